"""Train the tiny MTP checkpoints' MTP layer (a repository tool, not runtime; TEST DATA ONLY).

    cd tests/model && PYTHONPATH=../.. nice -n 19 python train_tiny_mtp.py [mimo glm4_moe qwen3_next nemotron_h]

For each family of ``tiny_mtp_checkpoints``: build the seed-0 target with its
random MTP layer, let the frozen trunk (2 decoder layers) write greedy
continuations of random prompts, then train ONLY the MTP layer (its norms,
input projection and decoder block; GLM-4-MoE's ``shared_head.head`` stays the
copy of the target's LM head) to predict token t+2 from the target's hidden
state at t and the embedding of token t+1, computed as vLLM's MTP forward
computes it (``mimo_mtp.py`` ``MiMoMultiTokenPredictorLayer.forward`` /
``glm4_moe_mtp.py`` ``Glm4MoeMultiTokenPredictorLayer.forward``):

* the hidden state fed is the target model's output as vLLM hands it over:
  MiMo's before the final norm, GLM-4-MoE's after it;
* row i sits at position i, its embedding (token i+1) zeroed at position 0,
  normed (``token_layernorm`` / ``enorm``), the hidden normed
  (``hidden_layernorm`` / ``hnorm``), ``input_proj(cat[hidden, emb])`` (MiMo)
  or ``eh_proj(cat[emb, hidden])`` (GLM), one causal decoder block, then
  MiMo's ``final_layernorm`` and the target's ``lm_head``, or GLM's
  ``shared_head.norm`` and ``shared_head.head``;
* depth 2 (vLLM's V1 chain reuses the one layer fed its own output): rows
  (the layer's depth-1 output at i, embedding of token i+2) at position i+1
  predict token i+3 (approximated as one causal pass over depth-2 rows;
  vLLM's depth-2 row attends to the depth-1 rows' KV).

The hybrid families (``qwen3_next``: ``qwen3_next_mtp.py``
``Qwen3NextMultiTokenPredictor.forward``; ``nemotron_h``: ``nemotron_h_mtp.py``
``NemotronHMTPAttentionDecoderLayer.forward``) are fed the target's output
after its final norm, the embedding NOT zeroed at position 0, and compute
``fc(cat[pre_fc_norm_embedding(emb), pre_fc_norm_hidden(hidden)])`` (Gemma-style
``1 + w`` norms), the decoder layer, ``mtp.norm`` (Qwen3-Next), or
``eh_proj(cat[enorm(emb), hnorm(hidden)])``, norm, attention (no rotary),
residual, ``final_layernorm`` (Nemotron-H); both then the target's
``lm_head``, and hand the normed output to the next depth.

Writes ``data/tiny_mtp_{arch}.safetensors`` (the MTP tensors under the
checkpoint's names, fp32, metadata ``trunk_sha256``: the trunk it was trained
on, which ``build_mtp_target`` checks).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny_checkpoints import VOCAB, _randomize  # noqa: E402
from tiny_mtp_checkpoints import (  # noqa: E402
    DATA, HYBRID_ARCHITECTURES, MTP_ARCHITECTURES, TARGET_LAYERS, _config, build_mtp_target, is_mtp_key,
    trained_mtp_file, trunk_digest)

SEED = 0
SEQ_LEN = 48  # prompt + greedy continuation (the tests' requests: 7 + 20, 23 + 16, 12 + 20 tokens)
PROMPT_SEEDS, RANDOM_PROMPTS, TEST_REPEATS = 48, 512, 16
# the hybrids' trunks run transformers' reference recurrences (no fla / mamba_ssm kernels on a CPU): a third
# of the data keeps their training to minutes
HYBRID_PROMPT_SEEDS, HYBRID_RANDOM_PROMPTS = 16, 128
STEPS, BATCH, LR = 800, 64, 2e-3


def causal_mask(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


class Tiny:
    """The 3-layer model tiny_mtp_checkpoints builds (layers 0-1: the trunk; layer 2: the MTP block)."""

    def __init__(self, arch: str, folder: Path):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.arch = arch
        torch.manual_seed(SEED)
        self.model = AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32,
                                                      attn_implementation="eager").eval()
        _randomize(self.model, SEED)
        self.model.requires_grad_(False)
        m = self.model.model
        self.block = m.layers[TARGET_LAYERS]
        self.layer_types = getattr(self.model.config, "layer_types", None)
        files = list(folder.glob("*.safetensors"))
        sd = load_file(str(files[0]))
        self.digest = trunk_digest(sd)
        own = self.model.state_dict()  # (GLM-4-MoE's experts are fused here, one tensor per expert on disk)
        for k, v in sd.items():  # the checkpoint's trunk is the model's (same recipe)
            if not is_mtp_key(k) and k in own:
                assert torch.equal(own[k], v), k
        self.prefix = {"mimo": "model.mtp_layers.0.", "qwen3_next": "mtp.",
                       "nemotron_h": "mtp.layers.0."}.get(arch, f"model.layers.{TARGET_LAYERS}.")
        # the decoder block's (Qwen3-Next's sits under mtp.layers.0, its own tensors beside it)
        block_keys = {"qwen3_next": ("layers",), "nemotron_h": ("norm", "mixer")}.get(
            arch, ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))
        # the MTP module's own tensors (norms, input projection), from the checkpoint's random MTP layer; the
        # block is the model's layer 2, the checkpoint's (same recipe)
        self.params = {k[len(self.prefix):]: torch.nn.Parameter(v.clone()) for k, v in sd.items()
                       if k.startswith(self.prefix) and not k.endswith("shared_head.head.weight")
                       and k[len(self.prefix):].split(".")[0] not in block_keys}
        self.block.requires_grad_(True)
        cfg = self.model.config
        self.eps = cfg.layer_norm_epsilon if arch == "nemotron_h" else cfg.rms_norm_eps

    def rms(self, x, w):
        if self.arch == "qwen3_next":  # Qwen3NextRMSNorm: Gemma-style, weights stored as w - 1
            w = 1.0 + w
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w

    def layer_mask(self, i: int, n: int):
        """The causal mask for layer i's attention; None for a recurrent layer (no padding: it needs none)."""
        if self.arch == "nemotron_h":
            return causal_mask(n) if self.model.config.layers_block_type[i] == "full_attention" else None
        if self.layer_types is not None and self.layer_types[i] == "linear_attention":
            return None
        return causal_mask(n)

    def trunk_hybrid(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.model.model
        pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
        if self.arch == "nemotron_h":
            x = m.embeddings(ids)
            for i, layer in enumerate(m.layers[:TARGET_LAYERS]):
                x = layer(x, attention_mask=self.layer_mask(i, ids.shape[1]))
                x = x[0] if isinstance(x, tuple) else x
            normed = m.norm_f(x)
        else:
            x = m.embed_tokens(ids)
            pe = m.rotary_emb(x, pos)
            for i, layer in enumerate(m.layers[:TARGET_LAYERS]):
                x = layer(x, attention_mask=self.layer_mask(i, ids.shape[1]), position_ids=pos, position_embeddings=pe)
                x = x[0] if isinstance(x, tuple) else x
            normed = m.norm(x)
        return self.model.lm_head(normed), normed

    def mtp_hybrid(self, hidden: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor):
        P, m = self.params, self.model.model
        n = ids.shape[1]
        if self.arch == "nemotron_h":
            e, h = self.rms(m.embeddings(ids), P["enorm.weight"]), self.rms(hidden, P["hnorm.weight"])
            x = self.block(torch.cat([e, h], -1) @ P["eh_proj.weight"].T, attention_mask=causal_mask(n))
            x = self.rms(x[0] if isinstance(x, tuple) else x, P["final_layernorm.weight"])
        else:
            e = self.rms(m.embed_tokens(ids), P["pre_fc_norm_embedding.weight"])
            h = self.rms(hidden, P["pre_fc_norm_hidden.weight"])
            x = torch.cat([e, h], -1) @ P["fc.weight"].T
            x = self.block(x, attention_mask=causal_mask(n), position_ids=pos, position_embeddings=m.rotary_emb(x, pos))
            x = self.rms(x[0] if isinstance(x, tuple) else x, P["norm.weight"])
        return self.model.lm_head(x), x

    def trunk(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, the hidden state vLLM feeds the MTP layer) for [B, L] ids."""
        if self.arch in HYBRID_ARCHITECTURES:
            return self.trunk_hybrid(ids)
        m = self.model.model
        pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
        x = m.embed_tokens(ids)
        pe = m.rotary_emb(x, pos)
        mask = causal_mask(ids.shape[1])
        for layer in m.layers[:TARGET_LAYERS]:
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=pe)
            x = x[0] if isinstance(x, tuple) else x
        normed = m.norm(x)
        return self.model.lm_head(normed), (x if self.arch == "mimo" else normed)

    def mtp(self, hidden: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits, output hidden) of the MTP layer: rows (hidden, embedding of ids) at positions pos."""
        if self.arch in HYBRID_ARCHITECTURES:
            return self.mtp_hybrid(hidden, ids, pos)
        P, m = self.params, self.model.model
        emb = torch.where(pos[..., None] == 0, 0.0, m.embed_tokens(ids))
        if self.arch == "mimo":
            e, h = self.rms(emb, P["token_layernorm.weight"]), self.rms(hidden, P["hidden_layernorm.weight"])
            x = torch.cat([h, e], -1) @ P["input_proj.weight"].T
        else:
            e, h = self.rms(emb, P["enorm.weight"]), self.rms(hidden, P["hnorm.weight"])
            x = torch.cat([e, h], -1) @ P["eh_proj.weight"].T
        x = self.block(x, attention_mask=causal_mask(ids.shape[1]), position_ids=pos,
                       position_embeddings=m.rotary_emb(x, pos))
        x = x[0] if isinstance(x, tuple) else x
        if self.arch == "mimo":
            x = self.rms(x, P["final_layernorm.weight"])
            return self.model.lm_head(x), x
        return self.model.lm_head(self.rms(x, P["shared_head.norm.weight"])), x

    @torch.no_grad()
    def greedy(self, prompts: torch.Tensor, n: int) -> torch.Tensor:
        ids = prompts
        for _ in range(n):
            logits, _ = self.trunk(ids)
            ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
        return ids

    def trainable(self) -> list:
        return list(self.params.values()) + list(self.block.parameters())

    def trained_tensors(self) -> dict:
        """The MTP tensors under the checkpoint's names (the block saved as save_pretrained writes it)."""
        from safetensors.torch import load_file

        with tempfile.TemporaryDirectory() as tmp:
            self.model.save_pretrained(tmp, safe_serialization=True)
            sd = load_file(str(next(Path(tmp).glob("*.safetensors"))))
        n = f"{'backbone' if self.arch == 'nemotron_h' else 'model'}.layers.{TARGET_LAYERS}."
        block = self.prefix + ("layers.0." if self.arch == "qwen3_next" else "")
        out = {block + k[len(n):]: v for k, v in sd.items() if k.startswith(n)}
        out.update({self.prefix + k: p.detach().clone() for k, p in self.params.items()})
        return {k: v.contiguous() for k, v in out.items()}


def training_sequences(tiny: Tiny, gen: torch.Generator) -> torch.Tensor:
    """The target's greedy continuations (to SEQ_LEN tokens) of prompts built as the tests build theirs
    (``test_vllm_mtp_chain.prompt_ids``: every length 4-24, PROMPT_SEEDS seeds, the tests' own three
    prompts TEST_REPEATS times over, so the tests' requests are held in) and of random prompts."""
    from test_vllm_mtp_chain import PROMPTS, prompt_ids

    hybrid = tiny.arch in HYBRID_ARCHITECTURES
    seeds, randoms = (HYBRID_PROMPT_SEEDS, HYBRID_RANDOM_PROMPTS) if hybrid else (PROMPT_SEEDS, RANDOM_PROMPTS)
    groups: dict[int, list] = {}
    for n in range(4, 25):
        groups.setdefault(n, []).extend(prompt_ids(n, s) for s in range(seeds))
    for p in PROMPTS:
        groups[len(p)].extend([p] * TEST_REPEATS)
    rand = torch.randint(4, VOCAB, (randoms, 16), generator=gen)
    out = [tiny.greedy(rand, SEQ_LEN - 16)]
    for n, prompts in sorted(groups.items()):
        out.append(tiny.greedy(torch.tensor(prompts), SEQ_LEN - n))
    return torch.cat(out)


def train(arch: str) -> dict:
    from safetensors.torch import save_file

    t0 = time.time()
    torch.manual_seed(1234)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = Tiny(arch, build_mtp_target(arch, Path(tmp) / arch, SEED, mtp="random"))
    gen = torch.Generator().manual_seed(1)
    seqs = training_sequences(tiny, gen)
    print(f"{arch}: {len(seqs)} greedy sequences of {SEQ_LEN} tokens in {time.time() - t0:.0f} s", flush=True)
    num_seqs = len(seqs)
    with torch.no_grad():
        _, hidden = tiny.trunk(seqs)
    L = seqs.shape[1]
    pos1 = torch.arange(L - 2)[None]
    steps, batch = STEPS, BATCH
    opt = torch.optim.AdamW(tiny.trainable(), lr=LR, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for step in range(steps):
        idx = torch.randint(0, num_seqs, (batch,), generator=gen)
        s, h = seqs[idx], hidden[idx]
        # depth 1: row i (hidden at i, token i+1) at position i predicts token i+2
        logits1, out1 = tiny.mtp(h[:, :L - 2], s[:, 1:L - 1], pos1.expand(batch, -1))
        loss1 = torch.nn.functional.cross_entropy(logits1.reshape(-1, VOCAB), s[:, 2:].reshape(-1))
        # depth 2: row (depth-1 output at i, token i+2) at position i+1 predicts token i+3
        logits2, _ = tiny.mtp(out1[:, :L - 3], s[:, 2:L - 1], pos1[:, :L - 3].expand(batch, -1) + 1)
        loss2 = torch.nn.functional.cross_entropy(logits2.reshape(-1, VOCAB), s[:, 3:].reshape(-1))
        loss = loss1 + 0.5 * loss2
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            with torch.no_grad():
                acc1 = (logits1.argmax(-1) == s[:, 2:]).float().mean().item()
                acc2 = (logits2.argmax(-1) == s[:, 3:]).float().mean().item()
            print(f"{arch} step {step}: loss {loss1.item():.3f} / {loss2.item():.3f}, "
                  f"top-1 depth 1 {acc1:.3f}, depth 2 {acc2:.3f}", flush=True)
    DATA.mkdir(exist_ok=True)
    trained = tiny.trained_tensors()
    save_file(trained, str(trained_mtp_file(arch)), metadata={"trunk_sha256": tiny.digest})
    print(f"{arch}: wrote {trained_mtp_file(arch)} ({len(trained)} tensors) in {time.time() - t0:.0f} s", flush=True)
    return trained


if __name__ == "__main__":
    torch.set_num_threads(2)
    for a in sys.argv[1:] or MTP_ARCHITECTURES + HYBRID_ARCHITECTURES:
        train(a)
