"""Batched EAGLE-2 expansion (spec_plugins.tree_drafting), engine-free (the per-step
tree attention plan is tested with the kernels, tests/test_tree_attention.py)."""

from __future__ import annotations

import pytest
import torch

import spec_tree_kernels as stk
from spec_plugins.tree_drafting import TreeShape, chain_trees, expand_chain, expand_pool, select_trees


def _random_step(vocab: int, hidden: int, seed: int):
    """A deterministic fake head: logits depend on (request seed, level, token,
    hidden, ancestors), so batching mistakes change the pool."""
    proj = torch.randn(hidden + 1, vocab, generator=torch.Generator().manual_seed(seed))

    def step(level, tokens, hid, ancestors):
        feats = torch.cat([hid, (tokens.float() / vocab + ancestors.sum(-1).float() + level)[..., None]
                           .expand(*tokens.shape, 1)], -1)
        return feats @ proj, hid.roll(1, -1) + tokens[..., None].float() / vocab

    return step


@pytest.mark.parametrize("shape", [(5, 4, 8), (3, 2, 6), (4, 1, 5), (1, 3, 3), (6, 8, 32)])
def test_expand_pool_batched_equals_one_request_at_a_time(shape):
    S, K, T = shape
    R, V, H = 3, 50, 6
    gen = torch.Generator().manual_seed(sum(shape))
    first_logits, first_hidden = torch.randn(R, V, generator=gen), torch.randn(R, H, generator=gen)
    d2t = torch.randperm(200, generator=gen)[:V]
    step = _random_step(V, H, 7)
    batched = expand_pool(first_logits, first_hidden, d2t, S, K, step)
    for r in range(R):
        single = expand_pool(first_logits[r : r + 1], first_hidden[r : r + 1], d2t, S, K, step)
        # tokens and parents exactly; scores to rounding (a matmul over 1 row or R rows may
        # round its last bit differently on some CPUs: AVX-512 kernels are picked by shape)
        (b_scores, b_tokens, b_parents), (s_scores, s_tokens, s_parents) = batched, single
        assert torch.equal(b_tokens[r], s_tokens[0]) and torch.equal(b_parents[r], s_parents[0])
        torch.testing.assert_close(b_scores[r], s_scores[0], rtol=1e-5, atol=1e-7)
    scores, tokens, parent_list = batched
    assert scores.shape == (R, stk.pool_size(K, S)) and parent_list.shape == (R, stk.parent_list_width(K, S))
    assert set(tokens.flatten().tolist()) <= set(d2t.tolist())  # target ids through d2t
    trees = select_trees(scores, tokens, parent_list, TreeShape(S, K, T))
    assert trees.tokens.shape == (R, T - 1) and trees.parents.shape == (R, T)
    assert (trees.parents[:, 1:] < torch.arange(1, T)).all() and (trees.parents[:, 0] == -1).all()


def test_expand_pool_passes_each_frontier_its_ancestors():
    """The ancestors mask handed to the head: level 2's survivors descend from
    the level-1 entry they were expanded from (checked against the parent_list)."""
    seen = {}
    R, V, H, K = 2, 30, 4, 3
    base = _random_step(V, H, 1)

    def step(level, tokens, hidden, ancestors):
        seen[level] = ancestors.clone()
        return base(level, tokens, hidden, ancestors)

    gen = torch.Generator().manual_seed(0)
    _, _, parent_list = expand_pool(torch.randn(R, V, generator=gen), torch.randn(R, H, generator=gen), None, 3,
                                    K, step)
    assert seen[1].shape == (R, K, 0)
    # level-2 frontier j was expanded from pool candidate parent_list[:, 1 + j] (a level-1 child:
    # index // K gives the level-1 survivor row it came from, which is branch entry row)
    survivors = (parent_list[:, 1 + K : 1 + 2 * K] - K) // K  # rows of level-1 entries
    for r in range(R):
        for j in range(K):
            assert seen[2][r, j].nonzero().flatten().tolist() == [int(survivors[r, j])]


