"""SGLang adapter (entry point ``sglang.srt.plugins``).

``register()`` is idempotent and imports SGLang only inside the call. The
EAGLE_TREE algorithm, its worker and attention backend land with the SGLang
plugin issue; today it only gates the engine version.
"""

from __future__ import annotations

from ..engine_versions import check_engine_version

TESTED_SGLANG = ("0.5.23",)
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    check_engine_version("SGLang", ("sglang",), TESTED_SGLANG)
    _registered = True
