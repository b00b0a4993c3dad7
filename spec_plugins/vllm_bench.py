"""vLLM side-by-side runs: no speculation vs vLLM's own EAGLE chain vs our chains and trees.

``spec-plugins bench`` (repository only: not in the runtime wheel). The engine
runs themselves are ``spec_plugins.vllm_runs`` (runtime: ``spec-plugins check``
uses them), re-exported here. Every configuration runs in this process, one
after the other, on the same prompts (chat-templated), at each concurrency and
temperature (greedy by default; temperature > 0 samples with top-p 0.9 and one
seed per prompt), and greedy outputs are compared token for token with the
no-speculation run. vLLM's own EAGLE chain with the same head (no
``additional_config``) is the peer every tree is measured against.
Per configuration and concurrency:

* tokens/s (wall clock of ``generate`` after a warm-up request; requests are
  sent ``concurrency`` at a time), its ratio to no speculation and to vLLM's
  own chain with the same head;
* the step-time breakdown of our runner (per drafting step: target forward +
  sampling, the head's forwards, our bookkeeping) so overhead is visible;
* tau = 1 + accepted / drafts (vLLM's "mean acceptance length") and tau per
  depth (accepted at depth d / drafts), from vLLM's own metrics;
* the decode speedup: per-request decode tokens/s (vLLM's inter-token
  latency histogram: engine-core time between a request's outputs, so
  prefill, queueing and the frontend are out) over no speculation's;
* the cost model of the book chapter with measured parts (``cost_model``):
  t_T (no-spec decode step, from that histogram), t_V(T) (tree verify step:
  forward + sampling, from the runner's timers), c (draft time per step /
  (num_steps * t_T)); predicted speedup tau / (t_V/t_T + num_steps * c) next
  to the measured decode speedup, as their ratio.

Engine settings: vLLM-CPU (or CUDA), one process; dtype and eager mode from
``vllm_runs.run_profile`` (fp32 and eager on a CPU, vLLM's defaults on CUDA:
the model's dtype, CUDA graphs on), the same for every configuration.

``run_interleaved`` (``spec-plugins bench --interleave ROUNDS``) instead keeps
every configuration's engine alive at once, each in its own engine-core
process, and runs the configurations in rounds (order rotated each round), so
a drift of a shared machine's speed hits every configuration alike: tokens/s
is the median round, ratios are medians of per-round ratios.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from itertools import zip_longest
from pathlib import Path

from spec_plugins import bench_noise

# the engine part (part of the runtime distribution, for ``spec-plugins check``), re-exported here
from spec_plugins.vllm_runs import (  # noqa: F401
    METHOD_OF_KIND,
    RUN_ENGINE_SIZE,
    SAMPLED_TOP_P,
    RunResult,
    SpecConfig,
    _combine_counters,
    _counter_delta,
    _metric,
    _runner_stats,
    _spec_counts,
    _timed_run,
    build_engine,
    engine_kwargs,
    first_difference,
    run_config,
    sampling_params,
    spec_kwargs,
)


# --------------------------------------------------------------- interleaved

MP_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
GiB = 1 << 30
MEMORY_MARGIN = 2 * GiB  # left free beyond one more engine's RSS before building it


@dataclass
class LiveEngine:
    """One engine of an interleaved run. ``collectors``: its Prometheus
    metrics. Each engine's stat logger unregisters the previous engine's from
    the global registry that ``llm.get_metrics()`` reads, so they are put back
    before the engine runs. ``pids``: its processes (the engine core)."""

    cfg: SpecConfig
    llm: object
    collectors: list
    pids: list


def rotation(n: int, r: int) -> list[int]:
    """Indices of n configurations in round r's order (r from 0): it starts at r mod n."""
    return [(r + i) % n for i in range(n)]


def rounds_per_level(rounds, levels) -> dict:
    """{concurrency: rounds}. rounds: one count for every level, or a list of
    one count or of one per level (rounds at high concurrency are short, and
    more of them is what narrows a ratio there)."""
    counts = [rounds] if isinstance(rounds, int) else list(rounds)
    if len(counts) == 1:
        counts = counts * len(levels)
    if len(counts) != len(levels):
        raise ValueError(f"--interleave takes one round count or one per --concurrency level {list(levels)}; "
                         f"got {list(counts)}")
    return dict(zip(levels, counts))


