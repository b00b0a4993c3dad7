"""The chi-square helper the sampling tests share (tests/chisquare.py): p-values
against known values, the statistics on hand-computed samples, count vectors."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

import chisquare


def test_p_value_matches_known_quantiles():
    assert chisquare.p_value(3.841458820694124, 1) == pytest.approx(0.05, abs=1e-9)
    assert chisquare.p_value(18.307038053275146, 10) == pytest.approx(0.05, abs=1e-9)
    assert chisquare.p_value(4.0, 2) == pytest.approx(math.exp(-2), rel=1e-12)  # 2 dof: exp(-stat / 2)
    assert chisquare.p_value(0.0, 3) == 1.0
    assert chisquare.p_value(5.0, 0) == 1.0


def test_goodness_of_fit_of_a_known_sample():
    """A perfect fit gives 1, a gross misfit ~0, and a hand-computed case
    (counts 30/40/30 against 1/3 each of 100: stat 2, 2 dof, p exp(-1))."""
    assert chisquare.goodness_of_fit({"a": 50, "b": 50}, {"a": 0.5, "b": 0.5})[2] == pytest.approx(1.0)
    assert chisquare.goodness_of_fit({"a": 90, "b": 10}, {"a": 0.5, "b": 0.5})[2] < 1e-12
    stat = sum((n - 100 / 3) ** 2 / (100 / 3) for n in (30, 40, 30))
    got = chisquare.goodness_of_fit({"a": 30, "b": 40, "c": 30}, {"a": 1 / 3, "b": 1 / 3, "c": 1 / 3})
    assert got[:2] == (pytest.approx(stat), 2)
    assert got[2] == pytest.approx(math.exp(-stat / 2), rel=1e-9)
    assert chisquare.goodness_of_fit({"z": 1, "a": 99}, {"a": 1.0})[2] == 0.0  # an impossible category occurred


def test_goodness_of_fit_pools_rare_outcomes():
    # expected 60, 30, 6, 3, 1 of 100: the last two (4 expected, 7 observed) share a bin
    probs = {"a": 0.6, "b": 0.3, "c": 0.06, "d": 0.03, "e": 0.01}
    counts = Counter({"a": 58, "b": 29, "c": 6, "d": 4, "e": 3})
    stat, dof, _ = chisquare.goodness_of_fit(counts, probs)
    assert dof == 3
    assert stat == pytest.approx(4 / 60 + 1 / 30 + 0 + 9 / 4)


def test_count_vectors_equal_counters():
    """torch count vectors (outcome = index, as from torch.bincount) give the
    dict results; probability 0 with no observation is no bin."""
    counts = torch.tensor([0, 30, 50, 20, 0])
    probs = torch.tensor([0.0, 0.3, 0.45, 0.2, 0.05])
    as_dicts = ({1: 30, 2: 50, 3: 20}, {1: 0.3, 2: 0.45, 3: 0.2, 4: 0.05, 0: 0.0})
    assert chisquare.goodness_of_fit(counts, probs) == pytest.approx(chisquare.goodness_of_fit(*as_dicts))
    assert chisquare.goodness_of_fit(torch.tensor([1, 30, 50, 19, 0]), probs)[2] == 0.0  # p 0 observed
    other = torch.tensor([0, 25, 60, 10, 5])
    assert chisquare.two_sample(counts, other, min_count=1) == pytest.approx(
        chisquare.two_sample(Counter({1: 30, 2: 50, 3: 20}), Counter({1: 25, 2: 60, 3: 10, 4: 5}), min_count=1))


def test_two_sample_of_known_samples():
    same = Counter({"x": 500, "y": 300, "z": 200})
    assert chisquare.two_sample(same, same)[2] == pytest.approx(1.0)
    assert chisquare.two_sample(same, Counter({"x": 300, "y": 300, "z": 400}))[2] < 1e-10


def test_two_sample_is_nists_unequal_size_form():
    """For two samples the homogeneity statistic equals NIST's form for
    unequal sample sizes, sum (k1 a - k2 b)^2 / (a + b), k1 = sqrt(nb / na),
    k2 = sqrt(na / nb); outcomes seen fewer than min_count times together are
    pooled (here w and v: 4 + 5 observations)."""
    a = Counter({"x": 120, "y": 70, "z": 40, "w": 3, "v": 2})
    b = Counter({"x": 300, "y": 200, "z": 90, "w": 1, "v": 4})
    na, nb = sum(a.values()), sum(b.values())
    k1, k2 = math.sqrt(nb / na), math.sqrt(na / nb)
    columns = [(120, 300), (70, 200), (40, 90), (5, 5)]
    nist = sum((k1 * x - k2 * y) ** 2 / (x + y) for x, y in columns)
    stat, dof, p = chisquare.two_sample(a, b, min_count=10)
    assert (stat, dof) == (pytest.approx(nist, rel=1e-12), 3)
    assert p == pytest.approx(chisquare.p_value(nist, 3), rel=1e-9)
    assert chisquare.two_sample(a, b, min_count=1)[1] == 4  # no pooling: one column per outcome


def test_combined_adds_statistics_and_fails_on_an_impossible_outcome():
    stat, dof, p = chisquare.combined([(2.0, 1, None), (2.0, 1, None)])
    assert (stat, dof) == (4.0, 2) and p == pytest.approx(math.exp(-2), rel=1e-12)
    assert chisquare.combined([(1.0, 3, None), (float("inf"), 0, 0.0)])[2] == 0.0
    assert chisquare.combined([(float("inf"), 0, 0.0)])[2] == 0.0
