#!/usr/bin/env bash
# Build .venv-sglang at the repository root: a venv where SGLang 0.5.23 is
# importable next to our package, for the cross-check tests in tests/sglang:
#
#   TRITON_INTERPRET=1 .venv-sglang/bin/python -m pytest tests/sglang
#
# SGLang is installed with --no-deps: importing its Triton tree kernels on CPU
# needs only the short list below, not its full dependency set (CUDA kernels,
# transformers, ...).
#
# Idempotent: a stamp file records the exact install spec; when it matches and
# the imports the tests need work, the script does nothing. A partial or
# outdated venv is completed in place (pip skips what is already satisfied).
#
# Environment: PYTHON, the interpreter that creates the venv (default
# python3.11, else python3; SGLang 0.5.23 ships cp311 wheels).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo_root/.venv-sglang"
stamp="$venv/.spec-plugins-sglang-stamp"

# pytest-xdist: ci/test.sh runs tests/sglang with -n 2. The second line is
# what importing SGLang's EAGLE worker, attention backends, server args and
# Engine pulls in (the plugin tests drive those modules); pins are SGLang 0.5.23's.
# torchvision is not installed (PyPI's wheels break beside CPU torch): the
# plugin tests stub it (spec_plugins/sglang_ext/_testing.py).
base_packages=(
    torch==2.13.0 triton==3.9.0 pytest pytest-xdist hypothesis numpy orjson psutil pybase64
    requests packaging pillow starlette msgspec pydantic pyzmq tqdm ipython aiohttp
    transformers==5.19.0 einops dill compressed-tensors==0.18.0 gguf openai==2.8.0 partial_json_parser
    uvicorn fastapi apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 setproctitle uvloop
)
sglang_package="sglang==0.5.23"
spec="${base_packages[*]} | --no-deps $sglang_package | --no-deps -e $repo_root"

# What the tests import; a venv where this fails is not complete.
imports_ok() {
    "$venv/bin/python" -c \
        'import sglang.kernels.ops.speculative.spec_tree, spec_tree_kernels, hypothesis, pytest, xdist
from spec_plugins.sglang_ext._testing import install_import_stubs
install_import_stubs()
import sglang.srt.speculative.eagle_worker_v2, sglang.srt.layers.attention.torch_native_backend, sglang.srt.entrypoints.engine'
}

if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$spec" ]] && imports_ok 2>/dev/null; then
    echo "setup_sglang_venv: $venv is complete, nothing to do"
    exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
    python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
    echo "setup_sglang_venv: creating $venv with $python"
    "$python" -m venv "$venv"
fi

rm -f "$stamp"
pip_install=("$venv/bin/python" -m pip install --disable-pip-version-check)
"${pip_install[@]}" "${base_packages[@]}"
"${pip_install[@]}" --no-deps "$sglang_package"
"${pip_install[@]}" --no-deps -e "$repo_root"

if ! imports_ok; then
    echo "setup_sglang_venv: $venv was built but the imports above fail" >&2
    exit 1
fi
echo "$spec" >"$stamp"
echo "setup_sglang_venv: $venv is ready"
