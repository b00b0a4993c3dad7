"""``build_block_tree``: DDTree's best-first tree over a block drafter's
per-position top-K distributions (arXiv 2604.12989), validated and dispatched
like the ops of ``api.py``.

The specification (order, tie rule, NaN / positive log-prob clamps) is
``block_tree_reference``; the Triton kernel (``block_tree_triton``, one
program per request) returns the same tensors bit for bit. Every output shape
is fixed by (R, L, K, N) and neither implementation reads a device value on
the host, so the op can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from .api import _check_tensor, resolve_impl
from .block_tree_reference import BlockTree
from .block_tree_reference import build_block_tree as _reference
from .modes import MAX_TREE_NODES
from .tree_shape import TreeShape, check_positive

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def block_tree_capacity(length: int, topk: int) -> int:
    """Non-root nodes of the full tree of depth L and branching K:
    sum_{d=1..L} K^d (capped just above MAX_TREE_NODES, so it stays small)."""
    total, level = 0, 1
    for _ in range(length):
        level *= topk
        total += level
        if total > MAX_TREE_NODES:
            return MAX_TREE_NODES + 1
    return total


def validate_block_tree_shape(length: int, topk: int, num_nodes: int) -> None:
    """Startup check of a block-tree configuration (block length L, top-K per
    position, node budget N); raises ValueError naming the bad value."""
    check_positive("block length L", length)
    check_positive("topk K", topk)
    check_positive("num_nodes", num_nodes)
    capacity = block_tree_capacity(length, topk)
    if num_nodes > capacity:
        raise ValueError(f"num_nodes={num_nodes} exceeds the {capacity} nodes a block of L={length} positions "
                         f"with top-K={topk} tokens each can form (sum of K^d for d = 1..L)")
    if num_nodes + 1 > MAX_TREE_NODES:
        raise ValueError(f"num_nodes={num_nodes} gives trees of {num_nodes + 1} nodes; at most {MAX_TREE_NODES} "
                         f"are supported (num_nodes <= {MAX_TREE_NODES - 1})")


class BlockTreeShape(TreeShape):
    """A DDTree shape over a block drafter: num_steps = L, the block's mask rows
    (the deepest a tree reaches), topk = K tokens per position, num_draft_tokens
    = T (the root and N = T - 1 drafts). One drafter forward gives every
    position's top-K, so a tree may hold any of the sum_{d=1..L} K^d rank
    sequences (``validate_block_tree_shape``), not only EAGLE's pool of K +
    (L - 1) K^2 candidates, which ``TreeShape`` checks: e.g. (3, 2, 12) is a
    block shape, not an EAGLE one. Equal to no ``TreeShape``."""

    def __post_init__(self):
        for name in ("num_steps", "topk", "num_draft_tokens"):
            check_positive(name, getattr(self, name))
        capacity = block_tree_capacity(self.num_steps, self.topk)
        if self.num_draft_tokens - 1 > capacity:  # said in the shape's own keys, not the op's L / K / N
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens} needs {self.num_draft_tokens - 1} draft nodes "
                             f"but a block of num_steps={self.num_steps} positions with topk={self.topk} tokens "
                             f"each forms at most {capacity} (the sum of topk^d for d = 1..num_steps)")
        validate_block_tree_shape(self.num_steps, self.topk, self.num_draft_tokens - 1)


def build_block_tree(
    position_logprobs_topk_values: torch.Tensor,
    topk_tokens: torch.Tensor,
    num_nodes: int,
    *,
    impl: str = "auto",
) -> BlockTree:
    """DDTree: the best-first tree of ``num_nodes`` drafts over a block.

    position_logprobs_topk_values: [R, L, K] float16/bfloat16/float32/float64
        (computed in float32): log-probs of each block position's top-K
        tokens, sorted descending (``log_softmax(...).topk(K)``). Position i
        (0-based) is the distribution of the token i + 1 places after the
        last committed one (DDTree's q_{i+1}).
    topk_tokens: [R, L, K] int64, the matching token ids.
    num_nodes:   N >= 1 draft nodes per tree (root excluded), at most
                 sum_{d=1..L} K^d and at most MAX_TREE_NODES - 1.
    impl:        "auto" (Triton on CUDA, the reference elsewhere), "torch",
                 "triton" (CUDA, or CPU under TRITON_INTERPRET=1).

    Returns ``BlockTree`` (tokens [R, N], parents / depths / ranks
    [R, N + 1] int64, scores [R, N + 1] float32), nodes in BFS order:

    * node 0 is the root (parent -1, depth 0, score 0, rank 0); the other N
      nodes are the N best of all rank sequences (r_1..r_d), d <= L, by path
      score sum_i logp[i - 1, r_i], descending; ties go to the shallower node,
      then to the child of the earlier-selected parent, then to the lower rank
      (best-first selection with that tie rule picks exactly these);
    * closed under ancestors: every node's parent is in the tree and precedes
      it (parents[:, n] < n); nodes are ordered by depth, then by the same
      order (score descending first);
    * a NaN log-prob counts as -inf (ranks last, tied with -inf) and one above
      0 as 0, so the tree stays closed whatever the values; rows need not be
      sorted (each step searches all K children of every node), but only
      sorted rows make rank 0 each position's most likely token.

    No host sync and no data-dependent shape: capturable in a CUDA graph. The
    result's tokens / parents are ``DraftTrees``' (``tree_drafting.block_trees``)
    and parents feed ``tree_from_parents`` for the verify mask.
    """
    values = position_logprobs_topk_values
    _check_tensor("position_logprobs_topk_values", values, 3, _FLOATS)
    _check_tensor("topk_tokens", topk_tokens, 3, (torch.int64,), values.device)
    if topk_tokens.shape != values.shape:
        raise ValueError(f"topk_tokens has shape {tuple(topk_tokens.shape)}, position_logprobs_topk_values has "
                         f"{tuple(values.shape)}: both must be [R, L, K]")
    batch, length, topk = values.shape
    if length < 1 or topk < 1:
        raise ValueError(f"position_logprobs_topk_values has shape {tuple(values.shape)}: the block length L and "
                         f"the top-K width K must be at least 1")
    validate_block_tree_shape(length, topk, num_nodes)
    which = resolve_impl("block_tree", impl, values.device)
    values = values.float().contiguous()
    topk_tokens = topk_tokens.contiguous()
    if batch == 0:
        return _empty(batch, num_nodes, values.device)
    if which == "triton":
        from . import block_tree_triton

        return block_tree_triton.build_block_tree(values, topk_tokens, num_nodes)
    return _reference(values, topk_tokens, num_nodes)


def _empty(batch: int, num_nodes: int, device: torch.device) -> BlockTree:
    def ints(width: int) -> torch.Tensor:
        return torch.empty(batch, width, dtype=torch.int64, device=device)

    n1 = num_nodes + 1
    return BlockTree(ints(num_nodes), ints(n1), ints(n1), torch.empty(batch, n1, device=device), ints(n1))
