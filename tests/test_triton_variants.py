"""Issue #36 (3): every Triton variant a serving configuration can launch is
warmed at startup (``spec_tree_kernels.startup.warm_up``; variant keys:
``spec_tree_kernels.triton_launch``).

A variant is Triton's cache key of a launch (constexprs, argument dtypes,
integers equal to 1 / divisible by 16, pointers aligned to 16 bytes). Here:
the key follows Triton's specialization; the enumeration covers every tree
size a trimmed draft can have and every menu shape; and launches made the
way an engine serves (random batches, trimmed trees, growing contexts, query
rows that are views into the engine's query tensor at any row) only ever hit
variants ``warm_up`` launched. The vLLM engine version of the last check is
tests/model/test_vllm_tree_warmup.py.
"""

from __future__ import annotations

import random

import pytest
import torch

import spec_tree_kernels as K
from kernel_device import DEVICE
from spec_tree_kernels import TreeShape
from spec_tree_kernels import attention_triton as at
from spec_tree_kernels.api import IMPL_ENV, tree_from_parents
from spec_tree_kernels.attention_plan import TreeAttentionPlan
from spec_tree_kernels.startup import TRITON_OPS, AttentionLayer, ServingConfig, serving_launches, warm_up
from spec_tree_kernels.triton_launch import capturing, recording

