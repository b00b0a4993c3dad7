"""A verified tree as the chain of its accepted path: the row order that does it.

Engines that run the head's extend over a step's rows in chain order (vLLM's
Model Runner V2: ``prepare_prefill_inputs`` shifts each request's tokens by
one and reads the hidden state at the last accepted row) can serve trees
unchanged once every tree's accepted nodes sit first in its rows, in path
order. ``path_order`` gives the gather that puts them there; the KV cache
rows move the same way (``spec_tree_kernels.move_accepted_kv``). Device ops
only, fixed shapes: no host read, capturable (tests/test_tree_drafting_graphs.py).
"""

from __future__ import annotations

import torch


def node_rows(q_starts: torch.Tensor, nodes: int) -> torch.Tensor:
    """[B, nodes] int64 query rows of every node of B trees whose rows start at q_starts [B]."""
    return q_starts[:, None] + torch.arange(nodes, device=q_starts.device)


def path_order(num_rows: int, q_starts: torch.Tensor, accept_index: torch.Tensor, nodes: int) -> torch.Tensor:
    """[num_rows] int64 ``source``: row r of the step in chain order is row
    ``source[r]`` now. For B trees of ``nodes`` nodes at rows q_starts [B] with
    accepted nodes accept_index [B, >= 1] (root first, -1 padded), the path's
    depth d comes from node accept_index[d]; every other row stays."""
    width = min(nodes, accept_index.shape[1])
    rows = node_rows(q_starts, width)
    path = accept_index[:, :width].to(torch.int64)
    source = torch.arange(num_rows, device=q_starts.device)
    return source.scatter(0, rows.flatten(), torch.where(path >= 0, q_starts[:, None] + path, rows).flatten())


def linear_positions(context_lens: torch.Tensor, nodes: int) -> torch.Tensor:
    """[B * nodes] positions of the trees' rows in chain order (context + row offset)."""
    return node_rows(context_lens, nodes).flatten()
