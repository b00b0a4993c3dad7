"""EAGLE-2 dynamic tree drafting, engine-free (torch + spec_tree_kernels).

Shared by the HF reference decoder (``reference_decoder``) and the vLLM
proposer (``vllm_ext.proposer``): given the head's output at the last
committed position and the head's KV cache of the context, expand ``topk``
children per surviving branch for ``num_steps`` levels (SGLang's pool layout),
then pick the ``num_draft_tokens - 1`` best candidates, ancestor-closed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

import spec_tree_kernels as stk


@dataclass(frozen=True)
class TreeShape:
    """num_steps = tree depth D, topk = branching per step, num_draft_tokens = T
    (tree nodes including the root). topk = 1 is a chain with T = D + 1."""

    num_steps: int
    topk: int
    num_draft_tokens: int

    def __post_init__(self):
        stk.validate_tree_shape(self.num_steps, self.topk, self.num_draft_tokens)


@dataclass
class DraftTree:
    """One request's tree: tokens [T - 1] of nodes 1..T-1 (target ids, BFS
    order: parents before children) and parents [T] node-local (-1 for the root)."""

    tokens: list[int]
    parents: list[int]


def _noop_timer(key: str, dt: float) -> None:
    pass


def draft_pool(head, last_logits, last_hidden, past_k, past_v, kv_len: int, num_steps: int, topk: int,
               timer=_noop_timer):
    """EAGLE-2 expansion in SGLang's pool layout.

    head: ``spec_plugins.heads.EagleHead``; last_logits [V_draft] and
    last_hidden [H]: the head's output at position kv_len - 1 (which predicts
    the root's child level); past_k/v [kv_len, Hkv, Dh]: the head's KV of the
    context. Branch KV lives only in local tensors (nothing is written back).
    Returns (scores [P] float32 cumulative probabilities, pool_tokens [P]
    target ids, parent_list [1 + (S-1)K] int64).
    """
    K = topk
    d2t = head.draft_to_target()
    device = last_logits.device
    probs = last_logits.float().softmax(-1)
    top_p, top_i = probs.topk(K)
    pool_scores, pool_tokens = [top_p], [d2t[top_i]]
    parents = [torch.arange(-1, K, device=device)]
    surv_scores, surv_tokens = top_p, d2t[top_i]
    surv_hidden = last_hidden.expand(K, -1)
    surv_anc = torch.zeros(K, 0, dtype=torch.bool, device=device)  # [K, tree entries so far]: entry is an ancestor
    tree_k = past_k.new_zeros(0, *past_k.shape[1:])
    tree_v = past_v.new_zeros(0, *past_v.shape[1:])
    neg_inf = float("-inf")
    for i in range(1, num_steps):
        n_tree = tree_k.shape[0]
        bias = torch.zeros(K, kv_len + n_tree + K, device=device, dtype=past_k.dtype)
        bias[:, kv_len : kv_len + n_tree] = torch.where(surv_anc, 0.0, neg_inf)
        bias[:, kv_len + n_tree :] = torch.full((K, K), neg_inf, device=device).fill_diagonal_(0.0)
        t1 = time.perf_counter()
        logits, hidden, k, v = head.step(surv_tokens, surv_hidden, torch.full((K,), kv_len + i - 1, device=device),
                                         torch.cat([past_k, tree_k]), torch.cat([past_v, tree_v]), bias)
        timer("draft_step", time.perf_counter() - t1)
        tree_k, tree_v = torch.cat([tree_k, k]), torch.cat([tree_v, v])
        # each row's new entry: its ancestors' entries plus itself
        row_anc = torch.cat([surv_anc, torch.eye(K, dtype=torch.bool, device=device)], 1)
        probs = logits.float().softmax(-1)
        tp, ti = probs.topk(K, dim=-1)  # [K rows, K children]
        expand = (surv_scores[:, None] * tp).flatten()
        child_tokens = d2t[ti].flatten()
        pool_scores.append(expand)
        pool_tokens.append(child_tokens)
        if i < num_steps - 1:
            best = torch.sort(expand, descending=True, stable=True).indices[:K]
            parents.append(best + K * K * (i - 1) + K)
            rows = best // K
            surv_scores, surv_tokens = expand[best], child_tokens[best]
            surv_hidden, surv_anc = hidden[rows], row_anc[rows]
    parent_list = torch.cat(parents) if num_steps > 1 else torch.empty(0, dtype=torch.long, device=device)
    return torch.cat(pool_scores), torch.cat(pool_tokens), parent_list


def draft_tree(head, last_logits, last_hidden, past_k, past_v, kv_len: int, shape: TreeShape,
               impl: str = "torch", timer=_noop_timer) -> DraftTree:
    """Expand the pool and select the tree (see ``draft_pool`` for the inputs)."""
    scores, pool_tokens, parent_list = draft_pool(head, last_logits, last_hidden, past_k, past_v, kv_len,
                                                  shape.num_steps, shape.topk, timer)
    selected = stk.select_tree_nodes(scores[None], parent_list[None], shape.topk, shape.num_steps,
                                     shape.num_draft_tokens, impl=impl)
    parents = stk.node_parents(selected, parent_list[None], shape.topk)
    return DraftTree(tokens=pool_tokens[selected[0]].tolist(), parents=parents[0].tolist())
