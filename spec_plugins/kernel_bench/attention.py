"""Tree attention on a GPU: the sweep of issue #17 and the split-count scan.

    python -m spec_plugins.kernel_bench.attention          # the sweep, on a GPU
    bash ci/device_check.sh --skip correctness,sglang,sanitizer,bench   # the same inside the device check

``sweep_tree_attention`` times the Triton kernels on a Llama-3-8B-shaped
attention layer (32 query / 8 KV heads, D 128, bf16, 16-token blocks) over
batch x T x context, each call the GPU time of one replay of a CUDA graph
holding one call, the L2 flushed before each replay (``Timer``'s cold
figures), so a small batch's K/V is read from HBM as it would be in a model
whose other layers evict it. Reported per point: time, achieved K/V bandwidth
(K and V bytes of the context and the tree / time), the ratio to T = 1
(one-token decode of the same batch and context through the same entry
point), the kernel the dispatcher chose and the other kernel's time, and the
error against the torch reference on the first requests. ``copy_bandwidth``
measures a plain device-to-device copy in the same run, the yardstick;
``targets`` reads the issue's acceptance figures off a sweep. ``tune_splits``
times forced split counts at a few points, to retune plan_tree_attention.

Without a GPU (``device="cpu"`` under TRITON_INTERPRET=1) the same code runs
with wall-clock timings: a smoke test of the sweep, not a measurement.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from spec_tree_kernels.api import tree_from_parents
from spec_tree_kernels.attention_reference import tree_attention_reference
from spec_tree_kernels.attention_triton import plan_tree_attention, tree_attention_triton
from spec_tree_kernels.modes import TreeMaskMode, parse_mask_mode

from .points import Call, bench_point, run_sweep
from .timer import Timer, describe_error

LLAMA3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
SWEEP_BATCHES, SWEEP_NODES, SWEEP_CONTEXTS = (1, 4, 8, 64), (1, 8, 16, 64), (1024, 4096, 32768)
TUNE_POINTS = ((1, 8, 4096), (8, 8, 4096), (1, 8, 32768), (1, 64, 4096))  # (batch, T, context)
TUNE_SPLITS = (2, 4, 8, 16, 32, 64)
SWEEP_RESERVE_S, TUNE_POINT_RESERVE_S, TUNE_CALL_RESERVE_S = 15, 10, 5  # seconds a point / call needs


# ------------------------------------------------------------------ inputs


def random_parents(batch: int, nodes: int, generator: torch.Generator) -> torch.Tensor:
    """[B, T] int64 parents of random trees whose parent precedes its child."""
    parent = torch.full((batch, nodes), -1, dtype=torch.int64)
    for i in range(1, nodes):
        parent[:, i] = torch.randint(0, i, (batch,), generator=generator)
    return parent


def mask_from_parents(parent: torch.Tensor, mode) -> torch.Tensor:
    """Tree mask in ``mode``'s layout from [B, T] parents (the public tree_from_parents op)."""
    seq_lens = torch.zeros(parent.shape[0], dtype=torch.int64, device=parent.device)
    return tree_from_parents(parent, seq_lens, mode).tree_mask


@dataclass
class PagedProblem:
    """One (batch B, context) group's paged cache, shared by its tree sizes:
    k_cache / v_cache [blocks, block_size, Hkv, D], block_table [B, blocks per
    request] int32 (a random permutation of the blocks), context_lens [B]
    int32, all ``context``; gen: the CPU generator for queries and trees."""

    batch: int
    context: int
    gen: torch.Generator
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    context_lens: torch.Tensor


