"""Fresh engines per rep, order rotated: no-spec vs budget engine forced to 'none' vs budget auto,
16 prompts x 64 tokens, steady load at concurrency 16 (vllm_runs._steady)."""
import os, sys, time, gc, itertools, json
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
from spec_plugins import cli, vllm_runs as vr
model = cli.default_model()
prompts = [t for _, t in cli.load_prompts(None, 16, model)]
head = dict(cli.resolve_heads(["eagle3"]))["eagle3"]
CONC = int(sys.argv[1]) if len(sys.argv) > 1 else 16

def force_none(worker):
    worker.model_runner.budget.step = lambda B: None

budget = vr.SpecConfig(head=head, kind="eagle3", shape=(5, 4, 8), budget_menu="none,3,1,4,5,1,6,5,4,8")
runs = [("nospec", vr.SpecConfig(), False), ("forced_none", budget, True), ("auto", budget, False)]
out = {}
for rep in range(3):
    for k in range(len(runs)):
        name, cfg, forced = runs[(rep + k) % len(runs)]
        llm = vr.build_engine(cfg, model, prompts[0])
        if forced:
            llm.collective_rpc(force_none)
        rates = []
        for _ in range(int(os.environ.get("RUNS", "2"))):
            params = vr.sampling_params(0.0, 64, len(prompts))
            t0 = time.perf_counter()
            outs = vr._steady(llm, prompts, params, CONC, None)
            dt = time.perf_counter() - t0
            rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
        out.setdefault(name, []).append([round(r, 1) for r in rates])
        print(rep, name, [round(r, 1) for r in rates], flush=True)
        del llm; gc.collect()
print(json.dumps(out))
