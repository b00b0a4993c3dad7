"""The Triton ``tree_from_parents`` (one launch) equals the torch reference bit
for bit: every mask mode, batch and tree size, trees up to and past
``max_depth``. Under TRITON_INTERPRET=1 without a GPU (tests/conftest.py)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import spec_tree_kernels as K
from kernel_device import DEVICE
from spec_tree_kernels import TreeMaskMode as M
from spec_tree_kernels.api import IMPL_ENV
from spec_tree_kernels.modes import max_nodes
from spec_tree_kernels.triton_launch import recording
from test_triton_ops import assert_same
from triton_aot import run_compile_script

pytestmark = pytest.mark.skipif(not K.api.triton_usable(torch.device(DEVICE)),
                                reason="Triton needs CUDA or TRITON_INTERPRET=1 (set before import)")

MODES = [m for m in M if m != M.FULL_MASK]  # every mode tree_from_parents builds
SIZES = (1, 2, 9, 33, 64, 130)  # 130: three bitmask words, several row tiles
SHAPES = ("bfs", "any", "chain", "star", "deep")


def random_parents(rng: random.Random, nodes: int, shape: str) -> list[int]:
    """One tree of ``nodes`` nodes, node 0 the root (-1), each parent before its
    child. bfs: parents non-decreasing (a drafter's BFS order; any prefix is
    a tree); any: each parent anywhere before its child; chain: depth T - 1;
    star: depth 1; deep: mostly the previous node (long paths, some forks)."""
    parents = [-1]
    for i in range(1, nodes):
        if shape == "bfs":
            parents.append(rng.randint(max(parents[-1], 0), i - 1))
        elif shape == "any":
            parents.append(rng.randrange(i))
        elif shape == "chain":
            parents.append(i - 1)
        elif shape == "star":
            parents.append(0)
        else:
            parents.append(i - 1 if rng.random() < 0.8 else rng.randrange(i))
    return parents


def depth_of(parents: list[int]) -> int:
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    return max(depth)


def both(parent: torch.Tensor, seq_lens: torch.Tensor, mode, **kwargs):
    expected = K.tree_from_parents(parent, seq_lens, mode, impl="torch", **kwargs)
    got = K.tree_from_parents(parent, seq_lens, mode, impl="triton", **kwargs)
    return got, expected


def assert_builds_equal(got, expected):
    for name in K.TreeBuild._fields:
        assert_same(getattr(got, name), getattr(expected, name)), name


def batch_of(rng: random.Random, batch: int, nodes: int, shapes=SHAPES):
    trees = [random_parents(rng, nodes, rng.choice(shapes)) for _ in range(batch)]
    parent = torch.tensor(trees, dtype=torch.int64, device=DEVICE).view(batch, nodes)
    seq_lens = torch.tensor([rng.randint(0, 5000) for _ in range(batch)], dtype=torch.int64, device=DEVICE)
    return trees, parent, seq_lens


@pytest.mark.parametrize("mode,nodes", [(m, n) for m in MODES for n in SIZES if n <= max_nodes(m)])
def test_triton_equals_reference_for_every_mode_and_size(mode, nodes):
    """Every size each mode holds (QLEN_ONLY_BITPACKING: up to 32 nodes; no skips in CI)."""
    rng = random.Random(nodes * 10 + int(mode))
    for batch in (1, 3, 7) if nodes <= 64 else (2,):  # the interpreter climbs a 130-node chain slowly
        trees, parent, seq_lens = batch_of(rng, batch, nodes)
        deepest = max(depth_of(t) for t in trees)
        # the serving call (max_depth = T - 1), the exact depth, and a climb cut short
        for max_depth in sorted({nodes - 1, deepest, max(deepest - 2, 0)}):
            got, expected = both(parent, seq_lens, mode, max_depth=max_depth, validate=False)
            assert_builds_equal(got, expected)
    got, expected = both(parent[:1], seq_lens[:1], mode)  # validated, default depth
    assert_builds_equal(got, expected)


@pytest.mark.parametrize("mode", MODES)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), nodes=st.integers(1, 48), batch=st.integers(1, 12),
       cut=st.integers(0, 4))
def test_triton_equals_reference_on_random_trees(mode, seed, nodes, batch, cut):
    """Random trees of every shape, with max_depth from the deepest node's
    depth down to ``cut`` levels short of it (such nodes keep max_depth + 1
    and miss their upper ancestors, in both)."""
    nodes = min(nodes, max_nodes(mode))
    rng = random.Random(seed)
    trees, parent, seq_lens = batch_of(rng, batch, nodes)
    max_depth = max(max(depth_of(t) for t in trees) - cut, 0)
    got, expected = both(parent, seq_lens, mode, max_depth=max_depth, validate=False)
    assert_builds_equal(got, expected)


@pytest.mark.parametrize("mode", MODES)
def test_the_values_are_the_trees(mode):
    """Not two equal wrongs: a known tree's links, positions and mask."""
    parent = torch.tensor([[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, 3, 4, 5]], device=DEVICE)
    seq_lens = torch.tensor([10, 0], device=DEVICE)
    got = K.tree_from_parents(parent, seq_lens, mode, max_depth=6, validate=False, impl="triton")
    assert got.positions.tolist() == [[10, 11, 11, 12, 12, 12, 13], [0, 1, 2, 3, 4, 5, 6]]
    assert got.retrieve_index.tolist() == [list(range(7)), list(range(7, 14))]
    assert got.retrieve_next_token.tolist() == [[1, 3, 5, 6, -1, -1, -1], [1, 2, 3, 4, 5, 6, -1]]
    assert got.retrieve_next_sibling.tolist() == [[-1, 2, -1, 4, -1, -1, -1], [-1] * 7]
    ancestors_of_6 = [0, 1, 3, 6]  # tree 0's node 6 and its ancestors
    if mode == M.QLEN_ONLY:
        assert got.tree_mask.view(2, 7, 7)[0, 6].tolist() == [j in ancestors_of_6 for j in range(7)]
    elif mode == M.PARENT_POINTER:
        assert got.tree_mask[0].tolist() == [[-1, 0, 0, 1, 1, 2, 3], [0, 1, 1, 2, 2, 2, 3]]
    else:  # one word per row (uint8 bit-packed, int64 bitmask)
        assert int(got.tree_mask.view(2, 7)[0, 6]) == sum(1 << j for j in ancestors_of_6)


