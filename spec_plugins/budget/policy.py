"""The budget's choice: which menu entry each engine step runs.

``BudgetPolicy`` reads a ``CostTable`` (costs.py) and ``AcceptanceStats``
(acceptance.py); the engine calls its ``step`` and ``record`` once per step.

The rule (``choose_shape``)
    For a batch of B requests, each entry's expected throughput is

        rate(shape, B) = B * tau(shape) / (t_V(T, B) + d(shape, B))
        rate(None,  B) = B / t_V(1, B)

    tau = expected tokens a request emits per step = 1 + sum_d P(accept depth
    d); t_V(T, B) = verify forward + sampling of B requests with T tokens each
    (T = 1 is the plain decode step); d = the draft's time for the step. This
    is the book's  tau(T) / (t_V(T, B)/t_T + S*c)  with the draft term
    measured instead of modelled. The entry with the highest rate wins, with
    hysteresis: the entry chosen last step (the incumbent) is kept unless the
    best entry's rate exceeds the incumbent's by more than a factor
    ``1 + hysteresis`` (default 3 %), so two entries within noise of each other
    do not alternate. Exact ties go to the earlier menu entry; ``parse_menu``
    puts ``None`` first, so a tie means no speculation.

    With ``verify_width=W`` (vLLM's Model Runner V2, whose scheduler gives
    every request the same draft slots whatever the runner drafts) every
    entry's verify term is t_V(W, B), no speculation's included: the
    entries then differ in d(shape, B) and tau only.

Beyond the rate (``BudgetPolicy``)
    * The baseline first: at a batch size where plain decode's t_V(1, B) has
      no online measurement, the policy runs no speculation (one step), so
      speculation is never chosen against a profiled, possibly wrong, baseline.
    * Exploration by optimism (``BudgetPolicy``, deterministic): the choice
      maximizes an *optimistic* rate. Cost: each entry's step time is divided
      by 1 - cost_bonus * noise / sqrt(1 + k), k = online measurements of its
      t_V(T, B) (cost_bonus 1; at most a halving), so a cost measured once, or
      only estimated, is re-measured until it is known to within the noise
      (measured in vLLM: one noisy step made the chain look 15 % slower than
      it was, and it never ran again at that batch size). Acceptance: tau
      raised to min(1 + D, tau + explore_bonus * D / sqrt(1 + n)) with n the
      shape's decayed evidence (explore_bonus 0.5), and no bonus once the
      decayed number of requests the estimate rests on (``requests``: own,
      and for chains a tree's paired ones) reaches ``explore_until`` (60), or
      0.7 of what a shape run on every step holds, B / (1 - decay * age) (77
      at B = 1; a shape alternating with another would never reach 60). An
      unmeasured shape is tried when even its optimistic rate could win; the
      bonus shrinks as requests are counted, stops once the shape is measured
      and returns as its counts age, so a shape that lost is re-tried rarely,
      and one that cannot win
      at this batch size (its cost alone exceeds the best's, even at full
      acceptance) never is. Why the cut-off: a running shape's decayed n
      saturates near 1 / (1 - decay) = 100 requests per batch slot, where the
      bonus would stay at 0.05 D forever, favouring deep shapes (D = 5: +0.25
      tau, about 15 %) beyond the hysteresis; measured in vLLM at batch 1,
      trees ran where the chain of 3 was 10 % faster. Chains share their counts,
      so every chain gets the bonus of the shortest chain's depth (with D
      each, the chain of 5 won most explorations on depth alone). A tree
      whose chain-paired requests (acceptance.py, "Paired chain evidence") reach
      ``explore_until`` gets no bonus, even after its decayed counts fade:
      what is left to learn about it is its gain over the chains, and the
      chains' counts follow the text. Then, on every
      ``explore_every``-th step (16), an entry not run for ``stale_after``
      (256) steps whose expected rate is within ``explore_floor`` (0.8) of
      the best runs once (``None`` included: its t_V refreshes).
    Simulated (tests/test_budget_policy.py, CPU-like costs, 500 steps): >=
    0.95x the best fixed shape at B = 1, 4, 8 and 16 over 32 seeds; at B = 1
    over prompts whose acceptance differs by up to 6x, >= 0.96x over 16 seeds
    with paired chain evidence (0.88x without); with a profile 20 % off per
    batch size and 15 % step noise, >= 0.93x at every B over 12 seeds (0.87x
    before the baseline rule and cost optimism).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

from spec_plugins.budget.acceptance import AcceptanceStats
from spec_plugins.budget.costs import CostTable, check_key, check_seconds
from spec_plugins.budget.menu import Shape, parse_menu, shape_label, verify_tokens


def expected_rates(menu: Sequence[Shape], costs: CostTable, acceptance: AcceptanceStats,
                   batch_size: int) -> list[float]:
    """Expected tokens per second of each menu entry at this batch size."""
    return [batch_size * acceptance.tau(s) / costs.step_time(s, batch_size) for s in menu]


def _pick(rates: Sequence[float], current: Optional[int], hysteresis: float) -> int:
    best = max(range(len(rates)), key=lambda i: (rates[i], -i))
    if current is not None and best != current and rates[best] <= rates[current] * (1.0 + hysteresis):
        return current
    return best


_NO_CURRENT = object()


def choose_shape(menu: Sequence[Shape], costs: CostTable, acceptance: AcceptanceStats, batch_size: int, *,
                 current=_NO_CURRENT, hysteresis: float = 0.0) -> Shape:
    """The menu entry with the highest expected tokens/s at ``batch_size``.

    current: the entry chosen last step (may be None = no speculation); it is
    kept unless the best entry's rate exceeds its rate by more than a factor
    1 + hysteresis. Ties go to the earlier menu entry.
    """
    menu = list(menu)
    rates = expected_rates(menu, costs, acceptance, batch_size)
    cur = None
    if current is not _NO_CURRENT:
        if current not in menu:
            raise ValueError(f"current shape {shape_label(current)} is not in the menu")
        cur = menu.index(current)
    return menu[_pick(rates, cur, hysteresis)]


class BudgetPolicy:
    """Cost table + acceptance stats + hysteresis + exploration, one call per step.

    menu: anything ``parse_menu`` accepts; ``None`` is always on it (the
    baseline the policy must not lose to). costs: a CostTable (default empty:
    the policy runs no speculation until a verify time is recorded, then
    estimates the rest from it). acceptance: default ``AcceptanceStats(menu)``.
    verify_width: None (each entry verifies its own T tokens per request: T = 1
    for no speculation) or the one T every entry's verify forward runs (vLLM's
    Model Runner V2 schedules the same draft slots whatever the shape: the
    entries then differ in draft cost and acceptance only, and their verify
    costs are all t_V(verify_width, B)).
    Knobs: hysteresis, explore_bonus, explore_until, explore_every,
    stale_after, explore_floor, cost_bonus (module docstring). ``explorations`` counts the steps whose
    entry was not the best by expected rate (optimism or a stale re-check);
    ``last_rates`` holds the expected tokens/s of each entry at the last step.
    """

    SATURATED = 0.7  # share of the decayed count a shape run on every step reaches

    def __init__(self, menu, costs: Optional[CostTable] = None, *, acceptance: Optional[AcceptanceStats] = None,
                 hysteresis: float = 0.03, explore_every: int = 16, explore_bonus: float = 0.5,
                 stale_after: int = 256, explore_floor: float = 0.8, explore_until: float = 60.0,
                 cost_bonus: float = 1.0, verify_width: Optional[int] = None):
        self.menu: tuple[Shape, ...] = parse_menu(menu if isinstance(menu, str) else list(menu))
        self.costs = costs if costs is not None else CostTable()
        self.acceptance = acceptance if acceptance is not None else AcceptanceStats(self.menu)
        missing = [shape_label(s) for s in self.menu if s is not None and s not in self.acceptance.shapes]
        if missing:
            raise ValueError(f"acceptance stats lack menu shapes {missing}")
        _check_knobs(hysteresis=hysteresis, explore_every=explore_every, explore_bonus=explore_bonus,
                     stale_after=stale_after, explore_floor=explore_floor, explore_until=explore_until,
                     cost_bonus=cost_bonus)
        self.hysteresis, self.explore_every = float(hysteresis), int(explore_every)
        self.explore_bonus, self.stale_after = float(explore_bonus), int(stale_after)
        self.explore_floor = float(explore_floor)
        self.explore_until = float(explore_until)
        self.cost_bonus = float(cost_bonus)
        self._index = {s: i for i, s in enumerate(self.menu)}
        self.verify_width = None if verify_width is None else check_key("verify_width", verify_width)
        self._entries = [(s, self.verify_width or verify_tokens(s), 0 if s is None else s.max_depth,
                          None if s is None else self.acceptance.shapes.index(s)) for s in self.menu]
        self._lift_depth = self._optimism_depths()
        self._t = 0
        self._incumbent: Optional[int] = None
        self._last_run = [0] * len(self.menu)
        self._counts = [0] * len(self.menu)
        self.explorations = 0
        self.last_rates: Optional[list[float]] = None

    def _optimism_depths(self) -> dict[int, int]:
        """The depth D of each shape's acceptance bonus, by its index in the
        acceptance stats. Chains share their counts, so their optimism is the
        same: that of the shortest chain's depth (else the deepest chain wins
        every exploration on depth alone)."""
        shortest_chain = min((s.max_depth for s in self.menu if s is not None and s.topk == 1), default=0)
        return {j: (min(D, shortest_chain) if s.topk == 1 else D) for s, T, D, j in self._entries if s is not None}

    @property
    def incumbent(self) -> Shape:
        """The shape the policy currently prefers (None before the first step, or no speculation)."""
        return None if self._incumbent is None else self.menu[self._incumbent]

    def rates(self, batch_size: int) -> dict[str, float]:
        """Expected tokens/s of every entry now ({label: rate}, for logs)."""
        return dict(zip(map(shape_label, self.menu), self._rates_now(batch_size)[0]))

    def _rates_now(self, B: int) -> tuple[list[float], list[float]]:
        """(expected, optimistic) tokens/s of every entry at batch size B."""
        taus, evidence = self.acceptance.snapshot()
        # a shape run on every step holds about B / (1 - decay * age) decayed requests
        # (77 at B = 1): "enough" must stay below that, or a busy shape never stops exploring
        acc = self.acceptance
        enough = min(self.explore_until, self.SATURATED * B / max(1e-9, 1.0 - acc.decay * acc.age))
        costs, bonus = self.costs, self.explore_bonus
        cost_doubt = self.cost_bonus * costs.noise
        rates, optimistic = [], []
        for s, T, D, j in self._entries:
            # optimism about the cost: a step time measured k times at this batch size is
            # known to within noise / sqrt(1 + k), one never measured to within the noise
            cheaper = 1.0 / (1.0 - min(0.5, cost_doubt / math.sqrt(1.0 + costs.observations(T, B))))
            if s is None:
                r = B / costs.verify_time(1, B)
                rates.append(r)
                optimistic.append(r * cheaper)
                continue
            tau = taus[j]
            r = B * tau / (costs.verify_time(T, B) + costs.draft_time(s, B))
            rates.append(r)
            n = evidence[j]
            measured = max(acc.requests(s), acc.paired(s))
            lift = bonus * self._lift_depth[j] / math.sqrt(1.0 + n) if measured < enough else 0.0
            optimistic.append(r * cheaper * min(1.0 + D, tau + lift) / tau)
        return rates, optimistic

    def step(self, batch_size: int) -> Shape:
        """This step's entry for ``batch_size`` decode requests (< 1: None, no state change)."""
        if batch_size < 1:
            return None
        self._t += 1
        t = self._t
        try:
            rates, optimistic = self._rates_now(batch_size)
        except LookupError:  # no verify time known yet: plain decode measures one
            choice = self._index[None]
            self._incumbent = choice
            self._last_run[choice] = t
            self._counts[choice] += 1
            return self.menu[choice]
        self.last_rates = rates
        self._incumbent = choice = _pick(optimistic, self._incumbent, self.hysteresis)
        if not self.costs.observed(self._entries[self._index[None]][1], batch_size):
            # the baseline's cost at a new batch size is measured, not trusted to the profile
            choice = self._index[None]
        elif self.explore_every and t % self.explore_every == 0:
            floor = self.explore_floor * rates[choice]
            stale = [i for i, r in enumerate(rates)
                     if i != choice and t - self._last_run[i] >= self.stale_after and r >= floor]
            if stale:
                choice = max(stale, key=lambda i: (rates[i], -i))
        if rates[choice] < max(rates):
            self.explorations += 1
        self._last_run[choice] = t
        self._counts[choice] += 1
        return self.menu[choice]

    def record(self, shape: Shape, batch_size: int, verify_seconds: float, draft_seconds: Optional[float] = 0.0,
               accepted_lengths: Iterable[int] = (), chain_lengths: Iterable[int] = (),
               chain_censored: Iterable[bool] = ()) -> None:
        """What the step that ran ``shape`` measured: its verify (forward +
        sampling) and draft times for ``batch_size`` requests (draft_seconds
        None: not a clean sample, the draft cost is not updated), each
        speculating request's accepted draft tokens, and on tree steps what a
        chain would have accepted (``AcceptanceStats.record``). Call once per
        step. Invalid input raises ValueError before anything is recorded."""
        if shape not in self._index:
            raise ValueError(f"shape {shape_label(shape)} is not in the menu")
        batch_size = check_key("batch_size", batch_size)
        verify_seconds = check_seconds("verify_seconds", verify_seconds)
        if draft_seconds is not None:
            draft_seconds = check_seconds("draft_seconds", draft_seconds, allow_zero=True)
        self.acceptance.record(shape, accepted_lengths, chain_lengths, chain_censored)
        self.costs.observe_verify(self._entries[self._index[shape]][1], batch_size, verify_seconds)
        if shape is not None and draft_seconds is not None:
            self.costs.observe_draft(shape, batch_size, draft_seconds)

    def counters(self) -> dict[str, int]:
        """Steps that ran each entry (explorations included), keyed by shape_label."""
        return {shape_label(s): n for s, n in zip(self.menu, self._counts)}


def _check_knobs(*, hysteresis, explore_every, explore_bonus, stale_after, explore_floor, explore_until,
                 cost_bonus) -> None:
    for name, v, ok in (("hysteresis", hysteresis, hysteresis >= 0), ("explore_every", explore_every,
                        explore_every >= 0), ("explore_bonus", explore_bonus, explore_bonus >= 0),
                        ("stale_after", stale_after, stale_after >= 1),
                        ("explore_floor", explore_floor, 0 <= explore_floor <= 1),
                        ("explore_until", explore_until, explore_until >= 0),
                        ("cost_bonus", cost_bonus, cost_bonus >= 0)):
        if not ok:
            raise ValueError(f"{name}={v!r} is out of range")
