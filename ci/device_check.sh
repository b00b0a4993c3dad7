#!/usr/bin/env bash
# The GPU check of the tree kernels (ci/device_check.py documents the sections).
#
#   bash ci/device_check.sh              # GPU machine: correctness, sanitizer, timings (< 8 min)
#   bash ci/device_check.sh --reduced    # anywhere: CPU + TRITON_INTERPRET=1, tiny sizes (~1 min)
#   bash ci/device_check.sh --budget 300 --skip sanitizer   # a shorter GPU run
#   bash ci/device_check.sh --skip correctness,sglang,sanitizer,bench,sglang_graphs   # only tree attention (issue #17)
#   bash ci/device_check.sh --skip correctness,sglang,sanitizer,bench,attention   # only SGLang's verify graph (issue #38)
#
# The tree-attention section (issue #17) checks the split-KV and single-pass
# kernels against the reference, measures a device-to-device copy, sweeps
# batch {1,4,8,64} x T {1,8,16,64} x context {1k,4k,32k} and reports the
# issue's targets under .tree_attention.targets in the JSON.
#
# Writes $OUT/device_check.json and $OUT/device_check.log (OUT defaults to
# ./bench_out). Needs torch (+ triton) importable by $PYTHON (default: the
# repository's .venv when present, else python3); the package need not be
# installed. SGLang's own kernels join the comparison when SGLANG_SPEC_TREE_PY
# names a copy of SGLang 0.5.23's spec_tree.py, or when one lies at
# .whl/sglang_spec_tree.py (an ignored folder; never commit that file).
# Exit status: 0 when every correctness check passed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export OUT="${OUT:-$ROOT/bench_out}"
mkdir -p "$OUT"
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$ROOT/.venv/bin/python" ]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
export PYTHONUNBUFFERED=1
# CUDA kernel builds: reused by the compute-sanitizer child processes of the same run
export SPEC_TREE_KERNELS_BUILD_DIR="${SPEC_TREE_KERNELS_BUILD_DIR:-${TMPDIR:-/tmp}/spec_tree_kernels_build}"
if [ -z "${SGLANG_SPEC_TREE_PY:-}" ] && [ -f "$ROOT/.whl/sglang_spec_tree.py" ]; then
  export SGLANG_SPEC_TREE_PY="$ROOT/.whl/sglang_spec_tree.py"
fi
exec "$PYTHON" "$ROOT/ci/device_check.py" --out "$OUT" "$@"
