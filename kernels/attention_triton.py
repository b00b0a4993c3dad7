"""Triton tree attention over a paged KV cache: single-pass and split-KV kernels.

``attention.py`` documents the operation and the argument layouts; this
module holds the kernels, the launch plan and ``tree_attention_triton``.

Two kernels, chosen by shape (``plan_tree_attention``):

single pass (``_tree_attention_kernel``)
    One program per (node block, KV head, request) streams the request's
    whole prefix and then its T tree positions with an online softmax and
    writes the output. Grid ``(ceil(T / NODES), Hkv, B)``. Best when that grid
    already fills the GPU (large batch): no workspace, one launch.

split KV (flash-decoding; ``_tree_attention_split_kernel`` + ``_tree_attention_merge_kernel``)
    The committed prefix of each request is cut into ``num_splits`` chunks.
    Grid ``(ceil(T / NODES), num_splits + 1, B * Hkv)``: program split s < S
    attends its nodes to prefix chunk s (no mask: every node sees the whole
    prefix), program s = S attends them to the T tree positions under the
    compact mask; each writes a partial state (normalised output, log2-sum-
    exp) to a fp32 workspace. The merge kernel (grid ``(T * Hq, B)``, one
    program per output row) combines a row's used prefix chunks and its tree
    part in one vector step. Best at small batch, where the single-pass grid
    has too few programs to keep HBM busy.

Features (``attention_reference`` gives the semantics; constexpr flags, so
the variant without them is the code it always was): WINDOW (runtime
``window``: a row of node depth d sees prefix positions > ctx + d - W and
ancestors less than W levels up; the prefix loop and the split chunks start
at max(0, ctx - W + 1), the first position the root sees, so a windowed
layer reads at most W - 1 + T positions per request and its split plan
(``plan_tree_attention(window=)``) has at most ceil((W - 1) / min_chunk)
chunks), SOFT_CAP (runtime ``soft_cap2`` = cap * log2(e): scores work in base
2), ALIBI (``alibi_ptr`` fp32 [Hq] slopes, bias slope * (k - p) on logical
positions) and SINKS (``sinks_ptr`` fp32 [Hq]: a term 2^(sink * log2 e) in the
final denominator: the single-pass epilogue or the merge). WINDOW and ALIBI
read ``depth_ptr`` int32 [B, T] (node depths, ``node_depths``). Flags off,
the feature pointers are placeholders (``context_lens``) never read.

The chunk length is computed inside the kernels from the request's own
context length (``max(round_up(ceil(ctx / S), BLOCK_N), min_chunk)``), so a
short request uses few chunks (the programs of the others exit at once, the
merge skips them) and a long one is spread over all S. S itself depends on
shapes only (batch, heads, T, the block table's width or the
``max_context_len`` hint, the GPU's SM count), never on a device value: the
launch stays CUDA-graph capturable.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from . import triton_launch  # the one launch seam (recorded; captured: the warm-up, tests/triton_aot.py)
from .triton_launch import triton_interpreting
from .api import triton_usable
from .attention_reference import NO_FEATURES, AttentionFeatures, _check_inputs, _default_scale, check_features, node_depths
from .modes import TreeMaskMode, ancestor_bitmask_words

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

    def _jit(fn=None, **_):
        return fn if fn is not None else (lambda f: f)

# Arguments Triton must not specialize on (divisible by 16, equal to 1, 16-byte
# aligned), so that every variant a step can launch is known at startup and
# warmed then (``startup.warm_up``):
# * the query rows are views into the engine's query tensor: their address
#   (the step's first tree row) and row stride (the engine's layout) vary per
#   step and are unknown at startup. q is loaded once per program: the lost
#   vectorization does not show;
# * the output rows likewise: the kernels write the engine's output buffer
#   (vLLM's, at the step's first tree row), not a tensor of their own;
# * num_splits follows batch and context; it only enters index arithmetic,
#   where its divisibility buys nothing (a class per value would double the
#   split and merge variants).
_QUERY_ROWS = dict(do_not_specialize=["stride_qb", "stride_qt"], do_not_specialize_on_alignment=["q_ptr"])
_OUT_ROWS = dict(do_not_specialize=["stride_ob", "stride_ot"], do_not_specialize_on_alignment=["out_ptr"])
_SPLITS = ["num_splits"]
# * the features' runtime arguments: a window of 16 or 1 must not be a variant
#   of its own (nor a draft level's effective window), and the feature
#   tensors are loaded once per program (their alignment buys nothing)
_FEATURE_VALUES = ["window"]
_FEATURE_POINTERS = ["depth_ptr", "sinks_ptr", "alibi_ptr"]
LOG2E = 1.4426950408889634


# Split-KV plan constants (tuned by ci/device_check.py's tree_attention sweep)
SPLIT_MIN_TOKENS = 128  # shortest prefix chunk worth a program of its own
SPLIT_TARGET_WAVES = 2  # aim the split grid at this many programs per SM
SPLIT_MAX = 64  # most prefix chunks per request (and the merge's vector width)
SPLIT_WORKSPACE_MAX_BYTES = 256 << 20  # cap on the fp32 partial states
CPU_INTERPRETER_SMS = 4  # what the plan assumes for the CPU interpreter


# -------------------------------------------------------------------- kernels


@_jit
def _soft_cap(s, cap):
    """cap * tanh(s / cap), from exp2 (the interpreter has no tanh): tanh(x) =
    sign(x) (1 - e) / (1 + e), e = exp(-2|x|) in (0, 1], no overflow."""
    x = s / cap
    e = tl.exp2(-2.0 * 1.4426950408889634 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


@_jit
def _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_F32: tl.constexpr, alibi=0.0, cap2=0.0,
                         SOFT_CAP: tl.constexpr = False, ALIBI: tl.constexpr = False):
    """Fold one KV tile into the running state. q [BLOCK_M, BLOCK_D], k / v
    [BLOCK_N, BLOCK_D] (cache dtype), allowed [BLOCK_M, BLOCK_N] or [1, BLOCK_N]
    bool; m_i, l_i [BLOCK_M] fp32 running max / sum (base 2), acc [BLOCK_M,
    BLOCK_D] fp32. Shared by the verify kernels (paged tiles) and the draft
    kernel (paged context tiles and branch-scratch tiles). SOFT_CAP: cap2
    (= cap * log2 e) on the base-2 scores; ALIBI: alibi [BLOCK_M, BLOCK_N] fp32
    (slope * log2 e * (k - p)) added after the cap."""
    if DOT_F32:  # fp32 inputs: no TF32, fp32 callers expect fp32 scores
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    if SOFT_CAP or ALIBI:
        s = s * qk_scale
        if SOFT_CAP:
            s = _soft_cap(s, cap2)
        if ALIBI:
            s = s + alibi
        s = tl.where(allowed, s, float("-inf"))
    else:
        s = tl.where(allowed, s * qk_scale, float("-inf"))
    # m_i starts finite (-1e30), so a row with nothing allowed yet gets
    # exp2(-inf - m) = 0 rather than NaN from (-inf) - (-inf)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:  # rounding p to the cache dtype first, as the native path does
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@_jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    allowed,  # [BLOCK_M, BLOCK_N] or [1, BLOCK_N] bool
    pos,  # [BLOCK_N] token positions of this tile
    pos_ok,  # [BLOCK_N] bool: position exists (is loaded)
    bt_row_ptr,  # this request's block table row
    k_head_ptr,  # k_cache + kv_head * stride_kh
    v_head_ptr,
    stride_kb,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vd,
    dims,
    dims_ok,
    qk_scale,  # softmax scale * log2(e): the kernels work in base 2
    BLOCK_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr,
    alibi=0.0,  # [BLOCK_M, BLOCK_N] base-2 ALiBi bias (ALIBI)
    cap2=0.0,  # soft cap * log2(e) (SOFT_CAP)
    SOFT_CAP: tl.constexpr = False,
    ALIBI: tl.constexpr = False,
):
    """One online-softmax step over BLOCK_N paged positions."""
    block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    offset = (pos % BLOCK_SIZE).to(tl.int64)
    kv_ok = pos_ok[:, None] & dims_ok[None, :]
    k = tl.load(
        k_head_ptr + (block * stride_kb + offset * stride_ks)[:, None] + dims[None, :] * stride_kd, mask=kv_ok, other=0.0
    )
    v = tl.load(
        v_head_ptr + (block * stride_vb + offset * stride_vs)[:, None] + dims[None, :] * stride_vd, mask=kv_ok, other=0.0
    )
    return _online_softmax_step(q, k, v, allowed, m_i, l_i, acc, qk_scale, DOT_F32, alibi, cap2, SOFT_CAP, ALIBI)


@_jit
def _attend_prefix(
    q, m_i, l_i, acc, p_start, p_end, bt_row_ptr, k_head_ptr, v_head_ptr,
    stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, dims, dims_ok, qk_scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
    qpos=0, wlo=0, slope2=0.0, cap2=0.0,
    WINDOW: tl.constexpr = False, SOFT_CAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
):  # fmt: skip
    """Prefix positions [p_start, p_end): every node sees all of them, or
    (WINDOW) row r those >= wlo[r]. ALIBI: qpos [BLOCK_M] the rows' positions,
    slope2 [BLOCK_M] their slopes * log2 e."""
    cols = tl.arange(0, BLOCK_N)
    for start in range(p_start, p_end, BLOCK_N):
        pos = start + cols
        pos_ok = pos < p_end
        if WINDOW:
            allowed = pos_ok[None, :] & (pos[None, :] >= wlo[:, None])
        else:
            allowed = pos_ok[None, :]
        if ALIBI:
            alibi = slope2[:, None] * (pos[None, :] - qpos[:, None]).to(tl.float32)
        else:
            alibi = 0.0
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, allowed, pos, pos_ok, bt_row_ptr, k_head_ptr, v_head_ptr,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, dims, dims_ok, qk_scale,
            BLOCK_SIZE, DOT_F32, alibi, cap2, SOFT_CAP, ALIBI,
        )  # fmt: skip
    return m_i, l_i, acc


@_jit
def _attend_tree(
    q, m_i, l_i, acc, t_end, ctx, b, node, row_ok, mask_ptr, bt_row_ptr, k_head_ptr, v_head_ptr,
    stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, dims, dims_ok, qk_scale,
    T: tl.constexpr, BLOCK_SIZE: tl.constexpr, MODE: tl.constexpr, WORDS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
    depth_row_ptr=None, qpos=0, wlo=0, slope2=0.0, cap2=0.0,
    WINDOW: tl.constexpr = False, SOFT_CAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
):  # fmt: skip
    """Tree nodes j < t_end (T, or 0 for none): node j sits in slot ctx + j
    and is visible to row node i iff j is i or an ancestor of i, and (WINDOW)
    its position ctx + depth[j] (depth_row_ptr: this request's [T] depths) is
    >= wlo of the row."""
    cols = tl.arange(0, BLOCK_N)
    safe_node = tl.where(row_ok, node, 0)
    for j0 in range(0, t_end, BLOCK_N):
        j = j0 + cols
        j_ok = j < T
        if MODE == 1:  # QLEN_ONLY: one byte per (i, j)
            bits = tl.load(
                mask_ptr + b * T * T + safe_node[:, None] * T + j[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0
            )
            allowed = bits != 0
        else:
            window = (j0 // 64) * 64  # the 64 columns of mask word j0 // 64 (BLOCK_N divides 64)
            if MODE == 3:  # ANCESTOR_BITMASK
                word = tl.load(mask_ptr + (b * T + safe_node) * WORDS + j0 // 64, mask=row_ok, other=0)
            else:  # PARENT_POINTER: climb from each row node, setting the bits that fall in the window
                word = tl.zeros([BLOCK_M], tl.int64)
                cur = tl.where(row_ok, node, -1)
                depth = tl.load(mask_ptr + b * 2 * T + T + safe_node, mask=row_ok, other=0).to(tl.int32)
                for _ in range(0, tl.max(depth, 0) + 1):  # self, then `depth` ancestors
                    in_window = (cur >= window) & (cur < window + 64)
                    shift = tl.where(in_window, cur - window, 0).to(tl.int64)
                    word = word | tl.where(in_window, tl.full([BLOCK_M], 1, tl.int64) << shift, 0)
                    up = tl.load(mask_ptr + b * 2 * T + tl.where(cur >= 0, cur, 0), mask=cur >= 0, other=-1)
                    cur = tl.where(cur >= 0, up.to(tl.int32), -1)
            allowed = ((word[:, None] >> (j - window).to(tl.int64)[None, :]) & 1) != 0
        allowed = allowed & j_ok[None, :]
        if WINDOW or ALIBI:
            kpos = ctx + tl.load(depth_row_ptr + j, mask=j_ok, other=0)
        if WINDOW:
            allowed = allowed & (kpos[None, :] >= wlo[:, None])
        if ALIBI:
            alibi = slope2[:, None] * (kpos[None, :] - qpos[:, None]).to(tl.float32)
        else:
            alibi = 0.0
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, allowed, ctx + j, j_ok, bt_row_ptr, k_head_ptr, v_head_ptr,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, dims, dims_ok, qk_scale,
            BLOCK_SIZE, DOT_F32, alibi, cap2, SOFT_CAP, ALIBI,
        )  # fmt: skip
    return m_i, l_i, acc


@_jit
def _add_sink(m_i, l_i, acc, sinks_ptr, head, row_ok):
    """Fold each row's sink logit (fp32 [Hq] at sinks_ptr, natural units) into
    the denominator: the state rescaled to max(m_i, sink), no overflow."""
    sink2 = tl.load(sinks_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink2)
    alpha = tl.exp2(m_i - m_new)
    return l_i * alpha + tl.exp2(sink2 - m_new), acc * alpha[:, None]


@_jit
def _row_features(ctx, b, node, head, row_ok, depth_ptr, alibi_ptr, window,
                  T: tl.constexpr, BLOCK_M: tl.constexpr, WINDOW: tl.constexpr, ALIBI: tl.constexpr):  # fmt: skip
    """Per query row: (qpos = ctx + depth, wlo = qpos - window + 1 (the first
    position the row sees), slope2 = ALiBi slope * log2 e); zeros where off."""
    qpos = tl.zeros_like(node)
    if WINDOW or ALIBI:
        qpos = ctx + tl.load(depth_ptr + b * T + tl.where(row_ok, node, 0), mask=row_ok, other=0)
    wlo = qpos
    if WINDOW:
        wlo = qpos - window + 1
    slope2 = tl.zeros([BLOCK_M], tl.float32)
    if ALIBI:
        slope2 = tl.load(alibi_ptr + head, mask=row_ok, other=0.0) * 1.4426950408889634
    return qpos, wlo, slope2


@_jit(do_not_specialize=_QUERY_ROWS["do_not_specialize"] + _OUT_ROWS["do_not_specialize"] + _FEATURE_VALUES,
      do_not_specialize_on_alignment=_QUERY_ROWS["do_not_specialize_on_alignment"]
      + _OUT_ROWS["do_not_specialize_on_alignment"] + _FEATURE_POINTERS)
def _tree_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_table_ptr,
    context_lens_ptr,
    mask_ptr,  # int64 words / int16 parents+depths / uint8 QLEN_ONLY bytes
    depth_ptr,  # int32 [B, T] node depths (WINDOW / ALIBI; else a placeholder)
    sinks_ptr,  # fp32 [Hq] (SINKS)
    alibi_ptr,  # fp32 [Hq] slopes (ALIBI)
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ob,
    stride_ot,
    stride_oh,
    stride_od,
    stride_bt,
    qk_scale,
    window,  # W (WINDOW)
    soft_cap2,  # soft cap * log2(e) (SOFT_CAP)
    T: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size (tokens)
    MODE: tl.constexpr,  # TreeMaskMode value
    WORDS: tl.constexpr,  # ANCESTOR_BITMASK words per row
    NODES: tl.constexpr,  # nodes per program = BLOCK_M // GROUP
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,  # divides 64, so a tree tile lies in one mask word
    BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,  # run both dots in fp32 (see tree_attention_triton)
    WINDOW: tl.constexpr,  # the module docstring's features
    SOFT_CAP: tl.constexpr,
    ALIBI: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Single pass: grid (ceil(T / NODES), Hkv, B); writes out [B, T, Hq, D]."""
    node_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)

    rows = tl.arange(0, BLOCK_M)
    node = node_block * NODES + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < NODES * GROUP) & (node < T)
    dims = tl.arange(0, BLOCK_D)
    dims_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + node[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dims_ok[None, :],
        other=0.0,
    )

    ctx = tl.load(context_lens_ptr + b).to(tl.int32)
    bt_row_ptr = block_table_ptr + b * stride_bt
    k_head_ptr = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head_ptr = v_ptr + kv_head.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    qpos, wlo, slope2 = _row_features(ctx, b, node, head, row_ok, depth_ptr, alibi_ptr, window,
                                      T, BLOCK_M, WINDOW, ALIBI)  # fmt: skip
    if WINDOW:
        p_start = tl.maximum(ctx - window + 1, 0)  # the root's first position: no row sees one before
    else:
        p_start = 0

    # 1. the committed prefix, unmasked (WINDOW: each row's window); 2. the tree under the ancestor mask
    m_i, l_i, acc = _attend_prefix(
        q, m_i, l_i, acc, p_start, ctx, bt_row_ptr, k_head_ptr, v_head_ptr,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, dims, dims_ok, qk_scale,
        BLOCK_SIZE, BLOCK_N, DOT_F32, qpos, wlo, slope2, soft_cap2, WINDOW, SOFT_CAP, ALIBI,
    )  # fmt: skip
    m_i, l_i, acc = _attend_tree(
        q, m_i, l_i, acc, T, ctx, b, node, row_ok, mask_ptr, bt_row_ptr, k_head_ptr, v_head_ptr,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, dims, dims_ok, qk_scale,
        T, BLOCK_SIZE, MODE, WORDS, BLOCK_M, BLOCK_N, DOT_F32,
        depth_ptr + b * T, qpos, wlo, slope2, soft_cap2, WINDOW, SOFT_CAP, ALIBI,
    )  # fmt: skip

    if SINKS:
        l_i, acc = _add_sink(m_i, l_i, acc, sinks_ptr, head, row_ok)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i == 0 only on padding rows
    tl.store(
        out_ptr + b * stride_ob + node[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dims_ok[None, :],
    )


@_jit
def _chunk_len(ctx, num_splits, min_chunk, BLOCK_N: tl.constexpr):
    """Prefix chunk length of a request with ``ctx`` committed tokens (split and merge agree)."""
    return tl.maximum(tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N, min_chunk)


@_jit
def _window_start(ctx, window):
    """First prefix position a row at position ctx sees under ``window``,
    clamped to [0, ctx] (a draft level's effective window may be <= 0: none)."""
    return tl.minimum(tl.maximum(ctx - window + 1, 0), ctx)


@_jit(do_not_specialize=_QUERY_ROWS["do_not_specialize"] + _SPLITS + _FEATURE_VALUES,
      do_not_specialize_on_alignment=_QUERY_ROWS["do_not_specialize_on_alignment"] + _FEATURE_POINTERS)
def _tree_attention_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_part_ptr,  # fp32 [B, T, Hq, S + 1, HEAD_DIM]
    lse_part_ptr,  # fp32 [B, T, Hq, S + 1]
    block_table_ptr,
    context_lens_ptr,
    mask_ptr,
    depth_ptr,  # int32 [B, T] (WINDOW / ALIBI)
    alibi_ptr,  # fp32 [Hq] (ALIBI); sinks go to the merge
    stride_qb,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    qk_scale,
    num_splits,  # S: prefix chunks per request (runtime: no recompile per S)
    min_chunk,  # shortest chunk, a multiple of BLOCK_N
    num_kv_heads,
    window,  # W (WINDOW): the chunks cover [max(0, ctx - W + 1), ctx)
    soft_cap2,
    T: tl.constexpr,
    GROUP: tl.constexpr,
    HQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    MODE: tl.constexpr,
    WORDS: tl.constexpr,
    NODES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_F32: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    ALIBI: tl.constexpr,
):
    """Split KV: grid (ceil(T / NODES), S + 1, B * Hkv). Program (n, s, b * Hkv + h)
    attends the rows of node block n x KV head h's query heads to prefix chunk s
    (s < S) or to the tree (s = S) and stores the partial state: o = acc / l
    and lse = m + log2(l) (base 2, scaled scores). A chunk past the request's
    context stores nothing (the merge does not read it)."""
    node_block = tl.program_id(0)
    split = tl.program_id(1)
    bh = tl.program_id(2)
    b = (bh // num_kv_heads).to(tl.int64)
    kv_head = bh % num_kv_heads

    rows = tl.arange(0, BLOCK_M)
    node = node_block * NODES + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < NODES * GROUP) & (node < T)
    dims = tl.arange(0, BLOCK_D)
    dims_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + node[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :] * stride_qd,
        mask=row_ok[:, None] & dims_ok[None, :],
        other=0.0,
    )

    ctx = tl.load(context_lens_ptr + b).to(tl.int32)
    if WINDOW:  # the chunks split what the root sees, [lo, ctx)
        lo = _window_start(ctx, window)
        chunk = _chunk_len(ctx - lo, num_splits, min_chunk, BLOCK_N)
        is_tree = split == num_splits
        p_start = tl.where(is_tree, 0, lo + split * chunk)
        p_end = tl.where(is_tree, 0, tl.minimum(lo + split * chunk + chunk, ctx))
    else:
        chunk = _chunk_len(ctx, num_splits, min_chunk, BLOCK_N)
        is_tree = split == num_splits
        p_start = tl.where(is_tree, 0, split * chunk)
        p_end = tl.where(is_tree, 0, tl.minimum(split * chunk + chunk, ctx))
    t_end = tl.where(is_tree, T, 0)
    qpos, wlo, slope2 = _row_features(ctx, b, node, head, row_ok, depth_ptr, alibi_ptr, window,
                                      T, BLOCK_M, WINDOW, ALIBI)  # fmt: skip

    bt_row_ptr = block_table_ptr + b * stride_bt
    k_head_ptr = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head_ptr = v_ptr + kv_head.to(tl.int64) * stride_vh
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    m_i, l_i, acc = _attend_prefix(
        q, m_i, l_i, acc, p_start, p_end, bt_row_ptr, k_head_ptr, v_head_ptr,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, dims, dims_ok, qk_scale,
        BLOCK_SIZE, BLOCK_N, DOT_F32, qpos, wlo, slope2, soft_cap2, WINDOW, SOFT_CAP, ALIBI,
    )  # fmt: skip
    m_i, l_i, acc = _attend_tree(
        q, m_i, l_i, acc, t_end, ctx, b, node, row_ok, mask_ptr, bt_row_ptr, k_head_ptr, v_head_ptr,
        stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, dims, dims_ok, qk_scale,
        T, BLOCK_SIZE, MODE, WORDS, BLOCK_M, BLOCK_N, DOT_F32,
        depth_ptr + b * T, qpos, wlo, slope2, soft_cap2, WINDOW, SOFT_CAP, ALIBI,
    )  # fmt: skip

    # (WINDOW: a deep row may see nothing of a chunk: l_i = 0 stores lse = -1e30, weight 0 in the merge)
    # every stored row has l_i > 0 (a bool scalar & a bool vector is int32 under the interpreter: compare ints)
    store_ok = row_ok & (node < tl.where((p_start < p_end) | is_tree, T, 0))
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    slot = ((b * T + node) * HQ + head) * (num_splits + 1) + split  # int64
    tl.store(
        o_part_ptr + slot[:, None] * HEAD_DIM + dims[None, :],
        acc / l_safe[:, None],
        mask=store_ok[:, None] & dims_ok[None, :],
    )
    tl.store(lse_part_ptr + slot, m_i + tl.log2(l_safe), mask=store_ok)


