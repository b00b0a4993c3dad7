"""Without a GPU, run Triton kernels through Triton's CPU interpreter.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined,
i.e. before ``spec_tree_kernels.triton_ops`` is imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
