"""The EAGLE draft head as a torch module (``EagleHead``) and its config (``HeadConfig``).

``EagleHead`` is one draft decoder layer in the exact parameter layout that
vLLM's ``llama_eagle.py`` (EAGLE-1) and ``llama_eagle3.py`` (EAGLE-3) and
SGLang's EAGLE/EAGLE3 loaders read, so ``save`` writes a checkpoint folder
(``config.json`` + ``model.safetensors``) that the engines load as
``speculative_config={"method": "eagle"|"eagle3", "model": folder}``:

EAGLE-1 (``kind="eagle1"``, architectures ``["LlamaForCausalLM"]``)
    ``fc.weight [H, 2H]`` over ``cat(embed(token), h)`` where h is the target's
    final post-norm hidden state; ``layers.0.*`` without ``input_layernorm``;
    output ``x + residual`` feeds both the target's (shared) LM head and the
    next draft step. No embed_tokens / lm_head in the file: both are shared
    from the target.
EAGLE-3 (``kind="eagle3"``, architectures ``["LlamaForCausalLMEagle3"]``)
    ``fc.weight [H, 3H]`` over the target's auxiliary hidden states (inputs of
    layers ``eagle_aux_hidden_state_layer_ids``); ``midlayer.*`` whose q/k/v
    read ``cat(input_layernorm(embed(token)), hidden_norm(h))`` (2H), residual
    h; ``norm``; ``lm_head [draft_vocab, H]``; ``d2t [draft_vocab]`` int64 with
    target id = draft id + d2t. The pre-norm output feeds the next draft step.

The shipped, trained checkpoints and ``load_head``: ``spec_plugins.heads``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from spec_tree_kernels.head_kinds import head_kind


@dataclass
class HeadConfig:
    kind: str  # "eagle1" | "eagle3"
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    vocab_size: int = 49152
    draft_vocab_size: int = 49152
    aux_layer_ids: list = field(default_factory=lambda: [2, 15, 27])
    bos_token_id: int = 1
    eos_token_id: int = 2

    @classmethod
    def from_target(cls, target_config, kind: str, **overrides) -> "HeadConfig":
        c = target_config
        rope = getattr(c, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))
        return cls(
            kind=kind, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
            rms_norm_eps=c.rms_norm_eps, rope_theta=float(theta),
            max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size,
            draft_vocab_size=c.vocab_size, bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id,
            **overrides,
        )

    def engine_config(self) -> dict:
        """config.json as vLLM / SGLang read it."""
        common = {
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": "bfloat16",
            "spec_plugins": {"kind": self.kind},
        }
        if self.kind == "eagle1":
            return {"architectures": ["LlamaForCausalLM"], **common}
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            **common,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.hidden_size,
            "eagle_config": {
                "eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                "use_aux_hidden_state": True,
            },
        }

    @classmethod
    def from_engine_config(cls, cfg: dict) -> "HeadConfig":
        return cls(
            kind=head_kind(cfg).value, hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
            num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            rms_norm_eps=cfg["rms_norm_eps"], rope_theta=cfg.get("rope_theta", 10000.0),
            max_position_embeddings=cfg["max_position_embeddings"], vocab_size=cfg["vocab_size"],
            draft_vocab_size=cfg.get("draft_vocab_size", cfg["vocab_size"]),
            aux_layer_ids=list((cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids", [2, 15, 27])),
            bos_token_id=cfg.get("bos_token_id", 1), eos_token_id=cfg.get("eos_token_id", 2),
        )


def write_checkpoint(folder: Path, cfg: dict, weights: dict, dtype: torch.dtype, extra: dict | None = None) -> Path:
    """An engine checkpoint folder: config.json (``cfg`` with torch_dtype and
    ``extra`` merged into its "spec_plugins" entry) and model.safetensors."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**cfg, "torch_dtype": str(dtype).replace("torch.", "")}
    if extra:
        cfg["spec_plugins"] = {**cfg["spec_plugins"], **extra}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama (neox-style, rotate-half) rotary embedding. x [..., N, H, D], positions [..., N]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[..., None] * inv  # [..., N, D/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[..., None, :].to(x.dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1)[..., None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, c: HeadConfig, in_features: int):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(in_features, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [..., N, in] -> q [..., N, Hq, D], k, v [..., N, Hkv, D] (RoPE applied)."""
        c = self.c
        q = self.q_proj(x).unflatten(-1, (c.num_attention_heads, c.head_dim))
        k = self.k_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        v = self.v_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        return rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta), v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """q [N, Hq, D], k/v [S, Hkv, D], additive bias [N, S] (0 / -inf) -> [N, Hq * D]."""
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,shd->hns", q, k) / math.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + bias
    p = scores.float().softmax(-1).to(v.dtype)
    return torch.einsum("hns,shd->nhd", p, v).flatten(1)


class MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        eagle3 = c.kind == "eagle3"
        if eagle3:
            self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c, 2 * c.hidden_size if eagle3 else c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


