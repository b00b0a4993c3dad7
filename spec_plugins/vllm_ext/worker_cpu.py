"""``TreeCPUWorker``: vLLM's CPUWorker building the tree runner (``config.CPU_WORKER``).

CPU only: importing ``vllm.v1.worker.cpu_worker`` patches torch.cuda and
friends process-wide (see ``worker.py``), so no GPU-path module imports this one.
"""

from __future__ import annotations

from vllm.v1.worker import cpu_worker as _cpu_worker_module
from vllm.v1.worker.cpu_worker import CPUWorker

from .faults import with_test_faults
from .seams import check_seams
from .worker import TreeStatsMixin, require_v1_runner


class TreeCPUWorker(TreeStatsMixin, CPUWorker):
    def init_device(self):
        check_seams(platform="cpu")
        require_v1_runner(self)
        from .attention_cpu import install_cpu_override
        from .runner_cpu import TreeCPUModelRunner

        install_cpu_override()
        # CPUWorker.init_device builds its runner inline from this module global
        # (seam ``cpu_worker.CPUModelRunner`` in seams.py).
        original = _cpu_worker_module.CPUModelRunner
        _cpu_worker_module.CPUModelRunner = with_test_faults(TreeCPUModelRunner)
        try:
            super().init_device()
        finally:
            _cpu_worker_module.CPUModelRunner = original
        from spec_tree_kernels.startup import prepare

        prepare("cpu")  # tree attention's host kernel: compiled now, not in a step