def test_one_launch_per_call_whatever_the_batch_and_size():
    rng = random.Random(3)
    for batch, nodes in ((1, 8), (5, 64), (2, 130)):
        _, parent, seq_lens = batch_of(rng, batch, nodes)
        with recording() as launched:
            K.tree_from_parents(parent, seq_lens, M.ANCESTOR_BITMASK, max_depth=nodes - 1, validate=False,
                                impl="triton")
        assert [v.kernel for v in launched] == ["_tree_from_parents_kernel"]


def test_an_empty_batch_launches_nothing():
    parent, seq_lens = torch.empty(0, 5, dtype=torch.int64, device=DEVICE), torch.empty(0, dtype=torch.int64,
                                                                                           device=DEVICE)
    with recording() as launched:
        got, expected = both(parent, seq_lens, M.QLEN_ONLY)
    assert_builds_equal(got, expected)
    assert launched == []


def test_the_triton_path_validates_like_the_reference():
    with pytest.raises(ValueError, match="in \\[0, i\\)"):
        K.tree_from_parents(torch.tensor([[-1, 0, 3, 1]], device=DEVICE), torch.zeros(1, dtype=torch.int64,
                                                                                        device=DEVICE), impl="triton")
    with pytest.raises(ValueError, match="FULL_MASK"):
        K.tree_from_parents(torch.tensor([[-1, 0]], device=DEVICE), torch.zeros(1, dtype=torch.int64, device=DEVICE),
                            M.FULL_MASK, impl="triton")


def test_auto_resolves_to_triton_on_cuda_and_the_reference_elsewhere(monkeypatch):
    monkeypatch.delenv(IMPL_ENV, raising=False)
    assert K.resolve_impl("from_parents", "auto", torch.device("cpu")) == "torch"
    if K.api.triton_available():  # resolving reads no GPU
        assert K.resolve_impl("from_parents", "auto", torch.device("cuda")) == "triton"
    monkeypatch.setenv(IMPL_ENV, "torch")
    assert K.resolve_impl("from_parents", "auto", torch.device("cuda")) == "torch"



@pytest.mark.parametrize("forced", ["triton", "cuda"])
def test_a_host_build_stays_on_the_reference_whatever_the_env_forces(monkeypatch, forced):
    """V1 builds its trees from host tensors (``runner.TreeGroup.host_build``,
    impl "auto"): on a GPU machine (no interpreter) a forced Triton or CUDA
    impl must not make it raise, as the ops that run on the device would."""
    monkeypatch.setenv(IMPL_ENV, forced)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # Triton cannot run host tensors here (kernels stay defined)
    parent, seq_lens = torch.tensor([[-1, 0, 0, 1]]), torch.tensor([7])
    with recording() as launched:
        got = K.tree_from_parents(parent, seq_lens, M.ANCESTOR_BITMASK)
    assert launched == []
    assert_builds_equal(got, K.tree_from_parents(parent, seq_lens, M.ANCESTOR_BITMASK, impl="torch"))
    with pytest.raises(RuntimeError, match="needs CUDA tensors"):  # asked for by name, it says why not
        K.tree_from_parents(parent, seq_lens, M.ANCESTOR_BITMASK, impl=forced)


TREE_AOT = """
import json
import torch
from triton.backends.compiler import GPUTarget
from triton_aot import compile_launch, resource_usage
from spec_tree_kernels import TreeMaskMode as M, triton_ops
from spec_tree_kernels.triton_launch import capturing
z = lambda *shape: torch.zeros(*shape, dtype=torch.int64)
with capturing() as held:  # the launches, held: compiled below, never run
    for mode, nodes in [(M.QLEN_ONLY, 8), (M.QLEN_ONLY_BITPACKING, 20), (M.ANCESTOR_BITMASK, 8),
                        (M.PARENT_POINTER, 64), (M.ANCESTOR_BITMASK, 1024), (M.QLEN_ONLY, 1024)]:
        triton_ops.tree_from_parents(z(3, nodes), z(3), mode, nodes - 1)
    triton_ops.build_tree(z(2, 7), z(2, 9), z(2), 4, 3, M.FULL_MASK, 10, True, None)  # shares the row tiles
for h in held:
    c = compile_launch(h.kernel, h.grid, h.args, h.kwargs, GPUTarget("cuda", 90, 32))
    print(json.dumps(dict(kernel=h.kernel.__name__, **h.kwargs, **resource_usage(c.asm["cubin"]))))
"""


def test_the_kernels_compile_for_a_gpu_without_spills():
    """The interpreter accepts code the compiler rejects: compile the tree
    build's launches (every mode, up to 1024 nodes) and build_tree's kernel
    that shares its row tiles for sm_90 with Triton's bundled ptxas; no
    register spills to local memory."""
    pytest.importorskip("triton.backends.nvidia.compiler", reason="Triton has no NVIDIA backend (sm_90 compiler)")
    rows = run_compile_script(TREE_AOT, 7)
    for row in rows:
        assert row.get("local", 0) == 0 and row.get("stack", 0) == 0, row
