"""Tree attention: input validation and the pure-torch reference.

``attention.py`` documents the operation, the shapes, dtypes and layouts;
``attention_triton.py`` holds the Triton kernels. Both implementations share
``_check_inputs`` (shape/dtype/device checks only, never a host sync).

Per-layer attention features (issue #39: gpt-oss, Gemma 2/3, ALiBi models),
checked by ``check_features`` and honoured by every implementation (the
reference here, the torch / host-kernel / Triton paths of ``attention_plan``,
``tree_attention_triton``, and the draft-step attention of
``branch_attention`` / ``cpu_attention.run_branch``)::

    window        int W >= 1 or None: a query at position p sees a key at
                  position k only if p - W < k <= p (vLLM / FlashAttention's
                  sliding window: window_size_left = W - 1, right = 0)
    sinks         float32 [Hq] or None: per query head a logit that joins the
                  softmax denominator only (no value; gpt-oss): out =
                  sum_k e^(s_k) v_k / (sum_k e^(s_k) + e^(sink_h)); not scaled,
                  capped or biased
    soft_cap      float > 0 or None: s = soft_cap * tanh(s / soft_cap) on the
                  scaled score (Gemma 2), before ALiBi and masking
    alibi_slopes  float32 [Hq] or None: s += slope_h * (k - p) (vLLM's ALiBi:
                  the key's position minus the query's, <= 0 for what is seen)

Score order, as vLLM's CPU attention (csrc/cpu/cpu_attn_impl.hpp: QK * scale,
apply_softcap, apply_alibi_slopes, apply_mask, softmax with the sink as the
running max / sum's initial state): scale, cap, ALiBi, mask, softmax + sink.

Positions are logical, not cache slots: committed token j is at position j;
tree node m (stored in slot context_len + m) is at position context_len +
depth(m), depth(root) = 0. So node i sees committed j iff j > context_len +
depth(i) - W, and ancestor-or-self m iff depth(i) - depth(m) < W. ``features_from_vllm``
maps a vLLM attention impl's fields onto these arguments.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .kv_layout import TiledKV
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
    device = q.device if isinstance(q, torch.Tensor) else None
    _check_tensor("q", q, 4, device)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):  # a plain view or a TiledKV (kv_layout)
        _check_tensor(name, t, 4, device, kinds=(torch.Tensor, TiledKV))
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


def _check_tensor(name: str, t, ndim: int, device, kinds: tuple = (torch.Tensor,)) -> None:
    if not isinstance(t, kinds):
        names = " or ".join("torch.Tensor" if k is torch.Tensor else k.__name__ for k in kinds)
        raise TypeError(f"{name} must be a {names}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, q on {device}")


def _default_scale(scale, dim: int) -> float:
    return 1.0 / math.sqrt(dim) if scale is None else float(scale)


# ------------------------------------------------------------------ features


@dataclass(frozen=True, eq=False)
class AttentionFeatures:
    """One layer's window / sinks / soft-cap / ALiBi, checked (``check_features``;
    the module docstring gives the semantics). ``NO_FEATURES``: none of them."""

    window: int | None = None
    sinks: torch.Tensor | None = None
    soft_cap: float | None = None
    alibi_slopes: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return not (self.window is None and self.sinks is None and self.soft_cap is None
                    and self.alibi_slopes is None)

    @property
    def needs_positions(self) -> bool:
        """The tree nodes' depths are read (window or ALiBi)."""
        return self.window is not None or self.alibi_slopes is not None


NO_FEATURES = AttentionFeatures()


