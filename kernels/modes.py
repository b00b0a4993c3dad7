"""Tree-mask modes and their memory cost.

The first three values equal SGLang 0.5.23's ``TreeMaskMode`` (an IntEnum in
``sglang/kernels/ops/speculative/spec_tree.py``) so a mode can be handed to
SGLang code unchanged; the last two are ours.

Layouts (B = batch, T = num_draft_tokens = nodes per request including the
root, L_b = committed context length of request b):

FULL_MASK (0)
    Flat ``torch.bool`` of ``sum_b(L_b) * T + B * T * T`` entries. Request b
    owns ``T`` consecutive rows of width ``L_b + T`` starting at
    ``T * T * b + T * sum_{c<b} L_c``. Columns ``[0, L_b)`` are the prefix
    (True when ``fill_prefix_mask``, untouched otherwise), column ``L_b + j``
    is node j. Byte-identical to SGLang, which also fills a preallocated
    buffer whole (beyond ``seq_lens_sum``) when filling the prefix.
QLEN_ONLY (1)
    Flat ``torch.bool`` of ``B * T * T``: row i, column j is True iff node j
    is node i or one of its ancestors. Byte-identical to SGLang.
QLEN_ONLY_BITPACKING (2)
    Flat ``B * T`` words of uint8 (T <= 8), uint16 (T <= 16) or uint32
    (T <= 32); bit j of row i's word as QLEN_ONLY's column j. T <= 32 only.
    Byte-identical to SGLang.
ANCESTOR_BITMASK (3)
    ``[B, T, W]`` int64 with ``W = ceil(T / 64)``: bit ``j % 64`` of word
    ``j // 64`` of row i is QLEN_ONLY's (i, j). Any T.
PARENT_POINTER (4)
    ``[B, 2, T]`` int16: ``[:, 0]`` the parent node of each node (-1 for the
    root), ``[:, 1]`` its depth. O(T) bytes; a consumer walks ancestry.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

MAX_BITPACKED_NODES = 32
MAX_TREE_NODES = 1024  # int16 parent pointers and SGLang's own kernel bound


class TreeMaskMode(enum.IntEnum):
    FULL_MASK = 0
    QLEN_ONLY = 1
    QLEN_ONLY_BITPACKING = 2
    ANCESTOR_BITMASK = 3
    PARENT_POINTER = 4


# (batch B, nodes T, seq_lens_sum sum(L)) -> the buffer's shape
BufferShape = Callable[[int, int, int], tuple[int, ...]]


@dataclass(frozen=True)
class ModeSupport:
    """What one mask mode is and who reads it (the table ``MODES``)."""

    layout: str  # shape in words (the module doc gives the bits)
    dtype: Optional[torch.dtype]  # None: by T (QLEN_ONLY_BITPACKING: uint8 / uint16 / uint32)
    max_nodes: int  # largest T the layout holds
    sglang_builds: bool  # SGLang 0.5.23 builds this layout itself (byte-identical to ours)
    tree_attention: Optional[int]  # ``tree_attention`` reads it: its rank, 0 = the default; None: not read
    shape: BufferShape  # the buffer ``layout`` describes (``empty_tree_mask`` allocates it)


# The one table of mask modes. Both adapters' verify attention is
# ``spec_tree_kernels.tree_attention``, so ``TREE_ATTENTION_MODES`` is what
# vLLM's tree rows and SGLang's spec_tree backends accept.
MODES: dict[TreeMaskMode, ModeSupport] = {
    TreeMaskMode.FULL_MASK: ModeSupport("flat [sum(L) * T + B * T * T]", torch.bool, MAX_TREE_NODES, True, None,
                                        lambda b, t, lsum: (lsum * t + b * t * t,)),
    TreeMaskMode.QLEN_ONLY: ModeSupport("flat [B * T * T]", torch.bool, MAX_TREE_NODES, True, 2,
                                        lambda b, t, lsum: (b * t * t,)),
    TreeMaskMode.QLEN_ONLY_BITPACKING: ModeSupport("flat [B * T] words", None, MAX_BITPACKED_NODES, True, None,
                                                   lambda b, t, lsum: (b * t,)),
    TreeMaskMode.ANCESTOR_BITMASK: ModeSupport("[B, T, ceil(T / 64)]", torch.int64, MAX_TREE_NODES, False, 0,
                                               lambda b, t, lsum: (b, t, ancestor_bitmask_words(t))),
    TreeMaskMode.PARENT_POINTER: ModeSupport("[B, 2, T] (parent, depth)", torch.int16, MAX_TREE_NODES, False, 1,
                                             lambda b, t, lsum: (b, 2, t)),
}
# The modes tree attention reads, its default first.
TREE_ATTENTION_MODES: tuple[TreeMaskMode, ...] = tuple(
    sorted((m for m, s in MODES.items() if s.tree_attention is not None), key=lambda m: MODES[m].tree_attention)
)
TREE_ATTENTION_MODE_NAMES: tuple[str, ...] = tuple(m.name for m in TREE_ATTENTION_MODES)
DEFAULT_TREE_ATTENTION_MODE = TREE_ATTENTION_MODES[0]
# Modes only we build (SGLang's buffers for them are ours to lay out).
OWN_MODES: tuple[TreeMaskMode, ...] = tuple(m for m, s in MODES.items() if not s.sglang_builds)


def parse_mask_mode(mode: "TreeMaskMode | int | str") -> TreeMaskMode:
    """Accept an enum member, its integer value or its name (any case)."""
    if isinstance(mode, TreeMaskMode):
        return mode
    if isinstance(mode, str):
        try:
            return TreeMaskMode[mode.strip().upper()]
        except KeyError:
            pass
    else:
        try:
            return TreeMaskMode(int(mode))
        except (ValueError, TypeError):
            pass
    names = ", ".join(m.name for m in TreeMaskMode)
    raise ValueError(f"unknown tree mask mode {mode!r}; expected one of: {names}")


def bitpacked_word_bytes(num_draft_tokens: int) -> int:
    """Bytes of one QLEN_ONLY_BITPACKING row word, as SGLang picks them."""
    if num_draft_tokens > MAX_BITPACKED_NODES:
        raise ValueError(
            f"QLEN_ONLY_BITPACKING holds at most {MAX_BITPACKED_NODES} nodes per row, "
            f"got num_draft_tokens={num_draft_tokens}; use ANCESTOR_BITMASK"
        )
    return 4 if num_draft_tokens > 16 else (2 if num_draft_tokens > 8 else 1)


def ancestor_bitmask_words(num_draft_tokens: int) -> int:
    return max(1, math.ceil(num_draft_tokens / 64))


def max_nodes(mode: "TreeMaskMode | int | str") -> int:
    return MODES[parse_mask_mode(mode)].max_nodes


def mask_dtype(mode: TreeMaskMode, num_draft_tokens: int) -> torch.dtype:
    """The element dtype of ``mode``'s buffer for trees of T nodes (``MODES``)."""
    dtype = MODES[mode].dtype
    if dtype is None:  # QLEN_ONLY_BITPACKING: one word per row, as wide as T needs
        dtype = {1: torch.uint8, 2: torch.uint16, 4: torch.uint32}[bitpacked_word_bytes(num_draft_tokens)]
    return dtype


