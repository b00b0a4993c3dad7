"""Issue #37 (5): draft-step attention over the paged cache, read in place
(``spec_tree_kernels.branch_attention``; vLLM's ``BranchAttention`` runs it).

One tree-drafting level: K frontier nodes of R requests, each attending to its
request's committed KV (paged: shuffled, non-contiguous blocks, a table wider
than needed, ragged lengths down to 0) and to the branch entries it descends
from plus its own. Checked against a dense per-row reference for the Triton
kernel (single pass and split + merge, under TRITON_INTERPRET=1 here) and the
torch path (one chunk and many), GQA and not, K = 1 (a chain) to 8, three
levels, fp32 / fp16 / bf16 caches and both cache layouts the engines hand
over. The memory test bounds the torch path's temporaries per level by a
formula independent of the context, and shows the bound catches the dense
fp32 copy the vLLM adapter made before (``dense_gather_level``).
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kernel_device import DEVICE
from spec_tree_kernels.api import triton_usable
from spec_tree_kernels.attention_plan import gather_blocks, scores_over_blocks, values_over_blocks
from spec_tree_kernels.branch_attention import BranchAttentionPlan, torch_chunk_blocks
from spec_tree_kernels.triton_launch import recording

needs_triton = pytest.mark.skipif(not triton_usable(torch.device(DEVICE)),
                                  reason="Triton needs CUDA or TRITON_INTERPRET=1 (set before import)")
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


class Draft:
    """A drafting step's inputs: the paged cache of R requests (``layout``
    "cpu": K transposed per block as vLLM-CPU stores fp32, "flash": K | V
    halves of one tensor as FlashAttention does), the branch scratch and the
    dense context each request owns (the reference reads that)."""

    def __init__(self, lens, K, hq, hkv, dim, block_size, levels, dtype, layout, gen):
        R = len(lens)
        self.lens, self.K, self.hq, self.hkv, self.dim, self.levels = list(lens), K, hq, hkv, dim, levels
        self.dtype = dtype
        longest = max(self.lens)
        nb = -(-longest // block_size) + 1  # one column past what the longest request needs
        num_blocks = 2 * R * nb + 3
        ids = torch.randperm(num_blocks, generator=gen)[: R * nb].view(R, nb)  # non-contiguous, shuffled
        # finite noise of the wrong magnitude wherever a request must not read (spare blocks, past kv_len)
        if layout == "cpu":
            k_store = 1e3 * torch.randn(num_blocks, hkv, dim, block_size, generator=gen)
            self.k_cache = k_store.permute(0, 3, 1, 2)
            self.v_cache = 1e3 * torch.randn(num_blocks, block_size, hkv, dim, generator=gen)
        else:
            kv = 1e3 * torch.randn(num_blocks, hkv, block_size, 2 * dim, generator=gen)
            self.k_cache, self.v_cache = kv.transpose(1, 2)[..., :dim], kv.transpose(1, 2)[..., dim:]
        self.ctx_k, self.ctx_v = [], []
        for r, n in enumerate(self.lens):
            k, v = torch.randn(n, hkv, dim, generator=gen), torch.randn(n, hkv, dim, generator=gen)
            pos = torch.arange(n)
            self.k_cache[ids[r, pos // block_size], pos % block_size] = k
            self.v_cache[ids[r, pos // block_size], pos % block_size] = v
            self.ctx_k.append(k.to(dtype).float())
            self.ctx_v.append(v.to(dtype).float())
        self.k_cache, self.v_cache = self.k_cache.to(DEVICE, dtype), self.v_cache.to(DEVICE, dtype)
        self.table = ids.to(torch.int32).to(DEVICE)  # the engine's table dtype
        self.kv_lens = torch.tensor(self.lens, dtype=torch.int64, device=DEVICE)
        self.branch = torch.zeros(2, R, levels * K, hkv, dim, dtype=dtype, device=DEVICE)  # as from_paged
        self.gen = gen

    def level_inputs(self, level):
        """(query [R, K, Hq, D], ancestors [R, K, (level-1) K] bool) of ``level``;
        writes its K branch entries per request into the scratch."""
        R, K = len(self.lens), self.K
        q = torch.randn(R, K, self.hq, self.dim, generator=self.gen).to(DEVICE, self.dtype)
        new = torch.randn(2, R, K, self.hkv, self.dim, generator=self.gen).to(DEVICE, self.dtype)
        self.branch[:, :, (level - 1) * K: level * K] = new
        if K == 1:  # a chain: every entry before is an ancestor
            ancestors = torch.ones(R, 1, level - 1, dtype=torch.bool)
        else:
            ancestors = torch.rand(R, K, (level - 1) * K, generator=self.gen) < 0.5
        return q, ancestors.to(DEVICE)

    def reference(self, q, ancestors, level, scale):
        R, K = len(self.lens), self.K
        group = self.hq // self.hkv
        filled = level * K
        bk, bv = self.branch[0, :, :filled].float().cpu(), self.branch[1, :, :filled].float().cpu()
        out = torch.empty(R, K, self.hq, self.dim)
        for r in range(R):
            for j in range(K):
                seen = torch.cat([ancestors[r, j].cpu(), torch.arange(K) == j])
                keys = torch.cat([self.ctx_k[r], bk[r][seen]])
                vals = torch.cat([self.ctx_v[r], bv[r][seen]])
                qi = q[r, j].float().cpu().view(self.hkv, group, self.dim)
                w = torch.softmax(torch.einsum("hgd,nhd->hgn", qi, keys) * scale, -1)
                out[r, j] = torch.einsum("hgn,nhd->hgd", w, vals).reshape(self.hq, self.dim)
        return out


# lens, K, Hq, Hkv, D, block size, levels, layout; the interpreter's plan (4 SMs):
# R * Hkv * node blocks >= 4 programs -> single pass, else split when the context allows
CASES = {
    "gqa_single": ([300, 0, 37], 3, 4, 2, 16, 16, 3, "cpu"),
    "gqa_split": ([517], 4, 8, 2, 32, 16, 3, "flash"),
    "chain_split_ragged": ([260, 3], 1, 4, 1, 16, 8, 3, "cpu"),
    "k8_no_gqa": ([70, 1], 8, 2, 2, 16, 32, 2, "flash"),
}


def run_levels(draft: Draft, plan: BranchAttentionPlan):
    """Each level through ``plan`` against the reference; returns the kernels launched."""
    launched = []
    scale = draft.dim ** -0.5
    for level in range(1, draft.levels + 1):
        q, ancestors = draft.level_inputs(level)
        out = torch.full_like(q, float("nan"))
        with recording() as seen:
            res = plan.run(q, draft.k_cache, draft.v_cache, draft.branch[0], draft.branch[1], level * draft.K,
                           ancestors, scale, out)
        assert res is out
        launched.append([v.kernel for v in seen])
        want = draft.reference(q, ancestors, level, scale)
        tol = TOL[draft.dtype]
        torch.testing.assert_close(out.float().cpu(), want, rtol=tol, atol=tol, msg=f"level {level}")
    return launched


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_dense(case, dtype):
    lens, K, hq, hkv, dim, bs, levels, layout = CASES[case]
    draft = Draft(lens, K, hq, hkv, dim, bs, levels, dtype, layout, torch.Generator().manual_seed(len(case)))
    plan = BranchAttentionPlan.create(draft.table, draft.kv_lens, max(lens), bs, impl="triton")
    launched = run_levels(draft, plan)
    split = "split" in case
    want = ["_branch_attention_kernel"] + (["_tree_attention_merge_kernel"] if split else [])
    assert all(kernels == want for kernels in launched), launched  # 1 launch per level, or split + merge


@pytest.mark.parametrize("chunk_bytes", [1, None], ids=["block_per_chunk", "one_chunk"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_torch_matches_dense(case, dtype, chunk_bytes):
    lens, K, hq, hkv, dim, bs, levels, layout = CASES[case]
    draft = Draft(lens, K, hq, hkv, dim, bs, levels, dtype, layout, torch.Generator().manual_seed(len(case)))
    extra = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    plan = BranchAttentionPlan.create(draft.table, draft.kv_lens, max(lens), bs, impl="torch", **extra)
    assert run_levels(draft, plan) == [[]] * levels  # no Triton launch


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=needs_triton), "torch"])
def test_out_is_the_engines_rows_written_in_place(impl):
    """The output is a view of the engine's output buffer (here at row 1 of a
    wider buffer): exactly those rows are written, nothing else, no copy."""
    lens, K, hq, hkv, dim, bs, _, layout = CASES["gqa_single"]
    draft = Draft(lens, K, hq, hkv, dim, bs, 1, torch.float32, layout, torch.Generator().manual_seed(3))
    plan = BranchAttentionPlan.create(draft.table, draft.kv_lens, max(lens), bs, impl=impl)
    q, ancestors = draft.level_inputs(1)
    R = len(lens)
    buffer = torch.full((R * K + 2, hq * dim + 8), float("nan"), device=DEVICE)
    out = buffer[1: 1 + R * K, : hq * dim].view(R, K, hq, dim)
    assert plan.run(q, draft.k_cache, draft.v_cache, draft.branch[0], draft.branch[1], K, ancestors, None, out) is out
    torch.testing.assert_close(out.cpu(), draft.reference(q, ancestors, 1, dim ** -0.5), rtol=2e-5, atol=2e-5)
    assert buffer[0].isnan().all() and buffer[-1].isnan().all() and buffer[:, hq * dim:].isnan().all()


def test_inputs_are_checked_with_the_bad_value_named():
    lens, K, hq, hkv, dim, bs, _, layout = CASES["gqa_single"]
    draft = Draft(lens, K, hq, hkv, dim, bs, 2, torch.float32, layout, torch.Generator().manual_seed(4))
    with pytest.raises(ValueError, match="max_kv_len=300 needs 19 blocks"):
        BranchAttentionPlan.create(draft.table[:, :5], draft.kv_lens, 300, bs, impl="torch")
    plan = BranchAttentionPlan.create(draft.table, draft.kv_lens, 300, bs, impl="torch")
    q, ancestors = draft.level_inputs(1)
    args = (draft.k_cache, draft.v_cache, draft.branch[0], draft.branch[1])
    with pytest.raises(ValueError, match="filled=2 must count this level's K=3"):
        plan.run(q, *args, 2, ancestors, None, torch.empty_like(q))
    with pytest.raises(ValueError, match=r"ancestors must be bool \[R=3, K=3, filled - K=3\]"):
        plan.run(q, *args, 6, ancestors, None, torch.empty_like(q))
    with pytest.raises(TypeError, match="share one dtype"):
        plan.run(q, *args, 3, ancestors, None, torch.empty_like(q, dtype=torch.float16))


# ------------------------------------------------------------------ memory


class TemporaryBytes(TorchDispatchMode):
    """Peak bytes of the tensors an op sequence allocates and still holds, at
    op boundaries: every op output with storage of its own counts until its
    last Python reference dies; outputs that share an input's storage (views,
    in-place ops, ``out=`` writes) are the caller's memory and do not count."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[int, list]] = {}  # storage address -> (bytes, weakrefs of its tensors)
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(result):
            if not isinstance(t, torch.Tensor) or t.untyped_storage().nbytes() == 0:
                continue
            key = t.untyped_storage().data_ptr()
            if key in self.live:
                self.live[key][1].append(weakref.ref(t))
            elif key not in inputs:
                self.live[key] = (t.untyped_storage().nbytes(), [weakref.ref(t)])
        for key in [k for k, (_, refs) in self.live.items() if all(r() is None for r in refs)]:
            del self.live[key]
        self.peak = max(self.peak, sum(n for n, _ in self.live.values()))
        return result


