"""vLLM side-by-side runs: no speculation vs vLLM's own EAGLE chain vs our chains and trees.

The engine part of ``spec-plugins bench`` and ``spec-plugins check``: every
configuration runs in this process, one after the other, on the same prompts
(chat-templated), at each concurrency and temperature (greedy by default;
temperature > 0 samples with top-p 0.9 and one seed per prompt), and greedy
outputs are compared token for token with the no-speculation run. vLLM's own EAGLE chain with the same head
(no ``additional_config``) is the peer every tree is measured against.
Per configuration and concurrency:

* tokens/s (wall clock of ``generate`` after a warm-up request; requests are
  sent ``concurrency`` at a time), its ratio to no speculation and to vLLM's
  own chain with the same head;
* the step-time breakdown of our runner (per drafting step: target forward +
  sampling, the head's forwards, our bookkeeping) so overhead is visible;
* tau = 1 + accepted / drafts (vLLM's "mean acceptance length") and tau per
  depth (accepted at depth d / drafts), from vLLM's own metrics;
* the cost model of the book chapter with measured parts: t_T (no-spec time
  per decode step), t_V(T) (tree verify step: forward + sampling, from the
  runner's timers), c (draft time per step / (num_steps * t_T)); predicted
  speedup tau / (t_V/t_T + num_steps * c) next to the measured one.

Engine settings: vLLM-CPU (or CUDA) V1, fp32, enforce_eager, one process.
"""

from __future__ import annotations

import gc
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from spec_plugins.heads.vllm_check import _metric

METHOD_OF_KIND = {"eagle3": "eagle3", "eagle1": "eagle"}


@dataclass(frozen=True)
class SpecConfig:
    """One configuration. head None = no speculation; engine_chain: vLLM's own
    EAGLE chain of shape[0] tokens (no spec-plugins tree mode)."""

    head: str | None = None  # head folder
    kind: str | None = None  # "eagle1" | "eagle3"
    shape: tuple | None = None  # (num_steps, topk, num_draft_tokens); topk 1 = chain
    engine_chain: bool = False
    budget_menu: str | None = None  # adaptive budget over this menu (shape: its largest entry)

    @property
    def name(self) -> str:
        if self.head is None:
            return "no-spec"
        s, k, t = self.shape
        if self.budget_menu:
            return f"{self.kind} budget({self.budget_menu})"
        if self.engine_chain:
            return f"vllm {self.kind} chain({s})"
        return f"{self.kind} chain({s})" if k == 1 else f"{self.kind} tree({s},{k},{t})"


@dataclass
class RunResult:
    name: str
    concurrency: int = 1
    temperature: float = 0.0
    all_tokens_per_s: list = field(default_factory=list)  # every repeat's tokens/s (this run: the fastest)
    tokens: list = field(default_factory=list)  # per prompt: generated token ids
    finish_reasons: list = field(default_factory=list)
    seconds: float = 0.0
    generated: int = 0
    drafts: int = 0
    accepted: int = 0
    accepted_per_depth: list = field(default_factory=list)
    runner: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float | None:
        return 1 + self.accepted / self.drafts if self.drafts else None


def engine_kwargs(model: str, max_model_len: int = 2048, **extra) -> dict:
    kw = dict(model=model, dtype="float32", max_model_len=max_model_len, seed=0, distributed_executor_backend="uni",
              enforce_eager=True, disable_log_stats=False, enable_prefix_caching=False,
              kv_cache_memory_bytes=512 << 20)
    kw.update(extra)
    return kw


def spec_kwargs(cfg: SpecConfig) -> dict:
    if cfg.head is None:
        return {}
    s, k, t = cfg.shape
    if cfg.engine_chain:
        return {"speculative_config": {"method": METHOD_OF_KIND[cfg.kind], "model": cfg.head,
                                       "num_speculative_tokens": s}}
    tree = {"num_steps": s, "topk": k, "num_draft_tokens": t}
    if cfg.budget_menu:
        tree = {"budget": "auto", "menu": cfg.budget_menu}
    return {"speculative_config": {"method": METHOD_OF_KIND[cfg.kind], "model": cfg.head},
            "additional_config": {"spec_tree": tree}}


def _spec_counts(llm) -> tuple[int, int, list]:
    m = llm.get_metrics()
    return (_metric(m, "vllm:spec_decode_num_drafts") or 0, _metric(m, "vllm:spec_decode_num_accepted_tokens") or 0,
            list(_metric(m, "vllm:spec_decode_num_accepted_tokens_per_pos") or []))


SAMPLED_TOP_P = 0.9  # temperature > 0 runs sample with this top-p


