"""GPU tree attention for vLLM 0.33 (CUDA): FlashAttention plus tree rows.

Registered as vLLM's CUSTOM backend by ``TreeGPUWorker``. Written against
vLLM's flash_attn.py (0.32 source, same in 0.33); never executed here (no CUDA
build of vLLM on these machines). Tree rows run the Triton kernel of
``spec_tree_kernels.tree_attention`` with the compact per-request mask.
"""

from __future__ import annotations

from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from .attention import TreeRowsMixin, flash_kv_views


class TreeFlashAttentionImpl(TreeRowsMixin, FlashAttentionImpl):
    tree_impl = "triton"

    def kv_views(self, layer, kv_cache):
        return flash_kv_views(kv_cache)


class TreeFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeFlashAttentionImpl
