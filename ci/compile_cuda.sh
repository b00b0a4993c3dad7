#!/usr/bin/env bash
# Compile-only checks of the CUDA tree kernels; no GPU needed.
#
#   bash ci/compile_cuda.sh
#
# 1. nvcc compiles kernels/csrc/tree_ops.cu for sm_90 (CUDA_ARCH overrides),
#    every nvcc, host-compiler and ptxas warning (spills, local memory) an error;
# 2. the host compiler builds its emulated form (cuda_emulation.h) warning-free;
# 3. the torch binding tree_ops_binding.cpp passes a syntax-only compile
#    against the installed torch's headers (a CPU torch ships them, less one
#    generated CUDA header that is stubbed here). Skipped when torch is not
#    importable or SPEC_TREE_SKIP_BINDING_CHECK=1.
# Exits non-zero on the first failure; nvcc missing is an error (exit 3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CSRC="$ROOT/kernels/csrc"
ARCH="${CUDA_ARCH:-sm_90}"
PYTHON="${PYTHON:-$( [ -x "$ROOT/.venv/bin/python" ] && echo "$ROOT/.venv/bin/python" || command -v python3 )}"
CXX="${CXX:-c++}"

NVCC="${NVCC:-$(command -v nvcc || true)}"
if [ -z "$NVCC" ]; then
  for candidate in /usr/local/cuda*/bin/nvcc; do
    [ -x "$candidate" ] && NVCC="$candidate" && break
  done
fi
if [ -z "$NVCC" ] || [ ! -x "$NVCC" ]; then
  echo "compile_cuda: nvcc not found (PATH, NVCC, /usr/local/cuda*/bin)" >&2
  exit 3
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/spec_tree_compile.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

echo "[1/3] nvcc ($("$NVCC" --version | tail -1)) -arch=$ARCH tree_ops.cu"
"$NVCC" -std=c++17 -arch="$ARCH" -O3 -lineinfo \
  --Werror all-warnings \
  -Xcompiler -Wall,-Wextra,-Werror \
  -Xptxas --warn-on-spills,--warn-on-local-memory-usage,--warning-as-error \
  -I "$CSRC" -c "$CSRC/tree_ops.cu" -o "$WORK/tree_ops.o"

echo "[2/3] $CXX emulated tree_ops.cu (-DSPEC_TREE_EMULATE)"
"$CXX" -std=c++17 -O1 -Wall -Wextra -Werror -Wno-unknown-pragmas -x c++ -DSPEC_TREE_EMULATE \
  -fPIC -pthread -I "$CSRC" -c "$CSRC/tree_ops.cu" -o "$WORK/tree_ops_emulated.o"

if [ "${SPEC_TREE_SKIP_BINDING_CHECK:-0}" = "1" ]; then
  echo "[3/3] binding check skipped (SPEC_TREE_SKIP_BINDING_CHECK=1)"
  exit 0
fi
if ! INCLUDES="$("$PYTHON" - <<'PY' 2>/dev/null
import sysconfig
from torch.utils.cpp_extension import include_paths
print(" ".join("-isystem " + p for p in include_paths() + [sysconfig.get_paths()["include"]]))
PY
)"; then
  echo "[3/3] binding check skipped: torch not importable with $PYTHON"
  exit 0
fi
CUDA_INCLUDE=""
for candidate in "${CUDA_HOME:-/nonexistent}/include" "$(dirname "$NVCC")/../include" /usr/local/cuda*/include; do
  if [ -f "$candidate/cuda_runtime.h" ]; then CUDA_INCLUDE="$candidate"; break; fi
done
if [ -z "$CUDA_INCLUDE" ]; then
  echo "[3/3] binding check skipped: no cuda_runtime.h next to $NVCC or under /usr/local/cuda*"
  exit 0
fi
# CPU wheels lack this generated header; its only content is the shared-library switch.
mkdir -p "$WORK/stub/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$WORK/stub/c10/cuda/impl/cuda_cmake_macros.h"
echo "[3/3] $CXX -fsyntax-only tree_ops_binding.cpp against $("$PYTHON" -c 'import torch; print("torch", torch.__version__)')"
# shellcheck disable=SC2086  # INCLUDES is a list of flags
"$CXX" -std=c++17 -fsyntax-only -Wall -Wextra -Werror $INCLUDES -isystem "$WORK/stub" -isystem "$CUDA_INCLUDE" \
  -I "$CSRC" -DTORCH_EXTENSION_NAME=spec_tree_kernels_cuda "$CSRC/tree_ops_binding.cpp"
echo "compile_cuda: OK"
