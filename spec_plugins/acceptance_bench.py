"""Acceptance benchmark: chain vs tree EAGLE drafting on SmolLM2-135M-Instruct.

    python -m spec_plugins.acceptance_bench --out bench_out/acceptance

For every prompt (chat set + HumanEval, chat-templated) it runs plain greedy
decoding and the reference tree decoder (``spec_plugins.reference_decoder``)
for each head, (num_steps, topk, num_draft_tokens) configuration and
temperature (``--temperatures``, default 0 0.7 1.0; temperature > 0 samples
with ``--top-p`` 0.9 through ``verify_tree_sampling``, seeded per prompt and
temperature: ``--seed`` + 1000 * prompt index + temperature index), in the
same process, interleaved per prompt, and reports:

* tau: tokens emitted per verify step (mean), and acceptance by depth
  (fraction of verify steps that accepted a draft at depth d), per head x
  shape x temperature;
* S: draft forwards per step (num_steps: num_steps - 1 tree steps + 1 extend);
* the seed's cost model, measured on this CPU: t_T (one-token target forward),
  t_V(T) (verify forward over T tree nodes), c (mean draft forward / t_T), the
  predicted speedup tau / (t_V/t_T + S*c), and the measured wall-clock speedup
  of the reference decoder over plain greedy (tokens per second ratio; sampled
  rows too, against the same greedy baseline);
* whether every configuration's greedy output equals plain greedy (temperature
  0; sampled rows are exact in distribution, not token-identical: "n/a").

Writes ``results.json``, ``results.md`` (the table) and ``acceptance.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from spec_plugins.cli_types import parse_shape

CHAINS = [(3, 1, 4), (5, 1, 6), (7, 1, 8)]
TREES = [(5, 4, 8), (5, 4, 16), (6, 8, 32), (8, 8, 64)]



def run(args) -> dict:
    """Every prompt: plain greedy, then each head x shape x temperature through
    the reference tree decoder; the summary ``main`` writes as results.json."""
    from spec_plugins.prompts import apply_chat_template, eval_prompts

    tok, decoders = _load_target_and_decoders(args)
    prompts = eval_prompts(num_humaneval=args.num_humaneval, num_chat=args.num_chat)
    shapes = args.shapes or (CHAINS + TREES)
    runs = _empty_runs(args.heads, shapes, args.temperatures)
    base = {"tokens": 0, "seconds": 0.0, "t1_seconds": 0.0, "t1_calls": 0}
    vocab_sets = {h: set(d.head.draft_to_target().tolist()) for h, d in decoders.items()}
    covered = {h: 0 for h in args.heads}
    t_start = time.time()
    for pi, p in enumerate(prompts):
        ids = tok(apply_chat_template(tok, p.text), return_tensors="pt", add_special_tokens=False)["input_ids"][0]
        ref = decoders[args.heads[0]].greedy(ids, args.max_new_tokens)
        _add_baseline(base, ref)
        for h in args.heads:
            covered[h] += sum(t in vocab_sets[h] for t in ref.tokens)
        _run_speculative(args, decoders, runs, shapes, pi, p, ids, ref)
        el = time.time() - t_start
        print(f"[bench] prompt {pi + 1}/{len(prompts)} ({p.id}, {len(ids)} prompt tokens) done, {el / 60:.1f} min",
              flush=True)
        if pi == 0 or (pi + 1) % 4 == 0 or pi + 1 == len(prompts):
            _print_partial(runs, base)
    return _summary(args, prompts, runs, base, covered, t_start)


def _load_target_and_decoders(args):
    """(tokenizer, {head: TreeDecoder}) over the converted SmolLM2 target, seeded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from spec_plugins.heads import load_head
    from spec_plugins.models.smollm2 import ensure_converted
    from spec_plugins.reference_decoder import TreeDecoder

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model_dir = ensure_converted()
    tok = AutoTokenizer.from_pretrained(model_dir)
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    return tok, {h: TreeDecoder(target, load_head(h, target)) for h in args.heads}


