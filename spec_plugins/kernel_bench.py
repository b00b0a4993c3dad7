"""Kernel benchmark: mask bytes per request and time per op, per implementation.

    python -m spec_plugins.kernel_bench [--quick] [--out DIR]

For each (batch, T, context) of the grid it prints, per mask mode, the bytes
per request and the build time, then selection, verify and KV-move times, for
every implementation usable on the device (CPU: the torch reference; a GPU:
reference, Triton and CUDA side by side in the same run). Writes
``kernel_bench.json`` to ``--out``. Timings are medians; on a shared CPU they
swing, so compare columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

import spec_tree_kernels as K
from spec_tree_kernels import TreeMaskMode

from .synthetic_trees import synthetic_pool

# (num_steps, topk) that give a pool large enough for T draft tokens
TREE_SHAPES = {8: (5, 4), 16: (5, 4), 32: (6, 8), 64: (8, 8), 128: (8, 8)}
FULL_GRID = dict(batch=(1, 64, 256), nodes=(8, 32, 64), context=(2048, 32768))
QUICK_GRID = dict(batch=(1, 64), nodes=(8, 64), context=(2048,))
KV_LAYERS, KV_HEADS, KV_HEAD_DIM, KV_BLOCK = 30, 8, 128, 16  # a Llama-3-8B-like KV cache per layer (32 layers there)


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median milliseconds of ``fn()`` after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def usable_impls(device: torch.device) -> list[str]:
    impls = ["torch"]
    if K.api.triton_usable(device) and device.type == "cuda":
        impls.append("triton")
    if K.api.cuda_usable(device):
        impls.append("cuda")
    return impls


def bench_point(batch: int, nodes: int, context: int, device: torch.device, impls: list[str], repeats: int) -> list[dict]:
    num_steps, topk = TREE_SHAPES[nodes]
    scores, parent_list = synthetic_pool(batch, topk, num_steps, "random", seed=batch * 1000 + nodes)
    scores, parent_list = scores.to(device), parent_list.to(device)
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device=device)
    selected = K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes)
    tree = K.build_tree(selected, parent_list, seq_lens, topk, num_steps)
    gen = torch.Generator(device="cpu").manual_seed(0)
    candidates = torch.randint(0, 4, (batch, nodes), generator=gen).to(device)
    target = torch.randint(0, 4, (batch, nodes), generator=gen).to(device)
    verdict = K.verify_tree_greedy(candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target, num_steps)
    slots = torch.arange(batch * nodes, device=device).view(batch, nodes)
    kv_blocks = (batch * nodes + KV_BLOCK - 1) // KV_BLOCK
    kv_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    caches = [torch.zeros(kv_blocks, KV_BLOCK, KV_HEADS, KV_HEAD_DIM, dtype=kv_dtype, device=device) for _ in range(2 * KV_LAYERS)]
    rows = []
    base = dict(batch=batch, T=nodes, context=context, num_steps=num_steps, topk=topk)
    for impl in impls:
        row = dict(base, impl=impl)
        row["select_ms"] = timed(
            lambda: K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes, validate=False, impl=impl), device, repeats
        )
        for mode in TreeMaskMode:
            if nodes > K.modes.max_nodes(mode):
                continue
            fills = (True, False) if mode == TreeMaskMode.FULL_MASK else (True,)
            for fill in fills:
                key = f"build_{mode.name}" + ("" if fill or mode != TreeMaskMode.FULL_MASK else "_nofill") + "_ms"
                row[key] = timed(
                    lambda: K.build_tree(
                        selected, parent_list, seq_lens, topk, num_steps, mode,
                        seq_lens_sum=batch * context, fill_prefix_mask=fill, validate=False, impl=impl,
                    ),
                    device,
                    repeats,
                )
        row["verify_ms"] = timed(
            lambda: K.verify_tree_greedy(candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target, num_steps, impl=impl),
            device,
            repeats,
        )
        row["move_kv_ms"] = timed(
            lambda: K.move_accepted_kv(caches, slots, verdict.accept_index, verdict.accept_length, impl=impl), device, repeats
        )
        rows.append(row)
    return rows


def mask_bytes_table(grid: dict) -> list[dict]:
    table = []
    for nodes in grid["nodes"]:
        for context in grid["context"]:
            entry = dict(T=nodes, context=context)
            for mode in TreeMaskMode:
                entry[mode.name] = K.mask_bytes_per_request(mode, nodes, context) if nodes <= K.modes.max_nodes(mode) else None
            table.append(entry)
    return table


def print_tables(bytes_table: list[dict], rows: list[dict]) -> None:
    modes = [m.name for m in TreeMaskMode]
    print("\nTree-mask bytes per request")
    print(f"{'T':>4} {'context':>8} " + " ".join(f"{m:>21}" for m in modes))
    for e in bytes_table:
        print(f"{e['T']:>4} {e['context']:>8} " + " ".join(f"{'n/a' if e[m] is None else e[m]:>21}" for m in modes))
    columns = ["select_ms"] + [f"build_{m}_ms" for m in modes] + ["build_FULL_MASK_nofill_ms", "verify_ms", "move_kv_ms"]
    short = {c: c.replace("build_", "").replace("_ms", "").replace("QLEN_ONLY_BITPACKING", "BITPACK").replace("ANCESTOR_BITMASK", "ANC_BITS").replace("PARENT_POINTER", "PARENT_PTR") for c in columns}
    print("\nMilliseconds per call (median)")
    print(f"{'batch':>5} {'T':>4} {'context':>7} {'impl':>6} " + " ".join(f"{short[c]:>14}" for c in columns))
    for r in rows:
        cells = " ".join(f"{r[c]:>14.3f}" if r.get(c) is not None else f"{'-':>14}" for c in columns)
        print(f"{r['batch']:>5} {r['T']:>4} {r['context']:>7} {r['impl']:>6} {cells}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small grid (CI and CPU smoke runs)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per point (default 20 on GPU, 5 on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (tiny ops run fastest on one)")
    parser.add_argument("--out", default="bench_out", help="folder for kernel_bench.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    grid = QUICK_GRID if args.quick else FULL_GRID
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    impls = usable_impls(device)
    rows = []
    points = [(b, t, c) for b in grid["batch"] for t in grid["nodes"] for c in grid["context"]]
    for i, (batch, nodes, context) in enumerate(points, 1):
        print(f"[{i}/{len(points)}] batch={batch} T={nodes} context={context} impls={impls}", flush=True)
        rows.extend(bench_point(batch, nodes, context, device, impls, repeats))
    bytes_table = mask_bytes_table(grid)
    print_tables(bytes_table, rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        repeats=repeats,
        kv_cache=dict(layers=KV_LAYERS, heads=KV_HEADS, head_dim=KV_HEAD_DIM, block_size=KV_BLOCK),
        mask_bytes_per_request=bytes_table,
        timings_ms=rows,
    )
    (out / "kernel_bench.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out / 'kernel_bench.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
