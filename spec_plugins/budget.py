"""Adaptive tree budget: pick each step's speculative shape (or none) from measured cost and acceptance.

What it decides
    Once per engine step, before drafting: which entry of a configured *menu*
    the whole batch runs. An entry is a ``TreeShape`` (num_steps, topk,
    num_draft_tokens = T) or ``None`` (no speculation: a plain decode step).
    One shape per step for every request, so the verify batch is always one
    forward pass with one T (per-request shapes are not attempted here).

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

From what: costs (``CostTable``, seconds)
    t_V(T, B) and d(shape, B), one value per key. Seeded by a startup profile
    (``profile_plan`` lists a small grid of keys to time; ``seed_verify`` /
    ``seed_draft``), measured online (``observe_verify`` / ``observe_draft``).
    A key's first online measurement replaces its seed or interpolated
    estimate (a profile times a synthetic forward on a machine still starting
    up: on vLLM-CPU two startups differed by 30 % at B = 16); each later one
    moves the value towards the measurement with weight max(ema_weight, 1/n)
    (n = online observations: a running mean at first, then an exponentially
    decayed average; default ema_weight 0.1). ``noise`` tracks the log spread
    of measurements around their key's value (decayed, starting at 0.2).
    Keys without a measurement or a seed:

    * t_V(T, B): if T has >= 2 measured batch sizes, piecewise linear in B
      through them (for a fixed T that is piecewise linear in the step's token
      count B*T, which is what a forward's cost follows). If T has one
      measured point (T, B0): the *pooled* curve scaled to it,
      g(B*T) * t_V(T, B0) / g(B0*T), where g is piecewise linear in tokens
      N = B*T through every measured (T, B) (points at the same N averaged).
      If T has none: g(B*T).
    * d(shape, B): the same with the shape's own batch sizes; the pooled curve
      is per draft forward (x = B*topk tokens per forward, y = d/num_steps,
      times num_steps). With no draft time known at all,
      num_steps * draft_fraction * t_V(1, B) (default fraction 0.1).
    * Extrapolation: flat below the smallest measured x (fewer tokens are not
      cheaper in the weight-bound regime, so this errs pessimistic); beyond
      the largest, the last segment's slope (never negative). A single point
      extends flat both ways. Profile the batch sizes you serve.
    Measured values win over seeds in every rule above.

From what: acceptance (``AcceptanceStats``)
    Per shape and depth d = 1..D (D = min(num_steps, T - 1), the deepest
    node), decayed counts att_d = requests whose accepted length reached
    d - 1 (depth d was on offer) and acc_d = those that reached d (depth d is
    accepted iff the accepted length >= d). All chains (topk = 1) share one
    set of counts: a chain of 3 drafts the first 3 tokens of the chain of 5,
    so its depth-d acceptance is the same event. The estimate is

        r_d = (acc_d + W * q_d) / (att_d + W),   tau = 1 + sum_d r_1 * ... * r_d

    (with W = 0, tau is exactly 1 + the decay-weighted mean accepted length),
    then floored at the observed rate acc_d / att_d (>= ``min_evidence`` = 4
    attempts) of every shape it contains (the chains are contained in every
    tree; a tree in a tree when its topk, num_steps and T are all <=): a
    larger tree offers the smaller one's candidates and more. The prior q_d
    (weight W = ``prior_weight``, default 2 requests) pools depth d of the
    other shapes: q_d = (P_acc + W * prior_rate) / (P_att + W), over the
    other shapes with the same topk when they hold >= min_evidence attempts
    there, else over all others; ``prior_rate`` (0.6) where nothing drafts
    that deep. A shape nobody has run therefore starts from what the others
    measured.

    Paired chain evidence: a verified greedy tree also tells what a chain of
    the same head would have accepted (its top-1 path; the runner computes it
    with ``tree_drafting.chain_counterfactual``). Those lengths count for the
    chains, so their estimate stays current while a tree runs, and are kept
    as the tree's *paired* counts. A tree's tau is then scaled by how much the
    chains' expected extra tokens moved since:
    tau = 1 + (tau_tree - 1) * E_chain(now) / E_chain(paired). Acceptance
    varies a lot from one prompt to the next; without the pairing, a tree
    measured on an easy prompt kept beating a chain measured on a hard one
    (vLLM, batch 1: the tree ran a third of the steps while the chain of 3
    measured 25 % faster).

How it adapts
    * Forgetting: each record multiplies every shape's counts by ``age``
      (0.997 per step, any entry run, ``None`` included) and the shape that ran
      by ``decay`` too (0.99 per own step): the running shape averages over
      its last ~75 steps; one not run fades back to its prior over ~300.
    * Change detection: a two-sided CUSUM of the running shape's accepted
      lengths against its prediction, standardized (slack 0.5, threshold 8
      standard deviations; only once the shape has >= 2 * min_evidence
      requests). An alarm (the draft or the prompt mix changed) multiplies
      every shape's counts by ``change_discount`` (0.02): all estimates
      restart from fresh data, which optimism then gathers quickly.
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
      at B = 1; a shape alternating with another would never reach 60). An unmeasured shape is tried when even
      its optimistic rate could win; the bonus shrinks as requests are
      counted, stops once the shape is measured and returns as its counts
      age, so a shape that lost is re-tried rarely, and one that cannot win
      at this batch size (its cost alone exceeds the best's, even at full
      acceptance) never is. Why the cut-off: a running shape's decayed n
      saturates near 1 / (1 - decay) = 100 requests per batch slot, where the
      bonus would stay at 0.05 D forever, favouring deep shapes (D = 5: +0.25
      tau, about 15 %) beyond the hysteresis; measured in vLLM at batch 1,
      trees ran where the chain of 3 was 10 % faster. Chains share their counts,
      so every chain gets the bonus of the shortest chain's depth (with D
      each, the chain of 5 won most explorations on depth alone). A tree
      whose chain-paired requests (see "Paired chain evidence") reach
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

import bisect
import math
import operator
import re
from collections import Counter
from typing import Iterable, Mapping, Optional, Sequence, Union

from spec_plugins.tree_drafting import TreeShape

Shape = Optional[TreeShape]
DEFAULT_MENU = "none,3,1,4,5,1,6,5,4,8"

__all__ = [
    "AcceptanceStats", "BudgetPolicy", "CostTable", "DEFAULT_MENU", "MenuError", "Shape", "choose_shape",
    "expected_rates", "parse_budget_config", "parse_menu", "profile_plan", "shape_label", "verify_tokens",
]


class MenuError(ValueError):
    """A budget menu or budget config that cannot be used; the message names the bad value."""


def shape_label(shape: Shape) -> str:
    """"none" or "num_steps,topk,num_draft_tokens" (the menu-spec spelling)."""
    return "none" if shape is None else f"{shape.num_steps},{shape.topk},{shape.num_draft_tokens}"


def verify_tokens(shape: Shape) -> int:
    """T of the verify forward: num_draft_tokens, or 1 for no speculation."""
    return 1 if shape is None else shape.num_draft_tokens


def _depth(shape: TreeShape) -> int:
    """Deepest tree node = most draft tokens one request can accept."""
    return min(shape.num_steps, shape.num_draft_tokens - 1)


# ----------------------------------------------------------------------- menu


def _make_shape(triple: Sequence, where: str) -> TreeShape:
    if len(triple) != 3:
        raise MenuError(f"{where}: {list(triple)!r} is not a (num_steps, topk, num_draft_tokens) triple")
    for name, v in zip(("num_steps", "topk", "num_draft_tokens"), triple):
        if isinstance(v, bool) or not isinstance(v, int):
            raise MenuError(f"{where}: {name}={v!r} is not an integer")
    try:
        shape = TreeShape(*triple)
    except ValueError as e:
        raise MenuError(f"{where} ({','.join(map(str, triple))}): {e}") from None
    if shape.topk == 1 and shape.num_draft_tokens != shape.num_steps + 1:
        raise MenuError(f"{where} ({shape_label(shape)}): topk=1 is a chain, num_draft_tokens must be "
                        f"num_steps + 1 = {shape.num_steps + 1}, got {shape.num_draft_tokens}")
    return shape


def _int_token(token: str, where: str) -> int:
    try:
        return int(token)
    except ValueError:
        raise MenuError(f"{where}: {token!r} is neither 'none' nor an integer") from None


def parse_menu(spec: Union[str, Iterable], *, include_none: bool = True) -> tuple[Shape, ...]:
    """The budget menu from a spec string or a list.

    String: 'none' and integers separated by commas, semicolons or blanks;
    consecutive integers group into (num_steps, topk, num_draft_tokens)
    triples: "none,3,1,4,5,1,6,5,4,8" = none, chain (3,1,4), chain (5,1,6),
    tree (5,4,8). List: items None / "none" / [s, k, t] / "s,k,t" / TreeShape.
    ``None`` (no speculation) is added when missing unless include_none=False
    and always comes first; the other entries keep their order (ties go to the
    earlier one). Raises MenuError naming the bad value: a non-integer, an
    incomplete triple, an invalid shape, a chain with T != num_steps + 1, a
    duplicate, or no speculative shape at all.
    """
    entries: list[Shape] = []
    if isinstance(spec, str):
        tokens = [t for t in re.split(r"[\s,;]+", spec.strip()) if t]
        pending: list[int] = []
        for i, token in enumerate(tokens, 1):
            where = f"menu {spec!r} item {i}"
            if token.lower() == "none":
                if pending:
                    raise MenuError(f"{where}: 'none' inside the triple started by {pending}")
                entries.append(None)
                continue
            pending.append(_int_token(token, where))
            if len(pending) == 3:
                entries.append(_make_shape(pending, f"menu {spec!r} entry {len(entries) + 1}"))
                pending = []
        if pending:
            raise MenuError(f"menu {spec!r}: trailing {pending} is not a (num_steps, topk, num_draft_tokens) "
                            f"triple (the menu needs 'none' or groups of 3 integers)")
    else:
        try:
            items = list(spec)
        except TypeError:
            raise MenuError(f"menu {spec!r}: expected a string or a list of shapes") from None
        for i, item in enumerate(items, 1):
            where = f"menu entry {i}"
            if item is None or (isinstance(item, str) and item.strip().lower() == "none"):
                entries.append(None)
            elif isinstance(item, TreeShape):
                entries.append(_make_shape([item.num_steps, item.topk, item.num_draft_tokens], where))
            elif isinstance(item, str):
                parts = [t for t in re.split(r"[\s,;]+", item.strip()) if t]
                entries.append(_make_shape([_int_token(p, where) for p in parts], where))
            elif isinstance(item, (list, tuple)):
                entries.append(_make_shape(list(item), where))
            else:
                raise MenuError(f"{where}: {item!r} is not None, 'none', a triple or a TreeShape")
    seen: set = set()
    for e in entries:
        if e in seen:
            raise MenuError(f"menu lists {shape_label(e)} twice")
        seen.add(e)
    shapes = [e for e in entries if e is not None]
    if not shapes:
        raise MenuError(f"menu {spec!r} has no speculative shape")
    return ((None,) if include_none or None in seen else ()) + tuple(shapes)


def parse_budget_config(raw: Mapping) -> Optional[tuple[Shape, ...]]:
    """The menu from a config dict, or None when the budget is off.

    Reads only the keys "budget" ("auto" | "off"; absent = "off") and "menu"
    (a spec string or a list of triples; absent = DEFAULT_MENU), e.g.
    ``{"budget": "auto", "menu": [[3, 1, 4], [5, 4, 8]]}``.
    """
    mode = raw.get("budget", "off")
    if mode is None or mode is False or (isinstance(mode, str) and mode.lower() == "off"):
        if raw.get("menu") is not None:
            raise MenuError(f"budget menu {raw['menu']!r} given but budget is {mode!r}: set budget='auto'")
        return None
    if not (isinstance(mode, str) and mode.lower() == "auto"):
        raise MenuError(f"budget={mode!r}: expected 'auto' or 'off'")
    return parse_menu(raw.get("menu", DEFAULT_MENU))


def profile_plan(menu: Iterable[Shape], batch_sizes: Iterable[int]) -> tuple[list, list]:
    """The startup grid to time: ([(T, B)] verify keys incl. T = 1, [(shape, B)] draft keys)."""
    menu = list(menu)
    Bs = sorted({int(b) for b in batch_sizes})
    Ts = sorted({verify_tokens(s) for s in menu} | {1})
    return [(T, B) for T in Ts for B in Bs], [(s, B) for s in menu if s is not None for B in Bs]


# ----------------------------------------------------------------------- costs


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs ascending, unique); flat below xs[0]; beyond
    xs[-1] the last segment's slope clamped at >= 0; one point: flat."""
    if x <= xs[0]:
        return ys[0]
    n = len(xs)
    if x >= xs[-1]:
        if n == 1:
            return ys[-1]
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + max(slope, 0.0) * (x - xs[-1])
    i = bisect.bisect_right(xs, x)
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0)


