"""The tree runner: a mixin over vLLM's V1 GPUModelRunner and its CPU subclass.

vLLM's V1 runner verifies chains. A request's drafts here are the T - 1 nodes
of a tree in BFS order (parents before children), so vLLM's scheduler,
input batch and KV allocation handle them unchanged as "spec tokens" (a
prefix the scheduler cuts off is still a tree). One engine step, in the
order vLLM calls the mixin's methods, each around vLLM's own code:

``execute_model``    the target's forward, inside it:
  ``_update_states``   forgets finished requests' trees;
  ``_prepare_inputs``  plan (after vLLM's): the step's trees grouped by size
                     (``tree_groups.py``), from host state only; positions
                     of tree tokens = context + depth (KV slots stay
                     linear); the compact masks published to the attention
                     backends for the forward.
``sample_tokens``    vLLM's sampling and drafting, inside it:
  ``_sample``          verify (``verify.py``): the tree walk finds each
                     tree's accepted path: greedy requests on the target's
                     argmax, sampled ones by target-only rejection on the
                     target's distribution at each node (``sampling.py``),
                     which also draws their last token; the result is path
                     tokens + last token, -1 padded. A step of greedy chains
                     only is verified by vLLM's own rejection sampler as
                     vLLM's EAGLE chain is (the walk would accept the same
                     prefix).
  ``propose_draft_token_ids``  draft: ``TreeDrafter`` for the whole batch:
                     the head's extend over the step's rows (vLLM's EAGLE
                     model, its KV in vLLM's paged drafter cache), then the
                     commit: the accepted path's KV moved to the contiguous
                     front for every layer (target and head), before vLLM's
                     scheduler rolls num_computed_tokens back to the accepted
                     length; then batched tree drafting; returns each
                     request's tree tokens (empty: no speculation for it).
  then the step's statistics, device times and the adaptive budget's
  lessons (``step_bookkeeping.py``), kept apart from the step.

Requests whose token depends on more than temperature / min-p / top-k / top-p
(penalties, structured output, logprobs, ...: ``requests.py``) are decoded
without speculation (empty drafts), in the same batches.

With ``speculative_config.method == "dflash"`` the drafter is vLLM's V1
DFlash proposer as ``proposer_dflash.TreeDFlashProposer`` (DDTree trees from
its one block forward) and ``propose_draft_token_ids`` is
``_propose_block_trees``: the KV commit first, then vLLM's DFlash ``propose``
over the step's rows gathered into path order (its context K/V: the accepted
path's target hidden states), then the same hand-out of trees.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import spec_tree_kernels as stk

from .attention import VerifyTrees, check_tree_attention_installed, publish_verify_trees
from .config import settings_from_vllm_config
from .proposer import (
    TreeDrafter,
    check_head_fits_target,
    check_loaded_head,
    check_mtp_proposer,
    drafts_that_fit,
    share_embeddings_with_any_target,
    share_tied_lm_head,
)
from .requests import install_full_logitsprocs, may_speculate
from .startup_checks import check_at_startup, warm_tree_kernels
from .step_bookkeeping import StepBookkeeping, TreeStats
from .tree_groups import TreeGroup, plan_tree_group, upload
from .verify import chain_walks, walk_trees


@dataclass
class DraftingStep:
    """One drafting step of R requests. Host (numpy): q_start [R+1],
    scheduled [R], start [R] (positions computed before the step), discard [R]
    (mid-prefill: nothing sampled), kv_bound [R] (committed positions after
    the step, at most: start + scheduled), drafting (rows that get a tree next
    step). Device [R] int64: last_row (the row whose head output drafts the
    next tree) and kv_len (committed positions after the step)."""

    num_rows: int
    q_start: np.ndarray
    scheduled: np.ndarray
    start: np.ndarray
    discard: np.ndarray
    kv_bound: np.ndarray
    drafting: np.ndarray
    last_row: torch.Tensor
    kv_len: torch.Tensor


class TreeRunnerMixin:
    """Put first in the bases: ``class R(TreeRunnerMixin, GPUModelRunner)``.

    One step reads the device once: the draft trees, in one copy, which vLLM
    needs on the host to schedule them (vLLM's own bookkeeping reads the
    sampled tokens). Everything else is planned from what the host already
    knows (the scheduler's token counts, the trees it drafted) and runs on
    device tensors: the walk, the output tokens, the accepted-path KV move
    and the next drafting step's rows and lengths. ``spec_plugins.host_reads``
    counts this (tests/model/test_vllm_host_reads.py).
    """

    # spec_tree_kernels implementation for select/verify/KV move (``resolve_impl``): on CUDA
    # Triton select and CUDA build/verify/KV move (Triton where they did not build); on the
    # host CPU the reference, unless SPEC_TREE_KERNELS_IMPL says otherwise
    tree_impl = "auto"

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        settings = settings_from_vllm_config(vllm_config)
        if settings is None:
            raise RuntimeError("spec-plugins tree runner built without additional_config['spec_tree']")
        if self.uses_mrope:
            raise RuntimeError("spec-plugins tree runner: M-RoPE models are not supported")
        self.tree_settings = settings
        # D of every walk and KV move (their accepted-path arrays are D + 1 wide): one for all
        # steps, so each tree size has one kernel variant (warmed at startup). The deepest tree
        # of at most T nodes, a chain of a draft the runner did not make included, has T - 1 levels.
        self.verify_depth = settings.num_spec_tokens
        self.tree_drafter: TreeDrafter | None = None
        self.bookkeeping = StepBookkeeping(settings.menu, device)
        self._drafted: dict[str, tuple[list, list, list]] = {}  # req_id -> (tokens, parents, top1) behind its spec tokens
        self._step_groups: dict[int, TreeGroup] = {}
        self._verified: dict[int, TreeGroup] = {}  # this step's trees after the walk, until the KV move
        # DDTree over vLLM's DFlash drafter: the proposer vLLM built, with its mask rows' sampling replaced
        self.block_drafter = vllm_config.speculative_config.method == "dflash"
        if self.block_drafter:
            from .proposer_dflash import adopt_dflash_proposer

            adopt_dflash_proposer(self)

    @property
    def tree_stats(self) -> TreeStats:
        """Counters and device times (the ``spec_tree_stats`` RPC)."""
        return self.bookkeeping.stats

    @property
    def budget(self):
        """The adaptive budget's ``BudgetPolicy`` (None: one configured shape)."""
        return self.bookkeeping.budget

    # ------------------------------------------------------------------ setup
    def kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def load_model(self, *args, **kwargs):
        spec = self.vllm_config.speculative_config
        if self.block_drafter:  # vLLM's DFlash loader shares the target's embedding and lm_head itself
            from .speculator_dflash_v2 import check_plain_dflash

            check_plain_dflash(spec.draft_model_config)
            super().load_model(*args, **kwargs)
            return
        check_head_fits_target(spec.draft_model_config.hf_config, self.vllm_config.model_config.hf_text_config,
                               spec.method, spec.draft_model_config.model)
        share_embeddings_with_any_target(self.drafter)  # a target without `model` (BLOOM: `transformer`)
        super().load_model(*args, **kwargs)  # loads the target and vLLM's EAGLE head (self.drafter.model)
        if spec.method != "mtp":  # an MTP model computes its own logits (TreeDrafter.logits)
            share_tied_lm_head(self.drafter.model, self.get_model())  # a tied target without lm_head (Gemma-2)
        else:
            check_mtp_proposer(self.drafter, self.get_model(), spec.draft_model_config.model)
        check_loaded_head(self.drafter.model, self.vllm_config.model_config.get_vocab_size(),
                          spec.draft_model_config.model)
        self.tree_drafter = TreeDrafter(self, self.tree_settings.shape, self.tree_impl)

    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, *args, **kwargs):
        super().initialize_kv_cache(kv_cache_config, is_profiling, *args, **kwargs)
        if is_profiling:  # vLLM's CUDA-graph memory profile on a throwaway cache: the real one comes next
            return
        draft_layers = set(self.drafter._draft_attn_layer_names)
        target_layers = [n for g in self.kv_cache_config.kv_cache_groups for n in g.layer_names
                         if n not in draft_layers]
        # the head's layer too: its extend runs tree rows and its draft steps read BranchAttention
        check_tree_attention_installed(self.compilation_config.static_forward_context,
                                       target_layers + sorted(draft_layers))
        check_at_startup(self, target_layers, sorted(draft_layers))  # layouts/variants: refuse now, not per request
        # a block drafter's layers run DFlash's own attention only (no tree rows, no draft levels)
        warmed = warm_tree_kernels(self, target_layers, [] if self.block_drafter else sorted(draft_layers))
        self.tree_stats.warmed_variants, self.tree_stats.warm_up_seconds = len(warmed.variants), warmed.seconds
        if self.block_drafter:
            self.drafter.warm_up_trees()
        install_full_logitsprocs(self)  # logit_bias, min_p, entry-point processors apply as without speculation
        impl = self.compilation_config.static_forward_context[target_layers[0]].impl.tree_impl
        self.tree_stats.tree_attention_impl = stk.resolve_impl("attention", impl, self.device)
        if self.budget is not None:
            self.bookkeeping.profile_plain_decode(self._dummy_run, min(self.scheduler_config.max_num_seqs,
                                                                       self.max_num_tokens))

    def group_block_table(self, gid: int) -> torch.Tensor:
        """[max_num_reqs, max_blocks] KV cache group ``gid``'s block table, as attention metadata carries it."""
        return self.input_batch.block_table[gid].block_table.gpu

    def _layer_kv(self, name: str) -> torch.Tensor:
        kv = self.compilation_config.static_forward_context[name].kv_cache
        return kv[0] if isinstance(kv, list) else kv

    def _draft_kv_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_views(self._layer_kv(self.tree_drafter.layer_name))

    # ------------------------------------------------------- the step: forward
    def execute_model(self, scheduler_output, *args, **kwargs):
        self.bookkeeping.step_begins(scheduler_output)
        out = super().execute_model(scheduler_output, *args, **kwargs)
        self.bookkeeping.mark("forward_end")
        return out

    def _update_states(self, scheduler_output):
        result = super()._update_states(scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            self._drafted.pop(req_id, None)
        return result

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._step_groups = self._group_step_trees(scheduler_output.scheduled_spec_decode_tokens)
        if self._step_groups:
            # Chains are causal: vLLM's positions (context + index) and its own kernel are exact for them.
            branching = {T: g for T, g in self._step_groups.items() if not g.all_chains}
            for g in branching.values():
                rows = g.node_rows.flatten().to(self.positions.device)
                self.positions[rows] = g.build.positions.flatten().to(self.positions.dtype)
            num_tree_rows = sum(len(g.rows) * T for T, g in branching.items())
            publish_verify_trees(VerifyTrees(
                mode=self.tree_settings.mask_mode,
                groups={T: (g.rows_dev, g.q_starts, g.context_lens, g.build.tree_mask) for T, g in branching.items()},
                max_context=max((g.max_context for g in branching.values()), default=0),
                covers_batch=num_tree_rows == scheduler_output.total_num_scheduled_tokens,
                first_rows={T: g.first_row for T, g in branching.items()},
            ) if branching else None)
        return result

    def _group_step_trees(self, scheduled_spec: dict) -> dict[int, TreeGroup]:
        """The step's trees by size, from host state only (the drafts this runner
        made, the scheduler's cut of them, the batch's host arrays)."""
        by_size: dict[int, list] = {}
        batch = self.input_batch
        for req_id, drafts in scheduled_spec.items():
            if not drafts:
                continue
            row = batch.req_id_to_index[req_id]
            n = len(drafts)
            drafted = self._drafted.get(req_id)
            if drafted is not None and drafted[0][:n] == list(drafts):
                parents, top1 = drafted[1][: n + 1], drafted[2][: n + 1]
            else:
                parents = [-1] + list(range(n))  # not ours: a chain is a tree too, and verifies exactly
                top1 = [True] * (n + 1)
                self.tree_stats.chain_fallbacks += 1
            context = int(batch.num_computed_tokens_cpu[row])
            by_size.setdefault(n + 1, []).append(
                (row, int(self.query_start_loc.np[row]), context, [int(batch.token_ids_cpu[row, context]), *drafts],
                 parents, top1, req_id in batch.random_reqs))
        return {T: plan_tree_group(T, items, self.device, self.tree_settings.mask_mode)
                for T, items in by_size.items()}

    # --------------------------------------------- the step: verify and draft
    def sample_tokens(self, *args, **kwargs):
        self.bookkeeping.sampling_begins(self.input_batch)
        groups = self._step_groups  # _sample (inside) takes them: kept for the bookkeeping
        out = super().sample_tokens(*args, **kwargs)  # _sample, then propose_draft_token_ids
        self._commit_verified_trees()  # normally done by propose_draft_token_ids; here if vLLM skipped drafting
        self.bookkeeping.step_ends(out, groups)
        return out

    def _sample(self, logits, spec_decode_metadata):
        groups, self._step_groups = self._step_groups, {}
        # vLLM's rejection sampler (which it uses whenever spec metadata exists, even
        # with no drafts) drops logprob_token_ids: those steps take the path below.
        scored = bool(self.input_batch.sampling_metadata.logprob_token_ids)
        if spec_decode_metadata is None or not (groups or scored):
            return super()._sample(logits, spec_decode_metadata)
        if self._greedy_chains_only(groups):
            out = super()._sample(logits, spec_decode_metadata)
            chain_walks(groups, out, self.verify_depth)
            self.tree_stats.chain_steps += 1
        else:
            out = walk_trees(self, groups, logits, spec_decode_metadata)
        self._verified = groups  # their KV moves after the head's extend (``propose_draft_token_ids``)
        self.after_tree_sampling(out, groups)
        self.tree_stats.verify_steps += bool(groups)
        self.tree_stats.trees_verified += sum(len(g.rows) for g in groups.values())
        return out

    def _greedy_chains_only(self, groups: dict[int, TreeGroup]) -> bool:
        """Every draft of the step is a chain and every request decodes greedily (no logprob token ids)."""
        metadata = self.input_batch.sampling_metadata
        return all(g.all_chains for g in groups.values()) and metadata.all_greedy and not metadata.logprob_token_ids

    def after_tree_sampling(self, out, groups: dict[int, TreeGroup]) -> None:
        """Hook for the test-only faults of ``faults.py``; nothing to do here."""

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        # vLLM zeroes every request's drafts when the longest one nears max_model_len;
        # the tree proposer decides per request and the scheduler trims at max_model_len.
        return common_attn_metadata is not None

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        """One drafting step for the batch: head extend, KV commit, tree drafting."""
        if self.block_drafter:
            return self._propose_block_trees(scheduler_output, sampled_token_ids, hidden_states, aux_hidden_states,
                                             common_attn_metadata, slot_mappings)
        mark = self.bookkeeping.mark
        mark("draft")
        step = self._drafting_step(scheduler_output.total_num_scheduled_tokens)
        shape = self.bookkeeping.choose_shape(len(step.drafting), self.tree_settings.shape)
        # A plain decode step chosen by the budget skips the head: the head KV of this step's
        # positions stays unwritten, and drafts after speculation resumes attend to those slots'
        # stale contents, which can only lower acceptance (verification decides every token).
        # Prefill rows always run the head: a prompt's head KV is never skipped.
        run_head = shape is not None or not self.bookkeeping.pure_decode
        if run_head:
            input_ids = self._extend_input_ids(step, sampled_token_ids)
            features = self.tree_drafter.features(hidden_states[: step.num_rows],
                                                  [h[: step.num_rows] for h in aux_hidden_states or []])
        mark("draft_inputs")
        last_hidden = next_hidden = None
        if run_head:
            last_hidden, next_hidden = self.tree_drafter.extend(common_attn_metadata, input_ids,
                                                                self.positions[: step.num_rows], features)
        mark("extend_end")
        self._commit_verified_trees()
        mark("kv_moved")
        drafts = self._draft_trees(step, last_hidden, next_hidden, shape)
        mark("draft_end")
        return drafts

    def _drafting_step(self, num_rows: int) -> DraftingStep:
        """This step's requests: host bookkeeping (numpy over the batch) and, on
        the device, each request's last committed row and committed length (a
        tree request's come from its walk, which only the device knows)."""
        R = self.input_batch.num_reqs
        q_start = self.query_start_loc.np[: R + 1].astype(np.int64)
        scheduled = np.diff(q_start)
        start = self.input_batch.num_computed_tokens_cpu[:R].astype(np.int64)
        discard = self.discard_request_mask.np[:R].astype(bool)
        self.tree_stats.prefill_chunks += int(discard.sum())
        may = np.array([not discard[r] and self._may_speculate(req_id)
                        for r, req_id in enumerate(self.input_batch.req_ids[:R])], dtype=bool)
        # rows without a tree commit every scheduled row; trees commit their accepted path
        last_offset, committed, q0, kv0 = upload(np.stack([scheduled - 1, scheduled, q_start[:R], start]),
                                                 self.device)
        for g in self._verified.values():
            last_offset[g.rows_dev] = g.last_node
            committed[g.rows_dev] = g.accept_length + 1
        return DraftingStep(num_rows=num_rows, q_start=q_start, scheduled=scheduled, start=start, discard=discard,
                            kv_bound=start + scheduled, drafting=np.flatnonzero(may), last_row=q0 + last_offset,
                            kv_len=kv0 + committed)

    def _may_speculate(self, req_id: str) -> bool:
        return may_speculate(self.requests[req_id].sampling_params, self.input_batch.req_id_to_index.get(req_id),
                             self.input_batch.logitsprocs)

    def _extend_input_ids(self, step: DraftingStep, sampled_token_ids: torch.Tensor) -> torch.Tensor:
        """[N] the token that follows each row: the next prompt token inside a
        chunk, the sampled (or, mid-prefill, the next prompt) token at a
        request's last row, the target's argmax at a tree node."""
        ids = self.input_ids.gpu[: step.num_rows]
        next_ids = torch.empty_like(ids)
        next_ids[:-1] = ids[1:]
        R = len(step.scheduled)
        valid = (sampled_token_ids != -1).sum(dim=1).clamp(min=1)
        sampled = sampled_token_ids.gather(1, (valid - 1)[:, None])[:, 0].to(ids.dtype)
        ahead = np.minimum(step.start + step.scheduled, self.input_batch.token_ids_cpu.shape[1] - 1)
        prompt_next = self.input_batch.token_ids_cpu[np.arange(R), ahead].astype(np.int64)
        prompt_next, discard, last_rows = upload(np.stack([prompt_next, step.discard, step.q_start[1:] - 1]),
                                                 ids.device)
        next_ids[last_rows] = torch.where(discard.bool(), prompt_next.to(ids.dtype), sampled[:R])
        for g in self._verified.values():
            next_ids[g.node_rows.flatten().to(ids.device)] = g.predict.flatten().to(ids.dtype)
        return next_ids

    def _commit_verified_trees(self) -> None:
        """End of a tree step: withdraw the trees from attention, move the accepted KV."""
        groups, self._verified = self._verified, {}
        publish_verify_trees(None)
        if groups:
            self._move_accepted_kv(groups)

    def _move_accepted_kv(self, groups: dict[int, TreeGroup]) -> None:
        """Each tree's accepted nodes' K/V to the front of its verify slots (slot of
        depth d <- node a_d), for every layer of every KV cache group: the target's
        and the head's (whose extend wrote node-aligned KV like the target). Chains'
        paths are prefixes of the BFS order, already in place; for trees the
        kernel copies only the nodes that move (decided on the device)."""
        moves = [g for g in groups.values() if not g.all_chains and self._may_move(g)]
        if not moves:
            return
        for gid, kv_group in enumerate(self.kv_cache_config.kv_cache_groups):
            caches = [view for n in kv_group.layer_names for view in self.kv_views(self._layer_kv(n))]
            slot_mapping = self.input_batch.block_table[gid].slot_mapping.gpu
            for g in moves:
                slots = slot_mapping[g.node_rows.to(slot_mapping.device)].to(torch.int64)
                stk.move_accepted_kv(caches, slots, g.accept_index.to(slots.device), g.accept_length.to(slots.device),
                                     impl=self.tree_impl)

    @staticmethod
    def _may_move(g: TreeGroup) -> bool:
        """False when no accepted node of the group leaves its BFS place: asked
        only where the answer is free (host tensors: the CPU runner); on a GPU the
        kernel runs and decides on the device."""
        if not g.accept_index.is_cpu:
            return True
        depth = torch.arange(g.accept_index.shape[1], device=g.accept_index.device)
        return bool(((g.accept_index >= 0) & (g.accept_index != depth)).any())

    def _draft_trees(self, step: DraftingStep, last_hidden: torch.Tensor, next_hidden: torch.Tensor, shape):
        """The next step's trees for the drafting requests; the step's one host
        read brings their tokens (for vLLM's scheduler), parents and top-1 marks
        (for the next step's tree build) in one copy."""
        rows = step.drafting if shape is not None else step.drafting[:0]
        self.tree_stats.not_speculated += len(step.scheduled) - len(step.drafting)
        drafts, rows_dev = self._drafting_rows(step, rows)
        if rows_dev is None:
            return drafts
        sample_rows = step.last_row[rows_dev]
        block_table = self.input_batch.block_table[self.drafter.kv_cache_gid].block_table.gpu
        trees = self.tree_drafter.draft(last_hidden[sample_rows], next_hidden[sample_rows], step.kv_len[rows_dev],
                                        int(step.kv_bound[rows].max()), block_table[rows_dev.to(block_table.device)],
                                        self._draft_kv_views(), shape)
        return self._hand_out_trees(step, rows, rows_dev, trees, drafts)

    def _drafting_rows(self, step: DraftingStep, rows: np.ndarray) -> tuple[list[list[int]], torch.Tensor | None]:
        """Empty drafts for the batch, and ``rows`` (the requests that draft this
        step) on the device, None when there are none; every other request
        forgets its last tree (its next step verifies none)."""
        R = len(step.scheduled)
        req_ids = self.input_batch.req_ids
        for r in np.setdiff1d(np.arange(R), rows):
            self._drafted.pop(req_ids[r], None)
        return [[] for _ in range(R)], upload(rows.astype(np.int64), step.kv_len.device) if len(rows) else None

    def _hand_out_trees(self, step: DraftingStep, rows: np.ndarray, rows_dev: torch.Tensor, trees,
                        drafts: list[list[int]]) -> list[list[int]]:
        """The step's one host read: the trees of ``rows`` (``trees``' rows in
        order) as their requests' drafts (for vLLM's scheduler), their parents and
        top-1 marks kept for the next step's tree build."""
        req_ids = self.input_batch.req_ids
        T = trees.parents.shape[1]
        host = torch.cat([trees.tokens, trees.parents, trees.top1.to(trees.tokens.dtype),
                          step.kv_len[rows_dev, None].to(trees.tokens.dtype)], 1).tolist()  # the read
        for i, r in enumerate(rows):
            drafts[r] = host[i][: drafts_that_fit(host[i][-1], self.max_model_len, T - 1)]  # no drafts past the cap
            self._drafted[req_ids[r]] = (drafts[r], host[i][T - 1 : 2 * T - 1],
                                         [x == 1 for x in host[i][2 * T - 1 : 3 * T - 1]])
        return drafts

    # ------------------------------------------------- DDTree over DFlash (V1)
    def _propose_block_trees(self, scheduler_output, sampled_token_ids, hidden_states, aux_hidden_states,
                             common_attn_metadata, slot_mappings):
        """One drafting step with vLLM's DFlash drafter: the verified trees
        committed (target KV of each accepted path moved to the front of its
        verify slots), then vLLM's DFlash ``propose`` over the step's rows with
        each tree's accepted nodes gathered into path order and the rows past the
        path counted as rejected (DFlash writes context K/V for the accepted path
        only, at its chain positions and slots), then DDTree's trees from its mask
        rows (``TreeDFlashProposer``) handed out as for EAGLE trees."""
        mark = self.bookkeeping.mark
        mark("draft")
        drafter = self.drafter
        num_rows = scheduler_output.total_num_scheduled_tokens
        step = self._drafting_step(num_rows)
        R = len(step.scheduled)
        source = self._path_rows(num_rows)  # before the commit forgets the walk
        self._commit_verified_trees()  # (marks: the commit and input assembly are ours, the propose the head's)
        # vLLM's own bound for its DFlash chain (``_input_fits_in_drafter``, which the tree runner decides per
        # request for EAGLE): query rows past it would read the drafter's RoPE cache past its end. The batch then
        # decodes without speculation this step, as vLLM's chain does (the drafter's context K/V of this step's
        # positions stays unwritten: later drafts may be worse, never wrong; verification decides).
        if (common_attn_metadata.max_seq_len + 1 + self.tree_settings.shape.num_steps
                > self.effective_drafter_max_model_len):
            self.tree_stats.not_speculated += R
            self._drafted.clear()
            for name in ("draft_inputs", "extend_end", "kv_moved", "draft_end"):  # no head ran: all ours
                mark(name)
            return [[] for _ in range(R)]
        # the bonus token of every request (vLLM's own helper: the last valid sampled token, or mid-prefill the
        # request's backup token) and the rows past each request's committed path
        next_token_ids, _ = drafter.prepare_next_token_ids_padded(sampled_token_ids, self.requests, self.input_batch,
                                                                   self.discard_request_mask.gpu)
        bound = upload(step.kv_bound.astype(np.int64), step.kv_len.device)
        num_rejected = (bound - step.kv_len).to(torch.int32)
        if self.use_aux_hidden_state_outputs:
            target_hidden = torch.cat([h[source] for h in aux_hidden_states], dim=-1)
        else:
            target_hidden = hidden_states[source]
        # an accepted node at depth d has the tree position context + d: gathered, the path's chain positions
        positions = self._get_positions(num_rows)[source]
        mark("draft_inputs")
        drafter.propose(num_speculative_tokens=self.tree_settings.shape.num_steps,
                        target_token_ids=self.input_ids.gpu[:num_rows][source], target_positions=positions,
                        target_hidden_states=target_hidden, next_token_ids=next_token_ids,
                        token_indices_to_sample=None, common_attn_metadata=common_attn_metadata,
                        sampling_metadata=self.input_batch.sampling_metadata, num_rejected_tokens_gpu=num_rejected,
                        slot_mappings=slot_mappings)
        trees = drafter.take_trees()
        mark("extend_end")
        mark("kv_moved")  # already moved, before the drafter wrote its context K/V over the verify slots
        self.tree_stats.block_tree_steps += 1
        rows = step.drafting
        self.tree_stats.not_speculated += R - len(rows)
        drafts, rows_dev = self._drafting_rows(step, rows)
        if rows_dev is not None:
            trees = type(trees)(tokens=trees.tokens[rows_dev], parents=trees.parents[rows_dev],
                                top1=trees.top1[rows_dev])
            self._hand_out_trees(step, rows, rows_dev, trees, drafts)
        mark("draft_end")
        return drafts

    def _path_rows(self, num_rows: int) -> torch.Tensor:
        """[num_rows] int64 the gather that puts each verified tree's accepted
        nodes (root first) at the front of its rows, as the KV move puts their
        K/V; the rows past a path take the root's (DFlash counts them rejected:
        their context K/V, the root's again, lands on the root's own slot).
        Chains' paths are prefixes already in place."""
        source = torch.arange(num_rows, device=self.input_ids.gpu.device)
        for T, g in self._verified.items():
            if g.all_chains:
                continue
            node_rows = g.node_rows.to(source.device)
            index = g.accept_index[:, :T].clamp(min=0).to(source.device)
            source[node_rows.flatten()] = node_rows.gather(1, index).flatten()
        return source
