"""Issue #39 (2), kernels: sliding windows, attention sinks, soft-cap and ALiBi
in tree attention, every implementation, against an independent float64
oracle written here.

The oracle shares no code with the module: depths come from the parent
arrays (``make_tree`` of test_tree_attention), the logical positions are
spelled out (committed token j at j, tree node m at ctx + depth(m)), the
visibility of each (query, key) pair is an explicit Python predicate
(committed or ancestor-or-self, and ``p - k < W``), and attention is a
float64 softmax per row with the sink appended as one more logit. K/V come
in logical order from the same ``Problem`` / ``Draft`` objects the other
attention tests scatter into NaN-filled paged caches through random block
tables.

Covered: the torch reference, the torch plan, the host C kernel (generic
and vLLM-CPU vectorized layouts), the Triton single-pass and split-KV
kernels (TRITON_INTERPRET=1 here), and the draft-step attention (torch,
Triton single / split, host kernel); windows smaller than, equal to and
larger than the context and windows that cut into the tree (W = 1..3 on
deep chains and random trees); sinks, soft-cap, ALiBi, all together; GQA and
not; block sizes 1, 8, 16, 32. Bad inputs raise naming the value. The
warm-up test for feature variants is at the end.
"""

from __future__ import annotations

import random

import pytest
import torch

from kernel_device import DEVICE as _DEVICE_NAME
from spec_tree_kernels import cpu_attention
from spec_tree_kernels.api import triton_usable
from spec_tree_kernels.attention import features_from_vllm, tree_attention, tree_attention_reference
from spec_tree_kernels.attention_plan import TreeAttentionPlan
from spec_tree_kernels.branch_attention import BranchAttentionPlan
from spec_tree_kernels.modes import TreeMaskMode
from test_branch_attention import Draft
from test_tree_attention import TOL, Problem, ancestors_or_self, cpu_layout, finite_problem, make_tree

AB, PP, QL = TreeMaskMode.ANCESTOR_BITMASK, TreeMaskMode.PARENT_POINTER, TreeMaskMode.QLEN_ONLY
DEVICE = torch.device(_DEVICE_NAME)
CPU = torch.device("cpu")
needs_triton = pytest.mark.skipif(not triton_usable(DEVICE), reason="Triton needs CUDA or TRITON_INTERPRET=1")
needs_cc = pytest.mark.skipif(cpu_attention.find_compiler() is None, reason="no host C compiler to build the kernel")


# ------------------------------------------------------------------ oracle


def depths_of(parent: list[int]) -> list[int]:
    out = []
    for i in range(len(parent)):
        d, cur = 0, i
        while parent[cur] >= 0:
            cur, d = parent[cur], d + 1
        out.append(d)
    return out


def feature_values(hq: int, spec: dict, seed: int = 0) -> dict:
    """The keyword arguments of ``spec`` (window int, sinks / alibi True,
    soft_cap float) with seeded values: sinks around the scores' scale (some
    dominate a row), slopes as ALiBi's 2^(-8 i / Hq) times a random sign-free jitter."""
    gen = torch.Generator().manual_seed(seed)
    kw = {}
    if spec.get("window") is not None:
        kw["window"] = spec["window"]
    if spec.get("sinks"):
        kw["sinks"] = 2.0 * torch.randn(hq, generator=gen)
    if spec.get("soft_cap") is not None:
        kw["soft_cap"] = spec["soft_cap"]
    if spec.get("alibi"):
        kw["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (i + 1) / hq) for i in range(hq)]) * (
            1 + torch.rand(hq, generator=gen))
    return kw


