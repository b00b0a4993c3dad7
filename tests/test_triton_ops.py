"""Triton kernels equal the torch reference bit for bit.

Without a GPU they run under TRITON_INTERPRET=1 (tests/conftest.py), which is
exact but slow, so each example is a large batch of random trees.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spec_tree_kernels as K
from kernel_device import DEVICE
from pools import FLAVORS, random_batch
from spec_tree_kernels import TreeMaskMode as M
from test_tree_ops import one_storage_listed_twice, paged_caches, random_tokens_with_real_acceptance, slot_rows
from test_tree_sampling import degenerate_sampling_batch, random_sampling_batch, rejected_everywhere_batch
from triton_aot import run_compile_script

IMPLS = ["triton"] + (["cuda"] if DEVICE == "cuda" and K.api.cuda_usable(torch.device("cuda")) else [])


@st.composite
def batch_configs(draw, max_nodes=48):
    topk = draw(st.integers(1, 5))
    num_steps = draw(st.integers(1, 7))
    nodes = draw(st.integers(1, min(K.pool_size(topk, num_steps) + 1, max_nodes)))
    batch = draw(st.integers(1, 24))
    return topk, num_steps, nodes, batch, draw(st.sampled_from(FLAVORS)), draw(st.integers(0, 2**31))


def case(topk, num_steps, nodes, batch, flavor, seed):
    rng = random.Random(seed)
    scores, parent_list = random_batch(rng, batch, topk, num_steps, flavor)
    seq_lens = torch.tensor([rng.randint(0, 50) for _ in range(batch)], dtype=torch.int64)
    return rng, scores.to(DEVICE), parent_list.to(DEVICE), seq_lens.to(DEVICE)


def assert_same(a: torch.Tensor, b: torch.Tensor):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.view(torch.uint8) if a.dtype != torch.bool else a, b.view(torch.uint8) if b.dtype != torch.bool else b)


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=40, deadline=None)
@given(config=batch_configs())
def test_select_equals_reference(impl, config):
    topk, num_steps, nodes, *_ = config
    _, scores, parent_list, _ = case(*config)
    expected = K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes, impl="torch")
    got = K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes, impl=impl)
    assert_same(got, expected)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", list(M))
@settings(max_examples=12, deadline=None)
@given(config=batch_configs(), fill=st.booleans())
def test_build_equals_reference(impl, mode, config, fill):
    topk, num_steps, nodes, *_ = config
    if mode == M.QLEN_ONLY_BITPACKING:
        nodes = min(nodes, 32)
    _, scores, parent_list, seq_lens = case(*config)
    selected = K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes)
    kwargs = dict(seq_lens_sum=int(seq_lens.sum()), fill_prefix_mask=fill)
    expected = K.build_tree(selected, parent_list, seq_lens, topk, num_steps, mode, impl="torch", **kwargs)
    got = K.build_tree(selected, parent_list, seq_lens, topk, num_steps, mode, impl=impl, **kwargs)
    if mode == M.FULL_MASK and not fill:
        # prefix columns are left as they were: start both from the same random bytes
        start = torch.rand(expected.tree_mask.shape, device=DEVICE) < 0.5
        ref_buf, buf = start.clone(), start.clone()
        K.build_tree(selected, parent_list, seq_lens, topk, num_steps, mode, impl="torch", tree_mask_buf=ref_buf, **kwargs)
        K.build_tree(selected, parent_list, seq_lens, topk, num_steps, mode, impl=impl, tree_mask_buf=buf, **kwargs)
        assert_same(buf, ref_buf)
    else:
        assert_same(got.tree_mask, expected.tree_mask)
    for name in ("positions", "retrieve_index", "retrieve_next_token", "retrieve_next_sibling"):
        assert_same(getattr(got, name), getattr(expected, name))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("mode", [M.ANCESTOR_BITMASK, M.PARENT_POINTER, M.QLEN_ONLY])
def test_build_equals_reference_at_128_nodes(impl, mode):
    _, scores, parent_list, seq_lens = case(6, 8, 128, 3, "mixed", 7)
    selected = K.select_tree_nodes(scores, parent_list, 6, 8, 128, impl=impl)
    expected = K.build_tree(selected, parent_list, seq_lens, 6, 8, mode, impl="torch")
    got = K.build_tree(selected, parent_list, seq_lens, 6, 8, mode, impl=impl)
    for a, b in zip(got, expected):
        assert_same(a, b)


@pytest.mark.parametrize("impl", IMPLS)
def test_build_flags_an_open_tree(impl):
    with pytest.raises(ValueError, match="not a closed tree"):
        K.build_tree(
            torch.tensor([[0, 2, 4]], device=DEVICE), torch.tensor([[-1, 0, 1]], device=DEVICE),
            torch.tensor([10], device=DEVICE), 2, 2, impl=impl,
        )


@pytest.mark.parametrize("impl", IMPLS)
@settings(max_examples=25, deadline=None)
@given(config=batch_configs())
def test_verify_equals_reference(impl, config):
    topk, num_steps, nodes, *_ = config
    rng, scores, parent_list, seq_lens = case(*config)
    selected = K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes)
    tree = K.build_tree(selected, parent_list, seq_lens, topk, num_steps)
    candidates, target = (t.to(DEVICE) for t in random_tokens_with_real_acceptance(rng, selected.cpu(), parent_list.cpu(), topk))
    args = (candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target, num_steps)
    expected = K.verify_tree_greedy(*args, impl="torch")
    got = K.verify_tree_greedy(*args, impl=impl)
    for a, b in zip(got, expected):
        assert_same(a, b)


def sampled(impl, args, block_v=None):
    if impl == "triton" and block_v:  # a vocabulary block smaller than the default
        from spec_tree_kernels import triton_ops

        return triton_ops.verify_tree_sampling(*args, block_v=block_v)
    return K.verify_tree_sampling(*args, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "vocab, nodes, block_v",
    [(5, 9, None), (6, 1, None), (37, 16, 16), (300, 12, 64), (1100, 5, None)],  # V never a multiple of the block
)
def test_verify_sampling_equals_reference(impl, dtype, vocab, nodes, block_v):
    accepted = 0
    for seed in range(2):
        args = random_sampling_batch(seed * 100 + vocab + nodes, 6, nodes, vocab, dtype, DEVICE)
        expected = K.verify_tree_sampling(*args, impl="torch")
        got = sampled(impl, args, block_v)
        for a, b in zip(got, expected):
            assert_same(a, b)
        accepted += int(expected.accept_length.sum())
    assert nodes == 1 or accepted > 0  # the walks go somewhere


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_verify_sampling_equals_reference_on_degenerate_input(impl, dtype):
    """Out-of-vocabulary candidates, zero exponentials (inf and NaN in the
    race), empty residuals, exact ties: the reference's definitions hold."""
    args = degenerate_sampling_batch(3, dtype, DEVICE)
    expected = K.verify_tree_sampling(*args, impl="torch")
    got = sampled(impl, args, block_v=4)
    for a, b in zip(got, expected):
        assert_same(a, b)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("block_v", [4, None])
