"""Section "graphs" (issue #37): the tree step's own ops in a CUDA graph.

On a GPU, each case is captured once in a ``torch.cuda.CUDAGraph``, then
replayed on new inputs copied into the captured buffers and compared, exactly,
with an eager call on the same inputs:

* ``draft_level``: a draft level after the head's forward
  (``tree_drafting.grow_level``);
* ``select``: the tree selection (``select_trees``, the implementation the
  runner gets on CUDA);
* ``verify_tail``: the greedy walk and each tree's last accepted node, for each
  walk implementation the run has (triton, and cuda once built);
* ``v2_step`` (issue #49): what the V2 tree runner does on the device around
  the target forward, per implementation: the tree build from the drafted
  parents (positions, mask, links; no validation, so no host read), the
  walk, the accepted-path KV move and the gather of each tree's rows into
  path order (``spec_plugins.tree_commit``).

A host read inside raises during capture, so a pass means the op is
capturable. Reduced mode (CPU): the same cases through
``torch.compile(fullgraph=True, dynamic=False)`` (a graph break fails them),
as tests/test_tree_drafting_graphs.py does.
"""

from __future__ import annotations

import torch

import spec_tree_kernels as stk
from spec_plugins.tree_drafting import TreeShape, grow_level, select_trees

from .plumbing import CheckRun

R, K, S, T, H, V = 8, 4, 5, 8, 64, 512


def draft_level_inputs(seed: int, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [t.to(device) for t in (torch.randn(R, K, V, generator=g), torch.randn(R, K, H, generator=g),
                                   torch.rand(R, K, generator=g), torch.rand(R, K, 2 * K, generator=g) > 0.5)]


def select_inputs(seed: int, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    P = K + (S - 1) * K * K
    survivors = [torch.rand(R, K * K, generator=g).argsort(-1)[:, :K] + K * K * (lvl - 1) + K
                 for lvl in range(1, S - 1)]
    return [t.to(device) for t in (torch.rand(R, P, generator=g), torch.randint(0, 100, (R, P), generator=g),
                                   torch.cat([torch.arange(-1, K).expand(R, K + 1), *survivors], 1))]


def verify_inputs(seed: int, device):
    g = torch.Generator(device="cpu").manual_seed(seed)
    parents = torch.stack([torch.cat([torch.tensor([-1]), (torch.rand(T - 1, generator=g) * torch.arange(1, T)).long()])
                           for _ in range(R)])
    build = stk.tree_from_parents(parents, torch.full((R,), 100), "ANCESTOR_BITMASK")
    candidates = torch.randint(0, 4, (R, T), generator=g)
    predict = torch.randint(0, 4, (R, T), generator=g)
    return [t.to(device) for t in (candidates, build.retrieve_next_token, build.retrieve_next_sibling, predict)]


def v2_step_inputs(seed: int, device):
    """A step of R trees of T nodes after 5 rows of another request (a prefill chunk)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    parents = torch.stack([torch.cat([torch.tensor([-1]), (torch.rand(T - 1, generator=g) * torch.arange(1, T)).long()])
                           for _ in range(R)])
    context = torch.randint(50, 150, (R,), generator=g)
    q_starts = 5 + T * torch.arange(R)
    tokens = torch.randint(0, 3, (5 + R * T,), generator=g)
    predict = torch.randint(0, 3, (R, T), generator=g)
    k, v = torch.randn(2, 64, 16, 2, 8, generator=g)  # [num_blocks, block_size, H, D] each
    slots = torch.randperm(64 * 16, generator=g)[: R * T].view(R, T)
    return [t.to(device) for t in (parents, context, q_starts, tokens, predict, k, v, slots)]


def v2_step(impl: str):
    from spec_plugins.tree_commit import node_rows, path_order

    def step(parents, context, q_starts, tokens, predict, k, v, slots):
        build = stk.tree_from_parents(parents, context, "ANCESTOR_BITMASK", max_depth=T - 1, validate=False)
        res = stk.verify_tree_greedy(tokens[node_rows(q_starts, T)], build.retrieve_next_token,
                                     build.retrieve_next_sibling, predict, T - 1, impl=impl)
        stk.move_accepted_kv([k, v], slots, res.accept_index, res.accept_length, impl=impl)
        source = path_order(tokens.shape[0], q_starts, res.accept_index, T)
        return build.positions, build.tree_mask, res.accept_tokens, tokens[source], k, v

    return step


def cases(run: CheckRun):
    d2t = torch.arange(V, device=run.device) * 2
    shape = TreeShape(S, K, T)
    yield "draft_level", draft_level_inputs, lambda *a: grow_level(*a, d2t, 3, True)

    def select(*inputs):
        trees = select_trees(*inputs, shape, impl="torch" if run.reduced else "auto")
        return trees.tokens, trees.parents, trees.top1

    yield "select", select_inputs, select
    for impl in ["torch"] if run.reduced else [i for i in run.impls if i != "torch"]:
        def tail(candidates, next_token, next_sibling, predict, impl=impl):
            res = stk.verify_tree_greedy(candidates, next_token, next_sibling, predict, T - 1, impl=impl)
            return res, res.accept_index.long().gather(1, res.accept_length.long()[:, None])[:, 0]
        yield f"verify_tail_{impl}", verify_inputs, tail
        yield f"v2_step_{impl}", v2_step_inputs, v2_step(impl)


def leaves_equal(a, b) -> bool:
    left, right = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(left) == len(right) and all(torch.equal(x, y) for x, y in zip(left, right))


def capture_and_compare(fn, make_inputs, device) -> dict:
    static = make_inputs(0, device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up off the capture stream (Triton compiles, allocator pools)
        fn(*static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*static)
    replays = []
    for seed in (1, 2, 3):
        fresh = make_inputs(seed, device)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        replays.append(leaves_equal(out, fn(*fresh)))
    torch.cuda.synchronize()
    return {"ok": all(replays), "replays": len(replays)}


def compile_and_compare(fn, make_inputs, device) -> dict:
    graph = torch.compile(fn, fullgraph=True, dynamic=False, backend="aot_eager")
    inputs = make_inputs(1, device)
    return {"ok": leaves_equal(graph(*inputs), fn(*inputs)), "compiled": True}


def run_graphs(run: CheckRun) -> int:
    """The section (module docstring). Returns the number of failed cases."""
    section = run.report.data.setdefault("graphs", {})
    check = compile_and_compare if run.reduced else capture_and_compare
    failed = 0
    for name, make_inputs, fn in cases(run):
        try:
            result = check(fn, make_inputs, run.device)
        except Exception as exc:  # a capture error is this case's failure, not the section's
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
        section[name] = result
        failed += not result["ok"]
        run.report.log(f"  graphs {name}: {'ok' if result['ok'] else 'FAILED'} {result.get('error', '')}")
    section["failed"] = failed
    run.report.save()
    return failed
