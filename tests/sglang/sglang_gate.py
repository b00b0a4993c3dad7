"""Shared entry gate of the SGLang plugin tests.

They need SGLang 0.5.23 importable (.venv-sglang, built by
ci/setup_sglang_venv.sh) and run SGLang's and our Triton kernels on CPU
tensors, so TRITON_INTERPRET=1. Elsewhere (the main venv collects tests/ too)
the calling module is skipped with the reason.
"""

import os

import pytest


def require_sglang_venv(register_plugin: bool = True) -> None:
    """Skip the calling module unless SGLang is usable; then (by default)
    register our plugin with it."""
    pytest.importorskip(
        "sglang.kernels.ops.speculative.spec_tree",
        reason="SGLang is not importable: these tests run in .venv-sglang (build it with ci/setup_sglang_venv.sh)",
    )
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "these tests run SGLang's and our Triton kernels on CPU tensors: set TRITON_INTERPRET=1",
            allow_module_level=True,
        )
    if register_plugin:
        from spec_plugins.sglang_ext import _testing

        _testing.register_with_sglang()