class EagleHead(nn.Module):
    """One EAGLE draft layer. The target's embedding (and for EAGLE-1 its LM
    head) are borrowed, not owned: pass them to ``attach_target``."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.c = c
        H = c.hidden_size
        if c.kind == "eagle3":
            self.fc = nn.Linear(len(c.aux_layer_ids) * H, H, bias=False)
            self.midlayer = DraftLayer(c)
            self.norm = RMSNorm(H, c.rms_norm_eps)
            self.lm_head = nn.Linear(H, c.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        elif c.kind == "eagle1":
            self.fc = nn.Linear(2 * H, H, bias=False)
            self.layers = nn.ModuleList([DraftLayer(c)])
        else:
            raise ValueError(f"kind must be eagle1 or eagle3, got {c.kind!r}")
        self._target = {}

    # -- target wiring -------------------------------------------------------
    def attach_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> "EagleHead":
        self._target = {"embed": embed_weight.detach(), "lm_head": lm_head_weight.detach()}
        return self

    @property
    def layer(self) -> DraftLayer:
        return self.midlayer if self.c.kind == "eagle3" else self.layers[0]

    def draft_to_target(self) -> torch.Tensor:
        """[draft_vocab] target token id of each draft logit."""
        if self.c.kind == "eagle1":
            return torch.arange(self.c.vocab_size, device=self.fc.weight.device)
        return torch.arange(self.c.draft_vocab_size, device=self.d2t.device) + self.d2t

    # -- the three pieces of a draft step -----------------------------------
    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Target features -> the draft's input hidden. EAGLE-3: fc over the
        concatenated aux states [..., n_aux, H]; EAGLE-1: the final hidden [..., H]."""
        if self.c.kind == "eagle3":
            return self.fc(target_hidden.flatten(-2).to(self.fc.weight.dtype))
        return target_hidden.to(self.fc.weight.dtype)

    def layer_input(self, token_ids: torch.Tensor, hidden: torch.Tensor):
        """(attention input, residual) for tokens [...] and hiddens [..., H]."""
        emb = F.embedding(token_ids, self._target["embed"]).to(hidden.dtype)
        if self.c.kind == "eagle3":
            lay = self.midlayer
            return torch.cat([lay.input_layernorm(emb), lay.hidden_norm(hidden)], -1), hidden
        x = self.fc(torch.cat([emb, hidden], -1))
        return x, x  # layer 0 has no input_layernorm

    def layer_hidden(self, attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The layer's output hidden (pre-norm; the next draft step's input)."""
        lay = self.layer
        h = lay.self_attn.o_proj(attn_out) + residual
        return lay.mlp(lay.post_attention_layernorm(h)) + h

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary. EAGLE-3: own norm + reduced lm_head;
        EAGLE-1: the target's LM head on the raw output (no norm, as in vLLM)."""
        if self.c.kind == "eagle3":
            return self.lm_head(self.norm(out))
        return F.linear(out, self._target["lm_head"].to(out.dtype))

    def layer_output(self, attn_out: torch.Tensor, residual: torch.Tensor):
        """(logits over the draft vocabulary, next hidden) from the attention output."""
        out = self.layer_hidden(attn_out, residual)
        return self.logits(out), out

    def step(self, token_ids, hidden, positions, past_k=None, past_v=None, bias=None):
        """A draft forward of N rows with a KV cache (rows see cache + themselves per ``bias``).

        token_ids [N], hidden [N, H], positions [N]; past_k/v [S, Hkv, D] or None;
        bias [N, S + N] additive float mask (None: causal over the N new rows,
        all of the cache). Returns (logits [N, V_draft], next hidden [N, H], k [N, Hkv, D], v).
        """
        x, residual = self.layer_input(token_ids, hidden)
        q, k, v = self.layer.self_attn.qkv(x, positions)
        keys = k if past_k is None else torch.cat([past_k, k], 0)
        vals = v if past_v is None else torch.cat([past_v, v], 0)
        if bias is None:
            n, s = q.shape[0], keys.shape[0]
            bias = torch.zeros(n, s, dtype=q.dtype, device=q.device)
            bias[:, s - n :] = torch.full((n, n), float("-inf"), device=q.device).triu(1)
        logits, nxt = self.layer_output(attend(q, keys, vals, bias), residual)
        return logits, nxt, k, v

    # -- checkpoints ----------------------------------------------------------
    def engine_state_dict(self, dtype=torch.bfloat16) -> dict:
        sd = {}
        for name, t in self.state_dict().items():
            if name == "d2t":
                sd[name] = t.to(torch.int64).contiguous()
            else:
                sd[name] = t.detach().to(dtype).contiguous()
        if self.c.kind == "eagle1":
            # SGLang's EAGLE-1 fc is nn.Linear(2H, H) WITH a bias (as in the original
            # EAGLE checkpoints): ship an explicit zero bias so it is not left at its
            # random init. vLLM's fc has no bias and its loader ignores unexpected
            # ".bias" weights.
            sd["fc.bias"] = torch.zeros(self.c.hidden_size, dtype=dtype)
        return sd

    def save(self, folder: Path, dtype=torch.bfloat16, extra_config: dict | None = None) -> None:
        write_checkpoint(folder, self.c.engine_config(), self.engine_state_dict(dtype), dtype, extra_config)

    @classmethod
    def load(cls, folder: Path, dtype=torch.float32) -> "EagleHead":
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg = json.loads((folder / "config.json").read_text())
        head = cls(HeadConfig.from_engine_config(cfg))
        sd = load_file(str(folder / "model.safetensors"))
        bias = sd.pop("fc.bias", None)
        if bias is not None and bool(bias.any()):
            raise ValueError(f"{folder}: fc.bias must be zero (vLLM's EAGLE fc has no bias)")
        missing, unexpected = head.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise ValueError(f"{folder}: missing {missing}, unexpected {unexpected}")
        return head.to(dtype)
