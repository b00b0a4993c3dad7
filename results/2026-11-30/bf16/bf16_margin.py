import gc, json, math, os, sys
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
import torch
torch.cpu._is_amx_tile_supported = lambda: False
from vllm import LLM, SamplingParams
from transformers import AutoTokenizer
from spec_plugins.models.smollm2 import ensure_converted
from spec_plugins.prompts import apply_chat_template, eval_prompts
model = str(ensure_converted())
tok = AutoTokenizer.from_pretrained(model)
prompts = [apply_chat_template(tok, p.text) for p in eval_prompts(num_humaneval=4, num_chat=4)]
div = {0: 7, 2: 41, 3: 29, 4: 27, 5: 19, 6: 30}
llm = LLM(model=model, dtype="bfloat16", max_model_len=1024, seed=0, enforce_eager=True, distributed_executor_backend="uni",
          enable_prefix_caching=False, kv_cache_memory_bytes=256 << 20)
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, logprobs=2), use_tqdm=False)
gaps_all = []
for i, o in enumerate(outs):
    lps = o.outputs[0].logprobs
    gaps = [sorted((v.logprob for v in pos.values()), reverse=True) for pos in lps]
    g = [a[0] - a[1] for a in gaps if len(a) > 1]
    gaps_all += g
    if i in div:
        p = div[i]
        print(i, "pos", p, "top2 logprob gap at divergence", round(gaps[p][0] - gaps[p][1], 4))
gaps_all.sort()
print("median gap over all positions", round(gaps_all[len(gaps_all)//2], 3), "positions with gap < 0.05:", sum(x < 0.05 for x in gaps_all), "of", len(gaps_all))
