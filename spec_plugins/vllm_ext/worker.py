"""Worker classes that tree mode installs as ``parallel_config.worker_cls``.

Each builds the tree runner instead of vLLM's and installs the tree attention
backend before the model (and its attention layers) is built.
"""

from __future__ import annotations

from vllm.v1.worker import cpu_worker as _cpu_worker_module
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.gpu_worker import Worker

from .attention import install_cpu_override, install_gpu_backend


class TreeStatsMixin:
    def spec_tree_stats(self) -> dict:
        """Runner counters and timers (``llm.collective_rpc("spec_tree_stats")``)."""
        from dataclasses import asdict

        return asdict(self.model_runner.tree_stats)


class TreeCPUWorker(TreeStatsMixin, CPUWorker):
    def init_device(self):
        if self.use_v2_model_runner:
            raise RuntimeError("spec-plugins tree mode needs vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
        install_cpu_override()
        from .runner import TreeCPUModelRunner

        # CPUWorker.init_device builds its runner inline from this module global.
        original = _cpu_worker_module.CPUModelRunner
        _cpu_worker_module.CPUModelRunner = TreeCPUModelRunner
        try:
            super().init_device()
        finally:
            _cpu_worker_module.CPUModelRunner = original


class TreeGPUWorker(TreeStatsMixin, Worker):
    """vLLM 0.33 CUDA (written against the source, not executed here)."""

    def init_device(self):
        install_gpu_backend()
        super().init_device()

    def _make_model_runner(self):
        if self.use_v2_model_runner:
            raise RuntimeError("spec-plugins tree mode needs vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)")
        from .runner import TreeGPUModelRunner

        return TreeGPUModelRunner(self.vllm_config, self.device)
