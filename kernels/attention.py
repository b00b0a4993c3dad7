"""Tree attention over a paged KV cache: the verify pass of tree speculation.

Every request holds ``context_len`` committed tokens followed by the T nodes of
its draft tree, whose K/V the engine has already written to the cache at
token positions ``context_len .. context_len + T - 1``. Node i attends to the
whole committed prefix and to the tree positions of its ancestors and itself
(the tree mask, any layout of ``modes.TreeMaskMode`` listed below), never to a
sibling's branch. T = 1 with any mask is ordinary one-token decode.

Shapes and dtypes (B requests, T nodes per request including the root,
Hq query heads, Hkv KV heads with Hq % Hkv == 0, D head dim)::

    q            [B, T, Hq, D]   float16 / bfloat16 / float32, any strides.
                 Node order as in ``modes``: node 0 is the root.
    k_cache      [num_blocks, block_size, Hkv, D], q's dtype, any strides
    v_cache      (e.g. one half of vLLM's [2, num_blocks, ...] cache).
                 Token position p of request b lives in block
                 block_table[b, p // block_size], offset p % block_size.
    block_table  [B, max_blocks] int32 (or int64); entries past the blocks a
                 request uses are never read by the Triton kernel (the torch
                 reference reads them clamped and masks them out).
    context_lens [B] int32 (or int64): committed prefix length of each request;
                 the block table must cover context_len + T positions.
    tree_mask    per ``mode``:
                 ANCESTOR_BITMASK [B, T, ceil(T/64)] int64, bit j%64 of word
                     j//64 of row i set iff node j is i or an ancestor of i;
                 PARENT_POINTER   [B, 2, T] int16: parent (-1 root), depth;
                 QLEN_ONLY        flat bool [B*T*T], row i column j.
    scale        softmax scale, default 1/sqrt(D).
    returns      [B, T, Hq, D] in q's dtype (contiguous).

Softmax and accumulation run in fp32. Neither implementation reads a device
value on the host, and the Triton launch is fixed by shapes alone, so the call
is CUDA-graph capturable.

Triton kernel layout: one program per (node block, KV head, request). The GQA
group's Hq/Hkv query heads of a block of nodes are stacked into the rows of
one [BLOCK_M, D] query tile (row r = node r // G, head r % G) so each K/V tile
is loaded once for the whole group; the program then streams the request's KV
in BLOCK_N-token tiles with an online (flash-attention) softmax: first the
prefix, unmasked, then the T tree positions under the ancestor mask. The node
block is the fastest grid axis so the programs sharing one request's KV run
side by side and share it through L2.
"""

from __future__ import annotations

import math
import os

import torch

from .modes import TreeMaskMode, ancestor_bitmask_words, parse_mask_mode

try:  # the torch reference works without Triton
    import triton
    import triton.language as tl

    _jit = triton.jit
except ImportError:  # pragma: no cover - exercised only without triton
    triton = None
    tl = None

    def _jit(fn):
        return fn


SUPPORTED_MODES = (TreeMaskMode.ANCESTOR_BITMASK, TreeMaskMode.PARENT_POINTER, TreeMaskMode.QLEN_ONLY)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------- validation


