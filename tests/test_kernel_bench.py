"""The kernel benchmark harness (spec_plugins.kernel_bench) on the CPU: the
timer's figures, bench_point / run_sweep bookkeeping, the tree-ops point's
rows, the reports' arithmetic (per-implementation table, the device check's
headline, issue #17's targets) and the kernel benchmark CLI end to end. The
CUDA timings need a GPU: ci/device_check.sh runs them there."""

from __future__ import annotations

import json
import time

import torch

from spec_plugins.kernel_bench import __main__ as cli
from spec_plugins.kernel_bench.attention import targets, with_ratio_vs_t1
from spec_plugins.kernel_bench.points import Call, bench_point, run_sweep
from spec_plugins.kernel_bench.report import headline, per_impl_table
from spec_plugins.kernel_bench.timer import CPU_TIMER, Timer, describe_error
from spec_plugins.kernel_bench.tree_ops import CONTEXT_FREE_OPS, TREE_SHAPES, KvCacheShape, bench_tree_ops
from spec_tree_kernels import TreeMaskMode, pool_size

CPU = torch.device("cpu")


def test_timer_on_the_cpu_times_warmup_plus_iters_calls():
    calls = []
    timer = Timer(CPU, iters=3, warmup=2, graph_calls=10, flush_l2=True)
    figures = timer.figures(lambda: calls.append(1))
    assert set(figures) == {"eager_us"} and figures["eager_us"] >= 0  # no CUDA graph without CUDA
    assert len(calls) == 5
    cold = timer.cold(lambda: calls.append(1))
    assert cold["timer"] == CPU_TIMER and 0 <= cold["min_us"] <= cold["time_us"]
    assert len(calls) == 10 and timer.flush is None


def test_describe_error():
    assert describe_error(ValueError("x" * 500), 20) == "ValueError: " + "x" * 8
    assert describe_error(KeyboardInterrupt()) == "KeyboardInterrupt"


def test_bench_point_rows_errors_and_deadline():
    def boom():
        raise ValueError("boom")

    calls = [Call("verify", "torch", lambda: None), Call("verify", "triton", boom)]
    rows = bench_point(dict(batch=2, T=8), calls, lambda call: {"eager_us": (call.fn(), 1.5)[1]})
    assert rows == [dict(batch=2, T=8, op="verify", impl="torch", eager_us=1.5),
                    dict(batch=2, T=8, op="verify", impl="triton", error="ValueError: boom")]  # fmt: skip
    assert bench_point({}, calls, lambda call: {}, deadline=time.time() + 5, reserve=10) == []


def test_run_sweep_collects_rows_skips_and_errors():
    seen, saves, rows = [], [], [{"old": True}]

    def bench(point):
        seen.append(point["batch"])
        if point["batch"] == 2:
            raise RuntimeError("no memory")
        return [dict(point, t=1)]

    lines = []
    result = run_sweep([dict(batch=1), dict(batch=2)], bench, name="bench", log=lines.append, rows=rows,
                       after_point=lambda: saves.append(1))  # fmt: skip
    assert result["rows"] is rows and rows == [{"old": True}, dict(batch=1, t=1)]
    assert [e["batch"] for e in result["errors"]] == [2] and "RuntimeError: no memory" in result["errors"][0]["error"]
    assert seen == [1, 2] and len(saves) == 2 and "raised RuntimeError" in lines[1] and result["skipped"] == []
    late = run_sweep([dict(batch=1)], bench, name="bench", deadline=time.time(), reserve=60)
    assert late == {"rows": [], "skipped": [dict(batch=1)], "errors": []} and seen == [1, 2]


def test_tree_shapes_hold_enough_candidates():
    for nodes, (topk, num_steps) in TREE_SHAPES.items():
        assert pool_size(topk, num_steps) >= nodes - 1, nodes


def test_tree_ops_point_times_every_op_once_and_builds_per_context():
    timer = Timer(CPU, iters=1, warmup=0)
    kv = KvCacheShape(layers=1, heads=2, head_dim=4, block_size=4)
    rows = bench_tree_ops(2, 8, (16, 32), ["torch"], timer, kv=kv, vocab=11)
    assert not [r for r in rows if "error" in r], rows
    builds = {f"build_{m.name}" for m in TreeMaskMode} | {"build_FULL_MASK_nofill"}
    assert {r["op"] for r in rows} == set(CONTEXT_FREE_OPS) | builds
    for op in CONTEXT_FREE_OPS:
        assert [r["context"] for r in rows if r["op"] == op] == [16], op
    for op in builds:
        assert [r["context"] for r in rows if r["op"] == op] == [16, 32], op
    assert all(r["eager_us"] > 0 and (r["topk"], r["num_steps"]) == TREE_SHAPES[8] for r in rows)
    assert len({r["accepted_mean"] for r in rows}) == 1


