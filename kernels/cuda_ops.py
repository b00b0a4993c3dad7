"""CUDA C++ implementations of the tree ops (``csrc/tree_ops.cu``).

Semantics, shapes and dtypes are those of ``reference.py``, bit for bit; call
these through ``spec_tree_kernels.api`` (``impl="cuda"``), which validates the
inputs. Every op is one or two launches on the current CUDA stream with
launch shapes fixed by the tensors' shapes: no host sync, CUDA-graph
capturable.

The kernels are built once per process when torch sees a GPU and ``nvcc`` is
found: engines call ``ensure_built()`` (through ``spec_tree_kernels.prepare``)
at worker startup; otherwise the first ``available()`` or op builds them. The
compile runs in a child process under a timeout, behind a build lock that
survives killed builds (``startup.py``); when it cannot build, ``available()``
is False, the reason is logged, and ``impl="auto"`` uses Triton.

* ``extension`` backend (preferred): ``csrc/tree_ops_binding.cpp`` +
  ``tree_ops.cu`` through ``torch.utils.cpp_extension.load`` (needs ninja);
* ``ctypes`` backend (fallback): ``tree_ops.cu`` alone, built by ``nvcc
  -shared`` and called through ctypes with raw pointers.

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

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Sequence

import torch

from . import startup
from .modes import TreeMaskMode, empty_tree_mask
from .reference import TreeBuild, VerifyResult, empty_verify_result

logger = logging.getLogger("spec_tree_kernels")

CSRC = Path(__file__).resolve().parent / "csrc"
_KERNEL_SOURCE = CSRC / "tree_ops.cu"
_BINDING_SOURCE = CSRC / "tree_ops_binding.cpp"
_HEADERS = (CSRC / "tree_ops.h", CSRC / "cuda_emulation.h")
_GEOMETRY = 8  # int64 values per cache in spec_tree_move_kv (tree_ops.h)

_lock = threading.Lock()
_state: dict = {"loaded": False, "backend": None, "error": None}


# ------------------------------------------------------------------ backends


class _ExtensionBackend:
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


class _CtypesBackend:
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
        geometry = (ctypes.c_int64 * (n * _GEOMETRY))(
            *[v for c in caches for v in (*c.shape[1:], *c.stride(), c.element_size())]
        )
        code = self._lib.spec_tree_move_kv(
            bases, geometry, n, verify_slots.data_ptr(), verify_slots.shape[0], verify_slots.shape[1],
            accept_index.data_ptr(), int(accept_index.dtype == torch.int64), accept_index.shape[1],
            accept_length.data_ptr(), int(accept_length.dtype == torch.int64), self._stream(verify_slots),
        )  # fmt: skip
        self._check(code, "move_accepted_kv")


# -------------------------------------------------------------------- builds


def _sources_digest(*paths: Path, extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for path in paths:
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _cache_dir() -> Path:
    root = os.environ.get("SPEC_TREE_KERNELS_BUILD_DIR") or os.path.join(Path.home(), ".cache", "spec_tree_kernels")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def find_nvcc() -> str | None:
    """nvcc from CUDA_HOME / torch's CUDA_HOME / PATH / /usr/local/cuda*, or None."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    try:
        from torch.utils.cpp_extension import CUDA_HOME

        candidates.append(CUDA_HOME)
    except Exception:
        pass
    for home in candidates:
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return os.path.join(home, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    for home in sorted(Path("/usr/local").glob("cuda*"), reverse=True):
        if os.access(home / "bin" / "nvcc", os.X_OK):
            return str(home / "bin" / "nvcc")
    return None


def _build_extension(nvcc: str) -> _ExtensionBackend:
    import sys

    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:  # torch looked before we did; point it at our nvcc's toolkit
        cpp_extension.CUDA_HOME = str(Path(nvcc).resolve().parent.parent)
    if shutil.which("ninja") is None:  # a venv's ninja is not on PATH unless the venv is activated
        for folder in (Path(sys.executable).parent, Path(getattr(_ninja_module(), "BIN_DIR", "") or "/nonexistent")):
            if (folder / "ninja").exists():
                os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
                break
    build_dir = str(_extension_dir())
    module = cpp_extension.load(
        name="spec_tree_kernels_cuda",
        sources=[str(_BINDING_SOURCE), str(_KERNEL_SOURCE)],
        extra_include_paths=[str(CSRC)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
        build_directory=build_dir,
        verbose=os.environ.get("SPEC_TREE_KERNELS_VERBOSE_BUILD") == "1",
    )
    return _ExtensionBackend(module)


def _extension_dir() -> Path:
    """Where ``cpp_extension.load`` builds (ours, not torch's default, so the
    stale-lock check knows where torch's lock file lives)."""
    path = _cache_dir() / "extension"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _ninja_module():
    try:
        import ninja

        return ninja
    except ImportError:
        return None


def _device_arch_flags() -> list[str]:
    major, minor = torch.cuda.get_device_capability()
    return [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]


def _compile_library(compiler: str, flags: list[str], name: str, digest_key: str, out_dir: Path | None) -> Path:
    """``compiler flags tree_ops.cu`` into ``lib{name}_{digest}.so`` in
    ``out_dir`` (default: the build cache), reused while the sources and
    ``digest_key`` are unchanged. Returns the library path."""
    digest = _sources_digest(_KERNEL_SOURCE, *_HEADERS, extra=digest_key)
    library = (out_dir or _cache_dir()) / f"lib{name}_{digest}.so"
    if not library.exists():
        tmp = library.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([compiler, *flags, "-I", str(CSRC), str(_KERNEL_SOURCE), "-o", str(tmp)], check=True,
                       capture_output=True, text=True)  # fmt: skip
        os.replace(tmp, library)  # atomic: concurrent builders never load a half-written file
    return library


def build_shared_library(nvcc: str, arch_flags: Sequence[str], out_dir: Path | None = None) -> Path:
    """``nvcc -shared`` build of tree_ops.cu (static cudart). Returns the library path."""
    flags = ["-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", *arch_flags]
    return _compile_library(nvcc, flags, "spec_tree_ops", " ".join(flags), out_dir)


def build_emulated_library(cxx: str = "c++", out_dir: Path | None = None) -> Path:
    """Host build of tree_ops.cu against cuda_emulation.h (for CPU tests)."""
    flags = ["-std=c++17", "-O1", "-x", "c++", "-DSPEC_TREE_EMULATE", "-shared", "-fPIC", "-pthread"]
    return _compile_library(cxx, flags, "spec_tree_ops_emulated", " ".join([cxx, *flags]), out_dir)


def emulated_backend(out_dir: Path | None = None) -> _CtypesBackend:
    """The kernels compiled for the host (one thread per CUDA thread): pass as
    ``backend=`` to the ops below, with CPU tensors."""
    return _CtypesBackend(build_emulated_library(out_dir=out_dir), emulated=True)


def _compile(nvcc: str, choice: str):
    """Build (or reuse the cached build of) one backend in this process."""
    errors = []
    if choice in ("auto", "extension"):
        try:
            return _build_extension(nvcc)
        except Exception as exc:  # no ninja, header trouble, compiler error
            errors.append(f"extension: {type(exc).__name__}: {str(exc)[-2000:]}")
    if choice in ("auto", "ctypes"):
        try:
            return _CtypesBackend(build_shared_library(nvcc, _device_arch_flags()))
        except subprocess.CalledProcessError as exc:
            errors.append(f"ctypes: nvcc failed: {exc.stderr[-2000:]}")
        except Exception as exc:
            errors.append(f"ctypes: {type(exc).__name__}: {exc}")
    raise RuntimeError("; ".join(errors) or f"unknown SPEC_TREE_KERNELS_CUDA_BACKEND={choice!r}")


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
    with startup.BuildLock(_cache_dir() / "build.lock", timeout):
        if startup.remove_if_exists(_extension_dir() / "lock"):
            logger.warning("spec_tree_kernels: removed torch's stale build lock in %s (a killed build)", _extension_dir())
        built = startup.run_build_child(["--compile", choice], max(deadline - time.monotonic(), 1.0))
        return _compile(nvcc, built)


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
                _state["backend"] = _build_and_load(startup.build_timeout(timeout))
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
    print(_compile(find_nvcc() or "nvcc", sys.argv[2]).name)