@pytest.mark.parametrize("num_steps", [1, 2, 5])
def test_expand_chain_drafts_what_a_topk1_pool_selects(num_steps):
    """The chain fast path (argmax per level, no scores) drafts the tokens the
    topk-1 pool and its selection give, hands the head the same inputs (every
    branch entry before is an ancestor), and maps through d2t."""
    R, V, H = 4, 60, 6
    gen = torch.Generator().manual_seed(num_steps)
    first_logits, first_hidden = torch.randn(R, V, generator=gen), torch.randn(R, H, generator=gen)
    d2t = torch.randperm(300, generator=gen)[:V]
    calls = {"pool": [], "chain": []}
    base = _random_step(V, H, 9)

    def recording(name):
        def step(level, tokens, hidden, ancestors):
            calls[name].append((level, tokens.clone(), hidden.clone(), ancestors.clone()))
            return base(level, tokens, hidden, ancestors)
        return step

    pool = expand_pool(first_logits, first_hidden, d2t, num_steps, 1, recording("pool"))
    want = select_trees(*pool, TreeShape(num_steps, 1, num_steps + 1))
    got = chain_trees(expand_chain(first_logits, first_hidden, d2t, num_steps, recording("chain")), num_steps + 1)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.parents, want.parents)
    assert len(calls["chain"]) == len(calls["pool"]) == num_steps - 1
    for (l1, t1, h1, a1), (l2, t2, h2, a2) in zip(calls["chain"], calls["pool"]):
        assert l1 == l2 and torch.equal(t1, t2) and torch.equal(h1, h2) and torch.equal(a1, a2)
        assert a1.shape == (R, 1, l1 - 1) and a1.all()


def test_top1_path_is_what_a_chain_drafts():
    """The top1 flags mark, from the root down, exactly the tokens a chain drafted
    by the same head would draft (each node has at most one top1 child)."""
    S, K, T = 5, 4, 10
    R, V, H = 6, 40, 6
    gen = torch.Generator().manual_seed(3)
    first_logits, first_hidden = torch.randn(R, V, generator=gen), torch.randn(R, H, generator=gen)
    step = _random_step(V, H, 5)
    chain = select_trees(*expand_pool(first_logits, first_hidden, None, S, 1, step), TreeShape(S, 1, S + 1))
    tree = select_trees(*expand_pool(first_logits, first_hidden, None, S, K, step), TreeShape(S, K, T))
    assert tree.top1.shape == (R, T) and tree.top1[:, 0].all() and chain.top1.all()
    walked = 0
    for r in range(R):
        node, depth = 0, 0
        while True:
            kids = [j for j in range(1, T) if tree.parents[r, j] == node and tree.top1[r, j]]
            assert len(kids) <= 1
            if not kids:
                break
            node = kids[0]
            assert tree.tokens[r, node - 1] == chain.tokens[r, depth], (r, depth)
            depth += 1
        walked += depth
    assert walked >= R  # the top-1 path is in the tree, at least at depth 1


def test_chain_counterfactual():
    from spec_plugins.tree_drafting import chain_counterfactual

    # node:       0   1  2  3  4  5
    parents = torch.tensor([[-1, 0, 0, 1, 1, 3]] * 4)
    top1 = torch.tensor([[True, True, False, True, False, True]] * 4)  # top-1 path 0-1-3-5
    top1[3, 5] = False  # request 3: node 3's top-1 child was pruned (5 is its second child)
    paths = torch.tensor([[0, 1, 3, 5], [0, 1, 4, -1], [0, 2, -1, -1], [0, 1, 3, -1]])
    lengths = torch.tensor([3, 2, 1, 2])
    chain, censored = chain_counterfactual(parents, top1, paths, lengths)
    # 0: the whole path is top-1, node 5 has no children: chain accepted 3, its next token is unknown
    # 1: 1 is top-1, 4 is not: the chain accepted 1 (definite)
    # 2: 2 is not top-1: the chain accepted 0 (definite)
    # 3: 0-1-3 top-1, path ends at 3 whose top-1 child is not in the tree: 2, censored
    assert chain.tolist() == [3, 1, 0, 2] and censored.tolist() == [True, False, False, True]
    lengths0 = torch.tensor([2, 2, 1, 2])  # request 0 stopping at node 3 (whose top-1 child 5 is held): definite
    paths0 = paths.clone()
    paths0[0, 3] = -1
    chain, censored = chain_counterfactual(parents, top1, paths0, lengths0)
    assert chain[0] == 2 and not censored[0]


@pytest.mark.parametrize("shape", [(5, 1, 6), (5, 1, 4), (1, 1, 2), (8, 1, 9)])
def test_chain_selection_equals_the_tie_safe_ranking(shape):
    """select_trees' chain shortcut (topk 1: the pool's leading entries) picks
    what the tie-safe ranking of select_tree_nodes picks, with probability-one
    ties and NaN scores in the pools."""
    S, K, T = shape
    R = 6
    gen = torch.Generator().manual_seed(S * 10 + T)
    step_p = torch.rand(R, S, generator=gen)
    step_p[1, 1:] = 1.0  # every later step certain: all path scores tie
    step_p[2, 0] = 1.0
    step_p[3, min(2, S - 1)] = float("nan")  # NaN from that depth down
    step_p[4] = 0.0  # underflow to zero everywhere
    scores = step_p.cumprod(1)
    tokens = torch.randint(0, 1000, (R, S), generator=gen)
    # SGLang's layout for topk 1 (expand_pool's): the root's group [-1, 0], then entry level - 1 per level
    parent_list = torch.arange(-1, S - 1).expand(R, S) if S > 1 else torch.empty(R, 0, dtype=torch.int64)
    fast = select_trees(scores, tokens, parent_list, TreeShape(S, K, T))
    selected = stk.select_tree_nodes(scores, parent_list, K, S, T, validate=False)
    assert torch.equal(fast.tokens, tokens.gather(1, selected))
    assert torch.equal(fast.parents, stk.node_parents(selected, parent_list, K))
    assert fast.top1.all() and fast.top1.shape == (R, T)


