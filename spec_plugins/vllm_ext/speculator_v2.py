"""``TreeEagleSpeculatorV2``: trees from vLLM's EAGLE head on Model Runner V2.

V2's ``EagleSpeculator`` loads the head (every checkpoint layout vLLM's own
EAGLE accepts), owns its buffers and runs its draft prefill; this subclass
keeps all of that and replaces what follows the prefill: instead of one
sampled draft per level, ``TreeDrafter``'s levels (top-k frontier with path
scores, branch KV in a scratch tensor, the tie-safe ancestor-closed
selection) draft a tree of T - 1 nodes per request. Its tokens go back to V2
as the request's drafts; its parents stay here, on the device
(``tree_parents``, indexed like V2's request states), for the next step's
tree build. With the adaptive budget the tree is the entry the runner's
budget chose (None: the root alone), padded to V2's T slots
(``tree_nodes``: how many nodes were drafted; ``budget_v2``).

Before the prefill, a step that verified trees is turned into the step of
chains that accepted the same paths (``_commit_walk``): the accepted nodes'
target KV moves to the front of each tree's slots, and the target's hidden
rows, the node tokens and the positions are gathered into path order. V2's
``prepare_prefill_inputs`` and the head's forward over the step's rows then
run unchanged, under causal attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import spec_tree_kernels as stk
from vllm.config.compilation import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import prepare_prefill_inputs

from spec_plugins.budget import verify_tokens
from spec_plugins.tree_commit import linear_positions, path_order

from .attention import publish_verify_trees
from .proposer import TreeDrafter, target_view


class V2TreeDrafter(TreeDrafter):
    """``TreeDrafter``'s levels over the head V2's speculator loaded, run eager."""

    def __init__(self, speculator: "TreeEagleSpeculatorV2", runner, shape, impl: str):
        self.speculator = speculator
        self._setup(runner, speculator.model, speculator.draft_attn_layer_names, speculator.max_model_len, shape,
                    impl)

    def _forward(self, attn_metadata: dict, input_ids, positions, hidden, slot_mapping=None):
        """The head over N rows -> (hidden for logits, hidden for the next level) [N, H].
        The draft levels' KV stays out of the paged cache (no slot mapping)."""
        n = input_ids.shape[0]
        with set_forward_context(attn_metadata, self.runner.vllm_config, num_tokens=n,
                                 cudagraph_runtime_mode=CUDAGraphMode.NONE, slot_mapping={}):
            out = self.model(input_ids=input_ids.to(torch.int32), positions=positions, hidden_states=hidden)
        last, nxt = out if isinstance(out, tuple) else (out, out)
        return last[:n], nxt[:n]


class TreeSpeculatorStateMixin:
    """What every V2 tree speculator (EAGLE heads here, DFlash block drafters in
    ``speculator_dflash_v2``) keeps for the runner and does before its drafter
    runs: the trees' parents and node counts per request state, and the commit
    of the last step's walk (KV moved, rows gathered into path order,
    positions back in chain order)."""

    def _init_tree_state(self, runner, device) -> None:
        self.tree_runner = runner
        T = runner.tree_settings.shape.num_draft_tokens
        # [max_num_reqs + 1, T] node-local parent of every node of each request's last tree (-1: the
        # root); the last row takes writes of padded rows (a captured draft step's), never read
        self.tree_parents = torch.full((self.max_num_reqs + 1, T), -1, dtype=torch.int64, device=device)
        # [max_num_reqs] nodes of each request's last tree that were drafted (adaptive budget: the
        # chosen entry's T, 1 for no speculation); the rest of its T slots is padding no walk reaches
        self.tree_nodes = torch.full((self.max_num_reqs,), T, dtype=torch.int64, device=device)

    def _commit_walk(self, step, input_batch, num_rows: int, slot_mappings: dict) -> torch.Tensor:
        """The verified trees as chains of their accepted paths: target KV moved,
        node tokens rewritten in the input batch's buffer into path order.
        Returns the gather [num_rows] int64 that puts the step's target rows
        (hidden states) into the same order."""
        runner = self.tree_runner
        kv_groups = runner.target_kv_groups(slot_mappings)
        source = torch.arange(num_rows, device=self.device)
        for g in step.groups.values():
            for slots, caches in kv_groups:
                stk.move_accepted_kv(caches, slots[g.node_rows].to(torch.int64), g.accept_index, g.accept_length,
                                     impl=runner.tree_impl)
            source = source[path_order(num_rows, g.q_starts, g.accept_index, g.nodes)]
        input_batch.input_ids[:num_rows] = input_batch.input_ids[source]
        return source

    def _chain_positions(self, step, input_batch) -> None:
        """Positions back in chain order where the plan wrote tree positions: every
        row of a uniform step (one write), else the tree groups' rows."""
        dtype = input_batch.positions.dtype
        if step.uniform_context is not None:
            nodes = self.tree_runner.uniform_trees.nodes
            input_batch.positions[: step.uniform_context.shape[0] * nodes] = linear_positions(
                step.uniform_context, nodes).to(dtype)
            return
        for g in step.groups.values():
            input_batch.positions[g.node_rows.flatten()] = linear_positions(g.context_lens, g.nodes).to(dtype)


