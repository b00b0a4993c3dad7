"""``TreeCPUWorker``: vLLM's CPUWorker building the tree runner (``config.CPU_WORKER``).

CPU only: importing ``vllm.v1.worker.cpu_worker`` patches torch.cuda and
friends process-wide (see ``worker.py``), so no GPU-path module imports this one.
"""

from __future__ import annotations

from vllm.v1.worker import cpu_worker as _cpu_worker_module
from vllm.v1.worker.cpu_worker import CPUWorker

from .faults import with_test_faults
from .seams import check_seams
from .worker import TreeStatsMixin


class TreeCPUWorker(TreeStatsMixin, CPUWorker):
    def init_device(self):
        check_seams(platform="cpu")
        from .attention_cpu import install_cpu_override

        install_cpu_override()
        # CPUWorker.init_device builds its runner inline from a module global: vLLM's V1 runner
        # (seam ``cpu_worker.CPUModelRunner``) or, when vLLM chose V2, the V2 runner it imports
        # from ``vllm.v1.worker.cpu.model_runner`` (seam ``cpu.model_runner.CPUModelRunner``).
        if self.use_v2_model_runner:
            from vllm.v1.worker.cpu import model_runner as module

            from .runner_v2_cpu import TreeCPUModelRunnerV2 as runner
        else:
            from .runner_cpu import TreeCPUModelRunner

            module, runner = _cpu_worker_module, with_test_faults(TreeCPUModelRunner)
        original = module.CPUModelRunner
        module.CPUModelRunner = runner
        try:
            super().init_device()
        finally:
            module.CPUModelRunner = original
        from spec_tree_kernels.startup import prepare

        prepare("cpu")  # tree attention's host kernel: compiled now, not in a step
