"""The reference ops against the brute-force oracle (tests/oracle.py), on
SGLang-shaped random draft pools with ties, probability-one chains and
underflow. Triton/CUDA are compared with the reference in test_triton_ops.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import oracle
import spec_tree_kernels as K
from pools import FLAVORS, random_batch
from spec_tree_kernels import TreeMaskMode as M


@st.composite
def tree_configs(draw, max_nodes=40, max_topk=4, max_steps=6, max_batch=6):
    topk = draw(st.integers(1, max_topk))
    num_steps = draw(st.integers(1, max_steps))
    pool = K.pool_size(topk, num_steps)
    nodes = draw(st.integers(1, min(pool + 1, max_nodes)))
    batch = draw(st.integers(1, max_batch))
    flavor = draw(st.sampled_from(FLAVORS))
    seed = draw(st.integers(0, 2**31))
    return topk, num_steps, nodes, batch, flavor, seed


def make_case(topk, num_steps, nodes, batch, flavor, seed):
    rng = random.Random(seed)
    scores, parent_list = random_batch(rng, batch, topk, num_steps, flavor)
    seq_lens = torch.tensor([rng.randint(0, 40) for _ in range(batch)], dtype=torch.int64)
    return rng, scores, parent_list, seq_lens


@settings(max_examples=400, deadline=None)
@given(tree_configs())
def test_selection_matches_oracle_and_is_closed(config):
    topk, num_steps, nodes, batch, flavor, seed = config
    _, scores, parent_list, _ = make_case(*config)
    selected = K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes, impl="torch")
    assert selected.shape == (batch, nodes - 1) and selected.dtype == torch.int64
    for b in range(batch):
        expected = oracle.select(scores[b].tolist(), parent_list[b].tolist(), topk, nodes)
        assert selected[b].tolist() == expected
        assert oracle.is_closed(expected, parent_list[b].tolist(), topk)


@settings(max_examples=200, deadline=None)
@given(tree_configs(), st.booleans())
def test_selection_equals_global_topk_without_boundary_ties(config, use_double):
    """Where the (T-1)-th and T-th best scores differ, the set is SGLang's torch.topk set."""
    topk, num_steps, nodes, batch, _, seed = config
    _, scores, parent_list, _ = make_case(topk, num_steps, nodes, batch, "random", seed)
    scores = scores.double() if use_double else scores
    selected = K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes, impl="torch")
    for b in range(batch):
        ranked = sorted(scores[b].tolist(), reverse=True)
        if nodes - 1 < len(ranked) and nodes > 1 and ranked[nodes - 2] == ranked[nodes - 1]:
            continue
        sglang = torch.sort(torch.topk(scores[b], nodes - 1).indices).values
        assert selected[b].tolist() == sglang.tolist()


def test_sglang_tie_case_stays_closed():
    """ENGINES.md: scores [0.6, 0.4 | 0.6, 0, 0.4, 0], T=4 - a child with
    probability 1.0 ties its parent; a plain top-k may take {0, 2, 4}, whose
    node 4 hangs off unselected candidate 1."""
    scores = torch.tensor([[0.6, 0.4, 0.6, 0.0, 0.4, 0.0]])
    parent_list = torch.tensor([[-1, 0, 1]])
    selected = K.select_tree_nodes(scores, parent_list, topk=2, num_steps=2, num_draft_tokens=4)
    assert selected.tolist() == [[0, 1, 2]]
    assert not oracle.is_closed([0, 2, 4], [-1, 0, 1], 2)  # what an unlucky top-k returns
    tree = K.build_tree(selected, parent_list, torch.tensor([10]), 2, 2, M.QLEN_ONLY)
    assert tree.positions.tolist() == [[10, 11, 11, 12]]


def test_non_monotone_scores_still_give_a_closed_tree():
    """Scores that are not cumulative probabilities (a child above its parent)
    must not open the tree: the child ranks with its parent's score."""
    scores = torch.tensor([[0.1, 0.05, 0.9, 0.8, 0.0, 0.0]])
    parent_list = torch.tensor([[-1, 0, 1]])
    selected = K.select_tree_nodes(scores, parent_list, 2, 2, 3)
    assert oracle.is_closed(selected[0].tolist(), [-1, 0, 1], 2)
    assert selected.tolist() == [[0, 2]]


