"""``TreeGPUModelRunner``: the tree runner over vLLM's V1 GPU runner (CUDA).

vLLM 0.33, written against its source and imported against it by the CUDA
guard test; imports nothing CPU-only. ``TreeGPUWorker`` builds it.
"""

from __future__ import annotations

from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from .attention import flash_kv_views
from .runner import TreeRunnerMixin


class TreeGPUModelRunner(TreeRunnerMixin, GPUModelRunner):
    def kv_views(self, kv_cache):
        return flash_kv_views(kv_cache)
