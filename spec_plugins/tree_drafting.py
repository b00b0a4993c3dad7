"""EAGLE-2 dynamic tree drafting, engine-free and batched (torch + spec_tree_kernels).

One function expands the candidate pool for R requests at once
(``expand_pool``); the head forward of each draft step is a callback, so the
same expansion serves the vLLM adapter (vLLM's own EAGLE model, branch KV in a
scratch tensor read by tree-aware attention) and the HF reference decoder
(``EagleHead`` with a dense KV cache). ``select_trees`` then picks the
``num_draft_tokens - 1`` best candidates of each pool, ancestor-closed.
``block_trees`` builds DDTree's trees from a block drafter's per-position
top-K instead (one forward, no callback).

Pool layout (SGLang's): level 1 holds the K children of the root; every later
level holds K children of each of the K survivors of the level before (K^2
candidates), survivor-major. ``parent_list`` gives the pool index of the parent
of each group of K.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

import spec_tree_kernels as stk
from spec_tree_kernels import TreeShape  # the kernel module's shape type, re-exported for the adapters


@dataclass
class DraftTrees:
    """R requests' trees. tokens [R, T-1] int64: target ids of nodes 1..T-1 in
    BFS order (parents before children); parents [R, T] int64 node-local
    parent of each node, -1 for the root (node 0); top1 [R, T] bool: the node
    is its parent's most likely child (the root: True). The top1 nodes from
    the root down are what a chain drafted from the same head would have
    drafted, so a verified tree also tells what a chain would have accepted
    (``chain_counterfactual``)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    top1: torch.Tensor