def run_config(cfg: SpecConfig, model: str, prompts: list[str], max_tokens: int, concurrency=1,
               progress=None, temperatures=(0.0,), **engine_extra) -> RunResult | list[RunResult]:
    """Build the engine, warm it up, then time generation of all prompts at
    each temperature and concurrency (concurrency an int and one temperature:
    one RunResult; else a list, temperature-major)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(model, **engine_extra), **spec_kwargs(cfg))
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    levels = concurrency if isinstance(concurrency, (list, tuple)) else [concurrency]
    results = [_timed_run(llm, cfg, prompts, max_tokens, c, t, progress) for t in temperatures for c in levels]
    del llm
    gc.collect()
    return results if isinstance(concurrency, (list, tuple)) or len(temperatures) > 1 else results[0]


def sampling_params(temperature: float, max_tokens: int, n: int) -> list:
    """One SamplingParams per prompt: greedy, or sampled with top-p and a seed per prompt."""
    from vllm import SamplingParams

    if temperature == 0:
        return [SamplingParams(temperature=0.0, max_tokens=max_tokens)] * n
    return [SamplingParams(temperature=temperature, top_p=SAMPLED_TOP_P, seed=i, max_tokens=max_tokens)
            for i in range(n)]


def _timed_run(llm, cfg: SpecConfig, prompts: list[str], max_tokens: int, concurrency: int, temperature: float,
               progress) -> RunResult:
    params = sampling_params(temperature, max_tokens, len(prompts))
    d0, a0, p0 = _spec_counts(llm)
    stats0 = _runner_stats(llm) if cfg.head and not cfg.engine_chain else {}
    res = RunResult(cfg.name, concurrency=concurrency, temperature=temperature)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        for out in llm.generate(prompts[i : i + concurrency], params[i : i + concurrency], use_tqdm=False):
            res.tokens.append(list(out.outputs[0].token_ids))
            res.finish_reasons.append(out.outputs[0].finish_reason)
        if progress:
            progress(min(i + concurrency, len(prompts)), len(prompts))
    res.seconds = time.perf_counter() - t0
    res.generated = sum(len(t) for t in res.tokens)
    d1, a1, p1 = _spec_counts(llm)
    res.drafts, res.accepted = d1 - d0, a1 - a0
    res.accepted_per_depth = [b - a for a, b in zip(p0 or [0] * len(p1), p1)]
    if stats0:
        stats1 = _runner_stats(llm)
        res.runner = {k: _counter_delta(stats1[k], stats0.get(k)) for k in stats1}
    return res


def _counter_delta(after, before):
    """after - before for a runner counter: a number, or a dict of numbers (budget_steps)."""
    if isinstance(after, dict):
        before = before or {}
        return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}
    return after - (before or 0)


def _runner_stats(llm) -> dict:
    return llm.collective_rpc("spec_tree_stats")[0]


def first_difference(reference: list[int], got: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(reference, got)):
        if a != b:
            return i
    return None if len(reference) == len(got) else min(len(reference), len(got))


def summarize(base: RunResult, res: RunResult, cfg: SpecConfig, peer: RunResult | None = None) -> dict:
    """One table row. base: no speculation at the same concurrency and
    temperature; peer: vLLM's own chain with the same head there (None: none
    run). ``identical`` (to no speculation) is None for sampled runs: their
    draws differ by design; their distribution is tested in the test suite."""
    greedy = res.temperature == 0
    row = {"config": res.name, "concurrency": res.concurrency, "temperature": res.temperature,
           "tokens_per_s": round(res.tokens_per_s, 2), "all_tokens_per_s": res.all_tokens_per_s,
           "seconds": round(res.seconds, 2), "generated": res.generated,
           "identical": (res.tokens == base.tokens and res.finish_reasons == base.finish_reasons) if greedy else None}
    if cfg.head is None:
        return row
    steps = cfg.shape[0]
    row.update({
        "head": cfg.head, "kind": cfg.kind, "shape": list(cfg.shape), "engine_chain": cfg.engine_chain,
        "speedup": round(res.tokens_per_s / base.tokens_per_s, 3),
        "vs_vllm_chain": round(res.tokens_per_s / peer.tokens_per_s, 3) if peer and peer is not res else None,
        "drafts": res.drafts, "accepted": res.accepted,
        "tau": round(res.tau, 3) if res.tau else None,
        "tau_per_depth": [round(a / res.drafts, 3) if res.drafts else 0.0 for a in res.accepted_per_depth[:steps]],
    })
    r = res.runner
    if cfg.budget_menu:
        row["budget_menu"], row["budget_steps"] = cfg.budget_menu, r.get("budget_steps", {})
    if r.get("steps"):
        n, head, ours = r["steps"], r["head_seconds"], r["bookkeeping_seconds"]
        target = r["step_seconds"] - head - ours  # target forward + vLLM's own scheduling/sampling
        row["step_ms"] = {"target": round(target / n * 1e3, 2), "head": round(head / n * 1e3, 2),
                          "ours": round(ours / n * 1e3, 2), "ours_share": round(ours / r["step_seconds"], 3)}
    base_step = base.seconds / max(base.generated, 1) * base.concurrency  # t_T: one no-spec decode step
    if r.get("verify_steps") and r.get("draft_calls") and res.tau:
        t_v = r["verify_seconds"] / r["verify_steps"]
        c = r["draft_seconds"] / r["draft_calls"] / (steps * base_step)
        row["cost_model"] = {"t_T_ms": round(base_step * 1e3, 2), "t_V_over_t_T": round(t_v / base_step, 3),
                             "c": round(c, 3), "predicted_speedup": round(res.tau / (t_v / base_step + steps * c), 3)}
    return row


def peer_of(cfg: SpecConfig, configs: list[SpecConfig]) -> SpecConfig | None:
    """vLLM's own chain with the same head: the one with 5 tokens when run, else the longest."""
    chains = [c for c in configs if c.engine_chain and c.head == cfg.head]
    return min(chains, key=lambda c: (c.shape[0] != 5, -c.shape[0]), default=None)