def on(kw: dict, device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def row_attention(q, keys, vals, kpos, qpos, scale, window=None, sinks_h=None, soft_cap=None, slope=None):
    """One query row, float64: keys [n, D], vals [n, D], kpos [n] positions of
    the keys the row may see before the window; returns [D]."""
    keep = [i for i in range(len(kpos)) if window is None or qpos - kpos[i] < window]
    k, v = keys[keep].double(), vals[keep].double()
    s = (k @ q.double()) * scale
    if soft_cap is not None:
        s = soft_cap * torch.tanh(s / soft_cap)
    if slope is not None:
        s = s + float(slope) * (torch.tensor([kpos[i] for i in keep], dtype=torch.float64) - qpos)
    if sinks_h is not None:
        s = torch.cat([s, torch.tensor([float(sinks_h)], dtype=torch.float64)])
    w = torch.softmax(s, 0)[: len(keep)]
    return w @ v


def verify_oracle(p: Problem, window=None, sinks=None, soft_cap=None, alibi_slopes=None) -> torch.Tensor:
    """[B, T, Hq, D] float64: node t of request b (position ctx + depth(t))
    attends committed tokens j (position j) and its ancestors-or-self m
    (position ctx + depth(m)), those with p - k < window."""
    batch, nodes, hq, dim = p.q.shape
    hkv = p.k[0].shape[1]
    group = hq // hkv
    out = torch.empty(batch, nodes, hq, dim, dtype=torch.float64)
    for b, ctx in enumerate(p.ctx_lens):
        depth, anc = depths_of(p.parents[b]), ancestors_or_self(p.parents[b])
        for t in range(nodes):
            slots = list(range(ctx)) + [ctx + m for m in sorted(anc[t])]
            kpos = list(range(ctx)) + [ctx + depth[m] for m in sorted(anc[t])]
            for h in range(hq):
                out[b, t, h] = row_attention(
                    p.q[b, t, h], p.k[b][slots, h // group], p.v[b][slots, h // group], kpos, ctx + depth[t], p.scale,
                    window, None if sinks is None else sinks[h], soft_cap,
                    None if alibi_slopes is None else alibi_slopes[h])
    return out


def draft_oracle(draft: Draft, q, ancestors, level, scale, window=None, sinks=None, soft_cap=None,
                 alibi_slopes=None) -> torch.Tensor:
    """[R, K, Hq, D] float64: the level's queries at kv_len + level - 1 see
    committed j (at j) and their visible branch entries e (at kv_len + e // K)."""
    R, K = len(draft.lens), draft.K
    group = draft.hq // draft.hkv
    filled = level * K
    bk, bv = draft.branch[0, :, :filled].float().cpu(), draft.branch[1, :, :filled].float().cpu()
    out = torch.empty(R, K, draft.hq, draft.dim, dtype=torch.float64)
    for r in range(R):
        n = draft.lens[r]
        for j in range(K):
            seen = [e for e in range(filled) if (e < filled - K and bool(ancestors[r, j, e])) or e == filled - K + j]
            kpos = list(range(n)) + [n + e // K for e in seen]
            keys_all = torch.cat([draft.ctx_k[r], bk[r][seen]])
            vals_all = torch.cat([draft.ctx_v[r], bv[r][seen]])
            for h in range(draft.hq):
                out[r, j, h] = row_attention(
                    q[r, j, h].float().cpu(), keys_all[:, h // group], vals_all[:, h // group], kpos, n + level - 1,
                    scale, window, None if sinks is None else sinks[h], soft_cap,
                    None if alibi_slopes is None else alibi_slopes[h])
    return out


def make_problem(kind, nodes, ctx, hq, hkv, dim, bs, mode, dtype=torch.float32, seed=0, finite=False) -> Problem:
    if finite:
        return finite_problem(kind, nodes, ctx, seed=seed, hq=hq, hkv=hkv, dim=dim, block_size=bs, dtype=dtype,
                              mode=mode)
    gen = torch.Generator().manual_seed(seed)
    parents = [make_tree(kind, nodes, gen) for _ in ctx]
    return Problem(ctx, parents, hq, hkv, dim, bs, dtype, mode, gen)


def check(actual, expected, dtype=torch.float32):
    atol, rtol = TOL[dtype]
    assert actual.shape == expected.shape
    assert torch.isfinite(actual.float()).all()
    torch.testing.assert_close(actual.float().cpu().double(), expected, atol=atol, rtol=rtol)


# ------------------------------------------------------------ oracle checks


def test_oracle_agrees_with_the_sdpa_dense_and_with_itself_at_the_limits():
    """No features: the oracle equals test_tree_attention's SDPA computation;
    a window past every position is no window; W = 1 shows a node only
    itself (out = its V); a sink of -inf-like size changes nothing."""
    p = make_problem("random", 9, [0, 13, 40], 4, 2, 16, 16, AB, seed=1)
    plain = verify_oracle(p)
    torch.testing.assert_close(plain.float(), p.dense().float(), atol=2e-6, rtol=1e-5)
    assert torch.equal(verify_oracle(p, window=40 + 9), plain)
    own = verify_oracle(p, window=1)
    for b, ctx in enumerate(p.ctx_lens):
        for t in range(9):
            expect = p.v[b][ctx + t].double().repeat_interleave(2, 0)
            torch.testing.assert_close(own[b, t], expect)
    torch.testing.assert_close(verify_oracle(p, sinks=torch.full((4,), -1e4)), plain)


# ----------------------------------------------------------------- verify

# kind, T, ctx_lens, Hq, Hkv, D, block size, mode, features
CASES = {
    "window_cuts_a_deep_chain": ("chain", 12, [0, 5, 30], 4, 2, 16, 16, AB, dict(window=3)),
    "window_1_only_self": ("random", 16, [7, 40], 4, 2, 16, 16, PP, dict(window=1)),
    "window_equals_context": ("binary", 15, [33], 6, 2, 16, 8, QL, dict(window=33)),
    "window_larger_than_context": ("random", 9, [20, 3], 4, 1, 16, 16, AB, dict(window=200)),
    "window_smaller_than_context_sinks": ("random", 10, [45, 17, 0], 4, 2, 16, 16, AB, dict(window=20, sinks=True)),
    "soft_cap_no_gqa_block_1": ("star", 8, [25, 2], 2, 2, 16, 1, PP, dict(soft_cap=0.5)),
    "alibi_gqa_4": ("random", 12, [30, 0], 8, 2, 16, 16, AB, dict(alibi=True)),
    "all_features": ("chain", 20, [50], 4, 2, 16, 16, PP, dict(window=6, sinks=True, soft_cap=3.0, alibi=True)),
    "deep_random_two_words": ("random", 70, [10], 2, 1, 16, 16, AB, dict(window=4, sinks=True)),
    "block_32_window_2": ("random", 14, [70, 31], 4, 2, 16, 32, QL, dict(window=2, soft_cap=1.0)),
}


def case_problem(name, finite=False, dtype=torch.float32):
    kind, nodes, ctx, hq, hkv, dim, bs, mode, spec = CASES[name]
    p = make_problem(kind, nodes, ctx, hq, hkv, dim, bs, mode, dtype=dtype, seed=len(name), finite=finite)
    return p, feature_values(hq, spec, seed=len(name))


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_oracle(name):
    p, kw = case_problem(name)
    out = tree_attention_reference(*p.args(CPU), **kw)
    check(out, verify_oracle(p, **kw))


@pytest.mark.parametrize("name", list(CASES))
def test_torch_plan_matches_oracle(name):
    p, kw = case_problem(name, finite=True)
    q, k_cache, v_cache, table, ctx, mask, mode, scale = p.args(CPU)
    plan = TreeAttentionPlan.create(table, ctx, mask, mode, p.nodes, k_cache.shape[1], max(p.ctx_lens), impl="torch")
    check(plan.run(q, k_cache, v_cache, scale, **kw), verify_oracle(p, **kw))


@needs_cc
@pytest.mark.parametrize("layout", ["contiguous", "cpu"])
@pytest.mark.parametrize("name", list(CASES))
def test_cpu_kernel_matches_oracle(name, layout):
    """The host kernel, generic-stride loops and vLLM-CPU's transposed K
    (vectorized where the block size is a multiple of the register block);
    NaN in every slot no request stored (the kernel never mixes them in)."""
    assert cpu_attention.build(), cpu_attention.build_error()
    p, kw = case_problem(name)
    q, k_cache, v_cache, table, ctx, mask, mode, scale = p.args(CPU)
    table = table.clamp(min=0)  # the plan reads its block ids directly (engines' spare entries are real blocks)
    if layout == "cpu":
        k_cache, v_cache = cpu_layout(k_cache, v_cache)
    plan = TreeAttentionPlan.create(table, ctx, mask, mode, p.nodes, k_cache.shape[1], max(p.ctx_lens), impl="cpu")
    assert plan.impl == "cpu" and cpu_attention.supports(q, k_cache, v_cache)
    check(plan.run(q, k_cache, v_cache, scale, **kw), verify_oracle(p, **kw))


TRITON_CASES = ["window_cuts_a_deep_chain", "window_1_only_self", "window_equals_context",
                "window_smaller_than_context_sinks", "soft_cap_no_gqa_block_1", "alibi_gqa_4", "all_features",
                "deep_random_two_words"]


@needs_triton
@pytest.mark.parametrize("kernel", ["single", "split"])
@pytest.mark.parametrize("name", TRITON_CASES)
def test_triton_matches_oracle(name, kernel):
    p, kw = case_problem(name)
    knobs = dict(kernel="split", num_splits=3, split_min_tokens=16) if kernel == "split" else dict(kernel="single")
    from spec_tree_kernels.attention import tree_attention_triton

    out = tree_attention_triton(*p.args(), block_n=16, **knobs, **on(kw, DEVICE))
    check(out, verify_oracle(p, **kw))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_triton_half_precision_matches_oracle(dtype):
    p, kw = case_problem("all_features", dtype=dtype)
    from spec_tree_kernels.attention_triton import tree_attention_triton

    for knobs in (dict(kernel="single"), dict(kernel="split", num_splits=2, split_min_tokens=16)):
        out = tree_attention_triton(*p.args(), block_n=16, **knobs, **on(kw, DEVICE))
        assert out.dtype == dtype
        check(out, verify_oracle(p, **kw), dtype)


@needs_triton
@pytest.mark.parametrize("kernel", ["single", "split"])
def test_triton_never_reads_before_the_window(kernel):
    """NaN in the committed K/V every row's window excludes (positions <
    ctx - W + 1): the kernels start their prefix loop / chunks at the root's
    first position, so nothing of it is loaded (0 * NaN would show)."""
    p, kw = case_problem("window_smaller_than_context_sinks")
    window, bs = kw["window"], p.k_cache.shape[1]
    for b, ctx in enumerate(p.ctx_lens):
        for pos in range(max(0, ctx - window + 1)):
            block = int(p.block_table[b, pos // bs])
            p.k_cache[block, pos % bs] = float("nan")
            p.v_cache[block, pos % bs] = float("nan")
    from spec_tree_kernels.attention_triton import tree_attention_triton

    knobs = dict(kernel="split", num_splits=2, split_min_tokens=16) if kernel == "split" else dict(kernel="single")
    check(tree_attention_triton(*p.args(), block_n=16, **knobs, **on(kw, DEVICE)), verify_oracle(p, **kw))


PLAN_IMPLS = ["torch", pytest.param("cpu", marks=needs_cc), pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("impl", PLAN_IMPLS)
def test_one_plan_serves_layers_with_different_features(impl):
    """gpt-oss alternates windowed and full layers, Gemma 3 too: one step's
    plan runs them all, each layer with its own window / sinks / cap (what a
    layer made for its window never leaks into the next)."""
    if impl == "cpu":
        assert cpu_attention.build(), cpu_attention.build_error()
    device = DEVICE if impl == "triton" else CPU
    p = make_problem("random", 11, [37, 4, 19], 4, 2, 16, 16, AB, seed=21, finite=True)
    q, k_cache, v_cache, table, ctx, mask, mode, scale = p.args(device)
    plan = TreeAttentionPlan.create(table, ctx, mask, mode, p.nodes, 16, 37, impl=impl)
    layers = [dict(window=5, sinks=True), dict(), dict(window=2), dict(soft_cap=0.8, alibi=True), dict(window=5),
              dict(sinks=True)]
    for i, spec in enumerate(layers):
        kw = feature_values(4, spec, seed=i)
        check(plan.run(q, k_cache, v_cache, scale, **on(kw, device)), verify_oracle(p, **kw))
    if impl == "torch":
        assert set(plan._window_bias) == {5, 2}


def test_one_call_op_takes_the_features_on_every_impl():
    p, kw = case_problem("all_features", finite=True)
    want = verify_oracle(p, **kw)
    check(tree_attention(*p.args(CPU), impl="torch", **kw), want)
    if cpu_attention.build():
        check(tree_attention(*p.args(CPU), impl="cpu", **kw), want)
    if triton_usable(DEVICE):
        check(tree_attention(*p.args(), impl="triton", **on(kw, DEVICE)), want)


def test_defaults_are_the_featureless_path():
    """No feature given is the code of before: the torch plan's bias is the
    step's own (no windowed copy), no depths are made, and None for every
    feature gives the same bits as not passing them."""
    p = make_problem("random", 7, [9, 30], 4, 2, 16, 16, AB, seed=3, finite=True)
    q, k_cache, v_cache, table, ctx, mask, mode, scale = p.args(CPU)
    plan = TreeAttentionPlan.create(table, ctx, mask, mode, p.nodes, 16, 30, impl="torch")
    a = plan.run(q, k_cache, v_cache, scale)
    b = plan.run(q, k_cache, v_cache, scale, window=None, sinks=None, soft_cap=None, alibi_slopes=None)
    assert torch.equal(a, b)
    assert plan._depths is None and plan._positions is None and plan._window_bias == {}


def test_window_bounds_the_split_plan():
    """A window W leaves at most W - 1 prefix positions per row: the split
    plan follows min(context bound, W - 1), so a short window needs no split
    at all, a long one the same as no window. Host ints only (no device value)."""
    from spec_tree_kernels import attention_triton as at

    def plan(window, context=4096):
        return at.plan_tree_attention(1, 8, 32, 8, 128, 16, 260, "cuda", max_context_len=context, window=window)

    at._num_sms.cache_clear()
    original = at._num_sms
    try:
        at._num_sms = lambda *_: 132
        assert (plan(None).kernel, plan(None).num_splits) == ("split", 32)
        assert plan(100).kernel == "single"  # 99 positions: less than one chunk of 128
        assert plan(1025).num_splits == 8  # 1024 positions: 8 chunks of 128
        assert plan(10 ** 6).num_splits == plan(None).num_splits
    finally:
        at._num_sms = original


# ---------------------------------------------------------------- draft steps

# lens, K, Hq, Hkv, D, block size, levels, layout, features
DRAFT_CASES = {
    "window_cuts_levels": ([300, 0, 37], 3, 4, 2, 16, 16, 3, "cpu", dict(window=2)),
    "window_1_chain": ([260, 3], 1, 4, 1, 16, 16, 3, "cpu", dict(window=1, sinks=True)),
    "window_smaller_than_context_split": ([517], 4, 8, 2, 32, 16, 3, "flash", dict(window=300, sinks=True)),
    "cap_alibi_no_gqa": ([70, 1], 4, 2, 2, 16, 32, 2, "flash", dict(soft_cap=0.7, alibi=True)),
    "all_features": ([90, 33], 2, 4, 2, 16, 16, 3, "cpu", dict(window=33, sinks=True, soft_cap=2.0, alibi=True)),
}


def draft_case(name, dtype=torch.float32):
    lens, K, hq, hkv, dim, bs, levels, layout, spec = DRAFT_CASES[name]
    draft = Draft(lens, K, hq, hkv, dim, bs, levels, dtype, layout, torch.Generator().manual_seed(len(name)))
    return draft, feature_values(hq, spec, seed=len(name))


def run_draft_levels(draft: Draft, kw: dict, attend) -> None:
    """Each level through ``attend(q, ancestors, level, scale) -> out`` against the oracle."""
    scale = draft.dim ** -0.5 * 1.3
    for level in range(1, draft.levels + 1):
        q, ancestors = draft.level_inputs(level)
        out = attend(q, ancestors, level, scale)
        want = draft_oracle(draft, q, ancestors.cpu(), level, scale, **kw)
        tol = TOL[draft.dtype][0] * 2
        assert torch.isfinite(out.float()).all()
        torch.testing.assert_close(out.float().cpu().double(), want, rtol=tol, atol=tol, msg=f"level {level}")


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=needs_triton), "torch"])
@pytest.mark.parametrize("name", list(DRAFT_CASES))
def test_draft_plan_matches_oracle(name, impl):
    draft, kw = draft_case(name)
    extra = {"chunk_bytes": 1} if impl == "torch" else {}  # torch: a block per chunk (the online softmax's folds)
    plan = BranchAttentionPlan.create(draft.table, draft.kv_lens, max(draft.lens), draft.k_cache.shape[1], impl=impl,
                                      **extra)

    def attend(q, ancestors, level, scale):
        out = torch.full_like(q, float("nan"))
        return plan.run(q, draft.k_cache, draft.v_cache, draft.branch[0], draft.branch[1], level * draft.K, ancestors,
                        scale, out, **on(kw, DEVICE))

    run_draft_levels(draft, kw, attend)
    if impl == "triton" and "split" in name:
        (launch, _), = plan._launches.values()
        assert launch.kernel == "split"


@needs_cc
@pytest.mark.parametrize("name", [n for n in DRAFT_CASES if DRAFT_CASES[n][7] == "cpu"])
def test_draft_cpu_kernel_matches_oracle(name):
    assert cpu_attention.build(), cpu_attention.build_error()
    draft, kw = draft_case(name)
    draft.k_cache, draft.v_cache = draft.k_cache.cpu(), draft.v_cache.cpu()
    assert cpu_attention.branch_supports(draft.k_cache, draft.v_cache)
    blocks = draft.table.cpu().long()
    K = draft.K

    def attend(q, ancestors, level, scale):
        R = q.shape[0]
        visible = torch.cat([ancestors.cpu(), torch.eye(K, dtype=torch.bool).expand(R, K, K)], -1)
        return cpu_attention.run_branch(q.cpu(), draft.k_cache, draft.v_cache, blocks, draft.kv_lens.cpu(),
                                        draft.branch[0].cpu().contiguous(), draft.branch[1].cpu().contiguous(),
                                        level * K, visible, scale, **kw)

    run_draft_levels(draft, kw, attend)


# ---------------------------------------------------------------- bad inputs


BAD = [
    (dict(window=0), ValueError, "window=0"),
    (dict(window=-1), ValueError, "window=-1"),
    (dict(window=2.5), TypeError, "2.5"),
    (dict(window=True), TypeError, "True"),
    (dict(soft_cap=0.0), ValueError, "soft_cap=0.0"),
    (dict(soft_cap=-3.0), ValueError, "soft_cap=-3.0"),
    (dict(soft_cap=float("nan")), ValueError, "soft_cap=nan"),
    (dict(sinks=torch.zeros(3)), ValueError, r"sinks must be float32 of shape \[4\].*\(3,\)"),
    (dict(sinks=torch.zeros(4, dtype=torch.bfloat16)), ValueError, "sinks must be float32.*bfloat16"),
    (dict(sinks=torch.zeros(4, 1)), ValueError, r"sinks .*\(4, 1\)"),
    (dict(sinks=[0.0] * 4), TypeError, "sinks must be a float32 torch.Tensor"),
    (dict(alibi_slopes=torch.zeros(8)[::2]), ValueError, "alibi_slopes must be contiguous"),
    (dict(alibi_slopes=torch.zeros(5)), ValueError, r"alibi_slopes must be float32 of shape \[4\]"),
]


@pytest.mark.parametrize("bad,error,match", BAD, ids=[str(b[0])[:40] for b in BAD])
def test_bad_features_are_refused_naming_the_value(bad, error, match):
    p = make_problem("random", 5, [6, 3], 4, 2, 16, 16, AB, seed=2, finite=True)
    q, k_cache, v_cache, table, ctx, mask, mode, scale = p.args(CPU)
    with pytest.raises(error, match=match):
        tree_attention_reference(q, k_cache, v_cache, table, ctx, mask, mode, **bad)
    plan = TreeAttentionPlan.create(table, ctx, mask, mode, 5, 16, 6, impl="torch")
    with pytest.raises(error, match=match):
        plan.run(q, k_cache, v_cache, **bad)
    draft = Draft([20, 3], 2, 4, 2, 16, 16, 1, torch.float32, "cpu", torch.Generator().manual_seed(1))
    bplan = BranchAttentionPlan.create(draft.table.cpu(), draft.kv_lens.cpu(), 20, 16, impl="torch")
    dq, anc = draft.level_inputs(1)
    with pytest.raises(error, match=match):
        bplan.run(dq.cpu(), draft.k_cache.cpu(), draft.v_cache.cpu(), draft.branch[0].cpu(), draft.branch[1].cpu(), 2,
                  anc.cpu(), None, torch.empty_like(dq.cpu()), **bad)
    if triton_usable(DEVICE):
        from spec_tree_kernels.attention_triton import tree_attention_triton

        with pytest.raises(error, match=match):
            tree_attention_triton(*p.args(), **on(bad, DEVICE))


def test_features_on_another_device_are_refused():
    p = make_problem("random", 5, [6], 4, 2, 16, 16, AB, seed=2)
    sinks = torch.zeros(4, device="meta")
    with pytest.raises(ValueError, match="sinks is on meta"):
        tree_attention_reference(*p.args(CPU), sinks=sinks)


def test_features_from_vllm_maps_what_an_impl_holds():
    """vLLM's conventions: sliding_window None / -1 (CPU_ATTN's int) or
    (-1, -1) / (W - 1, 0) (FlashAttentionImpl's pair); logits_soft_cap None / 0
    for none; sinks in the model dtype (a float32 copy); ALiBi slopes a list."""
    assert features_from_vllm()["window"] is None
    assert features_from_vllm(-1)["window"] is None
    assert features_from_vllm(4096)["window"] == 4096
    assert features_from_vllm((4095, 0))["window"] == 4096
    assert features_from_vllm((-1, -1))["window"] is None
    with pytest.raises(ValueError, match="not causal"):
        features_from_vllm((127, 127))
    assert features_from_vllm(logits_soft_cap=0)["soft_cap"] is None
    assert features_from_vllm(logits_soft_cap=50.0)["soft_cap"] == 50.0
    sinks = torch.randn(4, dtype=torch.bfloat16)
    f = features_from_vllm(sinks=sinks, alibi_slopes=[0.5, 0.25, 0.125, 0.0625])
    assert f["sinks"].dtype == torch.float32 and torch.equal(f["sinks"], sinks.float())
    assert f["alibi_slopes"].tolist() == [0.5, 0.25, 0.125, 0.0625]
    p = make_problem("random", 5, [6], 4, 2, 16, 16, AB, seed=2)
    tree_attention_reference(*p.args(CPU), **f)  # accepted as they are


# ------------------------------------------------------------------ warm-up


@needs_triton
def test_warm_up_covers_the_feature_variants_a_layer_launches():
    """A layer with a window and sinks (gpt-oss) and one with soft-cap and
    ALiBi launch their own constexpr variants (WINDOW / SINKS / SOFT_CAP /
    ALIBI): ``AttentionLayer`` carries the features, the warm-up launches them,
    and serving (random batches, trees, contexts, both split plans) hits no
    variant it did not warm; a featureless layer warms none of them."""
    from spec_tree_kernels import TreeShape
    from spec_tree_kernels.api import tree_from_parents
    from spec_tree_kernels.startup import TRITON_OPS, AttentionLayer, ServingConfig, serving_launches, warm_up
    from spec_tree_kernels.triton_launch import recording

    config = ServingConfig(shapes=(TreeShape(3, 2, 4),), mode="ANCESTOR_BITMASK", prefix_trim=True, verify_depth=3,
                           max_batch=3, max_context_len=300, vocab_size=16)
    kv = torch.randn(40, 16, 4, 32, device=DEVICE)
    table = torch.zeros(4, 24, dtype=torch.int32, device=DEVICE)
    sinks, slopes = torch.randn(4, device=DEVICE), torch.rand(4, device=DEVICE)
    windowed = AttentionLayer(4, kv[:, :, :2], kv[:, :, 2:], table, "triton", window=200, sinks=sinks)
    capped = AttentionLayer(4, kv[:, :, :2], kv[:, :, 2:], table, "triton", soft_cap=30.0, alibi_slopes=slopes)
    plain = AttentionLayer(4, kv[:, :, :2], kv[:, :, 2:], table, "triton")
    no_ops = dict.fromkeys(TRITON_OPS, "torch")
    with recording() as warmed:
        warm_up(config, DEVICE, impls=no_ops, layers=[windowed, capped, plain], draft_layers=[windowed])
    flags = {(v.kernel, tuple(dict(v.constexprs).get(f) for f in ("WINDOW", "SINKS", "SOFT_CAP", "ALIBI")))
             for v in warmed}
    assert ("_tree_attention_kernel", (True, True, False, False)) in flags
    assert ("_tree_attention_kernel", (False, False, True, True)) in flags
    assert ("_branch_attention_kernel", (True, True, False, False)) in flags
    assert ("_tree_attention_merge_kernel", (True, True, None, None)) in flags
    only_plain = serving_launches(config, DEVICE, impls=no_ops, layers=[plain])
    assert all(not dict(l.variant.constexprs).get("WINDOW") and not dict(l.variant.constexprs).get("SINKS")
               for l in only_plain)

    rng = random.Random(5)
    with recording() as served:
        for step, (batch, longest) in enumerate([(1, 290), (1, 150), (3, 40), (2, 0), (1, 120)]):
            nodes = rng.choice(config.tree_sizes)
            ctx = torch.tensor([rng.randint(0, longest) for _ in range(batch - 1)] + [longest], device=DEVICE)
            parents = torch.tensor([[-1] + [rng.randrange(i) for i in range(1, nodes)] for _ in range(batch)],
                                   device=DEVICE)
            mask = tree_from_parents(parents, ctx, config.mode, impl="torch").tree_mask  # the ops serve on torch
            rows = torch.randn(batch * nodes + 2, 4 * 32 + 3, device=DEVICE)
            q = rows[1: 1 + batch * nodes, : 4 * 32].view(batch, nodes, 4, 32)
            plan = TreeAttentionPlan.create(table[:batch], ctx, mask, config.mode, nodes, 16, int(ctx.max()),
                                            impl="triton")
            for layer in (windowed, capped, plain):
                plan.run(q, layer.k_cache, layer.v_cache, window=layer.window, sinks=layer.sinks,
                         soft_cap=layer.soft_cap, alibi_slopes=layer.alibi_slopes)
            draft = BranchAttentionPlan.create(table[:batch], ctx, longest, 16, impl="triton")
            scratch = kv.new_zeros(2, batch, 2 * 2, 2, 32)
            for level in (1, 2):
                dq = torch.randn(batch, 2, 4, 32, device=DEVICE)
                anc = torch.rand(batch, 2, (level - 1) * 2, device=DEVICE) < 0.5
                draft.run(dq, windowed.k_cache, windowed.v_cache, scratch[0], scratch[1], level * 2, anc, None,
                          torch.empty_like(dq), window=windowed.window, sinks=windowed.sinks)
    missing = set(served) - set(warmed)
    assert not missing, "served but not warmed: " + ", ".join(sorted(map(str, missing)))
    assert {"_tree_attention_split_kernel", "_tree_attention_merge_kernel"} <= {v.kernel for v in served}
