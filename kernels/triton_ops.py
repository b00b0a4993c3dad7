"""Triton implementations of the tree ops (one program per request, or per
row tile of a request for the tree build from parents).

Semantics, shapes and dtypes are those of ``reference.py``; call these through
``spec_tree_kernels.api``, which validates the inputs. Every launch has a grid
and constexprs fixed by (batch, T, topk, num_steps, mode; V and the dtype for
the sampled verify), so the launches are CUDA-graph capturable; no op reads a
device value on the host. Unvalidated garbage (``validate=False``) may give
garbage out but never reads out of bounds.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .modes import TreeMaskMode, ancestor_bitmask_words, empty_tree_mask
from .reference import TreeBuild, VerifyResult, empty_verify_result
from .triton_launch import launch  # the one launch seam (recorded; captured by the startup warm-up)

_ROW_TILE = 16  # rows of a [rows, T] tile in the build kernels (at most)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


# --------------------------------------------------------------------- select


@triton.jit
def _select_kernel(
    scores_ptr,  # [B, P] float32
    parent_list_ptr,  # [B, PW] int64
    scratch_ptr,  # [B, BLOCK_P] int32 ordered keys
    out_ptr,  # [B, NUM_SEL] int64
    P,
    PW,
    TOPK: tl.constexpr,
    NUM_STEPS: tl.constexpr,
    NUM_SEL: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_P)
    valid = offs < P
    score = tl.load(scores_ptr + b * P + offs, mask=valid, other=float("-inf"))
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -2147483647 - 1, 0, bits)  # -0.0 ranks as +0.0; integer ops keep subnormals exact
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int order == float order
    key = tl.where(valid, key, -2147483647 - 1)
    row = scratch_ptr + b * BLOCK_P
    tl.store(row + offs, key)
    # path-min: a candidate never ranks above its parent (see reference.path_min_scores)
    for step in tl.static_range(1, NUM_STEPS):
        start = TOPK + (step - 1) * TOPK * TOPK
        in_step = (offs >= start) & (offs < start + TOPK * TOPK)
        parent_pool = tl.load(parent_list_ptr + b * PW + offs // TOPK, mask=in_step, other=0)
        tl.debug_barrier()
        parent_key = tl.load(row + parent_pool, mask=in_step, other=0)
        key = tl.where(in_step, tl.minimum(key, parent_key), key)
        tl.debug_barrier()
        tl.store(row + offs, key, mask=in_step)
    # rank by (key desc, index asc): both packed into one int64
    packed = (key.to(tl.int64) << 32) | (0x7FFFFFFF - offs).to(tl.int64)
    ranked = tl.sort(packed, 0, descending=True)
    kth = tl.max(tl.where(offs == NUM_SEL - 1, ranked, -9223372036854775807 - 1), 0)
    chosen = packed >= kth
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(out_ptr + b * NUM_SEL + slot, offs.to(tl.int64), mask=chosen)


def select_tree_nodes(scores, parent_list, topk, num_steps, num_draft_tokens):
    batch, pool = scores.shape
    block = _pow2(pool)
    scratch = torch.empty(batch, block, dtype=torch.int32, device=scores.device)
    out = torch.empty(batch, num_draft_tokens - 1, dtype=torch.int64, device=scores.device)
    parents = parent_list if parent_list.shape[1] > 0 else torch.zeros(batch, 1, dtype=torch.int64, device=scores.device)
    launch(
        _select_kernel,
        (batch,),
        scores.contiguous(),
        parents.contiguous(),
        scratch,
        out,
        pool,
        parents.shape[1],
        TOPK=topk,
        NUM_STEPS=num_steps,
        NUM_SEL=num_draft_tokens - 1,
        BLOCK_P=block,
    )
    return out


# ---------------------------------------------------------------------- build


@triton.jit
def _tree_rows(
    b,  # request (int64)
    rows,  # [ROWS] node indices of this tile (rows >= T are masked off)
    cols,  # [BLOCK_T] 0..BLOCK_T-1, BLOCK_T >= T
    col_parent,  # [BLOCK_T] parent of every node (any value past T)
    parent_ptr,  # [B, T] int32 | int64 node-local parents, -1 root (negative: no parent)
    seq_len,  # committed context length of request b (int64)
    prefix_ptr,  # [B] int64 exclusive prefix sum of seq_lens (FULL_MASK only)
    mask_ptr,  # mode layout, written through an integer view (``modes``)
    positions_ptr,  # [B, T] int64
    retrieve_index_ptr,
    next_token_ptr,
    next_sibling_ptr,  # [B, T] int64 each
    T,
    climbs,  # levels to climb at most: reference.ancestor_matrix's max_depth + 1
    MODE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Rows ``rows`` of request b's ``TreeBuild``: ``reference.ancestor_matrix``
    (climbing at most ``climbs`` levels), ``encode_mask`` and ``tree_links``.
    Returns [ROWS] the node each row's climb stopped at (-1: it left the tree
    through the root)."""
    row_ok = rows < T
    col_ok = cols < T
    row_parent = tl.load(parent_ptr + b * T + rows, mask=row_ok, other=-1)
    anc = (cols[None, :] == rows[:, None]) & col_ok[None, :]
    depth = tl.zeros(rows.shape, dtype=tl.int32)
    cur = tl.where(row_ok, rows, -1).to(row_parent.dtype)
    climbed = 0
    # a climb of rows that all left the tree changes nothing: stop there (the last climb leaves the root)
    while (climbed < climbs) & (tl.max(cur, 0) >= 0):
        inside = (cur >= 0) & (cur < T)  # an unvalidated parent past T stops (the reference's gather raises)
        cur = tl.where(cur >= 0, tl.load(parent_ptr + b * T + tl.where(inside, cur, 0), mask=inside, other=-1), cur)
        depth += (cur >= 0).to(tl.int32)
        anc = anc | (cols[None, :] == cur[:, None])
        climbed += 1
    tl.store(positions_ptr + b * T + rows, seq_len + depth.to(tl.int64), mask=row_ok)
    tl.store(retrieve_index_ptr + b * T + rows, b * T + rows, mask=row_ok)
    cell_ok = row_ok[:, None] & col_ok[None, :]
    if MODE == 0:  # FULL_MASK: tree columns only; the prefix is filled separately
        row_base = T * T * b + T * tl.load(prefix_ptr + b) + (seq_len + T) * rows + seq_len
        tl.store(mask_ptr + row_base[:, None] + cols[None, :], anc.to(tl.int8), mask=cell_ok)
    elif MODE == 1:  # QLEN_ONLY
        tl.store(mask_ptr + b * T * T + rows[:, None] * T + cols[None, :], anc.to(tl.int8), mask=cell_ok)
    elif MODE == 2:  # QLEN_ONLY_BITPACKING: one word per row
        word = tl.sum(tl.where(anc, tl.full([1, BLOCK_T], 1, tl.int64) << cols[None, :].to(tl.int64), 0), 1)
        tl.store(mask_ptr + b * T + rows, word.to(mask_ptr.dtype.element_ty), mask=row_ok)
    elif MODE == 3:  # ANCESTOR_BITMASK: WORDS int64 per row
        for w in tl.static_range(WORDS):
            in_word = (cols >= 64 * w) & (cols < 64 * w + 64)
            shift = (cols - 64 * w).to(tl.int64)
            bits = tl.where(anc & in_word[None, :], tl.full([1, BLOCK_T], 1, tl.int64) << shift[None, :], 0)
            tl.store(mask_ptr + (b * T + rows) * WORDS + w, tl.sum(bits, 1), mask=row_ok)
    else:  # PARENT_POINTER: [B, 2, T] int16
        tl.store(mask_ptr + b * 2 * T + rows, row_parent.to(tl.int16), mask=row_ok)
        tl.store(mask_ptr + b * 2 * T + T + rows, depth.to(tl.int16), mask=row_ok)
    # first child of each row node; next sibling = next higher node with the same parent
    is_child = (col_parent[None, :] == rows[:, None]) & col_ok[None, :]
    first_child = tl.min(tl.where(is_child, cols[None, :], BLOCK_T), 1)
    sibling = (col_parent[None, :] == row_parent[:, None]) & (cols[None, :] > rows[:, None]) & col_ok[None, :]
    sibling = sibling & (rows[:, None] > 0)
    next_sib = tl.min(tl.where(sibling, cols[None, :], BLOCK_T), 1)
    tl.store(next_token_ptr + b * T + rows, tl.where(first_child < BLOCK_T, first_child, -1).to(tl.int64), mask=row_ok)
    tl.store(next_sibling_ptr + b * T + rows, tl.where(next_sib < BLOCK_T, next_sib, -1).to(tl.int64), mask=row_ok)
    return cur


