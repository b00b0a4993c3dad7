"""Draft-step attention of tree drafting over a paged KV cache, read in place.

One tree-drafting level runs the draft head on the K frontier nodes of R
requests. Frontier node j of request r attends to

* the request's committed head KV: positions [0, kv_lens[r]) of the paged
  cache, through its block table row (no copy of the context is made), and
* the branch entries drafted at earlier levels that are its ancestors
  (``ancestors``), plus its own entry: the scratch ``branch_k`` / ``branch_v``,
  whose last K filled entries are this level's (entry filled - K + j is j's).

``BranchAttentionPlan.create`` is the drafting step's host work (once per
step: block rows and lengths normalised, the implementation resolved);
``run`` is one level. Shapes (Hq query / Hkv KV heads, G = Hq / Hkv, D head dim)::

    query       [R, K, Hq, D]  the level's queries (RoPE applied), any strides
    k_cache, v_cache  [num_blocks, block_size, Hkv, D] views of the head
                layer's paged cache, any strides, the query's dtype
    blocks      [R, >= ceil(max_kv_len / block_size)] int block ids (table rows)
    kv_lens     [R] int committed positions per request (0 allowed)
    max_kv_len  host int >= every kv_lens entry (the caller's bookkeeping:
                never read from the device)
    branch_k, branch_v  [R, E, Hkv, D] scratch in the cache dtype, entries
                [0, filled) written, the last K of them this level's
    ancestors   [R, K, filled - K] bool: entry e is an ancestor of node j
    out         [R, K, Hq, D] in the query's dtype, any strides: written in place

Implementations (``impl``, resolved by ``api.resolve_impl("attention")``):

triton (CUDA; CPU under TRITON_INTERPRET=1)
    ``_branch_attention_kernel``: the split-KV machinery of the verify
    kernels (``attention_triton``: launch plan, chunk rule, merge kernel).
    Grid ``(node_blocks, S + 1, R * Hkv)``: program (n, s, r * Hkv + h) holds
    the query rows of node block n x KV head h's G heads (GQA: K/V loaded once
    per group) and attends them to context chunk s (s < S, paged, in place)
    or to the branch entries (s = S, ancestor mask), writing a partial state
    (normalised output and log2-sum-exp) to the fp32 workspace; the verify
    merge kernel (T = K) combines them into ``out``: 2 launches per level.
    When the plan needs no split (a batch that fills the GPU) one program per
    (n, r, h) does context then branch and writes ``out``: 1 launch. The
    launch grid follows shapes and ``max_kv_len`` only: no host sync, CUDA-graph
    capturable. Temporaries: the workspace, R * K * Hq * (S + 1) * (D + 1) * 4
    bytes, S <= SPLIT_MAX (and capped at SPLIT_WORKSPACE_MAX_BYTES), made once
    per drafting step and reused by its levels.
torch (and "cpu" where the host kernel does not apply)
    Online softmax over the context in chunks of whole blocks: per chunk the
    chunk's K/V are gathered (and upcast to fp32: chunk only), scored, and
    folded into the running (max, sum, output) state; the branch entries go
    first, so the running max is finite (every node sees itself) before any
    chunk. Chunks are sized so that a chunk's temporaries stay under
    ``chunk_bytes`` (default TORCH_CHUNK_BYTES): temporary memory is
    O(chunk_bytes + R * K * Hq * (D + E)), not O(R * context).

The host C kernel (``cpu_attention.run_branch``) is the vLLM adapter's own
choice on CPU (it reads the paged cache in place too).

Features (``run``'s window / sinks / soft_cap / alibi_slopes, the semantics
of ``attention_reference``), on the draft step's logical positions: committed
token j at j, branch entry e (level e // K + 1) at kv_len + e // K, and the
level's queries (level L = filled // K) at kv_len + L - 1, as the vLLM
drafter's RoPE positions (kv_lens - 1 + level). A window W then shows a
query the context from max(0, kv_len + L - W) and the entries from (L - W) * K
on: one bound per request and level for all its rows, so the Triton kernel
starts its context loop (or its split chunks) there and the merge agrees
(the effective window W - L + 1 on the context). Sinks join the final
denominator (single pass) or the merge. All of it is launch arguments and
constexpr flags: no device value, no variant per level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from . import triton_launch
from .api import resolve_impl
from .attention_reference import NO_FEATURES, AttentionFeatures, _default_scale, check_features
from .attention_triton import (_FEATURE_POINTERS, _QUERY_ROWS, _SPLITS, _add_sink, _attend_prefix, _chunk_len, _jit,
                               _next_pow2, _online_softmax_step, _window_start, feature_launch_args, launch_merge,
                               plan_tree_attention, require_triton, split_workspace, tl)
from .kv_layout import refuse_tiled
from .triton_launch import triton_interpreting

TORCH_CHUNK_BYTES = 64 << 20  # torch path: temporaries of one context chunk (all requests)
# per position of a chunk and per request, the torch path holds at most: the
# gathered K and V in the cache dtype and in fp32, their matmul-ready copies,
# and two fp32 score rows (scores, probabilities) per query row
_TORCH_COPIES_KV = 3
_TORCH_COPIES_SCORES = 3
# Branch entries per tile of the Triton kernel: a level has (level) * K of them,
# tens at most, and each tile loads a [BLOCK_M, tile] ancestor mask with one
# address per element: 16 (tl.dot's least) keeps the fp16 / bf16 kernel
# free of register spills at 64 query rows and D 128 (tests/triton_aot.py).
BRANCH_TILE = 16

# Besides the query rows (``_QUERY_ROWS``): the output is the engine's buffer
# (vLLM's output rows of the draft tokens), the ancestor mask a slice of the
# drafter's bookkeeping whose width grows per level, the block rows a copy
# sized by the step's longest context, and ``filled`` the level's entry
# count; the branch scratch's V half starts R-dependent bytes after its K
# half. None of them may make a variant of its own, or a level or a step
# would compile one the warm-up did not launch.
_DRAFT_UNSPECIALIZED = (_QUERY_ROWS["do_not_specialize"] + _SPLITS
                        + ["stride_or", "stride_ok", "stride_ar", "stride_ak", "stride_ae", "stride_bt", "filled",
                           "window"])
_DRAFT_UNALIGNED = (_QUERY_ROWS["do_not_specialize_on_alignment"] + ["out_ptr", "anc_ptr", "bk_ptr", "bv_ptr"]
                    + [p for p in _FEATURE_POINTERS if p != "depth_ptr"])


# -------------------------------------------------------------------- kernel


@_jit
def _attend_branch(
    q, m_i, l_i, acc, e_end, own_start, node, row_ok, bk_row_ptr, bv_row_ptr, anc_row_ptr,
    stride_be, stride_bd, stride_ve, stride_vd, stride_ak, stride_ae, dims, dims_ok, qk_scale,
    BLOCK_E: tl.constexpr, DOT_F32: tl.constexpr,
    e_lo=0, level=0, slope2=0.0, cap2=0.0, K: tl.constexpr = 1,
    WINDOW: tl.constexpr = False, SOFT_CAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
):  # fmt: skip
    """Branch entries e < e_end (filled, or 0 for none) of one request and KV
    head: entry e is visible to row node i iff e = own_start + i (its own) or
    e < own_start and ancestors[i, e]; and (WINDOW) e >= e_lo. ALIBI: entry e
    is e // K - (level - 1) positions from the query."""
    cols = tl.arange(0, BLOCK_E)
    safe_node = tl.where(row_ok, node, 0)
    for e0 in range(0, e_end, BLOCK_E):
        e = e0 + cols
        e_ok = e < e_end
        older = e < own_start
        anc = tl.load(anc_row_ptr + safe_node[:, None] * stride_ak + e[None, :] * stride_ae,
                      mask=row_ok[:, None] & (e_ok & older)[None, :], other=0)  # fmt: skip
        own = (e[None, :] - own_start) == node[:, None]
        allowed = tl.where(older[None, :], anc != 0, own) & e_ok[None, :]
        if WINDOW:
            allowed = allowed & (e >= e_lo)[None, :]
        if ALIBI:
            alibi = slope2[:, None] * (e // K - (level - 1)).to(tl.float32)[None, :]
        else:
            alibi = 0.0
        kv_ok = e_ok[:, None] & dims_ok[None, :]
        k = tl.load(bk_row_ptr + e[:, None].to(tl.int64) * stride_be + dims[None, :] * stride_bd, mask=kv_ok, other=0.0)
        v = tl.load(bv_row_ptr + e[:, None].to(tl.int64) * stride_ve + dims[None, :] * stride_vd, mask=kv_ok, other=0.0)
        m_i, l_i, acc = _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_F32, alibi, cap2,
                                             SOFT_CAP, ALIBI)
    return m_i, l_i, acc


