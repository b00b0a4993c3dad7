"""NO_AMX=1 .venv-vllm/bin/python results/2026-12-05/bf16/bf16_measure.py 4 4 64

(2026-12-05: results/2026-11-30/bf16/bf16_measure.py with chain(5) for both vLLM and
the plugin, issue #41 item 3: the identical fraction beside vLLM's chain.)

bf16 on vLLM-CPU: greedy outputs of the plugin's chain and tree and vLLM's own
EAGLE-3 chain, each against no speculation in the same dtype (issue 12, 'Also').
On an AMX CPU vLLM picks the tiled 'amx' K layout for bf16 (refused by the
plugin at startup) and CPU_ATTN only takes block sizes that are multiples of
32, so with NO_AMX=1 vLLM is told AMX tiles are absent: it then uses its 'vec'
attention kernel, as on AVX-512/AVX2 CPUs without AMX (matmuls are unaffected)."""
import gc, json, os, sys, time
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch
if os.environ.get("NO_AMX") == "1":
    torch.cpu._is_amx_tile_supported = lambda: False
from vllm import LLM, SamplingParams
from transformers import AutoTokenizer
from spec_plugins.heads import head_path
from spec_plugins.heads.vllm_check import _metric
from spec_plugins.models.smollm2 import ensure_converted
from spec_plugins.prompts import apply_chat_template, eval_prompts

N_CHAT, N_CODE, MAX_TOKENS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
model = str(ensure_converted())
tok = AutoTokenizer.from_pretrained(model)
prompts = [apply_chat_template(tok, p.text) for p in eval_prompts(num_humaneval=N_CODE, num_chat=N_CHAT)]
base = dict(model=model, dtype="bfloat16", max_model_len=1024, seed=0, enforce_eager=True,
            distributed_executor_backend="uni", disable_log_stats=False, enable_prefix_caching=False,
            kv_cache_memory_bytes=256 << 20)
E3 = str(head_path("eagle3"))
configs = {
    "no-spec": {},
    "vllm eagle3 chain(5)": {"speculative_config": {"method": "eagle3", "model": E3, "num_speculative_tokens": 5}},
    "plugin chain(5,1,6)": {"speculative_config": {"method": "eagle3", "model": E3},
                            "additional_config": {"spec_tree": {"num_steps": 5, "topk": 1}}},
    "plugin tree(5,4,8)": {"speculative_config": {"method": "eagle3", "model": E3},
                           "additional_config": {"spec_tree": {"num_steps": 5, "topk": 4, "num_draft_tokens": 8}}},
}
res, ref = {}, None
for name, extra in configs.items():
    t0 = time.time()
    llm = LLM(**base, **extra)
    outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)]
    m = llm.get_metrics()
    drafts, acc = _metric(m, "vllm:spec_decode_num_drafts") or 0, _metric(m, "vllm:spec_decode_num_accepted_tokens") or 0
    del llm; gc.collect()
    if ref is None:
        ref = outs
    firsts = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), None) for r, o in zip(ref, outs)]
    compared = sum(len(r) for r in ref)
    agree = sum((f if f is not None else min(len(r), len(o))) for f, r, o in zip(firsts, ref, outs))
    res[name] = {"identical_prompts": sum(f is None and len(r) == len(o) for f, r, o in zip(firsts, ref, outs)),
                 "prompts": len(prompts), "first_divergence": firsts,
                 "tokens_before_first_divergence": f"{agree}/{compared}",
                 "tau": round(1 + acc / drafts, 3) if drafts else None, "seconds": round(time.time() - t0, 1)}
    print(name, json.dumps(res[name]), flush=True)
print(json.dumps(res, indent=1))
