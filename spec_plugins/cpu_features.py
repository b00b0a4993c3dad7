"""The CPU features a run saw, as one line for the CI log (issue #50 item 1).

vLLM-CPU picks kernels by CPU: on x86 with AMX tiles it gives MLA layers its
AMX_MLA backend (bf16 weights only) and stores bf16 K and V in AMX's tiles;
with AVX-512 or only AVX2 it takes other paths (CPU_MLA, the "vec" layouts).
ci/test.sh prints this line first, so a result can be read against the machine:

    cpu: AMD EPYC (x86_64, 2 cpus) avx2 avx512f avx512_bf16 no-amx

Read from /proc/cpuinfo's flags (Linux); ``describe`` parses any cpuinfo text.
Run: ``python3 -m spec_plugins.cpu_features`` from the repository (standard library only, no venv
needed); the host-kernel bench (``spec_plugins.kernel_bench.cpu_attention``) prints the same line.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

# (flag as /proc/cpuinfo names it): printed as the flag, or "no-<flag>" when absent
VECTOR_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16")
# AMX: "no-amx" without tiles, else every AMX flag present (amx_tile, amx_bf16, amx_int8, amx_fp16, ...)
AMX_TILE = "amx_tile"


def cpu_flags(cpuinfo: str) -> set[str]:
    """The first processor's feature flags ("flags" on x86, "Features" on Arm)."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def cpu_model(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("model name", "Model", "cpu model") and value.strip():
            return " ".join(value.split())
    return "unknown model"


def describe(cpuinfo: str | None, machine: str | None = None) -> str:
    """One line: ``cpu: <model> (<machine>, <n> cpus) <features>``; ``cpuinfo`` None: not readable."""
    machine = machine or platform.machine() or "unknown machine"
    if cpuinfo is None:
        return f"cpu: unknown ({machine}, no /proc/cpuinfo)"
    flags = cpu_flags(cpuinfo)
    cpus = sum(1 for line in cpuinfo.splitlines() if line.partition(":")[0].strip() == "processor")
    features = [f if f in flags else f"no-{f}" for f in VECTOR_FLAGS]
    amx = sorted(f for f in flags if f.startswith("amx_"))
    features += amx if AMX_TILE in flags else ["no-amx"]
    return f"cpu: {cpu_model(cpuinfo)} ({machine}, {cpus} cpus) {' '.join(features)}"


def read_cpuinfo(path: str = "/proc/cpuinfo") -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def main() -> int:
    print(describe(read_cpuinfo()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