class _Curve:
    """Points of one T (or one draft shape): B -> [online value, online count, profile seed].

    online value: the running (then decayed) mean of the online observations,
    None until the first one; online count: how many there were (not capped);
    seed: the startup profile's value, or None."""

    __slots__ = ("xs", "pts")

    def __init__(self):
        self.xs: list[int] = []
        self.pts: dict[int, list] = {}

    def point(self, x: int) -> list:
        p = self.pts.get(x)
        if p is None:
            bisect.insort(self.xs, x)
            p = self.pts[x] = [None, 0, None]
        return p


def _value(p: list) -> Optional[float]:
    """A point's estimate: its online value, else its profile seed (None if neither)."""
    return p[0] if p[0] is not None else p[2]


def _check_key(name: str, v) -> int:
    try:
        i = -1 if isinstance(v, bool) else operator.index(v)
    except TypeError:
        i = -1
    if i < 1:
        raise ValueError(f"{name}={v!r} must be a positive integer")
    return i


def _check_seconds(name: str, v, allow_zero: bool = False) -> float:
    v = float(v)
    if not math.isfinite(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name}={v!r} must be a finite {'non-negative' if allow_zero else 'positive'} time")
    return v


def _as_shape(s) -> TreeShape:
    if isinstance(s, TreeShape):
        return s
    if isinstance(s, (tuple, list)) and len(s) == 3:
        return TreeShape(*s)
    raise ValueError(f"draft key {s!r} is not a TreeShape or (num_steps, topk, num_draft_tokens)")