@pytest.mark.parametrize("mode", list(M))
@settings(max_examples=120, deadline=None)
@given(config=tree_configs())
def test_build_matches_oracle(mode, config):
    topk, num_steps, nodes, batch, flavor, seed = config
    if mode == M.QLEN_ONLY_BITPACKING:
        nodes = min(nodes, 32)
    _, scores, parent_list, seq_lens = make_case(*config)
    selected = K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes)
    tree = K.build_tree(selected, parent_list, seq_lens, topk, num_steps, mode, impl="torch")
    check_build_against_oracle(tree, selected, parent_list, seq_lens, topk, mode)


def check_build_against_oracle(tree, selected, parent_list, seq_lens, topk, mode):
    batch, nodes = selected.shape[0], selected.shape[1] + 1
    all_parents = []
    for b in range(batch):
        parents = oracle.tree_of(selected[b].tolist(), parent_list[b].tolist(), topk)
        all_parents.append(parents)
        first_child, next_sibling = oracle.links(parents)
        assert tree.positions[b].tolist() == [int(seq_lens[b]) + d for d in oracle.depths(parents)]
        assert tree.retrieve_index[b].tolist() == [b * nodes + i for i in range(nodes)]
        assert tree.retrieve_next_token[b].tolist() == first_child
        assert tree.retrieve_next_sibling[b].tolist() == next_sibling
    mask = tree.tree_mask
    if mode == M.FULL_MASK:
        assert mask.dtype == torch.bool
        assert mask.tolist() == oracle.full_mask_bytes(all_parents, seq_lens.tolist())
    elif mode == M.QLEN_ONLY:
        assert mask.dtype == torch.bool
        assert mask.view(batch, nodes, nodes).tolist() == [oracle.qlen_rows(p) for p in all_parents]
    elif mode == M.QLEN_ONLY_BITPACKING:
        assert mask.numel() == batch * nodes
        assert mask.element_size() == (1 if nodes <= 8 else 2 if nodes <= 16 else 4)
        assert bytes(mask.view(torch.uint8).tolist()) == b"".join(oracle.bitpacked_bytes(p) for p in all_parents)
    elif mode == M.ANCESTOR_BITMASK:
        assert mask.dtype == torch.int64 and mask.shape == (batch, nodes, (nodes + 63) // 64)
        assert mask.tolist() == [oracle.ancestor_words(p) for p in all_parents]
    else:
        assert mask.dtype == torch.int16 and mask.shape == (batch, 2, nodes)
        assert mask[:, 0].tolist() == all_parents
        assert mask[:, 1].tolist() == [oracle.depths(p) for p in all_parents]
    assert mask.numel() * mask.element_size() == sum(
        K.mask_bytes_per_request(mode, nodes, int(seq_lens[b])) for b in range(batch)
    )


@pytest.mark.parametrize("mode", [M.ANCESTOR_BITMASK, M.PARENT_POINTER, M.QLEN_ONLY])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), nodes=st.integers(100, 160), flavor=st.sampled_from(FLAVORS))
def test_build_large_trees(mode, seed, nodes, flavor):
    """No T <= 32 cap: trees of 100..160 nodes from an (8 steps, topk 6) pool."""
    config = (6, 8, nodes, 2, flavor, seed)
    _, scores, parent_list, seq_lens = make_case(*config)
    selected = K.select_tree_nodes(scores, parent_list, 6, 8, nodes)
    tree = K.build_tree(selected, parent_list, seq_lens, 6, 8, mode)
    check_build_against_oracle(tree, selected, parent_list, seq_lens, 6, mode)


@settings(max_examples=300, deadline=None)
@given(config=tree_configs(), data=st.data())
def test_verify_matches_oracle(config, data):
    topk, num_steps, nodes, batch, flavor, seed = config
    rng, scores, parent_list, seq_lens = make_case(*config)
    selected = K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes)
    tree = K.build_tree(selected, parent_list, seq_lens, topk, num_steps)
    candidates, target = random_tokens_with_real_acceptance(rng, selected, parent_list, topk)
    result = K.verify_tree_greedy(candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target, num_steps, impl="torch")
    check_verify_against_oracle(result, selected, parent_list, topk, candidates, target, num_steps)


