"""``TreeCPUModelRunner``: the tree runner over vLLM-CPU's V1 runner.

CPU only (imports vLLM's CPU runner and attention modules); ``TreeCPUWorker``
builds it.
"""

from __future__ import annotations

from vllm.v1.worker.cpu_model_runner import CPUModelRunner

from .attention_cpu import cpu_kv_views
from .runner import TreeRunnerMixin


def host_kv_views(kv_cache, cache_dtype):
    """K, V views [num_blocks, block_size, Hkv, D] of a vLLM-CPU cache, in the
    layout vLLM's CPU attention picked for it."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    block_size, head_size = kv_cache.shape[2], kv_cache.shape[3] // 2
    isa = _get_attn_isa(kv_cache.dtype, block_size, head_size, cache_dtype)
    return cpu_kv_views(kv_cache, isa)


class TreeCPUModelRunner(TreeRunnerMixin, CPUModelRunner):
    def kv_views(self, kv_cache):
        return host_kv_views(kv_cache, self.cache_config.cache_dtype)
