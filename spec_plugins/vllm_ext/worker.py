"""What the tree worker classes share; imports no vLLM module.

The classes themselves live in one module per platform, because importing
vLLM's CPU worker is not harmless: ``vllm.v1.worker.cpu_worker`` imports
``vllm.v1.worker.cpu.shm``, which replaces ``torch.cuda.Event/Stream/
current_stream``, ``torch.accelerator`` memory queries, ``Tensor.pin_memory``
and Triton's ``tl.debug_barrier`` process-wide. So:

* ``worker_cpu.TreeCPUWorker``  (``config.CPU_WORKER``) imports vLLM's CPU worker;
* ``worker_gpu.TreeGPUWorker``  (``config.GPU_WORKER``) imports nothing CPU-only
  (``tests/model/test_vllm_cuda_guard.py`` checks this against vLLM 0.33's source).
"""

from __future__ import annotations

from dataclasses import asdict

class TreeStatsMixin:
    def spec_tree_stats(self) -> dict:
        """Runner counters and timers (``llm.collective_rpc("spec_tree_stats")``)."""
        return asdict(self.model_runner.tree_stats)