def mask_bytes_per_request(mode: "TreeMaskMode | int | str", num_draft_tokens: int, context_len: int) -> int:
    """Bytes of tree mask one request needs per verify step: its buffer for
    B = 1, sum(L) = L (``MODES``).

    FULL_MASK: T * (L + T); QLEN_ONLY: T * T; QLEN_ONLY_BITPACKING: T * {1,2,4};
    ANCESTOR_BITMASK: T * 8 * ceil(T / 64); PARENT_POINTER: 2 * 2 * T.
    """
    mode = parse_mask_mode(mode)
    t = int(num_draft_tokens)
    if t < 1:
        raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
    if context_len < 0:
        raise ValueError(f"context_len must be >= 0, got {context_len}")
    itemsize = mask_dtype(mode, t).itemsize
    return math.prod(MODES[mode].shape(1, t, int(context_len))) * itemsize


def empty_tree_mask(mode: TreeMaskMode, batch: int, nodes: int, seq_lens_sum: int, device,
                    *, zeroed: bool = False) -> torch.Tensor:
    """The one mask allocator: a buffer in ``mode``'s layout (``MODES``; the
    module doc gives the bits), uninitialized or, with ``zeroed``, all zeros."""
    alloc = torch.zeros if zeroed else torch.empty
    return alloc(MODES[mode].shape(batch, nodes, seq_lens_sum), dtype=mask_dtype(mode, nodes), device=device)
