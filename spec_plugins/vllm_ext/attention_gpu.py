"""GPU tree attention for vLLM 0.33 (CUDA): FlashAttention plus tree rows.

Registered as vLLM's CUSTOM backend by ``TreeGPUWorker``. Written against
vLLM's flash_attn.py (0.32 source, same in 0.33); never executed here (no CUDA
build of vLLM on these machines). Tree rows run the Triton kernel of
``spec_tree_kernels.tree_attention`` with the compact per-request mask.
"""

from __future__ import annotations

from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from .attention import flash_kv_views, overwrite_tree_rows, published_verify_trees


class TreeFlashAttentionImpl(FlashAttentionImpl):
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                 output_block_scale)
        if attn_metadata is None or published_verify_trees() is None:
            return output
        k_view, v_view = flash_kv_views(kv_cache)
        overwrite_tree_rows(query, output, k_view, v_view, attn_metadata.block_table, self.num_heads,
                            self.head_size, self.scale, impl="triton")
        return output


class TreeFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeFlashAttentionImpl
