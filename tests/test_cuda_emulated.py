"""The CUDA kernels (kernels/csrc/tree_ops.cu) equal the torch reference bit
for bit, run on the CPU through their host emulation (csrc/cuda_emulation.h:
the same source compiled by the host C++ compiler, one std::thread per CUDA
thread, called through the same ctypes layer as a GPU build).

This checks the kernels' indexing and semantics without a GPU; the GPU itself
is covered by test_triton_ops.py (impl="cuda" where a GPU is present) and
ci/device_check.py.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spec_tree_kernels as K
from pools import FLAVORS, random_batch
from spec_tree_kernels import TreeMaskMode as M
from spec_tree_kernels import cuda_build, cuda_ops, reference
from test_tree_ops import paged_caches, random_tokens_with_real_acceptance
from test_tree_sampling import degenerate_sampling_batch, random_sampling_batch, rejected_everywhere_batch

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="needs a host C++ compiler (c++) for the emulation")


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    return cuda_build.emulated_backend(tmp_path_factory.mktemp("cuda_emulated"))


def case(topk, num_steps, nodes, batch, flavor, seed):
    rng = random.Random(seed)
    scores, parent_list = random_batch(rng, batch, topk, num_steps, flavor)
    seq_lens = torch.tensor([rng.randint(0, 50) for _ in range(batch)], dtype=torch.int64)
    selected = K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes, impl="torch")
    return rng, selected, parent_list, seq_lens


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def assert_same(got: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    assert torch.equal(as_bytes(got), as_bytes(expected)), what


def check_build(emu, selected, parent_list, seq_lens, topk, num_steps, mode, fill=True, start=None):
    """Build with the emulated kernels and the reference; every output equal.
    ``start``: initial mask buffer for both (FULL_MASK without fill leaves the prefix as it was)."""
    args = (selected, parent_list, seq_lens, topk, num_steps, mode, int(seq_lens.sum()), fill)
    ref_buf = None if start is None else start.clone()
    got_buf = None if start is None else start.clone()
    expected, ok_expected = reference.build_tree(*args, ref_buf)
    got, ok = cuda_ops.build_tree(*args, got_buf, backend=emu)
    for name in expected._fields:
        assert_same(getattr(got, name), getattr(expected, name), f"{mode.name} {name}")
    assert_same(ok, ok_expected, "ok")
    return ok


@st.composite
def configs(draw, max_nodes=40):
    topk = draw(st.integers(1, 5))
    num_steps = draw(st.integers(1, 7))
    nodes = draw(st.integers(1, min(K.pool_size(topk, num_steps) + 1, max_nodes)))
    return topk, num_steps, nodes, draw(st.integers(1, 4)), draw(st.sampled_from(FLAVORS)), draw(st.integers(0, 2**31))


@pytest.mark.parametrize("mode", list(M))
@settings(max_examples=10, deadline=None)
@given(config=configs(), fill=st.booleans())
def test_build_equals_reference(emu, mode, config, fill):
    topk, num_steps, nodes, *_ = config
    if mode == M.QLEN_ONLY_BITPACKING:
        nodes = min(nodes, 32)
    _, selected, parent_list, seq_lens = case(topk, num_steps, nodes, *config[3:])
    start = None
    if mode == M.FULL_MASK and not fill:
        size = int(seq_lens.sum()) * nodes + nodes * nodes * len(seq_lens)
        start = torch.rand(size) < 0.5
    assert bool(check_build(emu, selected, parent_list, seq_lens, topk, num_steps, mode, fill, start).all())


@pytest.mark.parametrize("mode", [M.ANCESTOR_BITMASK, M.QLEN_ONLY, M.FULL_MASK, M.PARENT_POINTER])
@pytest.mark.parametrize("topk, num_steps, nodes, batch", [(8, 4, 128, 2), (10, 4, 300, 1)])
def test_build_large_trees(emu, mode, topk, num_steps, nodes, batch):
    """T = 300 spans two row tiles of the mask stage and five 64-bit words."""
    _, selected, parent_list, seq_lens = case(topk, num_steps, nodes, batch, "mixed", nodes)
    check_build(emu, selected, parent_list, seq_lens, topk, num_steps, mode)


@pytest.mark.parametrize("mode", list(M))
def test_build_open_and_too_deep_selections(emu, mode):
    """Not a closed tree (a parent missing) or deeper than num_steps: ok is
    False and every other output still equals the reference's."""
    gen = torch.Generator().manual_seed(3)
    topk, num_steps, nodes, batch = 3, 4, 12, 6
    pool = K.pool_size(topk, num_steps)
    selected = torch.stack([torch.randperm(pool, generator=gen)[: nodes - 1].sort().values for _ in range(batch)])
    _, parent_list = random_batch(random.Random(5), batch, topk, num_steps, "random")
    seq_lens = torch.randint(0, 30, (batch,), generator=gen)
    ok = check_build(emu, selected, parent_list, seq_lens, topk, num_steps, mode)
    assert not bool(ok.all())
    # a closed chain of depth 4 judged with num_steps=3: too deep
    _, chain, chain_parents, chain_lens = case(1, 4, 5, 2, "onehot", 1)
    ok = check_build(emu, chain, chain_parents, chain_lens, 1, 3, mode)
    assert not bool(ok.any())