class CostTable:
    """Step-time estimates: t_V(T, B) and d(shape, B), in seconds.

    verify: {(T, B): seconds} startup profile of verify forward + sampling
    (T = 1: plain decode). draft: {(shape or (s, k, t), B): seconds} of one
    step's drafting. ema_weight: the weight of an online observation once a
    key has 1/ema_weight observations. draft_fraction: draft cost per draft forward
    as a fraction of t_V(1, B) while no draft time is known. Estimation rules:
    see the module docstring.
    """

    INITIAL_NOISE = 0.2  # step-time spread assumed before two observations of one key are in
    NOISE_WEIGHT = 0.05

    def __init__(self, verify: Optional[Mapping] = None, draft: Optional[Mapping] = None, *,
                 ema_weight: float = 0.1, draft_fraction: float = 0.1):
        if not 0 < ema_weight <= 1:
            raise ValueError(f"ema_weight={ema_weight!r} must be in (0, 1]")
        if not draft_fraction >= 0:
            raise ValueError(f"draft_fraction={draft_fraction!r} must be >= 0")
        self.ema_weight = float(ema_weight)
        self.draft_fraction = float(draft_fraction)
        self._verify: dict[int, _Curve] = {}
        self._draft: dict[TreeShape, _Curve] = {}
        self._version = 0
        self._pooled: dict[str, tuple] = {}
        self._noise_sq = self.INITIAL_NOISE ** 2  # decayed mean squared log surprise of an observation
        for (T, B), s in (verify or {}).items():
            self.seed_verify(T, B, s)
        for (shape, B), s in (draft or {}).items():
            self.seed_draft(shape, B, s)

    @staticmethod
    def _curve(table: dict, key) -> _Curve:
        c = table.get(key)
        if c is None:
            c = table[key] = _Curve()
        return c

    def _observe(self, table: dict, key, B: int, seconds: float) -> None:
        self._version += 1
        p = self._curve(table, key).point(B)
        if p[0] is not None and p[0] > 0 and seconds > 0:
            surprise = math.log(seconds / p[0])
            self._noise_sq += self.NOISE_WEIGHT * (surprise * surprise - self._noise_sq)
        p[1] += 1
        # the first online observation replaces the estimate: a profile seed may be biased
        # (it times a synthetic forward, on a machine busy starting up) and interpolation more so
        p[0] = seconds if p[0] is None else p[0] + max(self.ema_weight, 1.0 / p[1]) * (seconds - p[0])

    def _seed(self, table: dict, key, B: int, seconds: float) -> None:
        self._version += 1
        self._curve(table, key).point(B)[2] = seconds

    def seed_verify(self, T: int, B: int, seconds: float) -> None:
        """The startup profile's t_V(T, B): used until that key is measured online."""
        self._seed(self._verify, _check_key("T", T), _check_key("B", B), _check_seconds("verify", seconds))

    def seed_draft(self, shape: TreeShape, B: int, seconds: float) -> None:
        """The startup profile's d(shape, B) (see ``seed_verify``)."""
        self._seed(self._draft, _as_shape(shape), _check_key("B", B), _check_seconds("draft", seconds, True))

    def observe_verify(self, T: int, B: int, seconds: float) -> None:
        """One measured verify (forward + sampling) of B requests x T tokens."""
        T, B = _check_key("T", T), _check_key("B", B)
        self._observe(self._verify, T, B, _check_seconds("verify_seconds", seconds))

    def observe_draft(self, shape: TreeShape, B: int, seconds: float) -> None:
        """One measured drafting step of B requests with this shape."""
        shape, B = _as_shape(shape), _check_key("B", B)
        self._observe(self._draft, shape, B, _check_seconds("draft_seconds", seconds, allow_zero=True))

    @property
    def noise(self) -> float:
        """Relative spread of one step's time around its key's estimate (a log standard deviation)."""
        return math.sqrt(self._noise_sq)

    def observations(self, T: int, B: int) -> int:
        """How many times t_V(T, B) was measured online (never capped or decayed)."""
        c = self._verify.get(T)
        p = None if c is None else c.pts.get(B)
        return 0 if p is None else p[1]

    def observed(self, T: int, B: int) -> bool:
        """Whether t_V(T, B) has been measured online (not only profiled or estimated)."""
        return self.observations(T, B) > 0

    @staticmethod
    def _x(kind: str, key, B: int) -> tuple[int, int]:
        """(tokens, divisor): verify x = B*T, y = t_V; draft x = B*topk, y = d/num_steps."""
        return (B * key, 1) if kind == "verify" else (B * key.topk, key.num_steps)

    def _pooled_curve(self, kind: str) -> Optional[tuple[list, list]]:
        """(xs, ys) over tokens of every point's estimate (``_x``), points at the same x
        averaged; cached until the table changes."""
        hit = self._pooled.get(kind)
        if hit is not None and hit[0] == self._version:
            return hit[1]
        acc: dict[int, list] = {}
        for key, c in (self._verify if kind == "verify" else self._draft).items():
            for B, p in c.pts.items():
                v = _value(p)
                if v is None:
                    continue
                x, per = self._x(kind, key, B)
                a = acc.setdefault(x, [0.0, 0])
                a[0] += v / per
                a[1] += 1
        xs = sorted(acc)
        out = (xs, [acc[x][0] / acc[x][1] for x in xs]) if xs else None
        self._pooled[kind] = (self._version, out)
        return out

    def _estimate(self, c: Optional[_Curve], key, B: int, kind: str) -> Optional[float]:
        known = []  # (B, value) of this key's points with an estimate
        if c is not None:
            hit = _value(c.pts[B]) if B in c.pts else None
            if hit is not None:
                return hit
            known = [(x, v) for x in c.xs if (v := _value(c.pts[x])) is not None]
            if len(known) >= 2:
                return _interp([x for x, _ in known], [v for _, v in known], B)
        pooled = self._pooled_curve(kind)
        if pooled is None:
            return None
        x, per = self._x(kind, key, B)
        g = per * _interp(*pooled, x)
        if known:
            B0, v0 = known[0]
            g0 = per * _interp(*pooled, self._x(kind, key, B0)[0])
            if g0 > 0:
                g *= v0 / g0
        return g

    def _verify_estimate(self, T: int, B: int) -> Optional[float]:
        return self._estimate(self._verify.get(T), T, B, "verify")

    def _draft_estimate(self, shape: TreeShape, B: int) -> Optional[float]:
        est = self._estimate(self._draft.get(shape), shape, B, "draft")
        if est is None:
            base = self._verify_estimate(1, B)
            est = None if base is None else shape.num_steps * self.draft_fraction * base
        return est

    def verify_time(self, T: int, B: int) -> float:
        """t_V(T, B) in seconds; LookupError when no verify time is known at all."""
        est = self._verify_estimate(T, B)
        if est is None:
            raise LookupError("the cost table has no verify time yet: profile or observe_verify first")
        return est

    def draft_time(self, shape: Shape, B: int) -> float:
        """d(shape, B) in seconds (0 for no speculation); LookupError when nothing is known."""
        if shape is None:
            return 0.0
        est = self._draft_estimate(shape, B)
        if est is None:
            raise LookupError("the cost table has no verify or draft time yet")
        return est

    def step_time(self, shape: Shape, B: int) -> float:
        return self.verify_time(verify_tokens(shape), B) + self.draft_time(shape, B)

    def measured(self) -> dict:
        """{"verify": {(T, B): s}, "draft": {(label, B): s}}: the current per-key values (for logs)."""
        return {"verify": {(T, B): _value(p) for T, c in self._verify.items() for B, p in c.pts.items()},
                "draft": {(shape_label(s), B): _value(p) for s, c in self._draft.items() for B, p in c.pts.items()}}


