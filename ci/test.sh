#!/usr/bin/env bash
# The README's test command: set up both venvs and run every test.
#   1. .venv          the kernel module (reference vs oracle, Triton vs reference
#                     under TRITON_INTERPRET=1), CUDA compile check, plugin stubs;
#   2. .venv-sglang   our ops against SGLang 0.5.23's own Triton kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=1 PYTHONHASHSEED=0
bash ci/setup_venv.sh
.venv/bin/python -m pytest -q -n 2 -p no:cacheprovider tests --ignore=tests/sglang "$@"
bash ci/setup_sglang_venv.sh
.venv-sglang/bin/python -m pytest -q -n 2 -p no:cacheprovider tests/sglang "$@"