@_jit(do_not_specialize=_SPLITS + _OUT_ROWS["do_not_specialize"] + _FEATURE_VALUES,
      do_not_specialize_on_alignment=_OUT_ROWS["do_not_specialize_on_alignment"] + _FEATURE_POINTERS)
def _tree_attention_merge_kernel(
    o_part_ptr,
    lse_part_ptr,
    out_ptr,
    context_lens_ptr,
    sinks_ptr,  # fp32 [Hq] (SINKS; else a placeholder)
    stride_ob,
    stride_ot,
    stride_oh,
    stride_od,
    num_splits,
    min_chunk,
    window,  # WINDOW: the chunks covered [_window_start(ctx, window), ctx)
    T: tl.constexpr,
    HQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS_P2: tl.constexpr,  # power of 2 >= S
    ROWS: tl.constexpr,  # output rows (node, head) per program: 1 on a GPU
    BLOCK_D: tl.constexpr,
    WINDOW: tl.constexpr,
    SINKS: tl.constexpr,
):
    """Merge: grid (ceil(T * Hq / ROWS), B); program (r, b) merges rows
    r * ROWS .. of request b (row = node * Hq + head). Each row combines its
    used prefix chunks (ceil(ctx / chunk) of them; none for an empty context)
    and its tree part in one vector step: out = sum_s 2^(lse_s - M) o_s /
    sum_s 2^(lse_s - M), M = max_s lse_s. SINKS: the head's sink is one more
    term of the denominator (lse = sink * log2 e, no value)."""
    b = tl.program_id(1).to(tl.int64)
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < T * HQ
    ctx = tl.load(context_lens_ptr + b).to(tl.int32)
    if WINDOW:
        seen = ctx - _window_start(ctx, window)
        n_used = tl.cdiv(seen, _chunk_len(seen, num_splits, min_chunk, BLOCK_N))
    else:
        n_used = tl.cdiv(ctx, _chunk_len(ctx, num_splits, min_chunk, BLOCK_N))
    s = tl.arange(0, SPLITS_P2)
    dims = tl.arange(0, BLOCK_D)
    dims_ok = dims < HEAD_DIM
    base = (b * T * HQ + row) * (num_splits + 1)  # [ROWS] int64
    slot = base[:, None] + s[None, :]  # [ROWS, SPLITS_P2]
    used = row_ok[:, None] & (s < n_used)[None, :]

    lse = tl.load(lse_part_ptr + slot, mask=used, other=float("-inf"))
    lse_tree = tl.load(lse_part_ptr + base + num_splits, mask=row_ok, other=0.0)  # finite: a node sees itself
    m = tl.maximum(tl.max(lse, 1), lse_tree)
    if SINKS:
        lse_sink = tl.load(sinks_ptr + row % HQ, mask=row_ok, other=0.0) * 1.4426950408889634
        m = tl.maximum(m, lse_sink)
    w = tl.exp2(lse - m[:, None])  # 0 on unused chunks
    w_tree = tl.exp2(lse_tree - m)
    o = tl.load(o_part_ptr + slot[:, :, None] * HEAD_DIM + dims[None, None, :], mask=used[:, :, None] & dims_ok[None, None, :],
                other=0.0)  # fmt: skip
    o_tree = tl.load(o_part_ptr + (base + num_splits)[:, None] * HEAD_DIM + dims[None, :],
                     mask=row_ok[:, None] & dims_ok[None, :], other=0.0)  # fmt: skip
    num = tl.sum(w[:, :, None] * o, 1) + w_tree[:, None] * o_tree
    den = tl.sum(w, 1) + w_tree
    if SINKS:
        den = den + tl.exp2(lse_sink - m)
    node = row // HQ
    head = row % HQ
    tl.store(
        out_ptr + b * stride_ob + (node * stride_ot + head * stride_oh)[:, None] + dims[None, :] * stride_od,
        (num / den[:, None]).to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dims_ok[None, :],
    )


