"""Pure-torch reference implementations: the executable specification.

Every function here is batched over requests and runs on any device; the
Triton and CUDA implementations must equal these bit for bit. Arguments are
assumed already validated by ``spec_tree_kernels.api`` (shapes, dtypes).

Notation: B requests, S = num_steps (draft forwards), K = topk,
P = K + (S - 1) * K * K candidates in the draft pool, T = num_draft_tokens
(tree nodes per request including the root), D + 1 = S + 1 accepted-path
width. Node-indexed arrays are T wide, accepted-path arrays D + 1 wide.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from .modes import TreeMaskMode, ancestor_bitmask_words, bitpacked_word_bytes, empty_tree_mask


class TreeBuild(NamedTuple):
    """Everything the verify pass needs, for B requests of T nodes each.

    tree_mask:             layout per ``modes.TreeMaskMode``.
    positions:             [B, T] int64, context length + node depth.
    retrieve_index:        [B, T] int64, b * T + i (flat slot of node i).
    retrieve_next_token:   [B, T] int64, first child of node i, -1 if none.
    retrieve_next_sibling: [B, T] int64, next sibling of node i, -1 if none.
    """

    tree_mask: torch.Tensor
    positions: torch.Tensor
    retrieve_index: torch.Tensor
    retrieve_next_token: torch.Tensor
    retrieve_next_sibling: torch.Tensor


class VerifyResult(NamedTuple):
    """Greedy tree-walk result for B requests (accepted-path arrays, D + 1 wide).

    accept_index:  [B, D + 1] int32, node index (0..T-1) accepted at each depth,
                   node 0 (the root) first, -1 padded.
    accept_length: [B] int32, accepted draft nodes (root excluded).
    accept_tokens: [B, D + 1] int64, the tokens this step emits: the target's
                   argmax at each accepted node (= the next accepted draft token,
                   and for the last one the bonus token), -1 padded; a request
                   emits accept_length + 1 tokens.
    """

    accept_index: torch.Tensor
    accept_length: torch.Tensor
    accept_tokens: torch.Tensor


def empty_verify_result(batch: int, width: int, device: torch.device) -> VerifyResult:
    """Uninitialised ``VerifyResult`` outputs (accepted-path arrays ``width``
    wide) for a kernel that writes every element."""
    return VerifyResult(
        torch.empty(batch, width, dtype=torch.int32, device=device),
        torch.empty(batch, dtype=torch.int32, device=device),
        torch.empty(batch, width, dtype=torch.int64, device=device),
    )


def pool_step_bounds(topk: int, num_steps: int) -> list[tuple[int, int]]:
    """[start, end) of each draft step's candidates inside the pool."""
    bounds = [(0, topk)]
    for step in range(1, num_steps):
        start = topk + (step - 1) * topk * topk
        bounds.append((start, start + topk * topk))
    return bounds


def path_min_scores(scores: torch.Tensor, parent_list: torch.Tensor, topk: int, num_steps: int) -> torch.Tensor:
    """[B, P] float32: each candidate's score clamped to its ancestors' minimum.

    For honest cumulative probabilities this is the identity (a product of
    factors <= 1 never exceeds its prefix); for anything else it makes every
    child rank no higher than its parent, so ancestor-first tie breaking
    yields a closed tree whatever the input.
    """
    eff = scores.float() + 0.0  # -0.0 -> +0.0, so every implementation orders zeros alike
    for start, end in pool_step_bounds(topk, num_steps)[1:]:
        groups = torch.arange(start, end, device=scores.device) // topk
        parent_pool = parent_list[:, groups]  # [B, K*K] pool index of each candidate's parent
        eff[:, start:end] = torch.minimum(eff[:, start:end], eff.gather(1, parent_pool))
    return eff