def _empty_runs(heads, shapes, temps) -> dict:
    """{(head, shape, temperature): running totals}, in the rows' order."""
    return {(h, s, t): {"tokens": 0, "seconds": 0.0, "accept": [], "accept_by_domain": {},
                        "lossless": True if t == 0 else None,
                        "mismatch": [], "timer": {"seconds": {}, "calls": {}}}
            for h in heads for s in shapes for t in temps}


def _add_baseline(base: dict, ref) -> None:
    """Add one prompt's plain greedy run to the baseline totals."""
    base["tokens"] += len(ref.tokens)
    base["seconds"] += ref.seconds
    base["t1_seconds"] += ref.timer.seconds.get("target_1", 0.0)
    base["t1_calls"] += ref.timer.calls.get("target_1", 0)


def _run_speculative(args, decoders, runs, shapes, pi: int, prompt, ids, ref) -> None:
    """One prompt (an ``EvalPrompt``) through every head x shape x temperature;
    greedy runs are checked token-identical to plain greedy (``ref``)."""
    for h in args.heads:
        for s in shapes:
            for ti, t in enumerate(args.temperatures):
                out = decoders[h].generate(ids, args.max_new_tokens, *s, temperature=t, top_p=args.top_p,
                                           top_k=args.top_k, seed=args.seed + 1000 * pi + ti)
                r = runs[(h, s, t)]
                _accumulate(r, out, prompt.category)
                if t == 0 and out.tokens != ref.tokens:
                    r["lossless"] = False
                    r["mismatch"].append(prompt.id)


def _summary(args, prompts, runs, base, covered, t_start) -> dict:
    """results.json: the run's settings, the greedy baseline and one row per run."""
    t_T = base["t1_seconds"] / max(1, base["t1_calls"])
    base_tps = base["tokens"] / base["seconds"]
    rows = [_row(args, h, s, temp, r, t_T, base_tps) for (h, s, temp), r in runs.items()]
    return {
        "target": "SmolLM2-135M-Instruct fp32 (HF transformers, sdpa, float 4D tree mask)",
        "prompts": [p.id for p in prompts], "max_new_tokens": args.max_new_tokens, "threads": args.threads,
        "temperatures": args.temperatures, "top_p": args.top_p, "top_k": args.top_k,
        "seeds": f"{args.seed} + 1000 * prompt index + temperature index",
        "baseline": {"tokens": base["tokens"], "seconds": round(base["seconds"], 2),
                     "tokens_per_s": round(base_tps, 2), "t_T_ms": round(1000 * t_T, 2)},
        "draft_vocab_coverage_of_greedy_outputs": {h: round(covered[h] / max(1, base["tokens"]), 4)
                                                   for h in args.heads},
        "rows": rows, "minutes": round((time.time() - t_start) / 60, 1),
    }


def _row(args, h: str, s: tuple, temp: float, r: dict, t_T: float, base_tps: float) -> dict:
    """One head x shape x temperature: tau, acceptance by depth and the cost model."""
    steps, topk, T = s
    acc = r["accept"]
    n = max(1, len(acc))
    tau = 1 + sum(acc) / n
    by_depth = [round(sum(a >= d for a in acc) / n, 4) for d in range(1, steps + 1)]
    sec, calls = r["timer"]["seconds"], r["timer"]["calls"]
    t_V = sec.get("verify", 0.0) / max(1, calls.get("verify", 0))
    draft_sec = sec.get("draft_step", 0.0) + sec.get("draft_extend", 0.0)
    draft_calls = calls.get("draft_step", 0) + calls.get("draft_extend", 0)
    c = draft_sec / max(1, draft_calls) / t_T
    predicted = tau / (t_V / t_T + steps * c)
    measured = (r["tokens"] / r["seconds"]) / base_tps
    return {
        "head": h, "num_steps": steps, "topk": topk, "num_draft_tokens": T, "kind": "chain" if topk == 1 else "tree",
        "temperature": temp, "top_p": args.top_p if temp > 0 else None, "top_k": args.top_k if temp > 0 else None,
        "tau": round(tau, 3), "accept_by_depth": by_depth, "verify_steps": len(acc), "S": steps,
        "tau_by_domain": {d: round(1 + sum(a) / max(1, len(a)), 3) for d, a in sorted(r["accept_by_domain"].items())},
        "accept_by_depth_by_domain": {d: [round(sum(x >= k for x in a) / max(1, len(a)), 4)
                                          for k in range(1, steps + 1)]
                                      for d, a in sorted(r["accept_by_domain"].items())},
        "t_V_over_t_T": round(t_V / t_T, 3), "c": round(c, 4), "predicted_speedup": round(predicted, 3),
        "measured_speedup": round(measured, 3), "tokens_per_s": round(r["tokens"] / r["seconds"], 2),
        "lossless": r["lossless"], "mismatched_prompts": r["mismatch"],
        "tree_ops_ms_per_step": round(1000 * sec.get("tree_ops", 0.0) / n, 2),
        "t_T_ms": round(1000 * t_T, 2), "baseline_tokens_per_s": round(base_tps, 2),
    }