def paged_problem(batch, context, max_nodes, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device,
                  seed) -> PagedProblem:  # fmt: skip
    """Room for ``context`` + ``max_nodes`` positions per request (num_q_heads unused: queries come per T)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = -(-(context + max_nodes) // block_size)
    num_blocks = batch * blocks_per_req
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    if device.type == "cuda":
        dev_gen = torch.Generator(device=device).manual_seed(seed)
        k_cache = torch.randn(shape, generator=dev_gen, device=device, dtype=dtype)  # made on the GPU: fast
        v_cache = torch.randn(shape, generator=dev_gen, device=device, dtype=dtype)
    else:
        k_cache = torch.randn(shape, generator=gen).to(dtype)
        v_cache = torch.randn(shape, generator=gen).to(dtype)
    block_table = torch.randperm(num_blocks, generator=gen).view(batch, blocks_per_req).to(device, torch.int32)
    context_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    return PagedProblem(batch, context, gen, k_cache, v_cache, block_table, context_lens)


@dataclass
class AttentionSetup:
    """What every point of one sweep or scan shares: the layer's heads
    (LLAMA3_8B's keys), dtype, mask mode, timer and the plan's keyword
    arguments (``plan_kwargs``, passed to the plan and to every call)."""

    mode: TreeMaskMode
    heads: dict
    dtype: torch.dtype
    timer: Timer
    plan_kwargs: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.timer.device

    def args(self, problem: PagedProblem, nodes: int) -> tuple:
        """tree_attention's arguments for T = ``nodes``: random queries [B, T,
        Hq, D] and a random tree's mask on ``problem``'s cache."""
        batch = problem.batch
        q = torch.randn(batch, nodes, self.heads["num_q_heads"], self.heads["head_dim"], generator=problem.gen)
        mask = mask_from_parents(random_parents(batch, nodes, problem.gen), self.mode).to(self.device)
        return (q.to(self.device, self.dtype), problem.k_cache, problem.v_cache, problem.block_table, problem.context_lens,
                mask, self.mode)  # fmt: skip

    def plan(self, problem: PagedProblem, nodes: int, **overrides):
        h, max_blocks = self.heads, problem.block_table.shape[1]
        return plan_tree_attention(problem.batch, nodes, h["num_q_heads"], h["num_kv_heads"], h["head_dim"],
                                   h["block_size"], max_blocks, self.device, **dict(self.plan_kwargs, **overrides))  # fmt: skip

    def call(self, name: str, args: tuple, **overrides) -> Call:
        return Call("attention", name, lambda: tree_attention_triton(*args, **dict(self.plan_kwargs, **overrides)))

    def cold(self, call: Call) -> dict:
        return self.timer.cold(call.fn)


def setup_for(mode, *, shape: dict | None, dtype, device, iters: int, plan_kwargs: dict | None) -> AttentionSetup:
    timer = Timer(device, iters=iters, warmup=2, graph_calls=1, flush_l2=True)
    return AttentionSetup(parse_mask_mode(mode), dict(LLAMA3_8B, **(shape or {})), dtype, timer, dict(plan_kwargs or {}))


# ------------------------------------------------------------------ copies


def copy_bandwidth(device="cuda", sizes=(1 << 30, 16 << 20), iters: int = 10) -> list[dict]:
    """Plain device-to-device copies (``dst.copy_(src)``), L2 flushed before
    each: gbps = (bytes read + bytes written) / time, the same traffic
    convention as an attention kernel's K/V reads / time. The large copy is
    the HBM yardstick; a small one shows what a launch of that size reaches."""
    timer = Timer(device, iters=iters, warmup=2, graph_calls=1, flush_l2=True)
    rows = []
    for nbytes in sizes:
        t = time_copy(timer, nbytes)
        rows.append(dict(bytes=nbytes, time_us=t["time_us"], gbps=gbps(2 * nbytes, t["time_us"]), timer=t["timer"]))
    return rows


def time_copy(timer: Timer, nbytes: int) -> dict:
    """Cold figures of one ``nbytes`` uint8 copy (the buffers are freed on return)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=timer.device)
    dst = torch.empty_like(src)
    src.fill_(1)
    return timer.cold(lambda: dst.copy_(src))


