"""Chi-square tests for the sampling tests (scipy is not installed in every venv).

``p_value`` is the upper tail of the chi-square distribution, via the
regularized upper incomplete gamma function Q(df / 2, x / 2).
"""

from __future__ import annotations

from collections import Counter

import torch


def p_value(statistic: float, dof: int) -> float:
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def goodness_of_fit(counts: Counter, probs: dict, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Observed ``counts`` {outcome: n} against ``probs`` {outcome: p} (sum 1).
    Outcomes expected fewer than ``min_expected`` times are pooled into one
    bin. An observed outcome with probability 0 is a certain failure (p 0).
    Returns (statistic, degrees of freedom, p-value)."""
    n = sum(counts.values())
    if any(probs.get(k, 0.0) <= 0.0 for k in counts):
        return float("inf"), 0, 0.0
    bins, pooled_obs, pooled_exp = [], 0, 0.0
    for outcome, p in probs.items():
        expected = n * p
        if expected >= min_expected:
            bins.append((counts.get(outcome, 0), expected))
        else:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += expected
    if pooled_exp > 0:
        bins.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    return stat, len(bins) - 1, p_value(stat, len(bins) - 1)


def two_sample(a: Counter, b: Counter, min_count: int = 10) -> tuple[float, int, float]:
    """Do samples ``a`` and ``b`` (Counters of outcomes) come from one
    distribution? Chi-square test of homogeneity on the 2 x K table; outcomes
    seen fewer than ``min_count`` times in both samples together are pooled.
    Returns (statistic, degrees of freedom, p-value)."""
    na, nb = sum(a.values()), sum(b.values())
    columns, pooled = [], [0, 0]
    for outcome in set(a) | set(b):
        ca, cb = a.get(outcome, 0), b.get(outcome, 0)
        if ca + cb >= min_count:
            columns.append((ca, cb))
        else:
            pooled[0] += ca
            pooled[1] += cb
    if sum(pooled):
        columns.append(tuple(pooled))
    total = na + nb
    stat = 0.0
    for ca, cb in columns:
        col = ca + cb
        for observed, row_total in ((ca, na), (cb, nb)):
            expected = row_total * col / total
            stat += (observed - expected) ** 2 / expected
    return stat, len(columns) - 1, p_value(stat, len(columns) - 1)


def total_variation(a: Counter, b: Counter) -> float:
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a.get(k, 0) / na - b.get(k, 0) / nb) for k in set(a) | set(b))
