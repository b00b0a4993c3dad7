"""Test-side wrapper of the package's synthetic draft pools."""

from __future__ import annotations

import random

from spec_plugins.synthetic_trees import FLAVORS, synthetic_pool

__all__ = ["FLAVORS", "random_batch"]


def random_batch(rng: random.Random, batch: int, topk: int, num_steps: int, flavor: str):
    """(scores [B, P] float32, parent_list [B, W] int64) seeded from ``rng``."""
    return synthetic_pool(batch, topk, num_steps, flavor, seed=rng.randint(0, 2**31))
