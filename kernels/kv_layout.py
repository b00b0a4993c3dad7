"""Paged K or V stored in tiles inside each block and head (vLLM-CPU's AMX layout).

Every op of this package takes a layer's K and V as [num_blocks, block_size,
Hkv, D] views: slot s of the cache is [s // block_size, s % block_size], and
one strided tensor addresses any (block, token, head, dim). vLLM-CPU's "amx"
attention (bf16 on a CPU with AMX tiles, block_size a multiple of 32) stores
both in tiles that no 4-D strided view describes. Read from vLLM 0.32's own
cache-write op (``cpu_attn_reshape_and_cache(..., isa="amx")``, which is plain
C++ and runs on any x86 CPU; ``vllm_ext.attention_cpu`` probes it), the
element (token t, dim d) of one block/head region of block_size * D elements
lies at::

    K: (t // 16) * 16 * D + (d // 2) * 32 + (t % 16) * 2 + d % 2
       (16-token tiles; in each, dim pairs of 16 tokens x 2 dims: AMX's
       VNNI-packed B operand of Q @ K^T)
    V: (d // 16) * 16 * block_size + (t // 2) * 32 + (d % 16) * 2 + t % 2
       (16-dim tiles; in each, token pairs: the B operand of P @ V)

vLLM's AMX kernel reads the same tiles (csrc/cpu/cpu_attn_amx.hpp,
``TileGemm224``: the second B tile starts k_size * 16 elements on for K, the
next 16 tokens, and block_size * 16 on for V, the next 16 dims).

Both are one pattern: token t = t_o * tile_tokens + t_i, dim d = d_o *
tile_dims + d_i, each of t_o, t_i, d_o, d_i with a stride of its own.
``TiledKV`` holds that as one 6-D strided view [num_blocks, t_o, t_i, Hkv,
d_o, d_i] of the cache and answers the indexing the ops do on a 4-D view:

* ``cache[blocks]`` (blocks any int64 shape) -> a new [*blocks.shape,
  block_size, Hkv, D] tensor (the tree rows' and draft steps' gathers);
* ``cache[block, offset]`` -> a new [*block.shape, Hkv, D] tensor, and
  ``cache[block, offset] = rows`` writes them in place (the accepted-path KV
  move, ``reference.move_accepted_kv``).

The torch paths serve it (``attention_plan`` torch, ``branch_attention``
torch, the reference move); the host C kernel, Triton and CUDA take strided
views only and refuse it (``refuse_tiled``). A strided layout stays a plain
tensor (``tiled_or_plain``), so nothing changes for the layouts served before.
"""

from __future__ import annotations

import torch


