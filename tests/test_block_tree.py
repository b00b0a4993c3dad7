"""Issue #52 (2, core): DDTree's best-first block tree (``build_block_tree``).

The oracle enumerates every rank sequence (r_1..r_d), d <= L, scores it by a
sequential float32 sum of its (clamped) log-probs, orders all of them by
(score desc, depth asc, parent's order, rank asc) level by level, and keeps
the N first: no best-first loop, no candidate tile. The op's node set,
parents, BFS order and scores must equal it exactly, for the reference and
(bit for bit) for the Triton kernel under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernel_device  # noqa: F401  (TRITON_INTERPRET without a GPU)
import spec_tree_kernels as K
from spec_plugins.tree_drafting import DraftTrees, block_topk, block_trees, chain_counterfactual
from spec_tree_kernels import TreeMaskMode as M
from triton_aot import run_compile_script

INF = float("inf")


# --------------------------------------------------------------------- oracle


def _clamp(x: float) -> np.float32:
    return np.float32(-INF if math.isnan(x) else min(x, 0.0))


def oracle(logp: list, tokens: list, num_nodes: int) -> dict:
    """One request: logp / tokens [L][K] lists. Returns the expected tree as
    lists (tokens N, parents / depths / ranks / scores N + 1), BFS order."""
    length, topk = len(logp), len(logp[0])
    score, order = {(): np.float32(0.0)}, {(): 0}  # order: index within its own depth
    for d in range(1, length + 1):
        level = []
        for path in itertools.product(range(topk), repeat=d):
            score[path] = np.float32(score[path[:-1]] + _clamp(logp[d - 1][path[-1]]))
            level.append(path)
        level.sort(key=lambda p: (-float(score[p]), order[p[:-1]], p[-1]))
        order.update({p: i for i, p in enumerate(level)})
    every = sorted((p for p in score if p), key=lambda p: (-float(score[p]), len(p), order[p]))
    chosen = [()] + sorted(every[:num_nodes], key=lambda p: (len(p), order[p]))
    index = {p: i for i, p in enumerate(chosen)}
    assert all(p[:-1] in index for p in chosen[1:]), "the top N must be ancestor-closed"
    return {
        "tokens": [tokens[len(p) - 1][p[-1]] for p in chosen[1:]],
        "parents": [-1] + [index[p[:-1]] for p in chosen[1:]],
        "depths": [len(p) for p in chosen],
        "ranks": [p[-1] if p else 0 for p in chosen],
        "scores": [float(score[p]) for p in chosen],
    }


def assert_matches_oracle(logp: torch.Tensor, tokens: torch.Tensor, num_nodes: int, tree) -> None:
    R = logp.shape[0]
    assert tree.tokens.shape == (R, num_nodes) and tree.tokens.dtype == torch.int64
    for name in ("parents", "depths", "ranks"):
        assert getattr(tree, name).shape == (R, num_nodes + 1) and getattr(tree, name).dtype == torch.int64
    assert tree.scores.shape == (R, num_nodes + 1) and tree.scores.dtype == torch.float32
    for r in range(R):
        want = oracle(logp[r].tolist(), tokens[r].tolist(), num_nodes)
        for name, expected in want.items():
            assert getattr(tree, name)[r].tolist() == expected, (r, name)
        assert_closed_bfs(tree.parents[r].tolist(), tree.depths[r].tolist())


def assert_closed_bfs(parents: list, depths: list) -> None:
    """Root first, every parent earlier than its child and one level up, depths non-decreasing."""
    assert parents[0] == -1 and depths[0] == 0
    for n in range(1, len(parents)):
        assert 0 <= parents[n] < n and depths[n] == depths[parents[n]] + 1
        assert depths[n] >= depths[n - 1]


# ---------------------------------------------------------------------- inputs

FLAVORS = ("softmax", "dyadic", "all_equal", "certain", "inf_nan", "unsorted")


def make_inputs(rng: random.Random, R: int, L: int, topk: int, flavor: str):
    """[R, L, K] log-probs and token ids, one flavor of ties / specials per call."""
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    if flavor == "softmax":
        values, tokens = block_topk(torch.randn(R, L, 40, generator=gen) * 2, topk)
        return values, tokens
    tokens = torch.randint(0, 1000, (R, L, topk), generator=gen)
    if flavor == "dyadic":  # exact sums, many ties across depths
        values = -torch.randint(0, 6, (R, L, topk), generator=gen).float() / 4
    elif flavor == "all_equal":
        values = torch.full((R, L, topk), math.log(1 / topk))
    elif flavor == "certain":  # some positions put all mass on rank 0
        values = -torch.randint(0, 4, (R, L, topk), generator=gen).float() / 2
        sure = torch.rand(R, L, 1, generator=gen) < 0.5
        values = torch.where(sure, torch.tensor([0.0] + [-INF] * (topk - 1)), values)
    elif flavor == "inf_nan":
        values = -torch.rand(R, L, topk, generator=gen) * 3
        special = torch.rand(R, L, topk, generator=gen)
        values = torch.where(special < 0.2, -INF, torch.where(special < 0.35, float("nan"), values))
    else:  # unsorted garbage, positive values and +inf included
        values = torch.randn(R, L, topk, generator=gen)
        values[torch.rand(R, L, topk, generator=gen) < 0.1] = INF
    if flavor != "unsorted":
        values = torch.sort(values, dim=-1, descending=True).values  # NaN sorts first: still a valid input
    return values, tokens


@st.composite
def block_configs(draw, max_batch=4):
    L = draw(st.integers(1, 5))
    topk = draw(st.integers(1, 4 if L <= 3 else 2))
    capacity = K.block_tree_capacity(L, topk)
    N = draw(st.integers(1, min(capacity, 40)))
    return draw(st.integers(1, max_batch)), L, topk, N, draw(st.sampled_from(FLAVORS)), draw(st.integers(0, 2**31))


# ----------------------------------------------------------------------- tests


@settings(max_examples=300, deadline=None)
@given(block_configs())
def test_reference_matches_oracle(config):
    R, L, topk, N, flavor, seed = config
    logp, tokens = make_inputs(random.Random(seed), R, L, topk, flavor)
    assert_matches_oracle(logp, tokens, N, K.build_block_tree(logp, tokens, N, impl="torch"))


@pytest.mark.parametrize("flavor", FLAVORS)
@pytest.mark.parametrize("shape", [(3, 4, 3, 20), (2, 5, 2, 31), (2, 2, 4, 20), (1, 1, 1, 1), (3, 6, 1, 4)])
def test_triton_equals_reference_and_oracle(shape, flavor):
    R, L, topk, N = shape
    logp, tokens = make_inputs(random.Random(10 * sum(shape) + FLAVORS.index(flavor)), R, L, topk, flavor)
    ref = K.build_block_tree(logp, tokens, N, impl="torch")
    tri = K.build_block_tree(logp, tokens, N, impl="triton")
    for name, a, b in zip(ref._fields, ref, tri):
        assert a.dtype == b.dtype and torch.equal(a, b), name
        if a.is_floating_point():  # bit for bit, signed zeros included
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), name
    assert_matches_oracle(logp, tokens, N, tri)


def test_triton_wide_block_equals_reference():
    """DDTree-sized: a block of 8 positions, top-8, 63 nodes (a 64-node verify)."""
    logp, tokens = block_topk(torch.randn(2, 8, 200, generator=torch.Generator().manual_seed(5)) * 3, 8)
    ref = K.build_block_tree(logp, tokens, 63, impl="torch")
    tri = K.build_block_tree(logp, tokens, 63, impl="triton")
    assert all(torch.equal(a, b) for a, b in zip(ref, tri))
    assert_closed_bfs(ref.parents[0].tolist(), ref.depths[0].tolist())


def test_batch_rows_are_independent():
    """R > 1 with different distributions: each row equals its own call."""
    logp, tokens = make_inputs(random.Random(3), 5, 4, 3, "softmax")
    logp[2] = torch.tensor([0.0, -INF, -INF]).expand(4, 3)  # one request drafts a certain chain first
    whole = K.build_block_tree(logp, tokens, 12)
    for r in range(5):
        alone = K.build_block_tree(logp[r : r + 1], tokens[r : r + 1], 12)
        assert all(torch.equal(a[r : r + 1], b) for a, b in zip(whole, alone))
    assert (whole.scores[2] == 0).sum() == 5 and int(whole.depths[2].max()) == 4  # the certain chain is in
    assert_matches_oracle(logp, tokens, 12, whole)
    assert len({tuple(t.tolist()) for t in whole.tokens}) == 5


def test_all_equal_probabilities_follow_the_tie_rule():
    """Every node at depth d scores d * log(1/K): ties everywhere, so the tree is
    breadth-first, level by level, children of earlier parents first."""
    topk, L = 3, 3
    logp = torch.full((1, L, topk), math.log(1 / 3))
    tokens = torch.arange(L * topk).view(1, L, topk)
    tree = K.build_block_tree(logp, tokens, 7)
    assert tree.depths[0].tolist() == [0, 1, 1, 1, 2, 2, 2, 2]
    assert tree.parents[0].tolist() == [-1, 0, 0, 0, 1, 1, 1, 2]
    assert tree.ranks[0].tolist() == [0, 0, 1, 2, 0, 1, 2, 0]
    assert tree.tokens[0].tolist() == [0, 1, 2, 3, 4, 5, 3]


def test_probability_one_children_never_precede_their_parent():
    """A position of probability 1 ties every child with its parent: the parent
    (shallower) ranks first and the tree stays closed."""
    logp = torch.tensor([[[-0.5, -0.9], [0.0, -INF], [0.0, -INF]]])
    tokens = torch.tensor([[[10, 11], [20, 21], [30, 31]]])
    assert K.build_block_tree(logp, tokens, 1).tokens.tolist() == [[10]]
    tree = K.build_block_tree(logp, tokens, 4)
    assert tree.tokens.tolist() == [[10, 11, 20, 30]]  # 20 and 30 tie 10 (-0.5), then 11 (-0.9): BFS
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 3]]
    assert tree.scores.tolist() == [[0.0, -0.5, pytest.approx(-0.9), -0.5, -0.5]]


def test_nan_ranks_last_and_the_tree_stays_closed():
    logp = torch.tensor([[[-0.1, float("nan")], [float("nan"), -0.2], [-INF, -0.3]]])
    tokens = torch.tensor([[[1, 2], [3, 4], [5, 6]]])
    for impl in ("torch", "triton"):
        tree = K.build_block_tree(logp, tokens, 5, impl=impl)
        # finite paths first: 1, 1-4, 1-4-6; then the -inf ties, shallowest first: 2, then 1-3
        assert tree.tokens[0].tolist() == [1, 2, 4, 3, 6]
        assert tree.parents[0].tolist() == [-1, 0, 0, 1, 1, 3]
        assert torch.isinf(tree.scores[0]).tolist() == [False, False, True, False, True, False]
        assert not torch.isnan(tree.scores).any()  # NaN counts as -inf
        assert_closed_bfs(tree.parents[0].tolist(), tree.depths[0].tolist())
        assert_matches_oracle(logp, tokens, 5, tree)


def test_full_tree_when_the_budget_is_the_capacity():
    logp, tokens = make_inputs(random.Random(9), 2, 3, 2, "softmax")
    tree = K.build_block_tree(logp, tokens, K.block_tree_capacity(3, 2))
    assert tree.depths.tolist() == [[0, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3]] * 2


@pytest.mark.parametrize("mode", [m for m in M if m != M.FULL_MASK])
def test_tree_from_parents_accepts_the_result(mode):
    """Verification reuses the parents path (FULL_MASK is tree_from_parents'
    own refusal: it needs the context); positions = context + depth, and the
    ancestor relation is the block tree's."""
    logp, tokens = make_inputs(random.Random(11), 3, 4, 3, "softmax")
    tree = K.build_block_tree(logp, tokens, 20)
    seq_lens = torch.tensor([5, 17, 0])
    build = K.tree_from_parents(tree.parents, seq_lens, mode)
    assert torch.equal(build.positions, seq_lens[:, None] + tree.depths)
    qlen = K.tree_from_parents(tree.parents, seq_lens, M.QLEN_ONLY).tree_mask.view(3, 21, 21)
    for r in range(3):
        par = tree.parents[r].tolist()
        for n in range(21):
            anc, a = {n}, n
            while par[a] >= 0:
                a = par[a]
                anc.add(a)
            assert [bool(x) for x in qlen[r, n]] == [j in anc for j in range(21)]
    with pytest.raises(ValueError, match="FULL_MASK"):
        K.tree_from_parents(tree.parents, seq_lens, M.FULL_MASK)