def table(rows: list[dict]) -> str:
    lines = ["| config | conc | temp | tok/s | vs no-spec | vs vLLM chain | tau | tau per depth | step ms: target / "
             "head / ours (ours %) | t_V/t_T | c | predicted | identical |",
             "|---|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|:---:|"]
    for r in rows:
        cm, st = r.get("cost_model", {}), r.get("step_ms")
        depth = " ".join(f"{x:.2f}" for x in r.get("tau_per_depth", []))
        steps = (f"{st['target']} / {st['head']} / {st['ours']} ({100 * st['ours_share']:.0f}%)" if st else "-")
        peer = r.get("vs_vllm_chain")
        same = {True: "yes", False: "NO", None: "n/a (sampled)"}[r["identical"]]
        lines.append(f"| {r['config']} | {r['concurrency']} | {r.get('temperature', 0.0):g} | {r['tokens_per_s']:.1f} | "
                     f"{r.get('speedup', 1.0):.2f} | "
                     f"{f'{peer:.2f}' if peer else '-'} | {r['tau'] if r.get('tau') else '-'} | {depth or '-'} | "
                     f"{steps} | {cm.get('t_V_over_t_T', '-')} | {cm.get('c', '-')} | "
                     f"{cm.get('predicted_speedup', '-')} | {same} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Tokens/s vs no speculation over T, one panel per concurrency (greedy
    runs): our chains and trees as separate series per head, vLLM's own chain
    as a reference line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    rows = [r for r in rows if not r.get("temperature")]
    levels = sorted({r["concurrency"] for r in rows})
    fig, axes = plt.subplots(1, len(levels), figsize=(5.5 * len(levels), 4), squeeze=False)
    colors = {"eagle3": "tab:blue", "eagle1": "tab:orange"}
    for ax, conc in zip(axes[0], levels):
        here = [r for r in rows if r["concurrency"] == conc and r.get("shape")]
        ticks = set()
        for kind, color in colors.items():
            for label, marker, pick in (("chain", "o", lambda r: r["shape"][1] == 1), ("tree", "s",
                                                                                       lambda r: r["shape"][1] > 1)):
                pts = sorted((r["shape"][2], r["speedup"]) for r in here
                             if r["kind"] == kind and not r["engine_chain"] and not r.get("budget_menu") and pick(r))
                if pts:
                    ax.plot(*zip(*pts), marker=marker, color=color, ls="-" if label == "tree" else "--",
                            label=f"ours {kind} {label}")
                    ticks.update(t for t, _ in pts)
            for r in here:
                if r["kind"] == kind and r["engine_chain"]:
                    ax.axhline(r["speedup"], color=color, ls=":", lw=1.2,
                               label=f"vLLM's own {kind} chain({r['shape'][0]})")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(sorted(ticks)))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set(xlabel="draft tokens T (incl. root)", ylabel="tokens/s vs no speculation",
               title=f"vLLM-CPU, concurrency {conc}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_concurrency(rows: list[dict], path: Path) -> None:
    """Tokens/s vs concurrency, one line per configuration (greedy runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("temperature")]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["config"] for r in rows):
        pts = sorted((r["concurrency"], r["tokens_per_s"]) for r in rows if r["config"] == name)
        style = dict(lw=2.5, color="black") if "budget" in name else dict(ls=":" if name.startswith("vllm") else "-")
        ax.plot(*zip(*pts), marker="o", label=name, **style)
    ax.set(xscale="log", xlabel="concurrent requests", ylabel="tokens/s", title="vLLM-CPU, greedy")
    ax.set_xticks(sorted({r["concurrency"] for r in rows}), labels=[str(c) for c in sorted({r["concurrency"]
                                                                                           for r in rows})])
    ax.minorticks_off()
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(rows: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (out / "results.md").write_text(table(rows) + "\n")
    plot(rows, out / "bench.png")
    if len({r["concurrency"] for r in rows}) > 1:
        plot_concurrency(rows, out / "concurrency.png")


def as_dict(res: RunResult) -> dict:
    return asdict(res)
