"""Engine startup for the kernels: build the CUDA ops before serving, never inside it.

``prepare(device)`` is what an engine worker calls once it owns its device:
on CUDA it builds or loads the CUDA kernels now (``cuda_ops.ensure_built``;
the build runs in a killable child behind an owner-PID lock,
``cuda_build_guard``), so no compile runs on the first decode step under the
engine's watchdogs; when the toolchain is missing or the build fails or times
out, it logs why and ``impl="auto"`` uses Triton for build / verify / KV move
instead. On the host CPU it builds tree attention's C kernel
(``cpu_attention``, what ``auto`` then uses): a failure leaves the torch path
and is an error only when the kernel was asked for.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger("spec_tree_kernels")


def prepare(device) -> dict[str, str]:
    """Call once at engine startup on the serving device. Returns the
    implementation ``impl="auto"`` will use per op there (logged)."""
    # imported here, not at module level: ``import spec_tree_kernels`` must not load
    # cuda_ops, which the build child runs as __main__ (a second copy otherwise)
    from . import cuda_ops
    from .api import _AUTO_PREFERENCE, resolve_impl

    device = torch.device(device)
    if device.type == "cuda":
        cuda_ops.ensure_built()
    elif device.type == "cpu":
        import os

        from . import cpu_attention
        from .api import IMPL_ENV

        if not cpu_attention.build():
            if os.environ.get(IMPL_ENV) == "cpu":
                raise RuntimeError(f"{IMPL_ENV}=cpu asks for the host tree attention kernel, which did not build: "
                                   f"{cpu_attention.build_error()}")
            logger.info("spec_tree_kernels: the host tree attention kernel did not build (torch serves): %s",
                        cpu_attention.build_error())
        else:
            logger.info("spec_tree_kernels: host tree attention kernel built, %d-float register blocks",
                        cpu_attention.register_block_floats())
    impls = {op: resolve_impl(op, "auto", device) for op in _AUTO_PREFERENCE}
    logger.info("spec_tree_kernels on %s: %s", device, impls)
    return impls
