"""Draft pools shaped like SGLang's EAGLE-2 draft loop produces them.

``_select_top_k_tokens_first/_later`` (sglang/srt/speculative/spec_utils.py):
step 0 keeps the root's top-k children; each later step multiplies the k
survivors' cumulative scores by their children's top-k probabilities
(float32) and keeps the k best of the k^2 products as the next survivors.
The pool is every score ever produced, step-major; parent_list is
arange(-1, k) followed by each later step's survivor pool indices, the last
step's dropped (``organize_draft_results``).
"""

from __future__ import annotations

import random

import torch

FLAVORS = ("random", "ties", "onehot", "underflow", "mixed")


def child_probs(rng: random.Random, topk: int, flavor: str) -> list[float]:
    """Top-k probabilities of one softmax, descending."""
    if flavor == "mixed":
        flavor = rng.choice(FLAVORS[:-1])
    if flavor == "random":
        probs = [rng.random() for _ in range(topk)]
        total = sum(probs) or 1.0
        probs = [p / total for p in probs]
    elif flavor == "ties":
        probs = [rng.choice([1.0, 0.5, 0.25, 0.0]) for _ in range(topk)]
    elif flavor == "onehot":
        probs = [1.0] + [0.0] * (topk - 1)
    else:  # underflow: products of these reach float32 subnormals and 0
        probs = [rng.choice([1e-20, 1e-25, 0.5, 1.0]) for _ in range(topk)]
    return sorted(probs, reverse=True)


def draft_pool(rng: random.Random, topk: int, num_steps: int, flavor: str) -> tuple[list[float], list[int]]:
    """(scores [P] as float32 values, parent_list [1 + (S-1)K] or [] for S == 1)."""
    scores = torch.tensor(child_probs(rng, topk, flavor), dtype=torch.float32)
    pool = [scores]
    survivors = scores
    parent_list = list(range(-1, topk))
    for step in range(1, num_steps):
        probs = torch.tensor([child_probs(rng, topk, flavor) for _ in range(topk)], dtype=torch.float32)
        expand = (survivors[:, None] * probs).flatten()
        pool.append(expand)
        order = torch.sort(expand, descending=True, stable=True).indices[:topk]
        survivors = expand[order]
        if step < num_steps - 1:
            parent_list += (order + topk * topk * (step - 1) + topk).tolist()
    if num_steps == 1:
        parent_list = []
    return torch.cat(pool).tolist(), parent_list


def random_batch(rng: random.Random, batch: int, topk: int, num_steps: int, flavor: str):
    """Stacked pools for a batch: (scores [B, P] float32, parent_list [B, W] int64)."""
    pools = [draft_pool(rng, topk, num_steps, flavor) for _ in range(batch)]
    scores = torch.tensor([p[0] for p in pools], dtype=torch.float32)
    width = 0 if num_steps == 1 else 1 + (num_steps - 1) * topk
    parents = torch.tensor([p[1] for p in pools], dtype=torch.int64).view(batch, width)
    return scores, parents
