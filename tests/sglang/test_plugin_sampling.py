"""EAGLE_TREE with temperature > 0 through SGLang 0.5.23's own verify code on CPU.

SGLang's ``eagle_sample`` computes the target's probabilities (temperature,
top-k, top-p), draws its coins (``_verify_coins``) and calls
``tree_speculative_sampling_target_only``: a CUDA JIT kernel, None on CPU,
where SGLang verifies sampled batches greedily instead. With the EAGLE_TREE
hooks active that call is ``spec_tree_kernels.verify_tree_sampling`` (exact
target-only recursive rejection) on every platform. These tests check the
layout it hands back, that the tokens it emits are distributed as the target's
(chi-square, one- and two-sample), the threshold refusals and that the hooks
are inert outside our worker.

Runs in ``.venv-sglang`` with ``TRITON_INTERPRET=1`` (tests/conftest.py sets
it). What runs for real: SGLang's ``EagleDraftWorker.draft`` /
``draft_forward`` (the draft loop), ``build_eagle_verify_input``,
``eagle_sample`` (penalties, softmax, its top-k / top-p calls, ``_verify_coins``
including the seeded coins, the output allocation), ``EagleVerifyInput``,
``SamplingBatchInfo``, SGLang's resolution pipeline and its runtime-update
controller, SGLang's non-speculative torch sampler (the "without speculation"
side) and SGLang's Triton renorm and murmur kernels (interpreted, as
references).

Test doubles, because the server cannot run here (no GPU, no loaded model):
``eagle_utils._is_cpu`` is set as SGLang's CPU engine sets it
(``SGLANG_USE_CPU_ENGINE=1``, read at import); the draft model and the
target model are lookup tables of logits per input
token (the target is then a Markov chain, so "the target's distribution after
a prefix" is exact and known); the draft worker's ``self``,
``prepare_for_draft``, the schedule batch and the logits output are those of
``test_plugin_worker`` (namespaces with the fields read); the tensor-parallel
group is a one-rank namespace (``world_size`` 1: SGLang's broadcast is
skipped, as on one GPU); ``murmur_hash32`` on CPU needs ``sgl_kernel``'s CPU
build, not installed here, so CPU tensors go to a torch port of SGLang's
Triton murmur kernel (checked against the interpreted kernel below: the
interpreter is too slow for thousands of rows); SGLang's CUDA sampling kernel
cannot run, so the layout check against it uses a transcription of
``speculative/sampling.cuh`` on one-hot targets, where both laws are
deterministic; ``torchvision`` is stubbed (``spec_plugins.sglang_ext._testing``).
SGLang's greedy verify on CPU is ``sgl_kernel``'s CPU op, not installed:
where the test runs SGLang's own CPU path, its Triton version stands in.
``torch.compile`` is disabled (inductor would build C++ here).
"""

from __future__ import annotations

import os
import sys
import types

import pytest

from sglang_gate import require_sglang_venv

require_sglang_venv()