class TreeEagleSpeculatorV2(TreeSpeculatorStateMixin, EagleSpeculator):
    def __init__(self, vllm_config, device, runner):
        super().__init__(vllm_config, device)
        self._init_tree_state(runner, device)
        self.tree_drafter: V2TreeDrafter | None = None

    def load_draft_model(self, target_model, target_attn_layer_names):
        """V2's loader, given a target whose decoder is ``transformer`` (BLOOM) as
        a view it can read (``proposer.target_view``)."""
        return super().load_draft_model(target_view(target_model), target_attn_layer_names)

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        """No graphs of V2's own drafting: the tree speculator runs the head's
        forwards eager (``_run_model`` and the draft levels with mode NONE), so
        V2's captures of its chain's prefill and decode steps would cost startup
        time and graph memory and never replay."""
        super().init_cudagraph_manager(CUDAGraphMode.NONE)

    def make_drafter(self) -> None:
        """After the head is loaded (``runner.load_model``)."""
        runner = self.tree_runner
        self.tree_drafter = V2TreeDrafter(self, runner, runner.tree_settings.shape, runner.tree_impl)

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                dp_sync_state=None, dummy_run=False, skip_attn_for_dummy_run=False, mm_inputs=None,
                is_profile=False, num_speculative_tokens=None):
        if dummy_run:  # profiling and warm-up: V2's own chain drafting sizes the same head forwards
            return super().propose(input_batch, attn_metadata, slot_mappings, last_hidden_states, aux_hidden_states,
                                   num_sampled, num_rejected, last_sampled, next_prefill_tokens, temperature, seeds,
                                   dp_sync_state=dp_sync_state, dummy_run=dummy_run,
                                   skip_attn_for_dummy_run=skip_attn_for_dummy_run, mm_inputs=mm_inputs,
                                   is_profile=is_profile, num_speculative_tokens=num_speculative_tokens)
        num_reqs, num_tokens = input_batch.num_reqs, input_batch.num_tokens
        shape = self.tree_runner.draft_shape(input_batch)  # host: the fixed shape or the budget's choice
        features = self.tree_drafter.features(last_hidden_states, aux_hidden_states)
        step = self.tree_runner.tree_step
        publish_verify_trees(None)  # the head runs causal over the (gathered) rows
        if step is not None:
            if step.groups:
                features = features[self._commit_walk(step, input_batch, features.shape[0], slot_mappings)]
            self._chain_positions(step, input_batch)
        self._copy_request_inputs(num_reqs, input_batch.idx_mapping, temperature, seeds)
        prepare_prefill_inputs(self.last_token_indices, self.current_draft_step, self.input_buffers, input_batch,
                               num_sampled, num_rejected, last_sampled, next_prefill_tokens, self.max_num_reqs)
        self.hidden_states[:num_tokens].copy_(features[:num_tokens])
        h_logits, h_next = self._run_model(num_tokens, attn_metadata, slot_mappings, num_tokens_across_dp=None,
                                           cudagraph_runtime_mode=CUDAGraphMode.NONE)
        if num_speculative_tokens == 0:  # vLLM skips this step's drafts (V2 sets them to -1): the head's KV is kept
            return self.draft_tokens[:num_reqs]
        last_rows = self.last_token_indices[:num_reqs]
        budget = self.tree_runner.budget
        if budget is not None:
            budget.levels_begin()
        tokens, parents = self._draft(input_batch, h_logits[last_rows], h_next[last_rows],
                                      self.input_buffers.positions[last_rows] + 1, shape)
        self.tree_parents[input_batch.idx_mapping] = parents
        self.draft_tokens[:num_reqs] = tokens
        if budget is not None:
            self.tree_nodes.index_fill_(0, input_batch.idx_mapping.to(torch.int64), verify_tokens(shape))
            budget.levels_end()
        return self.draft_tokens[:num_reqs]

    # -------------------------------------------------------------- the steps
    def _draft(self, input_batch, last_hidden, next_hidden, kv_lens, shape) -> tuple[torch.Tensor, torch.Tensor]:
        """Trees of ``shape`` (None: the root alone, no draft levels) for every
        request of the batch, padded to the T slots V2 schedules: (tokens
        [R, T - 1], parents [R, T]). Padding nodes hang off the root with token
        0 (any id the target's forward takes); the step that verifies them
        masks them out of the walk (``tree_nodes``)."""
        R, T = input_batch.num_reqs, self.tree_parents.shape[1]
        if shape is None:
            tokens = torch.zeros(R, T - 1, dtype=torch.int64, device=self.device)
            parents = torch.zeros(R, T, dtype=torch.int64, device=self.device)
            parents[:, 0] = -1
            return tokens, parents
        gid = next(i for i, g in enumerate(self.kv_cache_config.kv_cache_groups)
                   if self.tree_drafter.layer_name in g.layer_names)
        block_rows = self.block_tables.input_block_tables[gid][:R]
        max_kv_len = int(input_batch.seq_lens_cpu_upper_bound[:R].max())
        layer = self.tree_runner.compilation_config.static_forward_context[self.tree_drafter.layer_name]
        kv = layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache
        trees = self.tree_drafter.draft(last_hidden, next_hidden, kv_lens.to(torch.int64), max_kv_len, block_rows,
                                        layer.impl.kv_views(layer, kv), shape)
        pad = T - trees.parents.shape[1]
        if pad == 0:
            return trees.tokens, trees.parents
        return F.pad(trees.tokens, (0, pad)), F.pad(trees.parents, (0, pad))  # padding: token 0, parent 0 (the root)
