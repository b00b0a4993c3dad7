"""The adaptive budget's bookkeeping on vLLM's Model Runner V2
(``spec_plugins.vllm_ext.budget_v2``), without an engine: what each step
leaves, when it is learned from (only once V2's own output copy has landed,
never by waiting), and what is recorded. End to end on V2:
tests/model/test_vllm_tree_v2.py (the "budget" engine)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from spec_plugins.budget import parse_menu, shape_label
from spec_plugins.tree_drafting import TreeShape
from spec_plugins.vllm_ext.budget_v2 import MAX_PENDING, BudgetV2
from spec_plugins.vllm_ext.config import TreeSettings

MENU = parse_menu("none 3,1,4 5,4,8")
C3, T548 = TreeShape(3, 1, 4), TreeShape(5, 4, 8)


class Clock:
    """StepClock stand-in: marks are the times set by the test; ``pending`` marks not passed yet."""

    def __init__(self):
        self.now, self.pending = 0.0, set()

    def mark(self):
        return self.now

    def ready(self, mark):
        return mark not in self.pending

    def seconds(self, start, end):
        return end - start


class Output:
    """V2's AsyncOutput as far as the budget reads it."""

    def __init__(self, num_sampled, landed=True):
        self.num_sampled_tokens_np = np.asarray(num_sampled, dtype=np.int32)
        self.copy_event = SimpleNamespace(query=lambda: self.landed)
        self.landed = landed


def batch(n, ids="req"):
    return (SimpleNamespace(num_reqs=n, idx_mapping_np=np.arange(n, dtype=np.int32)),
            SimpleNamespace(num_scheduled_tokens={f"{ids}{i}": 1 for i in range(n)}))


def make():
    stats = SimpleNamespace(budget_steps={}, budget_learned={}, budget_learned_requests={},  # TreeStatsV2's
                            budget_learned_accepted={}, budget_lag={})
    clock = Clock()
    budget = BudgetV2(TreeSettings(shape=T548, menu=MENU), 16, clock, stats)
    return budget, clock, stats


def run_step(budget, clock, n, output, levels=0.01, step=0.1, decode_only=True, ids="req"):
    """One engine step of n requests: plan (all rows trees), choose, end. Returns the entry drafted."""
    input_batch, scheduler_output = batch(n, ids)
    budget.begin(scheduler_output)
    budget.plan(input_batch, np.arange(n), decode_only)
    clock.now += step - levels
    budget.levels_begin()
    shape = budget.choose(input_batch, True)
    clock.now += levels
    budget.levels_end()
    budget.end(output)
    return shape


def test_first_steps_measure_the_baseline_then_speculate():
    budget, clock, stats = make()
    assert run_step(budget, clock, 2, Output([1, 1]), decode_only=False) is None  # prompt step: nothing known
    assert run_step(budget, clock, 2, Output([1, 1])) is None  # nothing learned yet from a decode step
    shape = run_step(budget, clock, 2, Output([1, 1]))  # learned the "none" step: t_V(8, 2) is known
    assert shape is not None
    assert stats.budget_learned == {"none": 1} and stats.budget_learned_requests == {"none": 0}
    assert stats.budget_lag == {"1": 1}
    assert budget.policy.costs.observed(8, 2)
    assert stats.budget_steps == {"none": 2, shape_label(shape): 1}


def test_records_wait_for_v2s_copy_and_never_block():
    """A step whose output copy has not landed is not read: it waits (in order)
    until a later step finds it landed."""
    budget, clock, stats = make()
    slow = Output([1, 1], landed=False)
    run_step(budget, clock, 2, Output([1, 1]), decode_only=False)
    run_step(budget, clock, 2, slow)  # verifies "none"
    run_step(budget, clock, 2, Output([1, 1]))
    run_step(budget, clock, 2, Output([1, 1]))
    assert stats.budget_learned == {} and len(budget.pending) == 3
    slow.landed = True
    run_step(budget, clock, 2, Output([1, 1]))
    assert stats.budget_learned["none"] >= 1 and stats.budget_lag["3"] == 1
    for _ in range(MAX_PENDING + 2):  # copies that never land are dropped, not waited for
        run_step(budget, clock, 2, Output([1, 1], landed=False))
    assert len(budget.pending) == MAX_PENDING


def test_a_tree_step_records_its_acceptance_and_both_costs():
    """Step k drafts entry S; step k + 1 verifies it: recorded as S with verify
    = step k + 1 minus its own draft levels, draft = step k's levels (same batch),
    accepted = num_sampled - 1 of the rows whose tree had S."""
    budget, clock, _ = make()
    budget.policy.step = lambda B: C3  # the entry under test, every step
    recorded = []
    budget.policy.record = lambda *args: recorded.append(args)
    run_step(budget, clock, 3, Output([1, 1, 1]), decode_only=False, levels=0.02)
    run_step(budget, clock, 3, Output([4, 1, 2]), levels=0.03, step=0.2)
    run_step(budget, clock, 3, Output([1, 1, 1]))  # learns the step before
    assert len(recorded) == 1
    shape, B, verify, draft, accepted = recorded[0]
    assert (shape, B, accepted) == (C3, 3, [3, 0, 1])
    assert verify == pytest.approx(0.17) and draft == pytest.approx(0.02)
    run_step(budget, clock, 2, Output([1, 1]))  # a request left: its draft time was for 3 requests
    run_step(budget, clock, 2, Output([1, 1]))
    assert recorded[-1][1] == 2 and recorded[-1][3] is None


def test_accepting_a_padding_node_is_an_error():
    """A chain of 3 accepts at most 3 drafts: a 4th (a padding slot of the
    8-node layout) would mean the walk reached padding."""
    budget, clock, _ = make()
    budget.policy.step = lambda B: C3
    run_step(budget, clock, 1, Output([1]), decode_only=False)
    run_step(budget, clock, 1, Output([5]))
    with pytest.raises(ValueError, match="outside 0..3"):
        run_step(budget, clock, 1, Output([1]))


def test_warm_up_steps_teach_nothing():
    budget, clock, stats = make()
    for _ in range(3):
        assert run_step(budget, clock, 2, Output([1, 1]), ids="_warmup_") == T548  # the largest tree's kernels
    assert not budget.pending
    run_step(budget, clock, 2, Output([1, 1]), decode_only=False)  # the first real step: the prompts
    assert stats.budget_steps == {"none": 1} and stats.budget_learned == {} and len(budget.pending) == 1


def test_no_request_may_draft_no_speculation_uncounted():
    budget, clock, stats = make()
    input_batch, scheduler_output = batch(2)
    budget.begin(scheduler_output)
    assert budget.choose(input_batch, False) is None
    assert stats.budget_steps == {}
