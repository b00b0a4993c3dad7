"""Section [env] (versions, device, tools, the CUDA kernels' build), SGLang's
kernels for the comparisons, and the closing [summary]."""

from __future__ import annotations

import json
import os
import platform
import threading
import time

import torch

from spec_tree_kernels import cuda_build, cuda_ops

from .plumbing import Budget, Report, find_tool

BUILD_LEAVES_S = 200  # the build may run until this much of the budget is left


def record_environment(report: Report, reduced: bool, budget: Budget) -> dict:
    """Python, torch, Triton, device and tools into the report's ``env``."""
    env = report.data.setdefault("env", {})
    env.update(
        mode="reduced" if reduced else "full",
        python=platform.python_version(),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        device=torch.cuda.get_device_name(0) if not reduced else platform.machine(),
        triton_interpret=os.environ.get("TRITON_INTERPRET"),
        budget_s=budget.left(),
        nvcc=None,
        compute_sanitizer=find_tool("compute-sanitizer"),
    )
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:
        env["triton"] = f"unavailable: {exc}"
    report.log("device_check:", json.dumps(env))
    report.save()
    return env


def start_cuda_build(env: dict):
    """Build the CUDA kernels in a thread (a minute of nvcc + c++) while the
    Triton checks run. Returns (thread, state dict it fills)."""
    env["nvcc"] = cuda_build.find_nvcc()
    build_state: dict = {}

    def build():
        t0 = time.time()
        build_state["available"] = cuda_ops.available()
        build_state["seconds"] = round(time.time() - t0, 1)

    build_thread = threading.Thread(target=build, daemon=True)
    build_thread.start()
    return build_thread, build_state


def finish_cuda_build(env: dict, report: Report, budget: Budget, build_thread, build_state: dict) -> bool:
    """Wait for the build (leaving the budget's last 200 s); record it; True when the kernels load."""
    build_thread.join(timeout=max(1.0, budget.left() - BUILD_LEAVES_S))
    env["cuda_kernels"] = dict(
        available=build_state.get("available", False),
        build_seconds=build_state.get("seconds", "still building"),
        backend=cuda_ops.backend_name(),
        error=cuda_ops.load_error(),
    )
    report.log("cuda kernels:", env["cuda_kernels"])
    report.save()
    return bool(build_state.get("available"))


def load_sglang_kernels(report: Report):
    """(SGLang's spec-tree kernels, their loader module), or None (why: in the report)."""
    try:
        import sglang_spec_tree

        if sglang_spec_tree.available():
            return (sglang_spec_tree.load(), sglang_spec_tree)
    except Exception as exc:
        report.data["sglang_load_error"] = f"{type(exc).__name__}: {exc}"
    return None


def write_summary(report: Report, failed: int) -> None:
    report.data["summary"] = dict(
        correctness_failed=failed,
        sanitizer_clean={k: v.get("clean") for k, v in report.data.get("sanitizer", {}).items() if isinstance(v, dict)},
        headline=(report.data.get("headline", {}).get("graph_us") or {}).get("ratio_sglang_over_ours"),
        attention_targets=report.data.get("tree_attention", {}).get("targets"),
    )
    report.log("summary:", json.dumps(report.data["summary"]))
    report.save()
