"""An oracle drafter for vLLM tree-mode tests (TEST CODE ONLY: a test double
for the head's predictions; nothing in spec_plugins imports it).

Why: the lossless property of tree verification (greedy outputs token-identical
to no speculation) only means something when deep paths are accepted and
siblings rejected. A trained head gives that on the one target it was trained
for (SmolLM2); a random head on a tiny random target of another architecture
(sliding windows, sinks, MLA, ...) drafts almost nothing the target accepts,
so verification would only ever see the root's bonus token. The oracle knows
what the target will emit (its no-speculation greedy continuation, computed
first by the test) and drafts trees that contain it, so every architecture's
tree rows, walk and accepted-path KV move are exercised at depth.

What it replaces: only the drafted tokens. It wraps the engine's
``TreeDrafter.draft`` in place: the real head still runs (its extend over the
step's rows in ``propose_draft_token_ids`` and its draft levels in
``draft``), then the trees it returns are swapped for oracle trees of the same
shape before the runner reads them. Everything downstream (the scheduler's
cut of drafts to a BFS prefix, tree attention, the walk, the KV move, vLLM's
metrics) is the production path.

The trees: per drafting request (row), from its prompt (the runner's
``requests[req_id].prompt_token_ids``) the oracle looks up the reference
sequence prompt + greedy continuation; the tree's root is the token at
position ``kv_len`` (the token sampled this step) and a depth-d node sits at
position ``kv_len + d``. It builds a random tree of the configured shape (T
nodes, depth <= num_steps, at most topk children per node, BFS order, parents
before children; a chain when topk is 1) holding the true path of depth
min(num_steps, T - 1), with random sibling branches (distinct tokens under one
parent) and the true child at a random place among its siblings. With
probability ``wrong_rate`` a tree gets a wrong token instead of the true one at
a random depth (and no true child there), so rejections at every depth are
exercised; ``wrong_depth`` forces that depth on every tree (a deliberately
broken oracle: ``wrong_depth=1`` must drop acceptance to zero). ``top1``
marks each parent's first child. A seeded ``numpy`` generator makes the
trees reproducible for a given schedule.

Install in an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)::

    oracle = TreeOracle(references, vocab_size=256).install(llm)
    llm.generate(...)
    oracle.stats  # trees drafted, wrong trees, rows whose history left the reference
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class OracleStats:
    trees: int = 0  # trees the oracle drafted
    wrong_trees: int = 0  # trees with a wrong token on the true path
    true_nodes: int = 0  # nodes on the true path (the most verification can accept)
    unknown_positions: int = 0  # path positions past the reference (random tokens there)
    off_reference: int = 0  # rows whose committed tokens differ from the reference (a failed test)
    unknown_prompts: int = 0  # rows whose prompt has no reference
    head_drafts: int = 0  # the real head's draft() calls (it keeps running)


@dataclass
class TreeOracle:
    references: dict  # tuple(prompt token ids) -> list(prompt + greedy continuation)
    vocab_size: int
    seed: int = 0
    wrong_rate: float = 0.25
    wrong_depth: int | None = None  # every tree wrong at this depth (a deliberately broken oracle)
    avoid: tuple = (0, 1, 2, 3)  # token ids never drafted as siblings (pad/bos/eos/unk)
    stats: OracleStats = field(default_factory=OracleStats)

    @classmethod
    def from_outputs(cls, prompts: list[list[int]], continuations: list[list[int]], vocab_size: int, **kw):
        refs = {}
        for p, c in zip(prompts, continuations):
            key = tuple(p)
            full = list(p) + list(c)
            assert refs.setdefault(key, full) == full, "one prompt, two different greedy continuations"
        return cls(refs, vocab_size, **kw)

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)
        self._rows = None

    # ------------------------------------------------------------ install
    def install(self, llm) -> "TreeOracle":
        """Wrap the tree runner of ``llm`` (an in-process vLLM engine in tree mode)."""
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        drafter = runner.tree_drafter
        assert drafter is not None, "not a spec_tree engine"
        run_draft_trees, head_draft = runner._draft_trees, drafter.draft
        oracle = self

        def draft_trees(step, last_hidden, next_hidden, shape):
            oracle._rows = step.drafting  # the rows the drafter's R trees belong to, in order
            try:
                return run_draft_trees(step, last_hidden, next_hidden, shape)
            finally:
                oracle._rows = None

        def draft(last_hidden, next_hidden, kv_lens, max_kv_len, block_rows, kv_views, shape=None):
            real = head_draft(last_hidden, next_hidden, kv_lens, max_kv_len, block_rows, kv_views, shape)
            oracle.stats.head_drafts += 1
            return oracle.trees(runner, oracle._rows, kv_lens, shape or drafter.shape, like=real)

        runner._draft_trees = draft_trees
        drafter.draft = draft
        return self

    # ------------------------------------------------------------ trees
    def trees(self, runner, rows, kv_lens, shape, like):
        import torch

        from spec_plugins.tree_drafting import DraftTrees

        assert rows is not None and len(rows) == like.tokens.shape[0], (rows, like.tokens.shape)
        T = like.parents.shape[1]
        batch = runner.input_batch
        tokens, parents, top1 = [], [], []
        for r, kv_len in zip(rows, kv_lens.tolist()):
            req_id = batch.req_ids[r]
            ref = self.references.get(tuple(runner.requests[req_id].prompt_token_ids))
            if ref is None:
                self.stats.unknown_prompts += 1
                ref = []
            else:  # what is committed (before this step's sample) must be the reference's
                n = min(int(batch.num_tokens_no_spec[r]), kv_len, len(ref))
                if list(batch.token_ids_cpu[r, :n]) != ref[:n]:
                    self.stats.off_reference += 1
            t, p, o = self.tree(ref, kv_len, shape, T)
            tokens.append(t)
            parents.append(p)
            top1.append(o)
        dev = like.tokens.device
        return DraftTrees(tokens=torch.tensor(tokens, dtype=like.tokens.dtype, device=dev),
                          parents=torch.tensor(parents, dtype=like.parents.dtype, device=dev),
                          top1=torch.tensor(top1, dtype=torch.bool, device=dev))

    def tree(self, ref: list, kv_len: int, shape, T: int):
        """One tree: (tokens [T-1] of nodes 1..T-1, parents [T], top1 [T]), BFS order."""
        S, K = shape.num_steps, shape.topk
        rng = self.rng
        depth = T - 1 if K == 1 else min(S, T - 1)  # a chain: every node on the path
        truth = [ref[kv_len + d] if kv_len + d < len(ref) else None for d in range(1, depth + 1)]
        self.stats.trees += 1
        self.stats.true_nodes += depth
        self.stats.unknown_positions += sum(t is None for t in truth)
        wrong = self.wrong_depth if self.wrong_depth is not None else (
            int(rng.integers(1, depth + 1)) if rng.random() < self.wrong_rate else None)
        if wrong is not None:
            self.stats.wrong_trees += 1
        # nodes: [parent, depth, token]; node 0 the root
        nodes = [[-1, 0, None]]
        children: dict[int, list[int]] = {0: []}

        def add(parent: int, token: int) -> int:
            nodes.append([parent, nodes[parent][1] + 1, token])
            children[parent].append(len(nodes) - 1)
            children[len(nodes) - 1] = []
            return len(nodes) - 1

        def fresh(parent: int, banned=()) -> int:
            used = {nodes[c][2] for c in children[parent]} | set(banned) | set(self.avoid)
            while True:
                tok = int(rng.integers(0, self.vocab_size))
                if tok not in used:
                    return tok

        node = 0
        for d, tok in enumerate(truth, start=1):
            if d == wrong or tok is None:
                tok = fresh(node, banned=() if tok is None else (tok,))
            node = add(node, tok)
        truth_at = {d: t for d, t in enumerate(truth, start=1)}
        while len(nodes) < T:  # random siblings: under any node with room (depth < S, < K children)
            open_ = [i for i in range(len(nodes)) if nodes[i][1] < S and len(children[i]) < K]
            parent = open_[int(rng.integers(len(open_)))]
            d = nodes[parent][1] + 1
            add(parent, fresh(parent, banned=(truth_at[d],) if truth_at.get(d) is not None else ()))
        # BFS order: by depth, then by the parent's new index, siblings in random order
        order, new = [0], {0: 0}
        level = [0]
        while level:
            nxt = []
            for p in level:
                kids = list(children[p])
                rng.shuffle(kids)
                nxt += kids
            for i in nxt:
                new[i] = len(order)
                order.append(i)
            level = nxt
        parents = [-1] + [new[nodes[i][0]] for i in order[1:]]
        first_child = {}
        for j, p in enumerate(parents[1:], start=1):
            first_child.setdefault(p, j)
        top1 = [True] + [first_child[p] == j for j, p in enumerate(parents[1:], start=1)]
        return [nodes[i][2] for i in order[1:]], parents, top1


@dataclass
class BlockOracleStats:
    blocks: int = 0  # request-steps whose block logits the oracle replaced
    second_rank: int = 0  # positions whose true token it ranked second (its rank-0 sibling is wrong)
    unknown_positions: int = 0  # positions past the reference (left to the real drafter's logits)
    unknown_prompts: int = 0  # requests whose prompt has no reference


@dataclass
class BlockLogitsOracle:
    """The oracle for block drafters (V2: ``TreeDFlashSpeculatorV2``, ``install``;
    V1: ``TreeDFlashProposer``, ``install_v1``):
    it replaces the drafter's mask-row logits [R, L, V] (``block_logits``)
    before DDTree's top-K and tree build, so the production path from
    ``block_topk`` on (the best-first tree, the scheduler's cut, tree
    attention, the walk, the KV move) runs on trees that hold the true
    continuation. Per position the true token gets rank 0, or with
    probability ``second_rate`` rank 1 under a wrong rank-0 sibling (which
    the walk must reject, then accept the sibling); the other ranks are
    random tokens. references: tuple(prompt ids) -> prompt + greedy continuation."""

    references: dict
    seed: int = 0
    second_rate: float = 0.3
    avoid: tuple = (0, 1, 2, 3)
    stats: BlockOracleStats = field(default_factory=BlockOracleStats)

    def install(self, runner) -> "BlockLogitsOracle":
        """On V2's ``TreeDFlashSpeculatorV2`` (``runner.speculator``)."""
        spec = runner.speculator
        real = spec.block_logits
        rng = np.random.default_rng(self.seed)
        states_of = runner.req_states

        def block_logits(hidden, num_reqs):
            logits = real(hidden, num_reqs)
            L = spec.num_speculative_steps
            states = spec.sample_idx_mapping[: num_reqs * L].view(num_reqs, L)[:, 0].tolist()
            pos = spec.sample_pos[: num_reqs * L].view(num_reqs, L).tolist()
            for r, state in enumerate(states):
                if state < 0:
                    continue
                plen = int(states_of.prompt_len.np[state])
                self._rewrite(logits[r], pos[r], tuple(states_of.all_token_ids.gpu[state, :plen].tolist()), rng)
            return logits

        spec.block_logits = block_logits
        return self

    def install_v1(self, runner) -> "BlockLogitsOracle":
        """On V1's ``TreeDFlashProposer`` (``runner.drafter``): its ``propose``
        covers the batch's R requests in order, their 1 + L query positions in
        the proposer's ``positions`` buffer (bonus first)."""
        drafter = runner.drafter
        real = drafter.block_logits
        rng = np.random.default_rng(self.seed)

        def block_logits(hidden):
            logits = real(hidden)
            R, L = logits.shape[:2]
            pos = drafter.positions[: R * (1 + L)].view(R, 1 + L)[:, 1:].tolist()
            for r in range(R):
                request = runner.requests[runner.input_batch.req_ids[r]]
                self._rewrite(logits[r], pos[r], tuple(request.prompt_token_ids), rng)
            return logits

        drafter.block_logits = block_logits
        return self

    def _rewrite(self, logits, positions: list, prompt: tuple, rng) -> None:
        """One request's mask rows [L, V] (row i drafts the token at positions[i])."""
        import torch

        ref = self.references.get(prompt)
        if ref is None:
            self.stats.unknown_prompts += 1
            return
        self.stats.blocks += 1
        V = logits.shape[-1]
        for i, p in enumerate(positions):
            if p >= len(ref):
                self.stats.unknown_positions += 1
                continue
            true = ref[p]
            others = [int(t) for t in rng.choice(V, 8, replace=False) if t != true and t not in self.avoid][:3]
            ranked = [true, *others]
            if rng.random() < self.second_rate:
                ranked[0], ranked[1] = ranked[1], ranked[0]
                self.stats.second_rank += 1
            row = torch.full((V,), -30.0, dtype=logits.dtype, device=logits.device)
            row[torch.tensor(ranked, device=logits.device)] = torch.tensor(
                [10.0, 9.0, 8.0, 7.0][: len(ranked)], dtype=logits.dtype, device=logits.device)
            logits[i] = row
