"""What the V1 tree runner keeps of its steps, apart from the steps themselves:
the counters and device times of ``TreeStats`` (the ``spec_tree_stats`` RPC)
and the adaptive budget's side (``BudgetPolicy``): its shape for each step,
its startup profile, and the cost and acceptance each step teaches it.

Times are ``StepClock`` marks the runner sets as the step goes (forward,
forward_end around the target's forward; sample, then inside vLLM's
sampling draft, draft_inputs, extend_end, kv_moved, draft_end around the
drafting; sample_end), read only at the step's end, once the step's host
read has waited for the work they mark.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import math

import torch

from spec_plugins.budget import BudgetPolicy, shape_label
from spec_plugins.step_clock import StepClock
from spec_plugins.tree_drafting import chain_counterfactual

from .tree_groups import TreeGroup


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
    block_tree_steps: int = 0  # DFlash drafter (method "dflash"): steps that drafted DDTree trees
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


class StepBookkeeping:
    """The runner's statistics, its step's clock marks and the adaptive budget
    (None without ``budget``), fed by the runner at the points of its step."""

    def __init__(self, menu, device):
        self.stats = TreeStats()
        self.clock = StepClock(device)
        self.budget = BudgetPolicy(menu) if menu else None  # adaptive shape per step
        self.marks: dict = {}  # this step's StepClock marks
        self.pure_decode = False  # every request of this step decodes (no prefill rows): its time is a cost sample
        self._decoding = 0  # this step's requests past their prompt
        self._budget_pending = None  # (shape, batch size, drafting seconds) drafted for the next step
        self._budget_current = None  # the same for the step being verified

    def mark(self, name: str) -> None:
        self.marks[name] = self.clock.mark()

    # ------------------------------------------------------------ the step's points
    def step_begins(self, scheduler_output) -> None:
        """Before the target's forward: the shape drafted last step is the one verified now."""
        if self.budget is not None:
            self._budget_current, self._budget_pending = self._budget_pending, None
            spec = scheduler_output.scheduled_spec_decode_tokens
            self.pure_decode = all(n == 1 + len(spec.get(req_id, ()))
                                   for req_id, n in scheduler_output.num_scheduled_tokens.items())
        self.marks = {"forward": self.clock.mark()}

    def sampling_begins(self, input_batch) -> None:
        R = input_batch.num_reqs  # requests past their prompt (computed tokens from before the step)
        self._decoding = int((input_batch.num_computed_tokens_cpu[:R] >= input_batch.num_prompt_tokens[:R]).sum())
        self.mark("sample")

    def choose_shape(self, batch: int, configured):
        """This step's tree shape: ``configured``, or the adaptive budget's choice
        for ``batch`` drafting requests (a TreeShape, or None: no speculation),
        remembered as drafted for the next step."""
        if self.budget is None or batch == 0:
            return configured
        shape = self.budget.step(batch)
        label = shape_label(shape)
        self.stats.budget_steps[label] = self.stats.budget_steps.get(label, 0) + 1
        # drafting time: filled in from the marks at the end of the step (None: no cost sample)
        self._budget_pending = (shape, batch, None)
        return shape

    def step_ends(self, out, groups: dict[int, TreeGroup]) -> None:
        """Statistics and the budget's cost sample, from device times read now that
        the step's host read has waited for its work."""
        self.mark("sample_end")
        clock, stats, marks, decoding = self.clock, self.stats, self.marks, self._decoding
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
            if self._budget_pending is not None and self.pure_decode:
                self._budget_pending = (*self._budget_pending[:2], extend + tree)
        stats.steps += 1
        stats.step_seconds += step
        stats.decode_request_steps += decoding
        stats.decode_verify_seconds += decoding * (step - drafting)
        stats.decode_draft_seconds += decoding * drafting
        if self.budget is not None:
            self._record_budget_step(out, groups, step - tree - extend)

    # ------------------------------------------------------------ the budget
    def profile_plain_decode(self, run_batch, max_batch: int) -> None:
        """Seed the budget's plain-decode cost t_V(1, B) at startup, over
        batch sizes 1, 2, 4, ... up to 128 (or ``max_batch``): one forward of B
        one-token requests (``run_batch``: vLLM's own dummy run; it skips
        attention, which at these sizes is a small share). Without it the
        policy knows no speculation's cost only at the batch sizes where it
        happened to run it, and may keep speculating where plain decode is
        faster. Online steps refine every value (``CostTable``); trees' T > 1
        costs start from the same curve over tokens B * T. The profile is only
        a seed: the policy measures plain decode at each batch size before
        trusting it (two startups of one engine differed by 30 % at B = 16).
        Three rounds over the sizes, the fastest kept: a slow moment of the
        machine hits one round, not one size."""
        largest = min(128, max_batch)
        sizes = [1 << i for i in range(largest.bit_length()) if 1 << i <= largest]
        run_batch(largest)  # warm-up: allocations, first-call paths
        fastest = dict.fromkeys(sizes, math.inf)
        for _ in range(3):
            for batch in sizes:
                start = self.clock.mark()
                run_batch(batch)
                fastest[batch] = min(fastest[batch], self.clock.seconds(start, self.clock.mark()))
        for batch, seconds in fastest.items():
            self.budget.costs.seed_verify(1, batch, seconds)

    def _record_budget_step(self, out, groups: dict[int, TreeGroup], verify_seconds: float) -> None:
        """The adaptive budget learns from this step: the shape drafted for it
        (last step), the cost of verifying it (the step, minus this step's tree
        drafting: the head's extend runs whatever the shape, so it counts as
        verify cost) and how far each request's tree was accepted (from the
        emitted tokens vLLM already read to the host). Steps with prefill rows
        are not cost samples of any shape and are skipped."""
        current = self._budget_current
        if current is None or not self.pure_decode:
            return
        shape, batch, draft_seconds = current
        accepted, chains = [], ((), ())
        if shape is not None:
            paths = _host_paths(out, groups)
            accepted = [len(p) - 1 for p in paths.values()]
            if shape.topk > 1:
                chains = _counterfactual_chains(groups, paths)
        self.budget.record(shape, batch, verify_seconds, draft_seconds, accepted, *chains)


def _host_paths(out, groups: dict[int, TreeGroup]) -> dict[int, list]:
    """{batch row: accepted node path} of the step's trees, from the host copy
    of the emitted tokens in vLLM's output (no device read)."""
    emitted = getattr(out, "sampled_token_ids", None)
    if not emitted:
        return {}
    return {row: paths_from_emitted(g.tokens[i], g.parents[i], emitted[row])
            for g in groups.values() for i, row in enumerate(g.rows) if row < len(emitted) and emitted[row]}


def _counterfactual_chains(groups: dict[int, TreeGroup], paths: dict[int, list]) -> tuple[list, list]:
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
