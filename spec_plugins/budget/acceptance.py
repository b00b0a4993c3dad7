"""The budget's acceptance statistics: per shape, how many draft tokens a request accepts (tau).

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

Forgetting and change detection
* Forgetting: each record multiplies every shape's counts by ``age``
  (0.997 per step, any entry run, ``None`` included) and the shape that ran
  by ``decay`` too (0.99 per own step): the running shape averages over
  its last ~75 steps; one not run fades back to its prior over ~300.
* Change detection: a two-sided CUSUM of the running shape's accepted
  lengths against its prediction, standardized (slack 0.5, threshold 8
  standard deviations; only once the shape has >= 2 * min_evidence
  requests). An alarm (the draft or the prompt mix changed) multiplies
  every shape's counts by ``change_discount`` (0.02): all estimates
  restart from fresh data, which the policy's optimism (policy.py) then
  gathers quickly.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from typing import Iterable, Optional, Sequence

from spec_plugins.budget.menu import Shape, shape_label
from spec_plugins.tree_drafting import TreeShape


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
        _check_knobs(decay=decay, age=age, prior_rate=prior_rate, prior_weight=prior_weight, min_evidence=min_evidence,
                     change_threshold=change_threshold, change_slack=change_slack, change_discount=change_discount)
        self.decay, self.age, self.prior_rate = float(decay), float(age), float(prior_rate)
        self.prior_weight, self.min_evidence = float(prior_weight), float(min_evidence)
        self.change_threshold, self.change_slack = float(change_threshold), float(change_slack)
        self.change_discount = float(change_discount)
        self.changes = 0  # change alarms so far
        self._cusum = [0.0, 0.0]  # (upward, downward) CUSUM of standardized accepted-length surprises
        self.shapes: tuple[TreeShape, ...] = tuple(dict.fromkeys(s for s in shapes if s is not None))
        self._set_up_counts(self._group_shapes())
        self._index = {s: i for i, s in enumerate(self.shapes)}
        self._rates: Optional[list[list[float]]] = None
        self._snap: Optional[tuple[list[float], list[float]]] = None

    def _group_shapes(self) -> list:
        """Count groups: one for all chains, one per tree. Sets ``_group``
        (shape -> group index); returns each group's key ("chain" or the tree)."""
        keys: list = []
        self._group: dict[TreeShape, int] = {}
        for s in self.shapes:
            key = "chain" if s.topk == 1 else s
            if key not in keys:
                keys.append(key)
            self._group[s] = keys.index(key)
        return keys

    def _set_up_counts(self, keys: list) -> None:
        """Zeroed count rows of every group (own, and the trees' chain-paired
        ones), with what the estimate reads of the groups: depth, topk, the
        groups each one contains."""
        n = len(keys)
        members = [[s for s in self.shapes if self._group[s] == g] for g in range(n)]
        self._gD = [max(s.max_depth for s in m) for m in members]
        self._topk = [m[0].topk for m in members]
        self._att = [[0.0] * D for D in self._gD]
        self._acc = [[0.0] * D for D in self._gD]
        self._contained = [[j for j in range(n) if j != i and _contains(keys[i], keys[j])] for i in range(n)]
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
        self._add(self._att[g], self._acc[g], hist, {}, shape.max_depth, self.decay)
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
        D = shape.max_depth
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
        return self._rates[self._gi(shape)][: shape.max_depth]

    def snapshot(self) -> tuple[list[float], list[float]]:
        """(tau, evidence) of every shape in ``self.shapes`` order; cached until the next record."""
        if self._snap is None:
            if self._rates is None:
                self._refresh()
            taus = []
            for s in self.shapes:
                g, D = self._group[s], s.max_depth
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


def _check_knobs(*, decay, age, prior_rate, prior_weight, min_evidence, change_threshold, change_slack,
                 change_discount) -> None:
    for name, v in (("decay", decay), ("age", age), ("change_discount", change_discount)):
        if not 0 < v <= 1:
            raise ValueError(f"{name}={v!r} must be in (0, 1]")
    if not 0 <= prior_rate <= 1:
        raise ValueError(f"prior_rate={prior_rate!r} must be in [0, 1]")
    for name, v in (("prior_weight", prior_weight), ("min_evidence", min_evidence),
                    ("change_threshold", change_threshold), ("change_slack", change_slack)):
        if not v >= 0:
            raise ValueError(f"{name}={v!r} must be >= 0")


def _contains(outer, inner) -> bool:
    """Whether count group ``outer``'s candidates include group ``inner``'s
    (keys: "chain" or a tree): every tree contains the chains; a tree another
    tree when its topk, num_steps and num_draft_tokens are all <=."""
    if outer == "chain":
        return False
    if inner == "chain":
        return True
    return (inner.topk <= outer.topk and inner.num_steps <= outer.num_steps
            and inner.num_draft_tokens <= outer.num_draft_tokens)