def random_tokens_with_real_acceptance(rng, selected, parent_list, topk, vocab=5):
    """Node tokens from a tiny vocabulary (duplicate siblings happen) and a
    target that follows a random root-to-node path, then diverges."""
    batch, nodes = selected.shape[0], selected.shape[1] + 1
    candidates = torch.randint(0, vocab, (batch, nodes), generator=torch.Generator().manual_seed(rng.randint(0, 2**31)))
    target = torch.randint(0, vocab, (batch, nodes), generator=torch.Generator().manual_seed(rng.randint(0, 2**31)))
    for b in range(batch):
        parents = oracle.tree_of(selected[b].tolist(), parent_list[b].tolist(), topk)
        node = rng.randrange(nodes)
        while parents[node] != -1:  # make the target agree along node's path
            target[b, parents[node]] = candidates[b, node]
            node = parents[node]
    return candidates, target


def check_verify_against_oracle(result, selected, parent_list, topk, candidates, target, num_steps):
    batch = selected.shape[0]
    width = num_steps + 1
    assert result.accept_index.shape == (batch, width) and result.accept_index.dtype == torch.int32
    assert result.accept_tokens.shape == (batch, width) and result.accept_tokens.dtype == torch.int64
    for b in range(batch):
        parents = oracle.tree_of(selected[b].tolist(), parent_list[b].tolist(), topk)
        path, emitted = oracle.verify(parents, candidates[b].tolist(), target[b].tolist(), num_steps)
        pad = width - len(path)
        assert result.accept_index[b].tolist() == path + [-1] * pad
        assert result.accept_tokens[b].tolist() == emitted + [-1] * pad
        assert int(result.accept_length[b]) == len(path) - 1


def test_verify_accepts_a_full_depth_chain():
    """A chain of num_steps nodes that the target agrees with entirely."""
    steps = 5
    scores = torch.tensor([[1.0] + [1.0] * (steps - 1)])
    parent_list = torch.tensor([[-1, 0] + list(range(1, steps - 1))]) if steps > 1 else torch.empty(1, 0, dtype=torch.int64)
    selected = K.select_tree_nodes(scores, parent_list, 1, steps, steps + 1)
    tree = K.build_tree(selected, parent_list, torch.tensor([7]), 1, steps)
    assert tree.positions.tolist() == [[7, 8, 9, 10, 11, 12]]
    candidates = torch.tensor([[9, 1, 2, 3, 4, 5]])
    target = torch.tensor([[1, 2, 3, 4, 5, 6]])
    result = K.verify_tree_greedy(candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target, steps)
    assert result.accept_index.tolist() == [[0, 1, 2, 3, 4, 5]]
    assert result.accept_length.tolist() == [5]
    assert result.accept_tokens.tolist() == [[1, 2, 3, 4, 5, 6]]


def test_single_node_tree():
    scores, parent_list = torch.rand(3, 6), torch.tensor([[-1, 0, 1]] * 3)
    selected = K.select_tree_nodes(scores, parent_list, 2, 2, 1)
    assert selected.shape == (3, 0)
    tree = K.build_tree(selected, parent_list, torch.tensor([3, 4, 5]), 2, 2, M.ANCESTOR_BITMASK)
    assert tree.tree_mask.tolist() == [[[1]]] * 3
    result = K.verify_tree_greedy(torch.zeros(3, 1, dtype=torch.int64), tree.retrieve_next_token, tree.retrieve_next_sibling, torch.tensor([[4], [5], [6]]), 2)
    assert result.accept_tokens.tolist() == [[4, -1, -1], [5, -1, -1], [6, -1, -1]]