class TiledKV:
    """A paged K or V cache as tiles: ``tiles`` [num_blocks, t_o, t_i, Hkv,
    d_o, d_i] (any strides; a view of the engine's cache, never a copy),
    block_size = t_o * t_i, D = d_o * d_i, any dtype. Looks like a [num_blocks,
    block_size, Hkv, D] tensor to the ops' checks (``shape``, ``dtype``,
    ``device``, ``dim``, ``data_ptr``, ``stride``, ``element_size``)."""

    __slots__ = ("tiles",)

    def __init__(self, tiles: torch.Tensor):
        if not isinstance(tiles, torch.Tensor) or tiles.dim() != 6:
            raise ValueError(f"TiledKV needs a 6-D [num_blocks, t_o, t_i, Hkv, d_o, d_i] view, got "
                             f"{type(tiles).__name__} {tuple(getattr(tiles, 'shape', ()))}")
        self.tiles = tiles

    # ------------------------------------------------ what the ops' checks read

    @property
    def shape(self) -> torch.Size:
        nb, t_o, t_i, heads, d_o, d_i = self.tiles.shape
        return torch.Size((nb, t_o * t_i, heads, d_o * d_i))

    @property
    def dtype(self) -> torch.dtype:
        return self.tiles.dtype

    @property
    def device(self) -> torch.device:
        return self.tiles.device

    @property
    def is_cpu(self) -> bool:
        return self.tiles.is_cpu

    def dim(self) -> int:
        return 4

    def data_ptr(self) -> int:
        return self.tiles.data_ptr()

    def stride(self) -> tuple:
        """The 6 strides of ``tiles`` (with ``shape``, what tells two views apart)."""
        return self.tiles.stride()

    def element_size(self) -> int:
        return self.tiles.element_size()

    # ------------------------------------------------ indexing

    def _split(self, offset: torch.Tensor):
        tile = self.tiles.shape[2]
        return torch.div(offset, tile, rounding_mode="floor"), offset % tile

    def __getitem__(self, index):
        """``cache[blocks]`` (a tensor of block ids) or ``cache[blocks, offsets]``
        (tensors): copies in logical order. Other indices are refused: a copy
        would silently drop a chained write (``cache[b][o] = x``)."""
        nb, t_o, t_i, heads, d_o, d_i = self.tiles.shape
        if not (isinstance(index, torch.Tensor)
                or (isinstance(index, tuple) and len(index) == 2 and all(isinstance(i, torch.Tensor) for i in index))):
            raise TypeError(f"TiledKV is read by a block-id tensor or (block, offset) tensors, got {index!r}")
        if isinstance(index, tuple):
            block, offset = index
            t_out, t_in = self._split(offset)
            rows = self.tiles[block, t_out, t_in]  # [*block.shape, Hkv, d_o, d_i]
            return rows.reshape(*rows.shape[:-2], d_o * d_i)
        picked = self.tiles[index]  # [*index.shape, t_o, t_i, Hkv, d_o, d_i]
        lead = picked.shape[:-5]
        return picked.reshape(*lead, t_o * t_i, heads, d_o * d_i)

    def __setitem__(self, index, value: torch.Tensor) -> None:
        if not isinstance(index, tuple) or len(index) != 2:
            raise TypeError(f"TiledKV is written by (block, offset) index tensors, got {type(index).__name__}")
        block, offset = index
        t_out, t_in = self._split(offset)
        _, _, _, heads, d_o, d_i = self.tiles.shape
        self.tiles[block, t_out, t_in] = value.reshape(*value.shape[:-1], d_o, d_i)

    def __repr__(self) -> str:
        return f"TiledKV(shape={tuple(self.shape)}, tiles={tuple(self.tiles.shape)}, strides={self.stride()})"


def tiled_or_plain(tiles: torch.Tensor):
    """``tiles`` [num_blocks, t_o, t_i, Hkv, d_o, d_i] as a plain [num_blocks,
    block_size, Hkv, D] view where strides can say it (one tile per block
    along tokens, whole dims: t_o = d_i = 1), else a ``TiledKV``."""
    return paged_view(tiles, tiles.shape, tiles.stride(), tiles.storage_offset())


def paged_view(base: torch.Tensor, shape, strides, offset: int):
    """``tiled_or_plain`` of ``base.as_strided(shape, strides, offset)`` (6-D
    tile shape and strides), a plain view built directly, without the 6-D view
    (engines rebuild their cache views per layer per step)."""
    nb, t_o, t_i, heads, d_o, d_i = shape
    if t_o == 1 and d_i == 1:
        s_block, _, s_ti, s_head, s_do, _ = strides
        return base.as_strided((nb, t_i, heads, d_o), (s_block, s_ti, s_head, s_do), offset)
    return TiledKV(base.as_strided(shape, strides, offset))


def refuse_tiled(impl: str, **caches) -> None:
    """Raise where an implementation that takes strided views only (the host
    kernel, Triton, CUDA) is handed a ``TiledKV``, naming it."""
    for name, cache in caches.items():
        if isinstance(cache, TiledKV):
            raise ValueError(f"{name} is a tiled cache ({cache!r}): the {impl} implementation reads strided "
                             "[num_blocks, block_size, Hkv, D] views only; the torch paths read tiles")
