"""CPU attention for tree mode (vLLM-CPU): CPU_ATTN with tree rows and draft steps.

CPU only: imports vLLM's CPU attention backend. ``TreeCPUWorker`` installs it
(``install_cpu_override``) before the model is built.
"""

from __future__ import annotations

import functools

import torch

from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from spec_tree_kernels.kv_layout import paged_view

from .attention import TreeRowsMixin, forget_resolved_backends


def cpu_kv_views(kv_cache: torch.Tensor, isa: str):
    """vLLM CPU cache [num_blocks, Hkv, block_size, 2D] -> K, V [num_blocks, block_size, Hkv, D] views.

    Per block and head the cache holds block_size * D elements of K then the
    same of V. The order inside each region belongs to the C++ kernel and
    depends on ``isa`` (fp32 "vec": K transposed [D, block_size], V
    row-major; bf16 "amx": both in tiles, ``spec_tree_kernels.kv_layout``), so
    it is probed once (``_cpu_kv_tiles``). A strided order gives plain
    tensor views; a tiled one ``TiledKV`` views, which the torch paths of the
    tree rows, the draft steps and the KV move read and write.
    """
    num_blocks, num_kv_heads, block_size, two_d = kv_cache.shape
    head_size = two_d // 2
    s_block, s_head = kv_cache.stride(0), kv_cache.stride(1)
    k_tiles, v_tiles = _cpu_kv_tiles(isa, kv_cache.dtype, block_size, head_size)
    views = []
    for (t_i, d_i, s_to, s_ti, s_do, s_di), start in ((k_tiles, 0), (v_tiles, block_size * head_size)):
        shape = (num_blocks, block_size // t_i, t_i, num_kv_heads, head_size // d_i, d_i)
        views.append(paged_view(kv_cache, shape, (s_block, s_to, s_ti, s_head, s_do, s_di),
                                kv_cache.storage_offset() + start))
    return views[0], views[1]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fit_tiles(loc: torch.Tensor) -> tuple | None:
    """loc [block_size, D] int64: where (token t, dim d) lies in its region ->
    (t_i, d_i, stride of t_o, t_i, d_o, d_i) with t = t_o * t_i + t_i', d =
    d_o * d_i + d_i' and loc = the strides' sum, or None when no such tiling
    gives loc. Whole blocks of tokens and single dims are tried first, so a
    strided layout comes back as t_o = d_i = 1 (a plain view)."""
    block_size, head_size = loc.shape
    tok = torch.arange(block_size)[:, None]
    dim = torch.arange(head_size)[None, :]
    for t_i in reversed(_divisors(block_size)):
        for d_i in _divisors(head_size):
            s_ti = int(loc[1, 0] - loc[0, 0]) if t_i > 1 else 0
            s_to = int(loc[t_i, 0] - loc[0, 0]) if t_i < block_size else 0
            s_di = int(loc[0, 1] - loc[0, 0]) if d_i > 1 else 0
            s_do = int(loc[0, d_i] - loc[0, 0]) if d_i < head_size else 0
            fit = (tok // t_i) * s_to + (tok % t_i) * s_ti + (dim // d_i) * s_do + (dim % d_i) * s_di
            if int(loc[0, 0]) == 0 and torch.equal(loc, fit):
                return t_i, d_i, s_to, s_ti, s_do, s_di
    return None


@functools.lru_cache(maxsize=None)
def _cpu_kv_tiles(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> tuple[tuple, tuple]:
    """(K, V) tilings (``_fit_tiles``) of one block/head region of the CPU cache.

    Writes probe keys and values through vLLM's own ``cpu_attn_reshape_and_cache``
    and reads back where each (token, dim) landed, one base-16 digit at a
    time (values 1..16 are exact in fp16/bf16). The write op is plain C++
    for every isa (its "amx" branch runs on CPUs without AMX too), so this is
    the layout vLLM's attention kernel reads. Raises, naming the isa and the
    tensor, if a region is not a tiling of strided tokens and dims (then the
    tree runner cannot address it)."""
    from vllm import _custom_ops as ops

    cache = torch.zeros(1, 1, block_size, 2 * head_size, dtype=dtype)
    kv = cache.view(1, 1, 2 * block_size, head_size)
    key_cache, value_cache = kv[:, :, :block_size], kv[:, :, block_size:]
    tok = torch.arange(block_size)[:, None].expand(block_size, head_size)
    dim = torch.arange(head_size)[None, :].expand(block_size, head_size)
    slots = torch.arange(block_size)
    region = cache.view(2, block_size * head_size)  # K's region, then V's
    decoded = {"tok": torch.zeros(2, block_size * head_size, dtype=torch.int64),
               "dim": torch.zeros(2, block_size * head_size, dtype=torch.int64)}
    for name, value in (("tok", tok), ("dim", dim)):
        for digit in range(3):
            probe = ((value // 16**digit) % 16 + 1).to(dtype)[:, None, :]  # [tokens, 1 head, D]
            cache.zero_()
            ops.cpu_attn_reshape_and_cache(probe, probe, key_cache, value_cache, slots, isa,
                                           k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
            decoded[name] += (region.float().round().long() - 1) * 16**digit
    tilings = []
    for i, what in enumerate(("K", "V")):
        t, d = decoded["tok"][i], decoded["dim"][i]
        loc = torch.full((block_size, head_size), -1, dtype=torch.int64)
        written = (t >= 0) & (t < block_size) & (d >= 0) & (d < head_size)
        loc[t[written], d[written]] = torch.arange(block_size * head_size)[written]
        tiling = _fit_tiles(loc)
        if tiling is None:
            raise RuntimeError(f"spec-plugins: vLLM's CPU attention (isa={isa}, {dtype}, block_size={block_size}, "
                               f"head_size={head_size}) stores {what} in a layout that is no tiling of strided "
                               "tokens and dims: the tree runner cannot address it; use --dtype float32 on this CPU")
        tilings.append(tiling)
    return tilings[0], tilings[1]


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
