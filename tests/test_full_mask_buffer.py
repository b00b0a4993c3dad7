"""FULL_MASK into a preallocated buffer fills the whole buffer (issue 19, item 8).

SGLang 0.5.23's ``build_tree_kernel_efficient`` runs ``tree_mask.fill_(True)``
on a preallocated FULL_MASK buffer, whatever ``seq_lens_sum`` says (its
callers may pass 0 with a buffer), and its kernel then writes the tree cells
at each request's real offsets. A fill sized by ``seq_lens_sum`` would leave
the previous step's prefix bits in place. Every implementation (torch
reference, Triton, the CUDA kernels through their host emulation) must end up
with the oracle's mask followed by True up to the end of the buffer.
"""

from __future__ import annotations

import random
import shutil

import pytest
import torch

import oracle
import spec_tree_kernels as K
from kernel_device import DEVICE
from pools import random_batch
from spec_tree_kernels import TreeMaskMode as M
from spec_tree_kernels import cuda_build, cuda_ops

TOPK, STEPS, NODES = 3, 3, 7
SLACK = 29  # buffer entries beyond what the batch needs (SGLang sizes for max_bs and the longest context)


def stale_buffer(size: int, device, dtype=torch.bool) -> torch.Tensor:
    """A buffer as the previous step left it: no prefix bit set."""
    return torch.zeros(size, dtype=dtype, device=device)


def case(batch: int, seed: int, device):
    rng = random.Random(seed)
    scores, parent_list = random_batch(rng, batch, TOPK, STEPS, "ties")
    seq_lens = torch.tensor([rng.randint(1, 20) for _ in range(batch)], dtype=torch.int64)
    selected = K.select_tree_nodes(scores, parent_list, TOPK, STEPS, NODES, impl="torch")
    return selected.to(device), parent_list.to(device), seq_lens.to(device)


def expected_mask(selected, parent_list, seq_lens, size: int, filled: bool = True) -> list[bool]:
    """The oracle's FULL_MASK for the batch, then True to the end of the buffer
    (``filled=False``: what a build without the fill leaves in a zeroed buffer)."""
    out: list[bool] = []
    for s, p, seq_len in zip(selected.cpu(), parent_list.cpu(), seq_lens.tolist()):
        for row in oracle.qlen_rows(oracle.tree_of(s.tolist(), p.tolist(), TOPK)):
            out.extend([filled] * seq_len + row)
    return out + [filled] * (size - len(out))


def emulated_build(emu):
    def build(selected, parent_list, seq_lens, seq_lens_sum, buf):
        return cuda_ops.build_tree(
            selected, parent_list, seq_lens, TOPK, STEPS, M.FULL_MASK, seq_lens_sum, True, buf, backend=emu
        )[0]

    return build


def api_build(impl):
    def build(selected, parent_list, seq_lens, seq_lens_sum, buf):
        return K.build_tree(
            selected, parent_list, seq_lens, TOPK, STEPS, M.FULL_MASK, seq_lens_sum=seq_lens_sum,
            tree_mask_buf=buf, impl=impl,
        )  # fmt: skip

    return build


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    if shutil.which("c++") is None:
        pytest.skip("needs a host C++ compiler (c++) for the CUDA emulation")
    return cuda_build.emulated_backend(tmp_path_factory.mktemp("cuda_emulated"))


def builders(request):
    impl = request.param
    if impl == "emulated":
        return "cpu", emulated_build(request.getfixturevalue("emu"))
    return (DEVICE if impl == "triton" else "cpu"), api_build(impl)


@pytest.fixture(params=["torch", "triton", "emulated"])
def build(request):
    return builders(request)


# bool: SGLang's FULL_MASK allocation; uint8: the buffer its Triton verify backend preallocates
@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8], ids=["bool", "uint8"])
@pytest.mark.parametrize("seq_lens_sum", ["zero", "exact"])
def test_preallocated_full_mask_is_filled_whole(build, seq_lens_sum, dtype):
    device, run = build
    selected, parent_list, seq_lens = case(batch=3, seed=19, device=device)
    needed = int(seq_lens.sum()) * NODES + NODES * NODES * 3
    buf = stale_buffer(needed + SLACK, device, dtype)
    tree = run(selected, parent_list, seq_lens, 0 if seq_lens_sum == "zero" else int(seq_lens.sum()), buf)
    assert tree.tree_mask.data_ptr() == buf.data_ptr()
    assert buf.bool().tolist() == expected_mask(selected, parent_list, seq_lens, buf.numel())


def test_empty_batch_fills_the_buffer(build):
    """bs == 0 still fills, as SGLang's unconditional fill_ does."""
    device, run = build
    empty = torch.empty(0, NODES - 1, dtype=torch.int64, device=device)
    parents = torch.empty(0, K.parent_list_width(TOPK, STEPS), dtype=torch.int64, device=device)
    buf = stale_buffer(SLACK, device)
    run(empty, parents, torch.empty(0, dtype=torch.int64, device=device), 0, buf)
    assert bool(buf.all())


def test_without_fill_the_prefix_is_left_alone():
    """fill_prefix_mask=False keeps its meaning: only tree cells are written."""
    selected, parent_list, seq_lens = case(batch=2, seed=3, device="cpu")
    buf = stale_buffer(int(seq_lens.sum()) * NODES + NODES * NODES * 2 + SLACK, "cpu")
    K.build_tree(
        selected, parent_list, seq_lens, TOPK, STEPS, M.FULL_MASK, seq_lens_sum=0, fill_prefix_mask=False,
        tree_mask_buf=buf, impl="torch",
    )  # fmt: skip
    assert buf.tolist() == expected_mask(selected, parent_list, seq_lens, buf.numel(), filled=False)
