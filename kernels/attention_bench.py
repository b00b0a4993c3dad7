"""GPU benchmark of tree attention: the sweep of issue #17.

    python -m spec_tree_kernels.attention_bench          # the sweep, on a GPU
    bash ci/device_check.sh --skip correctness,sglang,sanitizer,bench   # the same inside the device check

``sweep_tree_attention`` times the Triton kernels on a Llama-3-8B-shaped
attention layer (32 query / 8 KV heads, D 128, bf16, 16-token blocks) over
batch x T x context, each call the GPU time of one replay of a CUDA graph
holding one call, the L2 flushed (a 256 MB write) before each replay, so a
small batch's K/V is read from HBM as it would be in a model whose other
layers evict it. Reported per point: time, achieved K/V bandwidth (K and V
bytes of the context and the tree / time), the ratio to T = 1 (one-token
decode of the same batch and context through the same entry point), the
kernel the dispatcher chose and the other kernel's time, and the error
against the torch reference on the first requests. ``copy_bandwidth``
measures a plain device-to-device copy in the same run, the yardstick.

Without a GPU (``device="cpu"`` under TRITON_INTERPRET=1) the same code runs
with wall-clock timings: a smoke test of the sweep, not a measurement.
"""

from __future__ import annotations

import statistics
import time

import torch

from .attention_reference import tree_attention_reference
from .attention_triton import plan_tree_attention, tree_attention_triton
from .modes import parse_mask_mode

LLAMA3_8B = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
# (batch, context) groups, the headline points first so a short budget still gets them
SWEEP_BATCHES, SWEEP_NODES, SWEEP_CONTEXTS = (1, 4, 8, 64), (1, 8, 16, 64), (1024, 4096, 32768)
FLUSH_BYTES = 256 << 20  # > the 50 MB L2 of an H100/H200


def _random_parents(batch: int, nodes: int, generator: torch.Generator) -> torch.Tensor:
    """[B, T] int64 parents of random trees whose parent precedes its child."""
    parent = torch.full((batch, nodes), -1, dtype=torch.int64)
    for i in range(1, nodes):
        parent[:, i] = torch.randint(0, i, (batch,), generator=generator)
    return parent


def _mask_from_parents(parent: torch.Tensor, mode) -> torch.Tensor:
    """Tree mask in ``mode``'s layout from [B, T] parents (the public tree_from_parents op)."""
    from .api import tree_from_parents

    seq_lens = torch.zeros(parent.shape[0], dtype=torch.int64, device=parent.device)
    return tree_from_parents(parent, seq_lens, mode).tree_mask


class ColdTimer:
    """Median microseconds of ``fn``: on CUDA the replay of a CUDA graph of one
    call, after an L2 flush (eager calls when capture fails); on the CPU wall clock."""

    def __init__(self, device, iters: int = 10, warmup: int = 2):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.iters, self.warmup = iters, warmup
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=self.device) if self.cuda else None

    def __call__(self, fn) -> dict:
        for _ in range(self.warmup):
            fn()
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return {"time_us": (time.perf_counter() - t0) * 1e6, "timer": "cpu wall clock (meaningless)"}
        torch.cuda.synchronize()
        graph, method = None, "cuda graph replay, L2 flushed"
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graph.replay()
        except Exception as exc:  # not capturable: report it, time eagerly
            graph, method = None, f"eager, L2 flushed (capture failed: {type(exc).__name__}: {str(exc)[:120]})"
            torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(self.iters):
            self.flush.zero_()
            start.record()
            graph.replay() if graph is not None else fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        del graph
        return {"time_us": round(statistics.median(samples), 2), "min_us": round(min(samples), 2), "timer": method}


def copy_bandwidth(device="cuda", sizes=(1 << 30, 16 << 20), iters: int = 10) -> list[dict]:
    """Plain device-to-device copies (``dst.copy_(src)``), L2 flushed before
    each: gbps = (bytes read + bytes written) / time, the same traffic
    convention as an attention kernel's K/V reads / time. The large copy is
    the HBM yardstick; a small one shows what a launch of that size reaches."""
    device = torch.device(device)
    timer = ColdTimer(device, iters=iters)
    rows = []
    for nbytes in sizes:
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        src.fill_(1)
        t = timer(lambda: dst.copy_(src))
        rows.append(dict(bytes=nbytes, time_us=t["time_us"], gbps=round(2 * nbytes / (t["time_us"] * 1e-6) / 1e9, 1),
                         timer=t["timer"]))  # fmt: skip
        del src, dst
    return rows


