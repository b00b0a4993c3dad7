"""spec_tree_kernels.keyed_randoms: the Triton kernel against the torch
reference (the hashes, so the coins, bit for bit; the float64 -log of the
exponentials within float32 rounding), under TRITON_INTERPRET=1 without a GPU.
The distribution and the walk on these randoms are tested in
tests/model/test_vllm_tree_walk_randoms.py."""

from __future__ import annotations

import pytest
import torch

from kernel_device import DEVICE
from spec_tree_kernels.keyed_randoms import keyed_randoms, keyed_randoms_reference


@pytest.mark.parametrize("nodes,vocab", [(1, 1), (8, 300), (64, 2049), (1100, 37)])
def test_triton_equals_the_reference(nodes, vocab):
    seeds = torch.tensor([0, 5, -(2**62), 2**40 + 3, -1, 2**63 - 1])
    positions = torch.tensor([0, 7, 123456, 2**33 + 9, 1, 2**31])
    want_coins, want_exps = keyed_randoms_reference(seeds, positions, nodes, vocab)
    coins, exps = keyed_randoms(seeds.to(DEVICE), positions.to(DEVICE), nodes, vocab, impl="triton")
    assert torch.equal(coins.cpu(), want_coins)
    torch.testing.assert_close(exps.cpu(), want_exps, rtol=2e-7, atol=0)
    assert bool((exps > 0).all())


def test_a_requests_draws_do_not_depend_on_its_row_or_int32_positions():
    seeds, positions = torch.tensor([11, 22, 33]), torch.tensor([3, 4, 5])
    whole = keyed_randoms(seeds.to(DEVICE), positions.to(DEVICE), 4, 50, impl="triton")
    row = keyed_randoms(seeds[2:].to(DEVICE), positions[2:].to(torch.int32).to(DEVICE), 4, 50, impl="triton")
    assert torch.equal(row[0], whole[0][2:]) and torch.equal(row[1], whole[1][2:])


def test_bad_inputs_are_named():
    with pytest.raises(TypeError, match="seeds"):
        keyed_randoms(torch.zeros(2), torch.zeros(2, dtype=torch.int64), 4, 8)
    with pytest.raises(ValueError, match="positions has shape"):
        keyed_randoms(torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), 4, 8)
    with pytest.raises(ValueError, match="nodes=0"):
        keyed_randoms(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 0, 8)


def test_served_calls_only_make_warmed_variants():
    """As verify_v2 calls it (a block's rows of gathered seeds, int32 or int64
    positions, every trimmed tree size): nothing the startup warm-up missed."""
    from spec_tree_kernels.startup import TRITON_OPS, ServingConfig, warm_up
    from spec_tree_kernels.tree_shape import TreeShape
    from spec_tree_kernels.triton_launch import recording

    config = ServingConfig(shapes=(TreeShape(5, 4, 8),), mode="ANCESTOR_BITMASK", prefix_trim=True, verify_depth=7,
                           max_batch=6, max_context_len=600, vocab_size=50)
    with recording() as warmed:
        warm_up(config, DEVICE, impls={**dict.fromkeys(TRITON_OPS, "torch"), "keyed_randoms": "triton"})
    assert {v.kernel for v in warmed} == {"_keyed_randoms_kernel"}
    seeds = torch.arange(7, dtype=torch.int64, device=DEVICE) * 977
    with recording() as served:
        for nodes in config.tree_sizes:
            for first, dtype in ((0, torch.int64), (1, torch.int32), (3, torch.int64)):
                positions = torch.arange(first, 7, dtype=dtype, device=DEVICE)
                keyed_randoms(seeds[first:], positions, nodes, config.vocab_size, impl="triton")
    missing = set(served) - set(warmed)
    assert served and not missing, sorted(map(str, missing))
