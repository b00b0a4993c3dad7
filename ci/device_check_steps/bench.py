"""Section [bench] and [headline]: the tree ops timed side by side, through
the kernel benchmark harness (spec_plugins.kernel_bench: tree_ops.bench_tree_ops
at each (batch, T) of the grid, run_sweep under the run's time budget), and
one tree step's bookkeeping at batch 256, T 8, context 32k against SGLang's
kernels (report.headline)."""

from __future__ import annotations

from spec_plugins.kernel_bench.points import run_sweep
from spec_plugins.kernel_bench.report import headline
from spec_plugins.kernel_bench.timer import Timer
from spec_plugins.kernel_bench.tree_ops import LLAMA3_8B_KV, TREE_SHAPES, KvCacheShape, bench_tree_ops, kv_dtype

from .plumbing import CheckRun

FULL_GRID = dict(batches=(1, 64, 256), nodes=(8, 16, 64), contexts=(2048, 32768))
REDUCED_GRID = dict(batches=(2,), nodes=(8,), contexts=(64,))
REDUCED_KV = KvCacheShape(layers=2, heads=2, head_dim=8, block_size=16)
HEADLINE_POINT = (256, 8, 32768)  # (batch, T, context)
GRAPH_CALLS = 10
POINT_RESERVE_S, CALL_RESERVE_S = 60, 45  # budget a (batch, T) point / one timed call needs to start
FULL_NOTE = ("CUDA-event medians in microseconds; eager_us = one call with the GPU idle before it (host "
             f"launch overhead included), graph_us = one replay of a CUDA graph of {GRAPH_CALLS} back-to-back "
             f"calls / {GRAPH_CALLS} (GPU time per call); warm L2")  # fmt: skip
REDUCED_NOTE = "reduced mode: a smoke run of the benchmark code (CPU, Triton interpreter); timings are meaningless"


def run_bench(run: CheckRun) -> None:
    """bench.rows: {batch, T, topk, num_steps, context, op, impl, eager_us,
    graph_us | graph_error | error, accepted_mean} (tree_ops documents the
    ops); then the headline."""
    grid, kv = (REDUCED_GRID, REDUCED_KV) if run.reduced else (FULL_GRID, LLAMA3_8B_KV)
    section = run.report.data.setdefault("bench", {})
    section["note"] = REDUCED_NOTE if run.reduced else FULL_NOTE
    section["kv_cache"] = dict(layers=kv.layers, kv_heads=kv.heads, head_dim=kv.head_dim, block_size=kv.block_size,
                               dtype=str(kv_dtype(run.device)).removeprefix("torch."))  # fmt: skip
    section["tree_shapes"] = {str(t): dict(topk=TREE_SHAPES[t][0], num_steps=TREE_SHAPES[t][1]) for t in grid["nodes"]}
    section["sglang_kernels"] = run.sgl is not None
    timer = Timer(run.device, iters=1 if run.reduced else 15, warmup=1 if run.reduced else 3, graph_calls=GRAPH_CALLS)
    deadline = run.budget.deadline

    def bench(point: dict) -> list[dict]:
        return bench_tree_ops(point["batch"], point["T"], grid["contexts"], run.impls, timer, kv=kv, sgl=run.sgl,
                              deadline=deadline, reserve=CALL_RESERVE_S)  # fmt: skip

    points = [dict(batch=b, T=t) for b in grid["batches"] for t in grid["nodes"]]
    rows = section.setdefault("rows", [])
    sweep = run_sweep(points, bench, name="bench", deadline=deadline, reserve=POINT_RESERVE_S, log=run.report.log,
                      rows=rows, after_point=run.report.save)  # fmt: skip
    for key, value in (("skipped_for_time", sweep["skipped"]), ("errors", sweep["errors"])):
        if value:
            section.setdefault(key, []).extend(value)
    if run.reduced:  # the arithmetic on the smoke point
        point = (grid["batches"][0], grid["nodes"][0], grid["contexts"][-1])
        run.report.data["headline"] = dict(headline(rows, run.impls, point), note="reduced mode: not a measurement")
    else:
        run.report.data["headline"] = headline(rows, run.impls, HEADLINE_POINT)
    run.report.save()
