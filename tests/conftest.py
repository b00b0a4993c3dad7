"""Without a GPU, run Triton kernels through Triton's CPU interpreter.

TRITON_INTERPRET must be set before any ``@triton.jit`` function is defined,
i.e. before ``spec_tree_kernels.triton_ops`` is imported. (Test modules get the
device from ``kernel_device``: ``conftest`` is not a unique module name once
subfolders have their own.)
"""

import kernel_device  # noqa: F401  (sets TRITON_INTERPRET)
