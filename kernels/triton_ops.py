"""Triton implementations of the tree ops (one program per request).

Semantics, shapes and dtypes are those of ``reference.py``; call these through
``spec_tree_kernels.api``, which validates the inputs. Every launch has a grid
and constexprs fixed by (batch, T, topk, num_steps, mode), so the launches are
CUDA-graph capturable; no op reads a device value on the host. Unvalidated
garbage (``validate=False``) may give garbage out but never reads out of bounds.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from .modes import TreeMaskMode, ancestor_bitmask_words, empty_tree_mask
from .reference import TreeBuild, VerifyResult

_ROW_TILE = 16  # rows of a [rows, T] tile in the build kernel


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
    _select_kernel[(batch,)](
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
        row_ok = rows < T
        row_parent = tl.load(parent_ptr + b * T + rows, mask=row_ok, other=-1)
        anc = (cols[None, :] == rows[:, None]) & col_ok[None, :]
        depth = tl.zeros([ROWS], dtype=tl.int32)
        cur = rows.to(tl.int32)
        for _ in tl.static_range(NUM_STEPS + 1):  # the last climb leaves the root
            cur = tl.where(cur >= 0, tl.load(parent_ptr + b * T + cur, mask=(cur >= 0) & row_ok, other=-1), cur)
            depth += (cur >= 0).to(tl.int32)
            anc = anc | (cols[None, :] == cur[:, None])
        ok = ok & tl.min(tl.where(row_ok, (cur == -1).to(tl.int32), 1), 0)
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
    _build_kernel[(batch,)](
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


def verify_tree_greedy(candidates, next_token, next_sibling, target_predict, num_steps):
    batch, nodes = candidates.shape
    width = num_steps + 1
    device = candidates.device
    accept_index = torch.empty(batch, width, dtype=torch.int32, device=device)
    accept_length = torch.empty(batch, dtype=torch.int32, device=device)
    accept_tokens = torch.empty(batch, width, dtype=torch.int64, device=device)
    if batch:
        _verify_kernel[(batch,)](
            candidates.contiguous(),
            next_token.contiguous(),
            next_sibling.contiguous(),
            target_predict.contiguous(),
            accept_index,
            accept_length,
            accept_tokens,
            T=nodes,
            W=width,
        )
    return VerifyResult(accept_index, accept_length, accept_tokens)


# -------------------------------------------------------------------- move KV


@triton.jit
def _move_kv_kernel(
    cache_ptr,  # one layer's [num_blocks, block_size, H, D] view
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
        row = tl.load(cache_ptr + src_addr, mask=copy)
        tl.store(cache_ptr + dst_addr, row, mask=copy)


def move_accepted_kv(caches: Sequence[torch.Tensor], verify_slots, accept_index, accept_length):
    batch, nodes = verify_slots.shape
    width = accept_index.shape[1]
    slots = verify_slots.contiguous()
    index = accept_index.contiguous()
    length = accept_length.contiguous()
    for cache in caches:
        _, block_size, heads, head_dim = cache.shape
        row = heads * head_dim
        block = min(1024, triton.next_power_of_2(row))
        _move_kv_kernel[(batch, triton.cdiv(row, block))](
            cache,
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