pytestmark = pytest.mark.skipif(not K.api.triton_usable(torch.device(DEVICE)),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1 (set before import)")

ALL_TRITON = dict.fromkeys(TRITON_OPS, "triton")
MENU = (TreeShape(3, 1, 4), TreeShape(5, 1, 6), TreeShape(5, 4, 8))  # the budget's default menu


def tiny_config(**overrides) -> ServingConfig:
    values = dict(shapes=(TreeShape(5, 4, 8),), mode="ANCESTOR_BITMASK", prefix_trim=True, verify_depth=7,
                  max_batch=6, max_context_len=600, vocab_size=50)
    return ServingConfig(**{**values, **overrides})


def tiny_layer(num_blocks=48, block_size=16, hkv=2, dim=32, dtype=torch.float32) -> AttentionLayer:
    kv = torch.randn(num_blocks, block_size, 2 * hkv, dim, dtype=dtype, device=DEVICE)  # one layer's K | V heads
    table = torch.zeros(4, 40, dtype=torch.int32, device=DEVICE)
    return AttentionLayer(2 * hkv, kv[:, :, :hkv], kv[:, :, hkv:], table, impl="triton")


# ------------------------------------------------------------ variant keys


def move_variant(cache: torch.Tensor) -> set:
    with capturing() as launches:
        K.move_accepted_kv([cache], torch.zeros(1, 4, dtype=torch.int64, device=DEVICE),
                           torch.full((1, 3), -1, dtype=torch.int64, device=DEVICE),
                           torch.zeros(1, dtype=torch.int64, device=DEVICE), impl="triton")
    return {launch.variant for launch in launches}


def test_variant_key_is_tritons_specialization():
    """Integers divisible by 16 or equal to 1, pointers off 16-byte alignment
    and dtypes make new variants; other values of an integer do not."""
    base = torch.zeros(8, 16, 4, 64, device=DEVICE)
    assert move_variant(base) == move_variant(torch.zeros(8, 16, 4, 64, device=DEVICE))
    assert move_variant(torch.zeros(8, 16, 2, 128, device=DEVICE)) == move_variant(base)  # other strides, all by 16

    def padded(width):  # [8, 16, 4, 64] rows of ``width`` elements
        return torch.zeros(8, 16, 4, width, device=DEVICE)[..., :64]

    assert move_variant(padded(65)) != move_variant(base)  # strides 260, 65 not divisible by 16
    assert move_variant(padded(67)) == move_variant(padded(69))
    assert move_variant(torch.zeros(8, 1, 4, 64, device=DEVICE)) != move_variant(base)  # block size 1: a constant
    assert move_variant(torch.zeros(8 * 16 * 4 * 64 + 1, device=DEVICE)[1:].view(8, 16, 4, 64)) != move_variant(base)
    assert move_variant(base.half()) != move_variant(base)
    (variant,) = move_variant(base)
    assert variant.kernel == "_move_kv_kernel" and dict(variant.constexprs) == {"T": 4, "W": 3, "BLOCK": 256}


def test_recording_sees_each_launch_and_the_grid_is_no_variant():
    caches = [torch.zeros(8, 16, 4, 64, device=DEVICE)]
    with recording() as seen:
        for batch in (1, 3):
            K.move_accepted_kv(caches, torch.zeros(batch, 4, dtype=torch.int64, device=DEVICE),
                               torch.full((batch, 3), -1, dtype=torch.int64, device=DEVICE),
                               torch.zeros(batch, dtype=torch.int64, device=DEVICE), impl="triton")
    assert len(seen) == 2 and seen[0] == seen[1]


def test_query_rows_at_any_offset_and_stride_are_one_variant():
    """vLLM's tree rows are views into its query tensor (first row and row
    stride vary per step and per engine): one variant for all of them."""
    layer = tiny_layer()
    nodes, hq, dim = 5, layer.num_q_heads, layer.k_cache.shape[3]
    mask = tree_from_parents(torch.tensor([[-1, 0, 0, 1, 1]], device=DEVICE),
                             torch.zeros(1, dtype=torch.int64, device=DEVICE), "ANCESTOR_BITMASK").tree_mask
    plan = TreeAttentionPlan.create(layer.block_table[:1], torch.zeros(1, dtype=torch.int64, device=DEVICE), mask,
                                    "ANCESTOR_BITMASK", nodes, layer.k_cache.shape[1], 0, impl="triton")
    variants = set()
    for first, row_stride in ((0, hq * dim), (1, hq * dim), (3, hq * dim + 5), (0, 3 * hq * dim)):
        rows = torch.zeros(first + nodes + 2, row_stride, device=DEVICE)
        q = rows[first: first + nodes, : hq * dim].view(1, nodes, hq, dim)
        with capturing() as launches:
            plan.run(q, layer.k_cache, layer.v_cache)
        variants |= {launch.variant for launch in launches}
    assert len(variants) == 1


# ------------------------------------------------------------- enumeration


def test_tree_sizes_cover_every_trimmed_tree_and_menu_shape():
    assert tiny_config().tree_sizes == tuple(range(2, 9))
    assert tiny_config(prefix_trim=False).tree_sizes == (8,)
    assert tiny_config(shapes=MENU, prefix_trim=False).tree_sizes == (4, 6, 8)
    assert tiny_config(shapes=MENU + (TreeShape(4, 3, 12),), verify_depth=11).tree_sizes == tuple(range(2, 13))
    with pytest.raises(ValueError, match="verify_depth"):
        tiny_config(verify_depth=4)


def test_enumeration_has_every_tree_size_and_menu_shape():
    config = tiny_config(shapes=MENU + (TreeShape(3, 2, 7),))
    variants = [launch.variant for launch in serving_launches(config, DEVICE, impls=ALL_TRITON, layers=[tiny_layer()])]
    by_kernel: dict[str, list[dict]] = {}
    for v in variants:
        by_kernel.setdefault(v.kernel, []).append(dict(v.constexprs))
    every_size = set(config.tree_sizes)
    for kernel in ("_verify_kernel", "_verify_sampling_kernel", "_tree_attention_kernel"):
        assert {c["T"] for c in by_kernel[kernel]} == every_size, kernel
    assert {c["W"] for c in by_kernel["_verify_kernel"]} == {config.verify_depth + 1}
    # selection: every branching menu shape at its own size (chains are never ranked)
    assert sorted((c["TOPK"], c["NUM_STEPS"], c["NUM_SEL"] + 1) for c in by_kernel["_select_kernel"]) == [
        (2, 3, 7), (4, 5, 8)]
    assert "_move_kv_kernel" not in by_kernel  # no caches given: nothing to move
    # the tree build does not specialize on T or the depth: one variant per block of nodes (16 covers 2..16)
    assert by_kernel["_tree_from_parents_kernel"] == [dict(MODE=3, WORDS=1, BLOCK_T=16, ROWS=16)]


def test_nothing_is_warmed_where_nothing_runs_triton(monkeypatch):
    """The host CPU serves the reference / host kernel unless the impl is
    forced: the warm-up launches nothing there."""
    monkeypatch.delenv(IMPL_ENV, raising=False)
    layer = tiny_layer()
    cpu_layer = AttentionLayer(layer.num_q_heads, layer.k_cache.cpu(), layer.v_cache.cpu(), layer.block_table.cpu())
    assert serving_launches(tiny_config(), "cpu", layers=[cpu_layer], kv_caches=[cpu_layer.k_cache],
                            draft_layers=[cpu_layer]) == []


def test_smollm2_on_an_h200_split_plans(monkeypatch):
    """SmolLM2-135M (Hq 9, Hkv 3, D 64, bf16, block 16) on 132 SMs, context
    up to 8192: at batch 1 every split count 2..64 occurs, so for each tree
    size the merge kernel has one variant per power-of-2 bound of the split
    count (6), beside the split and single-pass kernels (captured, not run).
    The split count itself is not specialized: 16 and 32 make no variant."""
    monkeypatch.setattr(at, "_num_sms", lambda *_: 132)
    kv = torch.zeros(64, 16, 6, 64, dtype=torch.bfloat16, device=DEVICE)
    table = torch.zeros(1, 512, dtype=torch.int32, device=DEVICE)
    layer = AttentionLayer(9, kv[:, :, :3], kv[:, :, 3:], table, "triton")
    config = tiny_config(max_batch=256, max_context_len=8192, vocab_size=49152)
    no_ops = dict.fromkeys(ALL_TRITON, "torch")
    attention = [launch.variant for launch in serving_launches(config, DEVICE, impls=no_ops, layers=[layer, layer])]
    for nodes in config.tree_sizes:
        of_size = [v for v in attention if dict(v.constexprs)["T"] == nodes]
        kinds = sorted(v.kernel for v in of_size)
        assert kinds.count("_tree_attention_kernel") == 1
        assert kinds.count("_tree_attention_split_kernel") == 1
        merges = [dict(v.constexprs)["SPLITS_P2"] for v in of_size if v.kernel == "_tree_attention_merge_kernel"]
        assert sorted(merges) == [2, 4, 8, 16, 32, 64], nodes
    assert len(attention) == 8 * len(config.tree_sizes)  # one layer signature: the second layer adds none


# ------------------------------------------ serving only hits warmed variants


def serve_like_an_engine(config: ServingConfig, layer: AttentionLayer, caches, steps: int, seed: int = 0) -> None:
    """Launches as an engine makes them: per step a random batch of trimmed
    trees of one size (random shapes), contexts up to the limit, the query
    rows a view into a larger query tensor (odd row stride, any first row)."""
    rng = random.Random(seed)
    hq, dim = layer.num_q_heads, layer.k_cache.shape[3]
    num_blocks, block_size = layer.k_cache.shape[:2]
    forced = [(1, config.max_context_len - 8), (1, 150), (config.max_batch, 40)]  # interpreter: split, split, single
    for step in range(steps):
        batch, longest = forced[step] if step < len(forced) else (rng.randint(1, config.max_batch),
                                                                  rng.randint(0, config.max_context_len - 8))
        nodes = rng.choice(config.tree_sizes)
        ctx = torch.tensor([rng.randint(0, longest) for _ in range(batch - 1)] + [longest], device=DEVICE)
        parents = torch.tensor([[-1] + [rng.randrange(i) for i in range(1, nodes)] for _ in range(batch)],
                               device=DEVICE)
        mask = tree_from_parents(parents, ctx, config.mode).tree_mask
        table = torch.randint(0, num_blocks, (batch, layer.block_table.shape[1]), dtype=layer.block_table.dtype,
                              device=DEVICE)
        first = rng.randint(0, 3)
        rows = torch.randn(first + batch * nodes + 1, hq * dim + 7, device=DEVICE)
        q = rows[first: first + batch * nodes, : hq * dim].view(batch, nodes, hq, dim)
        plan = TreeAttentionPlan.create(table, ctx, mask, config.mode, nodes, block_size, int(ctx.max()),
                                        impl="triton")
        plan.run(q, layer.k_cache, layer.v_cache)
        links = K.tree_from_parents(parents, ctx, config.mode, max_depth=nodes - 1, validate=False,
                                    impl="triton")  # as vLLM's V2 runner
        cands = torch.randint(0, config.vocab_size, (batch, nodes), device=DEVICE)
        greedy = K.verify_tree_greedy(cands, links.retrieve_next_token, links.retrieve_next_sibling, cands,
                                      config.verify_depth, impl="triton")
        probs = torch.rand(batch, nodes, config.vocab_size, device=DEVICE).softmax(-1)
        K.verify_tree_sampling(cands, links.retrieve_next_token, links.retrieve_next_sibling, probs,
                               torch.rand(batch, nodes, device=DEVICE),
                               torch.empty(batch, config.vocab_size, device=DEVICE).exponential_(),
                               config.verify_depth, impl="triton")
        slots = torch.randperm(num_blocks * block_size, device=DEVICE)[: batch * nodes].view(batch, nodes)
        K.move_accepted_kv(caches, slots, greedy.accept_index.long(), greedy.accept_length.long(), impl="triton")
    for shape in config.shapes:
        if shape.topk > 1:
            scores = torch.rand(3, K.pool_size(shape.topk, shape.num_steps), device=DEVICE)
            parent_list = torch.zeros(3, K.parent_list_width(shape.topk, shape.num_steps), dtype=torch.int64,
                                      device=DEVICE)
            K.select_tree_nodes(scores, parent_list, shape.topk, shape.num_steps, shape.num_draft_tokens,
                                validate=False, impl="triton")


def test_serving_launches_only_warmed_variants():
    config = tiny_config(shapes=MENU)
    layer = tiny_layer()
    caches = [layer.k_cache, layer.v_cache]
    with recording() as warmed:
        done = warm_up(config, DEVICE, impls=ALL_TRITON, layers=[layer], kv_caches=caches)
    assert done.variants == warmed and len(set(warmed)) == len(warmed)
    with recording() as served:
        serve_like_an_engine(config, layer, caches, steps=8)
    missing = set(served) - set(warmed)
    assert not missing, "served but not warmed: " + ", ".join(sorted(map(str, missing)))
    kernels = {v.kernel for v in served}
    assert {"_tree_attention_kernel", "_tree_attention_split_kernel", "_tree_attention_merge_kernel",
            "_verify_kernel", "_verify_sampling_kernel", "_move_kv_kernel", "_select_kernel",
            "_tree_from_parents_kernel"} <= kernels


def serve_draft_steps_like_the_drafter(config: ServingConfig, layer: AttentionLayer, steps: int, seed: int = 0):
    """Draft-step launches as vLLM's tree drafter makes them
    (``BranchAttention``): per drafting step a random batch, shape and
    contexts (the step's longest as the host bound), the engine's int32 block
    rows, the scratch of the shape's E; per level the queries a view of the
    head's qkv rows and the output a view of its output buffer (any first
    row), the ancestors as ``expand_pool`` / ``expand_chain`` hand them
    (gathered rows, or a slice of a chain's all-ones tensor)."""
    from spec_tree_kernels.branch_attention import BranchAttentionPlan
    from spec_tree_kernels.startup import draft_levels

    rng = random.Random(seed)
    hq, dim = layer.num_q_heads, layer.k_cache.shape[3]
    num_blocks, block_size, hkv, _ = layer.k_cache.shape
    forced = [(1, config.max_context_len - 8), (config.max_batch, 40)]  # interpreter: split, single pass
    for step in range(steps):
        batch, longest = forced[step] if step < len(forced) else (rng.randint(1, config.max_batch),
                                                                  rng.randint(0, config.max_context_len - 8))
        shape = config.shapes[step % len(config.shapes)]
        K, levels = draft_levels(shape)
        ctx = torch.tensor([rng.randint(0, longest) for _ in range(batch - 1)] + [longest], device=DEVICE)
        table = torch.randint(0, num_blocks, (batch, layer.block_table.shape[1]), dtype=torch.int32, device=DEVICE)
        plan = BranchAttentionPlan.create(table, ctx, longest, block_size, impl="triton")
        scratch = layer.k_cache.new_zeros(2, batch, (levels - 1) * K, hkv, dim)
        chain_anc = torch.ones(batch, 1, max(levels - 1, 0), dtype=torch.bool, device=DEVICE)
        for level in range(1, levels):
            first = rng.randint(0, 3)
            qkv = torch.randn(first + batch * K, (hq + 2 * hkv) * dim, device=DEVICE)
            q = qkv[first:, : hq * dim].view(batch, K, hq, dim)
            out = torch.empty(first + batch * K + 1, hq * dim, device=DEVICE)[first: first + batch * K].view(
                batch, K, hq, dim)
            if K == 1:
                ancestors = chain_anc[..., : level - 1]
            else:
                rows = torch.randint(0, K, (batch, K, 1), device=DEVICE).expand(batch, K, (level - 1) * K)
                ancestors = (torch.rand(batch, K, (level - 1) * K, device=DEVICE) < 0.5).gather(1, rows)
            plan.run(q, layer.k_cache, layer.v_cache, scratch[0], scratch[1], level * K, ancestors, None, out)


def test_draft_steps_launch_only_warmed_variants():
    """Issue #37 (5): the draft-step kernel's variants (every menu shape's K,
    a chain's, single pass and split + merge) are warmed with the head's
    layer among ``draft_layers``; without it they would not be."""
    config = tiny_config(shapes=MENU, max_batch=4)
    layer = tiny_layer()
    with recording() as warmed:
        warm_up(config, DEVICE, impls=dict.fromkeys(TRITON_OPS, "torch"), draft_layers=[layer])
    with recording() as served:
        serve_draft_steps_like_the_drafter(config, layer, steps=4)
    missing = set(served) - set(warmed)
    assert not missing, "served but not warmed: " + ", ".join(sorted(map(str, missing)))
    assert {v.kernel for v in served} == {"_branch_attention_kernel", "_tree_attention_merge_kernel"}
    assert {dict(v.constexprs)["SPLIT"] for v in served if v.kernel == "_branch_attention_kernel"} == {True, False}
    assert {dict(v.constexprs)["K"] for v in warmed if v.kernel == "_branch_attention_kernel"} == {1, 4}
    without = serving_launches(config, DEVICE, impls=dict.fromkeys(TRITON_OPS, "torch"), layers=[layer])
    assert not {launch.variant for launch in without} & {v for v in served if v.kernel == "_branch_attention_kernel"}


# ------------------------------------------- a block drafter's trees (DDTree)

BLOCK_SHAPE = TreeShape(7, 4, 16)  # L = a DFlash drafter's 7 mask rows, top-4 per row, 15 drafts


def test_a_block_drafters_tree_build_is_warmed():
    """Issue #52: DDTree's tree build (``build_block_tree``, through
    ``tree_drafting.block_topk`` / ``block_trees`` as the DFlash adapters
    call it) launches, whatever the batch, only the variant a block-drafter
    configuration warms; an EAGLE configuration of the same shape warms no
    tree build, and a block drafter no selection (it ranks no pool)."""
    from spec_plugins.tree_drafting import block_topk, block_trees

    block = tiny_config(shapes=(BLOCK_SHAPE,), verify_depth=15, block_drafter=True)
    with recording() as warmed:
        warm_up(block, DEVICE, impls={**dict.fromkeys(TRITON_OPS, "torch"), "block_tree": "triton"})
    with recording() as served:
        for batch in (1, 3, 8):
            logits = torch.randn(batch, BLOCK_SHAPE.num_steps, 50, device=DEVICE).bfloat16()
            block_trees(*block_topk(logits, BLOCK_SHAPE.topk), BLOCK_SHAPE.num_draft_tokens - 1, impl="triton")
    assert {v.kernel for v in served} == {"_block_tree_kernel"}
    missing = set(served) - set(warmed)
    assert not missing, "served but not warmed: " + ", ".join(sorted(map(str, missing)))
    block_kernels = {launch.variant.kernel for launch in serving_launches(block, DEVICE, impls=ALL_TRITON)}
    assert "_block_tree_kernel" in block_kernels and "_select_kernel" not in block_kernels
    eagle = serving_launches(tiny_config(shapes=(BLOCK_SHAPE,), verify_depth=15), DEVICE, impls=ALL_TRITON)
    assert "_select_kernel" in {launch.variant.kernel for launch in eagle}
    assert not {launch.variant for launch in eagle} & set(served)


def test_the_vllm_runner_tells_the_warm_up_its_trees_come_from_a_block_drafter(monkeypatch):
    """``startup_checks.warm_tree_kernels`` (both vLLM runners) passes the
    runner's block_drafter on: without it a DFlash engine would warm EAGLE's
    selection and compile DDTree's tree build in its first step."""
    from types import SimpleNamespace

    import spec_tree_kernels.startup as startup
    from spec_plugins.vllm_ext.config import TreeSettings
    from spec_plugins.vllm_ext.startup_checks import warm_tree_kernels

    configs = []
    monkeypatch.setattr(startup, "warm_up", lambda config, device, **kwargs: configs.append(config))
    for block_drafter in (True, False):
        runner = SimpleNamespace(
            tree_settings=TreeSettings(BLOCK_SHAPE), block_drafter=block_drafter, verify_depth=15,
            scheduler_config=SimpleNamespace(max_num_seqs=4), max_model_len=256, device=torch.device(DEVICE),
            model_config=SimpleNamespace(get_vocab_size=lambda: 50), tree_impl="auto",
            compilation_config=SimpleNamespace(static_forward_context={}),
            kv_cache_config=SimpleNamespace(kv_cache_groups=[]))
        warm_tree_kernels(runner, [], [])
    assert [c.block_drafter for c in configs] == [True, False] and configs[0].shapes == (BLOCK_SHAPE,)


def test_without_tritons_binder_the_key_is_finer_never_coarser(monkeypatch):
    """Another Triton release whose binder cannot be called: launches are told
    apart by a finer key, so the warm-up runs more of them and misses none."""
    import triton
    import triton.language as tl

    from spec_tree_kernels import triton_launch

    @triton.jit
    def tiny_kernel(x_ptr, n, BLOCK: tl.constexpr):
        pass

    def no_binder(kernel, device_type):
        raise AttributeError("create_function_from_signature")

    x = torch.zeros(32, dtype=torch.float32)
    launches = ((x, 3), (x, 5), (x[1:], 3))  # n=3 and n=5 specialize alike; x[1:] is not 16-byte aligned
    tritons = {triton_launch.variant_key(tiny_kernel, args, {"BLOCK": 16}) for args in launches}
    monkeypatch.setattr(triton_launch, "_binder", no_binder)
    finer = {triton_launch.variant_key(tiny_kernel, args, {"BLOCK": 16}) for args in launches}
    assert len(tritons) == 2 and len(finer) == 3
    assert triton_launch.variant_key(tiny_kernel, (x, 3), {"BLOCK": 16}) in finer  # the same launch, the same key