def _accumulate(r: dict, out, domain: str) -> None:
    r["tokens"] += len(out.tokens)
    r["seconds"] += out.seconds
    r["accept"].extend(out.accept_lengths)
    r["accept_by_domain"].setdefault(domain, []).extend(out.accept_lengths)
    for k, v in out.timer.seconds.items():
        r["timer"]["seconds"][k] = r["timer"]["seconds"].get(k, 0.0) + v
        r["timer"]["calls"][k] = r["timer"]["calls"].get(k, 0) + out.timer.calls[k]


def _print_partial(runs, base):
    parts = []
    for (h, s, t), r in runs.items():
        if r["accept"]:
            parts.append(f"{h}{s}@{t:g}: tau {1 + sum(r['accept']) / len(r['accept']):.2f}"
                         f"{' MISMATCH' if r['lossless'] is False else ''}")
    print("[bench]   " + "; ".join(parts), flush=True)


def merge(results: list[dict]) -> dict:
    """One result from runs over the same prompts (e.g. one process per head, each
    with its own greedy baseline measured in the same process)."""
    first = results[0]
    for r in results[1:]:
        if r["prompts"] != first["prompts"] or r["max_new_tokens"] != first["max_new_tokens"]:
            raise ValueError("merged runs must use the same prompts and max_new_tokens")
    cov = {}
    for r in results:
        cov.update(r.get("draft_vocab_coverage_of_greedy_outputs", {}))
    return {**first, "rows": [row for r in results for row in r["rows"]], "draft_vocab_coverage_of_greedy_outputs": cov,
            "baselines": [r["baseline"] for r in results], "minutes": max(r["minutes"] for r in results)}


def _temp(row: dict) -> float:
    return row.get("temperature", 0.0)  # results from before --temperatures are greedy


def _lossless(row: dict) -> str:
    if _temp(row) > 0:
        return "n/a (sampled)"
    return "yes" if row["lossless"] else "NO: " + ",".join(row["mismatched_prompts"])


def tau_table(res: dict) -> list[str]:
    """tau per head x shape (rows) and temperature (columns): chains and trees next to greedy."""
    temps = sorted({_temp(r) for r in res["rows"]})
    configs = list(dict.fromkeys((r["head"], r["num_steps"], r["topk"], r["num_draft_tokens"], r["kind"])
                                 for r in res["rows"]))
    tau = {(r["head"], r["num_steps"], r["topk"], r["num_draft_tokens"], r["kind"], _temp(r)): r["tau"]
           for r in res["rows"]}
    names = ["greedy" if t == 0 else f"T={t:g}" for t in temps]
    lines = ["| head | (steps, topk, T) | kind | " + " | ".join(f"tau {n}" for n in names) + " |",
             "|---|---|---|" + "---|" * len(temps)]
    for c in configs:
        cells = [f"{tau[c + (t,)]:.2f}" if c + (t,) in tau else "-" for t in temps]
        lines.append(f"| {c[0]} | ({c[1]}, {c[2]}, {c[3]}) | {c[4]} | " + " | ".join(cells) + " |")
    return lines