# ----------------------------------------------------------------- acceptance


class AcceptanceStats:
    """Decayed per-depth acceptance counts of the menu's shapes, and tau.

    Call ``record`` once per engine step, whichever entry ran (``None``
    included: the step still ages the counts). Knobs (module docstring):
    decay (per own step), age (per step), prior_rate / prior_weight /
    min_evidence (the prior and the containment floor), change_threshold /
    change_slack / change_discount (the CUSUM; threshold 0 turns it off).
    ``changes`` counts change alarms. Shapes are fixed at construction
    (``None`` ignored).
    """

    def __init__(self, shapes: Iterable[Shape], *, decay: float = 0.99, age: float = 0.997, prior_rate: float = 0.6,
                 prior_weight: float = 2.0, min_evidence: float = 4.0, change_threshold: float = 8.0,
                 change_slack: float = 0.5, change_discount: float = 0.02):
        for name, v in (("decay", decay), ("age", age), ("change_discount", change_discount)):
            if not 0 < v <= 1:
                raise ValueError(f"{name}={v!r} must be in (0, 1]")
        if not 0 <= prior_rate <= 1:
            raise ValueError(f"prior_rate={prior_rate!r} must be in [0, 1]")
        for name, v in (("prior_weight", prior_weight), ("min_evidence", min_evidence),
                        ("change_threshold", change_threshold), ("change_slack", change_slack)):
            if not v >= 0:
                raise ValueError(f"{name}={v!r} must be >= 0")
        self.decay, self.age, self.prior_rate = float(decay), float(age), float(prior_rate)
        self.prior_weight, self.min_evidence = float(prior_weight), float(min_evidence)
        self.change_threshold, self.change_slack = float(change_threshold), float(change_slack)
        self.change_discount = float(change_discount)
        self.changes = 0  # change alarms so far
        self._cusum = [0.0, 0.0]  # (upward, downward) CUSUM of standardized accepted-length surprises
        self.shapes: tuple[TreeShape, ...] = tuple(dict.fromkeys(s for s in shapes if s is not None))
        # count groups: one for all chains, one per tree
        keys: list = []
        self._group: dict[TreeShape, int] = {}
        for s in self.shapes:
            key = "chain" if s.topk == 1 else s
            if key not in keys:
                keys.append(key)
            self._group[s] = keys.index(key)
        n = len(keys)
        members = [[s for s in self.shapes if self._group[s] == g] for g in range(n)]
        self._gD = [max(_depth(s) for s in m) for m in members]
        self._topk = [m[0].topk for m in members]
        self._att = [[0.0] * D for D in self._gD]
        self._acc = [[0.0] * D for D in self._gD]
        self._others = [[j for j in range(n) if j != i] for i in range(n)]

        def contains(i: int, j: int) -> bool:  # group i's candidates include group j's
            if keys[i] == "chain":
                return False
            if keys[j] == "chain":
                return True
            a, b = keys[i], keys[j]
            return b.topk <= a.topk and b.num_steps <= a.num_steps and b.num_draft_tokens <= a.num_draft_tokens

        self._contained = [[j for j in self._others[i] if contains(i, j)] for i in range(n)]
        # Paired counts: what the chains would have accepted on each tree's own steps
        # (``chain_counterfactual``), decayed like that tree's counts (trees only, when
        # the menu has a chain).
        self._chain_g = keys.index("chain") if "chain" in keys else None
        Dc = self._gD[self._chain_g] if self._chain_g is not None else 0
        self._pair_att = [[0.0] * Dc if keys[i] != "chain" else [] for i in range(n)]
        self._pair_acc = [[0.0] * Dc if keys[i] != "chain" else [] for i in range(n)]
        self._paired_seen = [0] * n  # tree steps' requests ever paired with chain evidence (never decayed)
        # requests observed, own or (chains) a tree's paired ones, censored included; decayed
        # like the counts: how much the estimate rests on, for the exploration bonus
        self._requests = [0.0] * n
        self._index = {s: i for i, s in enumerate(self.shapes)}
        self._rates: Optional[list[list[float]]] = None
        self._snap: Optional[tuple[list[float], list[float]]] = None

    def _gi(self, shape: TreeShape) -> int:
        g = self._group.get(shape)
        if g is None:
            raise ValueError(f"shape {shape_label(shape)} is not in the menu {[shape_label(s) for s in self.shapes]}")
        return g

    def record(self, shape: Shape, accepted_lengths: Iterable[int] = (), chain_lengths: Iterable[int] = (),
               chain_censored: Iterable[bool] = ()) -> None:
        """One engine step: check for a change, age every count, decay the
        running shape's, then count this step's requests.

        accepted_lengths: each request's accepted draft tokens (0..D, D =
        min(num_steps, T - 1)); a list, or a CPU tensor/array (``.tolist()``).
        For ``shape=None`` only the ageing. Bad lengths raise ValueError and
        change nothing.

        chain_lengths / chain_censored (tree steps only, optional): for each
        greedy request of the tree, how many tokens a chain drafted by the same
        head would have accepted (its top-1 path; ``chain_counterfactual``), and
        whether that is only a lower bound (the chain's next token was not in
        the tree). They count as a step of the chains, and as the tree's paired
        chain evidence: when the chains run later on easier or harder text, the
        tree's tau is scaled by how the chains' acceptance moved since (see
        ``snapshot``), so a tree measured on other text is not compared as if
        it were measured on this text.
        """
        hist = self._histogram(shape, accepted_lengths, "accepted length")
        chain = self._chain_histograms(shape, chain_lengths, chain_censored)
        g = None if shape is None else self._gi(shape)
        if hist and self.change_threshold > 0 and self._att[g][0] >= 2 * self.min_evidence:
            self._detect_change(shape, hist)
        if self.age != 1.0:
            for rows in (self._att, self._acc, self._pair_att, self._pair_acc, (self._requests,)):
                _scale(rows, self.age)
        self._rates = self._snap = None
        if not hist:
            return
        self._add(self._att[g], self._acc[g], hist, {}, _depth(shape), self.decay)
        self._requests[g] = self._requests[g] * self.decay + sum(hist.values())
        if chain is not None:
            definite, censored = chain
            c = self._chain_g
            self._add(self._att[c], self._acc[c], definite, censored, self._gD[c], self.decay)
            self._add(self._pair_att[g], self._pair_acc[g], definite, censored, self._gD[c], self.decay)
            self._paired_seen[g] += sum(definite.values()) + sum(censored.values())
            self._requests[c] = self._requests[c] * self.decay + sum(definite.values()) + sum(censored.values())

    def _histogram(self, shape: Shape, lengths, what: str) -> dict[int, int]:
        """{length: requests}, every length checked to lie in 0..depth(shape)."""
        hist: dict[int, int] = {}
        if shape is None:
            return hist
        self._gi(shape)
        D = _depth(shape)
        if hasattr(lengths, "tolist"):
            lengths = lengths.tolist()
        for L, n in Counter(lengths).items():
            try:
                Li = -1 if isinstance(L, bool) else operator.index(L)
            except TypeError:
                Li = -1
            if not 0 <= Li <= D:
                raise ValueError(f"{what} {L!r} outside 0..{D} for shape {shape_label(shape)}")
            hist[Li] = hist.get(Li, 0) + n
        return hist

    def _chain_histograms(self, shape: Shape, lengths, censored) -> Optional[tuple[dict, dict]]:
        """(definite, censored) histograms of a tree step's counterfactual chain lengths, or None."""
        if hasattr(lengths, "tolist"):
            lengths = lengths.tolist()
        if hasattr(censored, "tolist"):
            censored = censored.tolist()
        lengths, censored = list(lengths), list(censored)
        if not lengths:
            return None
        if shape is None or shape.topk == 1:
            raise ValueError(f"chain_lengths given for {shape_label(shape)}: only tree steps have them")
        if censored and len(censored) != len(lengths):
            raise ValueError(f"chain_censored has {len(censored)} entries for {len(lengths)} chain_lengths")
        if self._chain_g is None:
            return None
        censored = censored or [False] * len(lengths)
        definite = self._histogram(shape, [L for L, c in zip(lengths, censored) if not c], "chain length")
        cut = self._histogram(shape, [L for L, c in zip(lengths, censored) if c], "chain length")
        return definite, cut

    @staticmethod
    def _add(att: list, acc: list, definite: dict, censored: dict, D: int, decay: float) -> None:
        """Decay one count row, then add requests by accepted length (depths
        beyond D ignored): depth d was attempted by those that reached d - 1,
        accepted by those that reached d. A censored length L reached L and
        says nothing about depth L + 1."""
        if decay != 1.0:
            _scale((att, acc), decay)
        for hist, cut in ((definite, 0), (censored, 1)):
            for L, n in hist.items():
                for d in range(min(L + 1 - cut, D)):
                    att[d] += n
                for d in range(min(L, D)):
                    acc[d] += n

    def _detect_change(self, shape: TreeShape, hist: dict[int, int]) -> None:
        """Two-sided CUSUM of this step's accepted lengths against the shape's
        prediction; on an alarm every shape's counts shrink by change_discount."""
        mean = second = 0.0
        prob = 1.0
        for d, r in enumerate(self.rates(shape), 1):
            prob *= r  # P(length >= d)
            mean += prob
            second += (2 * d - 1) * prob  # E[L^2] = sum_d (2d - 1) P(L >= d)
        n = sum(hist.values())
        var = max(second - mean * mean, 0.1)
        z = (sum(L * c for L, c in hist.items()) - n * mean) / math.sqrt(n * var)
        up = max(0.0, self._cusum[0] + z - self.change_slack)
        down = max(0.0, self._cusum[1] - z - self.change_slack)
        if up > self.change_threshold or down > self.change_threshold:
            for rows in (self._att, self._acc, self._pair_att, self._pair_acc, (self._requests,)):
                _scale(rows, self.change_discount)
            self.changes += 1
            up = down = 0.0
        self._cusum = [up, down]

    def paired(self, shape: Shape) -> int:
        """Requests of this tree ever paired with chain evidence (never decayed; 0 for chains and None)."""
        return 0 if shape is None else self._paired_seen[self._gi(shape)]

    def requests(self, shape: Shape) -> float:
        """Decayed number of requests this shape's estimate rests on (all chains
        together; for chains also a tree's paired requests, censored or not); inf for None."""
        return math.inf if shape is None else self._requests[self._gi(shape)]

    def evidence(self, shape: Shape) -> float:
        """Decayed number of requests observed with this shape (depth-1
        attempts; all chains together); inf for None."""
        return math.inf if shape is None else self._att[self._gi(shape)][0]

    def _refresh(self) -> None:
        W, rate0, need = self.prior_weight, self.prior_rate, self.min_evidence
        att, acc, gD, topk = self._att, self._acc, self._gD, self._topk
        Dmax = max(gD, default=0)
        # per-depth sums over all groups and over the groups of each topk
        tot_a, tot_c = [0.0] * Dmax, [0.0] * Dmax
        by_k: dict[int, tuple[list, list]] = {}
        for i, D in enumerate(gD):
            ka, kc = by_k.setdefault(topk[i], ([0.0] * Dmax, [0.0] * Dmax))
            for d in range(D):
                tot_a[d] += att[i][d]
                tot_c[d] += acc[i][d]
                ka[d] += att[i][d]
                kc[d] += acc[i][d]
        observed = [[acc[j][d] / att[j][d] if att[j][d] >= need else -1.0 for d in range(gD[j])]
                    for j in range(len(gD))]
        rates = []
        for i, D in enumerate(gD):
            ka, kc = by_k[topk[i]]
            ai, ci = att[i], acc[i]
            r_i = []
            for d in range(D):
                pa, pc = ka[d] - ai[d], kc[d] - ci[d]  # other groups with the same topk
                if pa < need:
                    pa, pc = tot_a[d] - ai[d], tot_c[d] - ci[d]  # all other groups
                q = (pc + W * rate0) / (pa + W) if pa + W > 0 else rate0
                r = (ci[d] + W * q) / (ai[d] + W) if ai[d] + W > 0 else q
                for j in self._contained[i]:
                    if d < gD[j] and observed[j][d] > r:
                        r = observed[j][d]
                r_i.append(r)
            rates.append(r_i)
        self._rates = rates

    def rates(self, shape: TreeShape) -> list[float]:
        """Estimated conditional acceptance rate of depths 1..D (prior included)."""
        if self._rates is None:
            self._refresh()
        return self._rates[self._gi(shape)][: _depth(shape)]

    def snapshot(self) -> tuple[list[float], list[float]]:
        """(tau, evidence) of every shape in ``self.shapes`` order; cached until the next record."""
        if self._snap is None:
            if self._rates is None:
                self._refresh()
            taus = []
            for s in self.shapes:
                g, D = self._group[s], _depth(s)
                excess = _excess(self._rates[g][:D])
                taus.append(1.0 + excess * self._chain_drift(g, D))
            self._snap = (taus, [self._att[self._group[s]][0] for s in self.shapes])
        return self._snap

    def _chain_drift(self, g: int, D: int) -> float:
        """How much more (> 1) or less the chains accept now than on tree group
        g's own steps: the ratio of their expected extra tokens (depths 1..D),
        now over paired. The paired rates shrink towards the current ones with
        the prior weight, so little paired evidence means a ratio near 1."""
        c = self._chain_g
        if c is None or g == c:
            return 1.0
        D = min(D, self._gD[c])
        now = self._rates[c][:D]
        W, att, acc = self.prior_weight, self._pair_att[g], self._pair_acc[g]
        paired = [(acc[d] + W * now[d]) / (att[d] + W) if att[d] + W > 0 else now[d] for d in range(D)]
        then = _excess(paired)
        return _excess(now) / then if then > 1e-9 else 1.0

    def tau(self, shape: Shape) -> float:
        """Expected tokens emitted per request per step (1 for no speculation)."""
        if shape is None:
            return 1.0
        self._gi(shape)
        return self.snapshot()[0][self._index[shape]]


