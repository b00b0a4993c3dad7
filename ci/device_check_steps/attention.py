"""Section [tree_attention], issue #17, in order of priority:

1. correctness: split / single / auto against the torch reference, mixed
   context lengths per batch (0, block boundaries, long), every compact
   mask mode, bf16/fp16/fp32 (``check_tree_attention``, here);
2. copy: plain device-to-device copy bandwidth (1 GiB and 16 MB), the yardstick;
3. sweep: batch {1,4,8,64} x T {1,8,16,64} x context {1k,4k,32k},
   ANCESTOR_BITMASK, Llama-3-8B layer (32/8 heads, D 128, bf16, 16-token
   blocks): time (CUDA graph replay, L2 flushed), K/V bandwidth, ratio to
   T=1, the dispatcher's kernel and the other kernel's time, error
   against the reference on the first two requests;
4. modes: PARENT_POINTER and QLEN_ONLY at batch {1,8} x T {8,64} x 4k;
5. tune: forced split counts at a few points (retunes plan_tree_attention);
6. targets: the issue's acceptance figures from 2 and 3.

Steps 2 to 6 are the benchmark harness's (spec_plugins.kernel_bench.attention).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import torch

from spec_plugins.kernel_bench import attention as ab
from spec_tree_kernels.attention_reference import tree_attention_reference
from spec_tree_kernels.attention_triton import plan_tree_attention, tree_attention_triton

from .plumbing import CheckRun

# (dtype, mode, T, Hq, Hkv, D, block_size, context lengths, kernel kwargs): mixed contexts per batch
CHECK_CASES = [
    ("bfloat16", "ANCESTOR_BITMASK", 8, 32, 8, 128, 16, (0, 1, 15, 16, 17, 1000, 4099, 127), {}),
    ("bfloat16", "ANCESTOR_BITMASK", 8, 32, 8, 128, 16, (0, 1, 15, 16, 17, 1000, 4099, 127), dict(kernel="single")),
    ("bfloat16", "PARENT_POINTER", 64, 32, 8, 128, 16, (3000, 0, 64), dict(kernel="split", num_splits=7)),
    ("float16", "QLEN_ONLY", 16, 32, 8, 128, 1, (500, 129), dict(kernel="split", num_splits=3)),
    ("bfloat16", "ANCESTOR_BITMASK", 160, 8, 2, 64, 16, (700, 0, 33), dict(kernel="split")),
    ("float32", "PARENT_POINTER", 24, 4, 2, 64, 16, (300, 5), dict(kernel="split", num_splits=4)),
    ("bfloat16", "ANCESTOR_BITMASK", 1, 32, 8, 128, 16, (8191, 2), dict(kernel="split", num_splits=64)),
]
CHECK_CASES_REDUCED = [  # CPU interpreter: small heads, short contexts, chunks of 16
    ("float32", "ANCESTOR_BITMASK", 8, 4, 2, 16, 16, (0, 5, 16, 40), dict(kernel="split", num_splits=3, split_min_tokens=16)),
    ("bfloat16", "PARENT_POINTER", 20, 4, 2, 16, 5, (33, 0), dict(kernel="split", num_splits=2, split_min_tokens=16)),
    ("float16", "QLEN_ONLY", 4, 2, 1, 16, 16, (17,), dict(kernel="single")),
]
CHECK_TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}
PLAN_KEYS = ("kernel", "num_splits", "split_min_tokens")  # the kernel kwargs plan_tree_attention takes
OTHER_MODES = ("PARENT_POINTER", "QLEN_ONLY")
SWEEP_NOTES = dict(layer="Llama-3-8B: 32 query / 8 KV heads, D 128, bf16, block 16",
                   timer="median of 10 CUDA-graph replays of one call, L2 flushed (256 MB write) before each",
                   kv_gbps="K and V bytes of context + T positions / time")  # fmt: skip


# ------------------------------------------------------------- correctness


def check_tree_attention(device="cuda", cases=None, seed: int = 0) -> dict:
    """Triton (split, single, auto) against the torch reference on requests of
    mixed context lengths (0, block boundaries, long) with random paged
    blocks: {"passed", "failed", "cases": [...]}. ``cases`` defaults to
    CHECK_CASES on CUDA and CHECK_CASES_REDUCED elsewhere."""
    device = torch.device(device)
    if cases is None:
        cases = CHECK_CASES if device.type == "cuda" else CHECK_CASES_REDUCED
    results = [check_attention_case(case, seed + i, device) for i, case in enumerate(cases)]
    passed = sum(entry["ok"] for entry in results)
    return {"passed": passed, "failed": len(results) - passed, "cases": results}


def mixed_context_args(case: tuple, gen: torch.Generator, device: torch.device) -> tuple:
    """tree_attention's arguments for one CHECK_CASES entry: q [B, T, Hq, D],
    caches [blocks, block_size, Hkv, D] whose blocks each request owns in a
    random order, block_table [B, max blocks + 1] int32 (a spare column of
    unused entries), context_lens [B] int32, a random tree's mask."""
    dtype_name, mode, nodes, hq, hkv, dim, block_size, contexts, _ = case
    dtype, batch = getattr(torch, dtype_name), len(contexts)
    need = [-(-(c + nodes) // block_size) for c in contexts]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(batch, max(need) + 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    k_cache = torch.randn(num_blocks, block_size, hkv, dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, dim, generator=gen).to(device, dtype)
    q = torch.randn(batch, nodes, hq, dim, generator=gen).to(device, dtype)
    mask = ab.mask_from_parents(ab.random_parents(batch, nodes, gen), mode).to(device)
    return (q, k_cache, v_cache, table.to(device), torch.tensor(contexts, dtype=torch.int32, device=device), mask, mode)


def check_attention_case(case: tuple, seed: int, device: torch.device) -> dict:
    dtype_name, mode, nodes, hq, hkv, dim, block_size, contexts, kwargs = case
    entry = dict(dtype=dtype_name, mode=mode, T=nodes, heads=(hq, hkv, dim), block_size=block_size, contexts=list(contexts),
                 kwargs=kwargs)  # fmt: skip
    try:
        args = mixed_context_args(case, torch.Generator().manual_seed(seed), device)
        plan_kw = {k: v for k, v in kwargs.items() if k in PLAN_KEYS}
        plan = plan_tree_attention(len(contexts), nodes, hq, hkv, dim, block_size, args[3].shape[1], device, **plan_kw)
        out = tree_attention_triton(*args, **kwargs)
        err = (out.float() - tree_attention_reference(*args).float()).abs().max().item()
        ok = bool(err <= CHECK_TOLERANCE[dtype_name]) and bool(torch.isfinite(out.float()).all())
        entry.update(kernel=plan.kernel, num_splits=plan.num_splits, max_abs_err=err, ok=ok)
    except Exception as exc:
        entry.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
    return entry


# ----------------------------------------------------------------- section


@dataclass
class AttentionSettings:
    """The sizes of the section's steps: full (a GPU) or reduced (the CPU
    interpreter, tiny shapes). Grids are sweep_tree_attention's batches /
    tree_sizes / contexts ({}: its defaults); sweep_kwargs go to every sweep."""

    sweep_grid: dict
    mode_grid: dict
    sweep_kwargs: dict
    tune_kwargs: dict
    copy_sizes: tuple
    copy_iters: int
    targets_at: dict = field(default_factory=dict)  # targets()'s context / nodes / batches ({}: the issue's)


def settings_for(run: CheckRun) -> AttentionSettings:
    if not run.reduced:
        return AttentionSettings({}, dict(batches=(1, 8), tree_sizes=(8, 64), contexts=(4096,)), dict(device=run.device),
                                 dict(device=run.device), (1 << 30, 16 << 20), 10)  # fmt: skip
    shape = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    plan_kwargs = dict(split_min_tokens=16)  # chunks of 16: batch 1 splits at context 40
    grid = dict(batches=(1, 2), tree_sizes=(1, 4), contexts=(40,))
    return AttentionSettings(
        sweep_grid=grid,
        mode_grid=dict(batches=(1,), tree_sizes=(4,), contexts=(40,)),  # one tiny point per mode
        sweep_kwargs=dict(shape, dtype=torch.float32, iters=1, tolerance=1e-4, device=run.device, plan_kwargs=plan_kwargs),
        tune_kwargs=dict(points=((1, 4, 64),), splits=(2,), iters=1, device=run.device, plan_kwargs=plan_kwargs,
                         shape=shape, dtype=torch.float32),  # fmt: skip
        copy_sizes=(1 << 20,),
        copy_iters=1,
        targets_at=dict(context=grid["contexts"][0], nodes=max(grid["tree_sizes"]), batches=grid["batches"]),
    )


def run_tree_attention(run: CheckRun) -> int:
    """The section (module docstring). Returns the number of failures:
    correctness checks, sweep rows and mode rows not ok, sweep groups and
    scan points that raised."""
    section = run.report.data.setdefault("tree_attention", {})
    if run.reduced:
        section["note"] = "reduced mode: CPU interpreter, tiny shapes; timings are meaningless"
    settings = settings_for(run)
    deadline = run.budget.deadline - 10
    failed = attention_correctness(run, section)
    attention_copy(run, section, settings)
    failed += attention_sweep(run, section, settings, deadline)
    failed += attention_modes(run, section, settings, None if run.reduced else deadline)
    failed += attention_tune(run, section, settings, None if run.reduced else deadline)
    section["failed"] = failed
    run.report.save()
    return failed


def attention_correctness(run: CheckRun, section: dict) -> int:
    t0 = time.time()
    check = check_tree_attention(run.device)
    check["seconds"] = round(time.time() - t0, 1)
    section["correctness"] = check
    run.report.log(f"  attention correctness: {check['passed']} passed, {check['failed']} failed ({check['seconds']}s)")
    run.report.save()
    return check["failed"]


def attention_copy(run: CheckRun, section: dict, settings: AttentionSettings) -> None:
    section["copy"] = ab.copy_bandwidth(run.device, sizes=settings.copy_sizes, iters=settings.copy_iters)
    run.report.log("  copy bandwidth:", json.dumps(section["copy"]))
    run.report.save()


def attention_sweep(run: CheckRun, section: dict, settings: AttentionSettings, deadline: float) -> int:
    """The sweep, then the targets read off it and the copy."""
    t0 = time.time()
    sweep = ab.sweep_tree_attention(**settings.sweep_grid, deadline=deadline, log=run.report.log, **settings.sweep_kwargs)
    section["sweep"] = dict(sweep, seconds=round(time.time() - t0, 1), **SWEEP_NOTES)
    targets = ab.targets(sweep["rows"], section["copy"], **settings.targets_at)
    section["targets"] = dict(targets, note="reduced mode: not a measurement") if run.reduced else targets
    run.report.log("  attention targets:", json.dumps(section["targets"]))
    run.report.save()
    return sum(not r.get("ok", True) for r in sweep["rows"]) + len(sweep.get("errors", []))


def attention_modes(run: CheckRun, section: dict, settings: AttentionSettings, deadline: float | None) -> int:
    """The other compact modes, one kernel each (the dispatcher's)."""
    t0, rows, failed = time.time(), [], 0
    for mode in OTHER_MODES:
        result = ab.sweep_tree_attention(**settings.mode_grid, mode=mode, compare_kernels=False, deadline=deadline,
                                         log=run.report.log, **settings.sweep_kwargs)  # fmt: skip
        rows.extend(result["rows"])
        failed += sum(not r.get("ok", True) for r in result["rows"]) + len(result.get("errors", []))
    section["modes"] = dict(rows=rows, seconds=round(time.time() - t0, 1))
    run.report.save()
    return failed


def attention_tune(run: CheckRun, section: dict, settings: AttentionSettings, deadline: float | None) -> int:
    t0 = time.time()
    points = ab.tune_splits(deadline=deadline, log=run.report.log, **settings.tune_kwargs)
    section["tune"] = dict(points=points, seconds=round(time.time() - t0, 1))
    run.report.save()
    return sum("error" in p for p in points)
