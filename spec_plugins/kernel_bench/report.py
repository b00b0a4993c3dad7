"""Reports from the tree-ops rows of ``tree_ops.bench_tree_ops``: the per
implementation table of ``kernel_bench.json`` and the device check's
headline (one tree step's bookkeeping, ours against SGLang's kernels), plus
the mask-bytes table."""

from __future__ import annotations

import spec_tree_kernels as K
from spec_tree_kernels import TreeMaskMode

from .tree_ops import CONTEXT_FREE_OPS

# ------------------------------------------------------- kernel_bench.json


def per_impl_table(rows: list[dict]) -> list[dict]:
    """One row per (batch, T, context, impl): {batch, T, context, num_steps,
    topk, impl, <op>_ms (the eager median in milliseconds) or <op>_error}.
    A context-free op's one timing fills every context's row of its (batch, T)."""
    contexts: dict[tuple, list] = {}
    for r in rows:
        seen = contexts.setdefault((r["batch"], r["T"]), [])
        if r["context"] not in seen:
            seen.append(r["context"])
    table: dict[tuple, dict] = {}
    for r in rows:
        for context in contexts[r["batch"], r["T"]] if r["op"] in CONTEXT_FREE_OPS else [r["context"]]:
            entry = table.setdefault((r["batch"], r["T"], context, r["impl"]), dict(
                batch=r["batch"], T=r["T"], context=context, num_steps=r["num_steps"], topk=r["topk"], impl=r["impl"]))  # fmt: skip
            if "eager_us" in r:
                entry[f"{r['op']}_ms"] = r["eager_us"] / 1e3
            else:
                entry[f"{r['op']}_error"] = r.get("error")
    return list(table.values())


def mask_bytes_table(tree_sizes, contexts) -> list[dict]:
    """{T, context, <MODE>: tree-mask bytes per request, None where T does not fit the mode}."""
    table = []
    for nodes in tree_sizes:
        for context in contexts:
            entry = dict(T=nodes, context=context)
            for mode in TreeMaskMode:
                fits = nodes <= K.modes.max_nodes(mode)
                entry[mode.name] = K.mask_bytes_per_request(mode, nodes, context) if fits else None
            table.append(entry)
    return table


def print_tables(bytes_table: list[dict], table: list[dict]) -> None:
    modes = [m.name for m in TreeMaskMode]
    print("\nTree-mask bytes per request")
    print(f"{'T':>4} {'context':>8} " + " ".join(f"{m:>21}" for m in modes))
    for e in bytes_table:
        print(f"{e['T']:>4} {e['context']:>8} " + " ".join(f"{'n/a' if e[m] is None else e[m]:>21}" for m in modes))
    columns = ["select_ms"] + [f"build_{m}_ms" for m in modes] + ["build_FULL_MASK_nofill_ms", "verify_ms",
                                                                  "verify_sampling_ms", "move_kv_ms"]  # fmt: skip
    abbreviations = (("build_", ""), ("_ms", ""), ("QLEN_ONLY_BITPACKING", "BITPACK"), ("ANCESTOR_BITMASK", "ANC_BITS"),
                     ("PARENT_POINTER", "PARENT_PTR"), ("verify_sampling", "verify_smp"))  # fmt: skip
    short = {}
    for c in columns:
        short[c] = c
        for long, abbreviated in abbreviations:
            short[c] = short[c].replace(long, abbreviated)
    print("\nMilliseconds per call (median)")
    print(f"{'batch':>5} {'T':>4} {'context':>7} {'impl':>6} " + " ".join(f"{short[c]:>14}" for c in columns))
    for r in table:
        cells = " ".join(f"{r[c]:>14.3f}" if r.get(c) is not None else f"{'-':>14}" for c in columns)
        print(f"{r['batch']:>5} {r['T']:>4} {r['context']:>7} {r['impl']:>6} {cells}")


# ------------------------------------------------ the device check's headline

