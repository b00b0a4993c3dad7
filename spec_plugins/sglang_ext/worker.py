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

It also builds or loads the kernels on its device when it is constructed
(``spec_tree_kernels.prepare``), so no compile starts in the serving loop,
where SGLang's warm-up request runs under the scheduler's watchdog.
"""

from __future__ import annotations

import logging
import os

import torch
from sglang.srt.runtime_context import get_device
from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

import spec_tree_kernels as stk
from spec_tree_kernels import TreeMaskMode, cuda_build_guard

from . import engine_patches
from .config import ALGORITHM_NAME, mask_mode_source, requested_mask_mode, resolve_mask_mode

logger = logging.getLogger(__name__)


def configured_mask_mode() -> TreeMaskMode:
    """The mode this process builds: --speculative-tree-mask-mode (carried in
    the published server args), else SPEC_PLUGINS_TREE_MASK_MODE, checked
    against the verify attention backend (same rule as at resolution)."""
    from sglang.srt.runtime_context import attention_backends, get_spec

    from .algorithm import published_mask_mode_flag

    prefill, decode = attention_backends()
    backend = prefill
    if prefill != decode and get_spec().speculative_attention_mode == "decode":
        backend = decode
    flag = published_mask_mode_flag()
    return resolve_mask_mode(requested_mask_mode(flag=flag), backend, mask_mode_source(flag))


def startup_build_timeout(watchdog_timeout) -> float:
    """Seconds the CUDA kernel build may take while the worker starts:
    ``$SPEC_TREE_KERNELS_BUILD_TIMEOUT`` when the user set it, else the
    kernels' default capped at half of SGLang's ``--watchdog-timeout``.

    SGLang starts the scheduler's watchdog only after the workers are built,
    so this build is not under it; still, a build slower than half the stall
    SGLang tolerates in a forward is abandoned rather than holding up
    readiness for the kernels' 600 s default: Triton serves, the log says why."""
    if os.environ.get(cuda_build_guard.TIMEOUT_ENV):
        return cuda_build_guard.build_timeout()
    if not watchdog_timeout or watchdog_timeout <= 0:  # watchdog off
        return cuda_build_guard.DEFAULT_BUILD_TIMEOUT_S
    return min(cuda_build_guard.DEFAULT_BUILD_TIMEOUT_S, watchdog_timeout / 2)


def prepare_tree_kernels(device) -> dict:
    """Build or load the tree kernels on ``device`` now; on failure or timeout
    ``prepare`` logs why and ``impl="auto"`` serves with Triton."""
    device = torch.device(device)
    timeout = startup_build_timeout(get_device().watchdog_timeout) if device.type == "cuda" else None
    return stk.prepare(device, build_timeout=timeout)


class EagleTreeWorker(EAGLEWorkerV2):
    """``--speculative-algorithm EAGLE_TREE``."""

    def __init__(self, server_args, gpu_id, nccl_port, target_worker):
        engine_patches.check_seams()
        engine_patches.ensure_hooks_applied()
        self.tree_mask_mode = configured_mask_mode()
        # the target worker has claimed the device by now (ModelRunner sets it)
        prepare_tree_kernels(target_worker.device)
        super().__init__(server_args, gpu_id, nccl_port, target_worker)
        engine_patches.activate(
            engine_patches.TreeRuntime(mask_mode=self.tree_mask_mode, device=str(target_worker.device))
        )
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
            f"{mode.name} (--speculative-tree-mask-mode / SPEC_PLUGINS_TREE_MASK_MODE)"
        )
