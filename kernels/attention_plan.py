"""Tree attention split into a per-step plan and a per-layer run (FlashInfer's
wrapper style), for engines that call attention once per layer per step.

``TreeAttentionPlan.create`` does the host work once per step: which cache
blocks the batch reads and the additive mask (prefix + ancestor-or-self tree
positions) over those positions. ``run`` is then a gather and two einsums per
layer, with no host sync and nothing rebuilt. This is the torch path (CPU, or
any device); on CUDA the Triton kernel of ``tree_attention`` is the fast one.

Shapes (B requests, T nodes incl. the root, Hq query / Hkv KV heads, D head dim)::

    block_table   [B, >= used] int32/int64 block ids (vLLM's block table rows)
    context_lens  [B] int64 committed prefix length; node i's K/V sit at
                  position context_len + i (the engine wrote them linearly)
    tree_mask     compact mask of ``mode`` for B trees of T nodes (see attention.py)
    q             [B, T, Hq, D];  k_cache / v_cache [num_blocks, block_size, Hkv, D] views
    returns       [B, T, Hq, D] in q's dtype

Positions a request does not own inside its used blocks, and the other
requests' extra blocks, are masked out by the bias; their values must be finite
(engines zero-fill their KV caches and write only model K/V there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention_reference import tree_mask_to_dense
from .modes import parse_mask_mode


@dataclass
class TreeAttentionPlan:
    """blocks [B, nb] int64 cache blocks read per request (nb * block_size
    positions S cover the longest context + T); bias [B, 1, 1, T, S] float32,
    0 where node t may attend position s, -inf elsewhere."""

    blocks: torch.Tensor
    bias: torch.Tensor

    @classmethod
    def create(cls, block_table: torch.Tensor, context_lens: torch.Tensor, tree_mask: torch.Tensor, mode,
               nodes: int, block_size: int, max_context_len: int) -> "TreeAttentionPlan":
        """``max_context_len``: a host int >= every context_lens entry (the
        caller knows it from its own bookkeeping: no device read here)."""
        mode = parse_mask_mode(mode)
        batch = context_lens.shape[0]
        used = -(-(max_context_len + nodes) // block_size)
        blocks = block_table[:, :used].long()
        positions = torch.arange(used * block_size, device=context_lens.device)
        ctx = context_lens.long()[:, None]
        node_of_pos = positions[None, :] - ctx  # [B, S]: tree node stored at each position, if any
        in_tree = (node_of_pos >= 0) & (node_of_pos < nodes)
        anc = tree_mask_to_dense(tree_mask, mode, batch, nodes)  # [B, T, T] ancestor-or-self
        tree_ok = anc.gather(2, node_of_pos.clamp(0, nodes - 1)[:, None, :].expand(batch, nodes, -1))
        allowed = (positions[None, :] < ctx)[:, None, :] | (tree_ok & in_tree[:, None, :])  # [B, T, S]
        bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
        bias.masked_fill_(~allowed, float("-inf"))
        return cls(blocks=blocks, bias=bias[:, None, None])

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        batch, nodes, hq, dim = q.shape
        hkv = k_cache.shape[2]
        k = k_cache[self.blocks].flatten(1, 2)  # [B, S, Hkv, D]
        v = v_cache[self.blocks].flatten(1, 2)
        qf = q.view(batch, nodes, hkv, hq // hkv, dim)
        scores = torch.einsum("bthgd,bshd->bhgts", qf.float(), k.float()).mul_(scale).add_(self.bias)
        probs = torch.softmax(scores, dim=-1)
        out = torch.einsum("bhgts,bshd->bthgd", probs, v.float())
        return out.reshape(batch, nodes, hq, dim).to(q.dtype)
