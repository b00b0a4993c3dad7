#!/usr/bin/env bash
# The README's main job: set up .venv and run the kernel benchmark
# (the full grid on a GPU; pass --quick for a short CPU run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup_venv.sh
.venv/bin/python -m spec_plugins.kernel_bench "$@"
