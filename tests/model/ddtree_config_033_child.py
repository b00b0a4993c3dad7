"""Child process of ``test_vllm_ddtree_lookahead.py`` (TEST CODE ONLY): DDTree's
engine config through vLLM 0.33's own ``EngineArgs.create_engine_config`` on
the CUDA platform, with the CUDA guard's stubs (``vllm_cuda_guard_child``:
vLLM's compiled parts and the GPU's device queries, nothing else). Run with
vLLM 0.33.0's sources first on PYTHONPATH. Argument: a JSON list of shapes
[L, K, T]; prints {shape: lookahead, or the error} as JSON on its last line.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import vllm_cuda_guard_child as guard  # noqa: E402


def main() -> None:
    guard.stub_compiled_parts()
    import vllm

    assert vllm.__version__ == "0.33.0", vllm.__version__
    guard.use_cuda_platform()
    import spec_plugins.vllm_ext as ext

    ext.register()
    from dflash_drafter import make_random_dflash_drafter
    from vllm.engine.arg_utils import EngineArgs

    drafter = make_random_dflash_drafter(Path.home() / ".cache/spec-plugins/dflash-random-test")
    report = {}
    for L, K, T in json.loads(sys.argv[1]):
        args = EngineArgs(model=guard.guard_target(), max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128,
                          speculative_config={"method": "dflash", "model": str(drafter), "num_speculative_tokens": L},
                          additional_config={"spec_tree": {"num_steps": L, "topk": K, "num_draft_tokens": T}})
        try:
            report[f"{L},{K},{T}"] = args.create_engine_config().num_lookahead_tokens
        except Exception as e:  # noqa: BLE001 - the report carries the failure
            report[f"{L},{K},{T}"] = f"{type(e).__name__}: {e}"
    print(json.dumps(report))


if __name__ == "__main__":
    main()