def _problem(batch, context, max_nodes, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, seed):
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
    return gen, k_cache, v_cache, block_table, context_lens


def _check(out, args, check_requests: int) -> float:
    """Max |out - reference| over the first ``check_requests`` requests."""
    q, k_cache, v_cache, block_table, context_lens, mask, mode = args
    n = min(check_requests, q.shape[0])
    nodes = q.shape[1]
    if parse_mask_mode(mode).name == "QLEN_ONLY":
        sub_mask = mask[: n * nodes * nodes]
    else:
        sub_mask = mask[:n]
    ref = tree_attention_reference(q[:n], k_cache, v_cache, block_table[:n], context_lens[:n], sub_mask, mode)
    return (out[:n].float() - ref.float()).abs().max().item()


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

    Returns {"rows": [...], "skipped": [...]}; each row: batch, T, context,
    mode, kernel and num_splits (the dispatcher's choice), time_us,
    kv_bytes, kv_gbps, ratio_vs_t1 (time / time of T = 1 at the same batch
    and context), other_kernel / other_time_us / other_num_splits (the
    kernel the dispatcher did not pick, when ``compare_kernels``),
    max_abs_err and ok (against the reference on the first
    ``check_requests`` requests; bf16 ``tolerance``). A (batch, context)
    group is skipped when ``deadline`` (time.time() value) is under 15 s away.
    """
    device = torch.device(device)
    mode = parse_mask_mode(mode)
    plan_kwargs = dict(plan_kwargs or {})
    timer = ColdTimer(device, iters=iters)
    heads = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size)
    rows, skipped = [], []
    groups = sorted(((b, c) for b in batches for c in contexts), key=lambda bc: (bc[1] != 4096, bc[1], bc[0]))
    for batch, context in groups:
        if deadline is not None and deadline - time.time() < 15:
            skipped.append(dict(batch=batch, context=context, reason="time budget"))
            continue
        t0 = time.time()
        gen, k_cache, v_cache, block_table, context_lens = _problem(
            batch, context, max(tree_sizes), dtype=dtype, device=device, seed=seed + batch * 7 + context, **heads
        )
        group_rows = []
        for nodes in tree_sizes:
            q = torch.randn(batch, nodes, num_q_heads, head_dim, generator=gen).to(device, dtype)
            mask = _mask_from_parents(_random_parents(batch, nodes, gen), mode).to(device)
            args = (q, k_cache, v_cache, block_table, context_lens, mask, mode)
            plan = plan_tree_attention(batch, nodes, num_q_heads, num_kv_heads, head_dim, block_size, block_table.shape[1],
                                       device, **plan_kwargs)  # fmt: skip
            kv_bytes = 2 * batch * (context + nodes) * num_kv_heads * head_dim * k_cache.element_size()
            row = dict(batch=batch, T=nodes, context=context, mode=mode.name, kernel=plan.kernel, num_splits=plan.num_splits,
                       kv_bytes=kv_bytes)  # fmt: skip
            try:
                out = tree_attention_triton(*args, **plan_kwargs)
                t = timer(lambda: tree_attention_triton(*args, **plan_kwargs))
                row.update(time_us=t["time_us"], min_us=t.get("min_us"), timer=t["timer"],
                           kv_gbps=round(kv_bytes / (t["time_us"] * 1e-6) / 1e9, 1))  # fmt: skip
                if compare_kernels:
                    other = "single" if plan.kernel == "split" else "split"
                    kw = dict(plan_kwargs, kernel=other)
                    other_plan = plan_tree_attention(batch, nodes, num_q_heads, num_kv_heads, head_dim, block_size,
                                                     block_table.shape[1], device, **kw)  # fmt: skip
                    t_other = timer(lambda: tree_attention_triton(*args, **kw))
                    row.update(other_kernel=other, other_num_splits=other_plan.num_splits, other_time_us=t_other["time_us"],
                               other_kv_gbps=round(kv_bytes / (t_other["time_us"] * 1e-6) / 1e9, 1))  # fmt: skip
                if check_requests:
                    err = _check(out, args, check_requests)
                    row.update(max_abs_err=err, ok=bool(err <= tolerance))
            except Exception as exc:
                row.update(error=f"{type(exc).__name__}: {str(exc)[:300]}", ok=False)
            group_rows.append(row)
            del q, mask, args
        base = next((r.get("time_us") for r in group_rows if r["T"] == 1), None)
        for row in group_rows:
            if base and row.get("time_us"):
                row["ratio_vs_t1"] = round(row["time_us"] / base, 3)
        rows.extend(group_rows)
        if log:
            summary = " ".join(
                f"T{r['T']}:{r.get('time_us', 'ERR')}us/{r.get('kv_gbps', '-')}GB/s({r['kernel'][:2]}{r['num_splits']})"
                for r in group_rows
            )
            log(f"  attention batch={batch} ctx={context} ({time.time() - t0:.1f}s): {summary}")
        del k_cache, v_cache, block_table, context_lens
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"rows": rows, "skipped": skipped}


def tune_splits(points=((1, 8, 4096), (8, 8, 4096), (1, 8, 32768), (1, 64, 4096)), splits=(2, 4, 8, 16, 32, 64), *,
                mode="ANCESTOR_BITMASK", iters: int = 10, deadline: float | None = None, device="cuda", log=None,
                plan_kwargs: dict | None = None, shape: dict | None = None,
                dtype: torch.dtype = torch.bfloat16) -> list[dict]:  # fmt: skip
    """Split-count scan at a few (batch, T, context) points: time per forced
    num_splits next to the single-pass kernel and the dispatcher's own
    choice (and, where it splits, block_n 32 / 8 warps / 2 stages at its
    split count), to check and retune plan_tree_attention's constants."""
    device = torch.device(device)
    mode = parse_mask_mode(mode)
    plan_kwargs = dict(plan_kwargs or {})
    timer = ColdTimer(device, iters=iters)
    h = dict(LLAMA3_8B, **(shape or {}))
    results = []
    for batch, nodes, context in points:
        if deadline is not None and deadline - time.time() < 10:
            results.append(dict(batch=batch, T=nodes, context=context, skipped="time budget"))
            continue
        gen, k_cache, v_cache, block_table, context_lens = _problem(batch, context, nodes, dtype=dtype, device=device,
                                                                    seed=batch + nodes + context, **h)  # fmt: skip
        q = torch.randn(batch, nodes, h["num_q_heads"], h["head_dim"], generator=gen).to(device, dtype)
        mask = _mask_from_parents(_random_parents(batch, nodes, gen), mode).to(device)
        args = (q, k_cache, v_cache, block_table, context_lens, mask, mode)
        plan = plan_tree_attention(batch, nodes, h["num_q_heads"], h["num_kv_heads"], h["head_dim"], h["block_size"],
                                   block_table.shape[1], device, **plan_kwargs)  # fmt: skip
        entry = dict(batch=batch, T=nodes, context=context, auto_kernel=plan.kernel, auto_splits=plan.num_splits, times_us={})
        variants = [("auto", {}), ("single", dict(kernel="single"))]
        useful = -(-context // plan.min_chunk)  # more chunks than this would not be used (chunk >= min_chunk)
        variants += [(f"split{s}", dict(kernel="split", num_splits=s)) for s in splits if s <= useful]
        if context // 64 > useful:  # shorter chunks than the plan allows
            variants.append(("split_chunk64", dict(kernel="split", num_splits=min(context // 64, 64), split_min_tokens=64)))
        if plan.kernel == "split":  # tiles and launch options at the plan's own split count
            variants += [("auto_block_n32", dict(block_n=32)), ("auto_warps8", dict(num_warps=8)),
                         ("auto_stages2", dict(num_stages=2))]
        for name, kw in variants:
            if deadline is not None and deadline - time.time() < 5:
                break
            try:
                entry["times_us"][name] = timer(lambda kw=kw: tree_attention_triton(*args, **dict(plan_kwargs, **kw)))["time_us"]
            except Exception as exc:
                entry["times_us"][name] = f"{type(exc).__name__}: {str(exc)[:160]}"
        numeric = {k: v for k, v in entry["times_us"].items() if isinstance(v, float) and k != "auto"}
        if numeric:
            entry["best"] = min(numeric, key=numeric.get)
        results.append(entry)
        if log:
            log(f"  tune batch={batch} T={nodes} ctx={context}: auto={plan.kernel}{plan.num_splits} {entry['times_us']}")
        del k_cache, v_cache, q, mask, args
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


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


def check_tree_attention(device="cuda", cases=None, seed: int = 0) -> dict:
    """Triton (split, single, auto) against the torch reference on requests of
    mixed context lengths (0, block boundaries, long) with random paged
    blocks: {"passed", "failed", "cases": [...]}. ``cases`` defaults to
    CHECK_CASES on CUDA and CHECK_CASES_REDUCED elsewhere."""
    device = torch.device(device)
    if cases is None:
        cases = CHECK_CASES if device.type == "cuda" else CHECK_CASES_REDUCED
    results, passed, failed = [], 0, 0
    for i, (dtype_name, mode, nodes, hq, hkv, dim, block_size, contexts, kwargs) in enumerate(cases):
        gen = torch.Generator().manual_seed(seed + i)
        dtype = getattr(torch, dtype_name)
        batch = len(contexts)
        need = [-(-(c + nodes) // block_size) for c in contexts]
        num_blocks = sum(need) + 2
        perm = torch.randperm(num_blocks, generator=gen)
        table = torch.zeros(batch, max(need) + 1, dtype=torch.int32)  # a spare column of unused entries
        used = 0
        for b, n in enumerate(need):
            table[b, :n] = perm[used : used + n].to(torch.int32)
            used += n
        k_cache = torch.randn(num_blocks, block_size, hkv, dim, generator=gen).to(device, dtype)
        v_cache = torch.randn(num_blocks, block_size, hkv, dim, generator=gen).to(device, dtype)
        q = torch.randn(batch, nodes, hq, dim, generator=gen).to(device, dtype)
        mask = _mask_from_parents(_random_parents(batch, nodes, gen), mode).to(device)
        args = (q, k_cache, v_cache, table.to(device), torch.tensor(contexts, dtype=torch.int32, device=device), mask, mode)
        entry = dict(dtype=dtype_name, mode=mode, T=nodes, heads=(hq, hkv, dim), block_size=block_size, contexts=list(contexts),
                     kwargs=kwargs)  # fmt: skip
        try:
            plan_kw = {k: v for k, v in kwargs.items() if k in ("kernel", "num_splits", "split_min_tokens")}
            plan = plan_tree_attention(batch, nodes, hq, hkv, dim, block_size, table.shape[1], device, **plan_kw)
            out = tree_attention_triton(*args, **kwargs)
            ref = tree_attention_reference(*args)
            err = (out.float() - ref.float()).abs().max().item()
            ok = bool(err <= CHECK_TOLERANCE[dtype_name]) and bool(torch.isfinite(out.float()).all())
            entry.update(kernel=plan.kernel, num_splits=plan.num_splits, max_abs_err=err, ok=ok)
        except Exception as exc:
            entry.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
        passed, failed = passed + entry["ok"], failed + (not entry["ok"])
        results.append(entry)
    return {"passed": passed, "failed": failed, "cases": results}


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


def bench_tree_attention(batches=(1, 8, 64), tree_sizes=(1, 8, 16, 32, 64), *, context_len: int = 2048, mode="ANCESTOR_BITMASK",
                         iters: int = 20, check: bool = True, device: str = "cuda", **kwargs) -> list[dict]:  # fmt: skip
    """One context length of the sweep (the former entry point); rows as
    ``sweep_tree_attention``'s, with ``nodes`` = T."""
    result = sweep_tree_attention(batches, tree_sizes, (context_len,), mode=mode, iters=iters, device=device,
                                  check_requests=2 if check else 0, **kwargs)  # fmt: skip
    for row in result["rows"]:
        row["nodes"] = row["T"]
    return result["rows"]


def main() -> None:  # python -m spec_tree_kernels.attention_bench (needs a GPU)
    import json

    copies = copy_bandwidth()
    print(json.dumps(copies))
    sweep = sweep_tree_attention(log=print)
    print(json.dumps(targets(sweep["rows"], copies), indent=1))


if __name__ == "__main__":
    main()