@settings(max_examples=200, deadline=None)
@given(config=tree_configs(max_nodes=24), block_size=st.sampled_from([1, 4, 16]), data=st.data())
def test_move_accepted_kv_matches_oracle(config, block_size, data):
    topk, num_steps, nodes, batch, flavor, seed = config
    rng, scores, parent_list, seq_lens = make_case(*config)
    selected = K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes)
    tree = K.build_tree(selected, parent_list, seq_lens, topk, num_steps)
    candidates, target = random_tokens_with_real_acceptance(rng, selected, parent_list, topk)
    result = K.verify_tree_greedy(candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target, num_steps)
    caches, verify_slots = paged_caches(rng, batch, nodes, block_size, layers=2)
    expected = [slot_rows(c) for c in caches]
    for b in range(batch):
        path = [i for i in result.accept_index[b].tolist() if i >= 0]
        for layer in range(len(caches)):
            expected[layer] = oracle.move_rows(expected[layer], verify_slots[b].tolist(), path)
    K.move_accepted_kv(caches, verify_slots, result.accept_index, result.accept_length, impl="torch")
    assert [slot_rows(c) for c in caches] == expected


def paged_caches(rng, batch, nodes, block_size, layers, heads=2, head_dim=3, layout="flash", dtype=torch.float32):
    """Per-layer [num_blocks, block_size, H, D] views with unique row values, and
    each request's T verify slots placed after a random context in its own
    scattered blocks (vLLM/SGLang allocate them contiguously in token order)."""
    per_request_blocks = (40 + nodes) // block_size + 2
    num_blocks = batch * per_request_blocks + 3
    block_ids = list(range(num_blocks))
    rng.shuffle(block_ids)
    verify_slots = []
    for b in range(batch):
        blocks = block_ids[b * per_request_blocks : (b + 1) * per_request_blocks]
        start = rng.randint(0, 40)
        token_slots = [blocks[t // block_size] * block_size + t % block_size for t in range(start, start + nodes)]
        verify_slots.append(token_slots)
    caches = []
    for layer in range(layers):
        values = torch.arange(num_blocks * block_size * heads * head_dim, dtype=torch.float32) + 10_000 * layer
        if layout == "flash":  # vLLM GPU: [num_blocks, block_size, H, D]
            cache = values.view(num_blocks, block_size, heads, head_dim).to(dtype)
        else:  # vLLM CPU: [num_blocks, H, block_size, D] seen through a permuted view
            cache = values.view(num_blocks, heads, block_size, head_dim).to(dtype).permute(0, 2, 1, 3)
        caches.append(cache)
    return caches, torch.tensor(verify_slots, dtype=torch.int64)


def slot_rows(cache):
    blocks, block_size = cache.shape[:2]
    return [cache[s // block_size, s % block_size].tolist() for s in range(blocks * block_size)]


def one_storage_listed_twice(layout="flash", device="cpu"):
    """K and V halves of one layer's storage, K listed twice (as vLLM lists a
    KV-sharing layer's cache next to its target's). Path [0, 2, 5] overlaps
    sources and destinations, so a second pass over K would corrupt it."""
    rng = random.Random(0)
    (kv,), slots = paged_caches(rng, batch=1, nodes=6, block_size=4, layers=1, head_dim=6, layout=layout)
    expected = oracle.move_rows(slot_rows(kv), slots[0].tolist(), [0, 2, 5])
    kv, slots = kv.to(device), slots.to(device)
    k, v = kv[..., :3], kv[..., 3:]
    index = torch.tensor([[0, 2, 5]], dtype=torch.int64, device=device)
    length = torch.tensor([2], dtype=torch.int64, device=device)
    # another tensor object over the same memory, and the same bytes as another dtype of the same size
    return kv, [k, v, k.view(k.shape), k.view(torch.int32)], slots, index, length, expected


@pytest.mark.parametrize("layout", ["flash", "cpu"])
def test_move_kv_moves_a_repeated_view_once(layout):
    kv, caches, slots, index, length, expected = one_storage_listed_twice(layout)
    assert [id(c) for c in K.api.distinct_views(caches)] == [id(c) for c in caches[:2]]  # V shares the storage: kept
    K.move_accepted_kv(caches, slots, index, length, impl="torch")
    assert slot_rows(kv) == expected


# ----------------------------------------------------------------- bad input


def test_nan_scores_are_an_error():
    scores = torch.tensor([[0.5, float("nan"), 0.2, 0.1, 0.0, 0.0]])
    with pytest.raises(ValueError, match="NaN"):
        K.select_tree_nodes(scores, torch.tensor([[-1, 0, 1]]), 2, 2, 3)


def test_unvalidated_nan_never_opens_the_tree():
    scores = torch.tensor([[float("nan"), 0.4, 0.3, 0.2, 0.1, 0.05]])
    parent_list = torch.tensor([[-1, 0, 1]])
    selected = K.select_tree_nodes(scores, parent_list, 2, 2, 4, validate=False)
    assert oracle.is_closed(selected[0].tolist(), [-1, 0, 1], 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_draft_tokens=8), "num_draft_tokens=8 asks for 7 nodes from a pool of 6"),
        (dict(topk=3), "scores has 6 candidates"),
        (dict(scores=torch.zeros(1, 6, dtype=torch.int64)), "scores must have dtype"),
        (dict(parent_list=torch.tensor([[-1, 0]])), "parent_list must have shape"),
        (dict(parent_list=torch.tensor([[-1, 0, 1.0]])), "parent_list must have dtype"),
        (dict(parent_list=torch.tensor([[-1, 0, 5]])), r"parent_list\[0, 2\] = 5"),
        (dict(topk=0), "topk must be a positive int"),
        (dict(scores=torch.zeros(6)), "scores must be 2-D"),
    ],
)
def test_select_rejects_bad_input(kwargs, message):
    args = dict(scores=torch.rand(1, 6), parent_list=torch.tensor([[-1, 0, 1]]), topk=2, num_steps=2, num_draft_tokens=4)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        K.select_tree_nodes(**args)


def test_build_rejects_an_open_tree():
    with pytest.raises(ValueError, match="not a closed tree"):
        K.build_tree(torch.tensor([[0, 2, 4]]), torch.tensor([[-1, 0, 1]]), torch.tensor([10]), 2, 2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(mode="QLEN_ONLY_BITPACKING", nodes=40), "exceeds mask mode QLEN_ONLY_BITPACKING"),
        (dict(mode="NOPE"), "unknown tree mask mode 'NOPE'"),
        (dict(seq_lens=torch.tensor([1, 2])), "seq_lens has 2 entries for 1 requests"),
        (dict(seq_lens=torch.tensor([1.0])), "seq_lens must have dtype"),
        (dict(selected_index=torch.tensor([[0, 999]])), "outside the candidate pool"),
    ],
)
def test_build_rejects_bad_input(kwargs, message):
    nodes = kwargs.pop("nodes", 3)
    scores, parent_list = random_batch(random.Random(0), 1, 6, 4, "random")
    args = dict(
        selected_index=K.select_tree_nodes(scores, parent_list, 6, 4, nodes),
        parent_list=parent_list,
        seq_lens=torch.tensor([5]),
        topk=6,
        num_steps=4,
        mode="QLEN_ONLY",
    )
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=message):
        K.build_tree(**args)


