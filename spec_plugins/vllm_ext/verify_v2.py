"""``TreeVerifierV2``: tree verification in the place of V2's rejection sampler.

V2 calls ``runner.rejection_sampler(logits, input_batch, draft_logits,
invalid_drafts)`` on the target's logits at every scheduled draft row and
root (``input_batch.logits_indices``; request r's rows are
``cu_num_logits[r] .. cu_num_logits[r + 1]``, root first). Here:

1. V2's own rejection sampler runs with every draft of the step marked
   invalid: each request gets the one token V2 would sample without
   speculation (its penalties, processors, logprobs, seeds);
2. for the tree requests of the step, the tree walk replaces that: greedy
   ones on the target's argmax at every node, sampled ones (temperature > 0,
   no seed) by target-only rejection (``verify_tree_sampling``) on the
   distribution V2's sampler would draw from at every node (its own
   ``apply_sampling_params``), with randoms keyed on V2's per-request seed and
   the root's position (``spec_tree_kernels.keyed_randoms``), as V2 keys its own draws:
   tensor-parallel ranks accept the same paths whatever their CUDA RNG
   streams; accepted path tokens then the bonus,
   ``num_sampled = accepted + 1``, ``num_rejected = drafts - accepted``, as
   V2's ``post_update`` expects of a chain that accepted as many.

All on the device; the walk's accepted nodes stay on the step's groups for
the speculator (KV move, row gathering).
"""

from __future__ import annotations

import torch

import spec_tree_kernels as stk
from spec_tree_kernels.keyed_randoms import keyed_randoms

from .sampling import verify_in_blocks


class TreeVerifierV2:
    def __init__(self, runner, inner):
        self.runner = runner
        self.inner = inner  # V2's RejectionSampler

    def __getattr__(self, name):  # V2 reads the sampler's other attributes (num_speculative_steps, ...)
        return getattr(self.inner, name)

    def __call__(self, logits: torch.Tensor, input_batch, draft_logits=None, invalid_drafts=None):
        step = self.runner.tree_step
        if step is None:
            return self.inner(logits, input_batch, draft_logits, invalid_drafts)
        invalid = step.invalid if invalid_drafts is None else step.invalid | invalid_drafts
        out = self.inner(logits, input_batch, draft_logits, invalid)
        processed = seeds = None
        if any(g.sampled is not None for g in step.groups.values()):
            processed = self._sampling_rows(logits, input_batch)
            seeds = self.inner.sampler.sampling_states.seeds.gpu[input_batch.idx_mapping]  # per batch row
        argmax = logits.argmax(dim=-1)  # [num_logits]: one pass, every group's greedy walk reads its rows
        for g in step.groups.values():
            self._walk(g, logits, argmax, processed, out, seeds)
        step.verified = True
        self.runner.tree_stats.verify_steps += bool(step.groups)
        return out

    def _sampling_rows(self, logits: torch.Tensor, input_batch):
        """``processed(requests, requests_np, rows)`` -> [len(rows), V] the logits V2's rejection
        sampler draws from at those rows (``_verify``: ``apply_sampling_params``
        with the same arguments, restricted to the requests owning the rows):
        temperature, min-p, top-k / top-p per request, in V2's order and with V2's
        kernels, all per row. Built per block of requests (``verify_in_blocks``):
        V2 makes an fp32 copy of what it processes, and the batch's [num_logits,
        V] copy is what V2's profile never saw (it chunks its own). Only rows of
        requests nothing else acts on are read (``params_allow_speculation``).
        requests: [b] int64 batch rows (device) and their host copy; rows: [n]
        int64 logits rows of those requests (all of each one's rows)."""
        from vllm.v1.worker.gpu.spec_decode.rejection_sampler import gather_draft_sampled

        sampler = self.inner.sampler
        draft_sampled, pos = gather_draft_sampled(input_batch.input_ids, input_batch.positions,
                                                  input_batch.logits_indices, input_batch.expanded_idx_mapping,
                                                  input_batch.expanded_local_pos, sampler.req_states.prefill_len.gpu)
        seq_lens_np = input_batch.seq_lens_cpu_upper_bound.numpy()

        def processed(requests: torch.Tensor, requests_np, rows: torch.Tensor) -> torch.Tensor:
            return sampler.apply_sampling_params(
                logits[rows], input_batch.expanded_idx_mapping[rows], input_batch.idx_mapping[requests],
                input_batch.idx_mapping_np[requests_np], pos[rows], draft_sampled[rows],
                input_batch.expanded_local_pos[rows], seq_lens_np[requests_np])

        return processed

    def _walk(self, g, logits: torch.Tensor, argmax: torch.Tensor, processed, out, seeds) -> None:
        """The group's walks (greedy on the argmax; sampled trees by target-only
        rejection on V2's distribution); their rows of ``out`` rewritten.
        seeds: [num_reqs] int64 V2's per-request seeds by batch row (None: no sampled tree)."""
        runner = self.runner
        depth = runner.verify_depth
        predict = argmax[g.logit_rows]
        res = stk.verify_tree_greedy(g.candidates, g.build.retrieve_next_token, g.build.retrieve_next_sibling,
                                     predict, depth, impl=runner.tree_impl)
        accept_index, accept_length = res.accept_index.to(torch.int64), res.accept_length.to(torch.int64)
        accept_tokens = res.accept_tokens.to(torch.int64)
        if g.sampled is not None:
            s, vocab = g.sampled, logits.shape[-1]
            links = (g.candidates[s], g.build.retrieve_next_token[s], g.build.retrieve_next_sibling[s])
            rows, requests, requests_np = g.logit_rows[s], g.rows[s], g.rows_np[g.sampled_np]
            keys = seeds[requests], g.context_lens[s]

            def probs_of(block):
                block_rows = rows[block].flatten()
                return (processed(requests[block], requests_np[block], block_rows).float().softmax(dim=-1)
                        .view(-1, g.nodes, vocab))

            def randoms_of(block):  # unseeded requests only (seeded ones stay with V2's sampler)
                return keyed_randoms(keys[0][block], keys[1][block], g.nodes, vocab)

            def walk_of(block, probs, coins, exponentials):
                return stk.verify_tree_sampling(*(t[block] for t in links), probs, coins, exponentials, depth,
                                                impl=runner.tree_impl)

            drawn = verify_in_blocks((len(g.sampled_np), g.nodes, vocab), probs_of, randoms_of, walk_of)
            accept_index[s] = drawn.accept_index.to(torch.int64)
            accept_length[s] = drawn.accept_length.to(torch.int64)
            accept_tokens[s] = drawn.accept_tokens.to(torch.int64)
        g.accept_index, g.accept_length = accept_index, accept_length
        width = min(depth + 1, out.sampled_token_ids.shape[1])
        sampled = torch.full((len(g.rows_np), out.sampled_token_ids.shape[1]), -1,
                             dtype=out.sampled_token_ids.dtype, device=logits.device)
        sampled[:, :width] = accept_tokens[:, :width].to(sampled.dtype)
        out.sampled_token_ids[g.rows] = sampled
        out.num_sampled[g.rows] = (g.accept_length + 1).to(out.num_sampled.dtype)
        out.num_rejected[g.rows] = (g.nodes - 1 - g.accept_length).to(out.num_rejected.dtype)
        runner.tree_stats.trees_verified += len(g.rows_np)
