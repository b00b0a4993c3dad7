"""The DFlash block drafter as a torch module (``DFlashDrafter``) and its config.

DFlash (arXiv 2602.06036) drafts a whole block in one forward: the queries are
the last committed token (the "bonus", at position p) followed by K mask
tokens at positions p+1..p+K; they attend, without a causal mask, to each
other and to the target's context features of every position < p. The output
at mask position p+i is the distribution of the token at p+i (DDTree's
q_i), read through the target's (shared) LM head.

The parameter layout is what vLLM's ``qwen3_dflash.py``
(``DFlashQwen3ForCausalLM``, architectures ``["DFlashDraftModel"]``) and the
public z-lab checkpoints use, so ``save`` writes a folder vLLM loads as
``speculative_config={"method": "dflash", "model": folder,
"num_speculative_tokens": K}``:

* ``fc.weight [H, n*H]`` over the concatenated target features of
  ``dflash_config.target_layer_ids`` (the OUTPUT of those target layers, which
  vLLM reads as the input of layer id + 1: ``get_eagle3_aux_layers_from_config``);
* ``hidden_norm`` over the fused context; every layer's k/v projections read
  that same normalized context (vLLM's ``precompute_and_store_context_kv``);
* ``layers.i.*``: Qwen3 decoder layers (q/k per-head RMSNorm, RoPE,
  non-causal attention), ``norm``;
* no embed_tokens / lm_head: both are shared from the target; the mask
  token's embedding is trained and shipped as ``mask_embedding.pt``, which
  vLLM substitutes for ``embed_tokens[mask_token_id]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from spec_plugins.heads.eagle_head import MLP, RMSNorm, rope, write_checkpoint

ARCHITECTURE = "DFlashDraftModel"
MASK_EMBEDDING_FILE = "mask_embedding.pt"


@dataclass
class DFlashConfig:
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    num_hidden_layers: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    max_position_embeddings: int = 8192
    vocab_size: int = 49152
    block_size: int = 8  # 1 bonus + block_size - 1 masks: vLLM's num_speculative_tokens = block_size - 1
    mask_token_id: int = 16
    target_layer_ids: list = field(default_factory=lambda: [1, 14, 26])  # outputs of these target layers
    num_target_layers: int = 30

    @property
    def num_masks(self) -> int:
        return self.block_size - 1

    @property
    def capture_layers(self) -> list:
        """The target layers whose INPUT is a context feature: the output of
        layer i is the input of layer i + 1 (vLLM's and SGLang's reading of
        ``target_layer_ids``)."""
        return [i + 1 for i in self.target_layer_ids]

    def engine_config(self) -> dict:
        """config.json as vLLM's DFlash loader reads it."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": self.num_hidden_layers,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "target_hidden_size": self.hidden_size,
            "torch_dtype": "float32",
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "spec_plugins": {"kind": "dflash"},
        }

    @classmethod
    def from_engine_config(cls, cfg: dict) -> "DFlashConfig":
        dflash = cfg.get("dflash_config") or {}
        kwargs = {k: cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                       "num_hidden_layers", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                                       "block_size", "num_target_layers") if k in cfg}
        kwargs["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kwargs["rope_theta"] = float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e6)))
        kwargs["mask_token_id"] = dflash["mask_token_id"]
        kwargs["target_layer_ids"] = list(dflash["target_layer_ids"])
        return cls(**kwargs)


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.c = c
        H, D = c.hidden_size, c.head_dim
        self.q_proj = nn.Linear(H, c.num_attention_heads * D, bias=False)
        self.k_proj = nn.Linear(H, c.num_key_value_heads * D, bias=False)
        self.v_proj = nn.Linear(H, c.num_key_value_heads * D, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * D, H, bias=False)
        self.q_norm = RMSNorm(D, c.rms_norm_eps)
        self.k_norm = RMSNorm(D, c.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor):
        """x [..., N, H] -> (k [..., N, Hkv, D] normed + RoPE'd, v [..., N, Hkv, D])."""
        c = self.c
        k = self.k_norm(self.k_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim)))
        v = self.v_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        return rope(k, positions, c.rope_theta), v

    def queries(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        c = self.c
        q = self.q_norm(self.q_proj(x).unflatten(-1, (c.num_attention_heads, c.head_dim)))
        return rope(q, positions, c.rope_theta)


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)


def masked_attention(q, k, v, visible: torch.Tensor) -> torch.Tensor:
    """q [B, N, Hq, D], k/v [B, S, Hkv, D], visible [B, N, S] bool -> [B, N, Hq * D]."""
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2).transpose(1, 2)
    v = v.repeat_interleave(groups, dim=2).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=visible[:, None])
    return out.transpose(1, 2).flatten(2)