def test_verify_rejects_mismatched_shapes():
    ok = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="target_predict has shape"):
        K.verify_tree_greedy(ok, ok, ok, torch.zeros(2, 5, dtype=torch.int64), 3)
    with pytest.raises(TypeError, match="candidates must have dtype"):
        K.verify_tree_greedy(ok.int(), ok, ok, ok, 3)


def test_move_kv_rejects_bad_views():
    slots = torch.zeros(1, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"caches\[0\] must be a 4-D"):
        K.move_accepted_kv([torch.zeros(8, 2)], slots, torch.zeros(1, 3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))


@pytest.mark.parametrize(
    "steps, topk, nodes, mode, message",
    [
        (5, 4, 8, "QLEN_ONLY", None),
        (3, 1, 4, "QLEN_ONLY_BITPACKING", None),
        (2, 2, 8, "QLEN_ONLY", "num_draft_tokens=8 needs 7 draft nodes"),
        (8, 8, 64, "QLEN_ONLY_BITPACKING", "exceeds what mask mode QLEN_ONLY_BITPACKING supports"),
        (8, 8, 64, "ANCESTOR_BITMASK", None),
        (0, 4, 8, "QLEN_ONLY", "num_steps must be a positive int"),
    ],
)
def test_validate_tree_shape(steps, topk, nodes, mode, message):
    if message is None:
        K.validate_tree_shape(steps, topk, nodes, mode)
    else:
        with pytest.raises(ValueError, match=message):
            K.validate_tree_shape(steps, topk, nodes, mode)