def _scale(rows: list, k: float) -> None:
    for row in rows:
        row[:] = [v * k for v in row]


def _excess(rates: Sequence[float]) -> float:
    """Expected accepted draft tokens given per-depth conditional rates: sum_d r_1 * ... * r_d."""
    total, p = 0.0, 1.0
    for r in rates:
        p *= r
        total += p
    return total


# -------------------------------------------------------------------- choice


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
    Knobs: hysteresis, explore_bonus, explore_until, explore_every,
    stale_after, explore_floor, cost_bonus (module docstring). ``explorations`` counts the steps whose
    entry was not the best by expected rate (optimism or a stale re-check);
    ``last_rates`` holds the expected tokens/s of each entry at the last step.
    """

    SATURATED = 0.7  # share of the decayed count a shape run on every step reaches

    def __init__(self, menu, costs: Optional[CostTable] = None, *, acceptance: Optional[AcceptanceStats] = None,
                 hysteresis: float = 0.03, explore_every: int = 16, explore_bonus: float = 0.5,
                 stale_after: int = 256, explore_floor: float = 0.8, explore_until: float = 60.0,
                 cost_bonus: float = 1.0):
        self.menu: tuple[Shape, ...] = parse_menu(menu if isinstance(menu, str) else list(menu))
        self.costs = costs if costs is not None else CostTable()
        self.acceptance = acceptance if acceptance is not None else AcceptanceStats(self.menu)
        missing = [shape_label(s) for s in self.menu if s is not None and s not in self.acceptance.shapes]
        if missing:
            raise ValueError(f"acceptance stats lack menu shapes {missing}")
        for name, v, ok in (("hysteresis", hysteresis, hysteresis >= 0), ("explore_every", explore_every,
                            explore_every >= 0), ("explore_bonus", explore_bonus, explore_bonus >= 0),
                            ("stale_after", stale_after, stale_after >= 1),
                            ("explore_floor", explore_floor, 0 <= explore_floor <= 1),
                            ("explore_until", explore_until, explore_until >= 0),
                            ("cost_bonus", cost_bonus, cost_bonus >= 0)):
            if not ok:
                raise ValueError(f"{name}={v!r} is out of range")
        self.hysteresis, self.explore_every = float(hysteresis), int(explore_every)
        self.explore_bonus, self.stale_after = float(explore_bonus), int(stale_after)
        self.explore_floor = float(explore_floor)
        self.explore_until = float(explore_until)
        self.cost_bonus = float(cost_bonus)
        self._index = {s: i for i, s in enumerate(self.menu)}
        self._entries = [(s, verify_tokens(s), 0 if s is None else _depth(s),
                          None if s is None else self.acceptance.shapes.index(s)) for s in self.menu]
        # Chains share their counts, so their optimism is the same: that of the shortest
        # chain's depth (else the deepest chain wins every exploration on depth alone).
        shortest_chain = min((_depth(s) for s in self.menu if s is not None and s.topk == 1), default=0)
        self._lift_depth = {j: (min(D, shortest_chain) if s.topk == 1 else D)
                            for s, T, D, j in self._entries if s is not None}
        self._t = 0
        self._incumbent: Optional[int] = None
        self._last_run = [0] * len(self.menu)
        self._counts = [0] * len(self.menu)
        self.explorations = 0
        self.last_rates: Optional[list[float]] = None

    @property
    def incumbent(self) -> Shape:
        """The shape the policy currently prefers (None before the first step, or no speculation)."""
        return None if self._incumbent is None else self.menu[self._incumbent]

    def rates(self, batch_size: int) -> dict[str, float]:
        """Expected tokens/s of every entry now ({label: rate}, for logs)."""
        return dict(zip(map(shape_label, self.menu),
                        expected_rates(self.menu, self.costs, self.acceptance, batch_size)))

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
        if not self.costs.observed(1, batch_size):
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
        batch_size = _check_key("batch_size", batch_size)
        verify_seconds = _check_seconds("verify_seconds", verify_seconds)
        if draft_seconds is not None:
            draft_seconds = _check_seconds("draft_seconds", draft_seconds, allow_zero=True)
        self.acceptance.record(shape, accepted_lengths, chain_lengths, chain_censored)
        self.costs.observe_verify(verify_tokens(shape), batch_size, verify_seconds)
        if shape is not None and draft_seconds is not None:
            self.costs.observe_draft(shape, batch_size, draft_seconds)

    def counters(self) -> dict[str, int]:
        """Steps that ran each entry (explorations included), keyed by shape_label."""
        return {shape_label(s): n for s, n in zip(self.menu, self._counts)}