def level_state_bytes(R, K, hq, hkv, dim, E):
    """What a level holds besides one context chunk, whatever the context:
    fp32 queries, running max / sum / output and the result (<= 8 copies of
    [R, K, Hq, D]), the branch scores and weights (<= 4 of [R, K, Hq, E]) and
    the fp32 branch K / V (<= 4 of [R, E, Hkv, D])."""
    return 4 * (8 * R * K * hq * dim + 4 * R * K * hq * E + 4 * R * E * hkv * dim)


def dense_gather_level(draft: Draft, blocks, q, ancestors, level, scale, out):
    """The adapter's torch path before #37 (``BranchAttention._attend_torch``):
    every request's context gathered into one dense fp32 copy, scored whole."""
    ctx_k_t, ctx_v = gather_blocks(draft.k_cache, draft.v_cache, blocks)
    positions = torch.arange(ctx_k_t.shape[1] * ctx_k_t.shape[-1])
    bias = torch.zeros(len(draft.lens), positions.shape[0]).masked_fill_(positions[None] >= draft.kv_lens[:, None],
                                                                          float("-inf"))
    R, _, hkv, dim, _ = ctx_k_t.shape
    K, group, filled = draft.K, draft.hq // hkv, level * draft.K
    visible = torch.cat([ancestors, torch.eye(K, dtype=torch.bool).expand(R, K, K)], -1)
    rows = q.float().view(R, K, hkv, group, dim).permute(0, 2, 3, 1, 4).reshape(R, hkv, group * K, dim) * scale
    s_ctx = scores_over_blocks(rows, ctx_k_t).add_(bias[:, None, None])
    bk = draft.branch[0, :, :filled].float().permute(0, 2, 3, 1)
    bv = draft.branch[1, :, :filled].float().permute(0, 2, 1, 3)
    s_br = torch.matmul(rows, bk).view(R, hkv, group, K, filled).masked_fill_(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(torch.cat([s_ctx, s_br.view(R, hkv, group * K, filled)], -1), dim=-1)
    L = s_ctx.shape[-1]
    res = values_over_blocks(probs[..., :L], ctx_v) + torch.matmul(probs[..., L:], bv)
    out.copy_(res.view(R, hkv, group, K, dim).permute(0, 3, 1, 2, 4).reshape(out.shape))


MEMORY_CASE = dict(R=8, K=4, hq=4, hkv=2, dim=16, block_size=16, context=2048, levels=2)
CHUNK_BYTES = 256 << 10


def memory_draft():
    c = MEMORY_CASE
    lens = [c["context"] - 7 * r for r in range(c["R"])]
    return Draft(lens, c["K"], c["hq"], c["hkv"], c["dim"], c["block_size"], c["levels"], torch.float32, "cpu",
                 torch.Generator().manual_seed(9))


def level_peaks(draft: Draft, run_level) -> list[int]:
    peaks = []
    for level in range(1, draft.levels + 1):
        q, ancestors = draft.level_inputs(level)
        out = torch.empty_like(q)
        with TemporaryBytes() as seen:
            run_level(q, ancestors, level, out)
        peaks.append(seen.peak)
    return peaks


def test_torch_path_temporaries_are_bounded_by_a_chunk():
    """Per level, temporaries <= chunk_bytes + level_state_bytes(R, K, Hq, Hkv,
    D, E): no term in the context length. At 64 requests x 16k context with
    an 8B head (Hq 32, Hkv 8, D 128), a 5,8,... shape (K 8, E 32) and the
    default chunk_bytes (64 MiB) that is 64 MiB + 109 MB per draft level,
    where the dense fp32 copy of before held 64 x 16384 x 8 x 128 x 4 x 2 =
    8.6 GB of K/V plus 64 x 32 x 8 x 16384 x 4 = 1.1 GB per score tensor.
    Run scaled down (8 requests x 2k, chunk_bytes 256 KiB): the dense copy
    needs 4 MiB of K/V alone, the bound is 0.4 MiB."""
    c = MEMORY_CASE
    draft = memory_draft()
    plan = BranchAttentionPlan.create(draft.table, draft.kv_lens, c["context"], c["block_size"], impl="torch",
                                      chunk_bytes=CHUNK_BYTES)
    bound = CHUNK_BYTES + level_state_bytes(c["R"], c["K"], c["hq"], c["hkv"], c["dim"], c["levels"] * c["K"])
    assert torch_chunk_blocks(c["R"], c["K"], c["hq"], c["hkv"], c["dim"], c["block_size"], 4, CHUNK_BYTES) < (
        c["context"] // c["block_size"]), "the case must take several chunks"
    peaks = level_peaks(draft, lambda q, anc, level, out: plan.run(
        q, draft.k_cache, draft.v_cache, draft.branch[0], draft.branch[1], level * c["K"], anc, None, out))
    assert max(peaks) <= bound, (peaks, bound)
    assert max(peaks) > CHUNK_BYTES // 4, peaks  # the tracker sees the chunk's tensors


def test_memory_bound_catches_the_dense_context_copy():
    """The same measurement on the adapter's torch path before #37 exceeds
    the bound (the test above fails on it)."""
    c = MEMORY_CASE
    draft = memory_draft()
    blocks = draft.table[:, : -(-c["context"] // c["block_size"])].long()
    bound = CHUNK_BYTES + level_state_bytes(c["R"], c["K"], c["hq"], c["hkv"], c["dim"], c["levels"] * c["K"])
    peaks = level_peaks(draft, lambda q, anc, level, out: dense_gather_level(draft, blocks, q, anc, level,
                                                                              c["dim"] ** -0.5, out))
    dense_kv = c["R"] * c["context"] * c["hkv"] * c["dim"] * 4 * 2
    assert min(peaks) >= dense_kv > 4 * bound, (peaks, dense_kv, bound)


@needs_triton
def test_triton_path_temporaries_are_its_workspace():
    """The kernel reads the cache in place: a level allocates at most the
    split workspace, R * K * Hq * (S + 1) * (D + 1) * 4 bytes (S <= SPLIT_MAX:
    no term in the context), made once per drafting step."""
    from spec_tree_kernels.attention_triton import SPLIT_MAX

    c = dict(MEMORY_CASE, R=1)
    draft = Draft([c["context"]], c["K"], c["hq"], c["hkv"], c["dim"], c["block_size"], c["levels"], torch.float32,
                  "cpu", torch.Generator().manual_seed(10))
    plan = BranchAttentionPlan.create(draft.table, draft.kv_lens, c["context"], c["block_size"], impl="triton")
    peaks = level_peaks(draft, lambda q, anc, level, out: plan.run(
        q, draft.k_cache, draft.v_cache, draft.branch[0], draft.branch[1], level * c["K"], anc, None, out))
    (launch, _), = plan._launches.values()
    assert launch.kernel == "split"
    assert peaks[0] <= c["K"] * c["hq"] * (SPLIT_MAX + 1) * (c["dim"] + 1) * 4 + 64, peaks
    assert peaks[1] <= 64, peaks  # the next level reuses it


class DeviceReads(TorchDispatchMode):
    """Records every op that hands a device value to the host (``.item()``,
    ``bool(t)``, ``.tolist()``: aten._local_scalar_dense), i.e. a host sync on a GPU."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(func)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("impl", [pytest.param("triton", marks=needs_triton), "torch"])
def test_a_level_reads_nothing_back_from_the_device(impl):
    """No host sync in a level (CUDA-graph capturable, no stall per level):
    the launch grid and the torch path's chunk loop follow shapes and the
    host bound max_kv_len only. The control shows the probe sees a read."""
    lens, K, hq, hkv, dim, bs, _, layout = CASES["gqa_split"]
    draft = Draft(lens, K, hq, hkv, dim, bs, 2, torch.float32, layout, torch.Generator().manual_seed(12))
    plan = BranchAttentionPlan.create(draft.table, draft.kv_lens, max(lens), bs, impl=impl, chunk_bytes=1 << 16)
    for level in (1, 2):
        q, ancestors = draft.level_inputs(level)
        with DeviceReads() as probe:
            plan.run(q, draft.k_cache, draft.v_cache, draft.branch[0], draft.branch[1], level * K, ancestors, None,
                     torch.empty_like(q))
        assert probe.reads == [], level
    with DeviceReads() as control:
        int(draft.kv_lens.max())
    assert control.reads