HEADLINE_NOTES = {
    "kv_move_note": "SGLang's move is its all-layer tiled copy kernel (cache_move.py, as "
                    "MHATokenToKVPool.move_kv_cache launches it, bs*(S+1) locations in chunks of 256) when "
                    "that kernel's source was supplied; otherwise an index_select + index_copy_ stand-in. "
                    "The two small index-fill kernels SGLang runs before it are not counted.",
    "sglang_build": "FULL_MASK with prefix fill, buffers as eagle_utils.build_tree_kernel_efficient allocates them",
}  # fmt: skip


def headline(rows: list[dict], ours_impls, point: tuple[int, int, int]) -> dict:
    """Per step at ``point`` = (batch, T, context): ours (mask build in each of
    our modes + verify + KV move, the fastest of ``ours_impls`` per op) against
    SGLang (FULL_MASK build with prefix fill + verify + its KV move), under
    "graph_us" and "eager_us". Verify and the KV move do not depend on the
    context: their one timing (at the first context) is used."""
    batch, nodes, context = point
    at = [r for r in rows if (r["batch"], r["T"]) == (batch, nodes)
          and (r["op"] in CONTEXT_FREE_OPS or r["context"] == context)]  # fmt: skip
    out = dict(point=dict(batch=batch, T=nodes, context=context), **HEADLINE_NOTES)
    for metric in ("graph_us", "eager_us"):
        out[metric] = step_comparison(at, ours_impls, metric)
    return out


def step_comparison(at: list[dict], ours_impls, metric: str) -> dict:
    """{"ours_by_mode", "sglang"?, "ours_best_mode"?, "ratio_sglang_over_ours"?,
    "ratio_sglang_over_ours_qlen_only"?}: the ratios against our fastest
    compact mode (FULL_MASK left out) and against QLEN_ONLY."""
    ours = ours_by_mode(at, ours_impls, metric)
    entry = {"ours_by_mode": ours}
    sglang = sglang_step(at, metric)
    if sglang is not None:
        entry["sglang"] = sglang
    compact = {m: v for m, v in ours.items() if not m.startswith("FULL_MASK")}
    if compact and sglang is not None:
        mode = min(compact, key=lambda m: compact[m]["total_us"])
        entry["ours_best_mode"] = mode
        entry["ratio_sglang_over_ours"] = round(sglang["total_us"] / compact[mode]["total_us"], 2)
        if "QLEN_ONLY" in ours:
            entry["ratio_sglang_over_ours_qlen_only"] = round(sglang["total_us"] / ours["QLEN_ONLY"]["total_us"], 2)
    return entry


def ours_by_mode(at: list[dict], impls, metric: str) -> dict:
    """{mode (or FULL_MASK_nofill): {total_us, build_us, build_impl, verify_us,
    verify_impl, move_us, move_impl}} where all three were timed."""
    verify, verify_impl = best(at, "verify", impls, metric)
    move, move_impl = best(at, "move_kv", impls, metric)
    ours = {}
    for op in sorted({r["op"] for r in at if r["op"].startswith("build_")}):
        build, build_impl = best(at, op, impls, metric)
        if None not in (build, verify, move):
            ours[op[len("build_"):]] = dict(total_us=round(build + verify + move, 2), build_us=build, build_impl=build_impl,
                                            verify_us=verify, verify_impl=verify_impl, move_us=move, move_impl=move_impl)  # fmt: skip
    return ours


def sglang_step(at: list[dict], metric: str) -> dict | None:
    """SGLang's FULL_MASK build + verify + move (its tiled copy, else the stand-in)."""
    build, _ = best(at, "build_FULL_MASK", ("sglang",), metric)
    verify, _ = best(at, "verify", ("sglang",), metric)
    move, move_impl = best(at, "move_kv", ("sglang",), metric)
    if move is None:
        move, move_impl = best(at, "move_kv", ("sglang_standin",), metric)
    if None in (build, verify, move):
        return None
    return dict(total_us=round(build + verify + move, 2), build_us=build, verify_us=verify, move_us=move, move_impl=move_impl)


def best(rows: list[dict], op: str, impls, metric: str):
    """(the smallest ``metric`` of ``op`` over ``impls``, its impl), or (None, None)."""
    timed = [r for r in rows if r["op"] == op and r["impl"] in impls and metric in r]
    if not timed:
        return None, None
    fastest = min(timed, key=lambda r: r[metric])
    return fastest[metric], fastest["impl"]