def _check_inputs(q, k_cache, v_cache, block_table, context_lens, tree_mask, mode) -> TreeMaskMode:
    """Shape/dtype/device checks only (no value checks: those would sync)."""
    mode = parse_mask_mode(mode)
    if mode not in SUPPORTED_MODES:
        names = ", ".join(m.name for m in SUPPORTED_MODES)
        raise ValueError(f"tree attention supports mask modes {names}; got {mode.name}")
    for name, t, ndim in (
        ("q", q, 4),
        ("k_cache", k_cache, 4),
        ("v_cache", v_cache, 4),
        ("block_table", block_table, 2),
        ("context_lens", context_lens, 1),
    ):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}, q on {q.device}")
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q must be float16/bfloat16/float32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"k_cache/v_cache must have q's dtype {q.dtype}, got {k_cache.dtype}/{v_cache.dtype}")
    if block_table.dtype not in _INDEX_DTYPES or context_lens.dtype not in _INDEX_DTYPES:
        raise TypeError(f"block_table/context_lens must be int32 or int64, got {block_table.dtype}/{context_lens.dtype}")
    batch, nodes, hq, dim = q.shape
    if nodes < 1:
        raise ValueError("q must hold at least one node per request")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    hkv = k_cache.shape[2]
    if k_cache.shape[3] != dim:
        raise ValueError(f"head dim of q ({dim}) and of the cache ({k_cache.shape[3]}) differ")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    if block_table.shape[0] != batch or context_lens.shape[0] != batch:
        raise ValueError(
            f"block_table {tuple(block_table.shape)} / context_lens {tuple(context_lens.shape)} "
            f"must have q's batch {batch} first"
        )
    if not isinstance(tree_mask, torch.Tensor) or tree_mask.device != q.device:
        raise ValueError("tree_mask must be a tensor on q's device")
    if mode == TreeMaskMode.ANCESTOR_BITMASK:
        want, dtype = (batch, nodes, ancestor_bitmask_words(nodes)), torch.int64
    elif mode == TreeMaskMode.PARENT_POINTER:
        want, dtype = (batch, 2, nodes), torch.int16
    else:
        want, dtype = (batch * nodes * nodes,), torch.bool
    if tuple(tree_mask.shape) != want or tree_mask.dtype != dtype:
        raise ValueError(
            f"{mode.name} tree_mask must be {dtype} of shape {want}, got {tree_mask.dtype} {tuple(tree_mask.shape)}"
        )
    return mode


def _default_scale(scale, dim: int) -> float:
    return 1.0 / math.sqrt(dim) if scale is None else float(scale)


# ----------------------------------------------------------------- reference