def select_tree_nodes(
    scores: torch.Tensor, parent_list: torch.Tensor, topk: int, num_steps: int, num_draft_tokens: int
) -> torch.Tensor:
    """EAGLE-2 global selection of the T - 1 best candidates, ancestor-closed.

    scores:      [B, P] float, cumulative path scores (SGLang's flattened
                 ``score_list``); NaN must be rejected by the caller.
    parent_list: [B, 1 + (S - 1) * K] int64 (or [B, 0] when S == 1), pool index
                 of the parent of each expansion group (group = pool index // K,
                 group 0 = children of the root), SGLang's ``parent_list``.
    Returns      [B, T - 1] int64 pool indices in ascending order.

    Ranking key: (path-min score descending, pool index ascending). Pool order
    is step-major, so ties go to the shallower node and a parent always
    precedes its children; without ties this is exactly SGLang's
    ``torch.topk`` + sort.
    """
    eff = path_min_scores(scores, parent_list, topk, num_steps)
    order = torch.sort(eff, dim=1, descending=True, stable=True).indices
    return torch.sort(order[:, : num_draft_tokens - 1], dim=1).values


def node_parents(
    selected_index: torch.Tensor, parent_list: torch.Tensor, topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Parent node of each node, from SGLang-format selection.

    Returns (parent [B, T] int64 with -1 for the root and -2 for a node whose
    parent candidate was not selected, i.e. an open tree; found [B, T-1] bool).
    """
    batch, num_selected = selected_index.shape
    root = torch.full((batch, 1), -1, dtype=torch.int64, device=selected_index.device)
    if num_selected == 0:
        return root, torch.ones(batch, 0, dtype=torch.bool, device=selected_index.device)
    group = selected_index // topk
    if parent_list.shape[1] > 0:
        parent_pool = parent_list.gather(1, group.clamp(max=parent_list.shape[1] - 1))
    else:
        parent_pool = torch.full_like(group, -1)
    matches = selected_index[:, None, :] == parent_pool[:, :, None]  # [B, child, candidate]
    found = matches.any(dim=2)
    first_match = matches.to(torch.int8).argmax(dim=2)
    parent = torch.where(group == 0, 0, torch.where(found, first_match + 1, -2))
    return torch.cat([root, parent], dim=1), found | (group == 0)


def ancestor_matrix(parent: torch.Tensor, max_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Ancestor-or-self matrix and depths by climbing ``max_depth`` levels.

    parent: [B, T] int64 (-1 root). Returns (anc [B, T, T] bool, anc[b, i, j]
    iff j is i or an ancestor of i; depth [B, T] int64; ok [B] bool, False where
    some node is deeper than max_depth or hangs off a missing parent).
    """
    batch, nodes = parent.shape
    device = parent.device
    anc = torch.eye(nodes, dtype=torch.bool, device=device).expand(batch, nodes, nodes).clone()
    depth = torch.zeros_like(parent)
    cur = torch.arange(nodes, device=device).expand(batch, nodes)
    for _ in range(max_depth + 1):  # the last climb steps from the root to -1
        cur = torch.where(cur >= 0, parent.gather(1, cur.clamp(min=0)), cur)
        climbed = cur >= 0
        depth += climbed
        anc |= torch.nn.functional.one_hot(cur.clamp(min=0), nodes).bool() & climbed[..., None]
    ok = (cur == -1).all(dim=1) & (parent[:, 1:] >= 0).all(dim=1)
    return anc, depth, ok


def tree_links(parent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First-child / next-sibling arrays ([B, T] int64, -1 = none), children in
    ascending node order (SGLang's order)."""
    nodes = parent.shape[1]
    idx = torch.arange(nodes, device=parent.device)
    big = torch.full((), nodes, dtype=torch.int64, device=parent.device)
    is_child = parent[:, None, :] == idx[None, :, None]  # [B, p, j]: j is a child of p
    first_child = torch.where(is_child, idx, big).min(dim=2).values
    same_parent_after = (parent[:, :, None] == parent[:, None, :]) & (idx[None, None, :] > idx[None, :, None])
    same_parent_after[:, 0, :] = False  # the root has no siblings
    next_sibling = torch.where(same_parent_after, idx, big).min(dim=2).values
    none = torch.full_like(first_child, -1)
    return torch.where(first_child == nodes, none, first_child), torch.where(next_sibling == nodes, none, next_sibling)


def encode_mask(
    anc: torch.Tensor,
    parent: torch.Tensor,
    depth: torch.Tensor,
    seq_lens: torch.Tensor,
    mode: TreeMaskMode,
    seq_lens_sum: int,
    fill_prefix_mask: bool,
    tree_mask_buf: torch.Tensor | None,
) -> torch.Tensor:
    """Write the ancestor matrix in ``mode``'s layout (see ``modes``)."""
    batch, nodes, _ = anc.shape
    device = anc.device
    out = tree_mask_buf if tree_mask_buf is not None else empty_tree_mask(mode, batch, nodes, seq_lens_sum, device)
    if mode == TreeMaskMode.QLEN_ONLY:
        out[: batch * nodes * nodes] = anc.flatten()
    elif mode == TreeMaskMode.FULL_MASK:
        if fill_prefix_mask:
            # The whole buffer, as SGLang's build_tree_kernel_efficient does: a
            # preallocated buffer can hold more than seq_lens_sum says (SGLang
            # passes 0 with one), and no prefix bit may survive from last step.
            out.fill_(True)
        prefix = torch.cumsum(seq_lens, 0) - seq_lens
        row_start = nodes * nodes * torch.arange(batch, device=device) + nodes * prefix  # [B]
        width = seq_lens + nodes
        idx = torch.arange(nodes, device=device)
        cell = row_start[:, None, None] + width[:, None, None] * idx[None, :, None] + seq_lens[:, None, None] + idx[None, None, :]
        out[cell.flatten()] = anc.flatten().to(out.dtype)  # SGLang's Triton backend hands a uint8 buffer
    elif mode in (TreeMaskMode.QLEN_ONLY_BITPACKING, TreeMaskMode.ANCESTOR_BITMASK):
        if mode == TreeMaskMode.QLEN_ONLY_BITPACKING:
            words, word_bits = 1, 8 * bitpacked_word_bytes(nodes)
        else:
            words, word_bits = ancestor_bitmask_words(nodes), 64
        padded = torch.zeros(batch, nodes, words * word_bits, dtype=torch.int64, device=device)
        padded[:, :, :nodes] = anc
        bit = torch.arange(word_bits, device=device, dtype=torch.int64)
        packed = (padded.view(batch, nodes, words, word_bits) << bit).sum(dim=3)  # distinct bits: sum == or
        if mode == TreeMaskMode.ANCESTOR_BITMASK:
            out.view(batch, nodes, words).copy_(packed)
        else:  # little-endian bytes of each row's word, whatever the word width
            nbytes = word_bits // 8
            byte_shift = 8 * torch.arange(nbytes, device=device, dtype=torch.int64)
            as_bytes = ((packed[:, :, 0, None] >> byte_shift) & 0xFF).to(torch.uint8)
            out[: batch * nodes].view(torch.uint8).copy_(as_bytes.flatten())
    else:
        out[:, 0] = parent
        out[:, 1] = depth
    return out


def tree_from_parents(parent: torch.Tensor, seq_lens: torch.Tensor, mode: TreeMaskMode, max_depth: int) -> TreeBuild:
    """``TreeBuild`` of trees given as parents ([B, T] int64, -1 root; seq_lens
    [B] int64), climbing ``max_depth`` + 1 levels (``ancestor_matrix``)."""
    batch, nodes = parent.shape
    anc, depth, _ = ancestor_matrix(parent, max_depth)
    first_child, next_sibling = tree_links(parent)
    mask = encode_mask(anc, parent, depth, seq_lens, mode, 0, False, None)
    retrieve_index = torch.arange(batch * nodes, device=parent.device, dtype=torch.int64).view(batch, nodes)
    return TreeBuild(mask, seq_lens[:, None] + depth, retrieve_index, first_child, next_sibling)


def build_tree(
    selected_index: torch.Tensor,
    parent_list: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    mode: TreeMaskMode,
    seq_lens_sum: int,
    fill_prefix_mask: bool = True,
    tree_mask_buf: torch.Tensor | None = None,
) -> tuple[TreeBuild, torch.Tensor]:
    """Tree structure and mask from a selection (see ``TreeBuild``).

    selected_index: [B, T - 1] int64 pool indices (any order; SGLang's is
    ascending and node i + 1 is selected_index[:, i]). seq_lens: [B] int64.
    Returns (TreeBuild, ok [B] bool: False where the selection is not a closed
    tree of depth <= num_steps).
    """
    batch, num_selected = selected_index.shape
    nodes = num_selected + 1
    device = selected_index.device
    parent, found = node_parents(selected_index, parent_list, topk)
    anc, depth, ok = ancestor_matrix(parent, num_steps)
    ok = ok & found.all(dim=1)
    first_child, next_sibling = tree_links(parent)
    mask = encode_mask(anc, parent, depth, seq_lens, mode, seq_lens_sum, fill_prefix_mask, tree_mask_buf)
    retrieve_index = torch.arange(batch * nodes, device=device, dtype=torch.int64).view(batch, nodes)
    positions = seq_lens[:, None].to(torch.int64) + depth
    return TreeBuild(mask, positions, retrieve_index, first_child, next_sibling), ok


def _at(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values[b, index[b]] for every request b: [B, N] values, [B] index."""
    return values.gather(1, index[:, None])[:, 0]


def _walk_start(batch: int, max_depth: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every walk at the root: (accept_index [B, D + 1] int64 holding just the
    root, -1 padded; the current node [B]; alive [B]: still descending)."""
    accept_index = torch.full((batch, max_depth + 1), -1, dtype=torch.int64, device=device)
    accept_index[:, 0] = 0
    cur = torch.zeros(batch, dtype=torch.int64, device=device)
    alive = torch.ones(batch, dtype=torch.bool, device=device)
    return accept_index, cur, alive


def _reads_are_free(t: torch.Tensor) -> bool:
    """An early exit may read ``t``: it lives on the host (no device queue to
    wait for) and no graph is being captured or compiled (a read would break it)."""
    return t.is_cpu and not torch.compiler.is_compiling()


def _first_accepted_child(
    first_child: torch.Tensor, alive: torch.Tensor, retrieve_next_sibling: torch.Tensor, accepts
) -> torch.Tensor:
    """[B] the first child, in sibling order from ``first_child``, that
    ``accepts``; -1 where none is (or the walk is no longer alive).

    ``accepts(child, k, scanning) -> [B] bool`` tests each request's k-th
    child; ``child`` is clamped to a valid node, and only the ``scanning``
    requests' answers count. It is called in sibling order, so it may keep
    state across the siblings of one node.
    """
    chosen = torch.full_like(first_child, -1)
    child = first_child
    for k in range(retrieve_next_sibling.shape[1] - 1):  # a node has at most T - 1 children
        scanning = alive & (chosen < 0) & (child >= 0)
        if _reads_are_free(scanning) and not bool(scanning.any()):
            break
        safe = child.clamp(min=0)
        hit = scanning & accepts(safe, k, scanning)
        chosen = torch.where(hit, child, chosen)
        child = torch.where(scanning & ~hit, _at(retrieve_next_sibling, safe), child)
    return chosen


def _descend(
    accept_index: torch.Tensor, depth: int, alive: torch.Tensor, cur: torch.Tensor, chosen: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Record depth ``depth``'s accepted node (chosen, -1 for none: that walk
    ends) in accept_index; returns the new (alive, cur)."""
    alive = alive & (chosen >= 0)
    accept_index[:, depth] = torch.where(alive, chosen, -1)
    return alive, torch.where(alive, chosen, cur)


def _accept_length(accept_index: torch.Tensor) -> torch.Tensor:
    """[B] int64 accepted draft nodes of a walk's accept_index (the root excluded)."""
    return (accept_index[:, 1:] >= 0).sum(dim=1)


def _verify_result(accept_index: torch.Tensor, accept_tokens: torch.Tensor) -> VerifyResult:
    """A walk's ``VerifyResult``, in its dtypes, from its int64 accept_index."""
    return VerifyResult(accept_index.to(torch.int32), _accept_length(accept_index).to(torch.int32), accept_tokens)


def verify_tree_greedy(
    candidates: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    max_depth: int,
) -> VerifyResult:
    """Greedy walk: from the root, descend to the first child and scan its
    siblings for the target's argmax at the parent; accept, repeat.

    candidates, target_predict: [B, T] int64 (node tokens, node 0 = root; the
    target's argmax at each node). Links: [B, T] int64. Returns ``VerifyResult``
    with accepted-path arrays max_depth + 1 wide.
    """
    accept_index, cur, alive = _walk_start(candidates.shape[0], max_depth, candidates.device)
    for depth in range(1, max_depth + 1):
        wanted = _at(target_predict, cur)

        def accepts(child: torch.Tensor, k: int, scanning: torch.Tensor) -> torch.Tensor:
            return _at(candidates, child) == wanted

        chosen = _first_accepted_child(_at(retrieve_next_token, cur), alive, retrieve_next_sibling, accepts)
        alive, cur = _descend(accept_index, depth, alive, cur, chosen)
    accept_tokens = torch.where(
        accept_index >= 0, target_predict.gather(1, accept_index.clamp(min=0)), torch.full_like(accept_index, -1)
    )
    return _verify_result(accept_index, accept_tokens)


def verify_tree_sampling(
    candidates: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    exponentials: torch.Tensor,
    max_depth: int,
) -> VerifyResult:
    """Target-only recursive rejection over the tree (temperature > 0).

    From the root: test the node's children in sibling order. A child with
    token c is accepted when ``coins[child] * mass < p_res(c)``, i.e. with
    probability p_res(c) / mass, where p is the target's distribution at the
    node, p_res is p with every already rejected sibling token zeroed (a
    duplicate of a rejected token has p_res 0) and mass = 1 - the p_res of
    the siblings rejected so far (``mass = mass - p_res(c)`` on each
    rejection). An accepted child becomes the node; when no child is accepted
    (or the node has none) the step's last token is drawn from p_res at that
    node by an exponential race: ``argmax_t p_res(t) / exponentials[t]``
    (first index on ties; NaN ranks above everything, as in torch.argmax),
    which is a draw from p_res / sum(p_res) for Exp(1) draws.

    Each emitted token is then distributed exactly as the target's p (for any
    deterministic draft: the drafts need no probabilities, so reduced-vocabulary
    EAGLE-3 heads are exact too): P(child c) = p(c), and the residual puts the
    rest of the mass on the remaining tokens in proportion to p.

    Two cases the rule above leaves open, defined here so that every
    implementation agrees:

    * a candidate token outside [0, V) has p = 0 (never accepted, zeroes
      nothing in the residual);
    * an empty residual (no p_res(t) / exponentials[t] above 0: every token
      of positive probability was a rejected child, which takes a row that
      sums to less than 1 in floating point) falls back to the race over p
      itself, ``argmax_t p(t) / exponentials[t]``, so the drawn token is never
      one of probability 0 (with plain argmax it would be token 0).

    candidates, links: [B, T] int64 as in ``verify_tree_greedy``.
    target_probs: [B, T, V] float32 or float64, the target's next-token
        distribution at each node after the engine's sampling transforms
        (rows sum to 1).
    coins: [B, T] same dtype, U[0, 1): node j's coin is used when node j is
        tested as a child (the root's is unused).
    exponentials: [B, V] same dtype, Exp(1) (> 0): the request's final draw.
    max_depth: D >= the deepest node's depth; outputs are D + 1 wide.
    Returns ``VerifyResult``; accept_tokens holds the accepted drafts, then
    the drawn token at index accept_length.
    """
    batch, nodes = candidates.shape
    vocab = target_probs.shape[2]
    device = candidates.device
    rows = torch.arange(batch, device=device)
    accept_index, cur, alive = _walk_start(batch, max_depth, device)
    # tokens rejected at the node where each request's walk stopped: zeroed in the final draw
    final_rejected = torch.full((batch, nodes), -1, dtype=torch.int64, device=device)
    for depth in range(1, max_depth + 1):
        p_node = target_probs[rows, cur]  # [B, V]
        mass = torch.ones(batch, dtype=target_probs.dtype, device=device)
        rejected = torch.full((batch, nodes), -1, dtype=torch.int64, device=device)

        def accepts(child: torch.Tensor, k: int, scanning: torch.Tensor) -> torch.Tensor:
            nonlocal mass
            token = _at(candidates, child)
            in_vocab = (token >= 0) & (token < vocab)
            p = _at(p_node, token.clamp(0, vocab - 1))
            duplicate = (rejected == token[:, None]).any(dim=1)
            p = torch.where(in_vocab & ~duplicate, p, torch.zeros_like(p))  # p_res(token)
            hit = _at(coins, child) * mass < p
            miss = scanning & ~hit
            mass = torch.where(miss, mass - p, mass)
            rejected[:, k] = torch.where(miss, token, rejected[:, k])
            return hit

        chosen = _first_accepted_child(_at(retrieve_next_token, cur), alive, retrieve_next_sibling, accepts)
        stops = alive & (chosen < 0)
        final_rejected = torch.where(stops[:, None], rejected, final_rejected)
        alive, cur = _descend(accept_index, depth, alive, cur, chosen)
    p_final = target_probs[rows, cur]  # [B, V]
    final_rejected = torch.where((final_rejected >= 0) & (final_rejected < vocab), final_rejected, -1)
    residual = p_final.clone()
    residual.scatter_(1, final_rejected.clamp(min=0), 0.0)  # -1 entries zero token 0 ...
    keep0 = ~(final_rejected == 0).any(dim=1)  # ... so token 0 is restored unless really rejected
    residual[:, 0] = torch.where(keep0, p_final[:, 0], residual[:, 0])
    race = residual / exponentials
    drawn = race.argmax(dim=1)
    empty = ~(race.gather(1, drawn[:, None])[:, 0] > 0)  # nothing of positive probability left (or NaN)
    drawn = torch.where(empty, (p_final / exponentials).argmax(dim=1), drawn)
    accept_tokens = torch.full_like(accept_index, -1)
    next_node = torch.cat([accept_index[:, 1:], accept_index.new_full((batch, 1), -1)], dim=1)
    accept_tokens = torch.where(next_node >= 0, candidates.gather(1, next_node.clamp(min=0)), accept_tokens)
    accept_tokens[rows, _accept_length(accept_index)] = drawn
    return _verify_result(accept_index, accept_tokens)


def move_accepted_kv(
    caches: Sequence[torch.Tensor],
    verify_slots: torch.Tensor,
    accept_index: torch.Tensor,
    accept_length: torch.Tensor,
) -> None:
    """In place: for every request, slot of depth d <- slot of node accept_index[d].

    caches: tensors viewed as [num_blocks, block_size, ...] (slot s is
    [s // block_size, s % block_size]; any strides). verify_slots: [B, T] int64
    slot of each node. accept_index: [B, D + 1] node indices, -1 padded;
    accept_length: [B]. All sources are read before any destination is written.
    """
    width = accept_index.shape[1]
    nodes = verify_slots.shape[1]
    depth = torch.arange(width, device=verify_slots.device)
    index = accept_index.to(torch.int64)
    moving = (depth <= accept_length[:, None].to(torch.int64)) & (index >= 0) & (index != depth)
    # Entries that do not move copy the root's slot onto itself instead of being filtered out
    # (a boolean filter would read the device): no moving entry writes there (depth 0 never
    # moves), and every such write stores the value read before any write.
    root = verify_slots[:, :1].expand_as(index)
    src = torch.where(moving, verify_slots.gather(1, index.clamp(min=0)), root).flatten()
    dst = torch.where(moving, verify_slots.gather(1, depth.clamp(max=nodes - 1).expand_as(index)), root).flatten()
    coords = {}  # block size -> (src block, src offset, dst block, dst offset): once, not per layer
    for cache in caches:
        block = cache.shape[1]
        if block not in coords:
            coords[block] = (src // block, src % block, dst // block, dst % block)
        src_block, src_offset, dst_block, dst_offset = coords[block]
        cache[dst_block, dst_offset] = cache[src_block, src_offset]  # advanced indexing reads a copy first
