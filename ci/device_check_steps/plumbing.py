"""The device check's plumbing: the report, the time budget, pass/fail tallies,
byte-exact comparison, finding tools and the checkout's kernels.

Imports neither spec_tree_kernels nor Triton: ci/device_check.py uses it
before deciding whether Triton runs interpreted.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
CI = ROOT / "ci"
MAX_FAILURE_DETAILS = 12


class Report:
    """The JSON result and the log, both rewritten / appended as we go."""

    def __init__(self, out: Path, name: str = "device_check"):
        out.mkdir(parents=True, exist_ok=True)
        self.json_path = out / f"{name}.json"
        self.log_path = out / f"{name}.log"
        self._log = open(self.log_path, "w", buffering=1)
        self.start = time.time()
        self.data: dict = {"script": "ci/device_check.py", "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def log(self, *parts) -> None:
        line = f"[{time.time() - self.start:7.1f}s] " + " ".join(str(p) for p in parts)
        print(line, flush=True)
        self._log.write(line + "\n")

    def log_only(self, text: str) -> None:
        """Into the log file, not the console (a child's long output)."""
        self._log.write(text)

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.time() - self.start, 1)
        tmp = self.json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.json_path)


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.time() + seconds

    def left(self) -> float:
        return self.deadline - time.time()


@dataclass
class CheckRun:
    """What the sections of one device check share. device: CUDA, or the CPU
    in reduced mode; impls: the implementations timed side by side (torch,
    triton, and cuda once its build loaded); sgl: SGLang's kernels (module,
    ci/sglang_spec_tree) or None."""

    report: Report
    budget: Budget
    reduced: bool
    device: torch.device
    impls: list
    sgl: tuple | None = None


class Tally:
    """Pass/fail counts per key ("build/cuda") and the first failures."""

    def __init__(self):
        self.counts: dict[str, dict[str, int]] = {}
        self.failures: list[dict] = []

    def add(self, key: str, ok: bool, **detail) -> None:
        entry = self.counts.setdefault(key, {"pass": 0, "fail": 0})
        entry["pass" if ok else "fail"] += 1
        if not ok and len(self.failures) < MAX_FAILURE_DETAILS:
            self.failures.append(dict(key=key, **detail))

    def failed(self) -> int:
        return sum(v["fail"] for v in self.counts.values())

    def passed(self) -> int:
        return sum(v["pass"] for v in self.counts.values())

    def as_dict(self) -> dict:
        return {"passed": self.passed(), "failed": self.failed(), "counts": self.counts, "failures": self.failures}


def guarded(report: Report, name: str, fn, *args, **kwargs):
    """Run one section; an exception is recorded, and the next section still runs."""
    try:
        return fn(*args, **kwargs)
    except Exception:
        report.data.setdefault("section_errors", {})[name] = traceback.format_exc(limit=6)[-3000:]
        report.log(f"section {name} raised:", traceback.format_exc(limit=6))
        report.save()
        return None


def import_kernels():
    """spec_tree_kernels from this checkout: installed (editable) or loaded from kernels/."""
    try:
        import spec_tree_kernels

        if Path(spec_tree_kernels.__file__).resolve().parent == ROOT / "kernels":
            return spec_tree_kernels
        for name in [m for m in sys.modules if m == "spec_tree_kernels" or m.startswith("spec_tree_kernels.")]:
            del sys.modules[name]  # another checkout's copy: use ours
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location(
        "spec_tree_kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["spec_tree_kernels"] = module
    spec.loader.exec_module(module)
    return module


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes: byte-exact, as the impls must agree."""
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(as_bytes(a), as_bytes(b))


def first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return f"dtype/shape {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    x, y = as_bytes(a).cpu(), as_bytes(b).cpu()
    idx = int(torch.nonzero(x != y)[0, 0]) // max(1, a.element_size())
    return f"first differing element {idx}: {a.reshape(-1)[idx].item()} vs {b.reshape(-1)[idx].item()}"


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    patterns = [f"/usr/local/cuda*/bin/{name}", f"/usr/local/cuda*/compute-sanitizer/{name}", f"/opt/nvidia/*/{name}",
                f"/opt/nvidia/*/*/{name}"]  # fmt: skip
    for pattern in patterns:
        hits = sorted(glob.glob(pattern), reverse=True)
        if hits:
            return hits[0]
    return None
