"""Section [sanitizer]: compute-sanitizer memcheck over a small run of every
CUDA and Triton kernel, racecheck over the CUDA kernels. Each tool runs a
child process of ci/device_check.py (--sanitizer-child) that checks a few
correctness cases under it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import torch

from .correctness import check_case
from .plumbing import CI, CheckRun, Tally, find_tool

# shapes of FULL_CASES: the Triton kernels are already in the cache (compiling under the sanitizer is slow)
CHILD_CASES = [(4, 3, 8, "mixed"), (3, 1, 4, "ties"), (8, 4, 32, "underflow"), (1, 6, 7, "onehot")]
CHILD_BATCH = 3
OPTION_RETRIED_WITHOUT = ["--report-api-errors", "no"]  # new-ish: older sanitizers reject it


def sanitizer_child(impls: str) -> int:
    """A small run of every kernel of ``impls`` (comma list; run under compute-sanitizer)."""
    impls = [i for i in impls.split(",") if i]
    if "cuda" in impls:
        from spec_tree_kernels import cuda_ops

        if not cuda_ops.available():
            print("sanitizer child: CUDA kernels unavailable:", cuda_ops.load_error())
            return 2
    tally = Tally()
    for case in CHILD_CASES:
        check_case(tally, impls, case, CHILD_BATCH, False, torch.device("cuda"))
    torch.cuda.synchronize()
    print("sanitizer child:", json.dumps(tally.as_dict()))
    return 0 if tally.failed() == 0 else 1


def run_sanitizer(run: CheckRun, impls_by_tool) -> None:
    """Each (tool, impls) of ``impls_by_tool`` while the budget allows (at
    most 180 s each, 150 s of the budget left for what follows)."""
    section = run.report.data.setdefault("sanitizer", {})
    tool = find_tool("compute-sanitizer")
    section["compute_sanitizer"] = tool
    if tool is None:
        section["skipped"] = "compute-sanitizer not found on PATH or under /usr/local/cuda*/bin"
        run.report.save()
        return
    for name, impls in impls_by_tool:
        timeout = min(180.0, run.budget.left() - 150)
        if timeout < 45:
            section[name] = {"skipped": f"only {run.budget.left():.0f}s of the time budget left"}
            continue
        entry, output = sanitize(tool, name, impls, timeout)
        section[name] = entry
        run.report.log(f"  {name} ({impls}): rc={entry['rc']} {entry['summary']} in {entry['seconds']}s")
        run.report.log_only(f"----- {name} output (tail) -----\n{output[-6000:]}\n----- end {name} -----\n")
        run.report.save()


def sanitize(tool: str, name: str, impls: str, timeout: float) -> tuple[dict, str]:
    """Run the child under ``tool --tool name``: (the report entry, its output)."""
    base = [tool, "--tool", name, "--error-exitcode", "97"]
    child = [sys.executable, str(CI / "device_check.py"), "--sanitizer-child", "--impls", impls]
    entry = {"impls": impls}
    for extra in (OPTION_RETRIED_WITHOUT, []):
        t0 = time.time()
        output, rc = run_child(base + extra + child, timeout)
        entry.update(rc=rc, seconds=round(time.time() - t0, 1),
                     command=" ".join(base + extra + ["<python> device_check.py --sanitizer-child"]))  # fmt: skip
        if not (extra and re.search(r"(unrecognized|unknown|invalid) option", output, re.I)):
            break
    entry.update(parse_sanitizer_output(output, rc))
    return entry, output


def run_child(command: list[str], timeout: float) -> tuple[str, int | str]:
    """(stdout + stderr, exit status or "timeout")."""
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        return proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout or ""
        return (partial.decode(errors="replace") if isinstance(partial, bytes) else partial), "timeout"


def parse_sanitizer_output(output: str, rc) -> dict:
    """summary lines, errors (the last ERROR SUMMARY count), the child's tally,
    and clean: exit 0 with 0 errors (memcheck) or 0 hazards (racecheck)."""
    summary = re.findall(r"(ERROR SUMMARY: \d+ errors?|RACECHECK SUMMARY: [^\n]*)", output)
    errors = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", output)]
    child_line = re.findall(r"sanitizer child: (\{.*\})", output)
    no_errors = bool(errors) and errors[-1] == 0
    return dict(
        summary=summary,
        errors=errors[-1] if errors else None,
        child_result=json.loads(child_line[-1]) if child_line else None,
        clean=rc == 0 and (no_errors or bool(re.search(r"RACECHECK SUMMARY: 0 hazards", output))),
    )
