"""vLLM side-by-side runs: no speculation vs EAGLE chains vs EAGLE trees.

The engine part of ``spec-plugins bench`` and ``spec-plugins check``: every
configuration runs in this process, one after the other, on the same prompts
(chat-templated), greedy, and is compared token for token with the
no-speculation run. Per configuration:

* tokens/s (wall clock of ``generate`` after a warm-up request; requests are
  sent ``concurrency`` at a time) and its ratio to no speculation;
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
    """One configuration. head None = no speculation."""

    head: str | None = None  # head folder
    kind: str | None = None  # "eagle1" | "eagle3"
    shape: tuple | None = None  # (num_steps, topk, num_draft_tokens); topk 1 = chain

    @property
    def name(self) -> str:
        if self.head is None:
            return "no-spec"
        s, k, t = self.shape
        return f"{self.kind} chain({s})" if k == 1 else f"{self.kind} tree({s},{k},{t})"


@dataclass
class RunResult:
    name: str
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
    return {"speculative_config": {"method": METHOD_OF_KIND[cfg.kind], "model": cfg.head},
            "additional_config": {"spec_tree": {"num_steps": s, "topk": k, "num_draft_tokens": t}}}


def _spec_counts(llm) -> tuple[int, int, list]:
    m = llm.get_metrics()
    return (_metric(m, "vllm:spec_decode_num_drafts") or 0, _metric(m, "vllm:spec_decode_num_accepted_tokens") or 0,
            list(_metric(m, "vllm:spec_decode_num_accepted_tokens_per_pos") or []))


def run_config(cfg: SpecConfig, model: str, prompts: list[str], max_tokens: int, concurrency: int = 1,
               progress=None, **engine_extra) -> RunResult:
    """Build the engine, warm it up, then time greedy generation of all prompts."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(model, **engine_extra), **spec_kwargs(cfg))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)  # warm-up
    d0, a0, p0 = _spec_counts(llm)
    stats0 = _runner_stats(llm) if cfg.head else {}
    res = RunResult(cfg.name)
    t0 = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        for out in llm.generate(prompts[i : i + concurrency], params, use_tqdm=False):
            res.tokens.append(list(out.outputs[0].token_ids))
            res.finish_reasons.append(out.outputs[0].finish_reason)
        if progress:
            progress(min(i + concurrency, len(prompts)), len(prompts))
    res.seconds = time.perf_counter() - t0
    res.generated = sum(len(t) for t in res.tokens)
    d1, a1, p1 = _spec_counts(llm)
    res.drafts, res.accepted = d1 - d0, a1 - a0
    res.accepted_per_depth = [b - a for a, b in zip(p0 or [0] * len(p1), p1)]
    if cfg.head:
        stats1 = _runner_stats(llm)
        res.runner = {k: stats1[k] - stats0.get(k, 0) for k in stats1}
    del llm
    gc.collect()
    return res


def _runner_stats(llm) -> dict:
    return llm.collective_rpc("spec_tree_stats")[0]


def first_difference(reference: list[int], got: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(reference, got)):
        if a != b:
            return i
    return None if len(reference) == len(got) else min(len(reference), len(got))


def summarize(base: RunResult, res: RunResult, cfg: SpecConfig) -> dict:
    row = {"config": res.name, "tokens_per_s": round(res.tokens_per_s, 2), "seconds": round(res.seconds, 2),
           "generated": res.generated,
           "identical": res.tokens == base.tokens and res.finish_reasons == base.finish_reasons}
    if cfg.head is None:
        return row
    steps = cfg.shape[0]
    row.update({
        "head": cfg.head, "shape": list(cfg.shape), "speedup": round(res.tokens_per_s / base.tokens_per_s, 3),
        "drafts": res.drafts, "accepted": res.accepted,
        "tau": round(res.tau, 3) if res.tau else None,
        "tau_per_depth": [round(a / res.drafts, 3) if res.drafts else 0.0 for a in res.accepted_per_depth[:steps]],
    })
    r = res.runner
    base_step = base.seconds / max(base.generated, 1)  # t_T: no-spec time per decode step (batch as run)
    if r.get("verify_steps") and r.get("draft_calls") and res.tau:
        t_v = r["verify_seconds"] / r["verify_steps"]
        c = r["draft_seconds"] / r["draft_calls"] / (steps * base_step)
        row["cost_model"] = {"t_T_ms": round(base_step * 1e3, 2), "t_V_over_t_T": round(t_v / base_step, 3),
                             "c": round(c, 3), "predicted_speedup": round(res.tau / (t_v / base_step + steps * c), 3)}
    return row


def table(rows: list[dict]) -> str:
    lines = ["| config | tok/s | speedup | tau | tau per depth | t_V/t_T | c | predicted | identical |",
             "|---|---:|---:|---:|---|---:|---:|---:|:---:|"]
    for r in rows:
        cm = r.get("cost_model", {})
        depth = " ".join(f"{x:.2f}" for x in r.get("tau_per_depth", []))
        lines.append(f"| {r['config']} | {r['tokens_per_s']:.1f} | {r.get('speedup', 1.0):.2f} | "
                     f"{r['tau'] if r.get('tau') else '-'} | {depth or '-'} | {cm.get('t_V_over_t_T', '-')} | "
                     f"{cm.get('c', '-')} | {cm.get('predicted_speedup', '-')} | {'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for kind, marker in (("eagle3", "o"), ("eagle1", "s")):
        pts = sorted((r["shape"][2], r["tau"], r["speedup"]) for r in rows
                     if r.get("shape") and r["config"].startswith(kind))
        if not pts:
            continue
        t, tau, sp = zip(*pts)
        axes[0].plot(t, tau, marker=marker, label=kind)
        axes[1].plot(t, sp, marker=marker, label=kind)
    axes[0].set(xlabel="draft tokens T (incl. root)", ylabel="tau (tokens / verify step)", xscale="log",
                title="tau vs T")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set(xlabel="draft tokens T (incl. root)", ylabel="tokens/s vs no speculation", xscale="log",
                title="vLLM-CPU speedup vs T")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(rows: list[dict], meta: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (out / "results.md").write_text(table(rows) + "\n")
    plot(rows, out / "bench.png")


def as_dict(res: RunResult) -> dict:
    return asdict(res)