def interleaved_schedule(n: int, levels, rounds, temperatures=(0.0,)) -> list[tuple]:
    """(temperature, concurrency, round, configuration index) in run order;
    rounds as ``rounds_per_level`` takes them. A round run prompt by prompt
    (``round_slices``) takes its order rotated by one more per prompt."""
    per_level = rounds_per_level(rounds, levels)
    return [(t, c, r, i) for t in temperatures for c in levels for r in range(per_level[c]) for i in rotation(n, r)]


def round_slices(num_prompts: int, concurrency: int) -> list[list[int]]:
    """How one round runs the prompt set on each engine: at concurrency 1, one
    prompt at a time, every configuration in turn (rotated per prompt), so a
    drift of the machine within the round hits every configuration alike;
    above, the whole set in one go (a steady load needs the requests in flight)."""
    if concurrency == 1:
        return [[k] for k in range(num_prompts)]
    return [list(range(num_prompts))]


def join_slices(runs: list[RunResult]) -> RunResult:
    """One round's RunResult from its slices (``round_slices``): outputs in
    prompt order, seconds, tokens and counters summed."""
    first = runs[0]
    return RunResult(first.name, first.concurrency, first.temperature,
                     tokens=[t for r in runs for t in r.tokens],
                     finish_reasons=[f for r in runs for f in r.finish_reasons], **_summed(runs))


def run_interleaved(configs: list[SpecConfig], model: str, prompts: list[str], max_tokens: int, levels,
                    rounds, temperatures=(0.0,), log=None, progress=None, load: str = "steady",
                    warmup_rounds: int = 1, **engine_extra) -> dict:
    """{(config, concurrency, temperature): RunResult} with every
    configuration's engine alive at once (each warmed up once): per
    temperature and level, ``warmup_rounds`` rounds whose results are dropped
    (a level's first requests meet new shapes: oneDNN builds a primitive per
    GEMM shape, the allocator grows; measured, the first round ran 20-25 % slower
    for every configuration), then ``rounds`` rounds (``rounds_per_level``) in each of which every
    configuration runs the whole prompt set, in rotated order, at
    concurrency 1 prompt by prompt (``round_slices``; see ``merge_rounds`` for
    what a RunResult then holds). log: takes a line of
    text; progress: label -> callback(done, total)."""
    log = log or (lambda line: None)
    runs = {}
    per_level = rounds_per_level(rounds, levels)
    schedule = interleaved_schedule(len(configs), levels, rounds, temperatures)  # a bad count fails here, early
    with _multiprocess_engines():
        engines = start_engines(configs, model, prompts[0], log,
                                **{"distributed_executor_backend": _executor_in_engine_core(), **engine_extra})

        def run_round(order: list[int], level: int, temp: float, label: str) -> dict[int, RunResult]:
            slices = round_slices(len(prompts), level)
            parts: dict[int, list] = {}
            round_bar = progress(f"all configurations c{level} {label}") if progress and len(slices) > 1 else None
            for s_idx, chunk in enumerate(slices):
                for i in order[s_idx % len(order):] + order[: s_idx % len(order)]:  # rotated per slice
                    e = engines[i]
                    _use_collectors(e.collectors)
                    show = progress(f"{e.cfg.name} c{level} {label}") if progress and len(slices) == 1 else None
                    parts.setdefault(i, []).append(
                        _timed_run(e.llm, e.cfg, [prompts[k] for k in chunk], max_tokens, level, temp, show, load))
                if round_bar:
                    round_bar(s_idx + 1, len(slices))
            return {i: join_slices(slice_runs) for i, slice_runs in parts.items()}

        try:
            for (temp, level, r), entries in itertools.groupby(schedule, key=lambda entry: entry[:3]):
                order = [i for *_, i in entries]
                if r == 0:
                    for w in range(warmup_rounds):
                        run_round(order, level, temp, f"warm-up {w + 1}/{warmup_rounds} (not counted)")
                for i, result in run_round(order, level, temp, f"r{r + 1}/{per_level[level]}").items():
                    runs.setdefault((engines[i].cfg, level, temp), []).append(result)
            log("after the runs: " + memory_report(engines))
        finally:
            stop_engines(engines)
    return {key: merge_rounds(v) for key, v in runs.items()}


