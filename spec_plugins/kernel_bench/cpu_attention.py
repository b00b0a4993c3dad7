"""Tree attention on the host CPU: one layer's tree rows, side by side in one run.

    python -m spec_plugins.kernel_bench.cpu_attention [--context 150 400 1500] [--batch 1 8] [--threads 1 2]

Per (threads, batch, context): the median wall time of one call over the same
rows (SmolLM2-135M's attention shape: 9 query / 3 KV heads, D 64, fp32,
vLLM-CPU's 128-token blocks and cache layout, a (5,4,8)-shaped tree of 8
nodes), each call writing into a preallocated output as the engines do, for

* ``torch``: ``TreeAttentionPlan(impl="torch").run`` (gather + batched matmuls),
* ``cpu``: ``TreeAttentionPlan(impl="cpu").run``, the host C kernel through
  the plan, as the vLLM adapter calls it per layer,
* ``vllm``: vLLM's own CPU attention kernel over the same 8 rows as a causal
  chain (the kernel vLLM runs for its own EAGLE chain's verify rows; where
  vLLM is importable),

and the ratios to ``cpu``. The calls are interleaved (a few calls of each per
round, the rounds' orders cycling through every permutation), so a noisy
neighbour slows all three alike and each follows each other equally often. The host kernel's error against the torch path is printed next to its
time. Machines are noisy: this is a ratio in one run, not a timed test.

Each point is measured ``--repeats`` times (each an interleaved median); the
table shows the median and the range of vLLM / cpu over the repeats, so a
ratio whose range straddles 1.0 reads as parity within this machine's noise,
not as a loss or a win.

The roofline: both kernels are FMA loops (q . K, then probs . V), so the
header prints the CPU's features and the float FMAs per second this core's
vector registers sustain (``cpu_attention.fma_per_second``, register-only
chains, per thread count), and each kernel's column "% FMA peak" is its
nominal work (4 B Hq T (context + T) D FLOPs: both passes over every visible
position, the same count for vLLM's causal rows) over that ceiling. A kernel
near the ceiling can only gain by doing less arithmetic.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

import torch

HQ, HKV, DIM, BLOCK, PARENTS = 9, 3, 64, 128, [-1, 0, 0, 1, 1, 2, 3, 3]


def interleaved_median_us(calls: dict, rounds: int, calls_per_sample: int = 4) -> dict:
    """name -> median us of one call: each round times ``calls_per_sample``
    calls of every variant after one untimed call of it, the rounds' orders
    cycling through the permutations of the variants. The untimed call is
    there because a call after the torch path meets caches that path's
    gathers flushed: with every call timed and the orders rotated by one, the
    host kernel followed it in 2 of 3 rounds and vLLM's kernel in 1, which
    cost the host kernel 10% at batch 8 x 400 positions (2026-12-06)."""
    names = list(calls)
    for fn in calls.values():  # warm: first-call allocations, caches, the thread pool
        for _ in range(10):
            fn()
    orders = list(itertools.permutations(names))
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in orders[r % len(orders)]:
            fn = calls[name]
            fn()  # not timed: the caches as this variant leaves them, whichever ran before
            t0 = time.perf_counter()
            for _ in range(calls_per_sample):
                fn()
            samples[name].append((time.perf_counter() - t0) / calls_per_sample)
    return {name: statistics.median(times) * 1e6 for name, times in samples.items()}


def _vllm_call(cache, q, block_table, context: int, batch: int):
    """vLLM's CPU kernel over each request's 8 rows as a causal chain (None: no vLLM here)."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return None
    nodes = len(PARENTS)
    kv = cache.view(cache.shape[0], HKV, BLOCK * 2, DIM)
    key_cache, value_cache = kv.chunk(2, dim=2)
    starts = torch.arange(batch + 1, dtype=torch.int32) * nodes
    seq_lens = torch.full((batch,), context + nodes, dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(batch, HQ, HKV, DIM, seq_lens, torch.float32, starts, True, -1, "vec",
                                               False)
    rows, out = q.reshape(-1, HQ, DIM), torch.empty(batch * nodes, HQ, DIM)
    return lambda: ops.cpu_attention_with_kv_cache(rows, key_cache, value_cache, out, starts, seq_lens, 1 / DIM**0.5,
                                                   True, None, -1, block_table, 0.0, meta, None)


def bench_point(batch: int, context: int, rounds: int) -> dict:
    import spec_tree_kernels as stk
    from spec_tree_kernels import cpu_attention
    from spec_tree_kernels.attention_plan import TreeAttentionPlan

    nodes = len(PARENTS)
    per_request = -(-(context + nodes) // BLOCK)
    num_blocks = batch * per_request + 1
    gen = torch.Generator().manual_seed(batch * 100003 + context)
    cache = torch.randn(num_blocks, HKV, BLOCK, 2 * DIM, generator=gen)  # vLLM-CPU fp32 layout
    k_view = cache.as_strided((num_blocks, BLOCK, HKV, DIM), (cache.stride(0), 1, cache.stride(1), BLOCK))
    v_view = cache.as_strided((num_blocks, BLOCK, HKV, DIM), (cache.stride(0), DIM, cache.stride(1), 1),
                              BLOCK * DIM)
    block_table = torch.randperm(num_blocks, generator=gen)[: batch * per_request].view(batch, per_request).int()
    ctx = torch.full((batch,), context, dtype=torch.int64)
    mask = stk.tree_from_parents(torch.tensor([PARENTS] * batch), ctx, "ancestor_bitmask").tree_mask
    q = torch.randn(batch, nodes, HQ, DIM, generator=gen)
    plans = {impl: TreeAttentionPlan.create(block_table, ctx, mask, "ancestor_bitmask", nodes, BLOCK, context,
                                            impl=impl) for impl in ("torch", "cpu")}
    outs = {impl: torch.empty_like(q) for impl in plans}  # held for the whole run: the calls write into them
    calls = {impl: (lambda plan=plan, out=outs[impl]: plan.run(q, k_view, v_view, out=out))
             for impl, plan in plans.items()}
    vllm = _vllm_call(cache, q, block_table, context, batch)
    if vllm:
        calls["vllm"] = vllm
    row = {"batch": batch, "context": context, "vllm": None, **interleaved_median_us(calls, rounds)}
    row["cpu_max_abs_err"] = float((plans["cpu"].run(q, k_view, v_view) - plans["torch"].run(q, k_view, v_view))
                                   .abs().max())
    return row


def nominal_flops(batch: int, context: int) -> float:
    """Both passes (q . K and probs . V) of every tree row over context + T positions."""
    nodes = len(PARENTS)
    return 4.0 * batch * HQ * nodes * (context + nodes) * DIM


def ratio_range(ratios: list[float]) -> str:
    """``median [min, max]`` of one point's repeats."""
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"


def fma_ceiling(threads: int, tries: int = 5) -> float:
    """The best of a few short register-only FMA runs: contention only lowers it."""
    from spec_tree_kernels import cpu_attention

    return max(cpu_attention.fma_per_second(threads, iters=4_000_000) for _ in range(tries))


def measure_point(threads: int, batch: int, context: int, rounds: int, repeats: int) -> dict:
    """One point, ``repeats`` interleaved measurements: medians, vLLM / cpu per repeat, the worst error."""
    peak = fma_ceiling(threads)
    runs = [bench_point(batch, context, rounds) for _ in range(repeats)]
    row = {"threads": threads, "batch": batch, "context": context, "peak": peak,
           "torch": statistics.median(r["torch"] for r in runs), "cpu": statistics.median(r["cpu"] for r in runs),
           "vllm": None, "vllm_ratios": None, "cpu_max_abs_err": max(r["cpu_max_abs_err"] for r in runs)}
    if runs[0]["vllm"]:
        row["vllm"] = statistics.median(r["vllm"] for r in runs)
        row["vllm_ratios"] = [r["vllm"] / r["cpu"] for r in runs]
    return row


def format_row(r: dict, peak: float) -> str:
    fmas = nominal_flops(r["batch"], r["context"]) / 2

    def peak_share(t_us: float) -> str:
        return f"{100 * fmas / (t_us * 1e-6) / peak:.0f}%" if peak else "-"

    vllm = ((f"{r['vllm']:.0f}", ratio_range(r["vllm_ratios"]), peak_share(r["vllm"])) if r["vllm"]
            else ("-", "-", "-"))
    return (f"| {r['threads']} | {r['batch']} | {r['context']} | {r['torch']:.0f} | {r['cpu']:.0f} | {vllm[0]} | "
            f"{r['torch'] / r['cpu']:.2f} | {vllm[1]} | {peak_share(r['cpu'])} | {vllm[2]} | "
            f"{r['cpu_max_abs_err']:.1e} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, nargs="+", default=[150, 400, 1500])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()],
                        help="OpenMP / torch threads (both kernels run on torch's pool); default: this process's")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="independent interleaved measurements per point")
    args = parser.parse_args(argv)
    from spec_plugins.cpu_features import describe, read_cpuinfo
    from spec_tree_kernels import cpu_attention

    if not cpu_attention.build():
        raise SystemExit(f"the host kernel did not build: {cpu_attention.build_error()}")
    print(describe(read_cpuinfo()))
    print(f"host kernel register block {cpu_attention.register_block_floats()} floats; one layer, 8 tree nodes per "
          f"request, median us of interleaved calls, {args.repeats} repeats per point")
    print("| threads | batch | context | torch | cpu (host kernel) | vLLM causal | torch / cpu | vLLM / cpu "
          "(median [min, max]) | cpu % FMA peak | vLLM % FMA peak | cpu max abs err |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for threads in args.threads:
        torch.set_num_threads(threads)
        rows = [measure_point(threads, batch, context, args.rounds, args.repeats)
                for batch in args.batch for context in args.context]
        # measured before each point and after the sweep: a neighbour can only lower it, so the max of all
        peak = max([fma_ceiling(threads)] + [r["peak"] for r in rows])
        print(f"<!-- {threads} thread(s): {peak / 1e9:.1f} G float FMA/s register-only -->")
        for r in rows:
            print(format_row(r, peak), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
