"""Self-distilled EAGLE training data for SmolLM2-135M-Instruct.

Stage 1 ``generate``: the target's own greedy answers (vLLM-CPU, temperature 0)
to the training prompts of ``spec_plugins.training.prompts`` (disjoint from
every evaluation prompt), chat-templated. Written to ``sequences.jsonl``.

Stage 2 ``features``: one HF forward of the target over each sequence records,
per position, the inputs of the EAGLE-3 auxiliary layers (vLLM's
``aux_hidden_states``: hidden + residual entering layer i) and the final
post-norm hidden state (what vLLM hands an EAGLE-1 head). Stored fp16 in
``features.pt``.

    python -m spec_plugins.training.data --num-prompts 400 --max-new-tokens 192

Everything lands in ``$SPEC_PLUGINS_CACHE/train-data`` (see ``models.smollm2``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

EAGLE3_AUX_LAYERS = (2, 15, 27)  # vLLM's default (2, L // 2, L - 3) for L = 30, written explicitly


def data_dir() -> Path:
    from spec_plugins.models.smollm2 import cache_root

    return cache_root() / "train-data"


def generate(out: Path, num_prompts: int, max_new_tokens: int, seed: int) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))  # vLLM-CPU drops to 1 thread otherwise
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "6")  # GiB: room for a few hundred concurrent answers
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from spec_plugins.models.smollm2 import ensure_converted
    from spec_plugins.prompts import apply_chat_template
    from spec_plugins.training.prompts import training_prompts
    from spec_plugins.vllm_runs import engine_kwargs

    model = ensure_converted()
    tok = AutoTokenizer.from_pretrained(model)
    prompts = training_prompts(num_prompts, seed=seed)
    texts = [apply_chat_template(tok, p) for p in prompts]
    llm = LLM(**engine_kwargs(
        str(model), max_model_len=1024, kv_cache_memory_bytes=2 << 30,  # ~45k fp32 SmolLM2 tokens
        seed=seed, max_num_seqs=256,
        enforce_eager=False, disable_log_stats=True,  # vLLM's defaults: a bulk job, no metrics read
    ))
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens)
    t0 = time.time()
    done = 0
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    with tmp.open("w") as f:
        chunk = 400
        for start in range(0, len(texts), chunk):
            results = llm.generate(texts[start : start + chunk], params, use_tqdm=False)
            for prompt, r in zip(prompts[start : start + chunk], results):
                rec = {
                    "prompt": prompt,
                    "prompt_ids": list(r.prompt_token_ids),
                    "response_ids": list(r.outputs[0].token_ids),
                }
                f.write(json.dumps(rec) + "\n")
                done += len(rec["response_ids"])
            el = time.time() - t0
            print(f"[data] generated {min(start + chunk, len(texts))}/{len(texts)} answers, {done} tokens, "
                  f"{done / el:.0f} tok/s, {el:.0f}s", flush=True)
    tmp.rename(out)


def load_sequences(path: Path) -> list[dict]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def target_features(model, input_ids, aux_layers=EAGLE3_AUX_LAYERS, attention_mask=None, **kwargs):
    """One target forward: (logits, aux [B, L, n_aux, H], final [B, L, H]).

    aux[..., i, :] is the input of decoder layer aux_layers[i] (vLLM's
    auxiliary hidden state), final is the post-norm last hidden state.
    Extra kwargs (position_ids, past_key_values, ...) go to the model.
    """
    captured = {}
    hooks = []
    for idx in aux_layers:
        def hook(module, args, kw, idx=idx):
            hs = args[0] if args else kw["hidden_states"]
            captured[idx] = hs
        hooks.append(model.model.layers[idx].register_forward_pre_hook(hook, with_kwargs=True))
    try:
        out = model.model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    final = out.last_hidden_state
    aux = torch_stack([captured[i] for i in aux_layers], dim=2)
    return out, aux, final


def torch_stack(xs, dim):
    import torch

    return torch.stack(xs, dim=dim)


def features(seq_path: Path, out: Path, max_tokens_per_batch: int = 4096) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from spec_plugins.models.smollm2 import ensure_converted

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(ensure_converted(), dtype=torch.float32).eval()
    seqs = load_sequences(seq_path)
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]["prompt_ids"]) + len(seqs[i]["response_ids"]))
    records = [None] * len(seqs)
    t0 = time.time()
    done = 0
    i = 0
    with torch.inference_mode():
        while i < len(order):
            length = len(seqs[order[i]]["prompt_ids"]) + len(seqs[order[i]]["response_ids"])
            j = i
            while j < len(order):
                lj = len(seqs[order[j]]["prompt_ids"]) + len(seqs[order[j]]["response_ids"])
                if (j - i + 1) * lj > max_tokens_per_batch and j > i:
                    break
                length = lj
                j += 1
            batch = [seqs[k] for k in order[i:j]]
            ids = torch.zeros(len(batch), length, dtype=torch.long)
            mask = torch.zeros(len(batch), length, dtype=torch.long)
            for b, s in enumerate(batch):
                t = s["prompt_ids"] + s["response_ids"]
                ids[b, : len(t)] = torch.tensor(t)
                mask[b, : len(t)] = 1
            _, aux, final = target_features(model, ids, attention_mask=mask)  # right padding: causal, exact
            for b, k in enumerate(order[i:j]):
                n = int(mask[b].sum())
                s = seqs[k]
                records[k] = {
                    "ids": torch.tensor(s["prompt_ids"] + s["response_ids"], dtype=torch.int32),
                    "prompt_len": len(s["prompt_ids"]),
                    "aux": aux[b, :n].to(torch.float16).clone(),
                    "final": final[b, :n].to(torch.float16).clone(),
                }
                done += n
            i = j
            el = time.time() - t0
            print(f"[data] features {i}/{len(seqs)} sequences, {done} tokens, {done / el:.0f} tok/s, {el:.0f}s",
                  flush=True)
    torch.save({"aux_layers": list(EAGLE3_AUX_LAYERS), "records": records}, out.with_suffix(".tmp"))
    out.with_suffix(".tmp").rename(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=400)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--stage", choices=["all", "generate", "features"], default="all")
    args = ap.parse_args(argv)
    out = args.out or data_dir()
    out.mkdir(parents=True, exist_ok=True)
    seq_path, feat_path = out / "sequences.jsonl", out / "features.pt"
    meta = {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "seed": args.seed}
    meta_path = out / "meta.json"
    if meta_path.exists() and json.loads(meta_path.read_text()) != meta:
        print(f"[data] settings changed ({meta_path}): regenerating")
        for p in (seq_path, feat_path):
            p.unlink(missing_ok=True)
    meta_path.write_text(json.dumps(meta))
    if args.stage in ("all", "generate"):
        if seq_path.exists():
            print(f"[data] {seq_path} exists, skipping generation")
        else:
            generate(seq_path, args.num_prompts, args.max_new_tokens, args.seed)
    if args.stage in ("all", "features"):
        if feat_path.exists():
            print(f"[data] {feat_path} exists, skipping features")
        else:
            features(seq_path, feat_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
