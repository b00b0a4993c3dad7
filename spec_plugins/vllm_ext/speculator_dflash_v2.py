"""``TreeDFlashSpeculatorV2``: DDTree trees over vLLM's DFlash drafter on Model Runner V2.

vLLM's ``DFlashSpeculator`` loads the block drafter, writes the drafter's
context K/V from the target's aux hidden states of the step's accepted rows,
then runs one forward over [bonus, mask x L] per request and samples one
token per mask row: a chain of L. This subclass keeps all of that and
replaces the sampling (``_generate_draft``): the L mask rows' logits
[R, L, V] give each position's top-K tokens (``tree_drafting.block_topk``)
and DDTree's best-first tree of T - 1 nodes over them
(``tree_drafting.block_trees``: ancestor-closed, BFS order, no host read).
Its tokens go back to V2 as the request's T - 1 drafts; its parents stay
here (``tree_parents``) for the next step's verify, as with EAGLE trees.

Two step counts. The scheduler must schedule T - 1 drafts per request
(``speculative_config.num_speculative_tokens`` = T - 1, set by
``config.prepare_engine_args``), which is what V2's request states and
``draft_tokens`` are sized by; the drafter still runs 1 + L queries, L =
the tree's ``num_steps``. DFlash derives its query count, its sampling
buffers and its captured graphs' sizes from ``num_speculative_steps``
(``DraftModelSpeculator``: num_speculative_tokens), so this subclass sets it
to L after vLLM's constructor and rebuilds what DFlash sized from it; no
vLLM code is patched (``seams.V2_DFLASH`` names what is relied on).

Before DFlash's own ``propose`` runs, a step that verified trees is
committed as for EAGLE trees (``TreeSpeculatorStateMixin._commit_walk``):
target KV moved, the target's aux hidden rows gathered into path order and
positions back in chain order, so DFlash's input preparation (context rows
= the step's rows minus ``num_rejected``) sees exactly the accepted path.
"""

from __future__ import annotations

import torch

from vllm.config.compilation import CUDAGraphMode
from vllm.v1.worker.gpu.spec_decode.dflash.speculator import DFlashSpeculator

from spec_plugins.tree_drafting import block_topk, block_trees, warm_block_drafting

from .attention import publish_verify_trees
from .errors import TreeConfigError
from .speculator_v2 import TreeSpeculatorStateMixin


# Drafters vLLM runs with another speculator under method 'dflash' (spec_decode.init_speculator picks by
# architecture; vLLM 0.32: LiLiCorr, DFlash2; 0.33 adds DFlash2Beam and XPress): trees subclass the plain
# DFlashSpeculator only.
OTHER_DFLASH_SPECULATOR_ARCHITECTURES = ("LiLiCorrDraftModel", "DFlash2DraftModel", "DFlash2BeamDraftModel",
                                         "Qwen3XPressModel", "DFlashQwen3XPressModel")


def check_plain_dflash(draft_model_config) -> None:
    """Refuse a 'dflash' drafter vLLM would not run with its plain DFlashSpeculator."""
    archs = list(getattr(draft_model_config, "architectures", None) or [])
    other = [a for a in archs if a in OTHER_DFLASH_SPECULATOR_ARCHITECTURES]
    if other:
        raise TreeConfigError(f"spec_tree with method 'dflash' drafts trees over vLLM's plain DFlash drafter; the "
                              f"drafter {getattr(draft_model_config, 'model', '?')} is {other[0]}, which vLLM runs "
                              f"with another speculator; drop spec_tree for it")


