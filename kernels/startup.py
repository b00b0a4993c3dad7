"""Engine startup for the kernels: build and compile before serving, never inside it.

``prepare(device)`` is what an engine worker calls once it owns its device:
on CUDA it builds or loads the CUDA kernels now (``cuda_ops.ensure_built``;
the build runs in a killable child behind an owner-PID lock,
``cuda_build_guard``), so no compile runs on the first decode step under the
engine's watchdogs; when the toolchain is missing or the build fails or times
out, it logs why and ``impl="auto"`` uses Triton for build / verify / KV move
instead. On the host CPU it builds tree attention's C kernel
(``cpu_attention``, what ``auto`` then uses): a failure leaves the torch path
and is an error only when the kernel was asked for.

``warm_up(config, device, ...)`` is what the engine calls once its KV cache exists,
before the first request: it launches once every Triton kernel variant
(``triton_launch``) serving ``config`` can make, so none JIT-compiles inside
a step. Serving meets new variants mid-run: an engine's scheduler cuts drafts
to its token budget (vLLM: any tree size up to the configured one turns up),
the adaptive budget switches shapes, the split-KV plan follows batch and
context. ``ServingConfig`` and ``AttentionLayer`` describe the configuration
in the kernels' terms; ``serving_launches`` enumerates one launch per variant
through the entry points serving calls, on small dummy inputs.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .kv_layout import refuse_tiled
from .modes import TreeMaskMode, parse_mask_mode
from .tree_shape import TreeShape, parent_list_width, pool_size
from .triton_launch import Launch, Variant, capturing

logger = logging.getLogger("spec_tree_kernels")
# the api ops with Triton kernels, attention aside
TRITON_OPS = ("select", "from_parents", "verify", "verify_sampling", "keyed_randoms", "move_kv", "block_tree")


def prepare(device, build_timeout: float | None = None) -> dict[str, str]:
    """Call once at engine startup on the serving device. Returns the
    implementation ``impl="auto"`` will use per op there (logged).
    build_timeout: seconds the CUDA build may take (default: ``cuda_ops.ensure_built``'s)."""
    # imported here, not at module level: ``import spec_tree_kernels`` must not load
    # cuda_ops, which the build child runs as __main__ (a second copy otherwise)
    from . import cuda_ops
    from .api import _AUTO_PREFERENCE, resolve_impl

    device = torch.device(device)
    if device.type == "cuda":
        cuda_ops.ensure_built(timeout=build_timeout)
    elif device.type == "cpu":
        import os

        from . import cpu_attention
        from .api import IMPL_ENV

        if not cpu_attention.build():
            if os.environ.get(IMPL_ENV) == "cpu":
                raise RuntimeError(f"{IMPL_ENV}=cpu asks for the host tree attention kernel, which did not build: "
                                   f"{cpu_attention.build_error()}")
            logger.info("spec_tree_kernels: the host tree attention kernel did not build (torch serves): %s",
                        cpu_attention.build_error())
        else:
            logger.info("spec_tree_kernels: host tree attention kernel built, %d-float register blocks",
                        cpu_attention.register_block_floats())
    impls = {op: resolve_impl(op, "auto", device) for op in _AUTO_PREFERENCE}
    logger.info("spec_tree_kernels on %s: %s", device, impls)
    return impls


# ------------------------------------------------- what serving can launch


@dataclass(frozen=True)
class ServingConfig:
    """A serving configuration as the tree kernels see it.

    shapes           every shape the engine drafts: the configured one, or
                     each speculative entry of the adaptive budget's menu
    mode             the tree mask mode verify attention reads
    prefix_trim      the engine verifies any BFS prefix of a drafted tree
                     (vLLM's scheduler cuts drafts to its token budget), so
                     trees of every size 2..T turn up; a tree of one node
                     has no draft and launches nothing
    verify_depth     D of the verify ops and the KV move: their accepted-path
                     arrays are D + 1 wide. One D per configuration (at least
                     every shape's deepest node, ``TreeShape.max_depth``), so
                     the walks compile once per tree size, not per depth
    max_batch        most trees of one size in a step (the engine's batch limit)
    max_context_len  longest committed context (the engine's context limit)
    vocab_size       V of the sampled verify's target distribution
    context_dtype, accept_dtype, probs_dtype  what the engine passes as
                     context lengths, accepted paths / lengths, and target
                     probabilities (argument dtypes are part of a variant)
    block_drafter    the trees come from a block drafter (DDTree:
                     ``build_block_tree`` over each shape's L = num_steps
                     positions of top-K = topk tokens, num_draft_tokens - 1
                     nodes), not from EAGLE pools (no selection)
    """

    shapes: tuple
    mode: TreeMaskMode
    prefix_trim: bool
    verify_depth: int
    max_batch: int
    max_context_len: int
    vocab_size: int
    context_dtype: torch.dtype = torch.int64
    accept_dtype: torch.dtype = torch.int64
    probs_dtype: torch.dtype = torch.float32
    block_drafter: bool = False

    def __post_init__(self):
        object.__setattr__(self, "shapes", tuple(self.shapes))
        object.__setattr__(self, "mode", parse_mask_mode(self.mode))
        if not self.shapes or not all(isinstance(s, TreeShape) for s in self.shapes):
            raise ValueError(f"shapes must be a non-empty sequence of TreeShape, got {self.shapes!r}")
        deepest = max(s.max_depth for s in self.shapes)
        if self.verify_depth < deepest:
            raise ValueError(f"verify_depth={self.verify_depth} is shallower than the deepest drafted node ({deepest})")

    @property
    def tree_sizes(self) -> tuple[int, ...]:
        """Every node count T a verify step can see."""
        if self.prefix_trim:
            return tuple(range(2, max(s.num_draft_tokens for s in self.shapes) + 1))
        return tuple(sorted({s.num_draft_tokens for s in self.shapes if s.num_draft_tokens > 1}))


@dataclass(frozen=True)
class AttentionLayer:
    """One attention layer whose tree rows serving computes, as the kernels read it.

    num_q_heads       Hq of the layer (per rank)
    k_cache, v_cache  the layer's paged K / V views [num_blocks, block_size, Hkv, D]
                      that serving reads (their dtype, strides and alignment
                      are part of every variant; warm-up reads them, never writes)
    block_table       the engine's block table [rows, width] for this layer:
                      its width and dtype are what the kernels see (no row is read)
    impl              the tree attention ``impl`` serving passes (``api.resolve_impl``)
    window, sinks, soft_cap, alibi_slopes   the layer's features as serving
                      passes them to ``TreeAttentionPlan.run`` /
                      ``BranchAttentionPlan.run`` (``attention_reference``;
                      ``features_from_vllm`` reads them off a vLLM impl), None
                      for none: each flag is a constexpr of its own variants,
                      and the window bounds the split plans the layer can get
    """

    num_q_heads: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    impl: str = "auto"
    window: int | None = None
    sinks: torch.Tensor | None = None
    soft_cap: float | None = None
    alibi_slopes: torch.Tensor | None = None

    @property
    def features(self) -> dict:
        """The keyword arguments of this layer's attention runs."""
        return dict(window=self.window, sinks=self.sinks, soft_cap=self.soft_cap, alibi_slopes=self.alibi_slopes)


def _attention_cases(nodes: int, layer: AttentionLayer, config: ServingConfig, device) -> list[tuple[int, int]]:
    """(batch, context bound) pairs that reach every launch plan serving can
    get for trees of ``nodes`` nodes: the plan (``plan_tree_attention``, the
    one rule) depends on them only through the split count, which takes each
    value ceil(context bound / min_chunk) allows (a windowed layer's bound
    is at most W - 1: the plan applies it); a larger batch never splits
    more (more programs per chunk, a larger workspace), so the batches stop
    at the first that stays single-pass at the longest context."""
    from .attention_triton import SPLIT_MAX, plan_tree_attention

    _, block_size, hkv, dim = layer.k_cache.shape
    width = layer.block_table.shape[1]

    def plan(batch: int, longest: int):
        return plan_tree_attention(batch, nodes, layer.num_q_heads, hkv, dim, block_size, width, device,
                                   max_context_len=longest, window=layer.window)

    longest = config.max_context_len
    min_chunk = plan(1, longest).min_chunk
    bounds = sorted({min(j * min_chunk, longest) for j in range(SPLIT_MAX + 1)})
    cases: dict[tuple[str, int], tuple[int, int]] = {}
    for batch in range(1, config.max_batch + 1):
        for bound in bounds:
            p = plan(batch, bound)
            cases.setdefault((p.kernel, p.num_splits), (batch, bound))
        if plan(batch, longest).kernel == "single":
            break
    return list(cases.values())


class _DummyAttention:
    """Verify attention inputs for ``layer`` on dummy data, made once per
    (tree size, batch): empty contexts (tree positions only, so block 0 of the
    real cache is read and nothing is written), chain-shaped trees, the mask
    built as serving builds it (``tree_from_parents``)."""

    def __init__(self, layer: AttentionLayer, config: ServingConfig):
        self.layer, self.config = layer, config
        self._inputs: dict[tuple[int, int], tuple] = {}

    def inputs(self, nodes: int, batch: int):
        key = (nodes, batch)
        if key not in self._inputs:
            from .api import tree_from_parents

            layer, device = self.layer, self.layer.k_cache.device
            parents = torch.arange(-1, nodes - 1, device=device).expand(batch, nodes)
            context_lens = torch.zeros(batch, dtype=self.config.context_dtype, device=device)
            # the reference: a Triton build here would be held with the attention launches, not run
            mask = tree_from_parents(parents, context_lens.long(), self.config.mode, impl="torch").tree_mask
            table = torch.zeros(batch, layer.block_table.shape[1], dtype=layer.block_table.dtype, device=device)
            q = torch.zeros(batch, nodes, layer.num_q_heads, layer.k_cache.shape[3], dtype=layer.k_cache.dtype,
                            device=device)
            self._inputs[key] = table, context_lens, mask, q
        return self._inputs[key]

    def run(self, nodes: int, batch: int, bound: int) -> None:
        """One verify attention of ``batch`` trees of ``nodes`` nodes with the
        context bound ``bound``, through ``TreeAttentionPlan`` (what both
        adapters call)."""
        from .attention_plan import TreeAttentionPlan

        table, context_lens, mask, q = self.inputs(nodes, batch)
        layer = self.layer
        plan = TreeAttentionPlan.create(table, context_lens, mask, self.config.mode, nodes, layer.k_cache.shape[1],
                                        bound, impl="triton")
        plan.run(q, layer.k_cache, layer.v_cache, **layer.features)


def draft_levels(shape: TreeShape) -> tuple[int, int]:
    """(K, levels) of the draft steps that drafting ``shape`` runs with
    ``BranchAttention``: K frontier nodes per request, levels 1..levels - 1
    (a chain drafts only the T - 1 levels it verifies; as the vLLM drafter)."""
    steps = shape.num_steps
    if shape.topk == 1:
        steps = max(1, min(steps, shape.num_draft_tokens - 1))
    return shape.topk, steps


class _DummyDraft:
    """Draft-step attention inputs for ``layer`` as the vLLM drafter makes
    them (``BranchAttention.from_paged``): a ``BranchAttentionPlan`` over
    empty contexts, the branch scratch [R, E, Hkv, D] of the shape's E, the
    query and output in the cache dtype; levels 1 and 2 (an empty and a
    non-empty ancestor mask). Nothing of the real cache is written."""

    def __init__(self, layer: AttentionLayer, config: ServingConfig):
        self.layer, self.config = layer, config

    def run(self, topk: int, steps: int, batch: int, bound: int) -> None:
        from .branch_attention import BranchAttentionPlan

        layer, device = self.layer, self.layer.k_cache.device
        refuse_tiled("Triton", k_cache=layer.k_cache, v_cache=layer.v_cache)  # before new_zeros, which tiles lack
        num_blocks, block_size, hkv, dim = layer.k_cache.shape
        width = max(layer.block_table.shape[1], -(-bound // block_size))
        table = torch.zeros(batch, width, dtype=layer.block_table.dtype, device=device)
        kv_lens = torch.zeros(batch, dtype=self.config.context_dtype, device=device)
        plan = BranchAttentionPlan.create(table, kv_lens, bound, block_size, impl="triton")
        scratch = layer.k_cache.new_zeros(2, batch, (steps - 1) * topk, hkv, dim)
        q = layer.k_cache.new_zeros(batch, topk, layer.num_q_heads, dim)
        out = torch.empty_like(q)
        for level in range(1, min(steps, 3)):
            ancestors = torch.zeros(batch, topk, (level - 1) * topk, dtype=torch.bool, device=device)
            plan.run(q, layer.k_cache, layer.v_cache, scratch[0], scratch[1], level * topk, ancestors, None, out,
                     **layer.features)


def _attention_signature(layer: AttentionLayer, config: ServingConfig) -> tuple:
    """The variants of one small verify attention over ``layer``, and its
    window: layers with equal ones launch equal variants for every case (the
    cache views' dtype, strides and alignment, the head counts, the table and
    the feature flags are all in the variants; the window value, a launch
    argument, bounds which split plans occur)."""
    with capturing() as launches:
        _DummyAttention(layer, config).run(config.tree_sizes[-1], 1, 0)
    return frozenset(launch.variant for launch in launches), layer.window


def serving_launches(config: ServingConfig, device, *, impls: dict[str, str] | None = None,
                     layers: Sequence[AttentionLayer] = (), kv_caches: Sequence[torch.Tensor] = (),
                     draft_layers: Sequence[AttentionLayer] = ()) -> list[Launch]:
    """One ``Launch`` per Triton variant serving ``config`` on ``device`` can
    make, each captured from the public entry point serving calls
    (``api.select_tree_nodes`` / ``tree_from_parents`` / ``verify_tree_greedy`` /
    ``verify_tree_sampling`` / ``keyed_randoms`` / ``move_accepted_kv`` / ``build_block_tree``,
    ``TreeAttentionPlan``) on small dummy inputs of
    the dtypes, strides and alignment serving passes.

    impls: op (``TRITON_OPS``) -> the impl serving passes (default "auto");
    only ops that resolve to Triton count.
    layers: every attention layer whose tree rows serving computes (with
    its features: a windowed / sink / soft-cap / ALiBi layer warms its own
    variants and split plans).
    kv_caches: every [num_blocks, block_size, H, D] view the KV move reads.
    draft_layers: every draft-head layer whose draft steps read the paged
    cache through ``branch_attention.BranchAttentionPlan`` (vLLM's drafter):
    each shape's K and levels, every split plan batch and context allow.
    """
    from . import api

    device = torch.device(device)
    impls = {op: (impls or {}).get(op, "auto") for op in TRITON_OPS}
    triton_ops = {op for op, impl in impls.items() if api.resolve_impl(op, impl, device) == "triton"}
    found: dict[Variant, Launch] = {}

    def add(case: Callable[[], object]) -> None:
        with capturing() as launches:
            case()
        for held in launches:
            found.setdefault(held.variant, held)

    def zeros(*shape, dtype=torch.int64):
        return torch.zeros(*shape, dtype=dtype, device=device)

    if "select" in triton_ops and not config.block_drafter:
        for s in config.shapes:
            if s.topk > 1:  # a chain's selection is its pool's first T - 1 entries: nothing ranks it
                add(lambda s=s: api.select_tree_nodes(
                    zeros(1, pool_size(s.topk, s.num_steps), dtype=torch.float32),
                    zeros(1, parent_list_width(s.topk, s.num_steps)), s.topk, s.num_steps, s.num_draft_tokens,
                    validate=False, impl=impls["select"]))
    if "block_tree" in triton_ops and config.block_drafter:
        from .block_tree import build_block_tree

        for s in config.shapes:  # one variant per (L, K, N): the batch is only the grid
            add(lambda s=s: build_block_tree(zeros(1, s.num_steps, s.topk, dtype=torch.float32),
                                             zeros(1, s.num_steps, s.topk), s.num_draft_tokens - 1,
                                             impl=impls["block_tree"]))
    width = config.verify_depth + 1
    for nodes in config.tree_sizes:
        no_links = torch.full((1, nodes), -1, dtype=torch.int64, device=device)
        if "from_parents" in triton_ops and config.mode != TreeMaskMode.FULL_MASK:  # as vLLM's V2 runner builds them
            add(lambda n=nodes: api.tree_from_parents(
                torch.arange(-1, n - 1, device=device)[None], zeros(1), config.mode, max_depth=n - 1, validate=False,
                impl=impls["from_parents"]))
        if "verify" in triton_ops:
            add(lambda n=nodes, links=no_links: api.verify_tree_greedy(
                zeros(1, n), links, links, zeros(1, n), config.verify_depth, impl=impls["verify"]))
        if "verify_sampling" in triton_ops:
            p = config.probs_dtype
            add(lambda n=nodes, links=no_links: api.verify_tree_sampling(
                zeros(1, n), links, links, zeros(1, n, config.vocab_size, dtype=p), zeros(1, n, dtype=p),
                torch.ones(1, config.vocab_size, dtype=p, device=device), config.verify_depth,
                impl=impls["verify_sampling"]))
        if "keyed_randoms" in triton_ops:  # the sampled walk's randoms on vLLM's V2 runner (verify_v2)
            from .keyed_randoms import keyed_randoms

            add(lambda n=nodes: keyed_randoms(zeros(1), zeros(1), n, config.vocab_size, impl=impls["keyed_randoms"]))
        if "move_kv" in triton_ops and kv_caches:  # nothing accepted: reads the slots, moves no row
            add(lambda n=nodes: api.move_accepted_kv(
                kv_caches, zeros(1, n), torch.full((1, width), -1, dtype=config.accept_dtype, device=device),
                zeros(1, dtype=config.accept_dtype), impl=impls["move_kv"]))
    representatives: dict[tuple, AttentionLayer] = {}
    for layer in layers:
        if api.resolve_impl("attention", layer.impl, layer.k_cache.device) == "triton":
            representatives.setdefault(_attention_signature(layer, config), layer)
    for layer in representatives.values():
        dummy = _DummyAttention(layer, config)
        for nodes in config.tree_sizes:
            for batch, bound in _attention_cases(nodes, layer, config, device):
                add(lambda n=nodes, b=batch, c=bound: dummy.run(n, b, c))
    for layer in draft_layers:
        if api.resolve_impl("attention", layer.impl, layer.k_cache.device) != "triton":
            continue
        draft = _DummyDraft(layer, config)
        for topk, steps in sorted({draft_levels(s) for s in config.shapes}):
            if steps < 2:  # one level: the root's children come from the last committed position, no draft step
                continue
            for batch, bound in _attention_cases(topk, layer, config, device):
                add(lambda k=topk, s=steps, b=batch, c=bound: draft.run(k, s, b, c))
    return list(found.values())


@dataclass
class WarmUp:
    """What ``warm_up`` launched: one ``Variant`` per launch, and the wall time."""

    variants: list
    seconds: float

    def counts(self) -> dict[str, int]:
        """Variants per kernel."""
        return dict(Counter(v.kernel for v in self.variants))


def warm_up(config: ServingConfig, device, *, impls: dict[str, str] | None = None,
            layers: Sequence[AttentionLayer] = (), kv_caches: Sequence[torch.Tensor] = (),
            draft_layers: Sequence[AttentionLayer] = ()) -> WarmUp:
    """Launch every Triton variant serving ``config`` can make once, now
    (``serving_launches``; same arguments): on a GPU each compiles here, at
    startup, instead of stalling a step under load. Call it after the KV cache
    exists and before the first request. Where nothing resolves to Triton (the
    host CPU unless ``SPEC_TREE_KERNELS_IMPL=triton``) it launches nothing."""
    device = torch.device(device)
    t0 = time.perf_counter()
    launches = serving_launches(config, device, impls=impls, layers=layers, kv_caches=kv_caches,
                                draft_layers=draft_layers)
    for held in launches:
        held.run()
    if launches and device.type == "cuda":
        torch.cuda.synchronize(device)
    done = WarmUp([held.variant for held in launches], time.perf_counter() - t0)
    if launches:
        logger.info("spec_tree_kernels: warmed %d Triton variants on %s in %.1f s %s", len(done.variants), device,
                    done.seconds, done.counts())
    return done
