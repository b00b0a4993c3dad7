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
    lib.spec_tree_attention_run.argtypes = [ptr, ptr, ptr, i64, ptr, i64]  # layer, step, q, q_stok, out, o_stok
    lib.spec_tree_attention_run.restype = None
    lib.spec_tree_attention_spans.argtypes = [ptr, i64, i64, i64, ptr]  # bias, B, T, S, spans
    lib.spec_tree_attention_spans.restype = None
    lib.spec_tree_attention_threads.argtypes = []
    lib.spec_tree_attention_threads.restype = i64
    lib.spec_tree_attention_workspace.argtypes = [i64, i64, i64]
    lib.spec_tree_attention_workspace.restype = i64
    lib.spec_tree_attention_lanes.argtypes = []
    lib.spec_tree_attention_lanes.restype = i64
    lib.spec_tree_fma_seconds.argtypes = [i64, i64, ctypes.POINTER(ctypes.c_double)]  # iters, threads, fmas out
    lib.spec_tree_fma_seconds.restype = ctypes.c_double
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


def fma_work(threads: int, iters: int = 20_000_000) -> tuple[float, float]:
    """(float FMAs done, seconds) of ``iters`` rounds of register-only FMA chains
    on ``threads`` threads: every lane of every thread counted, the time of the
    slowest thread (``build()`` first)."""
    fmas = ctypes.c_double(0.0)
    seconds = float(_lib.spec_tree_fma_seconds(iters, threads, ctypes.byref(fmas)))
    return fmas.value, seconds


def fma_per_second(threads: int, iters: int = 20_000_000) -> float:
    """Float FMAs per second this build's register block sustains on ``threads``
    threads, all in registers: the machine's ceiling for the kernel's two FMA
    passes (the kernel bench's roofline; ``build()`` first)."""
    fmas, seconds = fma_work(threads, iters)
    return fmas / seconds if seconds > 0 else 0.0


def available() -> bool:
    return _lib is not None


def build_error() -> str | None:
    return _error


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The kernel serves this layer's call: built, CPU, float32 everywhere,
    strided cache views (a ``kv_layout.TiledKV`` goes the torch way)."""
    return (_lib is not None and q.device.type == "cpu" and q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor))


def _feature_pointers(q: torch.Tensor, soft_cap, sinks, alibi_slopes, positions=None):
    """(soft_cap float (0: none), sinks, alibi, key_pos, query_pos pointers (None: NULL)), checked."""
    from .attention_reference import check_features

    f = check_features(None, sinks, soft_cap, alibi_slopes, num_q_heads=q.shape[2], device=q.device)
    if f.alibi_slopes is not None and positions is None:
        raise ValueError("ALiBi on the host kernel needs the columns' positions (key_pos, query_pos)")
    key_pos, query_pos = positions if f.alibi_slopes is not None else (None, None)
    return (0.0 if f.soft_cap is None else f.soft_cap,
            *(None if t is None else t.data_ptr() for t in (f.sinks, f.alibi_slopes, key_pos, query_pos)))


# ------------------------------------------------------------------ planned calls
#
# The per-layer call of a tree step, split by lifetime as the C side's structs
# are: ``HostLayer`` (a layer's cache views, scale and features: built once per
# engine layer and memoized by its values) and ``HostStep`` (a plan's blocks,
# mask and workspace: built once per TreeAttentionPlan). The layer call itself
# then converts four pointers (a call that rebuilt and re-checked everything
# spent about 15 us of Python per layer, more than the kernel at small contexts).


class _LayerArgs(ctypes.Structure):
    _fields_ = [("k", ctypes.c_void_p), ("k_sblk", ctypes.c_int64), ("k_stok", ctypes.c_int64),
                ("k_shead", ctypes.c_int64), ("k_sdim", ctypes.c_int64),
                ("v", ctypes.c_void_p), ("v_sblk", ctypes.c_int64), ("v_stok", ctypes.c_int64),
                ("v_shead", ctypes.c_int64), ("v_sdim", ctypes.c_int64),
                ("num_blocks", ctypes.c_int64), ("Hq", ctypes.c_int64), ("Hkv", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("D", ctypes.c_int64),
                ("scale", ctypes.c_float), ("soft_cap", ctypes.c_float),
                ("sinks", ctypes.c_void_p), ("alibi", ctypes.c_void_p)]


class _StepArgs(ctypes.Structure):
    _fields_ = [("B", ctypes.c_int64), ("T", ctypes.c_int64), ("nb", ctypes.c_int64),
                ("blocks", ctypes.c_void_p), ("bias", ctypes.c_void_p), ("key_pos", ctypes.c_void_p),
                ("query_pos", ctypes.c_void_p), ("work", ctypes.c_void_p), ("threads", ctypes.c_int64),
                ("spans", ctypes.c_void_p)]


class HostLayer:
    """A layer's constant arguments: the K/V views [num_blocks, block_size,
    Hkv, D] float32, Hq, the scale and the checked features, as pointers and
    strides. It holds no tensor: every pointer it carries is part of its
    ``layer_key``, and each call passes the live tensors whose key it is, so
    what it points at is alive (and is what the caller passed) during the call."""

    __slots__ = ("args", "ref")

    def __init__(self, k_cache, v_cache, num_q_heads: int, scale: float, features):
        nblk, block_size, hkv, dim = k_cache.shape
        sinks, alibi = features.sinks, features.alibi_slopes
        self.args = _LayerArgs(k_cache.data_ptr(), *k_cache.stride(), v_cache.data_ptr(), *v_cache.stride(),
                               nblk, num_q_heads, hkv, block_size, dim, float(scale),
                               0.0 if features.soft_cap is None else features.soft_cap,
                               None if sinks is None else sinks.data_ptr(),
                               None if alibi is None else alibi.data_ptr())
        self.ref = ctypes.byref(self.args)


_LAYERS: dict = {}
_MAX_LAYERS = 4096  # engines have one entry per attention layer; tests make many caches (small entries)


def layer_key(q, k_cache, v_cache, scale, window, sinks, soft_cap, alibi_slopes) -> tuple:
    """What a layer's planned call is made of (``TreeAttentionPlan.run``'s
    arguments but the step's): equal keys, equal arguments, so the memo of
    ``cached_layer`` / ``host_layer`` needs no check per call. The features
    enter as given (the checked ones are memoized with the key): a tensor's
    pointer, dtype and shape, a number's value."""
    return (q.dtype, q.is_cpu, q.shape[2], q.shape[3], k_cache.data_ptr(), k_cache.shape, k_cache.stride(),
            k_cache.dtype, k_cache.is_cpu, v_cache.data_ptr(), v_cache.shape, v_cache.stride(), v_cache.dtype,
            v_cache.is_cpu, scale, window, soft_cap, *(_tensor_key(t) for t in (sinks, alibi_slopes)))


