import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

try:
    import torch

    # Tiny-model tests are dominated by op overhead: one thread avoids OpenMP
    # spin contention when other jobs share the 2 cores.
    torch.set_num_threads(1)
except ImportError:  # the main venv without torch: the tests skip themselves
    pass
