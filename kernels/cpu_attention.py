"""Tree attention rows on the host CPU: ``csrc/tree_attention_cpu.c``, built with the host C compiler.

The torch path of ``attention_plan`` (gather the blocks, two batched
matmuls, softmax) costs about 0.3 ms per layer for one request's 8 tree
nodes over 400 positions on a 2-core CPU; this kernel reads the paged cache
in place, ROWS query rows per K/V load, on the process's OpenMP threads.
``build()`` compiles it once (``cc -O3 -march=native``, plus ``-fopenmp``
when the process already runs GNU OpenMP's ``libgomp.so.1``, as torch's
Linux wheels do, so the kernel joins that one thread pool instead of
starting a second runtime; cached by a digest of the source, flags and
CPU) into the kernels' build cache, with a timeout; where no compiler
works ``available()`` is false and ``build_error()`` says why. The engine adapters build it at startup, never in a step, and refuse
to start when it is asked for and did not build.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().parent / "csrc" / "tree_attention_cpu.c"
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-shared", "-fPIC"]
OPENMP_FLAG = "-fopenmp"
BUILD_TIMEOUT_S = 120

_lib = None
_error: str | None = None


def _cpu_signature() -> str:
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return platform.machine() + hashlib.sha256(flags.encode()).hexdigest()[:12]


def _process_runs_libgomp() -> bool:
    """GNU OpenMP is loaded here (torch's ``libgomp.so.1``): a kernel built with
    -fopenmp then binds to that same runtime by soname."""
    try:
        return "/libgomp" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _flags() -> list[str]:
    return [*FLAGS, OPENMP_FLAG] if _process_runs_libgomp() else list(FLAGS)


def _library_path(compiler: str, flags: list[str]) -> Path:
    from .cuda_build import cache_dir

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join([compiler, *flags, _cpu_signature()]).encode())
    return cache_dir() / f"libspec_tree_attention_cpu_{digest.hexdigest()[:16]}.so"


def find_compiler() -> str | None:
    """The C compiler ``build`` uses by default: $CC, else cc or gcc on PATH (None: none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(compiler: str | None = None) -> bool:
    """Compile (or reuse) and load the kernel; False, with ``build_error()``, when it cannot."""
    global _lib, _error
    if _lib is not None:
        return True
    compiler = compiler or find_compiler()
    if compiler is None:
        _error = "no C compiler (cc, gcc or $CC) on PATH"
        return False
    try:
        flags = _flags()
        library = _library_path(compiler, flags)
        if not library.exists():
            tmp = library.with_suffix(f".{os.getpid()}.tmp")
            subprocess.run([compiler, *flags, str(SOURCE), "-o", str(tmp), "-lm"], check=True, capture_output=True,
                           text=True, timeout=BUILD_TIMEOUT_S)
            os.replace(tmp, library)  # atomic: a concurrent builder never loads a half-written file
        lib = ctypes.CDLL(str(library))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        _error = f"{compiler} could not build {SOURCE.name}: {detail.strip()[-1500:]}"
        return False
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.spec_tree_attention_f32.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i64, i64, i64, ptr, i64, i64, i64,
                                            i64, i64, i64, i64, ptr, i64, ptr, f32, ptr, ptr,
                                            f32, ptr, ptr, ptr, ptr]  # soft_cap, sinks, alibi, key_pos, query_pos
    lib.spec_tree_attention_f32.restype = None
    lib.spec_tree_attention_workspace.argtypes = [i64, i64, i64]
    lib.spec_tree_attention_workspace.restype = i64
    lib.spec_tree_attention_lanes.argtypes = []
    lib.spec_tree_attention_lanes.restype = i64
    lib.spec_branch_attention_f32.argtypes = [ptr, i64, i64, i64, i64, ptr, i64, i64, i64, ptr, i64, i64, i64, i64, i64,
                                              i64, ptr, i64, ptr, ptr, ptr, i64, i64, ptr, f32, ptr, ptr,
                                              i64, f32, ptr, ptr]  # window, soft_cap, sinks, alibi
    lib.spec_branch_attention_f32.restype = None
    lib.spec_branch_attention_workspace.argtypes = [i64, i64, i64, i64]
    lib.spec_branch_attention_workspace.restype = i64
    _lib, _error = lib, None
    return True


def register_block_floats() -> int:
    """Floats per register block of the built kernel: one vector register of the
    build CPU (16 with AVX-512, 8 with AVX2, 4 otherwise; ``build()`` first)."""
    return int(_lib.spec_tree_attention_lanes())


def available() -> bool:
    return _lib is not None


def build_error() -> str | None:
    return _error


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The kernel serves this layer's call: built, CPU, float32 everywhere."""
    return (_lib is not None and q.device.type == "cpu" and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32)


def _feature_pointers(q: torch.Tensor, soft_cap, sinks, alibi_slopes, positions=None):
    """(soft_cap float (0: none), sinks, alibi, key_pos, query_pos pointers (None: NULL)), checked."""
    from .attention_reference import check_features

    f = check_features(None, sinks, soft_cap, alibi_slopes, num_q_heads=q.shape[2], device=q.device)
    if f.alibi_slopes is not None and positions is None:
        raise ValueError("ALiBi on the host kernel needs the columns' positions (key_pos, query_pos)")
    key_pos, query_pos = positions if f.alibi_slopes is not None else (None, None)
    return (0.0 if f.soft_cap is None else f.soft_cap,
            *(None if t is None else t.data_ptr() for t in (f.sinks, f.alibi_slopes, key_pos, query_pos)))


def run(blocks: torch.Tensor, bias: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        scale: float, out: torch.Tensor | None = None, *, soft_cap: float | None = None,
        sinks: torch.Tensor | None = None, alibi_slopes: torch.Tensor | None = None,
        positions: tuple | None = None) -> torch.Tensor:
    """blocks [B, nb] int64, bias [B, 1, 1, T, nb * block_size] float32 (the
    torch plan's, a sliding window folded in), q [B, T, Hq, D], K/V views
    [num_blocks, block_size, Hkv, D] -> [B, T, Hq, D] float32 (``supports``
    must hold): ``out`` when it is a contiguous float32 tensor of that shape,
    else a new one. soft_cap (float > 0), sinks / alibi_slopes (float32 [Hq]),
    positions (key [B, nb * block_size], query [B, T] float32 contiguous:
    with ALiBi): ``attention_reference``'s features, None for none."""
    features = _feature_pointers(q, soft_cap, sinks, alibi_slopes, positions)
    batch, nodes, hq, dim = q.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    q = q.contiguous()
    blocks = blocks.to(torch.int64).contiguous()
    bias = bias.contiguous()
    out = _result_buffer(out, q.shape)
    nb = blocks.shape[1]
    work = torch.empty(_lib.spec_tree_attention_workspace(nb, block_size, dim), dtype=torch.float32)

    # data_ptr(): element [0, 0, 0, 0] of each view (storage offset included)
    _lib.spec_tree_attention_f32(q.data_ptr(), batch, nodes, hq, dim,
                                 k_cache.data_ptr(), *k_cache.stride(), v_cache.data_ptr(), *v_cache.stride(),
                                 k_cache.shape[0], hkv, block_size, blocks.data_ptr(), nb, bias.data_ptr(), float(scale),
                                 out.data_ptr(), work.data_ptr(), *features)
    return out


def _result_buffer(out: torch.Tensor | None, shape) -> torch.Tensor:
    """Where a kernel writes its result: ``out`` when it is a contiguous float32
    tensor of ``shape``, else a new one (the caller copies from it)."""
    if out is not None and out.is_contiguous() and out.dtype == torch.float32 and out.shape == shape:
        return out
    return torch.empty(shape, dtype=torch.float32)


def branch_supports(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """``run_branch`` can serve this draft layer's cache (float32 queries
    given): built, CPU, float32, in vLLM-CPU's fp32 layout (K transposed per
    block, V row-major) with block size and head dim multiples of 16."""
    block_size, dim = k_cache.shape[1], k_cache.shape[3]
    return (_lib is not None and k_cache.device.type == "cpu" and k_cache.dtype == v_cache.dtype == torch.float32
            and k_cache.stride(1) == 1 and v_cache.stride(3) == 1 and block_size % 16 == 0 and dim % 16 == 0)


def run_branch(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
               kv_lens: torch.Tensor, branch_k: torch.Tensor, branch_v: torch.Tensor, filled: int,
               visible: torch.Tensor, scale: float, out: torch.Tensor | None = None, *, window: int | None = None,
               sinks: torch.Tensor | None = None, soft_cap: float | None = None,
               alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """One tree-drafting step (``BranchAttention``): query [R, K, Hq, D]; the
    head layer's paged K/V views (``branch_supports``); blocks [R, nb] int64
    with kv_lens [R] int64 <= nb * block_size committed positions; branch_k /
    branch_v [R, E, Hkv, D] contiguous scratch, the first ``filled`` entries
    written; visible [R, K, filled] bool (ancestors and self). Returns
    [R, K, Hq, D] float32: ``out`` when it is a contiguous float32 tensor of
    that shape, else a new one. window / sinks / soft_cap / alibi_slopes: the
    head layer's features on the draft step's positions
    (``branch_attention``'s module docstring), None for none."""
    from .attention_reference import check_features

    window = check_features(window, None, None, None, num_q_heads=query.shape[2], device=query.device).window
    features = _feature_pointers(query, soft_cap, sinks, alibi_slopes, positions=(None, None))[:3]
    R, K, hq, dim = query.shape
    block_size, hkv = k_cache.shape[1], k_cache.shape[2]
    query = query.contiguous()
    blocks = blocks.to(torch.int64).contiguous()
    kv_lens = kv_lens.to(torch.int64).contiguous()
    visible = visible.to(torch.uint8).contiguous()
    out = _result_buffer(out, query.shape)
    nb, entries = blocks.shape[1], branch_k.shape[1]
    work = torch.empty(_lib.spec_branch_attention_workspace(nb, block_size, entries, dim), dtype=torch.float32)
    _lib.spec_branch_attention_f32(query.data_ptr(), R, K, hq, dim,
                                   k_cache.data_ptr(), k_cache.stride(0), k_cache.stride(2), k_cache.stride(3),
                                   v_cache.data_ptr(), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
                                   k_cache.shape[0], hkv, block_size, blocks.data_ptr(), nb, kv_lens.data_ptr(),
                                   branch_k.data_ptr(), branch_v.data_ptr(), entries, filled, visible.data_ptr(),
                                   float(scale), out.data_ptr(), work.data_ptr(), window or 0, *features)
    return out
