"""The two ways the tree ops reach the compiled kernels of ``csrc/tree_ops.cu``.

* ``ExtensionBackend`` (preferred): the torch binding (``tree_ops_binding.cpp``,
  built by ``torch.utils.cpp_extension``) takes tensors and launches on the
  current stream;
* ``CtypesBackend`` (fallback): the C launchers of ``tree_ops.h`` from a plain
  shared library, called through ctypes with raw pointers; ``emulated=True``
  is the host build of the kernels (CPU tensors, the test suite's way to run
  them without a GPU).

Both have the same four methods (build, verify, verify_sampling, move_kv),
taking the tensors the ops in ``cuda_ops`` prepared (contiguous, outputs
allocated). ``cuda_build`` builds the code behind them.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

GEOMETRY = 8  # int64 values per cache in spec_tree_move_kv (tree_ops.h)


class ExtensionBackend:
    """The torch binding: takes tensors, launches on the current stream."""

    name = "extension"

    def __init__(self, module):
        self._m = module

    def build(self, selected, parent_list, seq_lens, topk, num_steps, mode, fill_prefix, seq_lens_sum, mask, links, ok):
        self._m.build(selected, parent_list, seq_lens, topk, num_steps, mode, fill_prefix, seq_lens_sum, mask, links, ok)

    def verify(self, candidates, next_token, next_sibling, target, accept_index, accept_length, accept_tokens):
        self._m.verify(candidates, next_token, next_sibling, target, accept_index, accept_length, accept_tokens)

    def verify_sampling(self, candidates, next_token, next_sibling, probs, coins, exponentials, accept_index,
                        accept_length, accept_tokens):
        self._m.verify_sampling(candidates, next_token, next_sibling, probs, coins, exponentials, accept_index,
                                accept_length, accept_tokens)

    def move_kv(self, caches, verify_slots, accept_index, accept_length):
        self._m.move_kv(list(caches), verify_slots, accept_index, accept_length)


class CtypesBackend:
    """The C launchers of tree_ops.h through ctypes, with raw pointers.

    ``emulated=True`` is the host build of the kernels (cuda_emulation.h):
    CPU tensors, no stream; the test suite uses it to check the kernels
    without a GPU.
    """

    def __init__(self, library: Path, emulated: bool = False):
        self.name = "emulated" if emulated else "ctypes"
        self._emulated = emulated
        lib = ctypes.CDLL(str(library))
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        lib.spec_tree_build.argtypes = [p, p, p, i64, i64, i64, i64, i64, i32, i32, i64, p, i32, p, p, p, p, p, p]
        lib.spec_tree_verify.argtypes = [p, p, p, p, i64, i64, i64, p, p, p, p]
        lib.spec_tree_verify_sampling.argtypes = [p, p, p, p, p, p, i32, i64, i64, i64, i64, p, p, p, p]
        lib.spec_tree_move_kv.argtypes = [p, p, i32, p, i64, i64, p, i32, i64, p, i32, p]
        for fn in (lib.spec_tree_build, lib.spec_tree_verify, lib.spec_tree_verify_sampling, lib.spec_tree_move_kv):
            fn.restype = ctypes.c_int
        lib.spec_tree_error_string.argtypes = [ctypes.c_int]
        lib.spec_tree_error_string.restype = ctypes.c_char_p
        self._lib = lib

    def _stream(self, t: torch.Tensor):
        if self._emulated:
            if t.device.type != "cpu":
                raise ValueError("the emulated CUDA kernels take CPU tensors")
            return None
        if t.device.type != "cuda":
            raise ValueError(f"the CUDA kernels take CUDA tensors, got {t.device}")
        return torch.cuda.current_stream(t.device).cuda_stream

    def _check(self, code: int, op: str) -> None:
        if code != 0:
            raise RuntimeError(f"spec_tree_kernels CUDA {op} failed: {self._lib.spec_tree_error_string(code).decode()}")

    def build(self, selected, parent_list, seq_lens, topk, num_steps, mode, fill_prefix, seq_lens_sum, mask, links, ok):
        batch, nodes = links.shape[1], links.shape[2]
        plane = batch * nodes * 8
        base = links.data_ptr()
        code = self._lib.spec_tree_build(
            selected.data_ptr(), parent_list.data_ptr(), seq_lens.data_ptr(), batch, nodes, topk, num_steps,
            parent_list.shape[1], int(mode), int(bool(fill_prefix)), seq_lens_sum, mask.data_ptr(),
            mask.element_size(), base, base + plane, base + 2 * plane, base + 3 * plane, ok.data_ptr(),
            self._stream(selected),
        )  # fmt: skip
        self._check(code, "build_tree")

    def verify(self, candidates, next_token, next_sibling, target, accept_index, accept_length, accept_tokens):
        code = self._lib.spec_tree_verify(
            candidates.data_ptr(), next_token.data_ptr(), next_sibling.data_ptr(), target.data_ptr(),
            candidates.shape[0], candidates.shape[1], accept_index.shape[1], accept_index.data_ptr(),
            accept_length.data_ptr(), accept_tokens.data_ptr(), self._stream(candidates),
        )  # fmt: skip
        self._check(code, "verify_tree_greedy")

    def verify_sampling(self, candidates, next_token, next_sibling, probs, coins, exponentials, accept_index,
                        accept_length, accept_tokens):
        if not (probs.dtype == coins.dtype == exponentials.dtype) or probs.dtype not in (torch.float32, torch.float64):
            raise ValueError("target_probs, coins and exponentials must all be float32 or all float64")
        code = self._lib.spec_tree_verify_sampling(
            candidates.data_ptr(), next_token.data_ptr(), next_sibling.data_ptr(), probs.data_ptr(),
            coins.data_ptr(), exponentials.data_ptr(), int(probs.dtype == torch.float64), candidates.shape[0],
            candidates.shape[1], probs.shape[2], accept_index.shape[1], accept_index.data_ptr(),
            accept_length.data_ptr(), accept_tokens.data_ptr(), self._stream(candidates),
        )  # fmt: skip
        self._check(code, "verify_tree_sampling")

    def move_kv(self, caches, verify_slots, accept_index, accept_length):
        n = len(caches)
        bases = (ctypes.c_void_p * n)(*[c.data_ptr() for c in caches])
        geometry = (ctypes.c_int64 * (n * GEOMETRY))(
            *[v for c in caches for v in (*c.shape[1:], *c.stride(), c.element_size())]
        )
        code = self._lib.spec_tree_move_kv(
            bases, geometry, n, verify_slots.data_ptr(), verify_slots.shape[0], verify_slots.shape[1],
            accept_index.data_ptr(), int(accept_index.dtype == torch.int64), accept_index.shape[1],
            accept_length.data_ptr(), int(accept_length.dtype == torch.int64), self._stream(verify_slots),
        )  # fmt: skip
        self._check(code, "move_accepted_kv")
