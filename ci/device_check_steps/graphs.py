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
  path order (``spec_plugins.tree_commit``);
* ``verify_attention`` (issue #49, item 3): one layer's tree rows for a
  uniform decode batch (every request T query rows, as a FULL decode graph
  replays them), its metadata read from persistent buffers only: block table
  and sequence lengths as vLLM's FlashAttention metadata holds them, the
  drafted parents; the mask built and the plan made inside the graph, the
  prefix bounded by the block table's reach (a shape), padded requests
  (sequence length 0) harmless;
* ``block_tree``: DDTree's drafting after a block drafter's forward (issue
  #52): each position's top-K of the block logits (``block_topk``) and the
  best-first tree over them (``block_trees``);
* ``recurrent_tree``: a hybrid layer's tree step (causal conv along each
  node's path, GDN and Mamba2 recurrences from each node's parent, the
  accepted path's state and conv window committed; ``recurrent.py``);
* ``draft_level_attention``: one draft level's attention
  (``BranchAttentionPlan``: committed head KV read in place from the paged
  cache, the level's branch KV appended to the scratch, ancestor mask), its
  bound the block table's reach.

A host read inside raises during capture, so a pass means the op is
capturable. Reduced mode (CPU): the same cases through
``torch.compile(fullgraph=True, dynamic=False)`` (a graph break fails them),
as tests/test_tree_drafting_graphs.py does.
"""

from __future__ import annotations

import torch

import spec_tree_kernels as stk
from spec_plugins.tree_drafting import TreeShape, block_topk, block_trees, grow_level, select_trees

from .cases import random_parents
from .plumbing import CheckRun
from .recurrent import recurrent_graph_inputs, recurrent_step

R, K, S, T, H, V = 8, 4, 5, 8, 64, 512
HQ, HKV, D, BLOCK, BLOCKS = 4, 2, 32, 16, 64  # attention cases: heads, head dim, cache blocks of BLOCK tokens


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
    parents = random_parents(g, R, T)
    build = stk.tree_from_parents(parents, torch.full((R,), 100), "ANCESTOR_BITMASK")
    candidates = torch.randint(0, 4, (R, T), generator=g)
    predict = torch.randint(0, 4, (R, T), generator=g)
    return [t.to(device) for t in (candidates, build.retrieve_next_token, build.retrieve_next_sibling, predict)]


def v2_step_inputs(seed: int, device):
    """A step of R trees of T nodes after 5 rows of another request (a prefill chunk)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    parents = random_parents(g, R, T)
    context = torch.randint(50, 150, (R,), generator=g)
    q_starts = 5 + T * torch.arange(R)
    tokens = torch.randint(0, 3, (5 + R * T,), generator=g)
    predict = torch.randint(0, 3, (R, T), generator=g)
    k, v = torch.randn(2, 64, 16, 2, 8, generator=g)  # [num_blocks, block_size, H, D] each
    slots = torch.randperm(64 * 16, generator=g)[: R * T].view(R, T)
    return [t.to(device) for t in (parents, context, q_starts, tokens, predict, k, v, slots)]


def block_logits_inputs(dtype):
    def make(seed: int, device):
        g = torch.Generator(device="cpu").manual_seed(seed)
        return [(torch.randn(R, S, V, generator=g) * 3).to(dtype).to(device)]  # [R, L, V]: L = S mask rows
    return make


def block_tree_step(impl: str):
    def step(logits):
        values, tokens = block_topk(logits, K)
        trees = block_trees(values, tokens, 2 * T - 1, impl=impl)
        return trees.tokens, trees.parents, trees.top1

    return step


def paged_cache(g: torch.Generator, dtype):
    """K and V views [BLOCKS, BLOCK, HKV, D] and a block table [R, BLOCKS // R] of distinct blocks."""
    k, v = torch.randn(2, BLOCKS, BLOCK, HKV, D, generator=g).to(dtype)
    return k, v, torch.randperm(BLOCKS, generator=g).view(R, BLOCKS // R).to(torch.int32)


def verify_attention_inputs(dtype):
    def make(seed: int, device):
        g = torch.Generator(device="cpu").manual_seed(seed)
        k, v, block_table = paged_cache(g, dtype)
        seq_lens = torch.randint(T, BLOCK * (BLOCKS // R), (R,), generator=g, dtype=torch.int32)
        seq_lens[-1] = 0  # a padded request of the graph's batch
        q = torch.randn(R, T, HQ, D, generator=g).to(dtype)
        return [t.to(device) for t in (q, k, v, block_table, seq_lens, random_parents(g, R, T))]
    return make


def verify_attention(impl: str):
    from spec_tree_kernels.attention_plan import TreeAttentionPlan

    def layer(q, k, v, block_table, seq_lens, parents):
        context = (seq_lens.long() - T).clamp(min=0)
        mask = stk.tree_from_parents(parents, context, "ANCESTOR_BITMASK", max_depth=T - 1, validate=False).tree_mask
        plan = TreeAttentionPlan.create(block_table, context, mask, "ANCESTOR_BITMASK", T, BLOCK, None, impl=impl)
        return plan.run(q, k, v, D ** -0.5)

    return layer


def draft_level_inputs_paged(dtype):
    def make(seed: int, device):
        g = torch.Generator(device="cpu").manual_seed(seed)
        k, v, block_table = paged_cache(g, dtype)
        kv_lens = torch.randint(1, BLOCK * (BLOCKS // R), (R,), generator=g)
        filled = K  # one level already in the scratch: this is the second
        branch = torch.randn(2, R, 2 * K, HKV, D, generator=g).to(dtype)
        query, key, value = torch.randn(3, R * K, HQ, D, generator=g).to(dtype).unbind(0)
        ancestors = torch.rand(R, K, filled, generator=g) > 0.5
        return [t.to(device) for t in (query, key[:, :HKV], value[:, :HKV], k, v, block_table, kv_lens, branch,
                                       ancestors)]
    return make


def draft_level_attention(impl: str):
    from spec_tree_kernels.branch_attention import BranchAttentionPlan

    def level(query, key, value, k, v, block_table, kv_lens, branch, ancestors):
        plan = BranchAttentionPlan.create(block_table, kv_lens, block_table.shape[1] * BLOCK, BLOCK, impl=impl)
        filled = ancestors.shape[2]
        branch[0, :, filled:filled + K] = key.view(R, K, HKV, D)
        branch[1, :, filled:filled + K] = value.view(R, K, HKV, D)
        out = torch.empty(R, K, HQ, D, dtype=query.dtype, device=query.device)
        return plan.run(query.view(R, K, HQ, D), k, v, branch[0], branch[1], filled + K, ancestors, D ** -0.5,
                        out)

    return level


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
    dtype = torch.float32 if run.reduced else torch.bfloat16
    for impl in ["torch"] if run.reduced else ["triton"]:
        yield f"verify_attention_{impl}", verify_attention_inputs(dtype), verify_attention(impl)
        yield f"draft_level_attention_{impl}", draft_level_inputs_paged(dtype), draft_level_attention(impl)
        yield f"block_tree_{impl}", block_logits_inputs(dtype), block_tree_step(impl)
        yield f"recurrent_tree_{impl}", recurrent_graph_inputs, recurrent_step(impl)


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
