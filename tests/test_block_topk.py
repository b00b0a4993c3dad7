"""Issue #52 (perf): DDTree's per-position top-K (``tree_drafting.block_topk``)
without a float32 copy of the drafter's [R, L, V] logits.

It was ``logits.float().log_softmax(-1).topk(K)``: two float32 [R, L, V]
tensors, ~1.2 GB at 64 requests x 16 positions of a 152k vocabulary, that
vLLM's memory profile never accounted for. Now the top-K is taken on the
logits in their own dtype and each row's log-sum-exp in float32 a bounded
number of rows at a time. Here: the result equals the old formula (values
within float32 rounding, ids wherever no two log-probs nearly tie); rank 0
is the logits' argmax (vLLM's DFlash chain token) even where float32
log-probs round to a tie; and the CPU allocator's peak while it runs is a
chunk's float32 copy, far below one [R, L, V] copy (the old formula fails
that bound). Its capturability is tests/test_tree_drafting_graphs.py's.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from spec_plugins import tree_drafting
from spec_plugins.tree_drafting import block_topk


def log_softmax_topk(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The formula block_topk replaced (and must still equal)."""
    return logits.float().log_softmax(-1).topk(topk, dim=-1)


def drafter_logits(R: int, L: int, V: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Peaked random logits, some rows with a masked (-inf) part of the
    vocabulary, one certain row (a single finite logit) and two broken ones
    (a +inf logit; all -inf)."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(R, L, V, generator=gen) * 3
    logits[1, 2, V // 3:] = -torch.inf
    logits[2, 0, 1:] = -torch.inf
    logits[3, 1, 5] = torch.inf
    logits[3, 2] = -torch.inf
    return logits.to(dtype)


@pytest.mark.parametrize("rows_per_chunk", [None, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_equals_the_float32_log_softmax_topk(dtype, rows_per_chunk, monkeypatch):
    R, L, V, K = 5, 7, 3001, 8  # 35 rows: chunks of 4 leave a short last one
    if rows_per_chunk is not None:
        monkeypatch.setattr(tree_drafting, "FLOAT32_CHUNK_ELEMENTS", rows_per_chunk * V + V // 2)
    logits = drafter_logits(R, L, V, dtype, seed=7)
    before = logits.clone()
    values, tokens = block_topk(logits, K)
    ref_values, ref_tokens = log_softmax_topk(logits, K)
    assert torch.equal(logits, before)  # the logits are read, never written
    assert values.dtype == torch.float32 and tokens.dtype == torch.int64 and values.shape == tokens.shape == (R, L, K)
    sound = values[~values.isnan().any(-1)]
    assert len(sound) == R * L - 2 and (sound[:, :-1] >= sound[:, 1:]).all()
    torch.testing.assert_close(values, ref_values, rtol=0, atol=1e-5, equal_nan=True)
    assert values[3, 1:3].isnan().all()  # the broken rows: NaN, as their log-softmax
    # ids: equal at every rank whose log-prob is apart from both neighbours' (near-ties may order either way)
    best = logits.float().log_softmax(-1).topk(K + 1, dim=-1).values
    gap = best[..., :-1] - best[..., 1:] > 1e-4  # rank j above rank j + 1
    apart = gap & torch.cat([torch.ones_like(gap[..., :1]), gap[..., :-1]], -1)
    assert apart.float().mean() > 0.5, "too few ranks without near-ties to compare ids"
    assert torch.equal(tokens[apart], ref_tokens[apart])
    assert values[2, 0, 0] == 0 and torch.isneginf(values[2, 0, 1:]).all()  # the certain row


def test_an_empty_batch():
    values, tokens = block_topk(torch.randn(0, 4, 50), 3)
    assert values.shape == tokens.shape == (0, 4, 3) and values.dtype == torch.float32


@pytest.mark.parametrize("argmax_first", [True, False])
@pytest.mark.parametrize("topk", [1, 4])
def test_rank_0_is_the_logits_argmax_where_float32_log_probs_tie(topk, argmax_first):
    """Two float32 logits one ulp apart at the top of rows whose log-sum-exp
    is large: their float32 log-probs round to the same value, so a top-K of
    the log-probs may rank either first; vLLM's DFlash chain drafts the
    argmax of the logits, and DDTree's rank 0 (the tree's top-1 path, the
    chain counterfactual) must be that token."""
    R, L, V = 4, 8, 20000
    gen = torch.Generator().manual_seed(3)
    logits = 0.25 + torch.rand(R, L, V, generator=gen) * 0.01  # many near-equal logits: log-sum-exp ~ 10
    lower = torch.randint(0, V // 2, (R, L, 1), generator=gen)
    top, runner_up = (lower, lower + V // 2) if argmax_first else (lower + V // 2, lower)
    logits.scatter_(-1, runner_up, 0.5)
    logits.scatter_(-1, top, torch.nextafter(torch.tensor(0.5), torch.tensor(1.0)).item())
    log_probs = logits.log_softmax(-1)
    assert torch.equal(log_probs.gather(-1, top), log_probs.gather(-1, runner_up))  # the tie this is about
    values, tokens = block_topk(logits, topk)
    assert torch.equal(tokens[..., 0], logits.argmax(-1))


def allocator_peak(fn) -> int:
    """Peak bytes held by torch's CPU allocator while ``fn`` runs, above what
    was held before (every allocation and free the profiler records, in order)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    records = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                     key=lambda e: e.start_ns())
    assert records, "the profiler recorded no allocation: this torch reports memory elsewhere"
    live = peak = 0
    for record in records:
        live += record.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_float32_copy_of_the_whole_block(dtype, monkeypatch):
    """At chunks of 2 rows of a 5000-token vocabulary the peak is one
    chunk's float32 copy, or two where the host casts a bf16 operand before
    the float32 subtraction (a GPU casts in the kernel), plus the small
    outputs; one float32 [R, L, V] alone is 8x that bound."""
    R, L, V, K = 4, 8, 5000, 8
    monkeypatch.setattr(tree_drafting, "FLOAT32_CHUNK_ELEMENTS", 2 * V)
    logits = drafter_logits(R, L, V, dtype, seed=1)
    block_topk(logits, K)  # first-call allocations (thread pools, caches) are not the op's
    chunk_bytes, whole_bytes = 2 * V * 4, R * L * V * 4
    peak = allocator_peak(lambda: block_topk(logits, K))
    assert peak <= 2 * chunk_bytes + 16 * 1024 < whole_bytes, (peak, chunk_bytes, whole_bytes)
