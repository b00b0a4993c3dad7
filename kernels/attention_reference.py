"""Tree attention: input validation and the pure-torch reference.

``attention.py`` documents the operation, the shapes, dtypes and layouts;
``attention_triton.py`` holds the Triton kernels. Both implementations share
``_check_inputs`` (shape/dtype/device checks only, never a host sync).
"""

from __future__ import annotations

import math

import torch

from .modes import MODES, TREE_ATTENTION_MODES, TreeMaskMode, mask_dtype, parse_mask_mode

SUPPORTED_MODES = TREE_ATTENTION_MODES  # the table in ``modes``
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------- validation


def _check_inputs(q, k_cache, v_cache, block_table, context_lens, tree_mask, mode) -> TreeMaskMode:
    """Shape/dtype/device checks only (no value checks: those would sync)."""
    _check_layer_inputs(q, k_cache, v_cache)
    return _check_step_inputs(block_table, context_lens, tree_mask, mode, q.shape[0], q.shape[1], q.device)


def _check_step_inputs(block_table, context_lens, tree_mask, mode, batch: int, nodes: int, device) -> TreeMaskMode:
    """The inputs every layer of a verify step shares: block table, context
    lengths, tree mask (checked once per step by ``TreeAttentionPlan``)."""
    mode = parse_mask_mode(mode)
    if mode not in SUPPORTED_MODES:
        names = ", ".join(m.name for m in SUPPORTED_MODES)
        raise ValueError(f"tree attention supports mask modes {names}; got {mode.name}")
    for name, t, ndim in (("block_table", block_table, 2), ("context_lens", context_lens, 1)):
        _check_tensor(name, t, ndim, device)
    if block_table.dtype not in _INDEX_DTYPES or context_lens.dtype not in _INDEX_DTYPES:
        raise TypeError(f"block_table/context_lens must be int32 or int64, got {block_table.dtype}/{context_lens.dtype}")
    if nodes < 1:
        raise ValueError("q must hold at least one node per request")
    if block_table.shape[0] != batch or context_lens.shape[0] != batch:
        raise ValueError(
            f"block_table {tuple(block_table.shape)} / context_lens {tuple(context_lens.shape)} "
            f"must have q's batch {batch} first"
        )
    if not isinstance(tree_mask, torch.Tensor) or tree_mask.device != device:
        raise ValueError("tree_mask must be a tensor on q's device")
    want, dtype = MODES[mode].shape(batch, nodes, 0), mask_dtype(mode, nodes)
    if tuple(tree_mask.shape) != want or tree_mask.dtype != dtype:
        raise ValueError(
            f"{mode.name} tree_mask must be {dtype} of shape {want}, got {tree_mask.dtype} {tuple(tree_mask.shape)}"
        )
    return mode


def _check_layer_inputs(q, k_cache, v_cache) -> None:
    """The per-layer inputs: queries and the layer's K/V cache views."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_tensor(name, t, 4, q.device if isinstance(q, torch.Tensor) else None)
    if q.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"q must be float16/bfloat16/float32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"k_cache/v_cache must have q's dtype {q.dtype}, got {k_cache.dtype}/{v_cache.dtype}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    hq, dim, hkv = q.shape[2], q.shape[3], k_cache.shape[2]
    if k_cache.shape[3] != dim:
        raise ValueError(f"head dim of q ({dim}) and of the cache ({k_cache.shape[3]}) differ")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")


def _check_tensor(name: str, t, ndim: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}")


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


def visible_positions(context_lens: torch.Tensor, tree_mask: torch.Tensor, mode, nodes: int, num_positions: int):
    """Which of a request's first ``num_positions`` token positions each node sees.

    Returns (allowed [B, T, S] bool: node t may attend position s, i.e. s is
    in the committed prefix or holds node t or one of its ancestors;
    owned [B, S] bool: s holds a committed token or a tree node). The one
    masking rule of the torch paths (this reference and ``attention_plan``)."""
    batch = context_lens.shape[0]
    positions = torch.arange(num_positions, device=context_lens.device)
    ctx = context_lens.long()[:, None]
    prefix = positions[None, :] < ctx  # [B, S]
    node_of_pos = positions[None, :] - ctx  # tree node stored at each position
    in_tree = (node_of_pos >= 0) & (node_of_pos < nodes)
    anc = tree_mask_to_dense(tree_mask, mode, batch, nodes)  # [B, T, T] ancestor-or-self
    tree_ok = anc.gather(2, node_of_pos.clamp(0, nodes - 1)[:, None, :].expand(batch, nodes, -1))
    return prefix[:, None, :] | (tree_ok & in_tree[:, None, :]), prefix | in_tree


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
    blocks = block_table.long().clamp(0, max(num_blocks - 1, 0))  # padding entries: harmless, masked below
    k = k_cache[blocks].flatten(1, 2).float()  # [B, S, Hkv, D], S = max_blocks * block_size
    v = v_cache[blocks].flatten(1, 2).float()
    allowed, owned = visible_positions(context_lens, tree_mask, mode, nodes, k.shape[1])  # [B, T, S], [B, S]
    # unused slots may hold anything (NaN included): zero V there so 0 * V stays 0
    v = torch.where(owned[:, :, None, None], v, 0.0)

    qf = q.float().view(batch, nodes, hkv, group, dim)
    scores = torch.einsum("bthgd,bshd->bhgts", qf, k) * scale
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhgts,bshd->bthgd", probs, v)
    return out.reshape(batch, nodes, hq, dim).to(q.dtype)
