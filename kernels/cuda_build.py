"""Building the CUDA tree kernels: finding the toolchain, compiling, caching.

``find_nvcc`` looks for the CUDA compiler; ``compile_backend`` builds (or
reuses the cached build of) one backend of ``cuda_backends`` in this process:
the torch extension through ``torch.utils.cpp_extension.load`` (needs ninja),
or ``tree_ops.cu`` alone by ``nvcc -shared`` (``build_shared_library``) for
ctypes. ``build_emulated_library`` / ``emulated_backend`` compile the kernels
for the host with a C++ compiler (``cuda_emulation.h``), for the CPU tests.

Builds go to ``$SPEC_TREE_KERNELS_BUILD_DIR`` (default
``~/.cache/spec_tree_kernels``; the extension in its ``extension/``), named
by a digest of the sources and flags, so a changed source rebuilds and an
unchanged one is reused. When and where a build runs (once per process, in a
killable child, behind the build lock) is ``cuda_ops``' part.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import torch

from .cuda_backends import CtypesBackend, ExtensionBackend

CSRC = Path(__file__).resolve().parent / "csrc"
KERNEL_SOURCE = CSRC / "tree_ops.cu"
BINDING_SOURCE = CSRC / "tree_ops_binding.cpp"
HEADERS = (CSRC / "tree_ops.h", CSRC / "cuda_emulation.h")


def _sources_digest(*paths: Path, extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for path in paths:
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cache_dir() -> Path:
    """Where builds go: ``$SPEC_TREE_KERNELS_BUILD_DIR``, default ``~/.cache/spec_tree_kernels``."""
    root = os.environ.get("SPEC_TREE_KERNELS_BUILD_DIR") or os.path.join(Path.home(), ".cache", "spec_tree_kernels")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def extension_dir() -> Path:
    """Where ``cpp_extension.load`` builds (ours, not torch's default, so the
    stale-lock check knows where torch's lock file lives)."""
    path = cache_dir() / "extension"
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


def _build_extension(nvcc: str) -> ExtensionBackend:
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:  # torch looked before we did; point it at our nvcc's toolkit
        cpp_extension.CUDA_HOME = str(Path(nvcc).resolve().parent.parent)
    if shutil.which("ninja") is None:  # a venv's ninja is not on PATH unless the venv is activated
        for folder in (Path(sys.executable).parent, Path(getattr(_ninja_module(), "BIN_DIR", "") or "/nonexistent")):
            if (folder / "ninja").exists():
                os.environ["PATH"] = f"{folder}{os.pathsep}{os.environ.get('PATH', '')}"
                break
    build_dir = str(extension_dir())
    module = cpp_extension.load(
        name="spec_tree_kernels_cuda",
        sources=[str(BINDING_SOURCE), str(KERNEL_SOURCE)],
        extra_include_paths=[str(CSRC)],
        extra_cflags=["-O3"],
        extra_cuda_cflags=["-O3"],
        build_directory=build_dir,
        verbose=os.environ.get("SPEC_TREE_KERNELS_VERBOSE_BUILD") == "1",
    )
    return ExtensionBackend(module)


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
    digest = _sources_digest(KERNEL_SOURCE, *HEADERS, extra=digest_key)
    library = (out_dir or cache_dir()) / f"lib{name}_{digest}.so"
    if not library.exists():
        tmp = library.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([compiler, *flags, "-I", str(CSRC), str(KERNEL_SOURCE), "-o", str(tmp)], check=True,
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


def emulated_backend(out_dir: Path | None = None) -> CtypesBackend:
    """The kernels compiled for the host (one thread per CUDA thread): pass as
    ``backend=`` to the ops of ``cuda_ops``, with CPU tensors."""
    return CtypesBackend(build_emulated_library(out_dir=out_dir), emulated=True)


def compile_backend(nvcc: str, choice: str):
    """Build (or reuse the cached build of) one backend in this process.

    choice: ``auto`` (the extension, else ctypes) | ``extension`` | ``ctypes``;
    RuntimeError with every attempt's error when none builds."""
    errors = []
    if choice in ("auto", "extension"):
        try:
            return _build_extension(nvcc)
        except Exception as exc:  # no ninja, header trouble, compiler error
            errors.append(f"extension: {type(exc).__name__}: {str(exc)[-2000:]}")
    if choice in ("auto", "ctypes"):
        try:
            return CtypesBackend(build_shared_library(nvcc, _device_arch_flags()))
        except subprocess.CalledProcessError as exc:
            errors.append(f"ctypes: nvcc failed: {exc.stderr[-2000:]}")
        except Exception as exc:
            errors.append(f"ctypes: {type(exc).__name__}: {exc}")
    raise RuntimeError("; ".join(errors) or f"unknown SPEC_TREE_KERNELS_CUDA_BACKEND={choice!r}")
