"""Sampled (temperature > 0) tree decoding on tiny Llama targets: exact in distribution.

``TreeDecoder.generate(temperature > 0)`` verifies with ``verify_tree_sampling``
(target-only recursive rejection over deterministic top-k drafts); its output
must be distributed exactly as plain sampling (``TreeDecoder.sample``) from the
same ``sampling_probs``. A two-sample chi-square test compares the joint of
the first three tokens over many seeds; a decoder whose tree path uses another
temperature must fail the same test.

Needs transformers (the .venv-vllm venv); skips cleanly without it.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("transformers", reason="transformers is not installed (ci/setup_model_venv.sh builds .venv-vllm)")

import tiny  # noqa: E402  (tests/model/tiny.py)

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import chisquare  # noqa: E402  (tests/chisquare.py)

from spec_plugins.reference_decoder import TreeDecoder, sampling_probs  # noqa: E402

TEMPERATURE, TOP_P = 0.8, 0.9
SHAPE = (3, 2, 6)  # depth 3, two children per step: sibling rejection and residual draws both occur
N_SEEDS = 1000
ALPHA = 1e-3


POOL_BELOW = 10  # outcomes seen fewer times in both samples together share one bin


def engineered_decoder(cls=TreeDecoder):
    """A 16-token target whose next token is mostly a bigram (a handful of likely
    tokens at temperature 0.8) and an EAGLE-1 head drafting that bigram."""
    target = tiny.tiny_target(vocab=16, engineered=True)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(10.0)
            layer.mlp.down_proj.weight.mul_(10.0)
    return cls(target, tiny.tiny_head(target, "eagle1", engineered=True))


PROMPT = torch.randint(3, 16, (8,), generator=torch.Generator().manual_seed(0))


def first_tokens(run, seeds) -> collections.Counter:
    return collections.Counter(tuple(run(s).tokens) for s in seeds)


def baseline_counts(dec) -> collections.Counter:
    return first_tokens(lambda s: dec.sample(PROMPT, 3, TEMPERATURE, TOP_P, seed=s, stop_at_eos=False),
                        range(N_SEEDS))


def tree_counts(dec, n, accept_lengths=None) -> collections.Counter:
    def run(seed):
        out = dec.generate(PROMPT, 3, *SHAPE, stop_at_eos=False, temperature=TEMPERATURE, top_p=TOP_P, seed=seed)
        if accept_lengths is not None:
            accept_lengths.extend(out.accept_lengths)
        return out

    return first_tokens(run, range(10**6, 10**6 + n))  # seeds disjoint from the baseline's: independent samples


class HotterTreePath(TreeDecoder):
    """Negative control: the tree nodes' distribution uses temperature x 1.5
    (the first token after prefill is still right)."""

    def _walk(self, t, logits, num_steps, sampling):
        hot = dataclasses.replace(sampling, temperature=sampling.temperature * 1.5)
        return super()._walk(t, logits, num_steps, hot)


@pytest.fixture(scope="module")
def baseline():
    return baseline_counts(engineered_decoder())


def test_sampled_tree_matches_plain_sampling_in_distribution(baseline):
    accept_lengths = []
    tree = tree_counts(engineered_decoder(), N_SEEDS, accept_lengths)
    stat, df, p = chisquare.two_sample(baseline, tree, min_count=POOL_BELOW)
    assert df >= 10, f"too few outcome bins ({df + 1}): the test has little power"
    assert p > ALPHA, f"tree sampling differs from plain sampling: chi2 {stat:.1f}, df {df}, p {p:.2e}"
    hist = torch.bincount(torch.tensor(accept_lengths), minlength=SHAPE[0] + 1)
    assert hist[0] > 0 and hist[1:].sum() > 0 and hist[2:].sum() > 0, \
        f"accept-length histogram {hist.tolist()}: the accept or reject path went untested"


def test_distribution_test_detects_a_wrong_tree_temperature(baseline):
    stat, df, p = chisquare.two_sample(baseline, tree_counts(engineered_decoder(HotterTreePath), 300),
                                       min_count=POOL_BELOW)
    assert p < ALPHA, f"a tree path at temperature x 1.5 went unnoticed: chi2 {stat:.1f}, df {df}, p {p:.2e}"


def test_sampling_probs_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0]], dtype=torch.float64)
    full = sampling_probs(logits, 0.5)
    assert torch.allclose(full, (logits / 0.5).softmax(-1))
    top2 = sampling_probs(logits, 1.0, top_k=2)
    e = torch.tensor(1.0, dtype=torch.float64).exp()  # tokens 4 and 0 (logits 3 and 2) keep e : 1
    assert torch.allclose(top2[0], torch.tensor([1, 0, 0, 0, e], dtype=torch.float64) / (1 + e))
    p = logits.softmax(-1)[0]  # sorted: tokens 4, 0, 1, 2, 3 with p 0.636, 0.234, 0.086, ...
    nucleus = sampling_probs(logits, 1.0, top_p=0.8)  # 0.636 < 0.8 <= 0.636 + 0.234: tokens 4 and 0
    assert torch.allclose(nucleus[0], torch.tensor([p[0], 0, 0, 0, p[4]], dtype=torch.float64) / (p[0] + p[4]))
    assert (sampling_probs(logits, 1.0, top_p=1e-6)[0] == torch.tensor([0, 0, 0, 0, 1.0],
                                                                       dtype=torch.float64)).all()
    assert sampling_probs(logits.float(), 0.7, 3, 0.9).dtype == torch.float32
    for bad in (dict(temperature=0.0), dict(temperature=1.0, top_p=0.0), dict(temperature=1.0, top_k=-1)):
        with pytest.raises(ValueError):
            sampling_probs(logits, **bad)


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
def test_sampled_generate_is_reproducible_per_seed_and_greedy_at_zero(kind):
    target = tiny.tiny_target(seed=3)
    dec = TreeDecoder(target, tiny.tiny_head(target, kind, seed=4, draft_vocab=48 if kind == "eagle3" else None))
    p = torch.randint(3, 96, (9,), generator=torch.Generator().manual_seed(10))
    runs = [dec.generate(p, 20, 5, 4, 8, stop_at_eos=False, temperature=1.0, top_k=20, seed=s).tokens
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] and len(runs[0]) == 20
    assert runs[0] != runs[2], "two seeds gave the same 20 sampled tokens: the seed is not used"
    assert dec.generate(p, 20, 5, 4, 8, stop_at_eos=False, seed=7).tokens == dec.greedy(p, 20, stop_at_eos=False).tokens
    assert dec.sample(p, 20, 1.0, top_k=20, seed=7).tokens == dec.sample(p, 20, 1.0, top_k=20, seed=7).tokens
