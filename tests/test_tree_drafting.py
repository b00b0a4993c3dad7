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