def tree_mask_to_dense(tree_mask: torch.Tensor, mode, batch: int, nodes: int) -> torch.Tensor:
    """[B, T, T] bool, [b, i, j] iff node j is node i or an ancestor of it."""
    mode = parse_mask_mode(mode)
    device = tree_mask.device
    if mode == TreeMaskMode.QLEN_ONLY:
        return tree_mask[: batch * nodes * nodes].view(batch, nodes, nodes).clone()
    if mode == TreeMaskMode.ANCESTOR_BITMASK:
        cols = torch.arange(nodes, device=device)
        words = tree_mask[:, :, cols // 64]  # [B, T, T]: the word holding column j
        return ((words >> (cols % 64)) & 1).bool()  # arithmetic shift; & 1 keeps bit 63 right
    if mode == TreeMaskMode.PARENT_POINTER:
        parent = tree_mask[:, 0].long()
        anc = torch.eye(nodes, dtype=torch.bool, device=device).expand(batch, nodes, nodes).clone()
        cur = torch.arange(nodes, device=device).expand(batch, nodes)
        for _ in range(nodes - 1):  # no node is deeper than T - 1; a fixed count needs no sync
            cur = torch.where(cur >= 0, parent.gather(1, cur.clamp(min=0)), cur)
            anc |= torch.nn.functional.one_hot(cur.clamp(min=0), nodes).bool() & (cur >= 0)[..., None]
        return anc
    raise ValueError(f"tree attention does not support mask mode {mode.name}")


def tree_attention_reference(q, k_cache, v_cache, block_table, context_lens, tree_mask, mode, scale=None):
    """Pure-torch tree attention (see the module docstring for the layouts).

    Gathers every position the block table can address ([B, max_blocks *
    block_size]), masks to prefix + ancestor-or-self tree positions and runs a
    plain fp32 softmax. Memory grows with the block table width: a reference,
    not a kernel.
    """
    mode = _check_inputs(q, k_cache, v_cache, block_table, context_lens, tree_mask, mode)
    batch, nodes, hq, dim = q.shape
    num_blocks, block_size, hkv, _ = k_cache.shape
    group = hq // hkv
    scale = _default_scale(scale, dim)
    device = q.device

    blocks = block_table.long().clamp(0, max(num_blocks - 1, 0))  # padding entries: harmless, masked below
    k = k_cache[blocks].flatten(1, 2).float()  # [B, S, Hkv, D], S = max_blocks * block_size
    v = v_cache[blocks].flatten(1, 2).float()
    positions = torch.arange(k.shape[1], device=device)
    ctx = context_lens.long()[:, None]
    prefix = positions[None, :] < ctx  # [B, S]
    node_of_pos = positions[None, :] - ctx  # tree node stored at each position
    in_tree = (node_of_pos >= 0) & (node_of_pos < nodes)
    anc = tree_mask_to_dense(tree_mask, mode, batch, nodes)  # [B, T, T]
    tree_ok = anc.gather(2, node_of_pos.clamp(0, nodes - 1)[:, None, :].expand(batch, nodes, -1))
    allowed = prefix[:, None, :] | (tree_ok & in_tree[:, None, :])  # [B, T, S]
    # unused slots may hold anything (NaN included): zero V there so 0 * V stays 0
    v = torch.where((prefix | in_tree)[:, :, None, None], v, 0.0)

    qf = q.float().view(batch, nodes, hkv, group, dim)
    scores = torch.einsum("bthgd,bshd->bhgts", qf, k) * scale
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgts,bshd->bthgd", probs, v)
    return out.reshape(batch, nodes, hq, dim).to(q.dtype)


# -------------------------------------------------------------------- Triton


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
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    BLOCK_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """One online-softmax step over BLOCK_N paged positions."""
    block = tl.load(bt_row_ptr + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
    offset = (pos % BLOCK_SIZE).to(tl.int64)
    kv_ok = pos_ok[:, None] & dims_ok[None, :]
    k = tl.load(
        k_head_ptr + (block * stride_kb + offset * stride_ks)[:, None] + dims[None, :] * stride_kd, mask=kv_ok, other=0.0
    )
    if DOT_F32:  # fp32 inputs: no TF32, fp32 callers expect fp32 scores
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(allowed, s * qk_scale, float("-inf"))
    # m_i starts finite (-1e30), so a row with nothing allowed yet gets
    # exp2(-inf - m) = 0 rather than NaN from (-inf) - (-inf)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(
        v_head_ptr + (block * stride_vb + offset * stride_vs)[:, None] + dims[None, :] * stride_vd, mask=kv_ok, other=0.0
    )
    if DOT_F32:  # rounding p to the cache dtype first, as the native path does
        pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@_jit
def _tree_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_table_ptr,
    context_lens_ptr,
    mask_ptr,  # int64 words / int16 parents+depths / uint8 QLEN_ONLY bytes
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
):
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
    cols = tl.arange(0, BLOCK_N)

    # 1. the committed prefix: every node sees all of it
    for start in range(0, ctx, BLOCK_N):
        pos = start + cols
        pos_ok = pos < ctx
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, pos_ok[None, :], pos, pos_ok, bt_row_ptr, k_head_ptr, v_head_ptr,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, dims, dims_ok, qk_scale,
            BLOCK_SIZE, DOT_F32,
        )

    # 2. the tree: node j sits at position ctx + j, visible to i iff j is an ancestor-or-self
    safe_node = tl.where(row_ok, node, 0)
    for j0 in range(0, T, BLOCK_N):
        j = j0 + cols
        j_ok = j < T
        if MODE == 1:  # QLEN_ONLY: one byte per (i, j)
            bits = tl.load(
                mask_ptr + b * T * T + safe_node[:, None] * T + j[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0
            )
            allowed = bits != 0
        else:
            window = (j0 // 64) * 64  # the 64 columns of mask word j0 // 64
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
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, allowed, ctx + j, j_ok, bt_row_ptr, k_head_ptr, v_head_ptr,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd, dims, dims_ok, qk_scale,
            BLOCK_SIZE, DOT_F32,
        )

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i == 0 only on padding rows
    tl.store(
        out_ptr + b * stride_ob + node[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dims_ok[None, :],
    )


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _triton_usable(device: torch.device) -> bool:
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and _interpreting())


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
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
):
    """Triton tree attention; same arguments and result as the reference.

    Tuning knobs (keyword only; the defaults suit an H100/H200):
    block_m   rows of the query tile (nodes x GQA group), a power of 2 >= 16;
    block_n   KV tokens per tile: 16, 32 or 64 (must divide 64);
    num_warps, num_stages  passed to the launch.
    """
    mode = _check_inputs(q, k_cache, v_cache, block_table, context_lens, tree_mask, mode)
    if not _triton_usable(q.device):
        raise RuntimeError(
            f"tree_attention_triton needs CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 "
            f"(device={q.device}, triton importable={triton is not None})"
        )
    batch, nodes, hq, dim = q.shape
    _, block_size, hkv, _ = k_cache.shape
    group = hq // hkv
    out = torch.empty(batch, nodes, hq, dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out

    if block_m is None:
        # one tile row per (node, head); up to 64 rows keeps the fp32 accumulator in registers at D=128
        block_m = min(64, triton.next_power_of_2(nodes * group))
    block_m = max(16, block_m, triton.next_power_of_2(group))  # tl.dot needs >= 16 rows; a group never splits
    if block_n is None:
        block_n = 64 if q.is_cuda else 32
    if block_n not in (16, 32, 64):
        raise ValueError(f"block_n must be 16, 32 or 64, got {block_n}")
    nodes_per_program = block_m // group

    if mode == TreeMaskMode.QLEN_ONLY:
        mask = tree_mask.view(torch.uint8)  # same bytes; Triton loads bytes, not i1
    else:
        mask = tree_mask.contiguous()
    launch = {}
    if num_warps is not None:
        launch["num_warps"] = num_warps
    if num_stages is not None:
        launch["num_stages"] = num_stages
    grid = (triton.cdiv(nodes, nodes_per_program), hkv, batch)
    _tree_attention_kernel[grid](
        q, k_cache, v_cache, out, block_table, context_lens, mask,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
        block_table.stride(0),
        _default_scale(scale, dim) * math.log2(math.e),
        T=nodes,
        GROUP=group,
        HEAD_DIM=dim,
        BLOCK_SIZE=block_size,
        MODE=int(mode),
        WORDS=ancestor_bitmask_words(nodes),
        NODES=nodes_per_program,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(dim)),
        # fp32 inputs get IEEE fp32 dots; so do bf16 ones under TRITON_INTERPRET,
        # whose tl.dot multiplies bf16's raw uint16 storage as integers (Triton 3.9)
        DOT_F32=q.dtype == torch.float32 or (q.dtype == torch.bfloat16 and _interpreting()),
        **launch,
    )
    return out