# ---------------------------------------------------------------- draft levels' float32 softmax


def _level_inputs(R: int, K: int, V: int, H: int, dtype: torch.dtype, seed: int):
    """One draft level's inputs: logits [R, K, V] (with duplicated values, so that
    probabilities tie, and a masked part of the vocabulary), hidden, path scores, ancestors."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(R, K, V, generator=gen) * 4).round() / 4  # many exact ties among the top
    logits[0, 1, V // 2:] = -torch.inf
    hidden, scores = torch.randn(R, K, H, generator=gen), torch.rand(R, K, generator=gen)
    return logits.to(dtype), hidden, scores, torch.rand(R, K, 2 * K, generator=gen) > 0.5


@pytest.mark.parametrize("rows_per_chunk", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_draft_levels_softmax_in_chunks_is_the_whole_softmax_bit_for_bit(dtype, rows_per_chunk, monkeypatch):
    """The draft levels' ``softmax(-1).topk(K)`` in float32, taken over bounded chunks
    of rows (``tree_drafting.softmax_topk``): the same probabilities and ids as over
    all rows at once, bit for bit, ties included; so the pools too (37 rows: chunks
    that leave a short last one)."""
    from spec_plugins import tree_drafting
    from spec_plugins.tree_drafting import grow_level, softmax_topk

    R, K, V, H = 37, 4, 3001, 6
    logits, hidden, scores, anc = _level_inputs(R, K, V, H, dtype, seed=rows_per_chunk)
    whole = logits.float().softmax(-1).topk(K, dim=-1)
    whole_level = grow_level(logits, hidden, scores, anc, None, 2, keep=True)
    first_whole = expand_pool(logits[:, 0], hidden[:, 0], None, 3, K, _random_step(V, H, 3))
    monkeypatch.setattr(tree_drafting, "FLOAT32_CHUNK_ELEMENTS", rows_per_chunk * V + V // 2)
    assert len(tree_drafting.row_chunks(logits.view(-1, V))) == -(-R * K // rows_per_chunk)
    probs, ids = softmax_topk(logits, K)
    assert torch.equal(probs, whole.values) and torch.equal(ids, whole.indices)
    for a, b in zip(torch.utils._pytree.tree_leaves(grow_level(logits, hidden, scores, anc, None, 2, keep=True)),
                    torch.utils._pytree.tree_leaves(whole_level)):
        assert torch.equal(a, b)
    first = expand_pool(logits[:, 0], hidden[:, 0], None, 3, K, _random_step(V, H, 3))
    for a, b in zip(first, first_whole):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_draft_level_holds_no_float32_softmax_of_all_its_rows(dtype, monkeypatch):
    """V2's memory profile runs vLLM's chain, not the tree's draft levels: a level's
    float32 softmax over all R x K rows (~1 GB at 1024 x 4 rows of a 32k vocabulary)
    would be memory the engine never planned for. At chunks of 2 rows of a
    5000-token vocabulary, the CPU allocator's peak while a level's top-K runs
    (``grow_level``, and ``expand_pool``'s first level over R rows) is a chunk's
    float32 softmax, or two where a bf16 chunk is first cast, plus small
    tensors; one float32 softmax of the rows is 8x that bound (same measure as
    tests/test_block_topk.py)."""
    from test_block_topk import allocator_peak

    from spec_plugins import tree_drafting
    from spec_plugins.tree_drafting import grow_level

    R, K, V, H = 8, 4, 5000, 6
    monkeypatch.setattr(tree_drafting, "FLOAT32_CHUNK_ELEMENTS", 2 * V, raising=False)
    logits, hidden, scores, anc = _level_inputs(R, K, V, H, dtype, seed=1)
    chunk_bytes = 2 * V * 4

    def level():
        grow_level(logits, hidden, scores, anc, None, 2, keep=True)

    def first_level():  # one level: the root's children only, no head step
        expand_pool(logits[:, 0], hidden[:, 0], None, 1, K, None)

    for run, rows in ((level, R * K), (first_level, R)):
        run()  # first-call allocations (thread pools, caches) are not the op's
        peak = allocator_peak(run)
        assert peak <= 2 * chunk_bytes + 16 * 1024 < rows * V * 4, (run.__name__, peak, chunk_bytes, rows * V * 4)
