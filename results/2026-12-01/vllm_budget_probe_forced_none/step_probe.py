"""Per-step wall time of plain decode steps: no-spec engine vs budget engine forced to none vs auto.
In-process engines; each step timed from execute_model entry to sample_tokens exit in the worker."""
import os, sys, time, gc, json, statistics
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from spec_plugins import cli, vllm_runs as vr
model = cli.default_model()
prompts = [t for _, t in cli.load_prompts(None, 16, model)]
head = dict(cli.resolve_heads(["eagle3"]))["eagle3"]
CONC = int(sys.argv[1]) if len(sys.argv) > 1 else 16
PROFILE = os.environ.get("PROFILE")

def instrument(worker, force_none=False):
    r = worker.model_runner
    if force_none:
        r.budget.step = lambda B: None
    r._probe = []
    ex, st = r.execute_model, r.sample_tokens
    def execute_model(so, *a, **k):
        r._probe_t0 = time.perf_counter()
        r._probe_n = len(so.num_scheduled_tokens)
        r._probe_tok = so.total_num_scheduled_tokens
        return ex(so, *a, **k)
    def sample_tokens(*a, **k):
        out = st(*a, **k)
        r._probe.append((r._probe_n, r._probe_tok, time.perf_counter() - r._probe_t0))
        return out
    r.execute_model, r.sample_tokens = execute_model, sample_tokens

def collect(worker):
    return worker.model_runner._probe

budget = vr.SpecConfig(head=head, kind="eagle3", shape=(5, 4, 8), budget_menu="none,3,1,4,5,1,6,5,4,8")
runs = [("nospec", vr.SpecConfig(), False), ("forced_none", budget, True)]
out = {}
for rep in range(int(os.environ.get("REPS", "2"))):
    for k in range(len(runs)):
        name, cfg, forced = runs[(rep + k) % len(runs)]
        llm = vr.build_engine(cfg, model, prompts[0])
        llm.collective_rpc(instrument, kwargs={"force_none": forced})
        params = vr.sampling_params(0.0, 64, len(prompts))
        if PROFILE:
            import cProfile, pstats
            pr = cProfile.Profile(); pr.enable()
        t0 = time.perf_counter()
        outs = vr._steady(llm, prompts, params, CONC, None)
        dt = time.perf_counter() - t0
        if PROFILE:
            pr.disable(); pr.dump_stats(f"/tmp/probe/{name}_{rep}.prof")
        steps = llm.collective_rpc(collect)[0]
        full = [s for n, tok, s in steps if n == CONC and tok == CONC]
        rate = sum(len(o.outputs[0].token_ids) for o in outs) / dt
        med = statistics.median(full) * 1e3 if full else float("nan")
        print(rep, name, f"tok/s {rate:.1f}", f"full steps {len(full)}", f"median {med:.2f} ms",
              f"min {min(full)*1e3:.2f} ms" if full else "", flush=True)
        out.setdefault(name, []).append({"rate": rate, "median_ms": med, "min_ms": min(full) * 1e3 if full else None})
        del llm; gc.collect()
print(json.dumps(out))
