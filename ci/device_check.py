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
6. [tree_attention] issue #17: split-KV vs single-pass tree attention
   against the torch reference (mixed contexts, every compact mode, three
   dtypes), a device-to-device copy's bandwidth, the sweep batch {1,4,8,64}
   x T {1,8,16,64} x context {1k,4k,32k} (time, K/V bandwidth, ratio to
   T=1, both kernels), other mask modes, a split-count scan, and the issue's
   targets (run_tree_attention documents it; kernels/attention_bench.py
   does the work). Only this section: --skip correctness,sglang,sanitizer,bench.

Reduced mode (--reduced, or no GPU): CPU tensors under TRITON_INTERPRET=1,
tiny sizes, triton against torch only (plus SGLang's kernels when given), a
smoke pass of the benchmark code; about a minute.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CI = ROOT / "ci"
MAX_FAILURE_DETAILS = 12


# ------------------------------------------------------------------ plumbing


class Report:
    """The JSON result and the log, both rewritten / appended as we go."""

    def __init__(self, out: Path, name: str = "device_check"):
        out.mkdir(parents=True, exist_ok=True)
        self.json_path = out / f"{name}.json"
        self.log_path = out / f"{name}.log"
        self._log = open(self.log_path, "w", buffering=1)
        self.start = time.time()
        self.data: dict = {"script": "ci/device_check.py", "started": time.strftime("%Y-%m-%d %H:%M:%S")}

    def log(self, *parts) -> None:
        line = f"[{time.time() - self.start:7.1f}s] " + " ".join(str(p) for p in parts)
        print(line, flush=True)
        self._log.write(line + "\n")

    def save(self) -> None:
        self.data["elapsed_s"] = round(time.time() - self.start, 1)
        tmp = self.json_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.json_path)


class Budget:
    def __init__(self, seconds: float):
        self.deadline = time.time() + seconds

    def left(self) -> float:
        return self.deadline - time.time()


class Tally:
    """Pass/fail counts per key ("build/cuda") and the first failures."""

    def __init__(self):
        self.counts: dict[str, dict[str, int]] = {}
        self.failures: list[dict] = []

    def add(self, key: str, ok: bool, **detail) -> None:
        entry = self.counts.setdefault(key, {"pass": 0, "fail": 0})
        entry["pass" if ok else "fail"] += 1
        if not ok and len(self.failures) < MAX_FAILURE_DETAILS:
            self.failures.append(dict(key=key, **detail))

    def failed(self) -> int:
        return sum(v["fail"] for v in self.counts.values())

    def passed(self) -> int:
        return sum(v["pass"] for v in self.counts.values())

    def as_dict(self) -> dict:
        return {"passed": self.passed(), "failed": self.failed(), "counts": self.counts, "failures": self.failures}