@triton.jit
def _build_kernel(
    selected_ptr,  # [B, T-1] int64
    parent_list_ptr,  # [B, PW] int64
    seq_lens_ptr,  # [B] int64
    prefix_ptr,  # [B] int64 exclusive prefix sum of seq_lens (FULL_MASK)
    parent_ptr,  # [B, T] int32 scratch: parent node, -1 root, -2 missing
    mask_ptr,  # mode layout, written through an integer view
    positions_ptr,  # [B, T] int64
    retrieve_index_ptr,
    next_token_ptr,
    next_sibling_ptr,  # [B, T] int64 each
    ok_ptr,  # [B] int32
    PW,
    T: tl.constexpr,
    TOPK: tl.constexpr,
    NUM_STEPS: tl.constexpr,
    MODE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ROWS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_T)
    col_ok = cols < T
    sel_row = selected_ptr + b * (T - 1)
    # candidate of every node as a column vector; node 0 (the root) gets -1
    col_cand = tl.load(sel_row + cols - 1, mask=col_ok & (cols > 0), other=-1)
    ok = tl.full([], 1, tl.int32)
    # 1. parent node of every node
    for r0 in range(0, BLOCK_T, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        child = (rows > 0) & (rows < T)
        cand = tl.load(sel_row + rows - 1, mask=child, other=0)
        group = cand // TOPK
        # clamped like the reference: an unvalidated out-of-pool candidate must not read past parent_list
        parent_pool = tl.load(parent_list_ptr + b * PW + tl.minimum(group, PW - 1), mask=child & (group > 0), other=-1)
        hit = (col_cand[None, :] == parent_pool[:, None]) & (cols[None, :] > 0) & col_ok[None, :]
        first = tl.min(tl.where(hit, cols[None, :], BLOCK_T), 1)
        parent = tl.where(group == 0, 0, tl.where(first < BLOCK_T, first, -2))
        parent = tl.where(rows == 0, -1, parent)
        ok = ok & tl.min(tl.where(rows < T, (parent != -2).to(tl.int32), 1), 0)
        tl.store(parent_ptr + b * T + rows, parent.to(tl.int32), mask=rows < T)
    tl.debug_barrier()
    col_parent = tl.load(parent_ptr + b * T + cols, mask=col_ok, other=-3)
    seq_len = tl.load(seq_lens_ptr + b)
    # 2. per row tile: ancestors, depth, mask, positions, links
    for r0 in range(0, BLOCK_T, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        cur = _tree_rows(b, rows, cols, col_parent, parent_ptr, seq_len, prefix_ptr, mask_ptr, positions_ptr,
                         retrieve_index_ptr, next_token_ptr, next_sibling_ptr, T, NUM_STEPS + 1, MODE, WORDS, BLOCK_T)
        ok = ok & tl.min(tl.where(rows < T, (cur == -1).to(tl.int32), 1), 0)
    tl.store(ok_ptr + b, ok)


def _int_view(mask: torch.Tensor) -> torch.Tensor:
    """Same bytes, a signed integer dtype Triton stores into."""
    signed = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[mask.element_size()]
    return mask.view(signed)


def build_tree(selected_index, parent_list, seq_lens, topk, num_steps, mode, seq_lens_sum, fill_prefix_mask, tree_mask_buf):
    batch, num_selected = selected_index.shape
    nodes = num_selected + 1
    device = selected_index.device
    mask = tree_mask_buf if tree_mask_buf is not None else empty_tree_mask(mode, batch, nodes, seq_lens_sum, device)
    positions = torch.empty(batch, nodes, dtype=torch.int64, device=device)
    links = torch.empty(3, batch, nodes, dtype=torch.int64, device=device)
    parent = torch.empty(batch, nodes, dtype=torch.int32, device=device)
    ok = torch.empty(batch, dtype=torch.int32, device=device)
    if mode == TreeMaskMode.FULL_MASK and fill_prefix_mask:
        # one memset beats a per-row prefix kernel; the build kernel then overwrites the tree cells.
        # The whole buffer, like SGLang and the reference (a preallocated one may exceed seq_lens_sum).
        mask.fill_(True)
    if batch == 0:
        return TreeBuild(mask, positions, links[0], links[1], links[2]), ok.bool()
    prefix = torch.cumsum(seq_lens, 0) - seq_lens
    parents = parent_list if parent_list.shape[1] > 0 else torch.zeros(batch, 1, dtype=torch.int64, device=device)
    block_t = _pow2(nodes)
    launch(
        _build_kernel,
        (batch,),
        selected_index.contiguous() if num_selected else torch.zeros(batch, 1, dtype=torch.int64, device=device),
        parents.contiguous(),
        seq_lens,
        prefix,
        parent,
        _int_view(mask),
        positions,
        links[0],
        links[1],
        links[2],
        ok,
        parents.shape[1],
        T=nodes,
        TOPK=topk,
        NUM_STEPS=num_steps,
        MODE=int(mode),
        WORDS=ancestor_bitmask_words(nodes),
        BLOCK_T=block_t,
        ROWS=min(_ROW_TILE, block_t),
    )
    return TreeBuild(mask, positions, links[0], links[1], links[2]), ok.bool()


# -------------------------------------------------------- tree from parents


# Not specialized on: T and climbs (one variant per BLOCK_T, whatever the tree size and depth), nor the
# inputs' alignment (the caller's views; the outputs are fresh allocations): the variants are known at startup.
@triton.jit(do_not_specialize=["T", "climbs"], do_not_specialize_on_alignment=["parent_ptr", "seq_lens_ptr"])
def _tree_from_parents_kernel(
    parent_ptr,  # [B, T] int64
    seq_lens_ptr,  # [B] int64
    mask_ptr,  # mode layout, written through an integer view
    positions_ptr,  # [B, T] int64
    retrieve_index_ptr,
    next_token_ptr,
    next_sibling_ptr,  # [B, T] int64 each
    T,
    climbs,
    MODE: tl.constexpr,
    WORDS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ROWS: tl.constexpr,
):
    """``reference``'s tree_from_parents outputs for rows [ROWS * pid(1), + ROWS)
    of request pid(0): grid (B, cdiv(T, ROWS)), one launch for the batch.

    Inputs (contiguous, row-major):
      parent_ptr    [B, T] int64   node-local parent, -1 for the root; a parent
                                   precedes its child (unchecked here)
      seq_lens_ptr  [B] int64      committed context length
    Outputs (contiguous, row-major, every element written):
      mask_ptr      MODE's layout (``modes``) through a signed integer view of
                    the same bytes: QLEN_ONLY (1) [B, T, T] int8 (bool bytes);
                    QLEN_ONLY_BITPACKING (2) [B, T] int8 / int16 / int32 (the
                    uint8 / uint16 / uint32 word); ANCESTOR_BITMASK (3)
                    [B, T, WORDS] int64, WORDS = ceil(T / 64); PARENT_POINTER
                    (4) [B, 2, T] int16 (parent, depth). FULL_MASK (0) is not
                    built from parents.
      positions_ptr [B, T] int64   seq_lens + depth
      retrieve_index_ptr, next_token_ptr, next_sibling_ptr  [B, T] int64: b * T + i,
                                   first child, next sibling (-1: none)
    T       nodes per tree (runtime: one variant serves every T of a BLOCK_T,
            the next power of two >= T and >= 16, with the same MODE / WORDS)
    climbs  reference.ancestor_matrix's max_depth + 1 (runtime): a node deeper
            than max_depth gets depth max_depth + 1 and misses its upper
            ancestors, as there; the climb stops early once every row of the
            tile has left the tree
    """
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_T)
    col_parent = tl.load(parent_ptr + b * T + cols, mask=cols < T, other=-3)
    _tree_rows(b, rows, cols, col_parent, parent_ptr, tl.load(seq_lens_ptr + b), seq_lens_ptr, mask_ptr,
               positions_ptr, retrieve_index_ptr, next_token_ptr, next_sibling_ptr, T, climbs, MODE, WORDS, BLOCK_T)


def tree_from_parents(parent, seq_lens, mode, max_depth):
    """``api.tree_from_parents`` in one launch (``_tree_from_parents_kernel``)
    into fresh tensors (each its own allocation: aligned, so their alignment
    makes no variant)."""
    batch, nodes = parent.shape
    device = parent.device
    mask = empty_tree_mask(mode, batch, nodes, 0, device)
    positions, *links = (torch.empty(batch, nodes, dtype=torch.int64, device=device) for _ in range(4))
    if batch:
        block_t = _pow2(nodes)
        rows = min(_ROW_TILE, max(2, 4096 // block_t))  # [rows, BLOCK_T] tiles: no spills on sm_90 up to T = 1024
        launch(
            _tree_from_parents_kernel,
            (batch, triton.cdiv(nodes, rows)),
            parent.contiguous(),
            seq_lens.contiguous(),
            _int_view(mask),
            positions,
            links[0],
            links[1],
            links[2],
            nodes,
            max_depth + 1,
            MODE=int(mode),
            WORDS=ancestor_bitmask_words(nodes) if mode == TreeMaskMode.ANCESTOR_BITMASK else 1,  # no variant per T
            BLOCK_T=block_t,
            ROWS=rows,
        )
    return TreeBuild(mask, positions, links[0], links[1], links[2])


# --------------------------------------------------------------------- verify


@triton.jit
def _verify_kernel(
    candidates_ptr,
    next_token_ptr,
    next_sibling_ptr,
    target_ptr,  # [B, T] int64 each
    accept_index_ptr,  # [B, W] int32
    accept_length_ptr,  # [B] int32
    accept_tokens_ptr,  # [B, W] int64
    T: tl.constexpr,
    W: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    base = b * T
    cur = tl.zeros([], dtype=tl.int64)
    length = tl.zeros([], dtype=tl.int32)
    alive = 1
    tl.store(accept_index_ptr + b * W, 0)
    tl.store(accept_tokens_ptr + b * W, tl.load(target_ptr + base))
    for d in tl.static_range(1, W):
        wanted = tl.load(target_ptr + base + cur)
        child = tl.load(next_token_ptr + base + cur)
        chosen = tl.full([], -1, tl.int64)
        for _ in range(T - 1):
            scanning = (alive != 0) & (chosen < 0) & (child >= 0) & (child < T)
            safe = tl.where(scanning, child, 0)
            hit = scanning & (tl.load(candidates_ptr + base + safe) == wanted)
            chosen = tl.where(hit, child, chosen)
            child = tl.where(scanning & (hit == 0), tl.load(next_sibling_ptr + base + safe), child)
        alive = alive & (chosen >= 0)
        cur = tl.where(alive != 0, chosen, cur)
        length += alive.to(tl.int32)
        tl.store(accept_index_ptr + b * W + d, tl.where(alive != 0, chosen, -1).to(tl.int32))
        token = tl.load(target_ptr + base + tl.where(alive != 0, chosen, 0))
        tl.store(accept_tokens_ptr + b * W + d, tl.where(alive != 0, token, -1))
    tl.store(accept_length_ptr + b, length)


def _launch_verify(
    kernel, candidates, next_token, next_sibling, target_inputs, num_steps, **kernel_args
) -> VerifyResult:
    """One program per request of a verify kernel whose parameters are the
    tree's three [B, T] arrays, ``target_inputs``, the three ``VerifyResult``
    outputs, then the keyword ``kernel_args`` and the shape constexprs T, W."""
    batch, nodes = candidates.shape
    width = num_steps + 1
    result = empty_verify_result(batch, width, candidates.device)
    if batch:
        launch(
            kernel,
            (batch,),
            candidates.contiguous(),
            next_token.contiguous(),
            next_sibling.contiguous(),
            *(t.contiguous() for t in target_inputs),
            *result,
            **kernel_args,
            T=nodes,
            W=width,
        )
    return result


def verify_tree_greedy(candidates, next_token, next_sibling, target_predict, num_steps):
    return _launch_verify(_verify_kernel, candidates, next_token, next_sibling, (target_predict,), num_steps)


# ------------------------------------------------------------ sampled verify


@triton.jit
def _first_max(v1, i1, v2, i2):
    """torch.argmax's order on (value, index) scalars: NaN above everything,
    then the larger value, then the lower index (-0.0 == +0.0)."""
    nan1 = v1 != v1
    nan2 = v2 != v2
    larger = (v1 > v2) & (nan2 == 0)
    tie = ((v1 == v2) | (nan1 & nan2)) & (i1 < i2)
    take1 = (nan1 & (nan2 == 0)) | larger | tie
    return tl.where(take1, v1, v2), tl.where(take1, i1, i2)


@triton.jit
def _block_first_max(v, idx, ok):
    """(value, index) of the first maximum of a block in torch.argmax's
    order, lanes with ok False left out (native reductions only)."""
    big = 9223372036854775807
    nan = ok & (v != v)
    any_nan = tl.max(nan.to(tl.int32), 0) > 0
    first_nan = tl.min(tl.where(nan, idx, big), 0)
    clean = tl.where(ok & (v == v), v, float("-inf"))
    top = tl.max(clean, 0)
    first_top = tl.min(tl.where(ok & (v == v) & (clean == top), idx, big), 0)
    return tl.where(any_nan, float("nan"), top), tl.where(any_nan, first_nan, first_top)


@triton.jit
def _div_rn(x, y, IS_F64: tl.constexpr):
    """x / y rounded to nearest like torch. Triton's fp32 ``/`` is the
    approximate div.full.f32 on NVIDIA GPUs; its fp64 ``/`` is div.rn.f64."""
    if IS_F64:
        q = x / y
    else:
        q = tl.math.div_rn(x, y)
    return q


@triton.jit
def _verify_sampling_kernel(
    candidates_ptr,
    next_token_ptr,
    next_sibling_ptr,  # [B, T] int64 each
    probs_ptr,  # [B, T, V] float32 | float64
    coins_ptr,  # [B, T]
    exponentials_ptr,  # [B, V]
    accept_index_ptr,  # [B, W] int32
    accept_length_ptr,  # [B] int32
    accept_tokens_ptr,  # [B, W] int64
    V,
    T: tl.constexpr,
    W: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_V: tl.constexpr,
    IS_F64: tl.constexpr,
):
    """reference.verify_tree_sampling for one request: the walk in scalars,
    then the exponential race over V in blocks."""
    b = tl.program_id(0).to(tl.int64)
    base = b * T
    dtype = probs_ptr.dtype.element_ty
    zero = tl.zeros([], dtype=dtype)
    offs_t = tl.arange(0, BLOCK_T)
    offs_w = tl.arange(0, BLOCK_W)
    path_index = tl.where(offs_w == 0, 0, -1).to(tl.int64)  # accept_index
    path_tokens = tl.full([BLOCK_W], -1, tl.int64)  # accepted draft tokens
    cur = tl.zeros([], dtype=tl.int64)
    alive = tl.full([], 1, tl.int1)
    length = tl.zeros([], dtype=tl.int32)
    stop_rejected = tl.zeros([], dtype=tl.int32)  # children rejected where the walk stopped
    final_rejected = tl.full([BLOCK_T], -1, tl.int64)  # ... and their tokens
    for d in tl.static_range(1, W):
        row = (base + cur) * V
        child = tl.load(next_token_ptr + base + cur)
        chosen = tl.full([], -1, tl.int64)
        mass = zero + 1.0
        rejected = tl.full([BLOCK_T], -1, tl.int64)
        num_rejected = tl.zeros([], dtype=tl.int32)
        scanning = alive & (child >= 0) & (child < T)
        steps = tl.zeros([], dtype=tl.int32)
        while scanning:  # the node's children in sibling order, at most T - 1
            token = tl.load(candidates_ptr + base + child)
            in_vocab = (token >= 0) & (token < V)
            p = tl.load(probs_ptr + row + tl.where(in_vocab, token, 0), mask=in_vocab, other=0.0)
            duplicate = tl.max((rejected == token).to(tl.int32), 0) > 0
            p = tl.where(duplicate, zero, p)  # p_res(token)
            coin = tl.load(coins_ptr + base + child)
            hit = coin * mass < p
            miss = hit == 0
            chosen = tl.where(hit, child, chosen)
            mass = tl.where(miss, mass - p, mass)
            rejected = tl.where((offs_t == num_rejected) & miss, token, rejected)
            num_rejected += miss.to(tl.int32)
            sibling = tl.load(next_sibling_ptr + base + child)
            child = tl.where(miss, sibling, child)
            steps += 1
            scanning = miss & (child >= 0) & (child < T) & (steps < T - 1)
        stops = alive & (chosen < 0)
        stop_rejected = tl.where(stops, num_rejected, stop_rejected)
        final_rejected = tl.where(stops, rejected, final_rejected)
        alive = alive & (chosen >= 0)
        token = tl.load(candidates_ptr + base + tl.where(alive, chosen, 0))
        path_index = tl.where((offs_w == d) & alive, chosen, path_index)
        path_tokens = tl.where((offs_w == d - 1) & alive, token, path_tokens)
        cur = tl.where(alive, chosen, cur)
        length += alive.to(tl.int32)
    # The race over V: argmax p_res / E, and argmax p / E for an empty residual.
    row = (base + cur) * V
    first_child = tl.load(next_token_ptr + base + cur)
    rejected_ok = (final_rejected >= 0) & (final_rejected < V)
    rejected_lo = tl.min(tl.where(rejected_ok, final_rejected, 9223372036854775807), 0)
    rejected_hi = tl.max(tl.where(rejected_ok, final_rejected, -1), 0)
    best_res = zero - float("inf")
    best_res_i = tl.full([], 9223372036854775807, tl.int64)
    best_all = zero - float("inf")
    best_all_i = tl.full([], 9223372036854775807, tl.int64)
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        ok = offs < V
        p = tl.load(probs_ptr + row + offs, mask=ok, other=0.0)
        e = tl.load(exponentials_ptr + b * V + offs, mask=ok, other=1.0)
        # the stop node's rejected children: its first stop_rejected children (none if the walk never
        # stopped), walked again from memory for the blocks that hold one of their tokens
        is_rejected = offs < 0
        child = first_child
        overlap = (rejected_lo < v0 + BLOCK_V) & (rejected_hi >= v0)
        for _ in range(tl.where(overlap, stop_rejected, 0)):
            is_rejected = is_rejected | (offs == tl.load(candidates_ptr + base + child))
            child = tl.load(next_sibling_ptr + base + child)
        blk, blk_i = _block_first_max(_div_rn(tl.where(is_rejected, zero, p), e, IS_F64), offs, ok)
        best_res, best_res_i = _first_max(best_res, best_res_i, blk, blk_i)
        blk, blk_i = _block_first_max(_div_rn(p, e, IS_F64), offs, ok)
        best_all, best_all_i = _first_max(best_all, best_all_i, blk, blk_i)
    drawn = tl.where(best_res > 0, best_res_i, best_all_i)
    tokens = tl.where(offs_w < length, path_tokens, tl.where(offs_w == length, drawn, -1))
    tl.store(accept_index_ptr + b * W + offs_w, path_index.to(tl.int32), mask=offs_w < W)
    tl.store(accept_tokens_ptr + b * W + offs_w, tokens, mask=offs_w < W)
    tl.store(accept_length_ptr + b, length)


def verify_tree_sampling(
    candidates, next_token, next_sibling, target_probs, coins, exponentials, num_steps, block_v=None
):
    """``reference.verify_tree_sampling``, one program per request.
    ``block_v``: vocabulary block of the final draw (a power of two; default
    min(1024, V rounded up))."""
    vocab = target_probs.shape[2]
    return _launch_verify(
        _verify_sampling_kernel,
        candidates,
        next_token,
        next_sibling,
        (target_probs, coins, exponentials),
        num_steps,
        V=vocab,
        BLOCK_T=_pow2(candidates.shape[1]),
        BLOCK_W=_pow2(num_steps + 1),
        BLOCK_V=block_v or min(1024, _pow2(vocab)),
        IS_F64=target_probs.dtype == torch.float64,
    )


# -------------------------------------------------------------------- move KV


@triton.jit
def _move_kv_kernel(
    cache_ptr,  # the group's first [num_blocks, block_size, H, D] view
    cache_offsets_ptr,  # [C] int64: each view's start, in elements from cache_ptr
    verify_slots_ptr,  # [B, T] int64
    accept_index_ptr,  # [B, W]
    accept_length_ptr,  # [B]
    stride_block,
    stride_offset,
    stride_head,
    stride_dim,
    BLOCK_SIZE,
    HEAD_DIM,
    ROW,
    T: tl.constexpr,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    elems = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    layer_ptr = cache_ptr + tl.load(cache_offsets_ptr + tl.program_id(2))  # one launch moves every view
    elem_ok = elems < ROW
    elem_offset = (elems // HEAD_DIM) * stride_head + (elems % HEAD_DIM) * stride_dim
    length = tl.load(accept_length_ptr + b).to(tl.int64)
    # depths in order: slot d is read (as node d) before any later depth writes it
    for d in tl.static_range(1, W):
        node = tl.load(accept_index_ptr + b * W + d).to(tl.int64)
        moving = (length >= d) & (node >= 0) & (node < T) & (node != d) & (d < T)
        src = tl.load(verify_slots_ptr + b * T + tl.where(moving, node, 0))
        dst = tl.load(verify_slots_ptr + b * T + tl.where(moving, d, 0))
        src_addr = (src // BLOCK_SIZE) * stride_block + (src % BLOCK_SIZE) * stride_offset + elem_offset
        dst_addr = (dst // BLOCK_SIZE) * stride_block + (dst % BLOCK_SIZE) * stride_offset + elem_offset
        copy = tl.where(moving, elem_ok, False)  # not `elem_ok & moving`: the interpreter makes that int32
        row = tl.load(layer_ptr + src_addr, mask=copy)
        tl.store(layer_ptr + dst_addr, row, mask=copy)


# caches (by identity) -> their launch groups; an engine passes the same views
# every step, so the grouping and the device offsets table are built once
_MOVE_GROUPS: dict = {}
_MOVE_GROUPS_MAX = 8


def _move_groups(caches: Sequence[torch.Tensor]):
    """Views of equal shape (but the block count), strides and dtype, as
    (first view, [C] int64 element offsets of each view from the first, on
    its device); views whose distance is not a whole number of elements
    start a group of their own."""
    # Keyed by where the views point, not by the view objects: engines build new views of the
    # same caches every step, and a miss uploads the offsets (a blocking copy on CUDA). The
    # entry holds its views, so their storage (and address) cannot be reused by another cache.
    key = tuple((c.data_ptr(), tuple(c.shape), c.stride(), c.dtype, c.device) for c in caches)
    hit = _MOVE_GROUPS.get(key)
    if hit is not None:
        return hit[1]
    groups: dict = {}
    for cache in caches:
        geometry = (tuple(cache.shape[1:]), cache.stride(), cache.dtype, cache.device)
        for first, members in groups.setdefault(geometry, []):
            distance = cache.data_ptr() - first.data_ptr()
            if distance % cache.element_size() == 0:
                members.append(distance // cache.element_size())
                break
        else:
            groups[geometry].append((cache, [0]))
    built = [
        (first, torch.tensor(offsets, dtype=torch.int64, device=first.device))
        for entries in groups.values()
        for first, offsets in entries
    ]
    if len(_MOVE_GROUPS) >= _MOVE_GROUPS_MAX:
        _MOVE_GROUPS.pop(next(iter(_MOVE_GROUPS)))
    _MOVE_GROUPS[key] = (tuple(caches), built)  # holds the views: their ids stay theirs
    return built


def move_accepted_kv(caches: Sequence[torch.Tensor], verify_slots, accept_index, accept_length):
    """One launch per group of like views (SGLang's and vLLM's K and V of
    every layer: one launch in all), not one per view."""
    batch, nodes = verify_slots.shape
    width = accept_index.shape[1]
    slots = verify_slots.contiguous()
    index = accept_index.contiguous()
    length = accept_length.contiguous()
    for cache, offsets in _move_groups(caches):
        _, block_size, heads, head_dim = cache.shape
        row = heads * head_dim
        block = min(1024, triton.next_power_of_2(row))
        launch(
            _move_kv_kernel,
            (batch, triton.cdiv(row, block), offsets.shape[0]),
            cache,
            offsets,
            slots,
            index,
            length,
            cache.stride(0),
            cache.stride(1),
            cache.stride(2),
            cache.stride(3),
            block_size,
            head_dim,
            row,
            T=nodes,
            W=width,
            BLOCK=block,
        )
