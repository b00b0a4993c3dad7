"""The engine-free acceptance benchmark runs end to end (tiny settings) and
reports lossless rows with the fields the README table is built from."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()


def test_acceptance_bench_smoke(tmp_path):
    from spec_plugins import acceptance_bench

    rc = acceptance_bench.main(["--out", str(tmp_path), "--heads", "eagle3", "--shapes", "3,1,4", "3,2,6",
                                "--num-chat", "1", "--num-humaneval", "0", "--max-new-tokens", "12",
                                "--threads", "1"])
    assert rc == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert len(res["rows"]) == 2 and all(r["lossless"] for r in res["rows"])
    assert (tmp_path / "acceptance.png").stat().st_size > 0 and (tmp_path / "results.md").read_text()