def test_per_impl_table_spreads_context_free_ops_over_contexts():
    base = dict(batch=1, T=8, topk=4, num_steps=3)
    rows = [dict(base, context=2048, op="verify", impl="torch", eager_us=500.0),
            dict(base, context=2048, op="build_QLEN_ONLY", impl="torch", eager_us=100.0),
            dict(base, context=32768, op="build_QLEN_ONLY", impl="torch", eager_us=300.0),
            dict(base, context=2048, op="move_kv", impl="torch", error="RuntimeError: x")]  # fmt: skip
    table = per_impl_table(rows)
    assert [(r["context"], r["build_QLEN_ONLY_ms"]) for r in table] == [(2048, 0.1), (32768, 0.3)]
    assert all(r["verify_ms"] == 0.5 and r["move_kv_error"] == "RuntimeError: x" for r in table)
    assert all((r["num_steps"], r["topk"], r["impl"]) == (3, 4, "torch") for r in table)


def test_headline_adds_the_fastest_impl_per_op_and_compares_with_sglang():
    def row(op, impl, context, graph_us):
        return dict(batch=256, T=8, context=context, op=op, impl=impl, eager_us=graph_us * 2, graph_us=graph_us)

    rows = [row("verify", "cuda", 2048, 2.0), row("verify", "triton", 2048, 3.0), row("move_kv", "cuda", 2048, 20.0),
            row("build_QLEN_ONLY", "cuda", 32768, 5.0), row("build_PARENT_POINTER", "triton", 32768, 4.0),
            row("build_PARENT_POINTER", "cuda", 2048, 1.0),  # another context: not the headline's
            row("build_FULL_MASK", "cuda", 32768, 30.0), row("build_FULL_MASK", "sglang", 32768, 33.0),
            row("verify", "sglang", 2048, 5.0), row("move_kv", "sglang_standin", 2048, 300.0)]  # fmt: skip
    out = headline(rows, ["torch", "triton", "cuda"], (256, 8, 32768))
    assert out["point"] == dict(batch=256, T=8, context=32768)
    graph = out["graph_us"]
    assert graph["ours_by_mode"]["PARENT_POINTER"] == dict(total_us=26.0, build_us=4.0, build_impl="triton", verify_us=2.0,
                                                           verify_impl="cuda", move_us=20.0, move_impl="cuda")  # fmt: skip
    assert graph["sglang"] == dict(total_us=338.0, build_us=33.0, verify_us=5.0, move_us=300.0, move_impl="sglang_standin")
    assert graph["ours_best_mode"] == "PARENT_POINTER" and graph["ratio_sglang_over_ours"] == 13.0
    assert graph["ratio_sglang_over_ours_qlen_only"] == 12.52
    assert out["eager_us"]["ratio_sglang_over_ours"] == 13.0
    assert "sglang" not in headline(rows[:5], ["cuda"], (256, 8, 32768))["graph_us"]


def test_attention_targets_and_ratio_to_t1():
    batch1 = with_ratio_vs_t1([dict(batch=1, T=1, context=4096, time_us=100.0, kv_gbps=1000.0),
                               dict(batch=1, T=8, context=4096, time_us=120.0, kv_gbps=2400.0)])  # fmt: skip
    batch8 = with_ratio_vs_t1([dict(batch=8, T=1, context=4096, time_us=50.0, kv_gbps=3000.0),
                               dict(batch=8, T=8, context=4096, time_us=70.0, kv_gbps=3500.0)])  # fmt: skip
    assert [r["ratio_vs_t1"] for r in batch1 + batch8] == [1.0, 1.2, 1.0, 1.4]
    out = targets(batch1 + batch8, [dict(bytes=1 << 30, gbps=4000.0), dict(bytes=16 << 20, gbps=1000.0)])
    assert out["copy_gbps"] == 4000.0
    assert out["b1_t8_ctx4096"] == dict(kv_gbps=2400.0, fraction_of_copy=0.6, target=0.6, met=True)
    assert out["ratio_t8_t1_b1_ctx4096"] == dict(ratio=1.2, target=1.3, met=True)
    assert out["ratio_t8_t1_b8_ctx4096"] == dict(ratio=1.4, target=1.3, met=False)
    assert targets(batch1, []) == dict(copy_gbps=None, ratio_t8_t1_b1_ctx4096=dict(ratio=1.2, target=1.3, met=True))