def gbps(nbytes: int, time_us: float) -> float:
    return round(nbytes / (time_us * 1e-6) / 1e9, 1)


# ------------------------------------------------------------------- sweep


def sweep_tree_attention(
    batches=SWEEP_BATCHES,
    tree_sizes=SWEEP_NODES,
    contexts=SWEEP_CONTEXTS,
    *,
    mode="ANCESTOR_BITMASK",
    num_q_heads: int = LLAMA3_8B["num_q_heads"],
    num_kv_heads: int = LLAMA3_8B["num_kv_heads"],
    head_dim: int = LLAMA3_8B["head_dim"],
    block_size: int = LLAMA3_8B["block_size"],
    dtype: torch.dtype = torch.bfloat16,
    iters: int = 10,
    compare_kernels: bool = True,
    check_requests: int = 2,
    tolerance: float = 2e-2,
    deadline: float | None = None,
    device="cuda",
    seed: int = 0,
    log=None,
    plan_kwargs: dict | None = None,
) -> dict:
    """Time tree attention over batch x T x context (module docstring).

    Returns {"rows": [...], "skipped": [...]} ("errors": [...] when a group
    raised); each row: batch, T, context, mode, kernel and num_splits (the
    dispatcher's choice), time_us, min_us, timer, kv_bytes, kv_gbps,
    ratio_vs_t1 (time / time of T = 1 at the same batch and context),
    other_kernel / other_time_us / other_num_splits / other_kv_gbps (the
    kernel the dispatcher did not pick, when ``compare_kernels``),
    max_abs_err and ok (against the reference on the first
    ``check_requests`` requests; bf16 ``tolerance``), error where a call
    raised. A (batch, context) group is skipped when ``deadline``
    (time.time() value) is under 15 s away; the headline context 4096 goes first.
    """
    shape = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    setup = setup_for(mode, shape=shape, dtype=dtype, device=device, iters=iters, plan_kwargs=plan_kwargs)
    groups = sorted(({"batch": b, "context": c} for b in batches for c in contexts),
                    key=lambda g: (g["context"] != 4096, g["context"], g["batch"]))  # fmt: skip

    def bench_group(group: dict) -> list[dict]:
        problem = paged_problem(group["batch"], group["context"], max(tree_sizes), dtype=dtype, device=setup.device,
                                seed=seed + group["batch"] * 7 + group["context"], **setup.heads)  # fmt: skip
        rows = [attention_row(setup, problem, nodes, compare_kernels, check_requests, tolerance) for nodes in tree_sizes]
        del problem
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
        return with_ratio_vs_t1(rows)

    result = run_sweep(groups, bench_group, name="attention", deadline=deadline, reserve=SWEEP_RESERVE_S, log=log,
                       summary=group_summary)  # fmt: skip
    out = {"rows": result["rows"], "skipped": [dict(g, reason="time budget") for g in result["skipped"]]}
    if result["errors"]:
        out["errors"] = result["errors"]
    return out