def test_greedy_verify_walks_the_block_tree():
    """A target that agrees with the drafter's rank-1 token at depth 1 and the
    rank-0 tokens after it accepts that path through the tree."""
    logp = torch.log(torch.tensor([[[0.6, 0.4], [0.9, 0.1], [0.8, 0.2]]]))
    tokens = torch.tensor([[[10, 11], [20, 21], [30, 31]]])
    tree = K.build_block_tree(logp, tokens, 6)
    build = K.tree_from_parents(tree.parents, torch.tensor([7]), M.ANCESTOR_BITMASK)
    candidates = torch.cat([torch.tensor([[99]]), tree.tokens], 1)
    path = [0]  # root -> 11 -> 20 -> 30
    for want in (11, 20, 30):
        path.append(next(n for n in range(1, 7) if tree.parents[0, n] == path[-1] and candidates[0, n] == want))
    predict = torch.full((1, 7), 5)
    for a, b in zip(path, path[1:]):
        predict[0, a] = candidates[0, b]
    res = K.verify_tree_greedy(candidates, build.retrieve_next_token, build.retrieve_next_sibling, predict, 3)
    assert res.accept_length.tolist() == [3] and res.accept_index[0].tolist() == path
    assert res.accept_tokens[0].tolist() == [11, 20, 30, 5]