def test_mask_bytes_per_request_formulas():
    assert K.mask_bytes_per_request("FULL_MASK", 8, 2000) == 8 * 2008
    assert K.mask_bytes_per_request("QLEN_ONLY", 8, 2000) == 64
    assert K.mask_bytes_per_request("QLEN_ONLY_BITPACKING", 8, 2000) == 8
    assert K.mask_bytes_per_request("QLEN_ONLY_BITPACKING", 9, 0) == 18
    assert K.mask_bytes_per_request("ANCESTOR_BITMASK", 128, 32768) == 128 * 16
    assert K.mask_bytes_per_request("PARENT_POINTER", 128, 32768) == 512
    with pytest.raises(ValueError, match="at most 32 nodes"):
        K.mask_bytes_per_request("QLEN_ONLY_BITPACKING", 33, 0)


@pytest.mark.parametrize("mode", [M.ANCESTOR_BITMASK, M.PARENT_POINTER, M.QLEN_ONLY])
@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), nodes=st.integers(1, 70), batch=st.integers(1, 4))
def test_tree_from_parents_matches_oracle(mode, seed, nodes, batch):
    """Trees kept as parent pointers (the vLLM runner's form), including BFS
    prefixes of them (what vLLM's scheduler leaves when it trims drafts)."""
    rng = random.Random(seed)
    parents = [[-1] + [rng.randrange(i) for i in range(1, nodes)] for _ in range(batch)]
    seq_lens = torch.tensor([rng.randint(0, 50) for _ in range(batch)], dtype=torch.int64)
    for keep in sorted({nodes, max(1, nodes // 2), 1}):
        sub = [p[:keep] for p in parents]
        tree = K.tree_from_parents(torch.tensor(sub), seq_lens, mode)
        for b, p in enumerate(sub):
            first_child, next_sibling = oracle.links(p)
            assert tree.positions[b].tolist() == [int(seq_lens[b]) + d for d in oracle.depths(p)]
            assert tree.retrieve_next_token[b].tolist() == first_child
            assert tree.retrieve_next_sibling[b].tolist() == next_sibling
        if mode == M.ANCESTOR_BITMASK:
            assert tree.tree_mask.tolist() == [oracle.ancestor_words(p) for p in sub]
        elif mode == M.PARENT_POINTER:
            assert tree.tree_mask[:, 0].tolist() == sub
        else:
            assert tree.tree_mask.view(batch, keep, keep).tolist() == [oracle.qlen_rows(p) for p in sub]


@settings(max_examples=100, deadline=None)
@given(tree_configs())
def test_node_parents_of_a_selection_is_the_oracle_tree(config):
    topk, num_steps, nodes, batch, flavor, seed = config
    _, scores, parent_list, _ = make_case(*config)
    selected = K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes)
    got = K.node_parents(selected, parent_list, topk)
    for b in range(batch):
        assert got[b].tolist() == oracle.tree_of(selected[b].tolist(), parent_list[b].tolist(), topk)


@pytest.mark.parametrize("parent,message", [
    ([[0, 0, 1]], "must be -1 for node 0"),
    ([[-1, 1, 0]], "in \\[0, i\\)"),  # a node is its own parent
    ([[-1, 0, 3, 1]], "in \\[0, i\\)"),  # a parent after its child
])
def test_tree_from_parents_rejects_non_trees(parent, message):
    with pytest.raises(ValueError, match=message):
        K.tree_from_parents(torch.tensor(parent), torch.zeros(1, dtype=torch.int64))


def test_node_parents_rejects_an_open_selection():
    # topk 2, 2 steps: pool = 2 roots' children + 4 grandchildren; select a grandchild without its parent
    parent_list = torch.tensor([[-1, 0, 1]])
    with pytest.raises(ValueError, match="not ancestor-closed"):
        K.node_parents(torch.tensor([[0, 4]]), parent_list, 2)
