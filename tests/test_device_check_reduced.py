"""ci/device_check.sh --reduced runs end to end on the CPU (TRITON_INTERPRET=1),
so the GPU check script keeps working between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from test_sglang_spec_tree_loader import find_spec_tree

ROOT = Path(__file__).resolve().parents[1]


def test_reduced_device_check(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, TRITON_INTERPRET="1")
    spec_tree = find_spec_tree()
    if spec_tree:  # SGLang's kernels join in when a copy of spec_tree.py is around
        env["SGLANG_SPEC_TREE_PY"] = spec_tree
    proc = subprocess.run(
        ["bash", str(ROOT / "ci" / "device_check.sh"), "--reduced"], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert (tmp_path / "device_check.log").stat().st_size > 0
    assert report["env"]["mode"] == "reduced"
    assert "section_errors" not in report, report.get("section_errors")
    triton = report["correctness"]["triton"]
    assert triton["failed"] == 0 and triton["passed"] > 50, triton
    assert {"select/triton", "build/triton", "from_parents/triton", "verify/triton", "move/triton",
            "block_tree/triton", "recurrent_gdn/triton", "recurrent_ssm/triton", "recurrent_conv/triton"} <= set(
        triton["counts"])
    assert triton["accepted_draft_tokens"] > 0  # the verify cases accept something
    assert report["bench"]["rows"] and "ours_by_mode" in report["headline"]["eager_us"]
    bench = report["bench"]  # the harness's tree-ops point: every op of both impls, none raising
    assert not [r for r in bench["rows"] if "error" in r] and "errors" not in bench, bench.get("errors")
    for impl in ("torch", "triton"):
        ops = {r["op"] for r in bench["rows"] if r["impl"] == impl}
        assert {"select", "verify", "verify_sampling", "move_kv", "build_FULL_MASK_nofill", "build_PARENT_POINTER"} <= ops
    attention = report["tree_attention"]  # issue #17's section: every part runs
    assert attention["failed"] == 0 and attention["correctness"]["passed"] >= 3, attention["correctness"]
    rows = attention["sweep"]["rows"]
    assert len(rows) == 4 and all(r["ok"] and r["time_us"] > 0 and "other_time_us" in r for r in rows), rows
    assert {r["kernel"] for r in rows} == {"split", "single"}  # batch 1 splits, batch 2 fills the pretend GPU
    assert attention["copy"][0]["gbps"] > 0
    assert {"b1_t4_ctx40", "ratio_t4_t1_b1_ctx40", "ratio_t4_t1_b2_ctx40"} <= set(attention["targets"])
    assert {r["mode"] for r in attention["modes"]["rows"]} == {"PARENT_POINTER", "QLEN_ONLY"}
    assert all(r["ok"] for r in attention["modes"]["rows"])
    tune = attention["tune"]["points"][0]
    assert {"auto", "single", "split2"} <= set(tune["times_us"]) and "best" in tune, tune
    own = report["graphs"]  # issues #37 / #49: the step's own ops (V2's device step included) without graph breaks
    assert own["failed"] == 0 and own["v2_step_torch"]["ok"] and own["verify_tail_torch"]["ok"], own
    # issue #49 item 3: a verify layer's tree rows and a draft level's attention, metadata from persistent buffers
    assert own["verify_attention_torch"]["ok"] and own["draft_level_attention_torch"]["ok"], own
    assert own["block_tree_torch"]["ok"], own
    assert own["recurrent_tree_torch"]["ok"], own  # a hybrid layer's tree step: conv, GDN, Mamba2, commit  # issue #52: DDTree's drafting after the block forward
    graphs = report["sglang_graphs"]  # issue #38: TARGET_VERIFY capture / replay stand-in, every mask mode
    assert graphs["failed"] == 0 and graphs["passed"] == 3 and all(r["replays"] == 2 for r in graphs["rows"]), graphs
    if spec_tree:
        assert report["sglang_crosscheck"]["failed"] == 0 and report["sglang_crosscheck"]["passed"] > 0
        assert "sglang" in report["headline"]["eager_us"]
