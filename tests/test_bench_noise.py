"""The bench's noise rules and summary (spec_plugins.bench_noise) on hand-built rows and machine readings."""

from __future__ import annotations

import os

import pytest

from spec_plugins import bench_noise as bn
from spec_plugins import vllm_bench as vb


def test_spread_is_range_over_median():
    assert bn.spread([10.0, 12.0, 11.0]) == pytest.approx(2 / 11)
    assert bn.spread([10.0]) is None and bn.spread(None) is None


@pytest.mark.parametrize("ratio,rounds,open_", [
    (1.10, [1.08, 1.10, 1.12], False),  # rounds 0.04 apart, 0.10 from parity: resolved
    (1.03, [0.98, 1.03, 1.09], True),  # rounds 0.11 apart on both sides of 1
    (0.80, [0.70, 0.80, 0.95], True),  # 0.25 apart > 0.20 gap
    (1.00, [1.00, 1.00], False),  # no disagreement at all
    (1.05, [1.05], False),  # one round: nothing to compare
])
def test_a_ratio_is_unresolved_when_its_rounds_disagree_by_more_than_its_gap(ratio, rounds, open_):
    assert bn.unresolved(ratio, rounds) is open_
    assert bn.marked(ratio, rounds).endswith("~") is open_


def test_busy_warnings_read_load_and_vllm_processes_on_our_cpus():
    assert bn.busy_warnings(0.4, {0, 1}, []) == []
    busy = bn.busy_warnings(1.7, {0, 1}, [])
    assert len(busy) == 1 and "load average 1.70 on 2 CPUs" in busy[0]
    shared = bn.busy_warnings(0.0, {0, 1}, [(4242, {1, 2}), (77, {5})])
    assert len(shared) == 1 and "pid 4242" in shared[0] and "[1]" in shared[0]


def test_other_vllm_processes_finds_a_vllm_process_and_skips_ours():
    """A vLLM process of someone else (here: an orphan whose command line names
    vllm) is found with its CPUs; this process and its children (our own engine
    cores) are not."""
    import signal
    import subprocess
    import sys

    sleeper = f"{sys.executable} -c 'import time; time.sleep(60)' vllm-test-marker"
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "vllm-test-marker"])
    orphan = int(subprocess.run(["sh", "-c", f"{sleeper} >/dev/null 2>&1 & echo $!"], capture_output=True,
                                text=True, check=True).stdout)
    try:
        found = dict(bn.other_vllm_processes())
        assert orphan in found and found[orphan] == set(os.sched_getaffinity(orphan))
        assert os.getpid() not in found and ours.pid not in found
    finally:
        os.kill(orphan, signal.SIGKILL)
        ours.kill()
        ours.wait()


def row(config, conc, tps, rounds=None, shape=None, speedup=None, all_speedup=None, peer=None, all_peer=None,
        engine_chain=False, identical=True, budget=None):
    return {"config": config, "concurrency": conc, "temperature": 0.0, "tokens_per_s": tps, "kind": "eagle3",
            "all_tokens_per_s": rounds, "shape": shape, "speedup": speedup, "all_speedup": all_speedup,
            "vs_vllm_chain": peer, "all_vs_vllm_chain": all_peer, "engine_chain": engine_chain,
            "identical": identical, "budget_menu": budget}


def quiet_rows(identical=True, baseline_rounds=(20.0, 20.5, 21.0)):
    return [
        row("no-spec", 1, 20.5, list(baseline_rounds)),
        row("vllm eagle3 chain(5)", 1, 18.0, [18, 18.2, 17.9], (5, 1, 6), 0.88, [0.88, 0.89, 0.87], engine_chain=True),
        row("eagle3 chain(3)", 1, 22.0, [22, 22.1, 21.8], (3, 1, 4), 1.07, [1.06, 1.07, 1.08], 1.22, [1.21, 1.22, 1.23]),
        row("eagle3 tree(5,4,8)", 1, 19.0, [19, 19.3, 18.8], (5, 4, 8), 0.93, [0.92, 0.93, 0.94], 1.03,
            [0.99, 1.03, 1.08], identical=identical),
    ]


def test_summary_names_the_best_the_tree_identity_and_a_quiet_verdict():
    lines = bn.summary_lines(quiet_rows())
    assert len(lines) == 4
    assert lines[0] == "best of ours: eagle3 chain(3) at 1.07x no speculation, 1.22x vLLM's chain (concurrency 1)"
    assert lines[1] == "eagle3 tree(5,4,8) vs vLLM's own chain: 1.03~x at concurrency 1"  # rounds 0.99..1.08
    assert lines[2] == "outputs: every greedy output token-identical to no speculation (4 rows)"
    assert lines[3].startswith("noise: quiet: no speculation's rounds spread 5% at concurrency 1; 1 of 5 ratios")


def test_summary_says_when_outputs_differ_and_when_the_baseline_drifted():
    lines = bn.summary_lines(quiet_rows(identical=False, baseline_rounds=(15.0, 20.5, 21.0)))
    assert lines[2] == "outputs: DIFFER from no speculation for eagle3 tree(5,4,8)"
    assert lines[3].startswith("noise: NOISY: no speculation's rounds spread 29% at concurrency 1")
    warnings = bn.noise_warnings(quiet_rows(baseline_rounds=(15.0, 20.5, 21.0)))
    assert len(warnings) == 1 and "spread by 29% (> 20%)" in warnings[0]
    assert bn.noise_warnings(quiet_rows()) == []


def test_a_sequential_run_has_no_noise_verdict():
    rows = [row("no-spec", 1, 20.0, [20.0]), row("eagle3 chain(3)", 1, 22.0, [22.0], (3, 1, 4), 1.1)]
    assert bn.noise_verdict(rows).startswith("noise: unknown")


def test_table_shows_the_spread_and_marks_unresolved_ratios():
    text = vb.table([{**r, "tau": None} for r in quiet_rows()])
    tree_line = next(line for line in text.splitlines() if line.startswith("| eagle3 tree"))
    assert "| 19.0 (3%) | 0.93 | 1.03~ |" in tree_line
    chain_line = next(line for line in text.splitlines() if line.startswith("| eagle3 chain(3)"))
    assert "| 1.07 | 1.22 |" in chain_line


def test_report_puts_the_summary_above_the_table(tmp_path, monkeypatch):
    monkeypatch.setattr(vb, "plot", lambda rows, path: None)  # the plots are the engine test's (matplotlib)
    monkeypatch.setattr(vb, "plot_concurrency", lambda rows, path: None)
    rows = [{**r, "tau": None} for r in quiet_rows()]
    vb.write_report(rows, {"m": 1}, tmp_path, ["line one", "line two"])
    assert (tmp_path / "results.md").read_text().startswith("- line one\n- line two\n\n| config |")
