"""Child process for tests/model/test_vllm_tree_v2.py: engines on vLLM-CPU's
Model Runner V2, which runs only under Triton's interpreter with a stand-in
for Triton's CPU backend (vLLM-CPU refuses V2 without one:
``vllm/triton_utils/importing.py``). vLLM reads that backend list when it is
first imported, so each run is a fresh process: the rest of the suite's
processes never see the stand-in.

    python v2_child.py SPEC_JSON  ->  one JSON line on stdout, prefixed "V2_RESULT "

SPEC_JSON: {"engines": [{"name", "kwargs" (LLM keyword overrides),
"fault": null | "skip_kv_move" | "census_regressions", "tree_impl": null |
"triton" | ..., "jobs": this engine's own jobs (optional), "block_oracle": null |
{"from": an earlier engine's name, BlockLogitsOracle options} (DDTree over
DFlash with oracle block logits)}], "jobs": [{"prompts": [...], "params":
[SamplingParams kwargs, one per prompt]}]}. Per engine: the token ids of
every job's outputs, finish reasons, the runner's counters, which model runner
class vLLM built.

With ``"force_async": true`` in SPEC_JSON, an engine given ``async_scheduling=True``
keeps it: vLLM-CPU's platform turns async scheduling off for every engine
(``CpuPlatform.check_and_update_config``: "async scheduling is not required on
CPU"), after VllmConfig's own async checks ran; ``keep_async_scheduling``
restores the user's value right after that hook, so vLLM picks its
AsyncScheduler and V2 runs two batches in flight as it does on a GPU.

With ``"census": true`` in SPEC_JSON (tests/model/test_vllm_v2_census.py), every
engine step is counted (``spec_plugins.host_reads_v2``: device->host reads,
staged and pageable uploads, aten ops and Triton launches, ours and the
engine's) and each engine's result gains "steps": one entry per step.
"""

from __future__ import annotations

import json
import os
import sys

from spec_plugins import cpu_v2_interpreter  # imports no engine

os.environ.update(cpu_v2_interpreter.ENV)  # before vLLM or Triton is imported


def keep_async_scheduling() -> None:
    """Undo vLLM-CPU's platform hook for async scheduling only (see the docstring)."""
    from vllm.platforms.cpu import CpuPlatform

    hook = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        wanted = vllm_config.scheduler_config.async_scheduling
        hook(cls, vllm_config)
        if wanted:
            vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def inject(fault: str | None) -> None:
    """Deliberate breaks that the identity tests and the census must catch
    (test-only; they last for the process: an engine with a fault goes last)."""
    if fault is None:
        return
    import spec_tree_kernels as stk

    if fault == "skip_kv_move":
        stk.move_accepted_kv = lambda *args, **kwargs: None
    elif fault == "census_regressions":  # what the census must see in our code: pageable uploads, a read
        import numpy as np
        import torch

        from spec_plugins.vllm_ext import runner_v2

        source = (  # compiled as runner_v2.py's: the census sees them in our code
            "def upload(host, device):\n"
            "    return torch.from_numpy(np.ascontiguousarray(host)).to(device, non_blocking=True)\n"
            "def plan_and_read(self, input_batch):\n"
            "    step = plan(self, input_batch)\n"
            "    if step is not None:\n"
            "        bool(step.invalid.any())\n"
            "    return step\n")
        found = {"torch": torch, "np": np, "plan": runner_v2.TreeRunnerV2Mixin._plan_tree_step}
        exec(compile(source, runner_v2.__file__, "exec"), found)
        runner_v2.upload = found["upload"]
        runner_v2.TreeRunnerV2Mixin._plan_tree_step = found["plan_and_read"]
    else:
        raise ValueError(f"unknown fault {fault!r}")


def install_block_oracle(llm, engine: dict, previous: dict):
    """``"block_oracle": {"from": ENGINE, ...}``: DDTree over DFlash with the drafter's
    block logits replaced by ``oracle_drafter.BlockLogitsOracle`` holding ENGINE's
    (an earlier no-speculation engine's) greedy continuations."""
    from oracle_drafter import BlockLogitsOracle

    options = dict(engine["block_oracle"])
    source = previous[options.pop("from")]
    refs = {tuple(o["prompt"]): o["prompt"] + o["tokens"] for job in source["jobs"] for o in job}
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    return BlockLogitsOracle(refs, **options).install(runner)


