"""Kernel benchmark: mask bytes per request and time per op, per implementation.

    python -m spec_plugins.kernel_bench [--quick] [--out DIR]     (bash ci/bench.sh)

For each (batch, T) of the grid it times, for every implementation usable on
the device (CPU: the torch reference; a GPU: reference, Triton and CUDA side
by side in the same run), selection, greedy and sampled verify and the KV
move once, and the mask build of each mode at each context
(``tree_ops.bench_tree_ops``: the device check's bench section runs the same
code). It prints the bytes per request of each mask mode and a table of
milliseconds per call, and writes ``kernel_bench.json`` to ``--out``.
Timings are eager medians (CUDA events on a GPU, the wall clock on a CPU);
on a shared CPU they swing, so compare columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import json
import platform
from dataclasses import asdict
from pathlib import Path

import torch

import spec_tree_kernels as K

from .points import run_sweep
from .report import mask_bytes_table, per_impl_table, print_tables
from .timer import Timer
from .tree_ops import LLAMA3_8B_KV, bench_tree_ops

FULL_GRID = dict(batch=(1, 64, 256), nodes=(8, 32, 64), context=(2048, 32768))
QUICK_GRID = dict(batch=(1, 64), nodes=(8, 64), context=(2048,))


def usable_impls(device: torch.device) -> list[str]:
    impls = ["torch"]
    if K.api.triton_usable(device) and device.type == "cuda":
        impls.append("triton")
    if K.api.cuda_usable(device):
        impls.append("cuda")
    return impls


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small grid (CI and CPU smoke runs)")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per point (default 20 on GPU, 5 on CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (tiny ops run fastest on one)")
    parser.add_argument("--out", default="bench_out", help="folder for kernel_bench.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    grid = QUICK_GRID if args.quick else FULL_GRID
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    timer = Timer(device, iters=repeats, warmup=1, graph_calls=0)  # eager figures only
    impls = usable_impls(device)
    print(f"impls: {impls}", flush=True)
    points = [dict(batch=b, T=t) for b in grid["batch"] for t in grid["nodes"]]
    sweep = run_sweep(points, lambda p: bench_tree_ops(p["batch"], p["T"], grid["context"], impls, timer), name="point",
                      log=lambda line: print(line, flush=True))  # fmt: skip
    for error in sweep["errors"]:
        print(f"point {error['batch']}, {error['T']} raised:\n{error['error']}")
    bytes_table, table = mask_bytes_table(grid["nodes"], grid["context"]), per_impl_table(sweep["rows"])
    print_tables(bytes_table, table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = dict(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
        repeats=repeats,
        kv_cache=asdict(LLAMA3_8B_KV),
        mask_bytes_per_request=bytes_table,
        timings_ms=table,
    )
    (out / "kernel_bench.json").write_text(json.dumps(report, indent=1))
    print(f"\nwrote {out / 'kernel_bench.json'}")
    return 1 if sweep["errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
