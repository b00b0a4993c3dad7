"""The order of the device check's sections (ci/device_check.py lists them),
each guarded: one that raises is recorded under section_errors and counts
as a failure, and the next still runs."""

from __future__ import annotations

from pathlib import Path

import torch

from .attention import run_tree_attention
from .bench import run_bench
from .correctness import run_correctness
from .environment import finish_cuda_build, load_sglang_kernels, record_environment, start_cuda_build, write_summary
from .graphs import run_graphs
from .plumbing import Budget, CheckRun, Report, guarded
from .sanitizer import run_sanitizer
from .sglang_crosscheck import run_sglang_crosscheck
from .sglang_graphs import run_sglang_graphs


def run_sections(out: Path, reduced: bool, budget_s: float, skip: set[str]) -> int:
    """Every section not in ``skip``; returns the exit status (1 when a check failed)."""
    report, budget = Report(out), Budget(budget_s)
    env = record_environment(report, reduced, budget)
    build = None if reduced else start_cuda_build(env)
    run = CheckRun(report, budget, reduced, torch.device("cpu" if reduced else "cuda"), impls=["torch", "triton"],
                   sgl=load_sglang_kernels(report))  # fmt: skip
    failed = triton_sections(run, skip)
    if build is not None and finish_cuda_build(env, report, budget, *build):
        run.impls.append("cuda")
        failed += correctness(run, skip, "cuda", min_left=200)
    if "sanitizer" not in skip and not reduced:
        report.log("compute-sanitizer")
        tools = [("memcheck", ",".join(i for i in ("cuda", "triton") if i in run.impls))]
        if "cuda" in run.impls:
            tools.append(("racecheck", "cuda"))
        guarded(report, "sanitizer", run_sanitizer, run, tools)
    if "bench" not in skip:
        report.log("bench")
        guarded(report, "bench", run_bench, run)
    if "graphs" not in skip:
        report.log("graphs (issue #37)")
        graphs_failed = guarded(report, "graphs", run_graphs, run)
        failed += 1 if graphs_failed is None else graphs_failed
    if "attention" not in skip:
        report.log("tree attention (issue #17)")
        attention_failed = guarded(report, "attention", run_tree_attention, run)
        failed += 1 if attention_failed is None else attention_failed
    if "sglang_graphs" not in skip:
        report.log("SGLang TARGET_VERIFY CUDA graph (issue #38)")
        graphs_failed = guarded(report, "sglang_graphs", run_sglang_graphs, run)
        failed += 1 if graphs_failed is None else graphs_failed
    write_summary(report, failed)
    return 1 if failed else 0


def triton_sections(run: CheckRun, skip: set[str]) -> int:
    """Triton against the reference and SGLang's kernels against ours (while the CUDA build runs)."""
    failed = correctness(run, skip, "triton", min_left=0 if run.reduced else 300)
    if "sglang" not in skip:
        run.report.log("sglang cross-check")
        guarded(run.report, "sglang", run_sglang_crosscheck, run, min_left=0 if run.reduced else 270)
        failed += run.report.data.get("sglang_crosscheck", {}).get("failed", 0)
    return failed


def correctness(run: CheckRun, skip: set[str], impl: str, min_left: float) -> int:
    """``impl`` against the reference; failures (1 when the section raised)."""
    if "correctness" in skip:
        return 0
    run.report.log(f"correctness: {impl} vs torch")
    tally = guarded(run.report, f"correctness_{impl}", run_correctness, run, [impl], impl, min_left=min_left)
    return tally.failed() if tally else 1