def _tensor_key(t) -> tuple | None:
    if not isinstance(t, torch.Tensor):
        return None if t is None else (type(t),)  # not a tensor: check_features refuses it (never memoized)
    return t.data_ptr(), t.dtype, t.shape, t.stride(), t.is_cpu


def cached_layer(key: tuple):
    """(HostLayer, checked features) made for ``key`` before, or None: check
    the inputs, then ``host_layer``."""
    return _LAYERS.get(key)


def host_layer(key: tuple, k_cache, v_cache, num_q_heads: int, scale: float, features) -> tuple:
    """Make and memoize ``key``'s (HostLayer, features); the caller has checked
    the inputs (``supports``, check_features): only checked layers are memoized."""
    if len(_LAYERS) >= _MAX_LAYERS:
        _LAYERS.clear()
    entry = _LAYERS[key] = (HostLayer(k_cache, v_cache, num_q_heads, scale, features), features)
    return entry


class HostStep:
    """A plan's per-step arguments: blocks [B, nb] int64 and bias [B, 1, 1, T,
    nb * block_size] float32 contiguous (the torch plan's, a window folded in),
    ALiBi's positions (key [B, S], query [B, T] float32, or None) and a
    workspace for head dim ``dim``."""

    __slots__ = ("args", "ref", "_keep")

    def __init__(self, blocks: torch.Tensor, bias: torch.Tensor, block_size: int, dim: int, positions=None):
        batch, nodes = bias.shape[0], bias.shape[3]
        if blocks.dtype != torch.int64 or not blocks.is_contiguous() or not bias.is_contiguous():
            raise ValueError("HostStep needs contiguous int64 blocks and a contiguous bias (the torch plan's)")
        threads = _lib.spec_tree_attention_threads()  # the workspace is sized for these, the call runs on them
        work = torch.empty(_lib.spec_tree_attention_workspace(blocks.shape[1], block_size, dim), dtype=torch.float32)
        key_pos, query_pos = positions if positions is not None else (None, None)
        spans = torch.empty(batch, 2, dtype=torch.int64)  # what each request's rows see: found once per plan
        _lib.spec_tree_attention_spans(bias.data_ptr(), batch, nodes, bias.shape[-1], spans.data_ptr())
        self.args = _StepArgs(batch, nodes, blocks.shape[1], blocks.data_ptr(), bias.data_ptr(),
                              None if key_pos is None else key_pos.data_ptr(),
                              None if query_pos is None else query_pos.data_ptr(), work.data_ptr(), threads,
                              spans.data_ptr())
        self.ref = ctypes.byref(self.args)
        self._keep = (blocks, bias, key_pos, query_pos, work, spans)


def token_stride(x: torch.Tensor) -> int | None:
    """Floats between consecutive tokens of a [B, T, H, D] float32 tensor
    whose H * D are contiguous per token and whose tokens are evenly spaced
    (a contiguous tensor, or rows of an engine's fused qkv); None otherwise."""
    batch, nodes, heads, dim = x.shape
    s0, s1, s2, s3 = x.stride()
    if s3 != 1 or s2 != dim or (batch > 1 and s0 != nodes * s1) or s1 < heads * dim:
        return None
    return s1


def run_planned(layer: HostLayer, step: HostStep, q: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One layer's tree rows: q [B, T, Hq, D] float32 on the host (any
    ``token_stride``; others are copied) -> out, when it is a float32 tensor
    of that shape with a token stride, else a new contiguous one."""
    q_stok = token_stride(q)
    if q_stok is None:
        q = q.contiguous()
        q_stok = q.shape[2] * q.shape[3]
    o_stok = None if out is None or out.dtype != torch.float32 or out.shape != q.shape or not out.is_cpu \
        else token_stride(out)
    if o_stok is None:
        out = torch.empty(q.shape, dtype=torch.float32)
        o_stok = q.shape[2] * q.shape[3]
    _lib.spec_tree_attention_run(layer.ref, step.ref, q.data_ptr(), q_stok, out.data_ptr(), o_stok)
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
    return (_lib is not None and isinstance(k_cache, torch.Tensor) and isinstance(v_cache, torch.Tensor)
            and k_cache.device.type == "cpu" and k_cache.dtype == v_cache.dtype == torch.float32
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
