"""``TreeVerifierV2``: tree verification in the place of V2's rejection sampler.

V2 calls ``runner.rejection_sampler(logits, input_batch, draft_logits,
invalid_drafts)`` on the target's logits at every scheduled draft row and
root (``input_batch.logits_indices``; request r's rows are
``cu_num_logits[r] .. cu_num_logits[r + 1]``, root first). Here:

1. V2's own rejection sampler runs with every draft of the step marked
   invalid: each request gets the one token V2 would sample without
   speculation (its penalties, processors, logprobs, seeds);
2. for the greedy tree requests of the step, the tree walk on the target's
   argmax at every node replaces that: accepted path tokens then the bonus,
   ``num_sampled = accepted + 1``, ``num_rejected = drafts - accepted``, as
   V2's ``post_update`` expects of a chain that accepted as many.

All on the device; the walk's accepted nodes stay on the step's groups for
the speculator (KV move, row gathering).
"""

from __future__ import annotations

import torch

import spec_tree_kernels as stk


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
        for g in step.groups.values():
            self._walk(g, logits, out)
        step.verified = True
        self.runner.tree_stats.verify_steps += bool(step.groups)
        return out

    def _walk(self, g, logits: torch.Tensor, out) -> None:
        """Greedy walk of the group's trees; their rows of ``out`` rewritten."""
        runner = self.runner
        depth = runner.verify_depth
        predict = logits[g.logit_rows.flatten()].argmax(dim=-1).view(-1, g.nodes)
        res = stk.verify_tree_greedy(g.candidates, g.build.retrieve_next_token, g.build.retrieve_next_sibling,
                                     predict, depth, impl=runner.tree_impl)
        g.accept_index = res.accept_index.to(torch.int64)
        g.accept_length = res.accept_length.to(torch.int64)
        width = min(depth + 1, out.sampled_token_ids.shape[1])
        sampled = torch.full((len(g.rows_np), out.sampled_token_ids.shape[1]), -1,
                             dtype=out.sampled_token_ids.dtype, device=logits.device)
        sampled[:, :width] = res.accept_tokens[:, :width].to(sampled.dtype)
        out.sampled_token_ids[g.rows] = sampled
        out.num_sampled[g.rows] = (g.accept_length + 1).to(out.num_sampled.dtype)
        out.num_rejected[g.rows] = (g.nodes - 1 - g.accept_length).to(out.num_rejected.dtype)
        runner.tree_stats.trees_verified += len(g.rows_np)