from spec_plugins.sglang_ext import _testing  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from sglang.kernels.ops.sampling import murmur_hash, renorm, renorm_triton  # noqa: E402
from sglang.kernels.ops.speculative import spec_tree, verify_sampling  # noqa: E402
from sglang.kernels.ops.speculative.sampling import (  # noqa: E402
    tree_speculative_sampling_target_only as sglang_cuda_kernel,
)
from sglang.srt.layers.sampler import (  # noqa: E402
    sampling_from_probs_torch,
    top_k_top_p_min_p_sampling_from_probs_torch,
)
from sglang.srt.managers.scheduler_components.internal_state import (  # noqa: E402
    SchedulerInternalStateController,
    UpdateRejected,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.speculative import eagle_utils, eagle_worker_v2  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleDraftInput, EagleVerifyInput  # noqa: E402

import spec_tree_kernels as stk  # noqa: E402
from spec_plugins.sglang_ext import config, engine_patches, layout  # noqa: E402
from spec_tree_kernels import TreeMaskMode  # noqa: E402
from test_plugin_worker import draft_worker_double, make_backend  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import chisquare  # noqa: E402  (tests/chisquare.py)

pytestmark = pytest.mark.sglang

VOCAB = 16
STEPS, TOPK, NODES = 4, 3, 12
ALL_MODES = list(TreeMaskMode)
TORCH = engine_patches.TreeRuntime  # shorthand below: TORCH(mode, impl="torch")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _testing.write_tiny_checkpoint_configs(tmp_path_factory.mktemp("ckpt"))


def publish(ckpt, **kwargs):
    kwargs = dict(
        model_path=ckpt["target"], speculative_algorithm="EAGLE_TREE", speculative_draft_model_path=ckpt["eagle_head"],
        attention_backend=config.BACKEND_TORCH, speculative_num_steps=STEPS, speculative_eagle_topk=TOPK,
        speculative_num_draft_tokens=NODES, **kwargs,
    )  # fmt: skip
    server_args = _testing.resolved_server_args(**kwargs)
    _testing.publish(server_args)
    return server_args


@pytest.fixture(autouse=True)
def clean(monkeypatch, ckpt):
    monkeypatch.delenv(config.VARIANT_ENV, raising=False)
    monkeypatch.delenv(config.MASK_MODE_ENV, raising=False)  # make_backend sets it; restored after the test
    engine_patches.deactivate()
    publish(ckpt)
    # SGLang's CPU engine: eagle_utils read SGLANG_USE_CPU_ENGINE=1 at import (unset in this test process)
    monkeypatch.setattr(eagle_utils, "_is_cpu", True)
    one_rank = types.SimpleNamespace(world_size=1)  # test double: a single-rank TP group
    with torch._dynamo.config.patch(disable=True), get_parallel().override(tp_group=one_rank):
        yield
    engine_patches.deactivate()


# ------------------------------------------------------------ statistics

# Chi-square tests: tests/chisquare.py (goodness of fit pools the outcomes
# expected fewer than 5 times; the two-sample tests here pool nothing).
ALPHA = 1e-3  # the tests are seeded: a pass or a failure reproduces


# ------------------------------------------------------- sampling settings


def sampling_info(bs, *, temperature=1.0, top_k=None, top_p=None, min_p=None, seed=None):
    """SGLang's own SamplingBatchInfo for ``bs`` requests with one setting
    (what ``SamplingBatchInfo.from_schedule_batch`` builds from their params)."""
    return SamplingBatchInfo(
        temperatures=torch.full((bs, 1), float(temperature)),
        top_ps=torch.full((bs,), float(top_p if top_p is not None else 1.0)),
        top_ks=torch.full((bs,), int(top_k if top_k is not None else 1 << 30), dtype=torch.int32),
        min_ps=torch.full((bs,), float(min_p if min_p is not None else 0.0)),
        is_all_greedy=False, is_any_greedy=False, need_top_p_sampling=top_p is not None,
        need_top_k_sampling=top_k is not None, need_min_p_sampling=min_p is not None, vocab_size=VOCAB,
        sampling_seed=None if seed is None else torch.as_tensor(seed, dtype=torch.int64),
    )  # fmt: skip


def target_probs_of(logits, *, temperature=1.0, top_k=None, top_p=None, min_p=None):
    """The law a sampled token must follow, from the definitions, in float64:
    softmax(logits / T), the k largest, the smallest top set with mass >= p
    (each renormalised, in eagle_sample's order), then min-p (as SGLang's
    sampler applies it)."""
    p = torch.softmax(logits.double() / temperature, dim=-1)
    if top_k is not None:
        kth = p.sort(dim=-1, descending=True).values[..., top_k - 1 : top_k]
        p = torch.where(p >= kth, p, 0.0)
        p = p / p.sum(-1, keepdim=True)
    if top_p is not None:
        ordered, index = p.sort(dim=-1, descending=True)
        keep = (ordered.cumsum(-1) - ordered) <= top_p
        p = torch.zeros_like(p).scatter(-1, index, torch.where(keep, ordered, 0.0))
        p = p / p.sum(-1, keepdim=True)
    if min_p is not None:
        p = torch.where(p >= p.max(-1, keepdim=True).values * min_p, p, 0.0)
        p = p / p.sum(-1, keepdim=True)
    return p


def sglang_direct_samples(logits, *, temperature=1.0, top_k=None, top_p=None, min_p=None):
    """Without speculation: SGLang's own non-speculative sampler on CPU (its
    "pytorch" sampling backend), one token per row of ``logits``."""
    rows = logits.shape[0]
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_k is None and top_p is None and min_p is None:
        return sampling_from_probs_torch(probs).long()
    info = sampling_info(rows, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    return top_k_top_p_min_p_sampling_from_probs_torch(
        probs, info.top_ks, info.top_ps, info.min_ps, info.need_min_p_sampling, None,
        torch.zeros(rows, dtype=torch.long),
    ).long()


def markov_tables(seed=0):
    """Target and draft models: next-token logits per last token. The draft is
    the target plus noise, so it proposes well but not perfectly."""
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(VOCAB, VOCAB, generator=gen) * 1.6
    draft = target + torch.randn(VOCAB, VOCAB, generator=gen) * 0.8
    return target, draft


# ------------------------------------------------------ the worker pipeline


def run_draft(monkeypatch, worker, draft_table, bonus, seq_lens):
    """SGLang's EagleDraftWorker.draft() from last tokens ``bonus`` (the draft
    input's top-k is the draft model's at the bonus token, as the draft extend
    leaves it); prepare_for_draft doubled as in test_plugin_worker."""
    bs = bonus.numel()
    topk_p, topk_index = torch.softmax(draft_table[bonus], dim=-1).topk(TOPK, dim=-1)
    draft_input = EagleDraftInput(topk_p=topk_p, topk_index=topk_index, hidden_states=torch.zeros(bs, 8),
                                  bonus_tokens=bonus)  # fmt: skip

    def prepare_for_draft_double(draft_input, *args, **kwargs):
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=None, req_pool_indices=torch.arange(bs) + 1,
            seq_lens=seq_lens, out_cache_loc=torch.zeros(1, dtype=torch.long), seq_lens_sum=int(seq_lens.sum()),
            spec_info=draft_input, positions=seq_lens.repeat_interleave(TOPK),
            sampling_info=types.SimpleNamespace(is_all_greedy=True),
        )  # fmt: skip
        fb.out_cache_loc = torch.arange(bs * TOPK * STEPS)
        return fb, False, None

    monkeypatch.setattr(eagle_worker_v2, "prepare_for_draft", prepare_for_draft_double)
    batch = types.SimpleNamespace(spec_info=draft_input, forward_mode=ForwardMode.DECODE, seq_lens=seq_lens,
                                  seq_lens_sum=int(seq_lens.sum()))  # fmt: skip
    verify_input, _, _ = eagle_worker_v2.EagleDraftWorker.draft(worker, batch, with_topology=True)
    return verify_input


def target_backend(mode):
    """Our verify backend for the modes it reads; for FULL_MASK and
    QLEN_ONLY_BITPACKING a backend without a verify buffer (as SGLang's GPU
    backends' eager path: build_eagle_verify_input allocates the mask)."""
    if mode in config.OUR_BACKEND_MODES:
        return make_backend(mode)
    return types.SimpleNamespace(verify_mask=None, max_context_len=64)


def speculate(monkeypatch, mode, info, bonus, target_table, draft_table, *, active=True, seq_lens=None):
    """One speculative step per request through SGLang's code: draft(), the
    verify input build, then eagle_sample on the target's logits at every tree
    node (the Markov target: a node's logits are the row of its token).
    Returns the emitted tokens [bs, D + 1] (-1 padded) and accept_lens."""
    bs = bonus.numel()
    seq_lens = torch.full((bs,), 20) if seq_lens is None else seq_lens
    backend = target_backend(mode)
    runtime = TORCH(mode, impl="torch")
    with engine_patches.activated(runtime):
        worker = draft_worker_double(draft_table, TOPK, STEPS, NODES, backend)
        verify_input = run_draft(monkeypatch, worker, draft_table, bonus, seq_lens)
    logits = target_table[verify_input.draft_token]  # [bs * T, V]
    batch = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, seq_lens=seq_lens, device="cpu",
                                  sampling_info=info)  # fmt: skip
    output = types.SimpleNamespace(next_token_logits=logits.clone())
    if active:
        with engine_patches.activated(runtime):
            predict, accept_lens, accept_index = eagle_utils.eagle_sample(verify_input, batch, output)
    else:
        predict, accept_lens, accept_index = eagle_utils.eagle_sample(verify_input, batch, output)
    emitted_mask = torch.arange(accept_index.shape[1])[None, :] < accept_lens[:, None]
    assert bool((accept_index[emitted_mask] >= 0).all()) and bool((accept_index[~emitted_mask] == -1).all())
    emitted = torch.where(emitted_mask, predict.long()[accept_index.long().clamp(min=0)], -1)
    return emitted, accept_lens, verify_input