def test_verify_sampling_zeroes_rejected_tokens_at_block_edges(impl, block_v):
    args = rejected_everywhere_batch(13, torch.float32, DEVICE)
    expected = K.verify_tree_sampling(*args, impl="torch")
    drawn = expected.accept_tokens[:, 0].cpu()
    assert bool((drawn != torch.arange(13)).all() and (drawn != (torch.arange(13) + 5) % 13).all())
    got = sampled(impl, args, block_v)
    for a, b in zip(got, expected):
        assert_same(a, b)


SAMPLING_AOT = """
import json, re, sys
import torch
from triton.backends.compiler import GPUTarget
from triton_aot import compile_launch, resource_usage
from spec_tree_kernels import triton_ops
for dtype in (torch.float32, torch.float64):
    B, T, V, W = 4, 16, 1000, 5
    z = lambda *shape, dt=torch.int64: torch.zeros(*shape, dtype=dt)
    args = (z(B, T), z(B, T), z(B, T), z(B, T, V, dt=dtype), z(B, T, dt=dtype), z(B, V, dt=dtype),
            z(B, W, dt=torch.int32), z(B, dt=torch.int32), z(B, W), V)
    kw = dict(T=T, W=W, BLOCK_T=16, BLOCK_W=8, BLOCK_V=1024, IS_F64=dtype == torch.float64)
    c = compile_launch(triton_ops._verify_sampling_kernel, (B,), args, kw, GPUTarget("cuda", 90, 32))
    ops = sorted(set(re.findall(r"\\b(?:div|mul|sub|add|fma)\\.[a-z0-9.]*f(?:32|64)\\b", c.asm["ptx"])))
    print(json.dumps(dict(dtype=str(dtype), ops=ops, **resource_usage(c.asm["cubin"]))))
"""


def test_verify_sampling_compiles_with_ieee_float_ops():
    """The sampled verify kernel compiles for sm_90 (Triton's bundled ptxas)
    with round-to-nearest division (Triton's fp32 ``/`` is the approximate
    div.full.f32), no flush-to-zero and no fused multiply-add: the float ops
    the reference does, so the GPU equals it bit for bit."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton has no NVIDIA backend (sm_90 compiler)")
    rows = run_compile_script(SAMPLING_AOT, 2)
    for row in rows:
        bits = "64" if "float64" in row["dtype"] else "32"
        assert f"div.rn.f{bits}" in row["ops"], row
        assert not any(".ftz" in op or ".full" in op or ".approx" in op or op.startswith("fma") for op in row["ops"]), row
        assert row.get("local", 0) == 0, row


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout, dtype", [("flash", torch.float32), ("cpu", torch.float16), ("flash", torch.bfloat16)])
@settings(max_examples=8, deadline=None)
@given(config=batch_configs(max_nodes=24), block_size=st.sampled_from([1, 16]))
def test_move_kv_equals_reference(impl, layout, dtype, config, block_size):
    topk, num_steps, nodes, batch, *_ = config
    rng, scores, parent_list, seq_lens = case(*config)
    selected = K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes)
    tree = K.build_tree(selected, parent_list, seq_lens, topk, num_steps)
    candidates, target = (t.to(DEVICE) for t in random_tokens_with_real_acceptance(rng, selected.cpu(), parent_list.cpu(), topk))
    result = K.verify_tree_greedy(candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target, num_steps)
    caches, slots = paged_caches(rng, batch, nodes, block_size, layers=2, layout=layout, dtype=dtype)
    caches = [c.to(DEVICE) for c in caches]
    expected = [c.clone() for c in caches]
    K.move_accepted_kv(expected, slots.to(DEVICE), result.accept_index, result.accept_length, impl="torch")
    K.move_accepted_kv(caches, slots.to(DEVICE), result.accept_index, result.accept_length, impl=impl)
    for a, b in zip(caches, expected):
        assert torch.equal(a, b)


@pytest.mark.parametrize("impl", IMPLS)
def test_move_kv_moves_a_repeated_view_once(impl):
    """One launch over a view listed twice would race (and a second pass is wrong)."""
    kv, caches, slots, index, length, expected = one_storage_listed_twice(device=DEVICE)
    K.move_accepted_kv(caches, slots, index, length, impl=impl)
    assert slot_rows(kv) == expected