def check_features(window=None, sinks=None, soft_cap=None, alibi_slopes=None, *, num_q_heads: int,
                   device) -> AttentionFeatures:
    """Validate a layer's features (host-only checks: shapes, dtypes, values of
    host numbers; never a device read). Raises naming the bad value."""
    if window is None and sinks is None and soft_cap is None and alibi_slopes is None:
        return NO_FEATURES
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, numbers.Integral):
            raise TypeError(f"window must be an int >= 1 or None, got {window!r}")
        if window < 1:
            raise ValueError(f"window must be >= 1 (None for no window; vLLM's None / -1 mean none: "
                             f"features_from_vllm maps them), got window={int(window)}")
        window = int(window)
    if soft_cap is not None:
        if isinstance(soft_cap, bool) or not isinstance(soft_cap, numbers.Real):
            raise TypeError(f"soft_cap must be a float > 0 or None, got {soft_cap!r}")
        if not (math.isfinite(soft_cap) and soft_cap > 0):
            raise ValueError(f"soft_cap must be a finite float > 0 (None for no cap; vLLM's 0 means none), "
                             f"got soft_cap={soft_cap}")
        soft_cap = float(soft_cap)
    for name, t in (("sinks", sinks), ("alibi_slopes", alibi_slopes)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a float32 torch.Tensor [{num_q_heads}] or None, got {type(t).__name__}")
        if t.dtype != torch.float32 or tuple(t.shape) != (num_q_heads,):
            raise ValueError(f"{name} must be float32 of shape [{num_q_heads}] (one per query head), got "
                             f"{t.dtype} {tuple(t.shape)}")
        if t.device != torch.device(device):
            raise ValueError(f"{name} is on {t.device}, the queries on {device}")
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
    return AttentionFeatures(window, sinks, soft_cap, alibi_slopes)


def features_from_vllm(sliding_window=None, sinks=None, logits_soft_cap=None, alibi_slopes=None, *,
                       device=None) -> dict:
    """The keyword arguments (``window``, ``sinks``, ``soft_cap``,
    ``alibi_slopes``) of a vLLM attention layer, from what its impl holds:

    sliding_window   the int W the impl was built with, None or -1 for none;
                     or the (left, right) pair FlashAttentionImpl stores:
                     (-1, -1) none, (W - 1, 0) a causal window of W
    sinks            the layer's sinks tensor [Hq] (any float dtype: a float32
                     contiguous copy on ``device`` is made when it is not one;
                     call this after the weights are loaded, and once per
                     layer, not per step)
    logits_soft_cap  float, None or 0 for none
    alibi_slopes     list / tensor of Hq slopes, or None (float32 on ``device``)
    """
    window = sliding_window
    if isinstance(window, (tuple, list)):
        if len(window) != 2:
            raise ValueError(f"sliding_window pair must be (left, right), got {sliding_window!r}")
        left, right = (int(x) for x in window)
        if (left, right) == (-1, -1):
            window = None
        elif right == 0 and left >= 0:
            window = left + 1
        else:
            raise ValueError(f"sliding_window {sliding_window!r} is not causal (right must be 0): tree "
                             f"attention serves causal decoder layers only")
    elif window is not None and int(window) == -1:
        window = None
    cap = None if logits_soft_cap is None or float(logits_soft_cap) == 0.0 else float(logits_soft_cap)

    def as_f32(t):
        if t is None:
            return None
        t = torch.as_tensor(t)
        return t.to(device=device if device is not None else t.device, dtype=torch.float32).contiguous()

    return dict(window=window, sinks=as_f32(sinks), soft_cap=cap, alibi_slopes=as_f32(alibi_slopes))


def node_depths(tree_mask: torch.Tensor, mode, batch: int, nodes: int) -> torch.Tensor:
    """[B, T] int32 depth of each tree node (root 0): PARENT_POINTER's depth
    row, else the ancestor-or-self count minus one. Device ops only (no sync)."""
    mode = parse_mask_mode(mode)
    if mode == TreeMaskMode.PARENT_POINTER:
        return tree_mask[:, 1].to(torch.int32).contiguous()
    if mode == TreeMaskMode.QLEN_ONLY and tree_mask.dtype != torch.bool:
        tree_mask = tree_mask.view(torch.bool)  # the kernels' uint8 view of the same bytes
    return (tree_mask_to_dense(tree_mask, mode, batch, nodes).sum(-1) - 1).to(torch.int32)


def token_positions(context_lens: torch.Tensor, depths: torch.Tensor, num_positions: int):
    """(key_pos [B, S], query_pos [B, T]) int64 logical positions: slot s < ctx
    holds committed token s, slot ctx + m tree node m at ctx + depth(m) (slots
    past the tree keep s: nothing sees them); node t queries from ctx + depth(t)."""
    nodes = depths.shape[1]
    ctx = context_lens.long()[:, None]
    slots = torch.arange(num_positions, device=context_lens.device)[None, :]
    node = slots - ctx
    in_tree = (node >= 0) & (node < nodes)
    tree_pos = ctx + depths.long().gather(1, node.clamp(0, nodes - 1))
    return torch.where(in_tree, tree_pos, slots.expand(ctx.shape[0], -1)), ctx + depths.long()


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim with an extra logit ``sinks`` (broadcast to
    scores[..., :1]) in the denominator only; plain softmax when None."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    m = torch.maximum(scores.amax(-1, keepdim=True), sinks)
    e = torch.exp(scores - m)
    return e / (e.sum(-1, keepdim=True) + torch.exp(sinks - m))


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


def tree_attention_reference(q, k_cache, v_cache, block_table, context_lens, tree_mask, mode, scale=None, *,
                             window=None, sinks=None, soft_cap=None, alibi_slopes=None):
    """Pure-torch tree attention (see the module docstring for the layouts and
    the features window / sinks / soft_cap / alibi_slopes).

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
    features = check_features(window, sinks, soft_cap, alibi_slopes, num_q_heads=hq, device=q.device)
    blocks = block_table.long().clamp(0, max(num_blocks - 1, 0))  # padding entries: harmless, masked below
    k = k_cache[blocks].flatten(1, 2).float()  # [B, S, Hkv, D], S = max_blocks * block_size
    v = v_cache[blocks].flatten(1, 2).float()
    allowed, owned = visible_positions(context_lens, tree_mask, mode, nodes, k.shape[1])  # [B, T, S], [B, S]
    # unused slots may hold anything (NaN included): zero V there so 0 * V stays 0
    v = torch.where(owned[:, :, None, None], v, 0.0)

    rel = None
    if features.needs_positions:
        key_pos, query_pos = token_positions(context_lens, node_depths(tree_mask, mode, batch, nodes), k.shape[1])
        rel = key_pos[:, None, :] - query_pos[:, :, None]  # [B, T, S]: k - p
        if features.window is not None:
            allowed = allowed & (rel > -features.window)

    qf = q.float().view(batch, nodes, hkv, group, dim)
    scores = torch.einsum("bthgd,bshd->bhgts", qf, k) * scale
    if features.soft_cap is not None:
        scores = features.soft_cap * torch.tanh(scores / features.soft_cap)
    if features.alibi_slopes is not None:
        scores = scores + features.alibi_slopes.view(1, hkv, group, 1, 1) * rel[:, None, None].float()
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    sink = None if features.sinks is None else features.sinks.view(1, hkv, group, 1, 1)
    probs = softmax_with_sinks(scores, sink)
    out = torch.einsum("bhgts,bshd->bthgd", probs, v)
    return out.reshape(batch, nodes, hq, dim).to(q.dtype)
