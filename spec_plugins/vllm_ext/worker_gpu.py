"""``TreeGPUWorker``: vLLM's CUDA worker building the tree runner (``config.GPU_WORKER``).

vLLM 0.33 CUDA, written against its source and checked against it by
``tests/model/test_vllm_cuda_guard.py`` (no CUDA vLLM runs here). This module
must import nothing CPU-only from vLLM (see ``worker.py``): the guard fails if
it does.
"""

from __future__ import annotations

import logging

from vllm.v1.worker.gpu_worker import Worker

from .faults import with_test_faults
from .seams import check_seams
from .worker import TreeStatsMixin

logger = logging.getLogger(__name__)


class TreeGPUWorker(TreeStatsMixin, Worker):
    def init_device(self):
        from .attention_gpu import install_gpu_backend

        check_seams(platform="cuda")  # every internal the CUDA path uses, before any of it runs
        # Before super(): init_device builds the runner, whose layers resolve
        # their attention backend from vLLM's registry.
        install_gpu_backend()
        super().init_device()

    def _make_model_runner(self):
        # The runner vLLM chose (VllmConfig.use_v2_model_runner): V2 by default in 0.33, V1 while it is served.
        if self.use_v2_model_runner:
            from .runner_v2_gpu import TreeGPUModelRunnerV2

            return TreeGPUModelRunnerV2(self.vllm_config, self.device)
        from .runner_gpu import TreeGPUModelRunner

        return with_test_faults(TreeGPUModelRunner)(self.vllm_config, self.device)

    def load_model(self, *args, **kwargs):
        prepare_tree_kernels(self.device)
        super().load_model(*args, **kwargs)


def prepare_tree_kernels(device) -> dict:
    """Build or load the CUDA tree kernels now, at startup (minutes on a cold
    cache), not on the first decode step; Triton serves if they cannot be built."""
    import spec_tree_kernels as stk

    impls = stk.prepare(device)
    logger.info("spec-plugins tree kernels on %s: %s", device, impls)
    return impls
