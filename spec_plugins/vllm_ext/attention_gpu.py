"""GPU tree attention for vLLM 0.33 (CUDA): FlashAttention plus tree rows.

Registered as vLLM's CUSTOM backend by ``TreeGPUWorker`` (``install_gpu_backend``).
Written against vLLM's flash_attn.py (0.32 source, same in 0.33); never
executed here (no CUDA build of vLLM on these machines), imported against
0.33's source by ``tests/model/test_vllm_cuda_guard.py``. Tree rows run the
Triton kernel of ``spec_tree_kernels.tree_attention`` with the compact
per-request mask.
"""

from __future__ import annotations

from vllm.v1.attention.backend import AttentionCGSupport
from vllm.v1.attention.backends.flash_attn import (
    FlashAttentionBackend,
    FlashAttentionImpl,
    FlashAttentionMetadataBuilder,
)

from .attention import TreeRowsMixin, flash_kv_views, forget_resolved_backends


class TreeFlashAttentionImpl(TreeRowsMixin, FlashAttentionImpl):
    tree_impl = "triton"

    def kv_views(self, layer, kv_cache):
        return flash_kv_views(kv_cache)


class TreeFlashAttentionMetadataBuilder(FlashAttentionMetadataBuilder):
    """FlashAttention's metadata, with the tree backend's real CUDA-graph support.

    UNIFORM_BATCH: a uniform decode batch (every request one tree of T =
    1 + num_speculative_tokens rows: what vLLM replays as a FULL graph) reads
    its trees from persistent buffers only (``attention.UniformTrees``: the V2
    runner's mask buffer, FlashAttention's block table and sequence lengths),
    so a captured verify forward replays each step's trees. A mixed batch
    (prefill chunks beside trees) computes its tree rows from trees the runner
    publishes per step: vLLM's own resolution
    (``CompilationConfig.resolve_cudagraph_mode_and_sizes``) keeps its default
    FULL_AND_PIECEWISE, and mixed batches run piecewise, attention eager
    between the graph pieces. V1's tree runner publishes every step's trees:
    it runs PIECEWISE only (``runner_choice.check_runner_options``).
    """

    _cudagraph_support = AttentionCGSupport.UNIFORM_BATCH


class TreeFlashAttentionBackend(FlashAttentionBackend):
    # get_name() stays FlashAttention's "FLASH_ATTN": vLLM maps layers to
    # AttentionBackendEnum by it (Attention.backend) for FlashAttention's own
    # cache layout and kernels, which the tree backend shares.
    @staticmethod
    def get_impl_cls():
        return TreeFlashAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TreeFlashAttentionMetadataBuilder


TREE_BACKEND_PATH = f"{__name__}.TreeFlashAttentionBackend"


def install_gpu_backend() -> None:
    """Register ``TreeFlashAttentionBackend`` as vLLM's CUSTOM backend (seams
    ``register_backend``, ``selector._cached_get_attn_backend``)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, TREE_BACKEND_PATH)
    forget_resolved_backends()
