"""EagleTreeWorker: SGLang's EAGLE V2 worker with our tree ops.

The draft loop, the draft CUDA graph, the target verify forward and the draft
extend are SGLang's own. What changes (see ``engine_patches``):

* selection (``organize_draft_results``) is tie-safe and ancestor-closed;
* the tree build (``build_tree_kernel_efficient``) is ours in every mask mode,
  including ANCESTOR_BITMASK and PARENT_POINTER;
* greedy verify (``verify_tree_greedy_func``) and the accepted-path KV move
  (``move_accept_tokens_to_target_kvcache``) are ours;
* sampled verify (temperature > 0: ``tree_speculative_sampling_target_only``)
  is ours, exact target-only recursive rejection, on CPU too (where SGLang
  itself verifies sampled batches greedily).

The worker activates those hooks for its process and sets the draft worker's
mask mode to the configured one; when the target attention backend exposes a
``verify_mask`` (ours always does), SGLang's ``build_eagle_verify_input``
builds that backend's mode, and startup fails if the two disagree.
"""

from __future__ import annotations

import logging

from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

from spec_tree_kernels import TreeMaskMode

from . import engine_patches
from .config import ALGORITHM_NAME, requested_mask_mode, resolve_mask_mode

logger = logging.getLogger(__name__)


def configured_mask_mode() -> TreeMaskMode:
    """The mode this process builds: SPEC_PLUGINS_TREE_MASK_MODE checked
    against the verify attention backend (same rule as at resolution)."""
    from sglang.srt.runtime_context import attention_backends, get_spec

    prefill, decode = attention_backends()
    backend = prefill
    if prefill != decode and get_spec().speculative_attention_mode == "decode":
        backend = decode
    return resolve_mask_mode(requested_mask_mode(), backend)


class EagleTreeWorker(EAGLEWorkerV2):
    """``--speculative-algorithm EAGLE_TREE``."""

    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        engine_patches.check_seams()
        engine_patches.ensure_hooks_applied()
        self.tree_mask_mode = configured_mask_mode()
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        engine_patches.activate(engine_patches.TreeRuntime(mask_mode=self.tree_mask_mode))
        logger.info("%s worker: tree mask %s", ALGORITHM_NAME, self.tree_mask_mode.name)

    def init_attention_backends(self):
        super().init_attention_backends()  # resets the draft worker's mode to SGLang's default
        self.apply_mask_mode()

    def apply_mask_mode(self) -> None:
        """Hand our mode to the draft worker; check the target backend reads it."""
        if self._draft_worker is not None:
            self._draft_worker.tree_mask_mode = self.tree_mask_mode
        check_backend_reads(self._target_worker.model_runner.attn_backend, self.tree_mask_mode)


def check_backend_reads(attn_backend, mode: TreeMaskMode) -> None:
    verify_mask = getattr(attn_backend, "verify_mask", None)
    if verify_mask is not None and verify_mask.is_read and int(verify_mask.mode) != int(mode):
        raise RuntimeError(
            f"{ALGORITHM_NAME}: the target attention backend {type(attn_backend).__name__} reads "
            f"{TreeMaskMode(int(verify_mask.mode)).name} tree masks but this worker is configured for "
            f"{mode.name} (SPEC_PLUGINS_TREE_MASK_MODE)"
        )
