#!/usr/bin/env python3
"""GPU check of the tree kernels: correctness, memory checking, timings.

    bash ci/device_check.sh                 # on the GPU machine (< 8 minutes)
    bash ci/device_check.sh --reduced       # anywhere: CPU, TRITON_INTERPRET=1, tiny sizes

Writes ``$OUT/device_check.json`` (rewritten after every section, so a run cut
short still leaves its results) and ``$OUT/device_check.log``.

Sections (the JSON key of each in brackets):

1. [env] versions, GPU, nvcc / compute-sanitizer, the CUDA kernels' build.
2. [correctness] impl="triton" and impl="cuda" against the torch reference
   on the same device tensors: SGLang-shaped random draft pools (ties,
   probability-one chains, underflow to zero), batch 1..64, T up to 128,
   every mask mode (FULL_MASK with and without prefix fill, open and too-deep
   selections too), greedy verify with real acceptance, sampled verify
   (float32 and float64 target distributions over V = 1537, top-k zeros,
   one-hot rows, a few zero exponentials), KV move on random
   paged caches (fp16 / bf16, vLLM flash K/V halves, SGLang's token pool,
   vLLM CPU's permuted layout, a strided head dim). Pass/fail counts per
   (op, impl), the first failures in detail.
3. [sglang_crosscheck] where $SGLANG_SPEC_TREE_PY names a copy of SGLang
   0.5.23's spec_tree.py (ci/sglang_spec_tree.py): SGLang's Triton build
   (FULL_MASK, QLEN_ONLY) and verify against ours on tie-free pools.
4. [sanitizer] compute-sanitizer memcheck over a small run of every CUDA and
   Triton kernel, racecheck over the CUDA kernels (child processes of this
   script with --sanitizer-child).
5. [bench] CUDA-event medians, eager and CUDA-graph replay, at batch
   1/64/256 x T 8/16/64 x context 2k/32k: select, build per mode (FULL_MASK
   with and without prefix fill), verify, sampled verify (float32 over
   V = 128256), KV move (30 layers of K and V,
   8 KV heads x 128, bf16), torch / triton / cuda side by side, and SGLang's
   own Triton build + verify where available; [headline]: our mask build +
   verify + KV move per step at batch 256, T 8, context 32k against SGLang's.
5b. [graphs] issue #37: the tree step's own ops (a draft level after the
   head, the selection, the greedy walk + last node per walk implementation;
   issue #49: the V2 runner's device step around the target forward: tree
   build from parents, walk, KV move, path-order gather) captured in a CUDA
   graph, replayed on new inputs, compared exactly with
   eager; reduced mode: torch.compile(fullgraph=True) of the same cases.
   Only this section: --skip correctness,sglang,sanitizer,bench,attention,sglang_graphs.
6. [tree_attention] issue #17: split-KV vs single-pass tree attention
   against the torch reference (mixed contexts, every compact mode, three
   dtypes), a device-to-device copy's bandwidth, the sweep batch {1,4,8,64}
   x T {1,8,16,64} x context {1k,4k,32k} (time, K/V bandwidth, ratio to
   T=1, both kernels), other mask modes, a split-count scan, and the issue's
   targets. Only this section: --skip correctness,sglang,sanitizer,bench,graphs,sglang_graphs.
7. [sglang_graphs] issue #38: TARGET_VERIFY as ``spec_tree_triton`` lets
   SGLang's decode graph runner capture it (static block table, lengths and
   mask buffers; the plan captured in a CUDA graph), replayed after the
   lengths change, against the eager step and the reference, per mask mode
   (ANCESTOR_BITMASK, PARENT_POINTER, QLEN_ONLY). Only this section:
   --skip correctness,sglang,sanitizer,bench,graphs,attention.

Reduced mode (--reduced, or no GPU): CPU tensors under TRITON_INTERPRET=1,
tiny sizes, triton against torch only (plus SGLang's kernels when given), a
smoke pass of the benchmark code; about a minute.

Where the work is: ci/device_check_steps/ holds one module per section
(sections.py: their order) and the plumbing (the report, the budget,
tallies); the timings of [bench], [headline] and [tree_attention] are the
repository's one kernel benchmark harness, spec_plugins/kernel_bench/.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from device_check_steps.plumbing import CI, ROOT, import_kernels

FULL_BUDGET_S, REDUCED_BUDGET_S = 450.0, 110.0


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reduced", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny sizes (also without a GPU)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench_out"), help="output folder ($OUT)")
    parser.add_argument("--budget", type=float, default=None,
                        help=f"seconds for the whole run (default {FULL_BUDGET_S:.0f}; {REDUCED_BUDGET_S:.0f} reduced)")  # fmt: skip
    parser.add_argument("--skip", default="", help="comma list of sections to skip: correctness,sglang,sanitizer,bench,graphs,attention,sglang_graphs")
    parser.add_argument("--sanitizer-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impls", default="cuda,triton", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def prepare_process(reduced: bool) -> bool:
    """Settle reduced mode (asked for, or no GPU), TRITON_INTERPRET, the import
    path and this checkout's spec_tree_kernels; True when reduced."""
    import torch

    reduced = reduced or not torch.cuda.is_available()
    if reduced:
        # before anything defines a @triton.jit function (spec_tree_kernels imports tree_attention)
        os.environ["TRITON_INTERPRET"] = "1"
    sys.path[:0] = [str(ROOT), str(CI)]  # spec_plugins (the benchmark harness) and ci/sglang_spec_tree.py
    import_kernels()
    return reduced


def main(argv=None) -> int:
    args = parse_args(argv)
    reduced = prepare_process(args.reduced)
    # The sections import spec_tree_kernels at their top: only now is it this
    # checkout's copy, with TRITON_INTERPRET settled.
    if args.sanitizer_child:
        from device_check_steps.sanitizer import sanitizer_child

        return sanitizer_child(args.impls)
    from device_check_steps.sections import run_sections

    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    budget_s = args.budget or (REDUCED_BUDGET_S if reduced else FULL_BUDGET_S)
    return run_sections(Path(args.out), reduced, budget_s, skip)


if __name__ == "__main__":
    sys.exit(main())