# ---------------------------------------------------------------- dispatcher


def tree_attention(q, k_cache, v_cache, block_table, context_lens, tree_mask, mode, scale=None, *, impl: str = "auto"):
    """Tree attention; ``impl`` is "torch" (reference), "triton" or "auto"
    (Triton on CUDA when importable, the reference otherwise)."""
    if impl == "auto":
        impl = "triton" if q.device.type == "cuda" and triton is not None else "torch"
    if impl == "torch":
        return tree_attention_reference(q, k_cache, v_cache, block_table, context_lens, tree_mask, mode, scale)
    if impl == "triton":
        return tree_attention_triton(q, k_cache, v_cache, block_table, context_lens, tree_mask, mode, scale)
    raise ValueError(f"impl must be 'auto', 'torch' or 'triton', got {impl!r}")


# ----------------------------------------------------------------- benchmark


def _random_parents(batch: int, nodes: int, generator: torch.Generator) -> torch.Tensor:
    """[B, T] int64 parents of random trees whose parent precedes its child."""
    parent = torch.full((batch, nodes), -1, dtype=torch.int64)
    for i in range(1, nodes):
        parent[:, i] = torch.randint(0, i, (batch,), generator=generator)
    return parent


def _mask_from_parents(parent: torch.Tensor, mode) -> torch.Tensor:
    """Tree mask in ``mode``'s layout from [B, T] parents (via the reference build)."""
    from .reference import ancestor_matrix, encode_mask

    batch, nodes = parent.shape
    anc, depth, _ = ancestor_matrix(parent, nodes - 1)
    seq_lens = torch.zeros(batch, dtype=torch.int64, device=parent.device)
    return encode_mask(anc, parent, depth, seq_lens, parse_mask_mode(mode), 0, False, None)


