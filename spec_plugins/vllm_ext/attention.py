"""Tree attention for vLLM's verify rows.

The runner publishes the step's trees (``publish_verify_trees``) before the
target forward and withdraws them after; while published, every decoder
attention layer first runs vLLM's own kernel over the whole batch (which also
leaves prefill and plain decode rows exactly as vLLM computes them), then
recomputes the rows of each tree request with
``spec_tree_kernels.tree_attention`` over the same paged KV cache, with the
compact tree mask, and overwrites them.

* CPU: ``TreeCPUAttentionBackend`` takes CPU_ATTN's place (the CPU platform
  ignores ``--attention-backend`` and always asks for CPU_ATTN's path, so the
  override of that path is the only way in). Tree rows use the torch reference.
* GPU (vLLM 0.33, written against its source, not executed here):
  ``TreeFlashAttentionBackend`` registered as CUSTOM; tree rows use the Triton
  kernel of ``spec_tree_kernels``.

KV views handed to the kernel are [num_blocks, block_size, Hkv, D]:
CPU cache [num_blocks, Hkv, block_size, 2 * D] holds per block and head
block_size K rows then block_size V rows; FlashAttention's (0.32/0.33) has the
same shape but K | V halves on the last dim.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

import spec_tree_kernels as stk


@dataclass
class VerifyTrees:
    """The step's tree requests, grouped by node count.

    groups: node count T -> (req_indices [B_T] int64 rows of the batch,
    query_starts [B_T] int64 first query token, context_lens [B_T] int64,
    tree_mask in ``mode``'s layout for B_T trees of T nodes).
    """

    mode: str
    groups: dict


_published: VerifyTrees | None = None


def publish_verify_trees(trees: VerifyTrees | None) -> None:
    global _published
    _published = trees


def published_verify_trees() -> VerifyTrees | None:
    return _published


def cpu_kv_views(kv_cache: torch.Tensor, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM CPU cache [num_blocks, Hkv, block_size, 2D] -> K, V [num_blocks, block_size, Hkv, D] views.

    Per block and head the cache holds block_size * D elements of K then the
    same of V. V is row-major [block_size, D]; K's order inside its region
    belongs to the C++ kernel and depends on ``isa`` (fp32 "vec": transposed
    [D, block_size]), so it is probed once (``_cpu_key_strides``).
    """
    num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
    head_size = two_d // 2
    s_block, s_head = kv_cache.stride(0), kv_cache.stride(1)
    s_tok, s_dim = _cpu_key_strides(isa, kv_cache.dtype, block_size, head_size)
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    k = kv_cache.as_strided(shape, (s_block, s_tok, s_head, s_dim), kv_cache.storage_offset())
    v = kv_cache.as_strided(shape, (s_block, head_size, s_head, 1), kv_cache.storage_offset() + block_size * head_size)
    return k, v


@functools.lru_cache(maxsize=None)
def _cpu_key_strides(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> tuple[int, int]:
    """(token stride, dim stride) of K inside one block/head region of the CPU cache.

    Writes probe keys through vLLM's own ``cpu_attn_reshape_and_cache`` and
    reads back where each (token, dim) landed, one base-16 digit at a time
    (values 1..16 are exact in fp16/bf16). Raises if the layout is not a plain
    strided one (then tree rows cannot address K by token)."""
    from vllm import _custom_ops as ops

    cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
    kv = cache.view(1, 1, 2 * block_size, head_size)
    key_cache, value_cache = kv[:, :, :block_size], kv[:, :, block_size:]
    tok = torch.arange(block_size)[:, None].expand(block_size, head_size)
    dim = torch.arange(head_size)[None, :].expand(block_size, head_size)
    slots = torch.arange(block_size)
    region = cache.view(-1)[: block_size * head_size]
    decoded = {"tok": torch.zeros(block_size * head_size, dtype=torch.int64),
               "dim": torch.zeros(block_size * head_size, dtype=torch.int64)}
    for name, value in (("tok", tok), ("dim", dim)):
        for digit in range(3):
            probe = ((value // 16**digit) % 16 + 1).to(dtype)[:, None, :]  # [tokens, 1 head, D]
            cache.zero_()
            ops.cpu_attn_reshape_and_cache(probe, torch.zeros_like(probe), key_cache, value_cache, slots, isa,
                                           k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
            decoded[name] += (region.float().round().long() - 1) * 16**digit
    loc = torch.empty(block_size, head_size, dtype=torch.int64)
    loc[decoded["tok"], decoded["dim"]] = torch.arange(block_size * head_size)
    s_tok = int(loc[1, 0] - loc[0, 0]) if block_size > 1 else 1
    s_dim = int(loc[0, 1] - loc[0, 0]) if head_size > 1 else 1
    if not torch.equal(loc, loc[0, 0] + tok * s_tok + dim * s_dim) or int(loc[0, 0]) != 0:
        raise RuntimeError(f"spec-plugins: vLLM's CPU attention (isa={isa}, {dtype}) stores K in a tiled layout "
                           "the tree runner cannot address by token; use --dtype float32 on this CPU")
    return s_tok, s_dim


def flash_kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention cache [num_blocks, Hkv, block_size, 2D] read as K | V on the
    last dim (flash_attn.py: ``kv_cache.transpose(1, 2).split(head_size, -1)``)."""
    kv = kv_cache.transpose(1, 2)
    head_size = kv.shape[-1] // 2
    return kv[..., :head_size], kv[..., head_size:]


def overwrite_tree_rows(query, output, k_view, v_view, block_table, num_heads: int, head_size: int,
                        scale: float, impl: str) -> None:
    """Recompute the published trees' rows of ``output`` ([N, Hq*D] or [N, Hq, D])."""
    trees = _published
    if trees is None:
        return
    out = output.view(output.shape[0], num_heads, head_size)
    q_all = query.view(query.shape[0], num_heads, head_size)
    for nodes, (req_idx, q_starts, ctx, mask) in trees.groups.items():
        rows = q_starts[:, None] + torch.arange(nodes, device=q_starts.device)  # [B_T, T]
        q = q_all[rows]  # [B_T, T, Hq, D]
        tables = block_table[req_idx]
        if impl == "torch":  # the reference gathers every block a row addresses: pass only the used ones
            used = (int(ctx.max()) + nodes + k_view.shape[1] - 1) // k_view.shape[1]
            tables = tables[:, :used]
        res = stk.tree_attention(q, k_view, v_view, tables, ctx, mask, trees.mode, scale=scale, impl=impl)
        out[rows.flatten()] = res.reshape(-1, num_heads, head_size).to(out.dtype)


# ------------------------------------------------------------------------ CPU

class TreeRowsMixin:
    """Put before an engine attention impl: its kernel over the batch, then the
    published trees' rows recomputed (``overwrite_tree_rows``)."""

    tree_impl = "torch"  # spec_tree_kernels.tree_attention implementation

    def kv_views(self, layer, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)
        if attn_metadata is None or _published is None or self.attn_type != AttentionType.DECODER:
            return output
        k_view, v_view = self.kv_views(layer, kv_cache)
        overwrite_tree_rows(query, output, k_view, v_view, attn_metadata.block_table, self.num_heads,
                            self.head_size, self.scale, impl=self.tree_impl)
        return output


class TreeCPUAttentionImpl(TreeRowsMixin, CPUAttentionBackendImpl):
    def kv_views(self, layer, kv_cache):
        return cpu_kv_views(kv_cache, layer.isa)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    """CPU_ATTN with tree rows (``get_name`` stays "CPU_ATTN": vLLM keys on it)."""

    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl


def install_cpu_override() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, f"{__name__}.TreeCPUAttentionBackend")
    _forget_resolved_backends()


# ------------------------------------------------------------------------ GPU


def install_gpu_backend() -> None:
    """Register ``TreeFlashAttentionBackend`` as vLLM's CUSTOM backend (GPU only)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, "spec_plugins.vllm_ext.attention_gpu.TreeFlashAttentionBackend")
    _forget_resolved_backends()


def _forget_resolved_backends() -> None:
    # vLLM memoizes backend classes per process (selector._cached_get_attn_backend):
    # an engine built earlier in this process would otherwise hand us its class.
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()


TREE_IMPL_NAMES = ("TreeCPUAttentionImpl", "TreeFlashAttentionImpl")


def check_tree_attention_installed(static_forward_context: dict, layer_names) -> None:
    """Fail at startup if a target attention layer did not get a tree-aware impl."""
    for name in layer_names:
        impl = getattr(static_forward_context.get(name), "impl", None)
        if type(impl).__name__ not in TREE_IMPL_NAMES:
            raise RuntimeError(f"spec-plugins: attention layer {name} uses {type(impl).__name__}, not a tree-aware "
                               "backend: tree verification would be wrong")