def test_reference_compiles_without_graph_breaks():
    """No host read and no data-dependent shape (see test_tree_drafting_graphs)."""
    logp, tokens = make_inputs(random.Random(4), 2, 3, 3, "dyadic")

    def run(logp, tokens):
        return tuple(K.build_block_tree(logp, tokens, 6, impl="torch"))

    graph = torch.compile(run, fullgraph=True, dynamic=False, backend="aot_eager")(logp, tokens)
    assert all(torch.equal(a, b) for a, b in zip(run(logp, tokens), graph))


def test_validation_names_the_bad_argument():
    logp, tokens = make_inputs(random.Random(1), 2, 3, 2, "softmax")
    cases = [
        ((logp[0], tokens, 3), ValueError, "position_logprobs_topk_values must be 3-D"),
        ((logp.long(), tokens, 3), TypeError, "position_logprobs_topk_values must have dtype"),
        ((logp, tokens.int(), 3), TypeError, "topk_tokens must have dtype"),
        ((logp, tokens[:, :2], 3), ValueError, "topk_tokens has shape"),
        ((logp[:, :0], tokens[:, :0], 3), ValueError, "block length L"),
        ((logp, tokens, 0), ValueError, "num_nodes must be a positive int"),
        ((logp, tokens, True), ValueError, "num_nodes must be a positive int"),
        ((logp, tokens, 15), ValueError, "num_nodes=15 exceeds the 14 nodes"),
        (([[0.0]], tokens, 3), TypeError, "position_logprobs_topk_values must be a torch.Tensor"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            K.build_block_tree(*args)
    wide_logp, wide_tokens = make_inputs(random.Random(2), 1, 10, 2, "softmax")
    with pytest.raises(ValueError, match="num_nodes <= 1023"):
        K.build_block_tree(wide_logp, wide_tokens, 1024)
    with pytest.raises(ValueError, match="impl must be one of"):
        K.build_block_tree(logp, tokens, 3, impl="cuda")
    assert K.build_block_tree(logp[:0], tokens[:0], 3).tokens.shape == (0, 3)
    assert K.build_block_tree(logp.double(), tokens, 14).scores.dtype == torch.float32


AOT = """
import json, re
import torch
from triton.backends.compiler import GPUTarget
from triton_aot import compile_launch, resource_usage
from spec_tree_kernels import block_tree_triton as bt
from spec_tree_kernels.triton_launch import capturing
for R, L, K, N in [(4, 8, 8, 63), (2, 16, 4, 255), (1, 1, 1, 1)]:
    with capturing() as held:  # the launch the op makes, held, not run
        bt.build_block_tree(torch.zeros(R, L, K), torch.zeros(R, L, K, dtype=torch.int64), N)
    c = compile_launch(held[0].kernel, held[0].grid, held[0].args, held[0].kwargs, GPUTarget("cuda", 90, 32))
    ops = sorted(set(re.findall(r"\\b(?:div|mul|sub|add|fma)\\.[a-z0-9.]*f32\\b", c.asm["ptx"])))
    print(json.dumps(dict(N=N, ops=ops, **resource_usage(c.asm["cubin"]))))
"""


def test_triton_kernel_compiles_for_sm90():
    """The interpreter accepts code the compiler rejects: compile the op's own
    launches for sm_90 with Triton's bundled ptxas (no GPU needed). Its only
    float arithmetic is the reference's one add per node (no ftz, nothing to
    fuse), and nothing spills, up to N = 255."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton has no NVIDIA backend (sm_90 compiler)")
    rows = run_compile_script(AOT, 3)
    for row in rows:
        assert row["ops"] == ["add.f32"], row
        assert row.get("local", 0) == 0, row


# ----------------------------------------------------------------- the adapter


def test_block_trees_adapter():
    gen = torch.Generator().manual_seed(8)
    d2t = torch.arange(30) * 7 + 1
    logp, tokens = block_topk(torch.randn(3, 4, 30, generator=gen), 3, d2t)
    assert logp.shape == tokens.shape == (3, 4, 3)
    assert torch.equal(tokens % 7, torch.ones_like(tokens)) and (logp[..., :-1] >= logp[..., 1:]).all()
    trees = block_trees(logp, tokens, 10, impl="torch")
    assert isinstance(trees, DraftTrees)
    raw = K.build_block_tree(logp, tokens, 10, impl="torch")
    assert torch.equal(trees.tokens, raw.tokens) and torch.equal(trees.parents, raw.parents)
    assert trees.top1[:, 0].all() and torch.equal(trees.top1, raw.ranks == 0)
    for r in range(3):  # top1: the token is the position's most likely one
        for n in range(1, 11):
            d = int(raw.depths[r, n])
            assert bool(trees.top1[r, n]) == (int(trees.tokens[r, n - 1]) == int(tokens[r, d - 1, 0]))
    # the rank-0 path is the drafter's chain: a tree that accepted it all says so
    chain = [0]
    for _ in range(4):
        kids = [n for n in range(11) if trees.parents[0, n] == chain[-1] and trees.top1[0, n]]
        if not kids:
            break
        chain.append(kids[0])
    paths = torch.tensor([chain + [-1] * (5 - len(chain))])
    lengths, censored = chain_counterfactual(trees.parents[:1], trees.top1[:1], paths, torch.tensor([len(chain) - 1]))
    assert lengths.tolist() == [len(chain) - 1]
    assert censored.tolist() == [True]  # the chain's next node was pruned or never drafted


def test_block_tree_shape_is_bounded_by_the_block_not_by_eagles_pool():
    """(3, 2, 12): 11 drafts fit the 2 + 4 + 8 = 14 rank sequences of a 3-position
    block with top-2 each, not EAGLE's pool of 2 + 2 * 2^2 = 10 candidates; the
    op builds such a tree. Above the block's 14, the shape is refused in the
    spec_tree keys' own names."""
    shape = K.BlockTreeShape(3, 2, 12)
    assert shape.as_tuple() == (3, 2, 12) and shape != K.TreeShape(3, 2, 8)
    with pytest.raises(ValueError, match="only draft 10 candidates"):
        K.TreeShape(3, 2, 12)
    logp = torch.log_softmax(torch.randn(1, 3, 2, generator=torch.Generator().manual_seed(0)), -1).sort(-1,
                                                                                                    True).values
    tree = K.build_block_tree(logp, torch.arange(6).view(1, 3, 2), shape.num_draft_tokens - 1, impl="torch")
    assert tree.parents.shape == (1, 12) and int(tree.depths.max()) == 3
    with pytest.raises(ValueError, match=r"num_draft_tokens=16 needs 15 draft nodes .* num_steps=3 .* topk=2 .* 14"):
        K.BlockTreeShape(3, 2, 16)
    with pytest.raises(ValueError, match="topk must be a positive int"):
        K.BlockTreeShape(3, 0, 4)
