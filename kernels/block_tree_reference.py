"""Torch reference of ``build_block_tree``: the executable specification.

DDTree (arXiv 2604.12989) over a block drafter: one drafter forward gives L
independent per-position distributions q_1..q_L; position i's top-K tokens
come as log-probs ``logp [R, L, K]`` (sorted descending) and ids. A node at
depth d is a rank sequence (r_1..r_d), token ``topk_tokens[:, i - 1, r_i]``
at depth i, with path score sum_{i<=d} logp[i - 1, r_i]. The tree is grown
best-first from the root: N times, the best frontier candidate (a child of
an already selected node, one level deeper, any of the K ranks) joins it.

Ranking key of a candidate (the *tie rule*): score descending, then depth
ascending, then the parent's selection step ascending, then the rank
ascending. Each step is an exhaustive search over the (N + 1) x K candidate
tile (O(N K) per step, a fixed trip count of N), so the result is defined for
any input, sorted or not. Two clamps keep the tree closed under ancestors
whatever the values: a NaN log-prob counts as -inf, and a log-prob above 0
counts as 0 (a child never scores above its parent; honest log-probs are
unchanged). Then the selection is the N best nodes of all prefix-closed
candidates in the order (score desc, depth asc, parent's order, rank asc), and
a parent always precedes its children.

Everything is device ops over fixed shapes: no host read, CUDA-graph safe.
Arguments are assumed validated by ``spec_tree_kernels.block_tree``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class BlockTree(NamedTuple):
    """R best-first block trees of N + 1 nodes (node 0 the root), BFS order:
    by depth, and within a depth by the tie rule's order (score descending
    first), so parents precede their children.

    tokens:  [R, N] int64, token ids of nodes 1..N (``DraftTrees.tokens``).
    parents: [R, N + 1] int64 node-local parent, -1 for the root.
    depths:  [R, N + 1] int64, 0 for the root; node n sits at block position
             depths[n] - 1 (its token is drawn from q_{depth}).
    scores:  [R, N + 1] float32 path log-prob (clamped as above), 0 for the root.
    ranks:   [R, N + 1] int64, the node's rank within its position's top-K
             (0 = the position's most likely token; the root: 0).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    scores: torch.Tensor
    ranks: torch.Tensor


def clamped_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """float32 log-probs with NaN -> -inf and values above 0 -> 0."""
    logp = logp.float()
    logp = torch.where(torch.isnan(logp), torch.full_like(logp, float("-inf")), logp)
    return torch.clamp(logp, max=0.0)


def bfs_order(sel_depth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(perm, inv) [R, N + 1] int64: perm[:, p] = the selection step of BFS
    node p (by depth, then selection step), inv its inverse."""
    batch, width = sel_depth.shape
    step = torch.arange(width, device=sel_depth.device)
    perm = torch.argsort(sel_depth * width + step, dim=1)  # keys are distinct
    inv = torch.empty_like(perm).scatter_(1, perm, step.expand(batch, width).contiguous())
    return perm, inv


def build_block_tree(logp: torch.Tensor, topk_tokens: torch.Tensor, num_nodes: int) -> BlockTree:
    """logp [R, L, K] float (any float dtype; computed in float32),
    topk_tokens [R, L, K] int64, 1 <= num_nodes <= sum_{d=1..L} K^d.
    Returns ``BlockTree`` (see the module doc for the order)."""
    batch, length, topk = logp.shape
    n1 = num_nodes + 1
    device = logp.device
    x = clamped_logprobs(logp)
    rows = torch.arange(batch, device=device)
    neg_inf = torch.full((), float("-inf"), device=device)  # fills, not host copies: capturable
    big = torch.full((), n1 + length + 1, dtype=torch.int64, device=device)
    # per selection step s (0 = the root): score, depth, parent step, rank
    sel_score = torch.zeros(batch, n1, dtype=torch.float32, device=device)
    sel_depth = torch.zeros(batch, n1, dtype=torch.int64, device=device)
    sel_parent = torch.full((batch, n1), -1, dtype=torch.int64, device=device)
    sel_rank = torch.zeros(batch, n1, dtype=torch.int64, device=device)
    # candidate tile: child of step j with rank k, flat index j * K + k
    cand = torch.full((batch, n1, topk), float("-inf"), dtype=torch.float32, device=device)
    valid = torch.zeros(batch, n1, topk, dtype=torch.bool, device=device)
    cand[:, 0] = sel_score[:, :1] + x[:, 0]
    valid[:, 0] = True
    for s in range(1, n1):
        flat_score, flat_valid = cand.view(batch, -1), valid.view(batch, -1)
        child_depth = (sel_depth + 1).repeat_interleave(topk, dim=1)
        best = torch.where(flat_valid, flat_score, neg_inf).max(dim=1).values
        tied = flat_valid & (flat_score == best[:, None])
        shallowest = torch.where(tied, child_depth, big).min(dim=1).values
        pick = (tied & (child_depth == shallowest[:, None])).to(torch.int8).argmax(dim=1)  # first: lowest j, k
        parent, rank = pick // topk, pick % topk
        score = flat_score.gather(1, pick[:, None])[:, 0]
        depth = sel_depth.gather(1, parent[:, None])[:, 0] + 1
        sel_score[:, s], sel_depth[:, s], sel_parent[:, s], sel_rank[:, s] = score, depth, parent, rank
        valid.view(batch, -1)[rows, pick] = False
        has_children = depth < length
        cand[:, s] = score[:, None] + x[rows, depth.clamp(max=length - 1)]
        valid[:, s] = has_children[:, None]
    perm, inv = bfs_order(sel_depth)
    depths = sel_depth.gather(1, perm)
    ranks = sel_rank.gather(1, perm)
    parent_step = sel_parent.gather(1, perm)
    parents = torch.where(parent_step >= 0, inv.gather(1, parent_step.clamp(min=0)), parent_step)
    flat_tokens = topk_tokens.reshape(batch, length * topk)
    tokens = flat_tokens.gather(1, ((depths[:, 1:] - 1) * topk + ranks[:, 1:]))
    return BlockTree(tokens, parents, depths, sel_score.gather(1, perm), ranks)