def test_build_edge_shapes(emu):
    # a single node (no selection) and a single draft step (empty parent_list)
    _, selected, parent_list, seq_lens = case(3, 1, 1, 3, "random", 0)
    for mode in M:
        check_build(emu, selected, parent_list, seq_lens, 3, 1, mode)
    _, selected, parent_list, seq_lens = case(4, 1, 5, 2, "ties", 0)
    assert parent_list.shape == (2, 0)
    for mode in M:
        check_build(emu, selected, parent_list, seq_lens, 4, 1, mode)
    # no requests at all
    empty = torch.empty(0, 4, dtype=torch.int64)
    got, ok = cuda_ops.build_tree(empty, torch.empty(0, 5, dtype=torch.int64), torch.empty(0, dtype=torch.int64), 2, 3, M.QLEN_ONLY, 0, True, None, backend=emu)
    assert got.positions.shape == (0, 5) and ok.shape == (0,)


def test_build_into_a_larger_buffer(emu):
    _, selected, parent_list, seq_lens = case(4, 3, 9, 3, "ties", 11)
    size = int(seq_lens.sum()) * 9 + 81 * 3
    start = torch.zeros(size + 37, dtype=torch.bool)
    check_build(emu, selected, parent_list, seq_lens, 4, 3, M.FULL_MASK, True, start)


@settings(max_examples=30, deadline=None)
@given(config=configs(max_nodes=64))
def test_verify_equals_reference(emu, config):
    topk, num_steps, nodes, *_ = config
    rng, selected, parent_list, seq_lens = case(*config)
    tree, _ = reference.build_tree(selected, parent_list, seq_lens, topk, num_steps, M.QLEN_ONLY, 0)
    candidates, target = random_tokens_with_real_acceptance(rng, selected, parent_list, topk)
    args = (candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target, num_steps)
    expected = reference.verify_tree_greedy(*args)
    got = cuda_ops.verify_tree_greedy(*args, backend=emu)
    for name in expected._fields:
        assert_same(getattr(got, name), getattr(expected, name), name)


def test_verify_many_requests(emu):
    """Several warps per block (batch > 264)."""
    rng, selected, parent_list, seq_lens = case(2, 3, 7, 300, "ties", 4)
    tree, _ = reference.build_tree(selected, parent_list, seq_lens, 2, 3, M.QLEN_ONLY, 0)
    candidates, target = random_tokens_with_real_acceptance(rng, selected, parent_list, 2, vocab=2)
    args = (candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target, 3)
    expected = reference.verify_tree_greedy(*args)
    got = cuda_ops.verify_tree_greedy(*args, backend=emu)
    assert int(expected.accept_length.sum()) > 0
    for name in expected._fields:
        assert_same(getattr(got, name), getattr(expected, name), name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "vocab, nodes, batch",
    [(5, 9, 6), (6, 1, 3), (37, 16, 6), (300, 12, 4), (1100, 5, 3), (2, 40, 4)],  # 32..512 threads per block
)
def test_verify_sampling_equals_reference(emu, dtype, vocab, nodes, batch):
    accepted = 0
    for seed in range(2):
        args = random_sampling_batch(seed * 100 + vocab + nodes, batch, nodes, vocab, dtype)
        expected = reference.verify_tree_sampling(*args)
        got = cuda_ops.verify_tree_sampling(*args, backend=emu)
        for name in expected._fields:
            assert_same(getattr(got, name), getattr(expected, name), name)
        accepted += int(expected.accept_length.sum())
    assert nodes == 1 or accepted > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_verify_sampling_degenerate_input(emu, dtype):
    """Out-of-vocabulary candidates, zero exponentials (inf and NaN in the
    race), empty residuals, exact ties: as the reference defines them."""
    args = degenerate_sampling_batch(3, dtype)
    expected = reference.verify_tree_sampling(*args)
    got = cuda_ops.verify_tree_sampling(*args, backend=emu)
    for name in expected._fields:
        assert_same(getattr(got, name), getattr(expected, name), name)


@pytest.mark.parametrize("vocab", [13, 700])  # 32 and 128 threads: rejected tokens at every thread's positions
def test_verify_sampling_zeroes_rejected_tokens_everywhere(emu, vocab):
    args = rejected_everywhere_batch(vocab, torch.float64)
    expected = reference.verify_tree_sampling(*args)
    got = cuda_ops.verify_tree_sampling(*args, backend=emu)
    for name in expected._fields:
        assert_same(getattr(got, name), getattr(expected, name), name)


