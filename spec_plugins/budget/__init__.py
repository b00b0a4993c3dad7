"""Adaptive tree budget: pick each step's speculative shape (or none) from measured cost and acceptance.

What it decides
    Once per engine step, before drafting: which entry of a configured *menu*
    the whole batch runs. An entry is a ``TreeShape`` (num_steps, topk,
    num_draft_tokens = T) or ``None`` (no speculation: a plain decode step).
    One shape per step for every request, so the verify batch is always one
    forward pass with one T (per-request shapes are not attempted here).

Where
    ``menu.py``        the entries, their spelling ("none,3,1,4,5,4,8") and parser
    ``costs.py``       ``CostTable``: t_V(T, B) and d(shape, B), profiled, then measured
    ``acceptance.py``  ``AcceptanceStats``: decayed per-depth acceptance, tau per shape
    ``policy.py``      ``choose_shape`` (the rate rule) and ``BudgetPolicy`` (plus
                       hysteresis, the baseline first, exploration by optimism)

What it costs
    Plain Python, no torch/numpy, no per-request Python loop (accepted lengths
    are histogrammed by ``collections.Counter``). Per step one ``step`` (per
    menu entry: two cost look-ups, a few-point interpolation, a cached tau)
    and one ``record`` (two EMA updates, a decay of shapes x depths counts,
    the CUSUM); the tau refresh after a record is O(shapes x depth). Tens of
    microseconds for a 4-entry menu on a CPU core.

Per engine step::

    shape = policy.step(batch_size)             # TreeShape or None
    ... draft with shape (if any), verify, accept ...
    policy.record(shape, batch_size, verify_seconds, draft_seconds, accepted_lengths)

``accepted_lengths``: each speculating request's accepted draft tokens this
step (0..D; emitted tokens = length + 1). ``policy.counters()`` counts the
steps each entry ran, keyed by ``shape_label`` ("none", "5,4,8").
"""

from __future__ import annotations

from spec_plugins.budget.acceptance import AcceptanceStats
from spec_plugins.budget.costs import CostTable
from spec_plugins.budget.menu import (
    DEFAULT_MENU,
    MenuError,
    Shape,
    parse_budget_config,
    parse_menu,
    profile_plan,
    shape_label,
    verify_tokens,
)
from spec_plugins.budget.policy import BudgetPolicy, choose_shape, expected_rates
from spec_plugins.tree_drafting import TreeShape

__all__ = [
    "AcceptanceStats", "BudgetPolicy", "CostTable", "DEFAULT_MENU", "MenuError", "Shape", "TreeShape", "choose_shape",
    "expected_rates", "parse_budget_config", "parse_menu", "profile_plan", "shape_label", "verify_tokens",
]
