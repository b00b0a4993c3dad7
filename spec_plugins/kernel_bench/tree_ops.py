"""The tree ops at one benchmark point: inputs, the calls to time, the rows.

``bench_tree_ops(batch, T, contexts, impls, timer)`` times, per
implementation, one verify step's bookkeeping on random SGLang-shaped draft
trees (``synthetic_trees``) whose tokens give real acceptance:

    select           select_tree_nodes (no CUDA kernel: torch and Triton)
    verify           verify_tree_greedy
    verify_sampling  verify_tree_sampling, float32 target distributions over
                     ``vocab`` tokens (Llama-3's 128256 on a GPU), peaked on
                     the greedy target so drafts get accepted
    move_kv          move_accepted_kv over ``kv.layers`` x (K, V) paged caches
    build_<MODE>     build_tree per mask mode at each context (FULL_MASK also
                     without prefix fill: build_FULL_MASK_nofill)

Only ``build_*`` depends on the context: the others are timed once, at the
first context (``CONTEXT_FREE_OPS``). With ``sgl`` (SGLang's kernels loaded by
ci/sglang_spec_tree.py) its Triton build (FULL_MASK, QLEN_ONLY) and verify
join as impl "sglang", and its accepted-KV move as "sglang" (its all-layer
tiled copy, when that kernel was supplied, on CUDA) and "sglang_standin"
(index_select + index_copy_ of the same rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import spec_tree_kernels as K
from spec_tree_kernels import TreeMaskMode as M

from ..synthetic_trees import synthetic_pool
from .points import Call, bench_point
from .timer import Timer

# T -> (topk, num_steps): a draft pool of at least T - 1 candidates
TREE_SHAPES = {8: (4, 3), 16: (4, 5), 32: (8, 4), 64: (8, 6), 128: (8, 8)}
CONTEXT_FREE_OPS = ("select", "verify", "verify_sampling", "move_kv")
SAMPLING_BYTES_LIMIT = 4 << 30  # sampled verify is skipped where target_probs alone would pass this


@dataclass(frozen=True)
class KvCacheShape:
    """The paged KV caches move_kv writes: ``layers`` x (K, V) tensors of
    [blocks, block_size, heads, head_dim]."""

    layers: int
    heads: int
    head_dim: int
    block_size: int


LLAMA3_8B_KV = KvCacheShape(layers=30, heads=8, head_dim=128, block_size=16)  # 32 layers in the model


def kv_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def sampling_vocab(device: torch.device) -> int:
    """Llama-3's vocabulary on a GPU; a small one where only the code is exercised."""
    return 128256 if device.type == "cuda" else 50


# ----------------------------------------------------------------- inputs


def draft_tree(topk: int, num_steps: int, nodes: int, batch: int, flavor: str, seed: int, max_context: int) -> dict:
    """A draft pool and its reference selection, on the CPU: {scores [B, pool]
    float32, parent_list [B, width] int64, seq_lens [B] int64 drawn from
    [0, max_context], selected [B, T-1] int64, gen: the seeded generator, for
    further draws}."""
    scores, parent_list = synthetic_pool(batch, topk, num_steps, flavor, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    seq_lens = torch.randint(0, max_context + 1, (batch,), generator=gen)
    selected = K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes, impl="torch")
    return dict(scores=scores, parent_list=parent_list, seq_lens=seq_lens, selected=selected, gen=gen)


def tokens_with_acceptance(selected, parent_list, topk: int, gen: torch.Generator, vocab: int = 4):
    """(candidates, target), [B, T] int64 on the CPU: node tokens from a tiny
    vocabulary (duplicate siblings) and a target that agrees along a random
    root-to-node path, so verify accepts something."""
    batch, nodes = selected.shape[0], selected.shape[1] + 1
    parent, _ = K.reference.node_parents(selected, parent_list, topk)
    candidates = torch.randint(0, vocab, (batch, nodes), generator=gen)
    target = torch.randint(0, vocab, (batch, nodes), generator=gen)
    for b in range(batch):
        node = int(torch.randint(0, nodes, (1,), generator=gen))
        while node > 0 and int(parent[b, node]) >= 0:
            target[b, int(parent[b, node])] = candidates[b, node]
            node = int(parent[b, node])
    return candidates, target


@dataclass
class TreeOpsInputs:
    """One (batch B, T) point's inputs on the device. scores [B, pool],
    parent_list [B, width], selected [B, T-1]; tree: the reference QLEN_ONLY
    build at context 0 (retrieve_next_token / _sibling [B, T]); candidates,
    target [B, T]; verdict: the reference greedy verify (accept_index
    [B, S+1], accept_length [B]); gen: a CPU generator for further draws."""

    batch: int
    nodes: int
    topk: int
    num_steps: int
    scores: torch.Tensor
    parent_list: torch.Tensor
    selected: torch.Tensor
    tree: K.TreeBuild
    candidates: torch.Tensor
    target: torch.Tensor
    verdict: object
    gen: torch.Generator

    @property
    def device(self) -> torch.device:
        return self.scores.device

    def verify_args(self) -> tuple:
        return (self.candidates, self.tree.retrieve_next_token, self.tree.retrieve_next_sibling, self.target,
                self.num_steps)  # fmt: skip