def import_kernels():
    """spec_tree_kernels from this checkout: installed (editable) or loaded from kernels/."""
    try:
        import spec_tree_kernels

        if Path(spec_tree_kernels.__file__).resolve().parent == ROOT / "kernels":
            return spec_tree_kernels
        for name in [m for m in sys.modules if m == "spec_tree_kernels" or m.startswith("spec_tree_kernels.")]:
            del sys.modules[name]  # another checkout's copy: use ours
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location(
        "spec_tree_kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["spec_tree_kernels"] = module
    spec.loader.exec_module(module)
    return module


def as_bytes(t):
    import torch

    return t.detach().contiguous().view(-1).view(torch.uint8)


def same(a, b) -> bool:
    import torch

    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(as_bytes(a), as_bytes(b))


def first_diff(a, b) -> str:
    import torch

    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return f"dtype/shape {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    x, y = as_bytes(a).cpu(), as_bytes(b).cpu()
    idx = int(torch.nonzero(x != y)[0, 0]) // max(1, a.element_size())
    return f"first differing element {idx}: {a.reshape(-1)[idx].item()} vs {b.reshape(-1)[idx].item()}"


def find_tool(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    patterns = [f"/usr/local/cuda*/bin/{name}", f"/usr/local/cuda*/compute-sanitizer/{name}", f"/opt/nvidia/*/{name}",
                f"/opt/nvidia/*/*/{name}"]  # fmt: skip
    for pattern in patterns:
        hits = sorted(glob.glob(pattern), reverse=True)
        if hits:
            return hits[0]
    return None


# -------------------------------------------------------------- case makers


class Cases:
    """Random inputs for the ops, built on the CPU from seeds, moved to ``device``."""

    def __init__(self, K, device, synthetic_pool):
        self.K = K
        self.device = device
        self.synthetic_pool = synthetic_pool

    def tree(self, topk, num_steps, nodes, batch, flavor, seed, max_context):
        import torch

        scores, parent_list = self.synthetic_pool(batch, topk, num_steps, flavor, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        seq_lens = torch.randint(0, max_context + 1, (batch,), generator=gen)
        selected = self.K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes, impl="torch")
        return dict(scores=scores, parent_list=parent_list, seq_lens=seq_lens, selected=selected, gen=gen)

    def open_selection(self, topk, num_steps, nodes, batch, gen):
        """Random ascending pool indices: mostly not a closed tree."""
        import torch

        pool = self.K.pool_size(topk, num_steps)
        rows = [torch.randperm(pool, generator=gen)[: nodes - 1].sort().values for _ in range(batch)]
        return torch.stack(rows) if rows else torch.empty(0, nodes - 1, dtype=torch.int64)

    def tokens(self, selected, parent_list, topk, gen, vocab=4):
        """Node tokens from a tiny vocabulary (duplicate siblings) and a target
        that agrees along a random root-to-node path: real acceptance."""
        import torch

        from spec_tree_kernels import reference

        batch, nodes = selected.shape[0], selected.shape[1] + 1
        parent, _ = reference.node_parents(selected, parent_list, topk)
        candidates = torch.randint(0, vocab, (batch, nodes), generator=gen)
        target = torch.randint(0, vocab, (batch, nodes), generator=gen)
        for b in range(batch):
            node = int(torch.randint(0, nodes, (1,), generator=gen))
            while node > 0 and int(parent[b, node]) >= 0:
                target[b, int(parent[b, node])] = candidates[b, node]
                node = int(parent[b, node])
        return candidates, target

    @staticmethod
    def sampling(candidates, target, next_token, next_sibling, num_steps, gen, dtype, vocab):
        """verify_tree_sampling's arguments (CPU): each node's distribution is
        peaked on ``target`` (drafts get accepted), cut to its top-k (k <= 64:
        exact zeros), one node in eight to its top token; U[0, 1) coins and Exp(1)
        exponentials, in every seventh request a few of them 0 (inf and NaN
        in the race: the corner cases the reference defines)."""
        import torch

        batch, nodes = candidates.shape
        logits = torch.randn(batch, nodes, vocab, generator=gen, dtype=torch.float64)
        logits.scatter_add_(2, target[..., None], torch.full((batch, nodes, 1), 4.0, dtype=torch.float64))
        probs = torch.softmax(logits, dim=-1)
        top = probs.topk(min(64, vocab), dim=-1).values
        kth = top.gather(-1, torch.randint(0, top.shape[-1], (batch, nodes, 1), generator=gen))
        one_hot = torch.rand(batch, nodes, 1, generator=gen) < 0.125
        kth = torch.where(one_hot, top[..., :1], kth)  # one-hot: only the top token (ties aside)
        probs = torch.where(probs >= kth, probs, 0.0)
        probs = (probs / probs.sum(dim=-1, keepdim=True)).to(dtype)
        coins = torch.rand(batch, nodes, generator=gen, dtype=dtype)
        exps = torch.empty(batch, vocab, dtype=dtype).exponential_(generator=gen)
        zero = (torch.rand(batch, vocab, generator=gen) < 0.002) & (torch.arange(batch)[:, None] % 7 == 3)
        exps[zero] = 0.0
        return candidates, next_token, next_sibling, probs, coins, exps, num_steps

    @staticmethod
    def kv_layouts(reduced: bool):
        """(name, block_size, heads, head_dim, make(storage) -> views, storage shape)."""
        layouts = [
            ("flash_kv_halves", 16, 8, 128, lambda s: [s[0], s[1]], lambda nb, bs, h, d: (2, nb, bs, h, d)),
            ("sglang_token_pool", 1, 2, 64, lambda s: [s[0].unsqueeze(1), s[1].unsqueeze(1)], lambda nb, bs, h, d: (2, nb, h, d)),
            ("cpu_permuted", 16, 2, 64, lambda s: [s[0].permute(0, 2, 1, 3)], lambda nb, bs, h, d: (1, nb, h, bs, d)),
            ("strided_head_dim", 16, 4, 8, lambda s: [s[0].transpose(2, 3)], lambda nb, bs, h, d: (1, nb, bs, d, h)),
            ("odd_row_bytes", 4, 3, 5, lambda s: [s[0], s[1]], lambda nb, bs, h, d: (2, nb, bs, h, d)),
        ]
        if reduced:
            return [(n, min(bs, 4), min(h, 2), min(d, 8), f, shape) for n, bs, h, d, f, shape in layouts]
        return layouts


# -------------------------------------------------------------- correctness

FULL_CASES = [  # (topk, num_steps, nodes, flavor) x batches
    (1, 6, 7, "onehot"),
    (3, 1, 4, "ties"),
    (4, 3, 8, "mixed"),
    (4, 5, 16, "ties"),
    (8, 4, 32, "underflow"),
    (8, 6, 64, "mixed"),
    (10, 6, 128, "random"),
]
FULL_BATCHES = (1, 7, 64)
REDUCED_CASES = [(2, 3, 6, "ties"), (1, 4, 5, "onehot"), (3, 1, 3, "random"), (4, 3, 9, "mixed")]
REDUCED_BATCHES = (2,)


def build_modules(K, impls):
    from spec_tree_kernels import reference

    mods = {"torch": reference}
    if "triton" in impls:
        from spec_tree_kernels import triton_ops

        mods["triton"] = triton_ops
    if "cuda" in impls:
        from spec_tree_kernels import cuda_ops

        mods["cuda"] = cuda_ops
    return mods


def check_case(K, cases, tally, impls, case, batch, reduced, report,
               ops=("select", "build", "verify", "sampling", "move")):  # fmt: skip
    """Every op of one (tree shape, batch): impls against the torch reference."""
    import torch

    from spec_tree_kernels import TreeMaskMode as M

    topk, num_steps, nodes, flavor = case
    seed = zlib.crc32(repr((topk, num_steps, nodes, batch, flavor)).encode())  # stable across runs
    dev = cases.device
    t = cases.tree(topk, num_steps, nodes, batch, flavor, seed, max_context=20 if reduced else 3000)
    parent_list, seq_lens, selected = (t[k].to(dev) for k in ("parent_list", "seq_lens", "selected"))
    seq_lens_sum = int(t["seq_lens"].sum())
    mods = build_modules(K, impls)
    label = dict(topk=topk, num_steps=num_steps, nodes=nodes, batch=batch, flavor=flavor)

    if "select" in ops and "triton" in impls and nodes > 1:
        got = K.select_tree_nodes(t["scores"].to(dev), parent_list, topk, num_steps, nodes, impl="triton")
        tally.add("select/triton", same(got.cpu(), t["selected"]), **label)

    if "build" in ops:
        selections = [("closed", selected)]
        if nodes > 2:
            selections.append(("open", cases.open_selection(topk, num_steps, nodes, batch, t["gen"]).to(dev)))
        for kind, sel in selections:
            for mode in M:
                if mode == M.QLEN_ONLY_BITPACKING and nodes > 32:
                    continue
                if kind == "open" and mode not in (M.QLEN_ONLY, M.FULL_MASK, M.PARENT_POINTER):
                    continue
                for fill in (True, False) if mode == M.FULL_MASK else (True,):
                    start = None
                    if not fill:  # the prefix stays as it was: start every impl from the same bytes
                        size = seq_lens_sum * nodes + nodes * nodes * batch
                        start = torch.rand(size, generator=t["gen"]).lt(0.5).to(dev)
                    args = (sel, parent_list, seq_lens, topk, num_steps, mode, seq_lens_sum, fill)
                    want, want_ok = mods["torch"].build_tree(*args, None if start is None else start.clone())
                    for impl in impls:
                        got, ok = mods[impl].build_tree(*args, None if start is None else start.clone())
                        bad = [f for f in want._fields if not same(getattr(got, f), getattr(want, f))]
                        if not same(ok, want_ok):
                            bad.append("ok")
                        detail = {f: first_diff(getattr(got, f), getattr(want, f)) for f in bad if f != "ok"}
                        tally.add(f"build/{impl}", not bad, mode=mode.name, fill=fill, selection=kind, fields=bad,
                                  diff=detail, **label)  # fmt: skip

    tree, _ = mods["torch"].build_tree(selected, parent_list, seq_lens, topk, num_steps, M.QLEN_ONLY, seq_lens_sum)
    candidates, target = (x.to(dev) for x in cases.tokens(t["selected"], t["parent_list"], topk, t["gen"]))
    vargs = (candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target, num_steps)
    want_v = mods["torch"].verify_tree_greedy(*vargs)
    if "verify" in ops:
        for impl in impls:
            got_v = mods[impl].verify_tree_greedy(*vargs)
            bad = [f for f in want_v._fields if not same(getattr(got_v, f), getattr(want_v, f))]
            tally.add(f"verify/{impl}", not bad, fields=bad, **label)

    if "sampling" in ops:
        for dtype in (torch.float32, torch.float64):
            sargs = cases.sampling(candidates.cpu(), target.cpu(), tree.retrieve_next_token.cpu(),
                                   tree.retrieve_next_sibling.cpu(), num_steps, t["gen"], dtype,
                                   vocab=37 if reduced else 1537)  # fmt: skip
            sargs = tuple(a.to(dev) if isinstance(a, torch.Tensor) else a for a in sargs)
            want_s = mods["torch"].verify_tree_sampling(*sargs)
            for impl in impls:
                got_s = mods[impl].verify_tree_sampling(*sargs)
                bad = [f for f in want_s._fields if not same(getattr(got_s, f), getattr(want_s, f))]
                detail = {f: first_diff(getattr(got_s, f), getattr(want_s, f)) for f in bad}
                tally.add(f"sampling/{impl}", not bad, fields=bad, diff=detail, dtype=str(dtype),
                          sampled_accepted=int(want_s.accept_length.sum()), **label)  # fmt: skip

    accepted = int(want_v.accept_length.sum())
    if "move" in ops and batch > 0:
        dtypes = (torch.float16, torch.bfloat16)
        for li, (layout, block_size, heads, head_dim, views, shape) in enumerate(cases.kv_layouts(reduced)):
            dtype = dtypes[li % 2]
            num_blocks = (batch * nodes + 7) // block_size + 3
            storage = torch.randn(shape(num_blocks, block_size, heads, head_dim), generator=t["gen"]).to(dtype).to(dev)
            slots = torch.randperm(num_blocks * block_size, generator=t["gen"])[: batch * nodes].view(batch, nodes).to(dev)
            index_dtype = torch.int64 if li % 2 else torch.int32
            index, length = want_v.accept_index.to(index_dtype), want_v.accept_length.to(index_dtype)
            want_s = storage.clone()
            mods["torch"].move_accepted_kv(views(want_s), slots, index, length)
            for impl in impls:
                got_s = storage.clone()
                mods[impl].move_accepted_kv(views(got_s), slots, index, length)
                tally.add(f"move/{impl}", same(got_s, want_s), layout=layout, dtype=str(dtype), **label)
    return accepted, batch * num_steps


def run_correctness(K, cases, impls, reduced, report, budget, key, min_left=0.0, ops=None):
    tally = Tally()
    accepted = possible = 0
    case_list = REDUCED_CASES if reduced else FULL_CASES
    batches = REDUCED_BATCHES if reduced else FULL_BATCHES
    skipped = 0
    t0 = time.time()
    for case in case_list:
        for batch in batches:
            if budget.left() < min_left:
                skipped += 1
                continue
            try:
                a, p = check_case(K, cases, tally, impls, case, batch, reduced, report,
                                  **({"ops": ops} if ops else {}))  # fmt: skip
                accepted, possible = accepted + a, possible + p
            except Exception as exc:  # an op raising is a failure of every impl under test
                for impl in impls:
                    tally.add(f"error/{impl}", False, case=case, batch=batch, error=f"{type(exc).__name__}: {exc}"[:400])
                report.log("  case", case, "batch", batch, "raised:", traceback.format_exc(limit=3))
        report.log(f"  {key}: case {case} done ({tally.passed()} passed, {tally.failed()} failed)")
    result = tally.as_dict()
    result.update(
        impls=impls,
        seconds=round(time.time() - t0, 1),
        cases_skipped_for_time=skipped,
        accepted_draft_tokens=accepted,
        max_acceptable_draft_tokens=possible,
    )
    report.data.setdefault("correctness", {})[key] = result
    report.save()
    return tally


# ------------------------------------------------------- SGLang cross-check


def run_sglang_crosscheck(K, cases, reduced, report, budget, min_left=0.0):
    import torch

    from spec_tree_kernels import reference

    sys.path.insert(0, str(CI))
    import sglang_spec_tree

    section = report.data.setdefault("sglang_crosscheck", {})
    if not sglang_spec_tree.available():
        section["skipped"] = f"${sglang_spec_tree.ENV_VAR} does not name a copy of SGLang's spec_tree.py"
        report.save()
        return
    try:
        mod = sglang_spec_tree.load()
    except Exception as exc:
        section["skipped"] = f"loading SGLang's kernels failed: {type(exc).__name__}: {exc}"
        report.save()
        return
    tally = Tally()
    dev = cases.device
    shapes = [(2, 3, 6), (3, 1, 3)] if reduced else [(4, 3, 8), (4, 5, 16), (8, 4, 32), (8, 6, 64), (1, 6, 7)]
    batches = (2,) if reduced else (1, 9, 64)
    for topk, num_steps, nodes in shapes:
        for batch in batches:
            if budget.left() < min_left:
                section["stopped_for_time"] = True
                break
            # "random" pools have no ties: SGLang's selection is then ours too
            t = cases.tree(topk, num_steps, nodes, batch, "random", topk * 1000 + nodes * 10 + batch, 20 if reduced else 3000)
            pl, sel, sl = (t[k].to(dev) for k in ("parent_list", "selected", "seq_lens"))
            total = int(t["seq_lens"].sum())
            label = dict(topk=topk, num_steps=num_steps, nodes=nodes, batch=batch)
            for mode in (K.TreeMaskMode.FULL_MASK, K.TreeMaskMode.QLEN_ONLY):
                ours, _ = reference.build_tree(sel, pl, sl, topk, num_steps, mode, total)
                mask, positions, index, nxt, sib = sglang_spec_tree.build_tree(mod, pl, sel, sl, total, topk, num_steps, nodes, int(mode))
                agree = (same(mask, ours.tree_mask) and same(positions.view(batch, nodes), ours.positions)
                         and same(index, ours.retrieve_index) and same(nxt, ours.retrieve_next_token)
                         and same(sib, ours.retrieve_next_sibling))  # fmt: skip
                tally.add(f"build_{mode.name}", agree, **label)
            candidates, target = (x.to(dev) for x in cases.tokens(t["selected"], t["parent_list"], topk, t["gen"]))
            want = reference.verify_tree_greedy(candidates, ours.retrieve_next_token, ours.retrieve_next_sibling, target, num_steps)
            _, accept_index, accept_num = sglang_spec_tree.verify(mod, candidates, index, nxt, sib, target, num_steps)
            flat = torch.where(want.accept_index >= 0, want.accept_index + nodes * torch.arange(batch, device=dev)[:, None], -1)
            tally.add("verify", same(accept_index, flat.to(torch.int32)) and same(accept_num, want.accept_length), **label)
    section.update(tally.as_dict())
    section["source"] = os.environ.get(sglang_spec_tree.ENV_VAR)
    report.save()


# --------------------------------------------------------------- sanitizer


def sanitizer_child(args) -> int:
    """Small run of every kernel of ``--impls`` (run under compute-sanitizer)."""
    K = import_kernels()
    import torch

    from spec_plugins.synthetic_trees import synthetic_pool

    impls = [i for i in args.impls.split(",") if i]
    if "cuda" in impls:
        from spec_tree_kernels import cuda_ops

        if not cuda_ops.available():
            print("sanitizer child: CUDA kernels unavailable:", cuda_ops.load_error())
            return 2
    cases = Cases(K, torch.device("cuda"), synthetic_pool)
    tally = Tally()

    class Quiet:
        def log(self, *parts):
            print(*parts)

    # shapes of FULL_CASES: the Triton kernels are already in the cache (compiling under the sanitizer is slow)
    for case in [(4, 3, 8, "mixed"), (3, 1, 4, "ties"), (8, 4, 32, "underflow"), (1, 6, 7, "onehot")]:
        check_case(K, cases, tally, impls, case, 3, False, Quiet())
    torch.cuda.synchronize()
    print("sanitizer child:", json.dumps(tally.as_dict()))
    return 0 if tally.failed() == 0 else 1


def run_sanitizer(report, budget, impls_by_tool):
    section = report.data.setdefault("sanitizer", {})
    tool = find_tool("compute-sanitizer")
    section["compute_sanitizer"] = tool
    if tool is None:
        section["skipped"] = "compute-sanitizer not found on PATH or under /usr/local/cuda*/bin"
        report.save()
        return
    for name, impls in impls_by_tool:
        timeout = min(180.0, budget.left() - 150)
        if timeout < 45:
            section[name] = {"skipped": f"only {budget.left():.0f}s of the time budget left"}
            continue
        base = [tool, "--tool", name, "--error-exitcode", "97"]
        child = [sys.executable, str(Path(__file__).resolve()), "--sanitizer-child", "--impls", impls]
        entry = {"impls": impls}
        for extra in (["--report-api-errors", "no"], []):  # the option is new-ish: retry without it
            t0 = time.time()
            try:
                proc = subprocess.run(base + extra + child, capture_output=True, text=True, timeout=timeout)
                output, rc = proc.stdout + proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as exc:
                partial = exc.stdout or ""
                output = partial.decode(errors="replace") if isinstance(partial, bytes) else partial
                rc = "timeout"
            entry.update(rc=rc, seconds=round(time.time() - t0, 1), command=" ".join(base + extra + ["<python> device_check.py --sanitizer-child"]))
            if extra and re.search(r"(unrecognized|unknown|invalid) option", output, re.I):
                continue
            break
        summary = re.findall(r"(ERROR SUMMARY: \d+ errors?|RACECHECK SUMMARY: [^\n]*)", output)
        errors = [int(n) for n in re.findall(r"ERROR SUMMARY: (\d+) error", output)]
        child_line = re.findall(r"sanitizer child: (\{.*\})", output)
        entry.update(
            summary=summary,
            errors=errors[-1] if errors else None,
            child_result=json.loads(child_line[-1]) if child_line else None,
            clean=rc == 0 and ((bool(errors) and errors[-1] == 0) or bool(re.search(r"RACECHECK SUMMARY: 0 hazards", output))),
        )
        section[name] = entry
        report.log(f"  {name} ({impls}): rc={rc} {summary} in {entry['seconds']}s")
        report._log.write(f"----- {name} output (tail) -----\n{output[-6000:]}\n----- end {name} -----\n")
        report.save()


# -------------------------------------------------------------------- bench

BENCH_BATCHES, BENCH_NODES, BENCH_CONTEXTS = (1, 64, 256), (8, 16, 64), (2048, 32768)
TREE_SHAPE = {8: (4, 3), 16: (4, 5), 64: (8, 6)}  # T -> (topk, num_steps): pool >= T - 1
KV_LAYERS, KV_HEADS, KV_HEAD_DIM, KV_BLOCK = 30, 8, 128, 16
HEADLINE = (256, 8, 32768)


class Timer:
    """Median microseconds of a call: eager (CUDA events around each call, so
    host launch overhead counts) and from a CUDA graph holding ``graph_reps``
    back-to-back calls, replayed (the time of one replay / graph_reps: the
    GPU time of a call, without the ~10 us of one graph launch)."""

    def __init__(self, device, iters: int, warmup: int = 3, graph_reps: int = 10):
        import torch

        self.torch = torch
        self.cuda = device.type == "cuda"
        self.iters, self.warmup, self.graph_reps = iters, warmup, graph_reps

    def __call__(self, fn, graph: bool = True) -> dict:
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        if not self.cuda:  # reduced mode: wall clock, only to exercise the code
            t0 = time.perf_counter()
            fn()
            return {"eager_us": (time.perf_counter() - t0) * 1e6}
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(self.iters):
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        result = {"eager_us": round(statistics.median(samples), 2)}
        if graph:
            g = None
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    fn()
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for _ in range(self.graph_reps):
                        fn()
                for _ in range(self.warmup):
                    g.replay()
                samples = []
                for _ in range(self.iters):
                    start.record()
                    g.replay()
                    end.record()
                    end.synchronize()
                    samples.append(start.elapsed_time(end) * 1e3 / self.graph_reps)
                result["graph_us"] = round(statistics.median(samples), 2)
            except Exception as exc:  # host syncs (the torch reference) cannot be captured
                result["graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}" if str(exc) else type(exc).__name__
                torch.cuda.synchronize()
            finally:
                del g
        return result


def bench_point(K, cases, timer, impls, batch, nodes, contexts, sgl, report, budget) -> list[dict]:
    """Every op at one (batch, T), each context; rows of {op, impl, context, eager_us, graph_us}."""
    import torch

    from spec_tree_kernels import TreeMaskMode as M

    dev = cases.device
    topk, num_steps = TREE_SHAPE[nodes]
    t = cases.tree(topk, num_steps, nodes, batch, "random", 1000 * batch + nodes, 0)
    scores, parent_list, selected = (t[k].to(dev) for k in ("scores", "parent_list", "selected"))
    tree, _ = K.reference.build_tree(selected, parent_list, torch.zeros(batch, dtype=torch.int64, device=dev), topk, num_steps, M.QLEN_ONLY, 0)
    candidates, target = (x.to(dev) for x in cases.tokens(t["selected"], t["parent_list"], topk, t["gen"]))
    verdict = K.verify_tree_greedy(candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target, num_steps, impl="torch")
    rows = []
    base = dict(batch=batch, T=nodes, topk=topk, num_steps=num_steps)

    def add(op, impl, context, fn):
        if budget.left() < 45:
            return
        try:
            # the torch reference syncs with the host (data-dependent shapes): eager only
            rows.append(dict(base, op=op, impl=impl, context=context, **timer(fn, graph=impl != "torch")))
        except Exception as exc:
            rows.append(dict(base, op=op, impl=impl, context=context, error=f"{type(exc).__name__}: {exc}"[:300]))

    # context-independent ops: once, at the first context
    ctx0 = contexts[0]
    for impl in [i for i in impls if i != "cuda"]:  # selection has no CUDA kernel
        add("select", impl, ctx0, lambda impl=impl: K.select_tree_nodes(scores, parent_list, topk, num_steps, nodes, validate=False, impl=impl))
    vargs = (candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target, num_steps)
    for impl in impls:
        add("verify", impl, ctx0, lambda impl=impl: K.verify_tree_greedy(*vargs, impl=impl))
    # sampled verify: float32 target distributions over Llama-3's vocabulary (128256), peaked on the
    # greedy target (drafts get accepted); skipped where target_probs alone would pass 4 GiB
    vocab = 128256 if dev.type == "cuda" else 50
    if batch * nodes * vocab * 4 <= 4 << 30:
        sgen = torch.Generator(device=dev).manual_seed(batch * 1000 + nodes)
        logits = torch.randn(batch, nodes, vocab, generator=sgen, device=dev)
        logits.scatter_add_(2, target[..., None], torch.full((batch, nodes, 1), 8.0, device=dev))
        sprobs = torch.softmax(logits, dim=-1)
        del logits
        scoins = torch.rand(batch, nodes, generator=sgen, device=dev)
        sexps = torch.empty(batch, vocab, device=dev).exponential_(generator=sgen)
        sargs = (candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, sprobs, scoins, sexps, num_steps)
        for impl in impls:
            add("verify_sampling", impl, ctx0, lambda impl=impl: K.verify_tree_sampling(*sargs, impl=impl))
        del sprobs, sargs
    # KV move: 30 layers x (K, V) of [blocks, 16, 8, 128] bf16; request b's T verify slots are contiguous
    kv_dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    heads, head_dim, layers = (KV_HEADS, KV_HEAD_DIM, KV_LAYERS) if dev.type == "cuda" else (2, 8, 2)
    num_blocks = (batch * nodes + KV_BLOCK - 1) // KV_BLOCK + 1
    caches = [torch.zeros(num_blocks, KV_BLOCK, heads, head_dim, dtype=kv_dtype, device=dev) for _ in range(2 * layers)]
    order = torch.randperm(batch, generator=t["gen"]).to(dev)
    slots = (order[:, None] * nodes + torch.arange(nodes, device=dev)).contiguous()
    for impl in impls:
        add("move_kv", impl, ctx0, lambda impl=impl: K.move_accepted_kv(caches, slots, verdict.accept_index, verdict.accept_length, impl=impl))
    if sgl is not None:
        # SGLang has no accepted-KV move kernel of this kind: the stand-in copies the same rows
        # (moved depths only) with index_select + index_copy_ per cache
        depth = torch.arange(num_steps + 1, device=dev)
        index = verdict.accept_index.long()
        moving = (depth <= verdict.accept_length[:, None].long()) & (index >= 0) & (index != depth)
        src = slots.gather(1, index.clamp(min=0))[moving]
        dst = slots.gather(1, depth.clamp(max=nodes - 1).expand_as(index))[moving]
        flat = [c.view(-1, heads, head_dim) for c in caches]

        def standin_move():
            for f in flat:
                f.index_copy_(0, dst, f.index_select(0, src))

        add("move_kv", "sglang_standin", ctx0, standin_move)
        if hasattr(sgl[0], "copy_all_layer_kv_cache_tiled") and dev.type == "cuda":
            # SGLang's real path: every accepted entry (self-copies and zero padding
            # included, size bs * (S + 1)) through its all-layer tiled copy kernel
            accepted = (depth <= verdict.accept_length[:, None].long()) & (index >= 0)
            pairs_src = slots.gather(1, index.clamp(min=0))[accepted]
            pairs_dst = slots.gather(1, depth.clamp(max=nodes - 1).expand_as(index))[accepted]
            size = batch * (num_steps + 1)
            tgt_loc = torch.zeros(size, dtype=torch.int64, device=dev)
            src_loc = torch.zeros(size, dtype=torch.int64, device=dev)
            tgt_loc[: pairs_dst.numel()] = pairs_dst
            src_loc[: pairs_src.numel()] = pairs_src
            add("move_kv", "sglang", ctx0, lambda: sgl[1].move_kv(sgl[0], flat, tgt_loc, src_loc))
        sgl_mod, sgl_api = sgl
        sgl_tree = sgl_api.build_tree(sgl_mod, parent_list, selected, torch.zeros(batch, dtype=torch.int64, device=dev), 0, topk, num_steps, nodes, 1)
        add("verify", "sglang", ctx0, lambda: sgl_api.verify(sgl_mod, candidates, sgl_tree[2], sgl_tree[3], sgl_tree[4], target, num_steps))

    for context in contexts:
        seq_lens = torch.full((batch,), context, dtype=torch.int64, device=dev)
        total = batch * context
        for mode in M:
            if nodes > K.modes.max_nodes(mode):
                continue
            for fill in (True, False) if mode == M.FULL_MASK else (True,):
                op = f"build_{mode.name}" + ("" if fill else "_nofill")
                for impl in impls:
                    add(op, impl, context, lambda impl=impl, mode=mode, fill=fill: K.build_tree(
                        selected, parent_list, seq_lens, topk, num_steps, mode, seq_lens_sum=total,
                        fill_prefix_mask=fill, validate=False, impl=impl))  # fmt: skip
                if sgl is not None and mode in (M.FULL_MASK, M.QLEN_ONLY):
                    add(op, "sglang", context, lambda mode=mode, fill=fill: sgl[1].build_tree(
                        sgl[0], parent_list, selected, seq_lens, total, topk, num_steps, nodes, int(mode), fill))  # fmt: skip
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    for row in rows:
        row["accepted_mean"] = round(float(verdict.accept_length.float().mean()), 3)
    return rows


def best(rows, op, impls, metric):
    values = [r[metric] for r in rows if r["op"] == op and r["impl"] in impls and metric in r]
    if not values:
        return None, None
    value = min(values)
    impl = next(r["impl"] for r in rows if r["op"] == op and r["impl"] in impls and r.get(metric) == value)
    return value, impl


def headline(rows, ours_impls, point=HEADLINE, first_context=BENCH_CONTEXTS[0]) -> dict:
    """Per step at ``point`` (batch 256, T 8, context 32k): ours (mask build in
    each of our modes + verify + KV move, fastest of our impls per op) vs
    SGLang (FULL_MASK build with prefix fill + verify + KV-move stand-in).
    Verify and KV move do not depend on the context: they were timed once, at
    ``first_context``."""
    batch, nodes, context = point
    at = [r for r in rows if r["batch"] == batch and r["T"] == nodes and r["context"] in (context, first_context)]
    at = [r for r in at if r["op"] in ("verify", "move_kv") or r["context"] == context]
    out = {"point": dict(batch=batch, T=nodes, context=context),
           "kv_move_note": "SGLang's move is its all-layer tiled copy kernel (cache_move.py, as "
                           "MHATokenToKVPool.move_kv_cache launches it, bs*(S+1) locations in chunks of 256) when "
                           "that kernel's source was supplied; otherwise an index_select + index_copy_ stand-in. "
                           "The two small index-fill kernels SGLang runs before it are not counted.",
           "sglang_build": "FULL_MASK with prefix fill, buffers as eagle_utils.build_tree_kernel_efficient allocates them"}  # fmt: skip
    for metric in ("graph_us", "eager_us"):
        verify, verify_impl = best(at, "verify", ours_impls, metric)
        move, move_impl = best(at, "move_kv", ours_impls, metric)
        ours = {}
        for op in sorted({r["op"] for r in at if r["op"].startswith("build_")}):
            build, build_impl = best(at, op, ours_impls, metric)
            if None not in (build, verify, move):
                ours[op[len("build_"):]] = dict(total_us=round(build + verify + move, 2), build_us=build, build_impl=build_impl,
                                                verify_us=verify, verify_impl=verify_impl, move_us=move, move_impl=move_impl)  # fmt: skip
        sgl_build, _ = best(at, "build_FULL_MASK", ("sglang",), metric)
        sgl_verify, _ = best(at, "verify", ("sglang",), metric)
        sgl_move, sgl_move_impl = best(at, "move_kv", ("sglang",), metric)
        if sgl_move is None:
            sgl_move, sgl_move_impl = best(at, "move_kv", ("sglang_standin",), metric)
        entry = {"ours_by_mode": ours}
        if None not in (sgl_build, sgl_verify, sgl_move):
            entry["sglang"] = dict(total_us=round(sgl_build + sgl_verify + sgl_move, 2), build_us=sgl_build, verify_us=sgl_verify,
                                   move_us=sgl_move, move_impl=sgl_move_impl)  # fmt: skip
        compact = {m: v for m, v in ours.items() if not m.startswith("FULL_MASK")}
        if compact and "sglang" in entry:
            mode = min(compact, key=lambda m: compact[m]["total_us"])
            entry["ours_best_mode"] = mode
            entry["ratio_sglang_over_ours"] = round(entry["sglang"]["total_us"] / compact[mode]["total_us"], 2)
            if "QLEN_ONLY" in ours:
                entry["ratio_sglang_over_ours_qlen_only"] = round(entry["sglang"]["total_us"] / ours["QLEN_ONLY"]["total_us"], 2)
        out[metric] = entry
    return out


def run_bench(K, cases, impls, reduced, report, budget, sgl):
    section = report.data.setdefault("bench", {})
    if reduced:
        grid = dict(batches=(2,), nodes=(8,), contexts=(64,))
        section["note"] = "reduced mode: a smoke run of the benchmark code (CPU, Triton interpreter); timings are meaningless"
    else:
        grid = dict(batches=BENCH_BATCHES, nodes=BENCH_NODES, contexts=BENCH_CONTEXTS)
        section["note"] = ("CUDA-event medians in microseconds; eager_us = one call with the GPU idle before it (host "
                           "launch overhead included), graph_us = one replay of a CUDA graph of 10 back-to-back "
                           "calls / 10 (GPU time per call); warm L2")  # fmt: skip
    section["kv_cache"] = dict(layers=KV_LAYERS, kv_heads=KV_HEADS, head_dim=KV_HEAD_DIM, block_size=KV_BLOCK, dtype="bfloat16")
    section["tree_shapes"] = {str(k): dict(topk=v[0], num_steps=v[1]) for k, v in TREE_SHAPE.items()}
    section["sglang_kernels"] = sgl is not None
    timer = Timer(cases.device, iters=3 if reduced else 15, warmup=1 if reduced else 3)
    rows = section.setdefault("rows", [])
    for batch in grid["batches"]:
        for nodes in grid["nodes"]:
            if budget.left() < 60:
                section.setdefault("skipped_for_time", []).append(dict(batch=batch, T=nodes))
                continue
            t0 = time.time()
            try:
                rows.extend(bench_point(K, cases, timer, impls, batch, nodes, grid["contexts"], sgl, report, budget))
            except Exception as exc:
                section.setdefault("errors", []).append(dict(batch=batch, T=nodes, error=traceback.format_exc(limit=4)[-1500:]))
                report.log("  bench point failed:", exc)
            report.log(f"  bench batch={batch} T={nodes}: {time.time() - t0:.1f}s")
            report.save()
    if reduced:  # exercise the arithmetic on the smoke point
        point = (grid["batches"][0], grid["nodes"][0], grid["contexts"][-1])
        report.data["headline"] = dict(headline(rows, impls, point, grid["contexts"][0]), note="reduced mode: not a measurement")
    else:
        report.data["headline"] = headline(rows, impls)
    report.save()


# ----------------------------------------------------------- tree attention

ATTENTION_MODE_POINTS = dict(batches=(1, 8), tree_sizes=(8, 64), contexts=(4096,))
ATTENTION_REDUCED = dict(batches=(1, 2), tree_sizes=(1, 4), contexts=(40,), num_q_heads=4, num_kv_heads=2, head_dim=16,
                         block_size=16)  # fmt: skip


def run_tree_attention(K, reduced, report, budget) -> int:
    """Issue #17: tree attention (kernels/attention_bench.py), in order of priority:

    1. correctness: split / single / auto against the torch reference, mixed
       context lengths per batch (0, block boundaries, long), every compact
       mask mode, bf16/fp16/fp32;
    2. copy: plain device-to-device copy bandwidth (1 GiB and 16 MB), the yardstick;
    3. sweep: batch {1,4,8,64} x T {1,8,16,64} x context {1k,4k,32k},
       ANCESTOR_BITMASK, Llama-3-8B layer (32/8 heads, D 128, bf16, 16-token
       blocks): time (CUDA graph replay, L2 flushed), K/V bandwidth, ratio to
       T=1, the dispatcher's kernel and the other kernel's time, error
       against the reference on the first two requests;
    4. modes: PARENT_POINTER and QLEN_ONLY at batch {1,8} x T {8,64} x 4k;
    5. tune: forced split counts at a few points (retunes plan_tree_attention);
    6. targets: the issue's acceptance figures from 2 and 3.

    Returns the number of failed correctness checks (sweep rows included)."""
    import torch

    section = report.data.setdefault("tree_attention", {})
    from spec_tree_kernels import attention_bench as ab

    device = "cpu" if reduced else "cuda"
    deadline = budget.deadline - 10
    failed = 0
    if reduced:
        section["note"] = "reduced mode: CPU interpreter, tiny shapes; timings are meaningless"

    t0 = time.time()
    check = ab.check_tree_attention(device)
    check["seconds"] = round(time.time() - t0, 1)
    section["correctness"] = check
    failed += check["failed"]
    report.log(f"  attention correctness: {check['passed']} passed, {check['failed']} failed ({check['seconds']}s)")
    report.save()

    section["copy"] = ab.copy_bandwidth(device, sizes=(1 << 20,) if reduced else (1 << 30, 16 << 20), iters=1 if reduced else 10)
    report.log("  copy bandwidth:", json.dumps(section["copy"]))
    report.save()

    if reduced:
        shape = dict(ATTENTION_REDUCED)
        grid = {k: shape.pop(k) for k in ("batches", "tree_sizes", "contexts")}
        kw = dict(shape, dtype=torch.float32, iters=1, tolerance=1e-4, device=device, plan_kwargs=dict(split_min_tokens=16))
    else:
        grid, shape, kw = {}, None, dict(device=device)
    t0 = time.time()
    sweep = ab.sweep_tree_attention(*grid.values(), deadline=deadline, log=report.log, **kw)
    section["sweep"] = dict(sweep, seconds=round(time.time() - t0, 1), layer="Llama-3-8B: 32 query / 8 KV heads, D 128, bf16, block 16",
                            timer="median of 10 CUDA-graph replays of one call, L2 flushed (256 MB write) before each",
                            kv_gbps="K and V bytes of context + T positions / time")  # fmt: skip
    bad = [r for r in sweep["rows"] if not r.get("ok", True)]
    failed += len(bad)
    if reduced:  # the arithmetic on the smoke grid
        section["targets"] = dict(ab.targets(sweep["rows"], section["copy"], context=40, nodes=4, batches=(1, 2)),
                                  note="reduced mode: not a measurement")  # fmt: skip
    else:
        section["targets"] = ab.targets(sweep["rows"], section["copy"])
    report.log("  attention targets:", json.dumps(section["targets"]))
    report.save()

    t0 = time.time()
    modes = []
    for mode in ("PARENT_POINTER", "QLEN_ONLY"):
        if reduced:  # one tiny point per mode
            result = ab.sweep_tree_attention((1,), (4,), (40,), mode=mode, compare_kernels=False, log=report.log, **kw)
        else:
            result = ab.sweep_tree_attention(*ATTENTION_MODE_POINTS.values(), mode=mode, compare_kernels=False, deadline=deadline,
                                             log=report.log, **kw)  # fmt: skip
        modes.extend(result["rows"])
        failed += len([r for r in result["rows"] if not r.get("ok", True)])
    section["modes"] = dict(rows=modes, seconds=round(time.time() - t0, 1))
    report.save()

    t0 = time.time()
    if reduced:
        tune = ab.tune_splits(points=((1, 4, 64),), splits=(2,), iters=1, device=device, log=report.log,
                              plan_kwargs=dict(split_min_tokens=16), shape=shape, dtype=torch.float32)  # fmt: skip
    else:
        tune = ab.tune_splits(deadline=deadline, log=report.log, device=device)
    section["tune"] = dict(points=tune, seconds=round(time.time() - t0, 1))
    report.save()

    section["failed"] = failed
    report.save()
    return failed


# --------------------------------------------------------------------- main


def guarded(report, name, fn, *args, **kwargs):
    """Run one section; an exception is recorded, and the next section still runs."""
    try:
        return fn(*args, **kwargs)
    except Exception:
        report.data.setdefault("section_errors", {})[name] = traceback.format_exc(limit=6)[-3000:]
        report.log(f"section {name} raised:", traceback.format_exc(limit=6))
        report.save()
        return None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reduced", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny sizes (also without a GPU)")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench_out"), help="output folder ($OUT)")
    parser.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 450; 110 reduced)")
    parser.add_argument("--skip", default="", help="comma list of sections to skip: correctness,sglang,sanitizer,bench,attention")
    parser.add_argument("--sanitizer-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impls", default="cuda,triton", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def record_environment(report: Report, reduced: bool, budget: Budget) -> dict:
    """Python, torch, Triton, device and tools into the report's ``env``."""
    import torch

    env = report.data.setdefault("env", {})
    env.update(
        mode="reduced" if reduced else "full",
        python=platform.python_version(),
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        device=torch.cuda.get_device_name(0) if not reduced else platform.machine(),
        triton_interpret=os.environ.get("TRITON_INTERPRET"),
        budget_s=budget.left(),
        nvcc=None,
        compute_sanitizer=find_tool("compute-sanitizer"),
    )
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception as exc:
        env["triton"] = f"unavailable: {exc}"
    report.log("device_check:", json.dumps(env))
    report.save()
    return env


def start_cuda_build(env: dict):
    """Build the CUDA kernels in a thread (a minute of nvcc + c++) while the
    Triton checks run. Returns (thread, state dict it fills)."""
    from spec_tree_kernels import cuda_ops

    env["nvcc"] = cuda_ops.find_nvcc()
    build_state: dict = {}

    def build():
        t0 = time.time()
        build_state["available"] = cuda_ops.available()
        build_state["seconds"] = round(time.time() - t0, 1)

    build_thread = threading.Thread(target=build, daemon=True)
    build_thread.start()
    return build_thread, build_state


def finish_cuda_build(env: dict, report: Report, budget: Budget, build_thread, build_state: dict) -> bool:
    """Wait for the build (leaving the budget's last 200 s); record it; True when the kernels load."""
    build_thread.join(timeout=max(1.0, budget.left() - 200))
    from spec_tree_kernels import cuda_ops

    env["cuda_kernels"] = dict(
        available=build_state.get("available", False),
        build_seconds=build_state.get("seconds", "still building"),
        backend=cuda_ops.backend_name(),
        error=cuda_ops.load_error(),
    )
    report.log("cuda kernels:", env["cuda_kernels"])
    report.save()
    return bool(build_state.get("available"))


def load_sglang_kernels(report: Report):
    """(SGLang's spec-tree kernels, their loader module), or None (why: in the report)."""
    try:
        import sglang_spec_tree

        if sglang_spec_tree.available():
            return (sglang_spec_tree.load(), sglang_spec_tree)
    except Exception as exc:
        report.data["sglang_load_error"] = f"{type(exc).__name__}: {exc}"
    return None


def write_summary(report: Report, failed: int) -> None:
    report.data["summary"] = dict(
        correctness_failed=failed,
        sanitizer_clean={k: v.get("clean") for k, v in report.data.get("sanitizer", {}).items() if isinstance(v, dict)},
        headline=(report.data.get("headline", {}).get("graph_us") or {}).get("ratio_sglang_over_ours"),
        attention_targets=report.data.get("tree_attention", {}).get("targets"),
    )
    report.log("summary:", json.dumps(report.data["summary"]))
    report.save()


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path[:0] = [str(ROOT), str(CI)]
    import torch

    reduced = args.reduced or not torch.cuda.is_available()
    if reduced:
        # before anything defines a @triton.jit function (spec_tree_kernels imports tree_attention)
        os.environ["TRITON_INTERPRET"] = "1"
    if args.sanitizer_child:
        return sanitizer_child(args)
    report = Report(Path(args.out))
    budget = Budget(args.budget or (110.0 if reduced else 450.0))
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    K = import_kernels()
    from spec_plugins.synthetic_trees import synthetic_pool

    device = torch.device("cpu" if reduced else "cuda")
    cases = Cases(K, device, synthetic_pool)
    env = record_environment(report, reduced, budget)
    build_thread, build_state = start_cuda_build(env) if not reduced else (None, {})
    sgl = load_sglang_kernels(report)

    failed = 0
    if "correctness" not in skip:
        report.log("correctness: triton vs torch")
        tally = guarded(report, "correctness_triton", run_correctness, K, cases, ["triton"], reduced, report, budget, "triton",
                        min_left=0 if reduced else 300)  # fmt: skip
        failed += tally.failed() if tally else 1
    if "sglang" not in skip:
        report.log("sglang cross-check")
        guarded(report, "sglang", run_sglang_crosscheck, K, cases, reduced, report, budget, min_left=0 if reduced else 270)
        failed += report.data.get("sglang_crosscheck", {}).get("failed", 0)

    impls = ["torch", "triton"]
    if build_thread is not None and finish_cuda_build(env, report, budget, build_thread, build_state):
        impls.append("cuda")
        if "correctness" not in skip:
            report.log("correctness: cuda vs torch")
            tally = guarded(report, "correctness_cuda", run_correctness, K, cases, ["cuda"], reduced, report, budget, "cuda",
                            min_left=200)  # fmt: skip
            failed += tally.failed() if tally else 1

    if "sanitizer" not in skip and not reduced:
        report.log("compute-sanitizer")
        tools = [("memcheck", ",".join(i for i in ("cuda", "triton") if i in impls))]
        if "cuda" in impls:
            tools.append(("racecheck", "cuda"))
        guarded(report, "sanitizer", run_sanitizer, report, budget, tools)
    if "bench" not in skip:
        report.log("bench")
        guarded(report, "bench", run_bench, K, cases, impls, reduced, report, budget, sgl)
    if "attention" not in skip:
        report.log("tree attention (issue #17)")
        attention_failed = guarded(report, "attention", run_tree_attention, K, reduced, report, budget)
        failed += 1 if attention_failed is None else attention_failed

    write_summary(report, failed)
    return 1 if failed else 0

if __name__ == "__main__":
    sys.exit(main())
