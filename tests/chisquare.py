"""Chi-square tests for the sampling tests (scipy is not installed in every venv).

The one implementation the tests share. ``p_value`` is the upper tail of the
chi-square distribution, via the regularized upper incomplete gamma function
Q(df / 2, x / 2). Counts are ``Counter``s / dicts {outcome: n} or 1-D count
vectors (e.g. ``torch.bincount``: outcome = index); probabilities are dicts
{outcome: p} or 1-D vectors.
"""

from __future__ import annotations

from collections import Counter

import torch


def p_value(statistic: float, dof: int) -> float:
    if dof <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(statistic / 2, dtype=torch.float64)))


def _counts(counts) -> dict:
    """{outcome: n}; a count vector becomes {index: n} over its nonzero entries."""
    if isinstance(counts, dict):
        return counts
    values = counts.tolist() if hasattr(counts, "tolist") else list(counts)
    return {i: n for i, n in enumerate(values) if n}


def _probs(probs) -> dict:
    """{outcome: p}; a probability vector becomes {index: p}."""
    if isinstance(probs, dict):
        return probs
    values = probs.double().tolist() if isinstance(probs, torch.Tensor) else list(probs)
    return dict(enumerate(float(p) for p in values))


def goodness_of_fit(counts, probs, min_expected: float = 5.0) -> tuple[float, int, float]:
    """Observed ``counts`` {outcome: n} against ``probs`` {outcome: p} (sum 1).
    Outcomes expected fewer than ``min_expected`` times are pooled into one
    bin. An observed outcome with probability 0 is a certain failure (p 0).
    Returns (statistic, degrees of freedom, p-value)."""
    counts, probs = _counts(counts), _probs(probs)
    n = sum(counts.values())
    if any(probs.get(k, 0.0) <= 0.0 for k in counts):
        return float("inf"), 0, 0.0
    bins, pooled_obs, pooled_exp = [], 0, 0.0
    for outcome, p in probs.items():
        expected = n * p
        if expected >= min_expected and expected > 0:
            bins.append((counts.get(outcome, 0), expected))
        else:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += expected
    if pooled_exp > 0:
        bins.append((pooled_obs, pooled_exp))
    stat = sum((o - e) ** 2 / e for o, e in bins)
    return stat, len(bins) - 1, p_value(stat, len(bins) - 1)


def two_sample(a, b, min_count: int = 10) -> tuple[float, int, float]:
    """Do samples ``a`` and ``b`` (Counters of outcomes, or count vectors) come
    from one distribution? Chi-square test of homogeneity on the 2 x K table
    (for two rows the same statistic as NIST's unequal-sample-size form);
    outcomes seen fewer than ``min_count`` times in both samples together are
    pooled (``min_count=1``: no pooling).
    Returns (statistic, degrees of freedom, p-value)."""
    a, b = _counts(a), _counts(b)
    na, nb = sum(a.values()), sum(b.values())
    columns, pooled = [], [0, 0]
    for outcome in set(a) | set(b):
        ca, cb = a.get(outcome, 0), b.get(outcome, 0)
        if ca + cb >= min_count and ca + cb > 0:
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


def combined(results) -> tuple[float, int, float]:
    """Independent tests ((statistic, dof, p) each) as one: statistics and
    degrees of freedom add; an infinite statistic (an impossible outcome
    observed) fails the whole. Returns (statistic, degrees of freedom, p-value)."""
    stat, dof = 0.0, 0
    for s, d, _ in results:
        stat, dof = stat + s, dof + d
    if stat == float("inf"):
        return stat, dof, 0.0
    return stat, dof, p_value(stat, dof)


def total_variation(a: Counter, b: Counter) -> float:
    na, nb = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a.get(k, 0) / na - b.get(k, 0) / nb) for k in set(a) | set(b))