# ----------------------------------------------------------------------- plan




def _triton_usable(device: torch.device) -> bool:
    """``api.triton_usable`` (the one rule), for this module's own import of Triton."""
    return triton is not None and triton_usable(device)


@functools.lru_cache(maxsize=None)
def _num_sms(device_type: str, index: int | None) -> int:
    """Streaming multiprocessors (a host-side property: no sync, capture-safe)."""
    if device_type != "cuda":
        return CPU_INTERPRETER_SMS
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).multi_processor_count


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@dataclass(frozen=True)
class AttentionPlan:
    """How ``tree_attention_triton`` launches for a set of shapes.

    kernel             "single" (one pass) or "split" (split KV + merge)
    num_splits         S, prefix chunks per request (split only; 1 for single)
    min_chunk          shortest prefix chunk in tokens (a multiple of block_n)
    block_m, block_n   query-row and KV tiles; nodes_per_program = block_m // group
    node_blocks        ceil(T / nodes_per_program)
    programs           programs of the (first) launch
    workspace_bytes    fp32 partial states of the split kernel (0 for single)
    """

    kernel: str
    num_splits: int
    min_chunk: int
    block_m: int
    block_n: int
    nodes_per_program: int
    node_blocks: int
    programs: int
    workspace_bytes: int


def plan_tree_attention(
    batch: int,
    nodes: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    max_blocks: int,
    device: torch.device | str = "cuda",
    *,
    kernel: str = "auto",
    num_splits: int | None = None,
    max_context_len: int | None = None,
    split_min_tokens: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
) -> AttentionPlan:
    """The launch plan, from shapes (and the device's SM count) only.

    Tiles: block_m = min(64, next_pow2(T * group)) rows (>= 16, >= group),
    block_n = 64 on CUDA, 32 under the interpreter.

    Split count (kernel="auto", num_splits=None): with P = B * Hkv *
    node_blocks programs per chunk, a GPU with N SMs and the longest prefix L
    (``max_context_len`` when given, else the block table's reach
    max_blocks * block_size - T, a shape):

    * P >= N (one full wave already): the single-pass kernel.
    * else S = min(ceil(SPLIT_TARGET_WAVES * N / P), ceil(L / min_chunk),
      SPLIT_MAX), lowered until the workspace fits SPLIT_WORKSPACE_MAX_BYTES;
      min_chunk = max(SPLIT_MIN_TOKENS, T * group / 2) rounded up to block_n
      (a chunk reads at least half as many K/V bytes as its partial state
      writes). S = 1 falls back to the single-pass kernel.

    kernel="single" / "split" forces one; ``num_splits`` forces S (and the
    split kernel unless kernel="single"); ``split_min_tokens`` replaces
    min_chunk (tests use it to cut short contexts into many chunks).
    ``window`` (a layer's sliding window W, a host int): no row sees more
    than W - 1 prefix positions, so L is at most W - 1 (a short window: the
    single-pass kernel, whatever the context).
    """
    device = torch.device(device)
    if kernel not in ("auto", "single", "split"):
        raise ValueError(f"kernel must be 'auto', 'single' or 'split', got {kernel!r}")
    group = num_q_heads // num_kv_heads
    if block_m is None:
        # one tile row per (node, head); up to 64 rows keeps the fp32 accumulator in registers at D=128
        block_m = min(64, _next_pow2(nodes * group))
    block_m = max(16, block_m, _next_pow2(group))  # tl.dot needs >= 16 rows; a group never splits
    if block_n is None:
        block_n = 64 if device.type == "cuda" else 32
    if block_n not in (16, 32, 64):
        raise ValueError(f"block_n must be 16, 32 or 64, got {block_n}")
    nodes_per_program = block_m // group
    node_blocks = -(-nodes // nodes_per_program)
    per_chunk = batch * num_kv_heads * node_blocks

    if split_min_tokens is not None:
        if split_min_tokens < 1:
            raise ValueError(f"split_min_tokens must be >= 1, got {split_min_tokens}")
        min_chunk = split_min_tokens
    else:
        min_chunk = max(SPLIT_MIN_TOKENS, nodes * group // 2)
    min_chunk = -(-min_chunk // block_n) * block_n

    def workspace(s: int) -> int:
        return batch * nodes * num_q_heads * (s + 1) * (head_dim + 1) * 4

    if num_splits is not None:
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        splits = int(num_splits)
        chosen = "single" if kernel == "single" else "split"
    else:
        longest = max_context_len if max_context_len is not None else max_blocks * block_size - nodes
        if window is not None:
            longest = min(longest, window - 1)
        sms = _num_sms(device.type, device.index)
        if per_chunk >= sms and kernel != "split":
            splits = 1
        else:
            splits = min(-(-SPLIT_TARGET_WAVES * sms // max(per_chunk, 1)), -(-max(longest, 0) // min_chunk), SPLIT_MAX)
            splits = max(splits, 1)
            while splits > 1 and workspace(splits) > SPLIT_WORKSPACE_MAX_BYTES:
                splits -= 1
        chosen = kernel if kernel != "auto" else ("split" if splits > 1 else "single")
    if chosen == "single":
        return AttentionPlan("single", 1, min_chunk, block_m, block_n, nodes_per_program, node_blocks, per_chunk, 0)
    return AttentionPlan("split", splits, min_chunk, block_m, block_n, nodes_per_program, node_blocks,
                         per_chunk * (splits + 1), workspace(splits))  # fmt: skip


# --------------------------------------------------------------------- launch


def tree_attention_triton(
    q,
    k_cache,
    v_cache,
    block_table,
    context_lens,
    tree_mask,
    mode,
    scale=None,
    *,
    kernel: str = "auto",
    num_splits: int | None = None,
    max_context_len: int | None = None,
    split_min_tokens: int | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    soft_cap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
):
    """Triton tree attention; same arguments and result as the reference
    (window, sinks, soft_cap, alibi_slopes included: ``attention_reference``).

    Keyword-only knobs (the defaults suit an H100/H200; ``plan_tree_attention``
    documents the choice):
    kernel           "auto" (by shape), "single" or "split";
    num_splits       prefix chunks per request for the split kernel;
    max_context_len  a bound on context_lens known to the caller (e.g. the
                     engine's max_model_len): a tighter split plan than the
                     block table's width gives. A bound, never read from
                     context_lens (that would sync);
    split_min_tokens shortest prefix chunk;
    block_m          rows of the query tile (nodes x GQA group), a power of 2 >= 16;
    block_n          KV tokens per tile: 16, 32 or 64 (must divide 64);
    num_warps, num_stages  passed to the attention launch.
    """
    mode = _check_inputs(q, k_cache, v_cache, block_table, context_lens, tree_mask, mode)
    require_triton(q.device)
    batch, nodes, hq, dim = q.shape
    _, block_size, hkv, _ = k_cache.shape
    features = check_features(window, sinks, soft_cap, alibi_slopes, num_q_heads=hq, device=q.device)
    out = torch.empty(batch, nodes, hq, dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    plan = plan_tree_attention(
        batch, nodes, hq, hkv, dim, block_size, block_table.shape[1], q.device, kernel=kernel, num_splits=num_splits,
        max_context_len=max_context_len, split_min_tokens=split_min_tokens, block_m=block_m, block_n=block_n,
        window=features.window,
    )  # fmt: skip
    launch = {k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages)) if v is not None}
    depths = node_depths(tree_mask, mode, batch, nodes) if features.needs_positions else None
    run_planned_attention(plan, q, k_cache, v_cache, block_table, context_lens, kernel_mask(tree_mask, mode), mode,
                          scale, out, split_workspace(plan, q), features=features, depths=depths, **launch)
    return out


def require_triton(device) -> None:
    if not _triton_usable(device):
        raise RuntimeError(
            f"tree_attention_triton needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 "
            f"(device={device}, triton importable={triton is not None})"
        )


def kernel_mask(tree_mask: torch.Tensor, mode: TreeMaskMode) -> torch.Tensor:
    """The tree mask as the kernels load it (QLEN_ONLY's bools as the same
    bytes: Triton loads bytes, not i1)."""
    return tree_mask.view(torch.uint8) if mode == TreeMaskMode.QLEN_ONLY else tree_mask.contiguous()


def split_workspace(plan: AttentionPlan, q: torch.Tensor):
    """(o_part [B, T, Hq, S+1, D], lse_part [B, T, Hq, S+1]) fp32 partial states
    of the split kernel, or None for the single-pass one. Reusable across
    layers: the merge reads only the chunks each request's split programs wrote."""
    if plan.kernel != "split":
        return None
    batch, nodes, hq, dim = q.shape
    o_part = torch.empty(batch, nodes, hq, plan.num_splits + 1, dim, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(batch, nodes, hq, plan.num_splits + 1, dtype=torch.float32, device=q.device)
    return o_part, lse_part


def feature_launch_args(features: AttentionFeatures, placeholder: torch.Tensor, depths=None) -> dict:
    """The kernels' feature arguments and flags for ``features``: pointers (a
    placeholder tensor where a flag is off: never read), window, soft_cap2
    (base 2), and the WINDOW / SOFT_CAP / ALIBI / SINKS constexprs."""
    if features.needs_positions and depths is None:
        raise ValueError("a window or ALiBi needs the tree's node depths (node_depths)")
    return dict(
        depth_ptr=depths if features.needs_positions else placeholder,
        sinks_ptr=features.sinks if features.sinks is not None else placeholder,
        alibi_ptr=features.alibi_slopes if features.alibi_slopes is not None else placeholder,
        window=features.window if features.window is not None else 0,
        soft_cap2=features.soft_cap * LOG2E if features.soft_cap is not None else 0.0,
        WINDOW=features.window is not None, SOFT_CAP=features.soft_cap is not None,
        ALIBI=features.alibi_slopes is not None, SINKS=features.sinks is not None,
    )


def run_planned_attention(plan: AttentionPlan, q, k_cache, v_cache, block_table, context_lens, mask, mode, scale, out,
                          workspace, *, features: AttentionFeatures = NO_FEATURES, depths=None, **launch) -> None:
    """Launch ``plan``'s kernels, writing ``out`` [B, T, Hq, D]. Inputs are the
    checked ones of ``tree_attention_triton`` (``mask`` from ``kernel_mask``,
    ``workspace`` from ``split_workspace``, ``depths`` [B, T] int32 from
    ``node_depths`` when the features need positions); nothing here reads
    the device."""
    batch, nodes, hq, dim = q.shape
    _, block_size, hkv, _ = k_cache.shape
    fa = feature_launch_args(features, context_lens, depths)
    common = dict(
        T=nodes,
        GROUP=hq // hkv,
        HEAD_DIM=dim,
        BLOCK_SIZE=block_size,
        MODE=int(mode),
        WORDS=ancestor_bitmask_words(nodes),
        NODES=plan.nodes_per_program,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n,
        BLOCK_D=max(16, _next_pow2(dim)),
        # fp32 inputs get IEEE fp32 dots; so do bf16 ones under TRITON_INTERPRET,
        # whose tl.dot multiplies bf16's raw uint16 storage as integers (Triton 3.9)
        DOT_F32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and triton_interpreting()),
    )
    qk_scale = _default_scale(scale, dim) * math.log2(math.e)

    if plan.kernel == "single":
        grid = (plan.node_blocks, hkv, batch)
        triton_launch.launch(
            _tree_attention_kernel, grid, q, k_cache, v_cache, out, block_table, context_lens, mask,
            fa["depth_ptr"], fa["sinks_ptr"], fa["alibi_ptr"],
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
            block_table.stride(0), qk_scale, fa["window"], fa["soft_cap2"], **common,
            WINDOW=fa["WINDOW"], SOFT_CAP=fa["SOFT_CAP"], ALIBI=fa["ALIBI"], SINKS=fa["SINKS"], **launch,
        )  # fmt: skip
        return

    splits = plan.num_splits
    o_part, lse_part = workspace
    grid = (plan.node_blocks, splits + 1, batch * hkv)
    triton_launch.launch(
        _tree_attention_split_kernel, grid, q, k_cache, v_cache, o_part, lse_part, block_table, context_lens, mask,
        fa["depth_ptr"], fa["alibi_ptr"],
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        block_table.stride(0), qk_scale, splits, plan.min_chunk, hkv, fa["window"], fa["soft_cap2"],
        HQ=hq, **common, WINDOW=fa["WINDOW"], SOFT_CAP=fa["SOFT_CAP"], ALIBI=fa["ALIBI"], **launch,
    )  # fmt: skip
    launch_merge(o_part, lse_part, out, context_lens, fa["sinks_ptr"], splits, plan.min_chunk, fa["window"],
                 nodes, hq, dim, plan.block_n, common["BLOCK_D"], fa["WINDOW"], fa["SINKS"])


def launch_merge(o_part, lse_part, out, context_lens, sinks, splits: int, min_chunk: int, window: int, nodes: int,
                 hq: int, dim: int, block_n: int, block_d: int, has_window: bool, has_sinks: bool) -> None:
    """The merge launch of a split plan (verify and draft steps): ``window``
    the one the split kernel's chunks were cut under (a draft level's
    effective one), ``sinks`` fp32 [Hq] or a placeholder."""
    # one row per program on a GPU (parallelism); many per program in the interpreter (speed)
    rows = min(_next_pow2(nodes * hq), 256) if triton_interpreting() else 1
    triton_launch.launch(
        _tree_attention_merge_kernel, (triton.cdiv(nodes * hq, rows), out.shape[0]),
        o_part, lse_part, out, context_lens, sinks, *out.stride(), splits, min_chunk, window,
        T=nodes, HQ=hq, HEAD_DIM=dim, BLOCK_N=block_n, SPLITS_P2=max(2, _next_pow2(splits)), ROWS=rows,
        BLOCK_D=block_d, WINDOW=has_window, SINKS=has_sinks,
    )  # fmt: skip
