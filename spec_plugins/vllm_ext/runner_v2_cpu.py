"""``TreeCPUModelRunnerV2``: the tree runner over vLLM-CPU's Model Runner V2.

CPU only (imports vLLM's CPU runner and attention modules); ``TreeCPUWorker``
builds it when vLLM chose the V2 runner.
"""

from __future__ import annotations

from vllm.v1.worker.cpu.model_runner import CPUModelRunner

from .runner_cpu import host_kv_views
from .runner_v2 import TreeRunnerV2Mixin


class TreeCPUModelRunnerV2(TreeRunnerV2Mixin, CPUModelRunner):
    def kv_views(self, kv_cache):
        return host_kv_views(kv_cache, self.cache_config.cache_dtype)