def transitions(bonus, emitted):
    """(previous token, emitted token) for every emitted token of every request."""
    previous = torch.cat([bonus[:, None], emitted[:, :-1]], dim=1)
    valid = emitted >= 0
    return previous[valid], emitted[valid]


def transition_test(bonus, emitted, target_table, settings, min_count=40):
    """Pooled chi-square of every emitted token against the target's law after
    its prefix (the Markov target: after its previous token)."""
    prev, nxt = transitions(bonus, emitted)
    tests = []
    for token in range(VOCAB):
        chosen = nxt[prev == token]
        if chosen.numel() < min_count:
            continue
        p = target_probs_of(target_table[token], **settings)
        tests.append(chisquare.goodness_of_fit(torch.bincount(chosen, minlength=VOCAB), p))
    assert len(tests) >= 3, "too few prefixes observed to test"
    return chisquare.combined(tests)[2]


MODE_SETTINGS = dict(temperature=0.8, top_k=8)


@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.name)
def test_emitted_tokens_follow_the_target_in_every_mask_mode(monkeypatch, mode):
    """Worker level, each mask mode: the first emitted token of each request is
    distributed as the target's p(. | last token) (chi-square per last token),
    and so is every later emitted token given its prefix (pooled)."""
    torch.manual_seed(int(mode) + 11)  # SGLang's coins and our exponentials: the default generator
    target_table, draft_table = markov_tables()
    bs = 6000
    bonus = torch.tensor([3, 7, 11]).repeat(bs // 3)
    emitted, accept_lens, verify_input = speculate(
        monkeypatch, mode, sampling_info(bs, **MODE_SETTINGS), bonus, target_table, draft_table
    )
    assert int(verify_input.custom_mask.numel()) > 0
    assert float((accept_lens > 1).float().mean()) > 0.4  # the tree walk is exercised, not just the root draw
    assert int(accept_lens.max()) >= 4
    for token in (3, 7, 11):
        first = emitted[bonus == token, 0]
        law = target_probs_of(target_table[token], **MODE_SETTINGS)
        stat, dof, p = chisquare.goodness_of_fit(torch.bincount(first, minlength=VOCAB), law)
        assert p > ALPHA, (token, stat, dof)
    assert transition_test(bonus, emitted, target_table, MODE_SETTINGS) > ALPHA


SETTINGS = [
    pytest.param(dict(temperature=0.7), id="temperature"),
    pytest.param(dict(temperature=1.0, top_k=5), id="top_k"),
    pytest.param(dict(temperature=1.3, top_p=0.8), id="top_p"),
    pytest.param(dict(temperature=1.2, top_k=10, min_p=0.15), id="top_k-min_p"),
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_first_tokens_agree_with_and_without_speculation(monkeypatch, settings):
    """The issue's two-sample test: the first sampled token with tree
    speculation (SGLang's eagle_sample with our hooks) against SGLang's own
    non-speculative sampler on the same target logits; and every emitted token
    against the target's law after its prefix."""
    torch.manual_seed(5)
    target_table, draft_table = markov_tables(1)
    bs = 6000
    bonus = torch.tensor([2, 9]).repeat(bs // 2)
    info = sampling_info(bs, **settings)
    mode = TreeMaskMode.ANCESTOR_BITMASK
    emitted, accept_lens, _ = speculate(monkeypatch, mode, info, bonus, target_table, draft_table)
    assert float((accept_lens > 1).float().mean()) > 0.3
    direct = sglang_direct_samples(target_table[bonus], **settings)
    for token in (2, 9):
        rows = bonus == token
        stat, dof, p = chisquare.two_sample(
            torch.bincount(emitted[rows, 0], minlength=VOCAB), torch.bincount(direct[rows], minlength=VOCAB),
            min_count=1,
        )
        assert p > ALPHA, (token, stat, dof)
    assert transition_test(bonus, emitted, target_table, settings) > ALPHA


def test_the_statistical_checks_can_fail(monkeypatch):
    """The same checks reject: a wrong target law; a broken final draw
    (constant exponentials: the residual's argmax); min-p left out (what SGLang's
    eagle_sample alone does); and SGLang's own CPU path (hooks inactive: it
    verifies sampled batches greedily)."""
    target_table, draft_table = markov_tables(1)
    bs = 6000
    bonus = torch.tensor([2, 9]).repeat(bs // 2)
    rows = bonus == 2
    settings = dict(temperature=1.2, top_k=10)
    mode = TreeMaskMode.ANCESTOR_BITMASK

    def first_token_pvalue(emitted, law):
        return chisquare.goodness_of_fit(torch.bincount(emitted[rows, 0], minlength=VOCAB), law)[2]

    def run(settings, bonus=bonus, **kwargs):
        torch.manual_seed(5)
        emitted, _, _ = speculate(monkeypatch, mode, sampling_info(bonus.numel(), **settings), bonus, target_table,
                                  draft_table, **kwargs)  # fmt: skip
        return emitted

    law = target_probs_of(target_table[2], **settings)
    good = run(settings)
    assert first_token_pvalue(good, law) > ALPHA
    assert transition_test(bonus, good, target_table, settings) > ALPHA
    # 1. a wrong law: another temperature
    assert first_token_pvalue(good, target_probs_of(target_table[2], **dict(settings, temperature=1.0))) < 1e-6
    # 2. a broken variant: the final draw without its exponentials
    real_exponentials = layout.verify_exponentials
    monkeypatch.setattr(layout, "verify_exponentials", lambda bs, vocab, *a, **k: torch.ones(bs, vocab))
    broken = run(settings)
    monkeypatch.setattr(layout, "verify_exponentials", real_exponentials)
    assert first_token_pvalue(broken, law) < 1e-6
    assert transition_test(bonus, broken, target_table, settings) < 1e-6
    # 3. min-p not applied (eagle_sample without our context hook)
    with_min_p = dict(settings, min_p=0.15)
    real_context = layout.verify_context_of
    monkeypatch.setattr(layout, "verify_context_of", lambda batch: layout.VerifyContext(batch.seq_lens))
    no_min_p = run(with_min_p)
    monkeypatch.setattr(layout, "verify_context_of", real_context)
    direct = sglang_direct_samples(target_table[bonus], **with_min_p)
    counts = torch.bincount(direct[rows], minlength=VOCAB)

    def two_sample_pvalue(emitted):
        return chisquare.two_sample(torch.bincount(emitted[rows, 0], minlength=VOCAB), counts, min_count=1)[2]

    assert two_sample_pvalue(run(with_min_p)) > ALPHA
    assert two_sample_pvalue(no_min_p) < 1e-6
    # 4. SGLang's own CPU behaviour: argmax whatever the temperature. Its greedy
    # verify there is sgl_kernel's CPU op (not installed): SGLang's Triton
    # version stands in (interpreted, hence a smaller batch).
    monkeypatch.setattr(spec_tree, "_is_cpu", True)
    def cpu_op_double(retrive_index, retrive_next_token, retrive_next_sibling, **kwargs):
        spec_tree.verify_tree_greedy_triton(retrieve_index=retrive_index, retrieve_next_token=retrive_next_token,
                                            retrieve_next_sibling=retrive_next_sibling, **kwargs)  # fmt: skip

    monkeypatch.setattr(spec_tree, "sgl_verify_tree_greedy_cpu", cpu_op_double, raising=False)
    small = torch.tensor([2, 9]).repeat(150)
    greedy = run(settings, bonus=small, active=False)
    assert bool((greedy[small == 2, 0] == target_table[2].argmax()).all())
    counts = torch.bincount(greedy[small == 2, 0], minlength=VOCAB)
    assert chisquare.goodness_of_fit(counts, law)[2] < 1e-6


# ---------------------------------------------------------- seeded requests


def murmur_hash32_torch(seed, positions, col_indices):
    """Torch port of SGLang's Triton ``murmur_hash32_kernel`` (test double for
    CPU tensors: SGLang sends those to sgl_kernel's CPU op, not installed here)."""
    mask = 0xFFFFFFFF

    def rotl(x, r):
        return ((x << r) | (x >> (32 - r))) & mask

    def mix(h, k):
        k = (k * 0xCC9E2D51) & mask
        k = rotl(k, 15)
        k = (k * 0x1B873593) & mask
        h = rotl(h ^ k, 13)
        return (h * 5 + 0xE6546B64) & mask

    seed = seed.to(torch.int64)[:, None]
    pos = (positions.to(torch.int64) & mask)[:, None]
    col = (col_indices.to(torch.int64) & mask)[None, :]
    h = torch.zeros_like(seed)
    h = mix(h, seed & mask)
    h = mix(h, (seed >> 32) & mask)
    h = mix(h, pos)
    h = mix(h.expand(-1, col.shape[1]), col.expand(h.shape[0], -1))
    h = h ^ 16
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & mask
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & mask
    h = h ^ (h >> 16)
    return h.to(torch.uint32)


def test_murmur_port_equals_sglang_triton_kernel():
    seed = (torch.tensor([0, 1, 42, 2**40 + 3, -5]) + layout.VERIFY_EXP_SEED_SALT).to(torch.uint64)
    positions = torch.tensor([0, 7, 19, 2**33 + 1, 3]).to(torch.uint64)
    cols = torch.arange(20, dtype=torch.int64)
    theirs = torch.empty((5, 20), dtype=torch.uint32)
    murmur_hash.murmur_hash32_kernel[(5, triton.cdiv(20, 1024))](seed, positions, cols, theirs, 5, 20, BLOCK_SIZE=1024)
    assert torch.equal(murmur_hash32_torch(seed, positions, cols), theirs)


def test_seeded_requests_reproduce_and_follow_the_target(monkeypatch):
    """With per-request seeds (``--enable-deterministic-inference``): SGLang's
    coins and our exponentials both come from murmur hashes of (seed,
    seq_len), so a step reproduces whatever the global generator did, other
    seeds give other draws, and over many seeds the law is the target's."""
    monkeypatch.setattr(murmur_hash, "murmur_hash32", murmur_hash32_torch)
    target_table, draft_table = markov_tables(2)
    bs = 4000
    bonus = torch.tensor([4, 13]).repeat(bs // 2)
    seq_lens = torch.full((bs,), 33)
    settings = dict(temperature=0.9, top_k=7)

    def step(seeds, global_seed):
        torch.manual_seed(global_seed)
        info = sampling_info(bs, seed=seeds, **settings)
        emitted, _, _ = speculate(monkeypatch, TreeMaskMode.PARENT_POINTER, info, bonus, target_table, draft_table,
                                  seq_lens=seq_lens)  # fmt: skip
        return emitted

    seeds = torch.arange(bs) * 7919 + 1
    first, again = step(seeds, 0), step(seeds, 12345)
    assert torch.equal(first, again)
    other = step(seeds + 1, 0)
    assert float((other[:, 0] != first[:, 0]).float().mean()) > 0.2
    for token in (4, 13):
        stat, dof, p = chisquare.goodness_of_fit(torch.bincount(first[bonus == token, 0], minlength=VOCAB),
                                                 target_probs_of(target_table[token], **settings))  # fmt: skip
        assert p > ALPHA, (token, stat, dof)
    assert transition_test(bonus, first, target_table, settings) > ALPHA
    # the exponentials' stream is apart from SGLang's coins (same seed and seq_len, other salt)
    coins, _ = eagle_utils._verify_coins(sampling_info=sampling_info(4, seed=seeds[:4]), seq_lens=seq_lens[:4],
                                         draft_token_num=NODES, candidates=torch.zeros(4, NODES), device="cpu")  # fmt: skip
    exps = layout.verify_exponentials(4, VOCAB, "cpu", sampling_seed=seeds[:4], seq_lens=seq_lens[:4])
    assert not torch.allclose(torch.exp(-exps[:, :NODES]), coins, atol=1e-3)


# ------------------------------------------------------------- the layout


def hand_tree():
    """Two requests, T = 4, flat retrieve_index b * T + i.
    Request 0: root -> 1 (token 5) -> 3 (token 2); root -> 2 (token 7).
    Request 1: root -> 1 (token 3), 2 (token 3, a duplicate), 3 (token 6)."""
    next_token = torch.tensor([[1, 3, -1, -1], [1, -1, -1, -1]])
    next_sibling = torch.tensor([[-1, 2, -1, -1], [-1, 2, 3, -1]])
    candidates = torch.tensor([[9, 5, 7, 2], [9, 3, 3, 6]])
    retrieve_index = torch.arange(8).view(2, 4)
    return candidates, retrieve_index, next_token, next_sibling


def sglang_outputs(bs, nodes, depth, fill=0):
    """What eagle_sample allocates (predict filled with a sentinel here, to see
    what is written)."""
    return (
        torch.full((bs * nodes,), fill, dtype=torch.int32),
        torch.full((bs, depth + 1), -1, dtype=torch.int32),
        torch.empty((bs,), dtype=torch.int32),
    )


def test_hand_checked_case():
    """Request 0: node 1 (p 0.5, coin 0.2) is accepted; its child node 3 (p 0.1,
    coin 0.9) is rejected, and the final draw at node 1 picks token 4 (the
    exponentials make it win). Request 1: node 1 (p 0.3, coin 0.95) is rejected,
    its duplicate node 2 has no mass left, node 3 (token 6, p 0.2, coin 0.5:
    0.5 * 0.7 < 0.2 fails) is rejected; the final draw at the root, with
    tokens 3 and 6 removed, picks token 0."""
    candidates, r_index, r_next, r_sib = hand_tree()
    probs = torch.full((2, 4, 8), 0.0)
    probs[0, 0] = torch.tensor([0.0, 0.1, 0.0, 0.0, 0.0, 0.5, 0.1, 0.3])
    probs[0, 1] = torch.tensor([0.2, 0.0, 0.1, 0.0, 0.5, 0.0, 0.0, 0.2])
    probs[1, 0] = torch.tensor([0.25, 0.0, 0.0, 0.3, 0.0, 0.0, 0.2, 0.25])
    probs[:, 2:] = 1.0 / 8
    probs[1, 1] = 1.0 / 8
    coins = torch.tensor([[0.0, 0.2, 0.99, 0.9], [0.0, 0.95, 0.0, 0.5]])
    exps = torch.ones(2, 8)
    exps[0, 4] = 0.1  # token 4: 0.5 / 0.1 beats 0.2 / 1
    exps[1, 0] = 0.5  # token 0: 0.25 / 0.5 beats 0.25 / 1
    predicts, accept_index, accept_num = sglang_outputs(2, 4, 3, fill=-7)
    layout.verify_tree_sampling_sglang_layout(
        predicts, accept_index, accept_num, candidates, r_index, r_next, r_sib, coins, torch.rand(2), probs,
        torch.zeros_like(probs), impl="torch", exponentials=exps,
    )  # fmt: skip
    assert accept_num.tolist() == [1, 0]
    assert accept_index.tolist() == [[0, 1, -1, -1], [4, -1, -1, -1]]
    assert predicts.tolist() == [5, 4, -7, -7, 0, -7, -7, -7]


def sglang_kernel_transcription(candidates, r_index, r_next, r_sib, coins, final_coins, probs, depth):
    """SGLang's TreeSpeculativeSamplingTargetOnly (speculative/sampling.cuh,
    thresholds 1) transcribed per request (its CUDA JIT cannot run here)."""
    bs, nodes = candidates.shape
    predicts, accept_index, accept_num = sglang_outputs(bs, nodes, depth)
    draft = torch.zeros_like(probs)
    for b in range(bs):
        prob_acc, cur_prob, coin = 0.0, (b, 0), float(coins[b, 0])
        last = int(r_index[b, 0])
        accept_index[b, 0] = last
        accepted, cur = 0, 0
        for _ in range(1, depth + 1):
            cur = int(r_next[b, cur])
            while cur != -1:
                token = int(candidates[b, cur])
                p = float(probs[cur_prob][token])
                prob_acc += p
                if p > 0 and coin < prob_acc:
                    prob_acc, cur_prob, coin = 0.0, (b, cur), float(coins[b, cur])
                    predicts[last] = token
                    accepted += 1
                    accept_index[b, accepted] = int(r_index[b, cur])
                    last = int(r_index[b, cur])
                    break
                draft[cur_prob][token] = probs[cur_prob][token]
                cur = int(r_sib[b, cur])
            if cur == -1:
                break
        accept_num[b] = accepted
        q = probs[cur_prob] - (draft[cur_prob] if accepted != depth else 0)
        residual = q.clamp(min=0)
        cdf = residual.cumsum(0)
        u = float(final_coins[b]) * float(cdf[-1])
        predicts[last] = int((cdf > u).nonzero()[0]) if bool((cdf > u).any()) else probs.shape[-1] - 1
    return predicts, accept_index, accept_num


def random_tree(gen, bs, vocab=6):
    parent_list = _testing.random_parent_list(gen, bs, TOPK, STEPS)
    selected = stk.select_tree_nodes(torch.rand(bs, stk.pool_size(TOPK, STEPS), generator=gen), parent_list, TOPK,
                                     STEPS, NODES)  # fmt: skip
    seq_lens = torch.randint(5, 30, (bs,), generator=gen)
    draft_tokens = torch.randint(0, vocab, (bs, NODES - 1), generator=gen)  # small vocab: duplicate siblings
    bonus = torch.randint(0, vocab, (bs,), generator=gen)
    _, _, r_index, r_next, r_sib, tokens = layout.build_tree_sglang_layout(
        bonus, parent_list, selected, draft_tokens, seq_lens, int(seq_lens.sum()), TOPK, STEPS, NODES,
        TreeMaskMode.QLEN_ONLY,
    )  # fmt: skip
    return tokens.view(bs, NODES), r_index, r_next, r_sib


def test_layout_equals_sglang_kernel_on_one_hot_targets():
    """One-hot targets (the greedy requests of a sampled batch: top_k = 1)
    make both laws deterministic: our drop-in and SGLang's kernel write the
    same three outputs."""
    gen = torch.Generator().manual_seed(3)
    bs, vocab = 64, 6
    accepted_deep = 0
    for trial in range(3):
        candidates, r_index, r_next, r_sib = random_tree(gen, bs, vocab)
        best = torch.randint(0, vocab, (bs, NODES), generator=gen)
        probs = torch.nn.functional.one_hot(best, vocab).float()
        coins, final = torch.rand(bs, NODES, generator=gen), torch.rand(bs, generator=gen)
        ours = sglang_outputs(bs, NODES, STEPS)
        layout.verify_tree_sampling_sglang_layout(*ours, candidates, r_index, r_next, r_sib, coins, final,
                                                          probs, torch.zeros_like(probs), impl="torch")  # fmt: skip
        theirs = sglang_kernel_transcription(candidates, r_index, r_next, r_sib, coins, final, probs, STEPS)
        for a, b in zip(ours, theirs):
            assert a.tolist() == b.tolist()
        accepted_deep += int((ours[2] >= 2).sum())
        # and they are the greedy verify's
        greedy = sglang_outputs(bs, NODES, STEPS)
        layout.verify_tree_greedy_sglang_layout(*greedy, candidates, r_index, r_next, r_sib, best, impl="torch")
        for a, b in zip(ours, greedy):
            assert a.tolist() == b.tolist()
    assert accepted_deep > 10


def peak_cpu_bytes(function) -> int:
    """The most bytes ``function`` holds at once beyond what it was handed, by
    torch.profiler's memory records (each op's own allocations and frees, in
    the order the ops started)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        function()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak


def min_p_reference(probs, min_ps):
    """Min-p as SGLang's sampler applies it, out of place."""
    kept = torch.where(probs >= probs.max(dim=-1, keepdim=True).values * min_ps[:, None], probs, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


@pytest.mark.parametrize("chunk_rows", [None, 5], ids=["one-chunk", "chunks-of-5-rows"])
def test_min_p_renormalises_sglangs_target_probs_in_place(monkeypatch, chunk_rows):
    """With min-p the sampled verify renormalises ``target_probs`` (SGLang's
    buffer, made for this call and dropped after it) in place: the same
    probabilities, bit for bit, as the out-of-place formula and the same
    outputs, without an fp32 [bs * T, V] copy SGLang's memory planner never
    saw (about 0.2 GB at bs 48, T 8, 128k vocabulary): what min-p adds to the
    call's peak stays within one bool mask of the rows."""
    if chunk_rows is not None:
        from spec_plugins import tree_drafting

        monkeypatch.setattr(tree_drafting, "FLOAT32_CHUNK_ELEMENTS", chunk_rows * 4096)
    gen = torch.Generator().manual_seed(6)
    bs, vocab = 8, 4096
    rows = bs * NODES
    candidates, r_index, r_next, r_sib = random_tree(gen, bs)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    min_ps = torch.rand(bs, generator=gen) * 0.3
    coins, final = torch.rand(bs, NODES, generator=gen), torch.rand(bs, generator=gen)
    exponentials = torch.empty(bs, vocab).exponential_(generator=gen)
    draft_probs = torch.zeros(bs, NODES, vocab)
    expected_probs = min_p_reference(torch.softmax(logits, dim=-1), min_ps.repeat_interleave(NODES))

    def verify(probs, context, outputs):
        layout.verify_tree_sampling_sglang_layout(
            *outputs, candidates, r_index, r_next, r_sib, coins, final, probs, draft_probs, impl="torch",
            exponentials=exponentials, context=context,
        )  # fmt: skip

    target_probs = torch.softmax(logits, dim=-1).view(bs, NODES, vocab)  # what eagle_sample hands the kernel
    ours = sglang_outputs(bs, NODES, STEPS)
    with_min_p = peak_cpu_bytes(lambda: verify(target_probs, layout.VerifyContext(None, min_ps=min_ps), ours))
    reference, renormalised = sglang_outputs(bs, NODES, STEPS), expected_probs.view(bs, NODES, vocab).clone()
    without_min_p = peak_cpu_bytes(lambda: verify(renormalised, None, reference))
    assert with_min_p - without_min_p <= rows * vocab, (with_min_p, without_min_p, rows * vocab * 4)
    assert torch.equal(target_probs.view(rows, vocab), expected_probs)
    for a, b in zip(ours, reference):
        assert torch.equal(a, b)


def test_layout_is_our_op_mapped_through_retrieve_index():
    """Random targets, randoms given: the drop-in's outputs are
    ``verify_tree_sampling``'s, node indices mapped through a (shuffled)
    retrieve_index, by a plain loop."""
    gen = torch.Generator().manual_seed(4)
    bs, vocab = 40, 6
    candidates, _, r_next, r_sib = random_tree(gen, bs, vocab)
    shuffled = torch.stack([torch.randperm(NODES, generator=gen) for _ in range(bs)])
    r_index = shuffled + (torch.arange(bs) * NODES)[:, None]
    probs = torch.softmax(torch.randn(bs, NODES, vocab, generator=gen) * 2, -1)
    coins, exps = torch.rand(bs, NODES, generator=gen), torch.empty(bs, vocab).exponential_(generator=gen)
    predicts, accept_index, accept_num = sglang_outputs(bs, NODES, STEPS, fill=-7)
    layout.verify_tree_sampling_sglang_layout(
        predicts, accept_index, accept_num, candidates, r_index, r_next, r_sib, coins, torch.rand(bs), probs,
        torch.zeros_like(probs), impl="torch", exponentials=exps,
    )  # fmt: skip
    result = stk.verify_tree_sampling(candidates, r_next, r_sib, probs, coins, exps, STEPS, impl="torch")
    expect_predicts = [-7] * (bs * NODES)
    for b in range(bs):
        length = int(result.accept_length[b])
        assert int(accept_num[b]) == length
        for d in range(STEPS + 1):
            node = int(result.accept_index[b, d])
            if d > length:
                assert node == -1 and int(accept_index[b, d]) == -1
                continue
            assert int(accept_index[b, d]) == int(r_index[b, node])
            expect_predicts[int(r_index[b, node])] = int(result.accept_tokens[b, d])
    assert predicts.tolist() == expect_predicts
    assert int(accept_num.max()) >= 2


def test_thresholds_passed_anyway_are_ignored(caplog):
    """Refused at startup and on update; should one still reach the drop-in,
    it verifies exactly (same outputs) and says so."""
    gen = torch.Generator().manual_seed(6)
    candidates, r_index, r_next, r_sib = random_tree(gen, 8)
    probs = torch.softmax(torch.randn(8, NODES, 6, generator=gen), -1)
    coins, exps = torch.rand(8, NODES, generator=gen), torch.ones(8, 6)
    runs = []
    for thresholds in ((1.0, 1.0), (0.3, 0.5)):
        out = sglang_outputs(8, NODES, STEPS)
        layout.verify_tree_sampling_sglang_layout(*out, candidates, r_index, r_next, r_sib, coins, None, probs,
                                                          None, *thresholds, impl="torch", exponentials=exps)  # fmt: skip
        runs.append([t.tolist() for t in out])
    assert runs[0] == runs[1]
    assert "accept thresholds single=0.3 acc=0.5 ignored" in caplog.text


# ------------------------------------------------- renorms, refusals, hooks


def sglang_renorm_on_cpu(monkeypatch):
    """SGLang's HIP renorm fallback (Triton, interpreted) with its CUDA-tensor
    check lifted (test double of ``_prepare_probs``): the reference semantics."""
    monkeypatch.setattr(renorm_triton, "_prepare_probs", lambda probs: probs.float().contiguous())
    return renorm_triton.top_k_renorm_probs_triton, renorm_triton.top_p_renorm_probs_triton


def test_renorm_drop_ins_equal_sglangs_fallback(monkeypatch):
    top_k_theirs, top_p_theirs = sglang_renorm_on_cpu(monkeypatch)
    gen = torch.Generator().manual_seed(8)
    probs = torch.softmax(torch.randn(6, 40, generator=gen) * 2, -1)
    probs[0, :4] = probs[0].max()  # ties at a top-k pivot are all kept
    probs[0] /= probs[0].sum()
    top_ks = torch.tensor([2, 1, 5, 40, 1 << 30, 7], dtype=torch.int32)
    top_ps = torch.tensor([0.5, 0.9, 0.99, 1.0, 0.1, 0.75])
    torch.testing.assert_close(layout.top_k_renorm_prob_torch(probs, top_ks), top_k_theirs(probs, top_ks))
    torch.testing.assert_close(layout.top_p_renorm_prob_torch(probs, top_ps), top_p_theirs(probs, top_ps))
    torch.testing.assert_close(layout.top_k_renorm_prob_torch(probs, 3), top_k_theirs(probs, 3))
    assert int((layout.top_k_renorm_prob_torch(probs, top_ks)[0] > 0).sum()) >= 4


THRESHOLD_FLAGS = [
    pytest.param("speculative_accept_threshold_single", "--speculative-accept-threshold-single", id="single"),
    pytest.param("speculative_accept_threshold_acc", "--speculative-accept-threshold-acc", id="acc"),
]


@pytest.mark.parametrize("field,flag", THRESHOLD_FLAGS)
def test_relaxed_thresholds_are_refused_at_startup(ckpt, field, flag):
    with pytest.raises(ValueError, match=f"does not support {flag} 0.7: a relaxed acceptance threshold is lossy"):
        publish(ckpt, **{field: 0.7})
    publish(ckpt, **{field: 1.0})  # the default is fine


def test_sglang_refuses_its_rejection_sampler_for_eagle_tree(ckpt):
    """docs/sglang.md: rejection sampling (SGLang's chain sampler, not ours) is refused;
    SGLang's EAGLE-family resolution does it for any other algorithm name."""
    with pytest.raises(NotImplementedError, match="only supported for EAGLE / EAGLE3"):
        publish(ckpt, speculative_use_rejection_sampling=True)


@pytest.mark.parametrize("field,flag", THRESHOLD_FLAGS)
def test_relaxed_thresholds_are_refused_at_runtime(field, flag):
    """SGLang lets ``/update_internal_state`` change the thresholds of a running
    server: in our worker's process the update is rejected (SGLang's own
    validator, untouched elsewhere). The controller's scheduler is a namespace."""
    controller = object.__new__(SchedulerInternalStateController)
    controller.scheduler = types.SimpleNamespace(spec_algorithm=types.SimpleNamespace(is_dflash=lambda: False))
    controller._validate_accept_threshold(field, 0.5)  # inactive: SGLang's rule (only DFlash refuses)
    with engine_patches.activated(TORCH(TreeMaskMode.ANCESTOR_BITMASK, impl="torch")):
        controller._validate_accept_threshold(field, 1.0)
        with pytest.raises(UpdateRejected, match=f"updating {field} to 0.5 is rejected"):
            controller._validate_accept_threshold(field, 0.5)
        with pytest.raises(UpdateRejected):  # through the handler table SGLang applies updates with
            controller._update_handlers()[field].validate(field, 0.9)


def test_hooks_delegate_when_inactive():
    """Outside an EAGLE_TREE worker everything is SGLang's: on this CPU build
    its sampling kernel and renorms are None, so the filled bindings fail as
    calling None does, ``_verify_uses_greedy`` forces greedy on CPU, and other
    modules' None names are untouched (a HookRegistry hook on a None target
    would have been propagated to every None global)."""
    assert verify_sampling.tree_speculative_sampling_target_only is None  # this platform has no kernel
    assert renorm.top_k_renorm_prob is None and renorm.top_p_renorm_prob is None
    assert engine_patches.HOOK_SAMPLE not in HookRegistry._hooks  # not registered on a None target
    for name, _ in engine_patches.SLOTS:
        slot = getattr(eagle_utils, name)
        assert isinstance(slot, engine_patches.KernelSlot)
        with pytest.raises(TypeError, match=f"SGLang has no {name} kernel"):
            slot(torch.ones(1, 2), 1) if "renorm" in name else slot()
    kwargs = dict(is_all_greedy=False, is_cpu=True, is_hip=False, is_xpu=False, use_rejection_sampling=False)
    assert eagle_utils._verify_uses_greedy(**kwargs) is True  # SGLang's CPU rule
    with engine_patches.activated(TORCH(TreeMaskMode.FULL_MASK, impl="torch")):
        assert eagle_utils._verify_uses_greedy(**kwargs) is False
        assert eagle_utils._verify_uses_greedy(**dict(kwargs, is_all_greedy=True)) is True
        assert eagle_utils._verify_uses_greedy(**dict(kwargs, use_rejection_sampling=True)) is True  # SGLang's
        probs = torch.tensor([[0.5, 0.3, 0.2]])
        assert eagle_utils.top_k_renorm_prob(probs, torch.tensor([2])).tolist() == [[0.625, 0.375, 0.0]]
    # where SGLang has a kernel (CUDA), the AROUND hook calls it unless active
    calls = []
    engine_patches._sample_hook(lambda *a, **k: calls.append((a, k)), "args", threshold_acc=1.0)
    assert calls == [(("args",), {"threshold_acc": 1.0})]


def test_active_hook_runs_our_op_with_the_workers_impl(monkeypatch):
    """Active, the kernel SGLang has is not called; our op runs with the
    worker's implementation choice ("auto" in the worker: the fastest for the
    device)."""
    seen = []
    real = stk.verify_tree_sampling
    monkeypatch.setattr(stk, "verify_tree_sampling", lambda *a, impl: seen.append(impl) or real(*a, impl="torch"))
    gen = torch.Generator().manual_seed(9)
    candidates, r_index, r_next, r_sib = random_tree(gen, 4)
    probs = torch.softmax(torch.randn(4, NODES, 6, generator=gen), -1)
    out = sglang_outputs(4, NODES, STEPS)
    sglang_kernel = []
    with engine_patches.activated(TORCH(TreeMaskMode.PARENT_POINTER, impl="triton")):
        engine_patches._sample_hook(lambda *a, **k: sglang_kernel.append(a), *out, candidates, r_index, r_next, r_sib,
                                    torch.rand(4, NODES), torch.rand(4), probs, torch.zeros_like(probs))  # fmt: skip
    assert seen == ["triton"] and sglang_kernel == []
    assert int(out[2].min()) >= 0
    # eagle_sample's wrapper is the one its callers hold
    from sglang.srt.speculative import eagle_worker_common

    assert eagle_worker_common.eagle_sample is eagle_utils.eagle_sample
    assert eagle_utils.eagle_sample.__wrapped__ is not None


def test_sampling_drop_in_takes_what_sglang_passes():
    """Parameters (names, order, defaults) of SGLang's CUDA kernel wrapper,
    plus keyword-only extras; the renorm drop-ins take SGLang's positional
    (probs, top_k / top_p)."""
    import inspect

    theirs = list(inspect.signature(inspect.unwrap(sglang_cuda_kernel)).parameters.values())
    ours = [
        p for p in inspect.signature(layout.verify_tree_sampling_sglang_layout).parameters.values()
        if p.kind != p.KEYWORD_ONLY
    ]  # fmt: skip
    assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in theirs]
    for ours_fn, theirs_fn in ((layout.top_k_renorm_prob_torch, renorm_triton.top_k_renorm_probs_triton),
                               (layout.top_p_renorm_prob_torch, renorm_triton.top_p_renorm_probs_triton)):
        assert list(inspect.signature(ours_fn).parameters) == list(inspect.signature(theirs_fn).parameters)
