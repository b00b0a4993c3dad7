"""Triton implementation of ``build_block_tree`` (one program per request).

The same best-first loop as ``block_tree_reference`` (the specification):
the (N + 1) x K candidate tile lives in registers, each of the N steps takes
its best valid entry by (score desc, depth asc, flat index asc), and the BFS
order is a counting sort by depth. Every float operation is the reference's
(one float32 add per node, compares), so the outputs are equal bit for bit.
Grid and constexprs are fixed by (R, L, K, N): CUDA-graph capturable, no host
read. Call it through ``spec_tree_kernels.build_block_tree``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_tree_reference import BlockTree
from .triton_launch import launch

_MAX_TILE = 1 << 20  # Triton's largest tensor


@triton.jit
def _clamped(x):
    """NaN -> -inf, above 0 -> 0 (``block_tree_reference.clamped_logprobs``)."""
    x = tl.where(x != x, float("-inf"), x)
    return tl.where(x > 0.0, 0.0, x)


@triton.jit
def _block_tree_kernel(
    logp_ptr,  # [R, L, K] float32
    tokens_ptr,  # [R, L, K] int64
    scratch_ptr,  # [R, BLOCK_N] int32: BFS position of each selection step
    tokens_out,  # [R, N] int64
    parents_out,  # [R, N + 1] int64
    depths_out,  # [R, N + 1] int64
    scores_out,  # [R, N + 1] float32
    ranks_out,  # [R, N + 1] int64
    L: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.arange(0, BLOCK_N)  # selection step (0 = the root)
    cols = tl.arange(0, BLOCK_K)  # rank
    flat = rows[:, None] * BLOCK_K + cols[None, :]
    col_ok = cols < K
    logp_row = logp_ptr + b * (L * K)
    sel_score = tl.zeros([BLOCK_N], tl.float32)
    sel_depth = tl.zeros([BLOCK_N], tl.int32)
    sel_parent = tl.full([BLOCK_N], -1, tl.int32)
    sel_rank = tl.zeros([BLOCK_N], tl.int32)
    x0 = _clamped(tl.load(logp_row + cols, mask=col_ok, other=float("-inf")))
    root = rows[:, None] == 0
    cand = tl.where(root, tl.zeros([BLOCK_N], tl.float32)[:, None] + x0[None, :], float("-inf"))
    valid = root & col_ok[None, :]
    for s in range(1, N + 1):
        child_depth = sel_depth[:, None] + 1
        best = tl.max(tl.max(tl.where(valid, cand, float("-inf")), 1), 0)
        tied = valid & (cand == best)
        shallowest = tl.min(tl.min(tl.where(tied, child_depth, L + 2), 1), 0)
        pick = tl.min(tl.min(tl.where(tied & (child_depth == shallowest), flat, BLOCK_N * BLOCK_K), 1), 0)
        parent = pick // BLOCK_K
        hit = flat == pick
        score = tl.max(tl.max(tl.where(hit, cand, float("-inf")), 1), 0)
        depth = tl.max(tl.where(rows == parent, sel_depth, 0), 0) + 1
        is_s = rows == s
        sel_score = tl.where(is_s, score, sel_score)
        sel_depth = tl.where(is_s, depth, sel_depth)
        sel_parent = tl.where(is_s, parent, sel_parent)
        sel_rank = tl.where(is_s, pick % BLOCK_K, sel_rank)
        x = _clamped(tl.load(logp_row + tl.minimum(depth, L - 1) * K + cols, mask=col_ok, other=float("-inf")))
        cand = tl.where(is_s[:, None], score + x[None, :], cand)
        valid = (valid & ~hit) | (is_s[:, None] & col_ok[None, :] & (depth < L))
    # BFS position: nodes of smaller depth, plus earlier steps of the same depth
    in_tree = rows <= N
    levels = tl.arange(0, BLOCK_L)
    at_level = ((sel_depth[:, None] == levels[None, :]) & in_tree[:, None]).to(tl.int32)  # [BLOCK_N, BLOCK_L]
    per_level = tl.sum(at_level, 0)
    before_level = tl.cumsum(per_level, 0) - per_level  # nodes above each level
    same_before = tl.cumsum(at_level, 0) - at_level  # earlier steps at the same level
    pos = tl.sum(tl.where(at_level != 0, before_level[None, :] + same_before, 0), 1)
    scratch = scratch_ptr + b * BLOCK_N
    tl.store(scratch + rows, pos)
    tl.debug_barrier()
    parent_pos = tl.load(scratch + tl.maximum(sel_parent, 0), mask=in_tree & (sel_parent >= 0), other=-1)
    out = b * (N + 1) + pos
    tl.store(parents_out + out, parent_pos.to(tl.int64), mask=in_tree)
    tl.store(depths_out + out, sel_depth.to(tl.int64), mask=in_tree)
    tl.store(scores_out + out, sel_score, mask=in_tree)
    tl.store(ranks_out + out, sel_rank.to(tl.int64), mask=in_tree)
    drafted = in_tree & (rows > 0)
    token = tl.load(tokens_ptr + b * (L * K) + (sel_depth - 1) * K + sel_rank, mask=drafted, other=0)
    tl.store(tokens_out + b * N + pos - 1, token, mask=drafted)


def build_block_tree(logp: torch.Tensor, topk_tokens: torch.Tensor, num_nodes: int) -> BlockTree:
    """logp [R, L, K] float32 and topk_tokens [R, L, K] int64, contiguous and
    validated (``block_tree.build_block_tree``); returns ``BlockTree``."""
    batch, length, topk = logp.shape
    n1 = num_nodes + 1
    block_n = max(16, triton.next_power_of_2(n1))
    block_k = max(2, triton.next_power_of_2(topk))
    block_l = max(2, triton.next_power_of_2(length + 1))
    if block_n * block_k > _MAX_TILE or block_n * block_l > _MAX_TILE:
        raise ValueError(f"num_nodes={num_nodes} with K={topk}, L={length} makes a candidate tile larger than "
                         f"Triton's {_MAX_TILE} elements; use impl='torch'")
    device = logp.device
    scratch = torch.empty(batch, block_n, dtype=torch.int32, device=device)
    tokens = torch.empty(batch, num_nodes, dtype=torch.int64, device=device)
    parents, depths, ranks = (torch.empty(batch, n1, dtype=torch.int64, device=device) for _ in range(3))
    scores = torch.empty(batch, n1, dtype=torch.float32, device=device)
    launch(_block_tree_kernel, (batch,), logp, topk_tokens, scratch, tokens, parents, depths, scores, ranks,
           L=length, K=topk, N=num_nodes, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_L=block_l)
    return BlockTree(tokens, parents, depths, scores, ranks)