class DFlashDrafter(nn.Module):
    """The block drafter. The target's embedding and LM head are borrowed
    (``attach_target``); ``mask_embedding`` is the drafter's own."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.c = c
        H = c.hidden_size
        self.fc = nn.Linear(len(c.target_layer_ids) * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, c.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(H, c.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.zeros(H))
        self._target = {}

    def attach_target(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor) -> "DFlashDrafter":
        self._target = {"embed": embed_weight.detach(), "lm_head": lm_head_weight.detach()}
        return self

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., S, n, H] (the layers of ``target_layer_ids``) ->
        the normalized context [..., S, H] every layer's k/v read."""
        return self.hidden_norm(self.fc(features.flatten(-2).to(self.fc.weight.dtype)))

    def embed_block(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [..., N] -> embeddings, the mask token's replaced by ``mask_embedding``."""
        emb = F.embedding(tokens, self._target["embed"]).to(self.mask_embedding.dtype)
        is_mask = (tokens == self.c.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embedding.expand_as(emb), emb)

    def forward(self, context: torch.Tensor, context_positions: torch.Tensor, block_tokens: torch.Tensor,
                block_positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The drafter's last hidden states (after ``norm``) for query rows.

        context [B, S, H] (``context``), context_positions [B, S];
        block_tokens / block_positions [B, N] (bonus and mask rows of any
        number of blocks); visible [B, N, S + N] bool: which context rows and
        which query rows each query row attends to. Returns [B, N, H].
        """
        hidden = self.embed_block(block_tokens)
        residual = hidden
        for i, layer in enumerate(self.layers):
            x = layer.input_layernorm(hidden if i == 0 else hidden + residual)
            if i:
                residual = hidden + residual
            attn = layer.self_attn
            k_ctx, v_ctx = attn.keys_values(context, context_positions)
            k_blk, v_blk = attn.keys_values(x, block_positions)
            q = attn.queries(x, block_positions)
            out = masked_attention(q, torch.cat([k_ctx, k_blk], 1), torch.cat([v_ctx, v_blk], 1), visible)
            h = attn.o_proj(out) + residual
            residual = h
            hidden = layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(hidden + residual)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self._target["lm_head"].to(hidden.dtype))

    def block_query(self, bonus: int, start: int, num_masks: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One request's query rows: the bonus token at position ``start`` (the
        committed length) then ``num_masks`` mask tokens (default block_size - 1)
        at start + 1..; (tokens, positions) [1, num_masks + 1] int64."""
        K = self.c.num_masks if num_masks is None else num_masks
        device = self.fc.weight.device
        tokens = torch.full((1, K + 1), self.c.mask_token_id, dtype=torch.long, device=device)
        tokens[0, 0] = bonus
        return tokens, torch.arange(start, start + K + 1, device=device)[None]

    @torch.no_grad()
    def block_hidden(self, features: torch.Tensor, bonus: int, num_masks: int | None = None) -> torch.Tensor:
        """The drafter's last hidden states [K + 1, H] of one request's block
        (``block_query``: row 0 the bonus, rows 1..K the masks): features
        [S, n, H] of positions 0..S-1, every row seeing all context and query rows."""
        S = features.shape[0]
        device = self.fc.weight.device
        tokens, positions = self.block_query(bonus, S, num_masks)
        visible = torch.ones(1, tokens.shape[1], S + tokens.shape[1], dtype=torch.bool, device=device)
        return self(self.context(features[None].to(device)), torch.arange(S, device=device)[None], tokens, positions,
                    visible)[0]

    @torch.no_grad()
    def draft_block(self, features: torch.Tensor, bonus: int, num_masks: int | None = None) -> torch.Tensor:
        """One request's block, as vLLM drafts it: features [S, n, H] of positions
        0..S-1, the bonus token at position S. Returns log-probs [K, V] of the
        tokens at positions S+1..S+K (K = ``num_masks``, default block_size - 1),
        float32 or wider: the mask rows' outputs (the bonus row's is unused)."""
        logits = self.logits(self.block_hidden(features, bonus, num_masks)[1:])
        return logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)

    # -- checkpoints ----------------------------------------------------------
    def save(self, folder: Path, dtype=torch.float32, extra: dict | None = None) -> None:
        weights = {k: t.detach().to(dtype).contiguous() for k, t in self.state_dict().items() if k != "mask_embedding"}
        folder = write_checkpoint(folder, self.c.engine_config(), weights, dtype, extra)
        torch.save({"mask_token_id": self.c.mask_token_id, "embedding": self.mask_embedding.detach().to(dtype).clone()},
                   folder / MASK_EMBEDDING_FILE)

    @classmethod
    def load(cls, folder: Path, dtype=torch.float32) -> "DFlashDrafter":
        from safetensors.torch import load_file

        folder = Path(folder)
        cfg = json.loads((folder / "config.json").read_text())
        drafter = cls(DFlashConfig.from_engine_config(cfg)).to(dtype)
        sd = load_file(str(folder / "model.safetensors"))
        mask = torch.load(folder / MASK_EMBEDDING_FILE, weights_only=True)
        if mask["mask_token_id"] != drafter.c.mask_token_id:
            raise ValueError(f"{folder}: {MASK_EMBEDDING_FILE} is for mask_token_id {mask['mask_token_id']}, "
                             f"config.json says {drafter.c.mask_token_id}")
        sd["mask_embedding"] = mask["embedding"]
        missing, unexpected = drafter.load_state_dict(sd, strict=False)
        if missing or unexpected:
            raise ValueError(f"{folder}: missing {missing}, unexpected {unexpected}")
        return drafter