def tree_ops_inputs(batch: int, nodes: int, device: torch.device) -> TreeOpsInputs:
    """A "random" pool of TREE_SHAPES[T], seeded by (batch, T)."""
    topk, num_steps = TREE_SHAPES[nodes]
    t = draft_tree(topk, num_steps, nodes, batch, "random", 1000 * batch + nodes, 0)
    scores, parent_list, selected = (t[k].to(device) for k in ("scores", "parent_list", "selected"))
    zeros = torch.zeros(batch, dtype=torch.int64, device=device)
    tree, _ = K.reference.build_tree(selected, parent_list, zeros, topk, num_steps, M.QLEN_ONLY, 0)
    candidates, target = (x.to(device) for x in tokens_with_acceptance(t["selected"], t["parent_list"], topk, t["gen"]))
    verdict = K.verify_tree_greedy(candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target, num_steps,
                                   impl="torch")  # fmt: skip
    return TreeOpsInputs(batch, nodes, topk, num_steps, scores, parent_list, selected, tree, candidates, target, verdict,
                         t["gen"])  # fmt: skip


# ------------------------------------------------------------------ calls


def selection_calls(x: TreeOpsInputs, impls):
    for impl in [i for i in impls if i != "cuda"]:  # selection has no CUDA kernel
        yield Call("select", impl, lambda impl=impl: K.select_tree_nodes(
            x.scores, x.parent_list, x.topk, x.num_steps, x.nodes, validate=False, impl=impl))  # fmt: skip


def verify_calls(x: TreeOpsInputs, impls, sgl=None):
    for impl in impls:
        yield Call("verify", impl, lambda impl=impl: K.verify_tree_greedy(*x.verify_args(), impl=impl))
    if sgl is not None:  # SGLang's verify reads its own build's retrieve_* arrays
        mod, api = sgl
        zeros = torch.zeros(x.batch, dtype=torch.int64, device=x.device)
        _, _, index, next_token, next_sibling = api.build_tree(mod, x.parent_list, x.selected, zeros, 0, x.topk,
                                                               x.num_steps, x.nodes, int(M.QLEN_ONLY))  # fmt: skip
        yield Call("verify", "sglang", lambda: api.verify(mod, x.candidates, index, next_token, next_sibling, x.target,
                                                           x.num_steps))  # fmt: skip


def sampled_verify_calls(x: TreeOpsInputs, impls, vocab: int):
    """target_probs [B, T, vocab] float32 (softmax of noise, +8 on the greedy
    target), coins [B, T], exponentials [B, vocab]; freed once timed."""
    if x.batch * x.nodes * vocab * 4 > SAMPLING_BYTES_LIMIT:
        return
    gen = torch.Generator(device=x.device).manual_seed(x.batch * 1000 + x.nodes)
    logits = torch.randn(x.batch, x.nodes, vocab, generator=gen, device=x.device)
    logits.scatter_add_(2, x.target[..., None], torch.full((x.batch, x.nodes, 1), 8.0, device=x.device))
    probs = torch.softmax(logits, dim=-1)
    del logits
    coins = torch.rand(x.batch, x.nodes, generator=gen, device=x.device)
    exps = torch.empty(x.batch, vocab, device=x.device).exponential_(generator=gen)
    args = (x.candidates, x.tree.retrieve_next_token, x.tree.retrieve_next_sibling, probs, coins, exps, x.num_steps)
    for impl in impls:
        yield Call("verify_sampling", impl, lambda impl=impl: K.verify_tree_sampling(*args, impl=impl))


def kv_move_calls(x: TreeOpsInputs, impls, kv: KvCacheShape, sgl=None):
    """kv.layers x (K, V) caches [blocks, block_size, heads, head_dim];
    request b's T verify slots are contiguous, requests in random order."""
    blocks = (x.batch * x.nodes + kv.block_size - 1) // kv.block_size + 1
    caches = [torch.zeros(blocks, kv.block_size, kv.heads, kv.head_dim, dtype=kv_dtype(x.device), device=x.device)
              for _ in range(2 * kv.layers)]  # fmt: skip
    order = torch.randperm(x.batch, generator=x.gen).to(x.device)
    slots = (order[:, None] * x.nodes + torch.arange(x.nodes, device=x.device)).contiguous()  # [B, T]
    index, length = x.verdict.accept_index, x.verdict.accept_length
    for impl in impls:
        yield Call("move_kv", impl, lambda impl=impl: K.move_accepted_kv(caches, slots, index, length, impl=impl))
    if sgl is not None:
        yield from sglang_move_calls(x, [c.view(-1, kv.heads, kv.head_dim) for c in caches], slots, sgl)


