"""The budget's cost table: step-time estimates t_V(T, B) and d(shape, B), in seconds.

t_V(T, B) = verify forward + sampling of B requests with T tokens each (T = 1
is the plain decode step); d(shape, B) = the draft's time for the step. One
value per key. Seeded by a startup profile (``profile_plan`` lists a small
grid of keys to time; ``seed_verify`` / ``seed_draft``), measured online
(``observe_verify`` / ``observe_draft``).

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
"""

from __future__ import annotations

import bisect
import math
import operator
from typing import Mapping, Optional, Sequence

from spec_plugins.budget.menu import Shape, shape_label, verify_tokens
from spec_plugins.tree_drafting import TreeShape


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


def check_key(name: str, v) -> int:
    """``v`` as a positive int (a T, B or batch size); ValueError naming ``name`` otherwise."""
    try:
        i = -1 if isinstance(v, bool) else operator.index(v)
    except TypeError:
        i = -1
    if i < 1:
        raise ValueError(f"{name}={v!r} must be a positive integer")
    return i


def check_seconds(name: str, v, allow_zero: bool = False) -> float:
    """``v`` as a finite positive (or, allow_zero, non-negative) time; ValueError naming ``name`` otherwise."""
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
        self._seed(self._verify, check_key("T", T), check_key("B", B), check_seconds("verify", seconds))

    def seed_draft(self, shape: TreeShape, B: int, seconds: float) -> None:
        """The startup profile's d(shape, B) (see ``seed_verify``)."""
        self._seed(self._draft, _as_shape(shape), check_key("B", B), check_seconds("draft", seconds, True))

    def observe_verify(self, T: int, B: int, seconds: float) -> None:
        """One measured verify (forward + sampling) of B requests x T tokens."""
        T, B = check_key("T", T), check_key("B", B)
        self._observe(self._verify, T, B, check_seconds("verify_seconds", seconds))

    def observe_draft(self, shape: TreeShape, B: int, seconds: float) -> None:
        """One measured drafting step of B requests with this shape."""
        shape, B = _as_shape(shape), check_key("B", B)
        self._observe(self._draft, shape, B, check_seconds("draft_seconds", seconds, allow_zero=True))

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
