"""Tree attention over a paged KV cache: reference vs an independent dense
computation, and the Triton kernels (TRITON_INTERPRET=1 on CPU, or CUDA) vs the
reference and the dense computation: the single-pass kernel and the split-KV
kernel + merge, with split counts that exercise the merge (a context shorter
than one chunk, exactly one chunk, many chunks with a short tail, an empty
context). The launch plan is tested from shapes alone, and the launches are
compiled for sm_90 without a GPU (tests/triton_aot.py).

The dense check shares no code with the module: trees are parent arrays
written here, masks are encoded here, K/V are kept per request in logical
order and scattered into a NaN-filled paged cache through a random block
table, and attention is ``scaled_dot_product_attention`` over the explicit
[T, ctx + T] mask.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import spec_tree_kernels.attention_triton as attention_triton
from spec_tree_kernels.modes import TreeMaskMode
from spec_tree_kernels.triton_launch import recording
from spec_tree_kernels.attention import (
    _triton_usable,
    plan_tree_attention,
    tree_attention,
    tree_attention_reference,
    tree_attention_triton,
)

AB, PP, QL = TreeMaskMode.ANCESTOR_BITMASK, TreeMaskMode.PARENT_POINTER, TreeMaskMode.QLEN_ONLY
DEVICE = torch.device("cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu")
needs_triton = pytest.mark.skipif(
    not _triton_usable(DEVICE), reason="Triton needs CUDA or TRITON_INTERPRET=1 (set before import)"
)
# output tolerance vs an fp32-accumulating reference: one or two output ulps
# plus, for the Triton kernel, P rounded to the cache dtype before P @ V
TOL = {torch.float32: (2e-5, 1e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 2e-2)}


# ------------------------------------------------------------------ problems


def make_tree(kind: str, nodes: int, gen: torch.Generator) -> list[int]:
    """Parent of each node (-1 for the root); a parent precedes its children."""
    if kind == "chain":
        return [-1] + list(range(nodes - 1))
    if kind == "star":
        return [-1] + [0] * (nodes - 1)
    if kind == "binary":
        return [-1] + [(i - 1) // 2 for i in range(1, nodes)]
    assert kind == "random"
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, nodes)]


def ancestors_or_self(parent: list[int]) -> list[set[int]]:
    out = []
    for i in range(len(parent)):
        seen, cur = set(), i
        while cur >= 0:
            seen.add(cur)
            cur = parent[cur]
        out.append(seen)
    return out


def encode_mask(mode: TreeMaskMode, parents: list[list[int]]) -> torch.Tensor:
    batch, nodes = len(parents), len(parents[0])
    anc = [ancestors_or_self(p) for p in parents]
    if mode == QL:
        dense = torch.zeros(batch, nodes, nodes, dtype=torch.bool)
        for b in range(batch):
            for i in range(nodes):
                dense[b, i, sorted(anc[b][i])] = True
        return dense.flatten()
    if mode == PP:
        out = torch.zeros(batch, 2, nodes, dtype=torch.int16)
        for b in range(batch):
            out[b, 0] = torch.tensor(parents[b], dtype=torch.int16)
            out[b, 1] = torch.tensor([len(a) - 1 for a in anc[b]], dtype=torch.int16)
        return out
    words = (nodes + 63) // 64
    out = torch.zeros(batch, nodes, words, dtype=torch.int64)
    for b in range(batch):
        for i in range(nodes):
            for w in range(words):
                value = sum(1 << (j - 64 * w) for j in anc[b][i] if 64 * w <= j < 64 * w + 64)
                out[b, i, w] = value - (1 << 64) if value >= 1 << 63 else value  # two's complement bit 63
    return out


class Problem:
    """B requests of T nodes with K/V in logical order and in a paged cache."""

    def __init__(self, ctx_lens, parents, hq, hkv, dim, block_size, dtype, mode, gen, spare_blocks=3):
        self.ctx_lens, self.parents, self.mode = list(ctx_lens), parents, mode
        batch, nodes = len(ctx_lens), len(parents[0])
        self.nodes = nodes
        lengths = [c + nodes for c in ctx_lens]
        need = [math.ceil(n / block_size) for n in lengths]
        num_blocks = sum(need) + spare_blocks
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        # one spare column of -1 padding: never read by the kernel, clamped by the reference
        table = torch.full((batch, max(need) + 1), -1, dtype=torch.int32)
        # NaN everywhere no request stores a token: reading it anywhere would show
        self.k_cache = torch.full((num_blocks, block_size, hkv, dim), float("nan"), dtype=dtype)
        self.v_cache = torch.full_like(self.k_cache, float("nan"))
        self.k, self.v = [], []
        used = 0
        for b, length in enumerate(lengths):
            blocks = perm[used : used + need[b]]
            used += need[b]
            table[b, : need[b]] = torch.tensor(blocks, dtype=torch.int32)
            k = torch.randn(length, hkv, dim, generator=gen).to(dtype)
            v = torch.randn(length, hkv, dim, generator=gen).to(dtype)
            pos = torch.arange(length)
            slot_block = torch.tensor(blocks)[pos // block_size]
            self.k_cache[slot_block, pos % block_size] = k
            self.v_cache[slot_block, pos % block_size] = v
            self.k.append(k)
            self.v.append(v)
        self.block_table = table
        self.context_lens = torch.tensor(ctx_lens, dtype=torch.int32)
        self.q = torch.randn(batch, nodes, hq, dim, generator=gen).to(dtype)
        self.tree_mask = encode_mask(mode, parents)
        self.scale = 1.0 / math.sqrt(dim) * 1.3  # not the default: the argument must reach the softmax

    def args(self, device=DEVICE):
        tensors = (self.q, self.k_cache, self.v_cache, self.block_table, self.context_lens, self.tree_mask)
        return tuple(t.to(device) for t in tensors) + (self.mode, self.scale)

    def dense(self) -> torch.Tensor:
        """Independent result: SDPA per request over the explicit [T, ctx + T] mask."""
        out = []
        hq, hkv = self.q.shape[2], self.k_cache.shape[2]
        for b, ctx in enumerate(self.ctx_lens):
            anc = ancestors_or_self(self.parents[b])
            mask = torch.zeros(self.nodes, ctx + self.nodes, dtype=torch.bool)
            mask[:, :ctx] = True
            for i in range(self.nodes):
                for j in anc[i]:
                    mask[i, ctx + j] = True
            q = self.q[b].float().transpose(0, 1)  # [Hq, T, D]
            k = self.k[b].float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)  # [Hq, L, D]
            v = self.v[b].float().repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
            out.append(o.transpose(0, 1))
        return torch.stack(out).to(self.q.dtype)


def problem(kind, nodes, ctx_lens, hq=4, hkv=2, dim=16, block_size=16, dtype=torch.float32, mode=AB, seed=0):
    gen = torch.Generator().manual_seed(seed)
    parents = [make_tree(kind, nodes, gen) for _ in ctx_lens]
    return Problem(ctx_lens, parents, hq, hkv, dim, block_size, dtype, mode, gen)


def assert_close(actual, expected, dtype):
    atol, rtol = TOL[dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual.float()).all()
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


# ---------------------------------------------------------- reference vs dense

REFERENCE_CASES = [
    # kind, T, ctx_lens, hq, hkv, dim, block_size, dtype, mode
    ("random", 16, [0, 7, 37], 4, 2, 16, 16, torch.float32, AB),
    ("random", 16, [0, 7, 37], 4, 2, 16, 16, torch.float32, PP),
    ("random", 16, [0, 7, 37], 4, 2, 16, 16, torch.float32, QL),
    ("chain", 64, [3, 50], 2, 1, 16, 16, torch.float32, AB),  # bit 63 of the word is set
    ("star", 64, [20, 0], 2, 2, 16, 1, torch.float32, PP),
    ("binary", 80, [5, 17], 6, 2, 16, 16, torch.float32, AB),  # two words per row, GQA group of 3
    ("random", 80, [5, 17], 4, 1, 16, 16, torch.float32, PP),
    ("random", 1, [0, 9, 33], 4, 2, 16, 16, torch.float32, AB),  # one-token decode
    ("random", 12, [4, 31], 4, 2, 32, 1, torch.float16, QL),
    ("random", 12, [4, 31], 8, 2, 32, 16, torch.bfloat16, AB),
]


@pytest.mark.parametrize("kind,nodes,ctx,hq,hkv,dim,bs,dtype,mode", REFERENCE_CASES)
def test_reference_matches_dense(kind, nodes, ctx, hq, hkv, dim, bs, dtype, mode):
    p = problem(kind, nodes, ctx, hq, hkv, dim, bs, dtype, mode)
    out = tree_attention_reference(*p.args(torch.device("cpu")))
    assert_close(out, p.dense(), torch.float32 if dtype == torch.float32 else dtype)


def test_mask_modes_agree():
    """The three layouts of one tree give the same attention."""
    outs = [tree_attention_reference(*problem("random", 20, [3, 40], mode=m, seed=5).args(torch.device("cpu"))) for m in (AB, PP, QL)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


# -------------------------------------------------------- Triton vs reference

TRITON_CASES = [
    # kind, T, ctx_lens, hq, hkv, dim, block_size, dtype, mode, block_m, block_n
    ("random", 16, [0, 19, 40], 4, 2, 16, 16, torch.float32, AB, None, 16),
    ("random", 16, [0, 19, 40], 4, 2, 16, 16, torch.float32, AB, 16, 32),  # 2 node blocks per head
    ("chain", 64, [3, 50], 2, 1, 16, 16, torch.float32, AB, None, 16),  # bit 63, 4 tree tiles, 2 node blocks
    ("star", 64, [21, 0], 2, 2, 16, 1, torch.float16, PP, None, 32),
    ("random", 80, [5, 17], 4, 2, 16, 16, torch.bfloat16, AB, None, 32),  # second mask word
    ("binary", 80, [5, 17], 2, 1, 16, 16, torch.float32, PP, None, 64),  # parent walk into word 2
    ("random", 24, [9, 70], 2, 1, 16, 1, torch.float16, QL, None, 16),
    ("random", 12, [4, 31], 6, 2, 24, 16, torch.bfloat16, AB, None, 16),  # group of 3, D not a power of 2
    ("random", 1, [0, 9, 33], 8, 2, 32, 16, torch.float32, AB, None, 32),  # one-token decode
    ("chain", 8, [16, 1], 4, 4, 32, 16, torch.float16, PP, None, 16),  # no GQA
]


@needs_triton
@pytest.mark.parametrize("kind,nodes,ctx,hq,hkv,dim,bs,dtype,mode,block_m,block_n", TRITON_CASES)
def test_triton_matches_reference(kind, nodes, ctx, hq, hkv, dim, bs, dtype, mode, block_m, block_n):
    p = problem(kind, nodes, ctx, hq, hkv, dim, bs, dtype, mode, seed=nodes + len(ctx))
    ref = tree_attention_reference(*p.args())
    out = tree_attention_triton(*p.args(), block_m=block_m, block_n=block_n)
    assert_close(out, ref, dtype)


@needs_triton
@pytest.mark.parametrize("seed", range(10))
def test_random_configurations(seed):
    """Seeded random shapes: dense == reference == Triton."""
    gen = torch.Generator().manual_seed(1000 + seed)

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=gen))]

    nodes = pick([1, 2, 7, 16, 33, 64, 65])
    hkv = pick([1, 2])
    hq = hkv * pick([1, 2, 4])
    batch = pick([1, 2, 4])
    ctx = torch.randint(0, 60, (batch,), generator=gen).tolist()
    dtype = pick([torch.float32, torch.float16, torch.bfloat16])
    p = problem(pick(["random", "chain", "star", "binary"]), nodes, ctx, hq, hkv, pick([16, 32]), pick([1, 16]),
                dtype, pick([AB, PP, QL]), seed=seed)
    ref = tree_attention_reference(*p.args())
    assert_close(ref, p.dense(), torch.float32 if dtype == torch.float32 else dtype)
    assert_close(tree_attention_triton(*p.args(), block_n=pick([16, 32, 64])), ref, dtype)


@needs_triton
def test_triton_strided_inputs():
    """q sliced out of a packed QKV tensor, K/V halves of one [2, ...] cache,
    int64 block table and context lengths."""
    p = problem("random", 10, [6, 23], hq=4, hkv=2, dim=16, block_size=16, seed=3)
    q, k_cache, v_cache, table, ctx, mask, mode, scale = p.args()
    qkv = torch.randn(q.shape[0], q.shape[1], 3 * q.shape[2], q.shape[3], device=DEVICE)
    qkv[:, :, 4:8] = q
    kv = torch.stack([k_cache, v_cache])
    args = (qkv[:, :, 4:8], kv[0], kv[1], table.long(), ctx.long(), mask, mode, scale)
    assert not args[0].is_contiguous()
    ref = tree_attention_reference(*p.args())
    assert_close(tree_attention_triton(*args, block_n=16), ref, torch.float32)
    assert_close(tree_attention_reference(*args), ref, torch.float32)


# ------------------------------------------------------------ split KV

# kind, T, ctx_lens, hq, hkv, dim, block_size, dtype, mode, num_splits, split_min_tokens, block_n
# chunk = max(round_up(ceil(ctx / S), block_n), split_min_tokens); used chunks = ceil(ctx / chunk)
SPLIT_CASES = [
    ("random", 8, [5, 16, 0], 4, 2, 16, 16, torch.float32, AB, 4, 16, 16),  # shorter than one chunk / exactly one / empty
    ("random", 8, [64, 70, 47], 4, 2, 16, 16, torch.float32, PP, 4, 16, 16),  # 4 full chunks / 3 of 32 (tail 6) / 3 of 16
    ("chain", 12, [31, 33, 96], 2, 1, 16, 5, torch.float16, QL, 3, 16, 16),  # block size 5: chunks straddle blocks
    ("binary", 20, [15, 17, 48], 6, 2, 24, 16, torch.bfloat16, AB, 2, 16, 16),  # block boundaries, GQA 3, D 24
    ("random", 1, [0, 33, 129], 8, 2, 32, 16, torch.float32, AB, 5, 32, 32),  # one-token decode, 5 chunks
    ("star", 64, [40, 0], 2, 2, 16, 1, torch.float16, PP, 6, 16, 16),  # bit 63, SGLang's block size 1
    ("random", 80, [21, 100], 2, 1, 16, 16, torch.bfloat16, QL, 4, 16, 32),  # three node blocks, second mask word
    ("random", 160, [37], 2, 1, 16, 16, torch.float32, AB, 3, 16, 64),  # three mask words
    ("random", 160, [0], 2, 1, 16, 8, torch.bfloat16, PP, 2, 16, 32),  # parent walk across three words, empty context
]


@needs_triton
@pytest.mark.parametrize("kind,nodes,ctx,hq,hkv,dim,bs,dtype,mode,splits,min_tokens,block_n", SPLIT_CASES)
def test_split_matches_dense(kind, nodes, ctx, hq, hkv, dim, bs, dtype, mode, splits, min_tokens, block_n):
    p = problem(kind, nodes, ctx, hq, hkv, dim, bs, dtype, mode, seed=nodes + 7 * len(ctx))
    out = tree_attention_triton(*p.args(), kernel="split", num_splits=splits, split_min_tokens=min_tokens, block_n=block_n)
    assert_close(out, p.dense(), dtype)


@needs_triton
@pytest.mark.parametrize("seed", range(6))
def test_split_random_configurations(seed):
    """Seeded random shapes and split plans through the split kernel: == dense."""
    gen = torch.Generator().manual_seed(2000 + seed)

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=gen))]

    nodes = pick([1, 3, 9, 16, 33, 65])
    hkv = pick([1, 2])
    batch = pick([1, 2])
    ctx = [pick([0, 1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 150]) for _ in range(batch)]
    dtype = pick([torch.float32, torch.float16, torch.bfloat16])
    p = problem(pick(["random", "chain", "star", "binary"]), nodes, ctx, hkv * pick([1, 2, 4]), hkv, pick([16, 32]),
                pick([1, 5, 16]), dtype, pick([AB, PP, QL]), seed=seed)  # fmt: skip
    out = tree_attention_triton(*p.args(), kernel="split", num_splits=pick([1, 2, 3, 5, 8]),
                                split_min_tokens=pick([16, 32]), block_n=pick([16, 32, 64]))  # fmt: skip
    assert_close(out, p.dense(), dtype)


@needs_triton
def test_dispatcher_picks_split_at_small_batch(monkeypatch):
    """tree_attention(impl="triton") with no knobs: the plan chooses the split
    kernel for one request on a (pretend) 132-SM GPU, and the result is right."""
    monkeypatch.setattr(attention_triton, "SPLIT_MIN_TOKENS", 16)
    monkeypatch.setattr(attention_triton, "_num_sms", lambda device_type, index: 132)
    p = problem("random", 6, [90], hq=4, hkv=2, dim=16, block_size=16, seed=4)
    plan = plan_tree_attention(1, 6, 4, 2, 16, 16, p.block_table.shape[1], DEVICE)
    assert plan.kernel == "split" and plan.num_splits > 2
    assert_close(tree_attention(*p.args(), impl="triton"), p.dense(), torch.float32)


def test_plan_from_shapes(monkeypatch):
    """The launch plan depends on shapes (and the SM count) only, never on context values."""
    monkeypatch.setattr(attention_triton, "_num_sms", lambda device_type, index: 132)
    llama = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)

    def plan(batch, nodes, max_blocks, **kw):
        return plan_tree_attention(batch, nodes, llama["num_q_heads"], llama["num_kv_heads"], llama["head_dim"],
                                   llama["block_size"], max_blocks, "cuda", **kw)  # fmt: skip

    # batch 64: 512 programs already fill 132 SMs: one pass, no workspace
    p = plan(64, 8, 260)
    assert (p.kernel, p.num_splits, p.workspace_bytes) == ("single", 1, 0)
    # batch 1, 4k context: 8 programs per chunk -> ceil(264 / 8) = 33, capped by 4096 / 128 = 32 chunks
    p = plan(1, 8, 260, max_context_len=4096)
    assert (p.kernel, p.num_splits, p.min_chunk, p.block_n) == ("split", 32, 128, 64)
    assert p.programs == 8 * 33 and p.workspace_bytes == 8 * 32 * 33 * 129 * 4
    # batch 8: ceil(264 / 64) = 5 chunks
    assert plan(8, 8, 260).num_splits == 5
    # T = 64: 4 node blocks of 16 nodes, chunk >= T * group / 2 = 128
    p = plan(1, 64, 260)
    assert (p.node_blocks, p.num_splits) == (4, 9)
    # a short block table (or a max_context_len hint) bounds the chunk count
    assert plan(1, 8, 16).num_splits == 2  # 256 - 8 positions -> 2 chunks of >= 128
    assert plan(1, 8, 8192, max_context_len=1024).num_splits == 8
    assert plan(1, 8, 8192).num_splits == 33  # 131k reach: the SM target decides
    assert plan(1, 8, 1).kernel == "single"  # no room for a prefix
    # forced choices, and SPLIT_MAX
    assert plan(64, 8, 260, kernel="split").kernel == "split"
    assert plan(1, 8, 260, kernel="single").kernel == "single"
    assert plan(1, 8, 260, num_splits=3).num_splits == 3
    assert plan(1, 1, 10**6).num_splits <= attention_triton.SPLIT_MAX
    # the workspace cap lowers S
    monkeypatch.setattr(attention_triton, "SPLIT_WORKSPACE_MAX_BYTES", 1 << 20)
    p = plan(1, 8, 260, max_context_len=4096)
    assert p.kernel == "split" and p.workspace_bytes <= 1 << 20 and p.num_splits == 6
    with pytest.raises(ValueError, match="kernel"):
        plan(1, 8, 260, kernel="fast")
    with pytest.raises(ValueError, match="num_splits"):
        plan(1, 8, 260, num_splits=0)


def test_kernels_compile_for_sm90():
    """The split, merge and single-pass launches, and the draft-step kernel
    (issue #37), compile to sm_90 cubins (Triton's bundled ptxas) without
    spilling the bf16 / fp16 paths: what the interpreter cannot show before a
    GPU run."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton has no NVIDIA backend (sm_90 compiler)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = Path(__file__).with_name("triton_aot.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and rows, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert {r["kernel"] for r in rows} == {"_tree_attention_kernel", "_tree_attention_split_kernel",
                                           "_tree_attention_merge_kernel", "_branch_attention_kernel"}
    for r in rows:
        if r["dtype"] != "float32" and "stack" in r:
            assert r["stack"] == 0 and r["local"] == 0, f"register spills: {r}"


# ------------------------------------------------------- branches stay apart


def sibling_isolation(impl, mode, **triton_kwargs):
    # node 3 (under 1) and the subtree of its uncle 2 = {2, 5, 6, 9, 10}
    parent = [-1, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7]
    gen = torch.Generator().manual_seed(11)
    p = Problem([13, 5], [parent, parent], 4, 2, 16, 16, torch.float32, mode, gen)
    subtree = {2, 5, 6, 9, 10}
    def run():
        if triton_kwargs:
            return tree_attention_triton(*p.args(), **triton_kwargs)
        return tree_attention(*p.args(), impl=impl)

    before = run()
    # overwrite the subtree's K/V in the cache (request 0 only)
    for node in subtree:
        pos = p.ctx_lens[0] + node
        block = int(p.block_table[0, pos // 16])
        p.k_cache[block, pos % 16] = 1e3 * torch.randn(2, 16, generator=gen)
        p.v_cache[block, pos % 16] = 1e3 * torch.randn(2, 16, generator=gen)
    after = run()
    outside = [i for i in range(len(parent)) if i not in subtree]
    assert torch.equal(before[0, outside], after[0, outside]), "a node saw a sibling branch"
    assert torch.equal(before[1], after[1]), "a request saw another request's KV"
    for node in subtree:
        assert not torch.allclose(before[0, node], after[0, node]), f"node {node} ignored its own branch"


@pytest.mark.parametrize("mode", [AB, PP, QL])
def test_sibling_branch_invisible_reference(mode):
    sibling_isolation("torch", mode)


@needs_triton
@pytest.mark.parametrize("mode", [AB, PP, QL])
def test_sibling_branch_invisible_triton(mode):
    sibling_isolation("triton", mode)


@needs_triton
@pytest.mark.parametrize("mode", [AB, PP, QL])
def test_sibling_branch_invisible_split(mode):
    sibling_isolation("triton", mode, kernel="split", num_splits=3, split_min_tokens=16, block_n=16)


# ---------------------------------------------------------------- dispatcher


def test_dispatch_and_validation():
    p = problem("random", 6, [2, 9], seed=1)
    args = p.args(torch.device("cpu"))
    ref = tree_attention_reference(*args)
    assert torch.equal(tree_attention(*args, impl="torch"), ref)
    # auto on CPU: the host kernel once built (by an earlier test or an engine), else the reference
    auto = tree_attention(*args)
    if cpu_attention.available():
        assert_close(auto, ref, torch.float32)
    else:
        assert torch.equal(auto, ref)
    with pytest.raises(ValueError, match="impl"):
        tree_attention(*args, impl="cuda")
    q, k, v, table, ctx, mask, mode, scale = args
    with pytest.raises(ValueError, match="FULL_MASK"):
        tree_attention(q, k, v, table, ctx, mask, TreeMaskMode.FULL_MASK)
    with pytest.raises(ValueError, match="ANCESTOR_BITMASK"):
        tree_attention(q, k, v, table, ctx, mask[:, :5], mode)
    with pytest.raises(ValueError, match="multiple"):
        tree_attention(q[:, :, :3], k, v, table, ctx, mask, mode)
    with pytest.raises(TypeError, match="dtype"):
        tree_attention(q.half(), k, v, table, ctx, mask, mode)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            tree_attention(*args, impl="triton")


def test_dispatch_honours_the_impl_env(monkeypatch):
    """tree_attention resolves ``auto`` by ``spec_tree_kernels.resolve_impl``,
    like every op: SPEC_TREE_KERNELS_IMPL is honoured, except where it names an
    implementation tree attention lacks (CUDA C++), which leaves ``auto``."""
    from spec_tree_kernels.api import resolve_impl

    p = problem("random", 6, [2, 9], seed=1)
    args = p.args(torch.device("cpu"))
    ref = tree_attention_reference(*args)
    monkeypatch.setenv("SPEC_TREE_KERNELS_IMPL", "cuda")
    auto_on_cpu = "cpu" if cpu_attention.available() else "torch"  # what auto picks without the variable
    assert resolve_impl("attention", "auto", torch.device("cpu")) == auto_on_cpu
    assert_close(tree_attention(*args), ref, torch.float32)
    with pytest.raises(ValueError, match="impl"):
        resolve_impl("attention", "cuda", torch.device("cpu"))
    monkeypatch.setenv("SPEC_TREE_KERNELS_IMPL", "torch")
    assert torch.equal(tree_attention(*args), ref)
    monkeypatch.setenv("SPEC_TREE_KERNELS_IMPL", "triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            tree_attention(*args)
    else:
        assert_close(tree_attention(*args), ref, torch.float32)


# ------------------------------------------------ per-step plan, per-layer run


def finite_problem(kind, nodes, ctx_lens, seed=0, **kw) -> Problem:
    """A problem whose unowned cache slots hold large finite garbage (the torch
    plan adds a -inf bias, so NaN there would poison 0 * NaN; engines zero-fill),
    and whose block table has no -1 padding (the plan's blocks are read
    directly; a real block table's spare entries are valid block ids)."""
    p = problem(kind, nodes, ctx_lens, seed=seed, **kw)
    gen = torch.Generator().manual_seed(seed + 100)
    for cache in (p.k_cache, p.v_cache):
        nan = torch.isnan(cache)
        cache[nan] = (torch.rand(int(nan.sum()), generator=gen) * 1e3).to(cache.dtype)
    p.block_table = torch.where(p.block_table < 0, torch.zeros_like(p.block_table), p.block_table)
    return p


def another_layer(p: Problem, seed: int) -> Problem:
    """The next layer of the same step: same trees, contexts and block table,
    new queries and K/V written where the block table puts them."""
    gen = torch.Generator().manual_seed(seed)
    layer = copy.copy(p)
    layer.k_cache, layer.v_cache, layer.k, layer.v = p.k_cache.clone(), p.v_cache.clone(), [], []
    block_size = p.k_cache.shape[1]
    for b, ctx in enumerate(p.ctx_lens):
        pos = torch.arange(ctx + p.nodes)
        blocks = p.block_table[b].long()[pos // block_size]
        k, v = (torch.randn(len(pos), *p.k_cache.shape[2:], generator=gen).to(p.k_cache.dtype) for _ in "kv")
        layer.k_cache[blocks, pos % block_size], layer.v_cache[blocks, pos % block_size] = k, v
        layer.k.append(k)
        layer.v.append(v)
    layer.q = torch.randn(p.q.shape, generator=gen).to(p.q.dtype)
    return layer


def plan_of(p: Problem, impl: str, max_context_len=None, device=DEVICE):
    from spec_tree_kernels.attention_plan import TreeAttentionPlan

    _, k_cache, _, table, ctx, mask, mode, _ = p.args(device)
    return TreeAttentionPlan.create(table, ctx, mask, mode, p.nodes, k_cache.shape[1], max_context_len, impl=impl)


PLAN_IMPLS = ["torch", pytest.param("triton", marks=needs_triton)]


@pytest.mark.parametrize("impl", PLAN_IMPLS)
@pytest.mark.parametrize("mode", [AB, PP, QL])
def test_plan_runs_every_layer_like_the_one_call_op(impl, mode):
    """One plan, several layers (different q and caches, GQA): each layer's run
    equals the independent dense attention; the Triton path plans its launch
    once (one cached launch for the layers' common head shape)."""
    first = finite_problem("random", 7, [0, 19, 45], seed=1, hq=6, hkv=2, mode=mode)
    layers = [first, another_layer(first, 2), another_layer(first, 3)]
    plan = plan_of(layers[0], impl, max_context_len=45)
    assert plan.impl == impl
    for p in layers:
        q, k_cache, v_cache, *_ = p.args()
        assert_close(plan.run(q, k_cache, v_cache, p.scale), p.dense(), torch.float32)
    if impl == "triton":
        assert len(plan._launches) == 1


@needs_triton
def test_plan_split_kernel_reuses_its_workspace_across_layers(monkeypatch):
    """At small batch the plan picks the split kernel; its fp32 workspace is
    made once and reused, and a second layer with other contexts' values is
    still exact (stale partial states are never read)."""
    monkeypatch.setattr(attention_triton, "SPLIT_MIN_TOKENS", 16)
    first = finite_problem("binary", 5, [70, 3], seed=4, hq=2, hkv=1)
    layers = [first, another_layer(first, 5)]
    plan = plan_of(layers[0], "triton")
    for p in layers:
        q, k_cache, v_cache, *_ = p.args()
        assert_close(plan.run(q, k_cache, v_cache, p.scale), p.dense(), torch.float32)
    (launch, workspace), = plan._launches.values()
    assert launch.kernel == "split" and launch.num_splits > 1 and workspace is not None


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch,kernel", [(1, "split"), (3, "single")])
def test_triton_plan_writes_the_callers_rows(monkeypatch, batch, kernel, dtype):
    """Issue #37 (6): the Triton run writes the ``out`` it is given (vLLM's
    output rows, a view at the step's first tree row, row stride of the
    engine's buffer): the single-pass kernel alone, or split + merge, and no
    copy afterwards; rows around it stay untouched. Before, the run wrote a
    tensor of its own and the adapter copied it (a third launch per layer)."""
    monkeypatch.setattr(attention_triton, "SPLIT_MIN_TOKENS", 16)
    p = finite_problem("binary", 5, [70, 3, 40][:batch], seed=6, hq=4, hkv=2, dtype=dtype)
    q, k_cache, v_cache, *_ = p.args()
    plan = plan_of(p, "triton", max_context_len=70)
    nodes, hq, dim = q.shape[1:]
    engine_out = torch.full((batch * nodes + 3, hq * dim + 4), float("nan"), dtype=dtype, device=DEVICE)
    dst = engine_out[2: 2 + batch * nodes, : hq * dim].view(batch, nodes, hq, dim)
    with recording() as launched:
        res = plan.run(q, k_cache, v_cache, p.scale, out=dst)
    assert res is dst
    (launch, _), = plan._launches.values()
    assert launch.kernel == kernel
    want = (["_tree_attention_kernel"] if kernel == "single"
            else ["_tree_attention_split_kernel", "_tree_attention_merge_kernel"])
    assert [v.kernel for v in launched] == want
    assert_close(dst, p.dense(), dtype)
    assert engine_out[:2].isnan().all() and engine_out[2 + batch * nodes:].isnan().all()
    assert engine_out[:, hq * dim:].isnan().all()


def test_torch_plan_reads_only_the_blocks_the_longest_request_uses():
    p = finite_problem("random", 5, [13, 0, 30], seed=11, hq=4, hkv=2, block_size=8)
    p.block_table = torch.cat([p.block_table, torch.zeros(3, 4, dtype=torch.int32)], 1)  # spare columns
    plan = plan_of(p, "torch", max_context_len=30, device=torch.device("cpu"))
    assert plan.blocks.shape == (3, 5)  # ceil((30 + 5) / 8)
    q, k_cache, v_cache, *_ = p.args(torch.device("cpu"))
    assert_close(plan.run(q, k_cache, v_cache, p.scale), p.dense(), torch.float32)
    unbounded = plan_of(p, "torch", device=torch.device("cpu"))  # no bound: the block table's width
    assert unbounded.blocks.shape == (3, p.block_table.shape[1])
    assert_close(unbounded.run(q, k_cache, v_cache, p.scale), p.dense(), torch.float32)


@pytest.mark.parametrize("impl", PLAN_IMPLS)
def test_plan_of_an_empty_batch(impl):
    from spec_tree_kernels.attention_plan import TreeAttentionPlan
    from spec_tree_kernels.modes import empty_tree_mask

    mask = empty_tree_mask(AB, 0, 4, 0, DEVICE, zeroed=True)
    plan = TreeAttentionPlan.create(torch.zeros(0, 2, dtype=torch.int32, device=DEVICE),
                                    torch.zeros(0, dtype=torch.int32, device=DEVICE), mask, AB, 4, 16, 0, impl=impl)
    cache = torch.zeros(3, 16, 2, 16, device=DEVICE)
    assert plan.run(torch.zeros(0, 4, 4, 16, device=DEVICE), cache, cache).shape == (0, 4, 4, 16)


def test_plan_validates_the_step_once_and_each_layer_against_it():
    """Bad step inputs fail at create, naming what is wrong; a layer whose
    shapes do not match the plan fails at run (never a wrong answer)."""
    p = finite_problem("random", 6, [2, 9], seed=1)
    cpu = torch.device("cpu")
    q, k_cache, v_cache, table, ctx, mask, mode, _ = p.args(cpu)
    from spec_tree_kernels.attention_plan import TreeAttentionPlan

    with pytest.raises(ValueError, match="tree_mask must be"):
        TreeAttentionPlan.create(table, ctx, mask[:1], mode, 6, 16)
    with pytest.raises(ValueError, match="FULL_MASK"):
        TreeAttentionPlan.create(table, ctx, mask, TreeMaskMode.FULL_MASK, 6, 16)
    with pytest.raises(ValueError, match="batch"):
        TreeAttentionPlan.create(table[:1], ctx, mask, mode, 6, 16)
    with pytest.raises(TypeError, match="int32 or int64"):
        TreeAttentionPlan.create(table.float(), ctx, mask, mode, 6, 16)
    with pytest.raises(ValueError, match="block_size"):
        TreeAttentionPlan.create(table, ctx, mask, mode, 6, 0)
    plan = TreeAttentionPlan.create(table, ctx, mask, mode, 6, 16, impl="torch")
    with pytest.raises(ValueError, match="6 nodes"):
        plan.run(q[:, :5], k_cache, v_cache)
    with pytest.raises(ValueError, match="block size 8"):
        plan.run(q, k_cache.view(-1, 8, *k_cache.shape[2:]), v_cache.view(-1, 8, *v_cache.shape[2:]))
    with pytest.raises(TypeError, match="dtype"):
        plan.run(q.half(), k_cache, v_cache)


def test_plan_resolves_its_impl_like_every_op(monkeypatch):
    """``impl="auto"`` goes through ``resolve_impl`` (SPEC_TREE_KERNELS_IMPL honoured)."""
    p = finite_problem("random", 4, [3, 8], seed=2)
    monkeypatch.setenv("SPEC_TREE_KERNELS_IMPL", "torch")
    assert plan_of(p, "auto").impl == "torch"
    monkeypatch.setenv("SPEC_TREE_KERNELS_IMPL", "cpu")
    if cpu_attention.available() and DEVICE.type == "cpu":
        assert plan_of(p, "auto").impl == "cpu"
    monkeypatch.setenv("SPEC_TREE_KERNELS_IMPL", "triton")
    if _triton_usable(DEVICE):
        assert plan_of(p, "auto").impl == "triton"
    else:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            plan_of(p, "auto")


# ------------------------------------------------ the host C kernel (impl="cpu")

from spec_tree_kernels import cpu_attention  # noqa: E402

# Skipped only where no compiler exists: where one does, a build error of ours fails the tests below.
needs_cc = pytest.mark.skipif(cpu_attention.find_compiler() is None,
                              reason="no host C compiler (cc, gcc or $CC) to build tree_attention_cpu.c")


@pytest.fixture
def host_kernel():
    assert cpu_attention.build(), cpu_attention.build_error()


def cpu_layout(cache_k: torch.Tensor, cache_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same K/V in vLLM-CPU's fp32 layout ([num_blocks, Hkv, block_size, 2D]:
    per block and head, K transposed [D, block_size], then V [block_size, D]),
    as [num_blocks, block_size, Hkv, D] views (``cpu_kv_views``' strides)."""
    nb, bs, hkv, dim = cache_k.shape
    raw = torch.empty(nb, hkv, bs, 2 * dim, dtype=cache_k.dtype)
    k = raw.as_strided((nb, bs, hkv, dim), (raw.stride(0), 1, raw.stride(1), bs))
    v = raw.as_strided((nb, bs, hkv, dim), (raw.stride(0), dim, raw.stride(1), 1), bs * dim)
    k.copy_(cache_k)
    v.copy_(cache_v)
    return k, v


@needs_cc
@pytest.mark.parametrize("layout", ["contiguous", "cpu"])
@pytest.mark.parametrize("mode", [AB, PP, QL])
@pytest.mark.parametrize("kind,nodes,ctx,hq,hkv,bs", [("random", 7, [0, 19, 45], 6, 2, 16), ("chain", 8, [130], 9, 3, 64), ("random", 8, [300, 7], 9, 3, 128),
                                                     ("star", 5, [3, 64, 200], 4, 4, 32), ("random", 1, [17], 2, 1, 16),
                                                     ("random", 8, [2030, 1500, 900, 2000], 8, 4, 128)])
def test_cpu_kernel_plan_equals_dense(layout, mode, kind, nodes, ctx, hq, hkv, bs, host_kernel):
    """The host kernel over several layers of one step equals the independent
    dense attention, in the generic-stride loops (contiguous cache) and the
    vectorized ones (vLLM-CPU's transposed K); the last case's K and V (17 MB)
    take the vectorized loops' prefetching instantiation (PREFETCH_BYTES)."""
    first = finite_problem(kind, nodes, ctx, seed=5, hq=hq, hkv=hkv, dim=64 if bs >= 64 else 16, block_size=bs,
                           mode=mode)
    layers = [first, another_layer(first, 6)]
    plan = plan_of(first, "cpu", max_context_len=max(ctx))
    assert plan.impl == "cpu"
    for p in layers:
        q, k_cache, v_cache, *_ = p.args()
        if layout == "cpu":
            k_cache, v_cache = cpu_layout(k_cache, v_cache)
            assert k_cache.stride(1) == 1
        assert_close(plan.run(q, k_cache, v_cache, p.scale), p.dense(), torch.float32)


@needs_cc
@pytest.mark.parametrize("layout", ["contiguous", "cpu"])
@pytest.mark.parametrize("dim,bs", [(32, 16), (128, 32), (64, 128)])
def test_cpu_kernel_never_reads_past_what_a_request_sees(layout, dim, bs, host_kernel):
    """NaN in every slot no request stored and -1 block table padding: the
    kernel stops at each request's last visible position and skips padding
    blocks, so the output is finite and equals the dense attention. Head dims
    32 and 128 take the vectorized value loop in one and in two passes."""
    p = problem("random", 6, [0, 37, 130], seed=11, hq=8, hkv=2, dim=dim, block_size=bs)
    q, k_cache, v_cache, *_ = p.args()
    if layout == "cpu":
        k_cache, v_cache = cpu_layout(k_cache, v_cache)
    plan = plan_of(p, "cpu", max_context_len=130)
    assert_close(plan.run(q, k_cache, v_cache, p.scale), p.dense(), torch.float32)


@needs_cc
def test_cpu_kernel_result_does_not_depend_on_the_thread_count(host_kernel):
    """Units split over OpenMP threads: one thread and two give the same bits."""
    p = finite_problem("random", 8, [300, 7, 64], seed=13, hq=9, hkv=3, dim=64, block_size=128)
    q, k_cache, v_cache, *_ = p.args()
    k_cache, v_cache = cpu_layout(k_cache, v_cache)
    threads = torch.get_num_threads()
    try:  # a plan's workspace is sized for the pool when it first runs: one plan per thread count
        torch.set_num_threads(1)
        one = plan_of(p, "cpu", max_context_len=300).run(q, k_cache, v_cache, p.scale)
        torch.set_num_threads(2)
        two = plan_of(p, "cpu", max_context_len=300).run(q, k_cache, v_cache, p.scale)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert_close(two, p.dense(), torch.float32)


@needs_cc
def test_cpu_kernel_planned_call_reads_fused_rows_in_place_and_tracks_each_cache(host_kernel):
    """The per-layer call as the vLLM adapter makes it: q rows of a fused qkv
    ([N, (Hq + 2 Hkv) * D], tokens further apart than Hq * D) read in place,
    the result written into a strided output view; the layers' memoized
    arguments follow each cache (two caches of one shape give each its own
    answer, every call), and a cache of another block size is refused."""
    p = finite_problem("random", 8, [150, 9], seed=17, hq=9, hkv=3, dim=64, block_size=128)
    other = another_layer(p, 3)
    plan = plan_of(p, "cpu", max_context_len=150)
    batch, nodes, hq, dim = p.args()[0].shape
    fused = torch.randn(batch * nodes, (hq + 6) * dim)
    out_rows = torch.full((batch * nodes, (hq + 1) * dim), float("nan"))
    for _ in range(2):
        for layer in (p, other):
            q, k_cache, v_cache, *_ = layer.args()
            k_cache, v_cache = cpu_layout(k_cache, v_cache)
            fused[:, : hq * dim] = q.reshape(batch * nodes, hq * dim)
            q_view = fused[:, : hq * dim].view(batch, nodes, hq, dim)
            out = out_rows[:, : hq * dim].view(batch, nodes, hq, dim)
            assert plan.run(q_view, k_cache, v_cache, layer.scale, out=out) is out
            assert_close(out, layer.dense(), torch.float32)
    assert torch.isnan(out_rows[:, hq * dim:]).all()  # nothing written past the output rows
    q, k_cache, v_cache, *_ = p.args()
    wrong = k_cache.view(k_cache.shape[0] * 2, 64, *k_cache.shape[2:])
    with pytest.raises(ValueError, match="block"):
        plan.run(q, wrong, v_cache.view_as(wrong), p.scale)


def _native_vector_floats() -> int:
    """Floats per vector register of the CPU the kernel is built for, as the
    compiler sees it under the kernel's -march=native (its predefined macros)."""
    macros = subprocess.run([cpu_attention.find_compiler(), "-march=native", "-dM", "-E", "-x", "c", os.devnull],
                            check=True, capture_output=True, text=True).stdout.split()
    return 16 if "__AVX512F__" in macros else 8 if "__AVX__" in macros else 4


@needs_cc
def test_cpu_kernel_register_block_is_one_vector_register(host_kernel):
    """The kernel's accumulators are sized for one vector register of this CPU:
    16-float blocks built for an AVX2 CPU spill every accumulator (7-9x slower,
    results/2026-12-03/cpu_tree_attention)."""
    assert cpu_attention.register_block_floats() == _native_vector_floats()


@needs_cc
def test_cpu_kernel_falls_back_to_torch_for_other_dtypes(host_kernel):
    p = finite_problem("random", 6, [5, 33], seed=7, dtype=torch.bfloat16)
    q, k_cache, v_cache, *_ = p.args()
    assert not cpu_attention.supports(q, k_cache, v_cache)
    cpu = plan_of(p, "cpu", max_context_len=33).run(q, k_cache, v_cache, p.scale)
    torch_path = plan_of(p, "torch", max_context_len=33).run(q, k_cache, v_cache, p.scale)
    assert torch.equal(cpu, torch_path)


@needs_cc
def test_auto_takes_the_built_host_kernel_for_tree_attention_only(monkeypatch, host_kernel):
    """Built, the host kernel is auto's tree attention on CPU; every other op
    stays on torch; SPEC_TREE_KERNELS_IMPL=torch forces the torch path; not
    built, auto falls back to torch and an explicit "cpu" is refused."""
    from spec_tree_kernels.api import resolve_impl

    p = finite_problem("random", 4, [3, 8], seed=2)
    cpu = torch.device("cpu")
    assert resolve_impl("attention", "auto", cpu) == "cpu"
    assert resolve_impl("verify", "auto", cpu) == "torch"  # no other op has a host kernel
    with pytest.raises(ValueError, match="impl"):
        resolve_impl("verify", "cpu", cpu)
    assert_close(tree_attention(*p.args(cpu)), p.dense(), torch.float32)
    monkeypatch.setenv("SPEC_TREE_KERNELS_IMPL", "torch")
    assert resolve_impl("attention", "auto", cpu) == "torch"
    monkeypatch.delenv("SPEC_TREE_KERNELS_IMPL")
    monkeypatch.setattr(cpu_attention, "_lib", None)  # as where no compiler built it
    assert resolve_impl("attention", "auto", cpu) == "torch"
    with pytest.raises(RuntimeError, match="impl='cpu' needs"):
        plan_of(p, "cpu")


def test_startup_refuses_a_requested_host_kernel_that_did_not_build(monkeypatch):
    from spec_tree_kernels import startup

    monkeypatch.setattr(cpu_attention, "_lib", None)
    monkeypatch.setattr(cpu_attention, "build", lambda compiler=None: False)
    monkeypatch.setattr(cpu_attention, "_error", "no C compiler (cc, gcc or $CC) on PATH")
    assert startup.prepare("cpu")["attention"] == "torch"  # not asked for: torch serves
    monkeypatch.setenv("SPEC_TREE_KERNELS_IMPL", "cpu")
    with pytest.raises(RuntimeError, match="SPEC_TREE_KERNELS_IMPL=cpu asks for the host tree attention kernel"):
        startup.prepare("cpu")


def test_cpu_kernel_build_failure_is_reported_not_raised(monkeypatch, tmp_path):
    """A compiler that fails (or is missing) leaves the torch path and says why."""
    monkeypatch.setattr(cpu_attention, "_lib", None)
    monkeypatch.setenv("SPEC_TREE_KERNELS_BUILD_DIR", str(tmp_path))
    assert cpu_attention.build(compiler="false") is False
    assert "false could not build tree_attention_cpu.c" in cpu_attention.build_error()
    assert cpu_attention.build(compiler=str(tmp_path / "no-such-cc")) is False
    assert "no-such-cc" in cpu_attention.build_error()
    assert not cpu_attention.available()