def sglang_move_calls(x: TreeOpsInputs, flat_caches, slots, sgl):
    """SGLang has no accepted-KV move kernel of this kind: a stand-in copies the
    rows that move (index_select + index_copy_ per cache), and, where its
    all-layer tiled copy kernel was supplied, its real path moves every
    accepted entry (self-copies and zero padding included, bs * (S + 1)
    locations) as MHATokenToKVPool.move_kv_cache launches it."""
    depth = torch.arange(x.num_steps + 1, device=x.device)
    index = x.verdict.accept_index.long()  # [B, S+1]
    accepted = (depth <= x.verdict.accept_length[:, None].long()) & (index >= 0)
    src_all = slots.gather(1, index.clamp(min=0))
    dst_all = slots.gather(1, depth.clamp(max=x.nodes - 1).expand_as(index))
    moving = accepted & (index != depth)
    src, dst = src_all[moving], dst_all[moving]

    def standin_move():
        for cache in flat_caches:
            cache.index_copy_(0, dst, cache.index_select(0, src))

    yield Call("move_kv", "sglang_standin", standin_move)
    mod, api = sgl
    if hasattr(mod, "copy_all_layer_kv_cache_tiled") and x.device.type == "cuda":
        size, pairs = x.batch * (x.num_steps + 1), int(accepted.sum())
        tgt_loc = torch.zeros(size, dtype=torch.int64, device=x.device)
        src_loc = torch.zeros(size, dtype=torch.int64, device=x.device)
        tgt_loc[:pairs], src_loc[:pairs] = dst_all[accepted], src_all[accepted]
        yield Call("move_kv", "sglang", lambda: api.move_kv(mod, flat_caches, tgt_loc, src_loc))


def build_calls(x: TreeOpsInputs, impls, context: int, sgl=None):
    """build_tree in every mode T fits, every request at ``context``."""
    seq_lens = torch.full((x.batch,), context, dtype=torch.int64, device=x.device)
    total = x.batch * context
    for mode in M:
        if x.nodes > K.modes.max_nodes(mode):
            continue
        for fill in (True, False) if mode == M.FULL_MASK else (True,):
            op = f"build_{mode.name}" + ("" if fill else "_nofill")
            for impl in impls:
                yield Call(op, impl, lambda impl=impl, mode=mode, fill=fill: K.build_tree(
                    x.selected, x.parent_list, seq_lens, x.topk, x.num_steps, mode, seq_lens_sum=total,
                    fill_prefix_mask=fill, validate=False, impl=impl))  # fmt: skip
            if sgl is not None and mode in (M.FULL_MASK, M.QLEN_ONLY):
                mod, api = sgl
                yield Call(op, "sglang", lambda mode=mode, fill=fill: api.build_tree(
                    mod, x.parent_list, x.selected, seq_lens, total, x.topk, x.num_steps, x.nodes, int(mode), fill))  # fmt: skip


# ------------------------------------------------------------------ point


def bench_tree_ops(batch: int, nodes: int, contexts, impls, timer: Timer, *, kv: KvCacheShape = LLAMA3_8B_KV,
                   vocab: int | None = None, sgl=None, deadline: float | None = None,
                   reserve: float = 0.0) -> list[dict]:  # fmt: skip
    """Rows {batch, T, topk, num_steps, context, op, impl, eager_us[, graph_us
    | graph_error] | error, accepted_mean} (module docstring); calls past
    ``deadline`` - ``reserve`` are left out."""
    x = tree_ops_inputs(batch, nodes, timer.device)
    point = dict(batch=batch, T=nodes, topk=x.topk, num_steps=x.num_steps)

    def measure(call: Call) -> dict:  # the torch reference syncs with the host (data-dependent shapes): eager only
        return timer.figures(call.fn, graph=call.impl != "torch")

    def timed(context, calls):
        return bench_point(dict(point, context=context), calls, measure, deadline=deadline, reserve=reserve)

    first = contexts[0]
    rows = timed(first, selection_calls(x, impls))
    rows += timed(first, verify_calls(x, impls, sgl))
    rows += timed(first, sampled_verify_calls(x, impls, vocab or sampling_vocab(x.device)))
    rows += timed(first, kv_move_calls(x, impls, kv, sgl))
    for context in contexts:
        rows += timed(context, build_calls(x, impls, context, sgl))
        if x.device.type == "cuda":
            torch.cuda.empty_cache()
    accepted = round(float(x.verdict.accept_length.float().mean()), 3)
    return [dict(row, accepted_mean=accepted) for row in rows]
