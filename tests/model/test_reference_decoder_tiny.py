"""Losslessness of the reference tree decoder on tiny Llama targets (fast, no files).

Needs transformers (the .venv-vllm venv); skips cleanly without it.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("transformers", reason="transformers is not installed (ci/setup_model_venv.sh builds .venv-vllm)")

import spec_tree_kernels as stk  # noqa: E402
import tiny  # noqa: E402  (tests/model/tiny.py)

from spec_plugins.reference_decoder import TreeDecoder  # noqa: E402

SHAPES = [(3, 1, 4), (5, 1, 6), (7, 1, 8), (5, 4, 8), (3, 2, 6), (5, 4, 16), (6, 8, 32), (4, 3, 1), (1, 4, 3)]


def engineered_decoder(scale=0.05):
    """A target whose next token is mostly a bigram, and an EAGLE-1 head drafting that bigram."""
    target = tiny.tiny_target(engineered=True)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(scale / 0.005)
            layer.mlp.down_proj.weight.mul_(scale / 0.005)
    return TreeDecoder(target, tiny.tiny_head(target, "eagle1", engineered=True))


def prompt(seed, n=12):
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", SHAPES)
def test_engineered_pair_is_lossless_and_accepts(shape):
    dec = engineered_decoder()
    accepted = 0
    rejected_steps = 0
    for seed in range(3):
        p = prompt(seed)
        ref = dec.greedy(p, 40, stop_at_eos=False).tokens
        out = dec.generate(p, 40, *shape, stop_at_eos=False)
        assert out.tokens == ref, f"seed {seed}: tree {shape} diverged from greedy"
        accepted += sum(out.accept_lengths)
        rejected_steps += sum(a < shape[0] for a in out.accept_lengths)
    if shape[2] > 1:
        assert accepted > 0, "the engineered head never got a draft accepted: the accept path is untested"
        assert rejected_steps > 0, "every draft was accepted: the reject path is untested"


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("shape", [(3, 1, 4), (5, 4, 8), (6, 8, 32)])
def test_random_heads_are_lossless(kind, shape):
    target = tiny.tiny_target(seed=3)
    head = tiny.tiny_head(target, kind, seed=4, draft_vocab=48 if kind == "eagle3" else None)
    dec = TreeDecoder(target, head)
    for seed in range(2):
        p = prompt(10 + seed, n=9)
        assert dec.generate(p, 30, *shape, stop_at_eos=False).tokens == dec.greedy(p, 30, stop_at_eos=False).tokens


def test_tau_counts_emitted_tokens_per_verify_step():
    dec = engineered_decoder()
    out = dec.generate(prompt(0), 40, 5, 4, 8, stop_at_eos=False)
    # the prefill emits the first token; each verify step emits accept_length + 1
    assert 1 + sum(a + 1 for a in out.accept_lengths) >= len(out.tokens)
    assert out.tau == pytest.approx(1 + sum(out.accept_lengths) / len(out.accept_lengths))
    assert all(0 <= a <= 5 for a in out.accept_lengths)


def test_losslessness_test_detects_missing_kv_compaction(monkeypatch):
    """Mutation check: without moving the accepted KV, a tree whose accepted path
    is not a prefix of the verify slots corrupts the cache and the output diverges."""
    dec = engineered_decoder()
    monkeypatch.setattr(stk, "move_accepted_kv", lambda *a, **k: None)
    diverged = False
    for seed in range(4):
        p = prompt(seed)
        ref = dec.greedy(p, 40, stop_at_eos=False).tokens
        if dec.generate(p, 40, 6, 8, 32, stop_at_eos=False).tokens != ref:
            diverged = True
            break
    assert diverged, "dropping KV compaction went unnoticed: the losslessness test is too weak"


def test_eos_stops_generation():
    dec = engineered_decoder()
    p = prompt(1)
    ref = dec.greedy(p, 25).tokens
    dec.eos = ref[7]  # pretend the 8th token is EOS
    ref_eos = dec.greedy(p, 25).tokens
    out = dec.generate(p, 25, 5, 4, 8)
    assert out.tokens == ref_eos == ref[: ref.index(ref[7]) + 1]