def test_verify_sampling_large_tree(emu):
    """T = 1024 (the node limit: the walk's arrays fill their share of shared memory)."""
    args = random_sampling_batch(5, 2, 1024, 50, torch.float64)
    expected = reference.verify_tree_sampling(*args)
    got = cuda_ops.verify_tree_sampling(*args, backend=emu)
    for name in expected._fields:
        assert_same(getattr(got, name), getattr(expected, name), name)


def extra_layout_caches(layout, num_blocks, block_size, heads, head_dim, dtype, layers=2):
    """Layouts beyond tests/test_tree_ops.paged_caches, each with distinct values."""
    caches = []
    for layer in range(layers):
        n = num_blocks * block_size * heads * head_dim
        values = (torch.arange(n, dtype=torch.float32) + 7_000 * layer).to(dtype)
        if layout == "sglang":  # token pool [slots, H, D] seen as blocks of one slot
            caches.append(values.view(num_blocks * block_size, heads, head_dim).unsqueeze(1))
        elif layout == "strided_dim":  # head dim not contiguous: element-wise copies
            caches.append(values.view(num_blocks, block_size, head_dim, heads).transpose(2, 3))
        elif layout == "kv_pair":  # vLLM flash [2, blocks, bs, H, D]: K and V halves
            kv = values.view(1, num_blocks, block_size, heads, head_dim).expand(2, -1, -1, -1, -1).clone()
            kv[1] += 1
            caches.extend([kv[0], kv[1]])
        else:
            raise ValueError(layout)
    return caches


def accepted(seed, topk=3, num_steps=4, nodes=10, batch=4):
    rng, selected, parent_list, seq_lens = case(topk, num_steps, nodes, batch, "mixed", seed)
    tree, _ = reference.build_tree(selected, parent_list, seq_lens, topk, num_steps, M.QLEN_ONLY, 0)
    candidates, target = random_tokens_with_real_acceptance(rng, selected, parent_list, topk, vocab=2)
    result = reference.verify_tree_greedy(candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target, num_steps)
    return rng, result


def check_move(emu, caches, slots, accept_index, accept_length):
    expected = [c.clone() for c in caches]
    reference.move_accepted_kv(expected, slots, accept_index, accept_length)
    cuda_ops.move_accepted_kv(caches, slots, accept_index, accept_length, backend=emu)
    for got, want in zip(caches, expected):
        assert torch.equal(as_bytes(got), as_bytes(want))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["flash", "cpu"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_move_kv_equals_reference(emu, dtype, layout, block_size, index_dtype):
    rng, result = accepted(block_size + len(layout))
    assert int(result.accept_length.sum()) > 0  # something moves
    caches, slots = paged_caches(rng, 4, 10, block_size, layers=3, heads=2, head_dim=8, layout=layout, dtype=dtype)
    check_move(emu, caches, slots, result.accept_index.to(index_dtype), result.accept_length.to(index_dtype))


@pytest.mark.parametrize("layout", ["sglang", "strided_dim", "kv_pair"])
@pytest.mark.parametrize("heads, head_dim, dtype", [(2, 8, torch.bfloat16), (3, 5, torch.float16), (1, 4, torch.float32)])
def test_move_kv_other_layouts(emu, layout, heads, head_dim, dtype):
    rng, result = accepted(heads * head_dim)
    block_size = 1 if layout == "sglang" else 4
    num_blocks = (4 * 10 * 2) // block_size + 2
    caches = extra_layout_caches(layout, num_blocks, block_size, heads, head_dim, dtype)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(rng.randint(0, 99)))[:40].view(4, 10)
    check_move(emu, caches, slots, result.accept_index, result.accept_length)


def test_move_kv_mixed_geometries_in_one_call(emu):
    """Caches of different dtypes and layouts in one list: one launch per geometry."""
    rng, result = accepted(9)
    flash, slots = paged_caches(rng, 4, 10, 4, layers=2, heads=2, head_dim=8, layout="flash", dtype=torch.bfloat16)
    cpu = [c.to(torch.float32) for c in flash]  # same slots, another dtype
    head0 = flash[0].clone()[:, :, :1]  # a third geometry: strided heads (a fresh tensor: no aliasing)
    check_move(emu, flash + cpu + [head0], slots, result.accept_index, result.accept_length)


def test_move_kv_wide_paths(emu):
    """W = 12 > 8: the kernel loads and stores depths in two groups, in depth
    order; on a path whose node indices grow with depth (every tree path in
    SGLang's node order) that equals the reference's all-reads-first order."""
    steps, nodes = 11, 23
    index = torch.tensor([[2 * d for d in range(steps + 1)]], dtype=torch.int32)  # node 2d at depth d
    length = torch.tensor([steps], dtype=torch.int32)
    caches, _ = paged_caches(random.Random(0), 1, nodes, 4, layers=2, heads=1, head_dim=4)
    total = caches[0].shape[0] * 4
    slots = torch.randperm(total, generator=torch.Generator().manual_seed(1))[:nodes][None]
    check_move(emu, caches, slots, index, length)
    # a path that reads a slot an earlier depth wrote breaks the in-order argument; not produced by build_tree
