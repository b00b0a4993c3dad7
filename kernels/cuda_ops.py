"""CUDA C++ implementations of the tree ops (``csrc/tree_ops.cu``), and
whether this process can use them.

Semantics, shapes and dtypes are those of ``reference.py``, bit for bit; call
these through ``spec_tree_kernels.api`` (``impl="cuda"``), which validates the
inputs. Every op is one or two launches on the current CUDA stream with
launch shapes fixed by the tensors' shapes: no host sync, CUDA-graph
capturable.

The kernels are built once per process when torch sees a GPU and ``nvcc`` is
found: engines call ``ensure_built()`` (through ``spec_tree_kernels.prepare``)
at worker startup; otherwise the first ``available()`` or op builds them. The
compile runs in a child process under a timeout (this module run as
``__main__``), behind a build lock that survives killed builds
(``startup.py``, ``cuda_build_guard.py``); when it cannot build, ``available()`` is False, the reason
is logged, and ``impl="auto"`` uses Triton. How a build is made (toolchain,
compile, cache): ``cuda_build.py``; the two backends it yields (the torch
``extension``, preferred, and ``ctypes``, its fallback): ``cuda_backends.py``.

Environment:

* ``SPEC_TREE_KERNELS_CUDA_BACKEND`` = ``auto`` (default: extension, else
  ctypes) | ``extension`` | ``ctypes``;
* ``SPEC_TREE_KERNELS_CUDA_JIT=0`` never builds (``available()`` is False);
* ``SPEC_TREE_KERNELS_BUILD_DIR`` where builds go (default
  ``~/.cache/spec_tree_kernels``; the extension in its ``extension/``);
* ``SPEC_TREE_KERNELS_BUILD_TIMEOUT`` seconds for the build, lock wait
  included (default 600).

``available()`` never raises; ``load_error()`` says why it is False.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import Sequence

import torch

from . import cuda_build_guard
from .cuda_build import cache_dir, compile_backend, extension_dir, find_nvcc
from .modes import TreeMaskMode, empty_tree_mask
from .reference import TreeBuild, VerifyResult, empty_verify_result

__all__ = [
    # the ops
    "build_tree", "verify_tree_greedy", "verify_tree_sampling", "move_accepted_kv",
    # whether this process can run them
    "ensure_built", "available", "load_error", "backend_name",
]

logger = logging.getLogger("spec_tree_kernels")

_lock = threading.Lock()
_state: dict = {"loaded": False, "backend": None, "error": None}


# ------------------------------------------------------- once per process


def _why_not_buildable() -> str | None:
    if os.environ.get("SPEC_TREE_KERNELS_CUDA_JIT", "1") == "0":
        return "SPEC_TREE_KERNELS_CUDA_JIT=0"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    if find_nvcc() is None:
        return "nvcc not found (CUDA_HOME, PATH, /usr/local/cuda*)"
    return None


def _build_and_load(timeout: float):
    """Compile in a child process (killable on timeout), under the build lock;
    then load the finished build here (a cache hit: no compile in this process)."""
    nvcc = find_nvcc()
    choice = os.environ.get("SPEC_TREE_KERNELS_CUDA_BACKEND", "auto")
    deadline = time.monotonic() + timeout
    with cuda_build_guard.BuildLock(cache_dir() / "build.lock", timeout):
        if cuda_build_guard.remove_if_exists(extension_dir() / "lock"):
            logger.warning("spec_tree_kernels: removed torch's stale build lock in %s (a killed build)", extension_dir())
        built = cuda_build_guard.run_build_child(["--compile", choice], max(deadline - time.monotonic(), 1.0))
        return compile_backend(nvcc, built)


def _load(timeout: float | None = None):
    """Build or load the backend once per process; record and log why not."""
    with _lock:
        if _state["loaded"]:
            return _state["backend"]
        _state["loaded"] = True
        reason = _why_not_buildable()
        if reason is None:
            started = time.monotonic()
            try:
                _state["backend"] = _build_and_load(cuda_build_guard.build_timeout(timeout))
                logger.info("spec_tree_kernels: CUDA kernels ready (%s backend, %.1fs)", _state["backend"].name,
                            time.monotonic() - started)
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
        if reason is not None:
            _state["error"] = reason
            log = logger.info if reason.startswith("SPEC_TREE_KERNELS_CUDA_JIT") else logger.warning
            log("spec_tree_kernels: CUDA kernels unavailable (%s); impl='auto' uses Triton for build/verify/move_kv",
                reason)
        return _state["backend"]


def ensure_built(timeout: float | None = None) -> bool:
    """Build or load the CUDA kernels now (call at engine startup, not in the
    serving loop). True when they are usable; never raises: on False the
    reason is logged and in ``load_error()``, and ``impl="auto"`` uses Triton.
    ``timeout`` (seconds, lock wait included) defaults to
    ``$SPEC_TREE_KERNELS_BUILD_TIMEOUT`` or 600."""
    return available(timeout)


def available(timeout: float | None = None) -> bool:
    """True when the CUDA kernels are built (building them on first call)."""
    try:
        return _load(timeout) is not None
    except Exception as exc:  # never raise: callers fall back to Triton / torch
        _state["error"] = str(exc)
        return False


def load_error() -> str | None:
    """Why ``available()`` is False (None when it is True or was never asked)."""
    return _state["error"]


def backend_name() -> str | None:
    """``"extension"`` or ``"ctypes"`` once built, else None."""
    backend = _state["backend"]
    return backend.name if backend is not None else None


def _backend_or_raise(backend):
    if backend is not None:
        return backend
    loaded = _load()
    if loaded is None:
        raise RuntimeError(f"the CUDA tree kernels are not available: {load_error()}")
    return loaded


# ----------------------------------------------------------------------- ops


def build_tree(
    selected_index, parent_list, seq_lens, topk, num_steps, mode, seq_lens_sum, fill_prefix_mask, tree_mask_buf,
    *, backend=None
) -> tuple[TreeBuild, torch.Tensor]:
    """``reference.build_tree`` in one kernel (plus a memset for FULL_MASK's prefix).

    selected_index [B, T-1], parent_list [B, PW], seq_lens [B]: int64.
    tree_mask_buf, when given, must be contiguous (it is written through its
    element size like the Triton kernel does). Returns (TreeBuild, ok [B] bool);
    positions and the three retrieve arrays are [B, T] int64 views of one buffer.
    """
    be = _backend_or_raise(backend)
    mode = TreeMaskMode(int(mode))
    batch, num_selected = selected_index.shape
    nodes = num_selected + 1
    device = selected_index.device
    mask = tree_mask_buf if tree_mask_buf is not None else empty_tree_mask(mode, batch, nodes, seq_lens_sum, device)
    if not mask.is_contiguous():
        raise ValueError("tree_mask_buf must be contiguous for impl='cuda'")
    links = torch.empty(4, batch, nodes, dtype=torch.int64, device=device)
    ok = torch.empty(batch, dtype=torch.bool, device=device)
    # The launcher fills seq_lens_sum * T + T * T * B entries, all of a mask it
    # sized; a preallocated buffer (or an empty batch's) is filled whole here,
    # as SGLang and the reference do.
    fill_here = fill_prefix_mask and mode == TreeMaskMode.FULL_MASK and (tree_mask_buf is not None or not batch)
    if fill_here:
        mask.fill_(True)
    if batch:
        be.build(
            selected_index.contiguous(), parent_list.contiguous(), seq_lens.contiguous(), int(topk), int(num_steps),
            int(mode), bool(fill_prefix_mask) and not fill_here, int(seq_lens_sum), mask, links, ok,
        )  # fmt: skip
    return TreeBuild(mask, links[0], links[1], links[2], links[3]), ok


def _verify(launch, candidates, next_token, next_sibling, target_inputs, num_steps) -> VerifyResult:
    """Run a backend's verify op (``launch``): the tree's three [B, T] arrays
    and ``target_inputs``, contiguous, then the ``VerifyResult`` outputs it fills."""
    batch = candidates.shape[0]
    result = empty_verify_result(batch, int(num_steps) + 1, candidates.device)
    if batch:
        launch(
            candidates.contiguous(), next_token.contiguous(), next_sibling.contiguous(),
            *(t.contiguous() for t in target_inputs), *result,
        )  # fmt: skip
    return result


def verify_tree_greedy(candidates, next_token, next_sibling, target_predict, num_steps, *, backend=None) -> VerifyResult:
    """``reference.verify_tree_greedy``: a warp per request walks the tree in shared memory.

    candidates, next_token, next_sibling, target_predict: [B, T] int64.
    Returns accept_index [B, S+1] int32, accept_length [B] int32, accept_tokens [B, S+1] int64.
    """
    launch = _backend_or_raise(backend).verify
    return _verify(launch, candidates, next_token, next_sibling, (target_predict,), num_steps)


def verify_tree_sampling(
    candidates, next_token, next_sibling, target_probs, coins, exponentials, num_steps, *, backend=None
) -> VerifyResult:
    """``reference.verify_tree_sampling``: a block per request; thread 0 walks
    the tree in shared memory, then the block runs the exponential race over V.

    candidates, next_token, next_sibling: [B, T] int64; target_probs [B, T, V],
    coins [B, T], exponentials [B, V]: float32 or float64, one dtype.
    Returns accept_index [B, S+1] int32, accept_length [B] int32, accept_tokens [B, S+1] int64.
    """
    launch = _backend_or_raise(backend).verify_sampling
    return _verify(launch, candidates, next_token, next_sibling, (target_probs, coins, exponentials), num_steps)


def move_accepted_kv(caches: Sequence[torch.Tensor], verify_slots, accept_index, accept_length, *, backend=None) -> None:
    """``reference.move_accepted_kv`` in place; caches of equal shape, strides
    and element size (e.g. every layer's K and V) share one launch.

    caches: [num_blocks, block_size, H, D] views, any strides and dtype (rows
    are copied as raw bytes, 16-byte vectors where alignment allows).
    verify_slots [B, T] int64; accept_index [B, S+1], accept_length [B]: int32/int64.
    """
    be = _backend_or_raise(backend)
    caches = list(caches)
    if not caches or verify_slots.shape[0] == 0:
        return
    be.move_kv(caches, verify_slots.contiguous(), accept_index.contiguous(), accept_length.contiguous())


if __name__ == "__main__":  # the build child of ``_build_and_load``: compile, print the backend built
    if sys.argv[1:2] != ["--compile"] or len(sys.argv) != 3:
        raise SystemExit("usage: python -m spec_tree_kernels.cuda_ops --compile auto|extension|ctypes")
    print(compile_backend(find_nvcc() or "nvcc", sys.argv[2]).name)
