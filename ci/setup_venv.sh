#!/usr/bin/env bash
# Create .venv with what the tests and the kernel benchmark need (CPU machine):
# torch 2.13.0 (a CPU wheel that pip finds on these machines' local disk),
# triton 3.9.0 (its CPU interpreter runs our kernels under TRITON_INTERPRET=1),
# pytest + hypothesis, and this package in editable mode. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --disable-pip-version-check \
  "torch==2.13.0" "triton==3.9.0" "pytest>=8" "hypothesis>=6.100" "pytest-xdist>=3" numpy
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e .
