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
                 request uses are never read by the Triton kernels (the torch
                 reference reads them clamped and masks them out).
    context_lens [B] int32 (or int64): committed prefix length of each request;
                 the block table must cover context_len + T positions.
    tree_mask    per ``mode``:
                 ANCESTOR_BITMASK [B, T, ceil(T/64)] int64, bit j%64 of word
                     j//64 of row i set iff node j is i or an ancestor of i;
                 PARENT_POINTER   [B, 2, T] int16: parent (-1 root), depth;
                 QLEN_ONLY        flat bool [B*T*T], row i column j.
    scale        softmax scale, default 1/sqrt(D).
    window       keyword, int W >= 1 or None: a sliding window on logical
                 positions (committed token j at j, tree node m at
                 context_len + depth(m)): node i sees keys at p - W < k <= p,
                 p = context_len + depth(i) (vLLM / FlashAttention's rule).
    sinks        keyword, float32 [Hq] or None: per-head sink logits (gpt-oss),
                 in the softmax denominator only.
    soft_cap     keyword, float > 0 or None: s = cap * tanh(s / cap) (Gemma 2).
    alibi_slopes keyword, float32 [Hq] or None: s += slope * (k - p).
                 (``attention_reference`` gives the exact semantics;
                 ``features_from_vllm`` maps a vLLM layer impl's fields.)
    returns      [B, T, Hq, D] in q's dtype (contiguous).

Softmax and accumulation run in fp32. Neither implementation reads a device
value on the host, and the Triton launches are fixed by shapes alone, so the
call is CUDA-graph capturable.

Modules: ``attention_reference`` (validation, the torch reference),
``attention_triton`` (the kernels and their launch plan), ``attention_plan``
(``TreeAttentionPlan``: the step's host work once, then one run per layer; what
the engine adapters call). This module is the one-call public face. The GPU
benchmark and sweep are the repository's harness,
``spec_plugins.kernel_bench.attention`` (not in the wheel).

Triton kernels (``attention_triton`` documents them): the GQA group's Hq/Hkv
query heads of a block of nodes are stacked into the rows of one
[BLOCK_M, D] query tile (row r = node r // G, head r % G) so each K/V tile is
loaded once for the whole group, and KV streams in BLOCK_N-token tiles with an
online (flash-attention) softmax in base 2: the prefix unmasked, the T tree
positions under the ancestor mask. By shape, either

* single pass: one program per (node block, KV head, request) walks the
  whole context (large batch: the grid already fills the GPU), or
* split KV (flash-decoding): the prefix is cut into S chunks per request,
  one program per (node block, chunk or tree part, KV head, request) writes
  a partial softmax state (o, log-sum-exp) to an fp32 workspace, and a merge
  kernel combines them (small batch: S is chosen from shapes so the grid
  fills the GPU; ``plan_tree_attention`` gives the rule).
"""

from __future__ import annotations

from .attention_reference import (  # noqa: F401  (re-exported)
    SUPPORTED_MODES,
    AttentionFeatures,
    _check_inputs,
    _default_scale,
    check_features,
    features_from_vllm,
    node_depths,
    tree_attention_reference,
    tree_mask_to_dense,
)
from .attention_triton import (  # noqa: F401  (re-exported)
    AttentionPlan,
    _triton_usable,
    plan_tree_attention,
    tree_attention_triton,
    triton,
)
from .api import resolve_impl
from .kv_layout import refuse_tiled


def tree_attention(q, k_cache, v_cache, block_table, context_lens, tree_mask, mode, scale=None, *, impl: str = "auto",
                   window: int | None = None, sinks=None, soft_cap: float | None = None, alibi_slopes=None):
    """Tree attention; ``impl`` is "torch" (reference), "triton", "cpu" (the
    host C kernel, once built) or "auto", chosen by ``api.resolve_impl`` like
    every op (``SPEC_TREE_KERNELS_IMPL`` honoured; auto: Triton on CUDA when
    importable, the host kernel on CPU when built, the reference otherwise).
    The Triton path picks its kernel (single pass or split KV) by shape.
    window / sinks / soft_cap / alibi_slopes: the layer's features (module
    docstring), every implementation."""
    features = dict(window=window, sinks=sinks, soft_cap=soft_cap, alibi_slopes=alibi_slopes)
    which = resolve_impl("attention", impl, q.device)
    if which == "triton":
        refuse_tiled("Triton", k_cache=k_cache, v_cache=v_cache)
        return tree_attention_triton(q, k_cache, v_cache, block_table, context_lens, tree_mask, mode, scale,
                                     **features)
    if which == "cpu":
        from .attention_plan import TreeAttentionPlan

        plan = TreeAttentionPlan.create(block_table, context_lens, tree_mask, mode, q.shape[1], k_cache.shape[1],
                                        impl="cpu")
        return plan.run(q, k_cache, v_cache, scale, **features)
    return tree_attention_reference(q, k_cache, v_cache, block_table, context_lens, tree_mask, mode, scale, **features)