def domain_table(res: dict) -> list[str]:
    """Greedy tau per head x shape (rows) and evaluation domain (columns: chat categories, humaneval)."""
    rows = [r for r in res["rows"] if _temp(r) == 0 and r.get("tau_by_domain")]
    if not rows:
        return []
    domains = sorted({d for r in rows for d in r["tau_by_domain"]})
    lines = ["| head | (steps, topk, T) | " + " | ".join(f"tau {d}" for d in domains) + " |",
             "|---|---|" + "---|" * len(domains)]
    for r in rows:
        cells = [f"{r['tau_by_domain'][d]:.2f}" if d in r["tau_by_domain"] else "-" for d in domains]
        lines.append(f"| {r['head']} | ({r['num_steps']}, {r['topk']}, {r['num_draft_tokens']}) | "
                     + " | ".join(cells) + " |")
    return lines


def table(res: dict) -> str:
    bases = res.get("baselines", [res["baseline"]])
    sampled = [t for t in res.get("temperatures", [0.0]) if t > 0]
    lines = [
        "Baseline greedy (per process): " + "; ".join(f"{b['tokens_per_s']} tok/s, t_T = {b['t_T_ms']} ms" for b in bases)
        + f" ({len(res['prompts'])} prompts x <= {res['max_new_tokens']} new tokens, {res['threads']} threads)",
        "Draft-vocabulary coverage of the greedy outputs: "
        + ", ".join(f"{h}: {c:.3f}" for h, c in res.get("draft_vocab_coverage_of_greedy_outputs", {}).items()),
    ]
    if sampled:
        lines.append(f"Sampled rows (temperature {', '.join(f'{t:g}' for t in sampled)}): top-p {res['top_p']}"
                     + (f", top-k {res['top_k']}" if res.get("top_k") else "")
                     + f", seeds {res['seeds']}; verify_tree_sampling (target-only recursive rejection, exact in "
                     "distribution); measured speedup against the greedy baseline's tokens/s.")
    lines += ["", *tau_table(res), "", *domain_table(res), "",
              "| head | (steps, topk, T) | kind | temperature | tau | accept by depth | S | t_V/t_T | c | predicted | "
              "measured | lossless |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(
            f"| {r['head']} | ({r['num_steps']}, {r['topk']}, {r['num_draft_tokens']}) | {r['kind']} | "
            f"{_temp(r):g} | {r['tau']:.2f} | "
            f"{' '.join(f'{x:.2f}' for x in r['accept_by_depth'])} | {r['S']} | {r['t_V_over_t_T']:.2f} | "
            f"{r['c']:.3f} | {r['predicted_speedup']:.2f}x | {r['measured_speedup']:.2f}x | {_lossless(r)} |"
        )
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    """acceptance.png: tau (against the tree size, or the temperature when
    several ran) and the measured and predicted speedup against the tree size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = iter(plt.rcParams["axes.prop_cycle"].by_key()["color"])
    temps = sorted({_temp(r) for r in res["rows"]})
    speed_temp = temps[0]  # the speedup panel shows one temperature (greedy when run)
    for head in sorted({r["head"] for r in res["rows"]}):
        for kind, marker in (("chain", "o"), ("tree", "s")):
            rows = [r for r in res["rows"] if r["head"] == head and r["kind"] == kind]
            if not rows:
                continue
            style = {"marker": marker, "color": next(colors)}
            _plot_tau(axes[0], rows, temps, f"{head} {kind}", style)
            _plot_speedup(axes[1], rows, speed_temp, f"{head} {kind}", style)
    _label_axes(axes, res, temps, speed_temp)
    fig.suptitle("EAGLE heads on SmolLM2-135M-Instruct: chain vs tree", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _shape_of(row: dict) -> tuple:
    return row["num_steps"], row["topk"], row["num_draft_tokens"]


def _plot_tau(ax, rows: list[dict], temps: list[float], label: str, style: dict) -> None:
    """One head and kind: tau against the tree size (one temperature ran), else
    against the temperature, one line per shape."""
    if len(temps) == 1:
        rows = sorted(rows, key=lambda r: r["num_draft_tokens"])
        ax.plot([r["num_draft_tokens"] for r in rows], [r["tau"] for r in rows], **style, label=label)
        return
    for i, shape in enumerate(sorted({_shape_of(r) for r in rows})):
        line = sorted([r for r in rows if _shape_of(r) == shape], key=_temp)
        ax.plot([_temp(r) for r in line], [r["tau"] for r in line], **style,
                linestyle=["-", "--", "-.", ":"][i % 4], label=f"{label} {shape}")


def _plot_speedup(ax, rows: list[dict], speed_temp: float, label: str, style: dict) -> None:
    """One head and kind at ``speed_temp``: measured (solid) and predicted (dotted) speedup against T."""
    rows = sorted([r for r in rows if _temp(r) == speed_temp], key=lambda r: r["num_draft_tokens"])
    T = [r["num_draft_tokens"] for r in rows]
    ax.plot(T, [r["measured_speedup"] for r in rows], **style, label=f"{label} measured")
    ax.plot(T, [r["predicted_speedup"] for r in rows], **style, linestyle=":", mfc="none",
            label=f"{label} predicted")


def _label_axes(axes, res: dict, temps: list[float], speed_temp: float) -> None:
    """Scales, ticks, labels, titles, grids and legends of both panels."""
    if len(temps) == 1:
        axes[0].set(xscale="log", xlabel="verified nodes T")
    else:
        axes[0].set(xlabel="temperature (0 = greedy; sampled with top-p " + f"{res.get('top_p')})")
        axes[0].set_xticks(temps, [f"{t:g}" for t in temps])
    axes[0].set(ylabel="tau (tokens / verify step)", title="Acceptance length")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set(xscale="log", xlabel="verified nodes T", ylabel="speedup over greedy",
                title="Speedup (reference decoder, this CPU, "
                      + ("greedy)" if speed_temp == 0 else f"temperature {speed_temp:g})"))
    ticks = sorted({r["num_draft_tokens"] for r in res["rows"]})
    for ax in axes if len(temps) == 1 else axes[1:]:
        ax.set_xticks(ticks, [str(t) for t in ticks])
    for ax in axes:
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench_out/acceptance"))
    ap.add_argument("--heads", nargs="+", default=["eagle3", "eagle1"])
    ap.add_argument("--shapes", nargs="+", type=parse_shape, default=None,
                    help="num_steps,topk,num_draft_tokens ... (default: chains 3/5/7 and four trees)")
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.7, 1.0],
                    help="0 = greedy (checked token-identical to plain greedy); > 0 = sampled with --top-p/--top-k")
    ap.add_argument("--top-p", type=float, default=0.9, help="top-p of the sampled temperatures")
    ap.add_argument("--top-k", type=int, default=0, help="top-k of the sampled temperatures (0: off)")
    ap.add_argument("--seed", type=int, default=0,
                    help="sampled runs use seed + 1000 * prompt index + temperature index (the same for every "
                         "head and shape)")
    ap.add_argument("--num-chat", type=int, default=6)
    ap.add_argument("--num-humaneval", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--update-model-cards", action="store_true",
                    help="write the measured tau into the shipped heads' README.md")
    ap.add_argument("--merge", nargs="+", type=Path, default=None,
                    help="combine the results.json of these output folders into --out instead of running")
    return ap


def main(argv=None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if any(t < 0 for t in args.temperatures) or len(set(args.temperatures)) != len(args.temperatures):
        ap.error("--temperatures must be distinct and >= 0")
    if args.merge:
        res = merge([json.loads((d / "results.json").read_text()) for d in args.merge])
        args.heads = sorted({r["head"] for r in res["rows"]})
    else:
        res = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(res, indent=2) + "\n")
    md = table(res)
    (args.out / "results.md").write_text(md)
    plot(res, args.out / "acceptance.png")
    print(md)
    print(f"[bench] wrote {args.out}/results.json, results.md, acceptance.png")
    if args.update_model_cards:
        from spec_plugins.heads import SHIPPED, head_path
        from spec_plugins.training.card import write_card

        greedy = {**res, "rows": [r for r in res["rows"] if _temp(r) == 0]}  # the cards' table is greedy
        for h in args.heads:
            if h in SHIPPED:
                write_card(head_path(h), bench=greedy)
    return 0 if all(r["lossless"] is not False for r in res["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