class TreeDFlashSpeculatorV2(TreeSpeculatorStateMixin, DFlashSpeculator):
    _speculator_name = "DFlash (spec_tree DDTree)"

    def __init__(self, vllm_config, device, runner):
        shape = runner.tree_settings.shape
        # before vLLM's constructor: vLLM 0.33's calls _num_graph_context_tokens (FULL decode graphs)
        self.block_nodes = shape.num_draft_tokens - 1
        self.block_topk_k = shape.topk
        super().__init__(vllm_config, device)  # sized for T - 1 steps: draft_tokens [max_num_reqs, T - 1] stays
        self._init_tree_state(runner, device)
        if shape.num_steps > self.block_nodes:  # config.check_block_drafter refuses it first; a direct build here
            raise TreeConfigError(f"spec_tree num_steps={shape.num_steps} above num_draft_tokens - 1 = "
                                  f"{self.block_nodes} with method 'dflash': the drafter's query rows would not fit "
                                  f"the slots vLLM schedules per request")
        block = getattr(self.draft_model_config.hf_config, "block_size", None)  # the drafter's trained block
        if block is not None and shape.num_steps > block - 1:
            raise TreeConfigError(f"spec_tree num_steps={shape.num_steps} with method 'dflash': the drafter "
                                  f"{self.draft_model_config.model} was trained on blocks of {block} (the bonus "
                                  f"token + {block - 1} mask rows); set num_steps <= {block - 1}")
        self._set_block_length(shape.num_steps)
        self._dummy = False

    def _set_block_length(self, length: int) -> None:
        """The drafter's query block: 1 + L rows per request, L sampled (mask)
        rows. What DFlashSpeculator.__init__ sized from num_speculative_steps."""
        device = self.device
        self.num_speculative_steps = length
        self.num_query_per_req = 1 + length
        rows = self.max_num_reqs * length
        self.sample_indices = torch.zeros(rows, dtype=torch.int64, device=device)
        self.sample_pos = torch.zeros(rows, dtype=torch.int64, device=device)
        self.sample_idx_mapping = torch.full((rows,), -1, dtype=torch.int64, device=device)
        self.sample_col = torch.arange(length, dtype=torch.int32, device=device).repeat(self.max_num_reqs)

    def warm_up_trees(self) -> None:
        """The draft tail once at startup (``tree_drafting.warm_block_drafting``),
        whether or not vLLM's profile run, warm-up requests or graph captures
        reach ``_generate_draft`` first (eager engines capture nothing)."""
        warm_block_drafting(self.num_speculative_steps, self.vocab_size, self.dtype, self.device, self.block_topk_k,
                            self.block_nodes, impl=self.tree_runner.tree_impl)

    def make_drafter(self) -> None:
        """Nothing to build: the block drafter is DFlash's own model."""

    def _num_graph_context_tokens(self, num_reqs: int) -> int:
        """Context rows a captured draft step stores: one verified tree (T rows)
        per request, not DFlash's chain of 1 + L."""
        return min(num_reqs * (self.block_nodes + 1), self.max_num_tokens)

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                dp_sync_state=None, dummy_run=False, skip_attn_for_dummy_run=False, mm_inputs=None,
                is_profile=False, num_speculative_tokens=None):
        publish_verify_trees(None)  # the drafter's attention is its own (non-causal over the block), no tree rows
        step = None if dummy_run else self.tree_runner.tree_step
        if step is not None:
            if step.groups:
                source = self._commit_walk(step, input_batch, last_hidden_states.shape[0], slot_mappings)
                last_hidden_states = last_hidden_states[source]
                if aux_hidden_states:
                    aux_hidden_states = [h[source] for h in aux_hidden_states]
            self._chain_positions(step, input_batch)
        self._dummy = dummy_run
        try:
            drafts = super().propose(input_batch, attn_metadata, slot_mappings, last_hidden_states,
                                     aux_hidden_states, num_sampled, num_rejected, last_sampled, next_prefill_tokens,
                                     temperature, seeds, dp_sync_state=dp_sync_state, dummy_run=dummy_run,
                                     skip_attn_for_dummy_run=skip_attn_for_dummy_run, mm_inputs=mm_inputs,
                                     is_profile=is_profile, num_speculative_tokens=num_speculative_tokens)
        finally:
            self._dummy = False  # a graph capture (``capture``) records the parents' write
        if not dummy_run and num_speculative_tokens != 0:  # 0: vLLM skips this step's drafts (0.33's skip_drafts)
            self.tree_runner.tree_stats.block_tree_steps += 1
        return drafts

    def _generate_draft(self, num_reqs, num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp,
                        cudagraph_runtime_mode=CUDAGraphMode.NONE) -> None:
        """DFlash's query forward, then trees instead of sampled chains (replayable:
        no host read; a captured step's padded rows write the spare parents row)."""
        hidden = self._run_model(num_tokens_padded, attn_metadata, slot_mappings, num_tokens_across_dp,
                                 cudagraph_runtime_mode)
        L = self.num_speculative_steps
        logits = self.block_logits(hidden, num_reqs)  # [R, L, V]
        values, tokens = block_topk(logits, self.block_topk_k)
        trees = block_trees(values, tokens, self.block_nodes, impl=self.tree_runner.tree_impl)
        self.draft_tokens[:num_reqs] = trees.tokens
        if self._dummy:  # warm-up and profiling (eager): no request's tree
            return
        states = self.sample_idx_mapping[: num_reqs * L: L]  # each request's state (-1: a padded row)
        states = torch.where(states < 0, self.max_num_reqs, states)
        self.tree_parents[states] = trees.parents

    def block_logits(self, hidden: torch.Tensor, num_reqs: int) -> torch.Tensor:
        """[R, L, V] the drafter's logits at each request's L mask rows (row i:
        the token i + 1 places after the bonus token)."""
        L = self.num_speculative_steps
        rows = self.sample_indices[: num_reqs * L]
        return self.compute_draft_logits(hidden[rows], 0).view(num_reqs, L, -1)