# step(level, tokens [R, K], hidden [R, K, H], ancestors [R, K, (level-1)*K] bool)
#   -> (logits [R, K, V_draft], next hidden [R, K, H])
# One head forward of the K frontier nodes of every request at depth ``level``
# (positions: the request's last committed position + level). ``ancestors[r, j, e]``
# says whether branch entry e (level l's frontier j' is entry (l-1)*K + j') is an
# ancestor of frontier node j; the callback keeps the branch KV itself, appending
# the K entries of each level in order, and each node also attends to its own KV.
DraftStep = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def expand_pool(first_logits: torch.Tensor, first_hidden: torch.Tensor, draft_to_target: torch.Tensor | None,
                num_steps: int, topk: int, step: DraftStep):
    """EAGLE-2 expansion for R requests in SGLang's pool layout.

    first_logits [R, V_draft]: the head's logits at each request's last
    committed position (they rank the root's children); first_hidden [R, H]:
    the head's hidden there; draft_to_target [V_draft] int64 target id of each
    draft logit (None: the same vocabulary). Scores are cumulative path
    probabilities (softmax over the draft vocabulary at each level).
    Returns (scores [R, P] float32, pool_tokens [R, P] int64 target ids,
    parent_list [R, 1 + (S-1)K] int64), P = K + (S-1)K^2.
    """
    K = topk
    R, H = first_hidden.shape
    device = first_logits.device

    def to_target(draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if draft_to_target is None else draft_to_target[draft_ids]

    top_p, top_i = softmax_topk(first_logits, K)  # [R, K]
    pool_scores, pool_tokens = [top_p], [to_target(top_i)]
    parents = [torch.arange(-1, K, device=device).expand(R, K + 1)]
    surv_scores, surv_tokens = top_p, pool_tokens[0]
    surv_hidden = first_hidden[:, None].expand(R, K, H)
    surv_anc = torch.zeros(R, K, 0, dtype=torch.bool, device=device)
    for level in range(1, num_steps):
        logits, hidden = step(level, surv_tokens, surv_hidden, surv_anc)
        expand, child_tokens, survivors = grow_level(logits, hidden, surv_scores, surv_anc, draft_to_target, level,
                                                     keep=level < num_steps - 1)
        pool_scores.append(expand)
        pool_tokens.append(child_tokens)
        if survivors is not None:
            best_parents, surv_scores, surv_tokens, surv_hidden, surv_anc = survivors
            parents.append(best_parents)
    parent_list = (torch.cat(parents, 1) if num_steps > 1
                   else torch.empty(R, 0, dtype=torch.int64, device=device))
    return torch.cat(pool_scores, 1), torch.cat(pool_tokens, 1), parent_list


def grow_level(logits: torch.Tensor, hidden: torch.Tensor, surv_scores: torch.Tensor, surv_anc: torch.Tensor,
               draft_to_target: torch.Tensor | None, level: int, keep: bool):
    """One level of ``expand_pool`` after the head's forward (device ops with
    static shapes, no host read: ``torch.compile(fullgraph=True)`` holds it,
    tests/test_tree_drafting_graphs.py).

    logits [R, K, V_draft] / hidden [R, K, H]: the head at the K survivors;
    surv_scores [R, K] their path scores; surv_anc [R, K, (level-1)K] bool
    their ancestors among the branch entries. Returns (expand [R, K*K] child
    path scores, survivor-major; child_tokens [R, K*K] target ids; None when
    ``keep`` is False (the last level), else (pool parent index of each new
    survivor [R, K], and the K new survivors' scores, tokens, hidden, ancestors)).
    """
    R, K, H = hidden.shape
    own = torch.eye(K, dtype=torch.bool, device=logits.device).expand(R, K, K)
    row_anc = torch.cat([surv_anc, own], -1)  # each frontier node's new entry: its ancestors plus itself
    child_p, child_i = softmax_topk(logits, K)  # [R, K survivors, K children]
    expand = (surv_scores[..., None] * child_p).flatten(1)  # [R, K*K], survivor-major
    child_tokens = (child_i if draft_to_target is None else draft_to_target[child_i]).flatten(1)
    if not keep:
        return expand, child_tokens, None
    best = torch.sort(expand, dim=-1, descending=True, stable=True).indices[:, :K]  # [R, K]
    rows = best // K
    return expand, child_tokens, (best + K * K * (level - 1) + K, expand.gather(1, best), child_tokens.gather(1, best),
                                  hidden.gather(1, rows[..., None].expand(R, K, H)),
                                  row_anc.gather(1, rows[..., None].expand(R, K, row_anc.shape[-1])))


def expand_chain(first_logits: torch.Tensor, first_hidden: torch.Tensor, draft_to_target: torch.Tensor | None,
                 num_steps: int, step: DraftStep) -> torch.Tensor:
    """A topk-1 pool without its scores: the argmax child at each of
    ``num_steps`` levels, as vLLM's own EAGLE chain drafts (a chain's ranking
    never reads the path probabilities: ``select_trees``), for R requests.
    Same inputs as ``expand_pool``; returns pool_tokens [R, num_steps] int64
    target ids (``chain_trees`` makes the trees)."""
    R, H = first_hidden.shape

    def to_target(draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if draft_to_target is None else draft_to_target[draft_ids]

    tokens = [to_target(first_logits.argmax(-1, keepdim=True))]  # [R, 1]
    hidden = first_hidden[:, None]
    ancestors = torch.ones(R, 1, num_steps - 1, dtype=torch.bool, device=first_logits.device)
    for level in range(1, num_steps):
        logits, hidden = step(level, tokens[-1], hidden, ancestors[..., : level - 1])  # every entry before is one
        tokens.append(to_target(logits[:, 0].argmax(-1, keepdim=True)))
    return torch.cat(tokens, 1)


def select_trees(scores: torch.Tensor, pool_tokens: torch.Tensor, parent_list: torch.Tensor, shape: TreeShape,
                 impl: str = "torch") -> DraftTrees:
    """The T - 1 best candidates of each pool as a closed tree (tie-safe,
    ``spec_tree_kernels.select_tree_nodes``), with node-local parents.
    Validation of the pools is off: a NaN score ranks last and the tree stays closed.
    A chain (topk 1) is the pool's first T - 1 entries: each holds the one
    child of the entry before, and path scores never rise along a chain (a
    tie keeps pool order, a NaN's descendants are NaN), so the ranking would
    pick exactly those."""
    if shape.topk == 1:
        return chain_trees(pool_tokens, shape.num_draft_tokens)
    selected = stk.select_tree_nodes(scores, parent_list, shape.topk, shape.num_steps, shape.num_draft_tokens,
                                     validate=False, impl=impl)
    parents = stk.node_parents(selected, parent_list, shape.topk, validate=False)  # closed by construction
    # pool index = K * (survivor group) + rank among its siblings (level 1: the rank itself)
    top1 = torch.cat([torch.ones_like(selected[:, :1], dtype=torch.bool), selected % shape.topk == 0], 1)
    return DraftTrees(tokens=pool_tokens.gather(1, selected), parents=parents, top1=top1)


def chain_trees(pool_tokens: torch.Tensor, num_nodes: int) -> DraftTrees:
    """R chains of ``num_nodes`` nodes from topk-1 pools [R, >= num_nodes - 1]."""
    R = pool_tokens.shape[0]
    parents = torch.arange(-1, num_nodes - 1, device=pool_tokens.device).expand(R, num_nodes)
    return DraftTrees(tokens=pool_tokens[:, : num_nodes - 1], parents=parents,
                      top1=torch.ones(R, num_nodes, dtype=torch.bool, device=pool_tokens.device))


# Elements of a float32 temporary over a drafter's logits at a time (64 MiB;
# ``row_chunks``): a whole float32 copy of [R, L, V] block logits is ~0.6 GB at
# R x L = 1024 rows of a 152k vocabulary, the draft levels' softmax over
# [max_num_seqs x K, V] ~1 GB at 1024 x 4 of a 32k one, memory neither V1's nor
# V2's profile run sees (vLLM's DFlash dummy_run stops after the drafter's
# forward; V2's profiles its EAGLE chain). A chunk is at least one row, whatever V.
FLOAT32_CHUNK_ELEMENTS = 1 << 24


def row_chunks(rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """rows [N, V] as consecutive views of at most max(1, FLOAT32_CHUNK_ELEMENTS // V)
    rows, a whole multiple of 16 rows where that is at least 16: every chunk then
    starts as aligned as ``rows`` does (CUDA's softmax picks its kernel by the
    input's alignment, and the chunked result must equal the whole one). From
    the shape alone: no host read, capturable, traceable with fullgraph=True."""
    per_chunk = max(1, FLOAT32_CHUNK_ELEMENTS // rows.shape[-1])
    if per_chunk >= 16:
        per_chunk -= per_chunk % 16
    return rows.split(per_chunk)


def softmax_topk(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., V] -> ``logits.float().softmax(-1).topk(topk)`` (probabilities [..., K]
    float32, ids [..., K] int64), computed over ``row_chunks``: the float32
    softmax of a chunk of rows at a time, never of all of them. Each row's
    softmax and top-K read that row only, so the result is the unchunked one
    bit for bit (tested on the CPU). CUDA's top-K picks its algorithm by the
    number of rows too: exactly tied probabilities may order differently per
    chunk there, as they may across batch sizes without chunks."""
    vocab = logits.shape[-1]
    parts = [chunk.float().softmax(-1).topk(topk, dim=-1) for chunk in row_chunks(logits.reshape(-1, vocab))]
    shape = (*logits.shape[:-1], topk)
    return torch.cat([p.values for p in parts]).view(shape), torch.cat([p.indices for p in parts]).view(shape)


def block_topk(block_logits: torch.Tensor, topk: int,
               draft_to_target: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A block drafter's forward [R, L, V_draft] logits (position i: the token
    i + 1 places after the last committed one) -> (log-probs [R, L, K]
    float32 sorted descending, target token ids [R, L, K] int64): the inputs
    of ``block_trees``. draft_to_target [V_draft] int64 maps a reduced draft
    vocabulary (None: the same vocabulary).

    ``log_softmax(logits.float()).topk(K)`` without a float32 [R, L, V]: the
    top-K is taken on the logits in their own dtype (log-softmax is monotone,
    and rank 0 is then the logits' argmax, vLLM's DFlash chain token, even
    where two float32 log-probs would round to a tie; exact ties in the
    logits may order either way), and each row's
    log-sum-exp in float32 over a bounded number of rows at a time
    (``row_chunks``)."""
    top, ids = block_logits.topk(topk, dim=-1)
    values = top.float() - row_logsumexp(block_logits).unsqueeze(-1)
    return values, (ids if draft_to_target is None else draft_to_target[ids])


def row_logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] -> [...] float32 log-sum-exp of each row of ``logits.float()``,
    float32 temporaries of one of ``row_chunks`` at a time. A row holding +inf,
    or only -inf, gives NaN, as its log-softmax would (so ``block_topk``
    equals the formula it replaced there too)."""
    vocab = logits.shape[-1]
    parts = []
    for chunk in row_chunks(logits.reshape(-1, vocab)):
        peak = chunk.amax(-1, keepdim=True).float()  # exact in the logits' dtype: one of the row's values
        # promoted to float32 by the subtraction (a new tensor: the logits stay untouched), then exp in place
        total = torch.sub(chunk, peak).exp_().sum(-1)
        parts.append(total.log_().add_(peak.squeeze(-1)))
    return torch.cat(parts).view(logits.shape[:-1]).float()  # float64 logits: summed in float64


def warm_block_drafting(length: int, vocab_size: int, dtype: torch.dtype, device, topk: int, num_nodes: int,
                        impl: str = "auto") -> None:
    """DDTree's draft tail (``block_topk``, then ``block_trees``) once on one
    request's [1, L, V] zero logits, at engine startup: on a GPU the tree's
    Triton kernel compiles here and the top-K and log-sum-exp kernels load,
    not in the first request's step. One request is enough: the tree
    kernel's variant is fixed by (L, K, N), the batch is only its grid, and
    the torch ops compile nothing per shape."""
    logits = torch.zeros(1, length, vocab_size, dtype=dtype, device=device)
    values, tokens = block_topk(logits, topk)
    block_trees(values, tokens, num_nodes, impl=impl)


def block_trees(logprobs_topk: torch.Tensor, tokens_topk: torch.Tensor, num_nodes: int,
                impl: str = "auto") -> DraftTrees:
    """DDTree (arXiv 2604.12989) trees of ``num_nodes`` drafts for R requests
    from one block-drafter forward: logprobs_topk / tokens_topk [R, L, K]
    (``block_topk``), built best-first by path probability
    (``spec_tree_kernels.build_block_tree``: ancestor-closed, BFS order, no
    host read). top1 marks each position's rank-0 token, i.e. the node is its
    parent's most likely child: the top1 nodes from the root down are the
    drafter's own chain (``chain_counterfactual`` applies unchanged)."""
    tree = stk.build_block_tree(logprobs_topk, tokens_topk, num_nodes, impl=impl)
    return DraftTrees(tokens=tree.tokens, parents=tree.parents, top1=tree.ranks == 0)


def _noop_timer(key: str, dt: float) -> None:
    pass


def dense_head_step(head, past_k: torch.Tensor, past_v: torch.Tensor, kv_len: int, timer=_noop_timer) -> DraftStep:
    """A ``DraftStep`` for one request (R = 1) over ``spec_plugins.heads.EagleHead``
    with a dense KV cache past_k/v [kv_len, Hkv, D] (the reference decoder's).
    Branch KV lives in local tensors; nothing is written back."""
    import time

    tree_k = past_k.new_zeros(0, *past_k.shape[1:])
    tree_v = past_v.new_zeros(0, *past_v.shape[1:])

    def step(level, tokens, hidden, ancestors):
        nonlocal tree_k, tree_v
        K = tokens.shape[1]
        n_tree = tree_k.shape[0]
        bias = torch.zeros(K, kv_len + n_tree + K, dtype=past_k.dtype, device=past_k.device)
        bias[:, kv_len : kv_len + n_tree] = torch.where(ancestors[0], 0.0, float("-inf"))
        bias[:, kv_len + n_tree :] = torch.full((K, K), float("-inf"), device=past_k.device).fill_diagonal_(0.0)
        t0 = time.perf_counter()
        positions = torch.full((K,), kv_len + level - 1, device=past_k.device)
        logits, nxt, k, v = head.step(tokens[0], hidden[0], positions, torch.cat([past_k, tree_k]),
                                      torch.cat([past_v, tree_v]), bias)
        timer("draft_step", time.perf_counter() - t0)
        tree_k, tree_v = torch.cat([tree_k, k]), torch.cat([tree_v, v])
        return logits[None], nxt[None]

    return step


def expand_head_pool(head, last_logits, last_hidden, past_k, past_v, kv_len: int, num_steps: int, topk: int,
                     timer=_noop_timer):
    """One request's pool from an ``EagleHead`` (the reference decoder's drafting).

    last_logits [V_draft] and last_hidden [H]: the head's output at position
    kv_len - 1; past_k/v [kv_len, Hkv, Dh]: the head's KV of the context.
    Returns (scores [P] float32, pool_tokens [P] target ids, parent_list [1 + (S-1)K] int64).
    """
    step = dense_head_step(head, past_k, past_v, kv_len, timer)
    scores, tokens, parent_list = expand_pool(last_logits[None], last_hidden[None], head.draft_to_target(),
                                              num_steps, topk, step)
    return scores[0], tokens[0], parent_list[0]


def chain_counterfactual(parents: torch.Tensor, top1: torch.Tensor, paths: torch.Tensor,
                         lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a chain drafted by the same head would have accepted, from verified
    greedy trees (host tensors, n trees of T nodes).

    parents [n, T] int64 and top1 [n, T] bool: the trees (``DraftTrees``);
    paths [n, W] int64: each tree's accepted nodes from the root (node 0),
    -1 after the end; lengths [n] int64: accepted draft tokens (path nodes - 1).
    The chain drafts the top-1 child at every depth, so it accepts exactly the
    leading accepted nodes that are top-1 children. When every accepted node
    is, the chain's next token is the top-1 child of the last one: rejected if
    the tree holds it (the target picked none of its children), unknown if the
    tree pruned it. Returns (chain_lengths [n] int64, censored [n] bool: the
    length is only a lower bound).
    """
    on_top1 = top1.gather(1, paths.clamp(min=0)) & (paths >= 0)
    chain = on_top1[:, 1:].to(torch.int64).cumprod(1).sum(1)
    last = paths.gather(1, lengths[:, None])
    holds_next = ((parents == last) & top1).any(1)
    return chain, (chain == lengths) & ~holds_next
