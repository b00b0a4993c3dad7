"""Kernel-level regression check against an installed SGLang (``spec-plugins check --engine sglang``).

SGLang's server does not run on these CPUs, so the check compares what the
plugin swaps into SGLang's pipeline with SGLang's own kernels on random
SGLang-shaped draft pools: tree build (QLEN_ONLY and FULL_MASK, SGLang's
Triton reference ``sgl_build_tree_kernel_triton``) and the greedy walk
(``verify_tree_greedy_triton``). On CPU the Triton kernels run under
TRITON_INTERPRET=1 (set before importing this module).
"""

from __future__ import annotations

import random

import torch

import spec_tree_kernels as stk
from spec_plugins.synthetic_trees import FLAVORS, synthetic_pool
from spec_tree_kernels import TreeMaskMode


def _sglang():
    try:
        from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode as SglMode
        from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton, verify_tree_greedy_triton
    except ImportError as e:
        raise ImportError(f"SGLang's tree kernels are not importable ({e}); install sglang==0.5.23") from None
    return SglMode, sgl_build_tree_kernel_triton, verify_tree_greedy_triton


def compare_with_sglang(rng: random.Random) -> str | None:
    """One random case; returns None when ours and SGLang's agree, else what differs."""
    SglMode, sgl_build, sgl_verify = _sglang()
    batch, topk, num_steps = rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 5)
    nodes = rng.randint(1, min(stk.pool_size(topk, num_steps) + 1, 16))
    flavor = rng.choice(FLAVORS)
    scores, parent_list = synthetic_pool(batch, topk, num_steps, flavor, seed=rng.randrange(2**31))
    selected = stk.select_tree_nodes(scores, parent_list, topk, num_steps, nodes, impl="torch")
    seq_lens = torch.tensor([rng.randint(1, 40) for _ in range(batch)], dtype=torch.int64)
    case = f"batch={batch} topk={topk} num_steps={num_steps} T={nodes} flavor={flavor}"
    for ours_mode, sgl_mode in ((TreeMaskMode.QLEN_ONLY, SglMode.QLEN_ONLY), (TreeMaskMode.FULL_MASK, SglMode.FULL_MASK)):
        ours = stk.build_tree(selected, parent_list, seq_lens, topk, num_steps, ours_mode, impl="torch")
        if ours_mode == TreeMaskMode.QLEN_ONLY:
            mask = torch.full((nodes * batch * nodes,), True, dtype=torch.bool)
        else:
            mask = torch.full((int(seq_lens.sum()) * nodes + nodes * nodes * batch,), True, dtype=torch.bool)
        retrieve = torch.full((3, batch, nodes), -1, dtype=torch.long)
        positions = torch.empty(batch * nodes, dtype=torch.long)
        sgl_build(parent_list, selected, seq_lens, mask, positions, retrieve[0], retrieve[1], retrieve[2],
                  topk, num_steps, nodes, sgl_mode)
        for what, a, b in (("positions", ours.positions.flatten(), positions),
                           ("retrieve_next_token", ours.retrieve_next_token, retrieve[1]),
                           ("retrieve_next_sibling", ours.retrieve_next_sibling, retrieve[2]),
                           (f"{ours_mode.name} mask", ours.tree_mask, mask)):
            if not torch.equal(a.to(b.dtype), b):
                return f"{case}: build {what} differs from SGLang's"
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    candidates = torch.randint(0, 6, (batch, nodes), generator=gen)
    predict = torch.where(torch.rand(batch, nodes, generator=gen) < 0.7,
                          candidates.roll(-1, dims=1), torch.randint(0, 6, (batch, nodes), generator=gen))
    res = stk.verify_tree_greedy(candidates, ours.retrieve_next_token, ours.retrieve_next_sibling, predict,
                                 num_steps, impl="torch")
    sgl_predict = torch.zeros(batch * nodes, dtype=torch.int32)
    accept_index = torch.full((batch, num_steps + 1), -1, dtype=torch.int32)
    accept_num = torch.empty(batch, dtype=torch.int32)
    retrieve_index = torch.arange(batch * nodes).view(batch, nodes)
    sgl_verify(predicts=sgl_predict, accept_index=accept_index, accept_token_num=accept_num, candidates=candidates,
               retrieve_index=retrieve_index, retrieve_next_token=ours.retrieve_next_token,
               retrieve_next_sibling=ours.retrieve_next_sibling, target_predict=predict)
    # SGLang's accept_index is batch-global (b * T + node); ours is node-local.
    local = torch.where(accept_index >= 0, accept_index - torch.arange(batch)[:, None] * nodes, accept_index)
    if not torch.equal(res.accept_length, accept_num) or not torch.equal(res.accept_index, local):
        return f"{case}: greedy walk differs from SGLang's (ours {res.accept_index.tolist()}, SGLang {local.tolist()})"
    return None
