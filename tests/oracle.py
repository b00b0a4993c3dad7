"""Brute-force pure-Python oracle for the tree ops, written from the spec
(the seed chapter and SGLang's layouts), not from our implementation.

Everything works on Python lists of one request at a time.
"""

from __future__ import annotations

import math


def candidate_parent(pool_index: int, parent_list: list[int], topk: int) -> int:
    """Pool index of a candidate's parent; -1 for children of the root."""
    group = pool_index // topk
    return -1 if group == 0 else parent_list[group]


def candidate_depth(pool_index: int, parent_list: list[int], topk: int) -> int:
    depth = 1
    while (pool_index := candidate_parent(pool_index, parent_list, topk)) != -1:
        depth += 1
    return depth


def select(scores: list[float], parent_list: list[int], topk: int, num_nodes: int) -> list[int]:
    """Grow the tree from the root: repeatedly take the best candidate whose
    parent is already in the tree (ties: shallower, then lower pool index).

    For honest cumulative scores (a child never beats its parent) this is the
    global top-(T-1) with ancestor-first tie breaking.
    """
    chosen: set[int] = set()
    while len(chosen) < num_nodes - 1:
        frontier = [
            p
            for p in range(len(scores))
            if p not in chosen and (candidate_parent(p, parent_list, topk) in chosen or candidate_parent(p, parent_list, topk) == -1)
        ]
        best = min(frontier, key=lambda p: (-scores[p], candidate_depth(p, parent_list, topk), p))
        chosen.add(best)
    return sorted(chosen)


def is_closed(selected: list[int], parent_list: list[int], topk: int) -> bool:
    chosen = set(selected)
    return all(candidate_parent(p, parent_list, topk) in chosen | {-1} for p in selected)


def tree_of(selected: list[int], parent_list: list[int], topk: int) -> list[int]:
    """Parent node of each node (node i + 1 = selected[i]; node 0 = root, parent -1)."""
    node_of = {p: i + 1 for i, p in enumerate(selected)}
    parents = [-1]
    for p in selected:
        parent_pool = candidate_parent(p, parent_list, topk)
        parents.append(0 if parent_pool == -1 else node_of[parent_pool])
    return parents


def depths(parents: list[int]) -> list[int]:
    out = []
    for node in range(len(parents)):
        d = 0
        while parents[node] != -1:
            node = parents[node]
            d += 1
        out.append(d)
    return out


def ancestors_or_self(parents: list[int], node: int) -> set[int]:
    out = {node}
    while parents[node] != -1:
        node = parents[node]
        out.add(node)
    return out


def links(parents: list[int]) -> tuple[list[int], list[int]]:
    """First child and next sibling, children in ascending node order."""
    n = len(parents)
    children = {p: sorted(i for i in range(1, n) if parents[i] == p) for p in range(n)}
    first_child = [children[p][0] if children[p] else -1 for p in range(n)]
    next_sibling = [-1] * n
    for kids in children.values():
        for a, b in zip(kids, kids[1:]):
            next_sibling[a] = b
    return first_child, next_sibling


def qlen_rows(parents: list[int]) -> list[list[bool]]:
    n = len(parents)
    return [[j in ancestors_or_self(parents, i) for j in range(n)] for i in range(n)]


def full_mask_bytes(batch_parents: list[list[int]], seq_lens: list[int]) -> list[bool]:
    """SGLang FULL_MASK: per request T rows of (seq_len + T); prefix True."""
    out: list[bool] = []
    for parents, seq_len in zip(batch_parents, seq_lens):
        for row in qlen_rows(parents):
            out.extend([True] * seq_len + row)
    return out


def bitpacked_bytes(parents: list[int]) -> bytes:
    n = len(parents)
    width = 1 if n <= 8 else (2 if n <= 16 else 4)
    out = b""
    for row in qlen_rows(parents):
        value = sum(1 << j for j, bit in enumerate(row) if bit)
        out += value.to_bytes(width, "little")
    return out


def ancestor_words(parents: list[int]) -> list[list[int]]:
    """Per row, ceil(T/64) words as signed 64-bit ints."""
    n = len(parents)
    words = max(1, math.ceil(n / 64))
    rows = []
    for row in qlen_rows(parents):
        value = sum(1 << j for j, bit in enumerate(row) if bit)
        ws = []
        for w in range(words):
            chunk = (value >> (64 * w)) & ((1 << 64) - 1)
            ws.append(chunk - (1 << 64) if chunk >= 1 << 63 else chunk)
        rows.append(ws)
    return rows


def verify(parents: list[int], tokens: list[int], target: list[int], max_depth: int) -> tuple[list[int], list[int]]:
    """Greedy walk. Returns (accepted node indices root first, emitted tokens)."""
    first_child, next_sibling = links(parents)
    path = [0]
    while len(path) < max_depth + 1:
        node = path[-1]
        child = first_child[node]
        while child != -1 and tokens[child] != target[node]:
            child = next_sibling[child]
        if child == -1:
            break
        path.append(child)
    return path, [target[n] for n in path]


def move_rows(rows: list, verify_slots: list[int], path: list[int]) -> list:
    """Slot-indexed list after moving the accepted path to the front."""
    out = list(rows)
    for depth, node in enumerate(path):
        out[verify_slots[depth]] = rows[verify_slots[node]]
    return out