def attention_row(setup: AttentionSetup, problem: PagedProblem, nodes: int, compare_kernels: bool,
                  check_requests: int, tolerance: float) -> dict:  # fmt: skip
    """The sweep's row at (batch, T, context) (``sweep_tree_attention``)."""
    args = setup.args(problem, nodes)
    batch, context, plan = problem.batch, problem.context, setup.plan(problem, nodes)
    kv_per_token = setup.heads["num_kv_heads"] * setup.heads["head_dim"] * problem.k_cache.element_size()
    kv_bytes = 2 * batch * (context + nodes) * kv_per_token  # K and V of the context and the tree
    row = dict(batch=batch, T=nodes, context=context, mode=setup.mode.name, kernel=plan.kernel, num_splits=plan.num_splits,
               kv_bytes=kv_bytes)  # fmt: skip
    calls = [setup.call("auto", args)]
    other = "single" if plan.kernel == "split" else "split"
    if compare_kernels:
        calls.append(setup.call(other, args, kernel=other))
    timed = {r["impl"]: r for r in bench_point({}, calls, setup.cold)}
    auto = timed["auto"]
    if "time_us" in auto:
        row.update(time_us=auto["time_us"], min_us=auto["min_us"], timer=auto["timer"], kv_gbps=gbps(kv_bytes, auto["time_us"]))
    if "time_us" in timed.get(other, {}):
        row.update(other_kernel=other, other_num_splits=setup.plan(problem, nodes, kernel=other).num_splits,
                   other_time_us=timed[other]["time_us"], other_kv_gbps=gbps(kv_bytes, timed[other]["time_us"]))  # fmt: skip
    errors = [r["error"] for r in timed.values() if "error" in r]
    if errors:
        return dict(row, error="; ".join(errors), ok=False)
    if check_requests:
        try:
            err = max_error_vs_reference(tree_attention_triton(*args, **setup.plan_kwargs), args, check_requests)
            row.update(max_abs_err=err, ok=bool(err <= tolerance))
        except Exception as exc:
            row.update(error=describe_error(exc), ok=False)
    return row


def max_error_vs_reference(out: torch.Tensor, args: tuple, check_requests: int) -> float:
    """Max |out - reference| over the first ``check_requests`` requests."""
    q, k_cache, v_cache, block_table, context_lens, mask, mode = args
    n = min(check_requests, q.shape[0])
    nodes = q.shape[1]
    sub_mask = mask[: n * nodes * nodes] if parse_mask_mode(mode) == TreeMaskMode.QLEN_ONLY else mask[:n]
    ref = tree_attention_reference(q[:n], k_cache, v_cache, block_table[:n], context_lens[:n], sub_mask, mode)
    return (out[:n].float() - ref.float()).abs().max().item()


def with_ratio_vs_t1(rows: list[dict]) -> list[dict]:
    """ratio_vs_t1 on each timed row of one (batch, context) group that has a timed T = 1."""
    base = next((r.get("time_us") for r in rows if r["T"] == 1), None)
    for row in rows:
        if base and row.get("time_us"):
            row["ratio_vs_t1"] = round(row["time_us"] / base, 3)
    return rows


def group_summary(rows: list[dict]) -> str:
    return " ".join(f"T{r['T']}:{r.get('time_us', 'ERR')}us/{r.get('kv_gbps', '-')}GB/s({r['kernel'][:2]}{r['num_splits']})"
                    for r in rows)  # fmt: skip


# -------------------------------------------------------------------- scan


def tune_splits(points=TUNE_POINTS, splits=TUNE_SPLITS, *, mode="ANCESTOR_BITMASK", iters: int = 10,
                deadline: float | None = None, device="cuda", log=None, plan_kwargs: dict | None = None,
                shape: dict | None = None, dtype: torch.dtype = torch.bfloat16) -> list[dict]:  # fmt: skip
    """Split-count scan at a few (batch, T, context) points: time per forced
    num_splits next to the single-pass kernel and the dispatcher's own
    choice (and, where it splits, block_n 32 / 8 warps / 2 stages at its
    split count), to check and retune plan_tree_attention's constants.
    Entries {batch, T, context, auto_kernel, auto_splits, times_us: {variant:
    us or error}, best}; {..., skipped} past the deadline, {..., error} where
    a point raised."""
    setup = setup_for(mode, shape=shape, dtype=dtype, device=device, iters=iters, plan_kwargs=plan_kwargs)
    grid = [dict(batch=b, T=t, context=c) for b, t, c in points]
    result = run_sweep(grid, lambda point: [tune_point(setup, point, splits, deadline)], name="tune", deadline=deadline,
                       reserve=TUNE_POINT_RESERVE_S, log=log, summary=tune_summary)  # fmt: skip
    return result["rows"] + [dict(p, skipped="time budget") for p in result["skipped"]] + result["errors"]


