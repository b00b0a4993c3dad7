"""The budget's menu: the entries a step may run, how they are spelled and parsed.

An entry is a ``TreeShape`` (num_steps, topk, num_draft_tokens = T) or
``None`` (no speculation: a plain decode step). ``parse_menu`` reads a spec
string ("none,3,1,4,5,1,6,5,4,8") or a list, ``parse_budget_config`` the
engines' ``{"budget": "auto", "menu": ...}`` setting, ``profile_plan`` the
startup grid of cost keys to time for a menu.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping, Optional, Sequence, Union

from spec_plugins.tree_drafting import TreeShape

Shape = Optional[TreeShape]
DEFAULT_MENU = "none,3,1,4,5,1,6,5,4,8"


class MenuError(ValueError):
    """A budget menu or budget config that cannot be used; the message names the bad value."""


def shape_label(shape: Shape) -> str:
    """"none" or "num_steps,topk,num_draft_tokens" (the menu-spec spelling)."""
    return "none" if shape is None else f"{shape.num_steps},{shape.topk},{shape.num_draft_tokens}"


def verify_tokens(shape: Shape) -> int:
    """T of the verify forward: num_draft_tokens, or 1 for no speculation."""
    return 1 if shape is None else shape.num_draft_tokens


def _make_shape(triple: Sequence, where: str) -> TreeShape:
    if len(triple) != 3:
        raise MenuError(f"{where}: {list(triple)!r} is not a (num_steps, topk, num_draft_tokens) triple")
    for name, v in zip(("num_steps", "topk", "num_draft_tokens"), triple):
        if isinstance(v, bool) or not isinstance(v, int):
            raise MenuError(f"{where}: {name}={v!r} is not an integer")
    try:
        shape = TreeShape(*triple)
    except ValueError as e:
        raise MenuError(f"{where} ({','.join(map(str, triple))}): {e}") from None
    if shape.topk == 1 and shape.num_draft_tokens != shape.num_steps + 1:
        raise MenuError(f"{where} ({shape_label(shape)}): topk=1 is a chain, num_draft_tokens must be "
                        f"num_steps + 1 = {shape.num_steps + 1}, got {shape.num_draft_tokens}")
    return shape


def _int_token(token: str, where: str) -> int:
    try:
        return int(token)
    except ValueError:
        raise MenuError(f"{where}: {token!r} is neither 'none' nor an integer") from None


def _tokens(text: str) -> list[str]:
    """The items of a spec string, separated by commas, semicolons or blanks."""
    return [t for t in re.split(r"[\s,;]+", text.strip()) if t]


def _string_entries(spec: str) -> list[Shape]:
    """The entries of a spec string, in order: 'none', or 3 consecutive integers."""
    entries: list[Shape] = []
    pending: list[int] = []
    for i, token in enumerate(_tokens(spec), 1):
        where = f"menu {spec!r} item {i}"
        if token.lower() == "none":
            if pending:
                raise MenuError(f"{where}: 'none' inside the triple started by {pending}")
            entries.append(None)
            continue
        pending.append(_int_token(token, where))
        if len(pending) == 3:
            entries.append(_make_shape(pending, f"menu {spec!r} entry {len(entries) + 1}"))
            pending = []
    if pending:
        raise MenuError(f"menu {spec!r}: trailing {pending} is not a (num_steps, topk, num_draft_tokens) "
                        f"triple (the menu needs 'none' or groups of 3 integers)")
    return entries


def _list_entry(item, where: str) -> Shape:
    """One item of a menu list: None / "none" / [s, k, t] / "s,k,t" / TreeShape."""
    if item is None or (isinstance(item, str) and item.strip().lower() == "none"):
        return None
    if isinstance(item, TreeShape):
        return _make_shape([item.num_steps, item.topk, item.num_draft_tokens], where)
    if isinstance(item, str):
        return _make_shape([_int_token(p, where) for p in _tokens(item)], where)
    if isinstance(item, (list, tuple)):
        return _make_shape(list(item), where)
    raise MenuError(f"{where}: {item!r} is not None, 'none', a triple or a TreeShape")


def _list_entries(spec: Iterable) -> list[Shape]:
    try:
        items = list(spec)
    except TypeError:
        raise MenuError(f"menu {spec!r}: expected a string or a list of shapes") from None
    return [_list_entry(item, f"menu entry {i}") for i, item in enumerate(items, 1)]


def parse_menu(spec: Union[str, Iterable], *, include_none: bool = True) -> tuple[Shape, ...]:
    """The budget menu from a spec string or a list.

    String: 'none' and integers separated by commas, semicolons or blanks;
    consecutive integers group into (num_steps, topk, num_draft_tokens)
    triples: "none,3,1,4,5,1,6,5,4,8" = none, chain (3,1,4), chain (5,1,6),
    tree (5,4,8). List: items None / "none" / [s, k, t] / "s,k,t" / TreeShape.
    ``None`` (no speculation) is added when missing unless include_none=False
    and always comes first; the other entries keep their order (ties go to the
    earlier one). Raises MenuError naming the bad value: a non-integer, an
    incomplete triple, an invalid shape, a chain with T != num_steps + 1, a
    duplicate, or no speculative shape at all.
    """
    entries = _string_entries(spec) if isinstance(spec, str) else _list_entries(spec)
    seen: set = set()
    for e in entries:
        if e in seen:
            raise MenuError(f"menu lists {shape_label(e)} twice")
        seen.add(e)
    shapes = [e for e in entries if e is not None]
    if not shapes:
        raise MenuError(f"menu {spec!r} has no speculative shape")
    return ((None,) if include_none or None in seen else ()) + tuple(shapes)


def parse_budget_config(raw: Mapping) -> Optional[tuple[Shape, ...]]:
    """The menu from a config dict, or None when the budget is off.

    Reads only the keys "budget" ("auto" | "off"; absent = "off") and "menu"
    (a spec string or a list of triples; absent = DEFAULT_MENU), e.g.
    ``{"budget": "auto", "menu": [[3, 1, 4], [5, 4, 8]]}``.
    """
    mode = raw.get("budget", "off")
    if mode is None or mode is False or (isinstance(mode, str) and mode.lower() == "off"):
        if raw.get("menu") is not None:
            raise MenuError(f"budget menu {raw['menu']!r} given but budget is {mode!r}: set budget='auto'")
        return None
    if not (isinstance(mode, str) and mode.lower() == "auto"):
        raise MenuError(f"budget={mode!r}: expected 'auto' or 'off'")
    return parse_menu(raw.get("menu", DEFAULT_MENU))


def profile_plan(menu: Iterable[Shape], batch_sizes: Iterable[int]) -> tuple[list, list]:
    """The startup grid to time: ([(T, B)] verify keys incl. T = 1, [(shape, B)] draft keys)."""
    menu = list(menu)
    Bs = sorted({int(b) for b in batch_sizes})
    Ts = sorted({verify_tokens(s) for s in menu} | {1})
    return [(T, B) for T in Ts for B in Bs], [(s, B) for s in menu if s is not None for B in Bs]