def test_kernel_bench_cli_writes_its_json(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "QUICK_GRID", dict(batch=(1,), nodes=(8,), context=(64, 128)))
    assert cli.main(["--quick", "--device", "cpu", "--repeats", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "kernel_bench.json").read_text())
    assert {"device", "torch", "threads", "repeats", "kv_cache", "mask_bytes_per_request", "timings_ms"} <= set(report)
    assert report["kv_cache"] == dict(layers=30, heads=8, head_dim=128, block_size=16) and report["repeats"] == 1
    assert [(r["T"], r["context"]) for r in report["mask_bytes_per_request"]] == [(8, 64), (8, 128)]
    table = report["timings_ms"]
    assert [(r["context"], r["impl"]) for r in table] == [(64, "torch"), (128, "torch")]
    for r in table:
        assert all(r[f"{op}_ms"] > 0 for op in CONTEXT_FREE_OPS), r
        assert all(r[f"build_{m.name}_ms"] > 0 for m in TreeMaskMode) and r["build_FULL_MASK_nofill_ms"] > 0, r
    assert "Milliseconds per call" in capsys.readouterr().out


def test_selection_is_not_timed_for_cuda():
    rows = bench_tree_ops(1, 8, (8,), ["torch", "cuda"], Timer(CPU, iters=1, warmup=0), kv=KvCacheShape(1, 1, 2, 4), vocab=5)
    assert {r["impl"] for r in rows if r["op"] == "select"} == {"torch"}
    assert all("error" in r for r in rows if r["impl"] == "cuda")  # no CUDA tensors here: each call raises, rows say so


def built_host_kernel() -> None:
    """The host kernel built (a build error of ours fails the test); skipped only without a C compiler."""
    import pytest

    from spec_tree_kernels import cpu_attention

    if cpu_attention.find_compiler() is None:
        pytest.skip("no host C compiler to build the kernel")
    assert cpu_attention.build(), cpu_attention.build_error()


def test_cpu_attention_bench_point_times_all_three_on_the_same_rows(capsys):
    """The host-CPU tree attention bench (python -m spec_plugins.kernel_bench.cpu_attention):
    one point times torch and the host kernel on the same rows and the host
    kernel agrees with the torch path; vLLM's kernel only where vLLM is
    importable (the core venv has none)."""
    import importlib.util

    from spec_plugins.kernel_bench import cpu_attention as bench

    built_host_kernel()
    row = bench.bench_point(batch=2, context=150, rounds=3)
    assert row["torch"] > 0 and row["cpu"] > 0 and row["cpu_max_abs_err"] < 1e-4
    assert (row["vllm"] is None) == (importlib.util.find_spec("vllm") is None)
    assert bench.main(["--context", "20", "--batch", "1", "--threads", "1", "--rounds", "2", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cpu: ") and "G float FMA/s register-only" in out  # the machine, then its ceiling
    row = next(line for line in out.splitlines() if line.startswith("| 1 | 1 | 20 |"))
    assert row.split("|")[9].strip().endswith("%")  # the host kernel's share of the FMA ceiling


def test_cpu_attention_bench_roofline_counts_every_lane_and_thread():
    """The FMA ceiling the bench divides by counts every float FMA the loop does:
    all lanes of all threads (the work comes back apart from the time, so no
    clock decides this); the nominal work of one point counted by hand."""
    from spec_plugins.kernel_bench import cpu_attention as bench
    from spec_tree_kernels import cpu_attention

    built_host_kernel()
    iters, chains, lanes = 1000, 12, cpu_attention.register_block_floats()
    assert lanes in (4, 8, 16), lanes
    for threads in (1, 2):
        fmas, seconds = cpu_attention.fma_work(threads, iters)
        assert fmas == iters * chains * lanes * threads and seconds >= 0.0, (threads, fmas, seconds)
    # 4 FLOPs (2 FMAs) per row, position and dim: 1 request x 9 heads x 8 nodes x (150 + 8) positions x 64
    assert bench.nominal_flops(batch=1, context=150) == 4 * 9 * 8 * 158 * 64
    assert bench.ratio_range([1.02, 0.97, 1.10]) == "1.02 [0.97, 1.10]"
