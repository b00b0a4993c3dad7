"""Draft pools shaped like SGLang's EAGLE-2 draft loop produces them, for
tests and benchmarks (no model needed).

``_select_top_k_tokens_first/_later`` (sglang/srt/speculative/spec_utils.py):
step 0 keeps the root's top-k children; each later step multiplies the k
survivors' cumulative scores by their children's top-k probabilities (float32)
and keeps the k best of the k^2 products as the next survivors. The pool is
every score ever produced, step-major; parent_list is arange(-1, k) followed by
each later step's survivor pool indices, the last step's dropped
(``organize_draft_results``).
"""

from __future__ import annotations

import torch

FLAVORS = ("random", "ties", "onehot", "underflow", "mixed")
_TIE_VALUES = (1.0, 0.5, 0.25, 0.0)
_UNDERFLOW_VALUES = (1e-20, 1e-25, 0.5, 1.0)  # products reach float32 subnormals, then 0


def child_probs(rows: int, topk: int, flavor: str, generator: torch.Generator) -> torch.Tensor:
    """[rows, topk] float32 top-k probabilities of ``rows`` softmaxes, descending."""

    def pick(values):
        table = torch.tensor(values, dtype=torch.float32)
        return table[torch.randint(len(values), (rows, topk), generator=generator)]

    if flavor == "random":
        probs = torch.rand(rows, topk, generator=generator) + 1e-6
        probs = probs / probs.sum(dim=1, keepdim=True)
    elif flavor == "ties":
        probs = pick(_TIE_VALUES)
    elif flavor == "onehot":
        probs = torch.zeros(rows, topk)
        probs[:, 0] = 1.0
    elif flavor == "underflow":
        probs = pick(_UNDERFLOW_VALUES)
    elif flavor == "mixed":
        choices = torch.stack([child_probs(rows, topk, f, generator) for f in FLAVORS[:-1]])
        which = torch.randint(len(FLAVORS) - 1, (rows,), generator=generator)
        probs = choices[which, torch.arange(rows)]
    else:
        raise ValueError(f"unknown flavor {flavor!r}; expected one of {FLAVORS}")
    return torch.sort(probs, dim=1, descending=True).values


def synthetic_pool(batch: int, topk: int, num_steps: int, flavor: str = "random", seed: int = 0):
    """(scores [B, P] float32, parent_list [B, 1 + (S-1)K] int64, or [B, 0] for S == 1)."""
    generator = torch.Generator().manual_seed(seed)
    survivors = child_probs(batch, topk, flavor, generator)
    pool = [survivors]
    parents = [torch.arange(-1, topk).expand(batch, -1)]
    for step in range(1, num_steps):
        probs = child_probs(batch * topk, topk, flavor, generator).view(batch, topk, topk)
        expand = (survivors[:, :, None] * probs).flatten(1)
        pool.append(expand)
        order = torch.sort(expand, dim=1, descending=True, stable=True).indices[:, :topk]
        survivors = expand.gather(1, order)
        parents.append(order + topk * topk * (step - 1) + topk)
    if num_steps == 1:
        parent_list = torch.empty(batch, 0, dtype=torch.int64)
    else:
        parent_list = torch.cat(parents[:-1], dim=1).contiguous()
    return torch.cat(pool, dim=1), parent_list
