"""SGLang adapter (entry point ``sglang.srt.plugins``): the EAGLE_TREE algorithm.

``register()`` is what SGLang's ``load_plugins`` calls in every process. It is
idempotent and imports SGLang only inside the call (this package imports
without SGLang). It

1. gates the engine version (``TESTED_SGLANG`` and their post releases;
   override with ``SPEC_PLUGINS_ALLOW_UNTESTED_ENGINE=1``; a refusal is
   logged with its reason, next to SGLang's "Unknown speculative algorithm"),
2. registers ``--speculative-algorithm EAGLE_TREE`` (``SpeculativeAlgorithm.register``
   with a spec class that behaves as the EAGLE family),
3. wraps the ``handle_speculative_decoding`` resolution step (EAGLE defaults
   and validation, plus ours: the head's variant, carried to every process
   in the server args, mask mode, backend, tree shape, and the refusals of
   ``name_keyed_features``),
4. registers the attention backends ``spec_tree`` and ``spec_tree_triton``,
5. registers AROUND hooks on SGLang's tree functions and its sampled verify
   (``engine_patches``), applied by ``load_plugins``; they act only inside an
   EAGLE_TREE worker (which also fills the sampling bindings SGLang leaves
   None on CPU / XPU).

Usage, knobs and limits: ``config`` and docs/sglang.md.
"""

from __future__ import annotations

from ..engine_versions import check_engine_version
from .config import ALGORITHM_NAME, BACKEND_TORCH, BACKEND_TRITON, MASK_MODE_ENV, TESTED_SGLANG, VARIANT_ENV

_registered = False


def register() -> None:
    """Register EAGLE_TREE with SGLang (no-op without SGLang, or when done)."""
    global _registered
    if _registered:
        return
    if check_engine_version("SGLang", ("sglang",), TESTED_SGLANG) is None:
        return  # SGLang is not installed: nothing to register with
    from . import registration

    registration.register_all()
    _registered = True


__all__ = [
    "ALGORITHM_NAME",
    "BACKEND_TORCH",
    "BACKEND_TRITON",
    "MASK_MODE_ENV",
    "TESTED_SGLANG",
    "VARIANT_ENV",
    "register",
]
