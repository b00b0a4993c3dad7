"""Random inputs for the correctness checks, built on the CPU from seeds.

Draft trees and tokens with real acceptance come from the benchmark harness
(``spec_plugins.kernel_bench.tree_ops``: draft_tree, tokens_with_acceptance),
so the checks and the timings run on the same kind of input; here are the
rest: random trees, open selections, sampled-verify arguments, KV cache layouts.
"""

from __future__ import annotations

import torch

import spec_tree_kernels as K


def random_parents(g: torch.Generator, batch: int, nodes: int) -> torch.Tensor:
    """[batch, nodes] BFS-ordered random trees: node t's parent uniform in [0, t), the root's -1."""
    return torch.stack([torch.cat([torch.tensor([-1]), (torch.rand(nodes - 1, generator=g) * torch.arange(1, nodes)).long()])
                        for _ in range(batch)])


def open_selection(topk, num_steps, nodes, batch, gen) -> torch.Tensor:
    """[B, T-1] random ascending pool indices: mostly not a closed tree."""
    pool = K.pool_size(topk, num_steps)
    rows = [torch.randperm(pool, generator=gen)[: nodes - 1].sort().values for _ in range(batch)]
    return torch.stack(rows) if rows else torch.empty(0, nodes - 1, dtype=torch.int64)


def sampling_args(candidates, target, next_token, next_sibling, num_steps, gen, dtype, vocab):
    """verify_tree_sampling's arguments (CPU): each node's distribution
    (target_probs [B, T, vocab]) is peaked on ``target`` (drafts get
    accepted), cut to its top-k (k <= 64: exact zeros), one node in eight
    to its top token; U[0, 1) coins [B, T] and Exp(1) exponentials
    [B, vocab], in every seventh request a few of them 0 (inf and NaN in
    the race: the corner cases the reference defines)."""
    batch, nodes = candidates.shape
    logits = torch.randn(batch, nodes, vocab, generator=gen, dtype=torch.float64)
    logits.scatter_add_(2, target[..., None], torch.full((batch, nodes, 1), 4.0, dtype=torch.float64))
    probs = torch.softmax(logits, dim=-1)
    top = probs.topk(min(64, vocab), dim=-1).values
    kth = top.gather(-1, torch.randint(0, top.shape[-1], (batch, nodes, 1), generator=gen))
    one_hot = torch.rand(batch, nodes, 1, generator=gen) < 0.125
    kth = torch.where(one_hot, top[..., :1], kth)  # one-hot: only the top token (ties aside)
    probs = torch.where(probs >= kth, probs, 0.0)
    probs = (probs / probs.sum(dim=-1, keepdim=True)).to(dtype)
    coins = torch.rand(batch, nodes, generator=gen, dtype=dtype)
    exps = torch.empty(batch, vocab, dtype=dtype).exponential_(generator=gen)
    zero = (torch.rand(batch, vocab, generator=gen) < 0.002) & (torch.arange(batch)[:, None] % 7 == 3)
    exps[zero] = 0.0
    return candidates, next_token, next_sibling, probs, coins, exps, num_steps


def kv_layouts(reduced: bool):
    """(name, block_size, heads, head_dim, make(storage) -> views, storage shape)."""
    layouts = [
        ("flash_kv_halves", 16, 8, 128, lambda s: [s[0], s[1]], lambda nb, bs, h, d: (2, nb, bs, h, d)),
        ("sglang_token_pool", 1, 2, 64, lambda s: [s[0].unsqueeze(1), s[1].unsqueeze(1)], lambda nb, bs, h, d: (2, nb, h, d)),
        ("cpu_permuted", 16, 2, 64, lambda s: [s[0].permute(0, 2, 1, 3)], lambda nb, bs, h, d: (1, nb, h, bs, d)),
        ("strided_head_dim", 16, 4, 8, lambda s: [s[0].transpose(2, 3)], lambda nb, bs, h, d: (1, nb, bs, d, h)),
        ("odd_row_bytes", 4, 3, 5, lambda s: [s[0], s[1]], lambda nb, bs, h, d: (2, nb, bs, h, d)),
    ]
    if reduced:
        return [(n, min(bs, 4), min(h, 2), min(d, 8), f, shape) for n, bs, h, d, f, shape in layouts]
    return layouts