def _multiprocess_engines():
    """Each engine in its own engine-core process while inside (``_engine_processes``)."""
    return _engine_processes("1")


@contextmanager
def _engine_processes(value: str):
    """VLLM_ENABLE_V1_MULTIPROCESSING=value while inside ("1": each engine in
    its own engine-core process; "0": in this process). vLLM freezes its
    environment once an engine core starts in this process (an earlier
    in-process engine), so that cache is dropped; the old value comes back
    afterwards."""
    import vllm.envs as envs

    old = os.environ.get(MP_ENV)
    os.environ[MP_ENV] = value
    envs.disable_envs_cache()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(MP_ENV, None)
        else:
            os.environ[MP_ENV] = old


def _executor_in_engine_core():
    """vLLM's single-process executor, as a class: the model runs inside the
    engine-core process, as in the in-process mode. The string "uni" would not
    do: with engines in their own processes vLLM-CPU turns it into its
    multiprocess executor, which puts the model in one more process (+0.6 GiB)
    and reserves a core for the engine core's busy polling (on a 2-core machine
    the model then gets one thread instead of two: no-spec at half speed)."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor

    return UniProcExecutor


def census_configs(configs: list[SpecConfig], model: str, prompts: list[str], max_tokens: int, log,
                   **engine_extra) -> dict:
    """{config name: per engine step with drafts (no-spec: every step after the
    first) the mean host syncs of our code and of all code, and the non-view
    ops on device tensors (about one kernel launch each on a GPU)}, from one
    greedy run of ``prompts`` per configuration under
    ``spec_plugins.host_reads``'s census. In-process engines whose buffers'
    host and device halves are kept apart (the census tells them apart); the
    census slows a step several times over, so these runs are not timed.
    ``engine_extra``: engine settings (the run's ``run_profile``)."""
    import statistics

    from vllm import LLM

    from spec_plugins.host_reads import census_runner_steps, separate_cpu_runner_buffers

    found = {}
    with _engine_processes("0"):
        for cfg in configs:
            with separate_cpu_runner_buffers():
                llm = LLM(**engine_kwargs(model, max_model_len=RUN_ENGINE_SIZE["max_model_len"],
                                          kv_cache_memory_bytes=RUN_ENGINE_SIZE["kv_cache_memory_bytes"],
                                          **engine_extra), **spec_kwargs(cfg))
            runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
            with census_runner_steps(runner) as steps:
                llm.generate(prompts, sampling_params(0.0, max_tokens, len(prompts)), use_tqdm=False)
            counted = [s for s in steps if s.tree_step] if cfg.head else steps[1:]
            found[cfg.name] = {"steps": len(counted),
                               **{key: round(statistics.mean(fn(s.counts) for s in counted), 1) if counted else None
                                  for key, fn in (("syncs_ours", lambda c: c.syncs("ours")),
                                                  ("syncs_all", lambda c: c.syncs()), ("ops", lambda c: c.ops))}}
            log(f"{cfg.name}: census {found[cfg.name]}")
            del llm, runner
            gc.collect()
    return found


def start_engines(configs: list[SpecConfig], model: str, warmup_prompt: str, log, **engine_extra) -> list:
    """One warmed-up LiveEngine per configuration; refuses to build one more
    when the memory available would not hold it. On any failure the engines
    already built are shut down."""
    engines = []
    try:
        for cfg in configs:
            if engines:
                _check_memory_for_another(engines[-1])
            before, t0 = _child_pids(), time.perf_counter()
            llm = build_engine(cfg, model, warmup_prompt, **engine_extra)
            engines.append(LiveEngine(cfg, llm, _vllm_collectors(), sorted(_child_pids() - before)))
            log(f"{cfg.name}: engine ready ({time.perf_counter() - t0:.0f} s)")
    except BaseException:
        stop_engines(engines)
        raise
    log(memory_report(engines))
    return engines


def stop_engines(engines: list) -> None:
    """Shut the engines' processes down, all at once (each may take vLLM's 5 s grace period)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max(len(engines), 1)) as pool:
        list(pool.map(lambda e: e.llm.llm_engine.engine_core.shutdown(), engines))
    engines.clear()
    gc.collect()


def _child_pids() -> set:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _rss(pids) -> int:
    import psutil

    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def memory_report(engines: list) -> str:
    import psutil

    sizes = [_rss(e.pids) for e in engines]
    return (f"{len(engines)} engines alive, RSS " + ", ".join(f"{e.cfg.name} {b / GiB:.2f}" for e, b in
                                                              zip(engines, sizes))
            + f" GiB; total {sum(sizes) / GiB:.1f} GiB + {psutil.Process().memory_info().rss / GiB:.1f} GiB this "
              f"process; {psutil.virtual_memory().available / GiB:.1f} GiB still available")


def _check_memory_for_another(last: LiveEngine) -> None:
    import psutil

    need, free = _rss(last.pids) + MEMORY_MARGIN, psutil.virtual_memory().available
    if free < need:
        raise MemoryError(f"spec-plugins bench --interleave: {free / GiB:.1f} GiB available, one more engine needs "
                          f"about {need / GiB:.1f} GiB (the last one's RSS + {MEMORY_MARGIN / GiB:.0f} GiB margin): "
                          "run fewer configurations at once")


def _vllm_collectors() -> list:
    """vLLM's Prometheus collectors now in the global registry (those of the engine built last)."""
    from prometheus_client import REGISTRY

    return [c for c in list(REGISTRY._collector_to_names) if getattr(c, "_name", "").startswith("vllm:")]


def _use_collectors(collectors: list) -> None:
    """Make these the vLLM metrics ``llm.get_metrics()`` reads (see LiveEngine)."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    unregister_vllm_metrics()
    for c in collectors:
        REGISTRY.register(c)


def merge_rounds(runs: list[RunResult]) -> RunResult:
    """One RunResult for a configuration's rounds: every round kept in
    ``rounds`` (so tokens/s is the median round's, ratios pair rounds) and
    its tokens/s in ``all_tokens_per_s``; tokens and finish reasons of the
    first round (``same_outputs`` checks them all); seconds, tokens generated,
    spec counters, decode timing and runner stats summed."""
    first = runs[0]
    return RunResult(first.name, first.concurrency, first.temperature,
                     all_tokens_per_s=[round(r.tokens_per_s, 2) for r in runs],
                     tokens=first.tokens, finish_reasons=first.finish_reasons, rounds=list(runs), **_summed(runs))


def _summed(runs: list[RunResult]) -> dict:
    """The RunResult fields that add up over runs: time, tokens, vLLM's counters, runner stats."""
    return {"seconds": sum(r.seconds for r in runs), "generated": sum(r.generated for r in runs),
            "drafts": sum(r.drafts for r in runs), "accepted": sum(r.accepted for r in runs),
            "accepted_per_depth": [sum(x) for x in zip_longest(*(r.accepted_per_depth for r in runs), fillvalue=0)],
            "runner": _sum_counters([r.runner for r in runs]),
            "decode_steps": sum(r.decode_steps for r in runs), "decode_seconds": sum(r.decode_seconds for r in runs),
            "decode_tokens": sum(r.decode_tokens for r in runs)}


def _sum_counters(stats: list[dict]) -> dict:
    """Runner stats deltas of several runs added up (numbers, or dicts of numbers: budget_steps)."""
    out = {}
    for s in stats:
        for k, v in s.items():
            out[k] = _combine_counters(out.get(k), v, 1)
    return out


def round_ratios(res: RunResult, ref: RunResult, rate=lambda run: run.tokens_per_s) -> list[float]:
    """rate(res) / rate(ref) (tokens/s unless told), round by round when both
    ran in the same rounds (interleaved); else the one ratio of their rates."""
    pairs = list(zip(res.rounds, ref.rounds)) if res.rounds and ref.rounds else [(res, ref)]
    return [rate(a) / rate(b) for a, b in pairs]


def paired_ratio(res: RunResult, ref: RunResult, rate=lambda run: run.tokens_per_s) -> float:
    """The median of ``round_ratios``: a drift between rounds cancels out."""
    return statistics.median(round_ratios(res, ref, rate))


def decode_rate(run: RunResult) -> float:
    return run.decode_tokens_per_s


def _outputs(run: RunResult) -> tuple:
    return tuple(map(tuple, run.tokens)), tuple(run.finish_reasons)


def same_outputs(res: RunResult, base: RunResult) -> bool:
    """Every round of res and of base (or each one run) produced the same tokens and finish reasons."""
    return len({_outputs(r) for r in (res.rounds or [res]) + (base.rounds or [base])}) == 1


def summarize(base: RunResult, res: RunResult, cfg: SpecConfig, peer: RunResult | None = None) -> dict:
    """One table row. base: no speculation at the same concurrency and
    temperature; peer: vLLM's own chain with the same head there (None: none
    run). ``identical`` (to no speculation) is None for sampled runs: their
    draws differ by design; their distribution is tested in the test suite.
    Interleaved runs: tokens/s is the median round, ``speedup`` and
    ``vs_vllm_chain`` the medians of the per-round ratios, and ``identical``
    covers every round."""
    greedy = res.temperature == 0
    row = {"config": res.name, "concurrency": res.concurrency, "temperature": res.temperature,
           "tokens_per_s": round(res.tokens_per_s, 2), "all_tokens_per_s": res.all_tokens_per_s,
           "seconds": round(res.seconds, 2), "generated": res.generated,
           "identical": same_outputs(res, base) if greedy else None}
    if cfg.head is None:
        return row
    steps = cfg.shape[0]
    row.update({
        "head": cfg.head, "kind": cfg.kind, "shape": list(cfg.shape), "engine_chain": cfg.engine_chain,
        "speedup": round(paired_ratio(res, base), 3),
        "vs_vllm_chain": round(paired_ratio(res, peer), 3) if peer and peer is not res else None,
        "drafts": res.drafts, "accepted": res.accepted,
        "tau": round(res.tau, 3) if res.tau else None,
        "tau_vs_vllm_chain": round(res.tau / peer.tau, 3) if peer and peer is not res and peer.tau and res.tau else None,
        "tau_per_depth": [round(a / res.drafts, 3) if res.drafts else 0.0 for a in res.accepted_per_depth[:steps]],
    })
    if res.rounds:  # interleaved: the per-round ratios behind the medians
        row["all_speedup"] = [round(x, 3) for x in round_ratios(res, base)]
        if row["vs_vllm_chain"]:
            row["all_vs_vllm_chain"] = [round(x, 3) for x in round_ratios(res, peer)]
    r = res.runner
    if cfg.budget_menu:
        row["budget_menu"], row["budget_steps"] = cfg.budget_menu, r.get("budget_steps", {})
    if r.get("steps"):
        n, head, ours = r["steps"], r["head_seconds"], r["bookkeeping_seconds"]
        target = r["step_seconds"] - head - ours  # target forward + vLLM's own scheduling/sampling
        row["step_ms"] = {"target": round(target / n * 1e3, 2), "head": round(head / n * 1e3, 2),
                          "ours": round(ours / n * 1e3, 2), "ours_share": round(ours / r["step_seconds"], 3)}
    if res.decode_seconds and base.decode_seconds:
        decode_speedup = paired_ratio(res, base, decode_rate)
        row["decode_speedup"] = round(decode_speedup, 3)
        row.update(cost_model(base, res, steps, decode_speedup))
    return row


def cost_model(base: RunResult, res: RunResult, num_steps: int, measured: float) -> dict:
    """{"cost_model": ...}: the book chapter's predicted speedup
    tau / (t_V / t_T + num_steps * c) from measured parts, next to the
    ``measured`` decode speedup ({} without the timings). Decode only on both
    sides, as the model is, and every time per decoding request-step (the
    unit of vLLM's inter-token latency, so a step serving 8 requests weighs
    8 times one serving 1): t_T is no speculation's engine-core step (its
    mean inter-token latency, which also holds the engine's own work around
    the runner: a conservative t_T, it raises the prediction); t_V(T)
    (target forward + sampling + our walk) and c (extend + drafting + our
    bookkeeping, per draft step, over t_T) come from our runner's timers."""
    r, t_T = res.runner, base.decode_step_seconds
    n = r.get("decode_request_steps")
    if not (t_T and n and res.tau):
        return {}
    t_v = r["decode_verify_seconds"] / n
    c = r["decode_draft_seconds"] / n / (num_steps * t_T)
    predicted = res.tau / (t_v / t_T + num_steps * c)
    return {"cost_model": {"t_T_ms": round(t_T * 1e3, 2), "t_V_over_t_T": round(t_v / t_T, 3), "c": round(c, 3),
                           "predicted_speedup": round(predicted, 3),
                           # the same count two ways: a mismatch means the weights above are not vLLM's
                           "decode_request_steps": {"runner": n, "vllm": res.decode_steps},
                           "measured_over_predicted": round(measured / predicted, 3)}}


def peer_of(cfg: SpecConfig, configs: list[SpecConfig]) -> SpecConfig | None:
    """vLLM's own chain with the same head: the one with 5 tokens when run, else the longest."""
    chains = [c for c in configs if c.engine_chain and c.head == cfg.head]
    return min(chains, key=lambda c: (c.shape[0] != 5, -c.shape[0]), default=None)


def table(rows: list[dict]) -> str:
    """The results table. tok/s is followed by its rounds' spread (interleaved
    runs); a ratio marked ~ is one whose rounds disagree by more than its
    distance from 1 (``bench_noise.unresolved``)."""
    lines = ["| config | conc | temp | tok/s (rounds' spread) | vs no-spec | vs vLLM chain | tau | tau vs vLLM chain | "
             "tau per depth | step ms: target / head / ours (ours %) | t_V/t_T | c | decode vs no-spec | predicted | "
             "measured / predicted | identical | host syncs ours / all, ops per step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|:---:|---|"]
    for r in rows:
        cm, st = r.get("cost_model", {}), r.get("step_ms")
        depth = " ".join(f"{x:.2f}" for x in r.get("tau_per_depth", []))
        steps = (f"{st['target']} / {st['head']} / {st['ours']} ({100 * st['ours_share']:.0f}%)" if st else "-")
        same = {True: "yes", False: "NO", None: "n/a (sampled)"}[r["identical"]]
        rounds = bench_noise.spread(r.get("all_tokens_per_s"))
        speed = f"{r['tokens_per_s']:.1f}" + (f" ({rounds:.0%})" if rounds is not None else "")
        vs_base = bench_noise.marked(r.get("speedup", 1.0), r.get("all_speedup"))
        lines.append(f"| {r['config']} | {r['concurrency']} | {r.get('temperature', 0.0):g} | {speed} | {vs_base} | "
                     f"{bench_noise.marked(r.get('vs_vllm_chain'), r.get('all_vs_vllm_chain'))} | "
                     f"{r['tau'] if r.get('tau') else '-'} | {r.get('tau_vs_vllm_chain') or '-'} | {depth or '-'} | "
                     f"{steps} | {cm.get('t_V_over_t_T', '-')} | {cm.get('c', '-')} | {r.get('decode_speedup', '-')} | "
                     f"{cm.get('predicted_speedup', '-')} | {cm.get('measured_over_predicted', '-')} | {same} | "
                     f"{census_cell(r.get('census'))} |")
    return "\n".join(lines)


def census_cell(census: dict | None) -> str:
    """"1 / 4, 1912" (``census_configs``), or "-" without a census (``--census``)."""
    if not census or census.get("ops") is None:
        return "-"
    return f"{census['syncs_ours']:g} / {census['syncs_all']:g}, {census['ops']:.0f}"


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


def write_report(rows: list[dict], meta: dict, out: Path, summary: list[str] = ()) -> None:
    """results.json (meta, summary, rows), results.md (the summary, then the table), the plots."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"meta": meta, "summary": list(summary), "rows": rows}, indent=2)
                                      + "\n")
    head = "".join(f"- {line}\n" for line in summary) + "\n" if summary else ""
    (out / "results.md").write_text(head + table(rows) + "\n")
    plot(rows, out / "bench.png")
    if len({r["concurrency"] for r in rows}) > 1:
        plot_concurrency(rows, out / "concurrency.png")


def as_dict(res: RunResult) -> dict:
    return asdict(res)