def spec_counters(llm) -> dict:
    """vLLM's own speculative metrics so far (cumulative over the engine's jobs)."""
    from spec_plugins.heads.vllm_check import _metric

    metrics = llm.get_metrics()
    return {"drafts": _metric(metrics, "vllm:spec_decode_num_drafts") or 0,
            "accepted": _metric(metrics, "vllm:spec_decode_num_accepted_tokens") or 0}


def run_engine(engine: dict, jobs: list[dict], census: bool = False, previous: dict | None = None) -> dict:
    import contextlib
    import gc

    from vllm import LLM, SamplingParams

    import time

    started = time.monotonic()
    inject(engine.get("fault"))
    if "kv_cache_memory_bytes" not in engine["kwargs"]:  # vLLM-CPU's default depends on the machine's free memory
        raise ValueError(f"engine {engine['name']!r} must state kv_cache_memory_bytes (tests/test_engine_sizing.py)")
    if "additional_config" in engine["kwargs"]:  # the tree kernels' implementation (walk, KV move, selection)
        from spec_plugins.vllm_ext.runner_v2 import TreeRunnerV2Mixin

        TreeRunnerV2Mixin.tree_impl = engine.get("tree_impl") or "auto"
    llm = LLM(**engine["kwargs"])
    oracle = install_block_oracle(llm, engine, previous) if engine.get("block_oracle") else None
    steps, counted = [], contextlib.nullcontext([])
    if census:
        from spec_plugins.host_reads_v2 import census_v2_runner_steps

        counted = census_v2_runner_steps(llm.llm_engine.model_executor.driver_worker.worker.model_runner)
    runner = llm.collective_rpc(lambda worker: f"{type(worker.model_runner).__module__}."
                                               f"{type(worker.model_runner).__name__}")[0]
    result = {"runner": runner, "jobs": [],
              "async_scheduling": bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling),
              "scheduler": type(llm.llm_engine.engine_core.engine_core.scheduler).__name__}
    job_of_step = []
    with counted as steps:
        for index, job in enumerate(engine.get("jobs", jobs)):
            params = [SamplingParams(**p) for p in job["params"]]
            outs = llm.generate(job["prompts"], params, use_tqdm=False)
            result["jobs"].append([{"tokens": list(o.outputs[0].token_ids), "finish": o.outputs[0].finish_reason,
                                    "prompt": list(o.prompt_token_ids),
                                    "logprobs": o.outputs[0].logprobs is not None} for o in outs])
            job_of_step += [index] * (len(steps) - len(job_of_step))
            if "additional_config" in engine["kwargs"]:  # cumulative counters after each job
                result.setdefault("after_job", []).append({"stats": llm.collective_rpc("spec_tree_stats")[0],
                                                           "spec": spec_counters(llm)})
    if census:
        result["steps"] = [{"job": j, "num_reqs": s.num_reqs, "decode": s.decode, "drafts": s.drafts,
                            **s.counts.to_json()} for j, s in zip(job_of_step, steps)]
    if oracle is not None:
        from dataclasses import asdict

        result["oracle"] = asdict(oracle.stats)
    if "additional_config" in engine["kwargs"]:
        result["stats"] = llm.collective_rpc("spec_tree_stats")[0]
    if "speculative_config" in engine["kwargs"]:
        result["spec"] = spec_counters(llm)
    del llm
    gc.collect()
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    cpu_v2_interpreter.install_triton_cpu_stand_in()
    if spec.get("force_async"):
        keep_async_scheduling()
    if spec.get("census"):
        from spec_plugins.host_reads_v2 import install_v2_census

        install_v2_census()
    out = {}
    for e in spec["engines"]:
        out[e["name"]] = run_engine(e, spec["jobs"], spec.get("census", False), out)
    print("V2_RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
