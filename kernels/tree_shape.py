"""The draft-tree shape: one type, its spelling and its validation.

A tree is drafted in ``num_steps`` (S) head steps of ``topk`` (K) children
each and verified as ``num_draft_tokens`` (T) nodes, the root included. The
draft pool holds K + (S - 1) K^2 candidates (``pool_size``), so T - 1 may not
exceed it; the mask mode bounds T too (``modes.max_nodes``). ``topk = 1`` is a
chain, with T = S + 1 when every step is kept.

``TreeShape`` is the type every consumer passes (the reference decoder, the
vLLM adapter's settings, the budget's menu, the command-line tools);
``"5,4,8"`` is its spelling on command lines and in menus (``TreeShape.parse``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .modes import max_nodes, parse_mask_mode


def check_positive(name: str, value) -> int:
    """``value`` if it is an int >= 1 (not a bool), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def pool_size(topk: int, num_steps: int) -> int:
    """Candidates in the draft pool: K + (S - 1) * K^2."""
    return topk + (num_steps - 1) * topk * topk


def parent_list_width(topk: int, num_steps: int) -> int:
    """Width of SGLang's parent_list: 0 for one step, else 1 + (S - 1) * K."""
    return 0 if num_steps == 1 else 1 + (num_steps - 1) * topk


def validate_tree_shape(num_steps: int, topk: int, num_draft_tokens: int, mode="QLEN_ONLY") -> None:
    """Startup check of a tree configuration; raises ValueError naming the bad value."""
    check_positive("num_steps", num_steps)
    check_positive("topk", topk)
    check_positive("num_draft_tokens", num_draft_tokens)
    mode = parse_mask_mode(mode)
    pool = pool_size(topk, num_steps)
    if num_draft_tokens - 1 > pool:
        raise ValueError(
            f"num_draft_tokens={num_draft_tokens} needs {num_draft_tokens - 1} draft nodes but "
            f"num_steps={num_steps}, topk={topk} only draft {pool} candidates"
        )
    if num_draft_tokens > max_nodes(mode):
        raise ValueError(
            f"num_draft_tokens={num_draft_tokens} exceeds what mask mode {mode.name} supports "
            f"({max_nodes(mode)} nodes)"
        )


def parse_shape_numbers(text: str) -> tuple[int, int, int]:
    """``"5,4,8"`` -> (5, 4, 8): the spelling only (ValueError naming the text)."""
    try:
        numbers = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        numbers = ()
    if len(numbers) != 3:
        raise ValueError(f"shape {text!r} must be num_steps,topk,num_draft_tokens (e.g. 5,4,8)")
    return numbers


@dataclass(frozen=True)
class TreeShape:
    """num_steps = tree depth D, topk = branching per step, num_draft_tokens = T
    (tree nodes including the root). topk = 1 is a chain with T = D + 1.
    Validated on construction (``validate_tree_shape``)."""

    num_steps: int
    topk: int
    num_draft_tokens: int

    def __post_init__(self):
        validate_tree_shape(self.num_steps, self.topk, self.num_draft_tokens)

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """``"5,4,8"`` -> TreeShape(5, 4, 8); ValueError naming the text."""
        numbers = parse_shape_numbers(text)
        try:
            return cls(*numbers)
        except ValueError as err:
            raise ValueError(f"shape {text!r}: {err}") from None

    @property
    def max_depth(self) -> int:
        """Depth of the deepest node a tree of this shape can have (the most
        drafts one request can accept): min(num_steps, T - 1)."""
        return min(self.num_steps, self.num_draft_tokens - 1)

    def as_tuple(self) -> tuple[int, int, int]:
        """(num_steps, topk, num_draft_tokens)."""
        return (self.num_steps, self.topk, self.num_draft_tokens)