def tune_point(setup: AttentionSetup, point: dict, splits, deadline: float | None) -> dict:
    batch, nodes, context = point["batch"], point["T"], point["context"]
    problem = paged_problem(batch, context, nodes, dtype=setup.dtype, device=setup.device, seed=batch + nodes + context,
                            **setup.heads)  # fmt: skip
    args = setup.args(problem, nodes)
    plan = setup.plan(problem, nodes)
    calls = (setup.call(name, args, **kw) for name, kw in tune_variants(plan, context, splits))
    rows = bench_point({}, calls, setup.cold, deadline=deadline, reserve=TUNE_CALL_RESERVE_S)
    entry = dict(point, auto_kernel=plan.kernel, auto_splits=plan.num_splits,
                 times_us={r["impl"]: r.get("time_us", r.get("error")) for r in rows})  # fmt: skip
    numeric = {k: v for k, v in entry["times_us"].items() if isinstance(v, float) and k != "auto"}
    if numeric:
        entry["best"] = min(numeric, key=numeric.get)
    del problem, args
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()
    return entry


def tune_variants(plan, context: int, splits) -> list[tuple[str, dict]]:
    """(name, tree_attention_triton keyword arguments) of the scan at one point."""
    variants = [("auto", {}), ("single", dict(kernel="single"))]
    useful = -(-context // plan.min_chunk)  # more chunks than this would not be used (chunk >= min_chunk)
    variants += [(f"split{s}", dict(kernel="split", num_splits=s)) for s in splits if s <= useful]
    if context // 64 > useful:  # shorter chunks than the plan allows
        variants.append(("split_chunk64", dict(kernel="split", num_splits=min(context // 64, 64), split_min_tokens=64)))
    if plan.kernel == "split":  # tiles and launch options at the plan's own split count
        variants += [("auto_block_n32", dict(block_n=32)), ("auto_warps8", dict(num_warps=8)),
                     ("auto_stages2", dict(num_stages=2))]  # fmt: skip
    return variants


def tune_summary(entries: list[dict]) -> str:
    return " ".join(f"auto={e['auto_kernel']}{e['auto_splits']} {e['times_us']}" for e in entries)


# ----------------------------------------------------------------- targets


def targets(rows: list[dict], copy_rows: list[dict], *, context: int = 4096, nodes: int = 8, batches=(1, 8)) -> dict:
    """Issue #17's acceptance figures from a sweep (absent where not measured):
    batch 1, T 8, context 4k at >= 60% of the bandwidth of the largest
    copy, and t(T=8) / t(T=1) <= 1.3 at batch 1 and 8 (context 4k)."""

    def at(batch, t):
        return next((r for r in rows if (r["batch"], r["T"], r["context"]) == (batch, t, context) and "time_us" in r), None)

    copy_gbps = max(copy_rows, key=lambda c: c["bytes"])["gbps"] if copy_rows else None
    out = dict(copy_gbps=copy_gbps)
    point = at(batches[0], nodes)
    if point and copy_gbps:
        frac = point["kv_gbps"] / copy_gbps
        out[f"b{batches[0]}_t{nodes}_ctx{context}"] = dict(kv_gbps=point["kv_gbps"], fraction_of_copy=round(frac, 3), target=0.6,
                                                         met=bool(frac >= 0.6))  # fmt: skip
    for batch in batches:
        big, one = at(batch, nodes), at(batch, 1)
        if big and one:
            ratio = big["time_us"] / one["time_us"]
            out[f"ratio_t{nodes}_t1_b{batch}_ctx{context}"] = dict(ratio=round(ratio, 3), target=1.3, met=bool(ratio <= 1.3))
    return out


def main() -> None:  # python -m spec_plugins.kernel_bench.attention (needs a GPU)
    import json

    copies = copy_bandwidth()
    print(json.dumps(copies))
    sweep = sweep_tree_attention(log=print)
    print(json.dumps(targets(sweep["rows"], copies), indent=1))


if __name__ == "__main__":
    main()