def bench_tree_attention(
    batches=(1, 8, 64),
    tree_sizes=(1, 8, 16, 32, 64),
    *,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    context_len: int = 2048,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    mode="ANCESTOR_BITMASK",
    warmup: int = 5,
    iters: int = 20,
    flush_l2: bool = True,
    check: bool = True,
    device: str = "cuda",
    seed: int = 0,
) -> list[dict]:
    """Time the Triton kernel on a Llama-3-8B-shaped attention layer.

    For every batch size and tree size T (T = 1 is plain one-token decode
    through the same kernel) returns a dict: batch, nodes, mode, time_us
    (median over ``iters`` CUDA-event timings, L2 flushed before each when
    ``flush_l2`` so a small batch's KV is not served from cache), kv_gbps
    (K+V bytes read / time), ratio_vs_t1 (time / time at T=1, same batch;
    None without a T=1 run) and, with ``check``, max_abs_err against the
    torch reference. Trees are random (seeded); block tables random
    permutations, so no request's blocks are contiguous.
    """
    gen = torch.Generator().manual_seed(seed)
    dev_gen = torch.Generator(device=device).manual_seed(seed)
    mode = parse_mask_mode(mode)
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=device) if flush_l2 else None
    results = []
    for batch in batches:
        max_nodes = max(tree_sizes)
        blocks_per_req = triton.cdiv(context_len + max_nodes, block_size)
        num_blocks = batch * blocks_per_req
        cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k_cache = torch.randn(cache_shape, generator=dev_gen, device=device, dtype=dtype)  # made on the GPU: fast
        v_cache = torch.randn(cache_shape, generator=dev_gen, device=device, dtype=dtype)
        block_table = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_req).to(device, torch.int32)
        context_lens = torch.full((batch,), context_len, dtype=torch.int32, device=device)
        per_batch = []
        for nodes in tree_sizes:
            q = torch.randn(batch, nodes, num_q_heads, head_dim, generator=gen).to(device, dtype)
            mask = _mask_from_parents(_random_parents(batch, nodes, gen).to(device), mode)
            args = (q, k_cache, v_cache, block_table, context_lens, mask, mode)
            out = tree_attention_triton(*args)
            for _ in range(warmup):
                tree_attention_triton(*args)
            times = []
            for _ in range(iters):
                if flush is not None:
                    flush.zero_()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                tree_attention_triton(*args)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1000.0)
            time_us = sorted(times)[len(times) // 2]
            kv_bytes = 2 * batch * (context_len + nodes) * num_kv_heads * head_dim * k_cache.element_size()
            row = {
                "batch": batch,
                "nodes": nodes,
                "mode": mode.name,
                "time_us": time_us,
                "kv_gbps": kv_bytes / (time_us * 1e-6) / 1e9,
            }
            if check:
                ref = tree_attention_reference(*args)
                row["max_abs_err"] = (out.float() - ref.float()).abs().max().item()
            per_batch.append(row)
        base = next((r["time_us"] for r in per_batch if r["nodes"] == 1), None)
        for row in per_batch:
            row["ratio_vs_t1"] = row["time_us"] / base if base else None
        results.extend(per_batch)
        del k_cache, v_cache
    return results


if __name__ == "__main__":  # python -m spec_tree_kernels.attention (needs a GPU)
    for r in bench_tree_attention():
        print(r)
