"""CPU attention for tree mode (vLLM-CPU): CPU_ATTN with tree rows and draft steps.

CPU only: imports vLLM's CPU attention backend. ``TreeCPUWorker`` installs it
(``install_cpu_override``) before the model is built.
"""

from __future__ import annotations

import functools

import torch

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from .attention import TreeRowsMixin, forget_resolved_backends


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


class TreeCPUAttentionImpl(TreeRowsMixin, CPUAttentionBackendImpl):
    tree_impl = "auto"  # the host C kernel (built at worker startup), torch where it did not build

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
    forget_resolved_backends()
