"""Issue #37: the tree step's own ops are capturable by construction.

A CUDA graph records device work only: a host read or a data-dependent shape
inside breaks capture. ``torch.compile(fullgraph=True, dynamic=False)`` fails
on exactly those (a graph break is an error), so it proves on the CPU what
``ci/device_check.sh`` (section "graphs") captures and replays on a GPU:

* the draft step after the head's forward (``tree_drafting.grow_level``) and
  the selection of the tree (``select_trees``, the torch path);
* the verify tail: the greedy walk (the reference kernel, whose early exit is
  taken only where reads are free) and the emitted-token grid;
* DDTree's draft tail over a block drafter's logits: the per-position top-K
  with its log-sum-exp over chunks of rows (``block_topk``) and the tree
  (``block_trees``, the torch reference).

aot_eager backend: the check is tracing without breaks, not inductor's code.
"""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_venv.sh builds .venv)")

import spec_tree_kernels as stk  # noqa: E402
from spec_tree_kernels import reference  # noqa: E402

from spec_plugins import tree_drafting  # noqa: E402
from spec_plugins.tree_drafting import TreeShape, block_topk, block_trees, grow_level, select_trees  # noqa: E402

R, K, S, T, H, V = 3, 4, 5, 8, 16, 40


def compiled(fn):
    return torch.compile(fn, fullgraph=True, dynamic=False, backend="aot_eager")


@pytest.mark.parametrize("keep", [True, False])
def test_a_draft_level_compiles_without_graph_breaks(keep, monkeypatch):
    monkeypatch.setattr(tree_drafting, "FLOAT32_CHUNK_ELEMENTS", 5 * V)  # its float32 softmax: 12 rows in 5, 5, 2
    g = torch.Generator().manual_seed(0)
    logits, hidden = torch.randn(R, K, V, generator=g), torch.randn(R, K, H, generator=g)
    scores, anc = torch.rand(R, K, generator=g), torch.rand(R, K, 2 * K, generator=g) > 0.5
    d2t = torch.arange(V) * 3
    eager = grow_level(logits, hidden, scores, anc, d2t, 3, keep)
    graph = compiled(lambda *a: grow_level(*a, d2t, 3, keep))(logits, hidden, scores, anc)
    for a, b in zip(torch.utils._pytree.tree_leaves(eager), torch.utils._pytree.tree_leaves(graph)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_tree_selection_compiles_without_graph_breaks():
    g = torch.Generator().manual_seed(1)
    P = K + (S - 1) * K * K
    scores, tokens = torch.rand(R, P, generator=g), torch.randint(0, 100, (R, P), generator=g)
    survivors = [torch.rand(R, K * K, generator=g).argsort(-1)[:, :K] + K * K * (lvl - 1) + K for lvl in range(1, S - 1)]
    parent_list = torch.cat([torch.arange(-1, K).expand(R, K + 1), *survivors], 1)
    shape = TreeShape(S, K, T)
    eager = select_trees(scores, tokens, parent_list, shape, impl="torch")
    graph = compiled(lambda *a: select_trees(*a, shape, impl="torch"))(scores, tokens, parent_list)
    for name in ("tokens", "parents", "top1"):
        assert torch.equal(getattr(eager, name), getattr(graph, name)), name


def test_the_ddtree_draft_tail_compiles_without_graph_breaks(monkeypatch):
    L, N = 4, 10
    monkeypatch.setattr(tree_drafting, "FLOAT32_CHUNK_ELEMENTS", 5 * V)  # 12 rows: chunks of 5, 5 and 2
    logits = torch.randn(R, L, V, generator=torch.Generator().manual_seed(4)).bfloat16()

    def tail(logits):
        values, tokens = block_topk(logits, K)
        trees = block_trees(values, tokens, N, impl="torch")
        return values, trees.tokens, trees.parents, trees.top1

    for a, b in zip(tail(logits), compiled(tail)(logits)):
        assert torch.equal(a, b)


def test_the_verify_tail_compiles_without_graph_breaks():
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 3], [-1, 0, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 0, 0, 0, 0, 0]])
    build = stk.tree_from_parents(parents, torch.tensor([10, 20, 30]), "ANCESTOR_BITMASK")
    g = torch.Generator().manual_seed(2)
    candidates = torch.randint(0, 6, (3, T), generator=g)
    predict = torch.randint(0, 6, (3, T), generator=g)
    predict[:, 0] = candidates[:, 1]  # accept something

    def tail(candidates, next_token, next_sibling, predict):
        res = reference.verify_tree_greedy(candidates, next_token, next_sibling, predict, T - 1)
        last = res.accept_index.long().gather(1, res.accept_length.long()[:, None])[:, 0]
        return res, last

    eager = tail(candidates, build.retrieve_next_token, build.retrieve_next_sibling, predict)
    graph = compiled(tail)(candidates, build.retrieve_next_token, build.retrieve_next_sibling, predict)
    for a, b in zip(torch.utils._pytree.tree_leaves(eager), torch.utils._pytree.tree_leaves(graph)):
        assert torch.equal(a, b)
    assert int(eager[0].accept_length.max()) > 0


def test_the_v2_step_plan_and_commit_compile_without_graph_breaks():
    """What the V2 tree runner does on the device around the target forward
    (issue #49): the tree build from the drafted parents (no validation: no
    host read), the walk, and the gather of each tree's accepted path into
    chain order (``tree_commit``)."""
    from spec_plugins.tree_commit import linear_positions, node_rows, path_order

    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 3], [-1, 0, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 0, 0, 0, 0, 0]])
    g = torch.Generator().manual_seed(3)
    q_starts, context = torch.tensor([2, 10, 18]), torch.tensor([40, 7, 90])
    tokens = torch.randint(0, 6, (30,), generator=g)
    predict = torch.randint(0, 6, (3, T), generator=g)

    def step(parents, context, q_starts, tokens, predict):
        build = stk.tree_from_parents(parents, context, "ANCESTOR_BITMASK", max_depth=T - 1, validate=False)
        rows = node_rows(q_starts, T)
        res = reference.verify_tree_greedy(tokens[rows], build.retrieve_next_token, build.retrieve_next_sibling,
                                           predict, T - 1)
        source = path_order(tokens.shape[0], q_starts, res.accept_index, T)
        return build.positions, res.accept_tokens, tokens[source], linear_positions(context, T)

    predict[:, 0] = tokens[q_starts + 1]  # every tree accepts its first child at least
    predict[0, 1] = tokens[q_starts[0] + 3]  # and tree 0 goes on off the BFS order (node 1 -> node 3)
    eager = step(parents, context, q_starts, tokens, predict)
    graph = compiled(step)(parents, context, q_starts, tokens, predict)
    for a, b in zip(eager, graph):
        assert torch.equal(a, b)
    gathered = eager[2]
    assert gathered[q_starts[0] + 1] == tokens[q_starts[0] + 1] and gathered[q_starts[0] + 2] == tokens[q_starts[0] + 3]
    assert torch.equal(gathered[:2], tokens[:2]) and torch.equal(gathered[26:], tokens[26:])  # other rows stay