@_jit(do_not_specialize=_DRAFT_UNSPECIALIZED, do_not_specialize_on_alignment=_DRAFT_UNALIGNED)
def _branch_attention_kernel(
    q_ptr,  # [R, K, Hq, D] query dtype
    k_ptr,  # [num_blocks, block_size, Hkv, D] paged views (cache dtype = query dtype)
    v_ptr,
    bk_ptr,  # [R, E, Hkv, D] branch scratch, cache dtype
    bv_ptr,
    anc_ptr,  # [R, K, filled - K] uint8 (a bool tensor's bytes)
    out_ptr,  # [R, K, Hq, D] query dtype (single pass only)
    o_part_ptr,  # fp32 [R, K, Hq, S + 1, D] (split only)
    lse_part_ptr,  # fp32 [R, K, Hq, S + 1] (split only)
    block_table_ptr,  # [R, >= used] int block rows
    kv_lens_ptr,  # [R] int committed positions
    sinks_ptr,  # fp32 [Hq] (SINKS, single pass; split: the merge's)
    alibi_ptr,  # fp32 [Hq] slopes (ALIBI)
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_ks, stride_kh, stride_kd,
    stride_vb, stride_vs, stride_vh, stride_vd,
    stride_br, stride_be, stride_bh, stride_bd,
    stride_wr, stride_we, stride_wh, stride_wd,
    stride_ar, stride_ak, stride_ae,
    stride_or, stride_ok, stride_oh, stride_od,
    stride_bt,
    qk_scale,  # softmax scale * log2(e): base 2 throughout
    filled,  # branch entries written, this level's K included
    num_splits,  # S context chunks per request (split), 0 (single pass)
    min_chunk,
    num_kv_heads,
    window,  # W (WINDOW)
    soft_cap2,  # soft cap * log2(e) (SOFT_CAP)
    K: tl.constexpr,  # frontier nodes per request
    GROUP: tl.constexpr,
    HQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NODES: tl.constexpr,  # nodes per program = BLOCK_M // GROUP
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # context positions per tile
    BLOCK_E: tl.constexpr,  # branch entries per tile (BRANCH_TILE)
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,  # write partial states for the merge (else out, directly)
    DOT_F32: tl.constexpr,
    WINDOW: tl.constexpr,  # the module docstring's features
    SOFT_CAP: tl.constexpr,
    ALIBI: tl.constexpr,
    SINKS: tl.constexpr,
):  # fmt: skip
    """Grid (node_blocks, S + 1, R * Hkv), S = num_splits (0 single pass).
    Split: program (n, s, r * Hkv + h) attends context chunk s (s < S) or the
    branch entries (s = S) and stores o = acc / l, lse = m + log2(l) at slot
    ((r * K + node) * Hq + head) * (S + 1) + s (the merge kernel's layout, T = K);
    a chunk past the request's context stores nothing. Single pass: the
    whole context, then the branch, then out."""
    node_block = tl.program_id(0)
    split = tl.program_id(1)
    bh = tl.program_id(2)
    r = (bh // num_kv_heads).to(tl.int64)
    kv_head = bh % num_kv_heads

    rows = tl.arange(0, BLOCK_M)
    node = node_block * NODES + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < NODES * GROUP) & (node < K)
    dims = tl.arange(0, BLOCK_D)
    dims_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + r * stride_qb + node[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dims_ok[None, :],
        other=0.0,
    )

    ctx = tl.load(kv_lens_ptr + r).to(tl.int32)
    level = filled // K  # this level's queries sit at ctx + level - 1
    if WINDOW:  # one bound for every row: the context from lo, the entries from e_lo
        lo = _window_start(ctx, window - level + 1)
        e_lo = (level - window) * K
    else:
        lo = 0
        e_lo = 0
    if SPLIT:
        if WINDOW:
            chunk = _chunk_len(ctx - lo, num_splits, min_chunk, BLOCK_N)
            is_branch = split == num_splits
            p_start = tl.where(is_branch, 0, lo + split * chunk)
            p_end = tl.where(is_branch, 0, tl.minimum(lo + split * chunk + chunk, ctx))
        else:
            chunk = _chunk_len(ctx, num_splits, min_chunk, BLOCK_N)
            is_branch = split == num_splits
            p_start = tl.where(is_branch, 0, split * chunk)
            p_end = tl.where(is_branch, 0, tl.minimum(split * chunk + chunk, ctx))
        e_end = tl.where(is_branch, filled, 0)
    else:
        p_start = lo
        p_end = ctx
        e_end = filled
    qpos = tl.zeros([BLOCK_M], tl.int32)
    slope2 = tl.zeros([BLOCK_M], tl.float32)
    if ALIBI:
        qpos = qpos + ctx + level - 1
        slope2 = tl.load(alibi_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend_prefix(
        q, m_i, l_i, acc, p_start, p_end, block_table_ptr + r * stride_bt,
        k_ptr + kv_head.to(tl.int64) * stride_kh, v_ptr + kv_head.to(tl.int64) * stride_vh,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, dims, dims_ok, qk_scale,
        BLOCK_SIZE, BLOCK_N, DOT_F32, qpos, 0, slope2, soft_cap2, False, SOFT_CAP, ALIBI,
    )  # fmt: skip
    m_i, l_i, acc = _attend_branch(
        q, m_i, l_i, acc, e_end, filled - K, node, row_ok,
        bk_ptr + r * stride_br + kv_head.to(tl.int64) * stride_bh,
        bv_ptr + r * stride_wr + kv_head.to(tl.int64) * stride_wh, anc_ptr + r * stride_ar,
        stride_be, stride_bd, stride_we, stride_wd, stride_ak, stride_ae, dims, dims_ok, qk_scale,
        BLOCK_E, DOT_F32, e_lo, level, slope2, soft_cap2, K, WINDOW, SOFT_CAP, ALIBI,
    )  # fmt: skip

    if SINKS and not SPLIT:  # (split: the merge adds them)
        l_i, acc = _add_sink(m_i, l_i, acc, sinks_ptr, head, row_ok)
    l_safe = tl.where(l_i > 0, l_i, 1.0)  # l_i == 0 only on padding rows and unused chunks
    if SPLIT:
        # a bool scalar & a bool vector is int32 under the interpreter: compare ints
        store_ok = row_ok & (node < tl.where((p_start < p_end) | is_branch, K, 0))
        slot = ((r * K + node) * HQ + head) * (num_splits + 1) + split  # int64
        tl.store(o_part_ptr + slot[:, None] * HEAD_DIM + dims[None, :], acc / l_safe[:, None],
                 mask=store_ok[:, None] & dims_ok[None, :])  # fmt: skip
        tl.store(lse_part_ptr + slot, m_i + tl.log2(l_safe), mask=store_ok)
    else:
        tl.store(
            out_ptr + r * stride_or + node[:, None] * stride_ok + head[:, None] * stride_oh + dims[None, :] * stride_od,
            (acc / l_safe[:, None]).to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dims_ok[None, :],
        )


# ---------------------------------------------------------------------- plan


@dataclass
class BranchAttentionPlan:
    """One drafting step's draft attention: ``create`` once per step, ``run``
    per level (module docstring: shapes, implementations).

    impl        "triton" or "torch" (resolved; "cpu" runs the torch path here:
                the host kernel is the adapter's call, it needs its own layout)
    blocks      int64 [R, nb] block rows, nb = ceil(max_kv_len / block_size) (>= 1)
    kv_lens     [R] int64
    chunk_bytes torch path: byte bound on one context chunk's temporaries
    """

    impl: str
    blocks: torch.Tensor
    kv_lens: torch.Tensor
    max_kv_len: int
    block_size: int
    chunk_bytes: int = TORCH_CHUNK_BYTES
    # triton: (Hq, Hkv, D, K, dtype, window) -> (launch plan, workspace), made by the first level
    _launches: dict = field(default_factory=dict, repr=False)
    _dummy_anc: torch.Tensor | None = field(default=None, repr=False)

    @classmethod
    def create(cls, blocks: torch.Tensor, kv_lens: torch.Tensor, max_kv_len: int, block_size: int, *,
               impl: str = "auto", chunk_bytes: int = TORCH_CHUNK_BYTES) -> "BranchAttentionPlan":
        if blocks.dim() != 2 or kv_lens.dim() != 1 or blocks.shape[0] != kv_lens.shape[0]:
            raise ValueError(f"blocks must be [R, nb] and kv_lens [R], got {tuple(blocks.shape)} and "
                             f"{tuple(kv_lens.shape)}")
        if blocks.dtype not in (torch.int32, torch.int64) or kv_lens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"blocks and kv_lens must be int32/int64, got {blocks.dtype} and {kv_lens.dtype}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_kv_len < 0:
            raise ValueError(f"max_kv_len must be >= 0, got {max_kv_len}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
        used = -(-max_kv_len // block_size)
        if blocks.shape[1] < used:
            raise ValueError(f"blocks has {blocks.shape[1]} columns; max_kv_len={max_kv_len} needs {used} blocks "
                             f"of {block_size}")
        impl = resolve_impl("attention", impl, kv_lens.device)
        if impl == "triton":
            require_triton(kv_lens.device)
        else:
            impl = "torch"
        # int64 whatever the engine's table holds (one kernel variant); one column at least, so that the
        # kernel's pointer is a real one when no request has context yet
        blocks = blocks[:, : max(used, min(1, blocks.shape[1]))].long()
        return cls(impl, blocks, kv_lens.to(torch.int64), int(max_kv_len), int(block_size), int(chunk_bytes))

    def run(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, branch_k: torch.Tensor,
            branch_v: torch.Tensor, filled: int, ancestors: torch.Tensor, scale: float | None,
            out: torch.Tensor, *, window: int | None = None, sinks: torch.Tensor | None = None,
            soft_cap: float | None = None, alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        """One level (module docstring: shapes, and the positions window /
        sinks / soft_cap / alibi_slopes act on); writes and returns ``out``."""
        self._check(query, k_cache, v_cache, branch_k, branch_v, filled, ancestors, out)
        features = check_features(window, sinks, soft_cap, alibi_slopes, num_q_heads=query.shape[2],
                                  device=query.device)
        scale = _default_scale(scale, query.shape[-1])
        if query.shape[0] == 0:
            return out
        if self.impl == "triton":
            self._run_triton(query, k_cache, v_cache, branch_k, branch_v, filled, ancestors, scale, out, features)
        else:
            _run_torch(query, k_cache, v_cache, self.blocks, self.kv_lens, branch_k, branch_v, filled, ancestors,
                       scale, out, self.chunk_bytes, features)
        return out

    # ------------------------------------------------------------- steps

    def _check(self, query, k_cache, v_cache, branch_k, branch_v, filled, ancestors, out) -> None:
        R = self.kv_lens.shape[0]
        if query.dim() != 4 or query.shape[0] != R:
            raise ValueError(f"query must be [R={R}, K, Hq, D], got {tuple(query.shape)}")
        _, K, hq, dim = query.shape
        if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[1] != self.block_size:
            raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} must be equal "
                             f"[num_blocks, block_size={self.block_size}, Hkv, D] views")
        hkv = k_cache.shape[2]
        if k_cache.shape[3] != dim or hq % hkv:
            raise ValueError(f"query heads {hq} x dim {dim} do not fit the cache's {hkv} heads x dim {k_cache.shape[3]}")
        if not (query.dtype == k_cache.dtype == v_cache.dtype == branch_k.dtype == branch_v.dtype == out.dtype):
            raise TypeError(f"query, caches, branch scratch and out must share one dtype, got {query.dtype}, "
                            f"{k_cache.dtype}/{v_cache.dtype}, {branch_k.dtype}/{branch_v.dtype}, {out.dtype}")
        if branch_k.shape != branch_v.shape or branch_k.dim() != 4 or (branch_k.shape[0], *branch_k.shape[2:]) != (R, hkv, dim):
            raise ValueError(f"branch_k {tuple(branch_k.shape)} / branch_v {tuple(branch_v.shape)} must be "
                             f"[R={R}, E, Hkv={hkv}, D={dim}]")
        if not K <= filled <= branch_k.shape[1]:
            raise ValueError(f"filled={filled} must count this level's K={K} entries and fit E={branch_k.shape[1]}")
        if tuple(ancestors.shape) != (R, K, filled - K) or ancestors.dtype != torch.bool:
            raise ValueError(f"ancestors must be bool [R={R}, K={K}, filled - K={filled - K}], got "
                             f"{ancestors.dtype} {tuple(ancestors.shape)}")
        if tuple(out.shape) != tuple(query.shape):
            raise ValueError(f"out {tuple(out.shape)} must be query's shape {tuple(query.shape)}")

    def _run_triton(self, query, k_cache, v_cache, branch_k, branch_v, filled, ancestors, scale, out,
                    features: AttentionFeatures = NO_FEATURES) -> None:
        refuse_tiled("Triton", k_cache=k_cache, v_cache=v_cache)
        R, K, hq, dim = query.shape
        block_size, hkv = k_cache.shape[1], k_cache.shape[2]
        key = (hq, hkv, dim, K, query.dtype, features.window)
        if key not in self._launches:
            # a window shows level 1 (the most context) W - 1 positions: the plan of every level
            plan = plan_tree_attention(R, K, hq, hkv, dim, block_size, self.blocks.shape[1], query.device,
                                       max_context_len=self.max_kv_len, window=features.window)
            # the single pass reads no workspace, but its pointers are part of the variant: a fixed dummy
            dummy = torch.empty(1, dtype=torch.float32, device=query.device)
            self._launches[key] = plan, split_workspace(plan, query) or (dummy, dummy)
        plan, workspace = self._launches[key]
        if ancestors.numel() == 0:  # level 1: nothing to read, but a pointer must be valid (an empty one is 0)
            if self._dummy_anc is None:
                self._dummy_anc = torch.zeros(1, 1, 1, dtype=torch.uint8, device=query.device)
            anc = self._dummy_anc
        else:
            anc = ancestors.view(torch.uint8)
        launch_branch_attention(plan, workspace, query, k_cache, v_cache, branch_k, branch_v, filled, anc,
                                self.blocks, self.kv_lens, scale, out, features)


def launch_branch_attention(plan, workspace, query, k_cache, v_cache, branch_k, branch_v, filled: int, anc,
                            blocks, kv_lens, scale: float, out, features: AttentionFeatures = NO_FEATURES) -> None:
    """The launches of one level (``plan`` from ``plan_tree_attention`` with
    nodes = K, ``workspace`` its ``split_workspace``); nothing reads the device."""
    R, K, hq, dim = query.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    split = plan.kernel == "split"
    splits = plan.num_splits if split else 0
    block_d = max(16, _next_pow2(dim))
    o_part, lse_part = workspace  # fp32 partial states (single pass: unread placeholders)
    fa = feature_launch_args(features, kv_lens, kv_lens)  # (no depths: a level's rows share one position)
    triton_launch.launch(
        _branch_attention_kernel, (plan.node_blocks, splits + 1, R * hkv),
        query, k_cache, v_cache, branch_k, branch_v, anc, out, o_part, lse_part, blocks, kv_lens,
        fa["sinks_ptr"], fa["alibi_ptr"],
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *branch_k.stride(), *branch_v.stride(), *anc.stride(),
        *out.stride(), blocks.stride(0), scale * math.log2(math.e), filled, splits, plan.min_chunk, hkv,
        fa["window"], fa["soft_cap2"],
        K=K, GROUP=hq // hkv, HQ=hq, HEAD_DIM=dim, BLOCK_SIZE=block_size, NODES=plan.nodes_per_program,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_E=BRANCH_TILE, BLOCK_D=block_d, SPLIT=split,
        # as the verify kernels: IEEE fp32 dots for fp32, and for bf16 in the
        # interpreter (its tl.dot multiplies bf16 storage as integers)
        DOT_F32=query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and triton_interpreting()),
        WINDOW=fa["WINDOW"], SOFT_CAP=fa["SOFT_CAP"], ALIBI=fa["ALIBI"], SINKS=fa["SINKS"],
    )  # fmt: skip
    if not split:
        return
    # the chunks covered the context from max(0, kv_len + level - W): the effective window W - level + 1
    window = fa["window"] - filled // K + 1 if fa["WINDOW"] else 0
    launch_merge(o_part, lse_part, out, kv_lens, fa["sinks_ptr"], plan.num_splits, plan.min_chunk, window, K, hq,
                 dim, plan.block_n, block_d, fa["WINDOW"], fa["SINKS"])


# ---------------------------------------------------------------- torch path


def torch_chunk_blocks(R: int, K: int, hq: int, hkv: int, dim: int, block_size: int, itemsize: int,
                       chunk_bytes: int) -> int:
    """Blocks per context chunk of the torch path: the most whose temporaries
    (``_TORCH_COPIES_KV`` K and V copies of R * blocks * block_size positions
    at <= 4 bytes, ``_TORCH_COPIES_SCORES`` fp32 score rows of R * K * Hq
    query rows) fit ``chunk_bytes``; at least one."""
    per_block = R * block_size * (2 * _TORCH_COPIES_KV * hkv * dim * max(itemsize, 4)
                                  + _TORCH_COPIES_SCORES * K * hq * 4)
    return max(1, chunk_bytes // per_block)


def _run_torch(query, k_cache, v_cache, blocks, kv_lens, branch_k, branch_v, filled, ancestors, scale, out,
               chunk_bytes, features: AttentionFeatures = NO_FEATURES) -> None:
    R, K, hq, dim = query.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv
    level = filled // K  # the level's queries at kv_len + level - 1, entry e at kv_len + e // K
    # query rows per KV head, ordered (j, g): [R, Hkv, K*G, D]
    q = (query.float() * scale).view(R, K, hkv, group, dim).permute(0, 2, 1, 3, 4).reshape(R, hkv, K * group, dim)

    def per_row(t):  # [Hq] -> [1, Hkv, K*G, 1]: the value of each query row's head
        return t.view(1, hkv, 1, group).expand(1, hkv, K, group).reshape(1, hkv, K * group, 1)

    def modify(s, rel):  # soft-cap then ALiBi (rel: key position - query position, broadcast to s)
        if features.soft_cap is not None:
            s = torch.tanh(s / features.soft_cap).mul_(features.soft_cap)
        if features.alibi_slopes is not None:
            s = s + per_row(features.alibi_slopes) * rel
        return s

    # the branch first: every row sees its own entry, so the running max is finite before any context chunk
    own = torch.eye(K, dtype=torch.bool, device=query.device).expand(R, K, K)
    visible = torch.cat([ancestors, own], -1)  # [R, K, filled]
    entries = torch.arange(filled, device=query.device)
    if features.window is not None:
        visible = visible & (entries >= (level - features.window) * K)
    bk = branch_k[:, :filled].float().permute(0, 2, 3, 1)  # [R, Hkv, D, filled]
    s = modify(torch.matmul(q, bk), (entries // K - (level - 1)).float()).view(R, hkv, K, group, filled)
    s.masked_fill_(~visible[:, None, :, None], float("-inf"))
    s = s.view(R, hkv, K * group, filled)
    m = s.amax(-1)  # [R, Hkv, K*G]
    p = torch.exp(s - m[..., None])
    del s
    l = p.sum(-1)
    acc = torch.matmul(p, branch_v[:, :filled].float().permute(0, 2, 1, 3))  # [R, Hkv, K*G, D]
    del p

    num_blocks = blocks.shape[1]
    step = torch_chunk_blocks(R, K, hq, hkv, dim, block_size, k_cache.element_size(), chunk_bytes)
    offsets = torch.arange(step * block_size, device=query.device)
    for c0 in range(0, num_blocks, step):
        chunk = blocks[:, c0:c0 + step]  # [R, c]
        c = chunk.shape[1]
        # [R, c, bs, Hkv, D] gathered -> [R, Hkv, D, c*bs] (fp32: this chunk only)
        k = k_cache[chunk].float().permute(0, 3, 4, 1, 2).reshape(R, hkv, dim, c * block_size)
        s = torch.matmul(q, k)  # [R, Hkv, K*G, c*bs]
        del k
        pos = (c0 * block_size + offsets[: c * block_size])[None]  # [1, c*bs]
        beyond = pos >= kv_lens[:, None]  # [R, c*bs]
        if features.active:
            s = modify(s, (pos - (kv_lens[:, None] + level - 1)).float()[:, None, None])
            if features.window is not None:
                beyond = beyond | (pos < kv_lens[:, None] + level - features.window)
        s.masked_fill_(beyond[:, None, None], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s.sub_(m_new[..., None]))
        del s
        l = l * alpha + p.sum(-1)
        v = v_cache[chunk].float().permute(0, 3, 1, 2, 4).reshape(R, hkv, c * block_size, dim)
        acc = acc * alpha[..., None] + torch.matmul(p, v)
        del p, v
        m = m_new
    if features.sinks is not None:  # m is finite: every row saw its own entry
        l = l + torch.exp(per_row(features.sinks)[..., 0] - m)
    res = (acc / l[..., None]).view(R, hkv, K, group, dim).permute(0, 2, 1, 3, 4).reshape(R, K, hq, dim)
    out.copy_(res)
