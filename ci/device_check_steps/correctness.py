"""Section [correctness]: impl="triton" and impl="cuda" against the torch
reference on the same device tensors, op by op, byte for byte.

A case is (topk, num_steps, T, pool flavor) x batch: a random SGLang-shaped
draft pool, its selection, every mask mode's build (FULL_MASK with and
without prefix fill; open selections too) and the compact modes' build from
parents, greedy verify with real
acceptance, sampled verify (float32 and float64 distributions) and the KV
move over several paged-cache layouts. Then DDTree's block trees
(``build_block_tree``, issue #52): per-position top-K log-probs with exact
ties and -inf / NaN entries, node budgets up to the block's capacity.
"""

from __future__ import annotations

import time
import traceback
import zlib
from dataclasses import dataclass

import torch

import spec_tree_kernels as K
from spec_plugins.kernel_bench.tree_ops import draft_tree, tokens_with_acceptance
from spec_tree_kernels import TreeMaskMode as M

from .cases import kv_layouts, open_selection, sampling_args
from .plumbing import CheckRun, Tally, first_diff, same
from .recurrent import check_recurrent_trees

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
OPS = ("select", "build", "verify", "sampling", "move")
# DDTree (batch, block length L, top-K, drafts N, flavor): "ties" draws log-probs from a few values, so
# paths tie often (the tie rule decides); "holes" has -inf and NaN entries (the op's clamps)
BLOCK_CASES = [(1, 7, 4, 7, "random"), (7, 7, 4, 15, "ties"), (64, 7, 8, 31, "random"), (64, 15, 8, 63, "ties"),
               (3, 3, 2, 14, "holes"), (16, 16, 10, 255, "ties")]
REDUCED_BLOCK_CASES = [(2, 3, 2, 14, "ties"), (2, 4, 3, 9, "holes")]


def implementation_modules(impls) -> dict:
    """{impl: the module whose functions run it}, the reference always included."""
    mods = {"torch": K.reference}
    if "triton" in impls:
        from spec_tree_kernels import triton_ops

        mods["triton"] = triton_ops
    if "cuda" in impls:
        from spec_tree_kernels import cuda_ops  # loads the built extension

        mods["cuda"] = cuda_ops
    return mods


@dataclass
class Case:
    """One (tree shape, batch) case: the CPU draft tree ``t`` (draft_tree's
    dict) and its parent_list, seq_lens [B] and selected [B, T-1] on the device."""

    topk: int
    num_steps: int
    nodes: int
    batch: int
    flavor: str
    t: dict
    parent_list: torch.Tensor
    seq_lens: torch.Tensor
    selected: torch.Tensor

    @property
    def label(self) -> dict:
        return dict(topk=self.topk, num_steps=self.num_steps, nodes=self.nodes, batch=self.batch, flavor=self.flavor)

    @property
    def seq_lens_sum(self) -> int:
        return int(self.t["seq_lens"].sum())


def make_case(case: tuple, batch: int, reduced: bool, device: torch.device) -> Case:
    topk, num_steps, nodes, flavor = case
    seed = zlib.crc32(repr((topk, num_steps, nodes, batch, flavor)).encode())  # stable across runs
    t = draft_tree(topk, num_steps, nodes, batch, flavor, seed, max_context=20 if reduced else 3000)
    parent_list, seq_lens, selected = (t[k].to(device) for k in ("parent_list", "seq_lens", "selected"))
    return Case(topk, num_steps, nodes, batch, flavor, t, parent_list, seq_lens, selected)


def check_case(tally: Tally, impls, case: tuple, batch: int, reduced: bool, device: torch.device, ops=OPS):
    """Every op of one (tree shape, batch): impls against the torch reference.
    Returns (draft tokens the greedy verify accepted, the most it could)."""
    c = make_case(case, batch, reduced, device)
    mods = implementation_modules(impls)
    if "select" in ops and "triton" in impls and c.nodes > 1:
        got = K.select_tree_nodes(c.t["scores"].to(device), c.parent_list, c.topk, c.num_steps, c.nodes, impl="triton")
        tally.add("select/triton", same(got.cpu(), c.t["selected"]), **c.label)
    if "build" in ops:
        check_build(tally, c, mods, impls)
        if "triton" in impls:
            check_from_parents(tally, c, mods)
    tree, _ = mods["torch"].build_tree(c.selected, c.parent_list, c.seq_lens, c.topk, c.num_steps, M.QLEN_ONLY,
                                       c.seq_lens_sum)  # fmt: skip
    candidates, target = (x.to(device) for x in tokens_with_acceptance(c.t["selected"], c.t["parent_list"], c.topk, c.t["gen"]))
    vargs = (candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target, c.num_steps)
    want = mods["torch"].verify_tree_greedy(*vargs)
    if "verify" in ops:
        for impl in impls:
            got = mods[impl].verify_tree_greedy(*vargs)
            bad = [f for f in want._fields if not same(getattr(got, f), getattr(want, f))]
            tally.add(f"verify/{impl}", not bad, fields=bad, **c.label)
    if "sampling" in ops:
        check_sampling(tally, c, mods, impls, vargs, vocab=37 if reduced else 1537)
    if "move" in ops and batch > 0:
        check_move(tally, c, mods, impls, want, reduced)
    return int(want.accept_length.sum()), batch * c.num_steps


def build_variants(c: Case):
    """(selection kind, selection [B, T-1], mode, fill): closed selections in
    every mode T fits, open ones (nodes > 2) in the modes that accept them."""
    selections = [("closed", c.selected)]
    if c.nodes > 2:
        selections.append(("open", open_selection(c.topk, c.num_steps, c.nodes, c.batch, c.t["gen"]).to(c.selected.device)))
    for kind, sel in selections:
        for mode in M:
            if mode == M.QLEN_ONLY_BITPACKING and c.nodes > 32:
                continue
            if kind == "open" and mode not in (M.QLEN_ONLY, M.FULL_MASK, M.PARENT_POINTER):
                continue
            for fill in (True, False) if mode == M.FULL_MASK else (True,):
                yield kind, sel, mode, fill


def check_build(tally: Tally, c: Case, mods: dict, impls) -> None:
    for kind, sel, mode, fill in build_variants(c):
        start = None
        if not fill:  # the prefix stays as it was: start every impl from the same bytes
            size = c.seq_lens_sum * c.nodes + c.nodes * c.nodes * c.batch
            start = torch.rand(size, generator=c.t["gen"]).lt(0.5).to(sel.device)
        args = (sel, c.parent_list, c.seq_lens, c.topk, c.num_steps, mode, c.seq_lens_sum, fill)
        want, want_ok = mods["torch"].build_tree(*args, None if start is None else start.clone())
        for impl in impls:
            got, ok = mods[impl].build_tree(*args, None if start is None else start.clone())
            bad = [f for f in want._fields if not same(getattr(got, f), getattr(want, f))]
            if not same(ok, want_ok):
                bad.append("ok")
            detail = {f: first_diff(getattr(got, f), getattr(want, f)) for f in bad if f != "ok"}
            tally.add(f"build/{impl}", not bad, mode=mode.name, fill=fill, selection=kind, fields=bad, diff=detail,
                      **c.label)  # fmt: skip


def check_from_parents(tally: Tally, c: Case, mods: dict) -> None:
    """``tree_from_parents`` (vLLM V2's build) of the closed selection's trees,
    every compact mode T fits, climbing T - 1 levels as the runner does and one
    level short of the deepest node; Triton only ("cuda" runs the same kernel)."""
    parent = K.node_parents(c.selected, c.parent_list, c.topk, validate=False)  # closed by construction
    for mode in M:
        if mode == M.FULL_MASK or (mode == M.QLEN_ONLY_BITPACKING and c.nodes > 32):
            continue
        for max_depth in sorted({c.nodes - 1, max(min(c.num_steps, c.nodes - 1) - 1, 0)}):
            want = mods["torch"].tree_from_parents(parent, c.seq_lens, mode, max_depth)
            got = mods["triton"].tree_from_parents(parent, c.seq_lens, mode, max_depth)
            bad = [f for f in want._fields if not same(getattr(got, f), getattr(want, f))]
            detail = {f: first_diff(getattr(got, f), getattr(want, f)) for f in bad}
            tally.add("from_parents/triton", not bad, mode=mode.name, max_depth=max_depth, fields=bad, diff=detail,
                      **c.label)  # fmt: skip


def check_sampling(tally: Tally, c: Case, mods: dict, impls, vargs: tuple, vocab: int) -> None:
    """Sampled verify with float32 and float64 distributions over ``vocab`` tokens."""
    candidates, next_token, next_sibling, target, num_steps = vargs
    for dtype in (torch.float32, torch.float64):
        sargs = sampling_args(candidates.cpu(), target.cpu(), next_token.cpu(), next_sibling.cpu(), num_steps,
                              c.t["gen"], dtype, vocab)  # fmt: skip
        sargs = tuple(a.to(candidates.device) if isinstance(a, torch.Tensor) else a for a in sargs)
        want = mods["torch"].verify_tree_sampling(*sargs)
        for impl in impls:
            got = mods[impl].verify_tree_sampling(*sargs)
            bad = [f for f in want._fields if not same(getattr(got, f), getattr(want, f))]
            detail = {f: first_diff(getattr(got, f), getattr(want, f)) for f in bad}
            tally.add(f"sampling/{impl}", not bad, fields=bad, diff=detail, dtype=str(dtype),
                      sampled_accepted=int(want.accept_length.sum()), **c.label)  # fmt: skip


def check_move(tally: Tally, c: Case, mods: dict, impls, verdict, reduced: bool) -> None:
    """The greedy verdict's KV move over every cache layout, fp16 and bf16
    alternately, int32 and int64 indices alternately."""
    device, gen, nodes = c.selected.device, c.t["gen"], c.nodes
    for li, (layout, block_size, heads, head_dim, views, shape) in enumerate(kv_layouts(reduced)):
        dtype = (torch.float16, torch.bfloat16)[li % 2]
        num_blocks = (c.batch * nodes + 7) // block_size + 3
        storage = torch.randn(shape(num_blocks, block_size, heads, head_dim), generator=gen).to(dtype).to(device)
        slots = torch.randperm(num_blocks * block_size, generator=gen)[: c.batch * nodes].view(c.batch, nodes).to(device)
        index_dtype = torch.int64 if li % 2 else torch.int32
        index, length = verdict.accept_index.to(index_dtype), verdict.accept_length.to(index_dtype)
        want = storage.clone()
        mods["torch"].move_accepted_kv(views(want), slots, index, length)
        for impl in impls:
            got = storage.clone()
            mods[impl].move_accepted_kv(views(got), slots, index, length)
            tally.add(f"move/{impl}", same(got, want), layout=layout, dtype=str(dtype), **c.label)


def block_tree_inputs(batch: int, length: int, topk: int, flavor: str, seed: int):
    """(log-probs [batch, L, K] float32 sorted descending, tokens [batch, L, K] int64) on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    if flavor == "ties":
        values = -torch.randint(0, 4, (batch, length, topk), generator=gen).float() / 2
    else:
        values = torch.randn(batch, length, topk * 4, generator=gen).log_softmax(-1)[..., :topk]
    if flavor == "holes":
        values[torch.rand(values.shape, generator=gen) < 0.2] = float("-inf")
        values[torch.rand(values.shape, generator=gen) < 0.05] = float("nan")
    values = values.sort(-1, descending=True).values  # NaN sorts first: the op treats it as -inf
    tokens = torch.randint(0, 50_000, (batch, length, topk), generator=gen)
    return values, tokens


def check_block_trees(tally: Tally, impls, reduced: bool, device: torch.device) -> None:
    """``build_block_tree``: Triton against the reference, every output field byte for byte."""
    if "triton" not in impls:  # the op has a torch and a Triton implementation only
        return
    for batch, length, topk, nodes, flavor in REDUCED_BLOCK_CASES if reduced else BLOCK_CASES:
        label = dict(batch=batch, length=length, topk=topk, nodes=nodes, flavor=flavor)
        values, tokens = (x.to(device) for x in block_tree_inputs(batch, length, topk, flavor,
                                                                  zlib.crc32(repr(label).encode())))
        want = K.build_block_tree(values, tokens, nodes, impl="torch")
        got = K.build_block_tree(values, tokens, nodes, impl="triton")
        bad = [f for f in want._fields if not same(getattr(got, f), getattr(want, f))]
        detail = {f: first_diff(getattr(got, f), getattr(want, f)) for f in bad}
        tally.add("block_tree/triton", not bad, fields=bad, diff=detail, **label)


def run_correctness(run: CheckRun, impls, key: str, min_left: float = 0.0) -> Tally:
    """Every case x batch while ``min_left`` seconds of the budget remain;
    the result under correctness.<key>."""
    tally, accepted, possible, skipped, t0 = Tally(), 0, 0, 0, time.time()
    for case in REDUCED_CASES if run.reduced else FULL_CASES:
        for batch in REDUCED_BATCHES if run.reduced else FULL_BATCHES:
            if run.budget.left() < min_left:
                skipped += 1
                continue
            try:
                a, p = check_case(tally, impls, case, batch, run.reduced, run.device)
                accepted, possible = accepted + a, possible + p
            except Exception as exc:  # an op raising is a failure of every impl under test
                for impl in impls:
                    tally.add(f"error/{impl}", False, case=case, batch=batch, error=f"{type(exc).__name__}: {exc}"[:400])
                run.report.log("  case", case, "batch", batch, "raised:", traceback.format_exc(limit=3))
        run.report.log(f"  {key}: case {case} done ({tally.passed()} passed, {tally.failed()} failed)")
    try:
        check_block_trees(tally, impls, run.reduced, run.device)
    except Exception as exc:  # the op raising is a failure of the impl under test
        tally.add("error/block_tree", False, error=f"{type(exc).__name__}: {exc}"[:400])
        run.report.log("  block trees raised:", traceback.format_exc(limit=3))
    try:
        if "triton" in impls:  # the recurrent tree ops have a torch and a Triton implementation only
            check_recurrent_trees(tally, run.reduced, run.device)
    except Exception as exc:
        tally.add("error/recurrent", False, error=f"{type(exc).__name__}: {exc}"[:400])
        run.report.log("  recurrent trees raised:", traceback.format_exc(limit=3))
    result = tally.as_dict()
    result.update(impls=impls, seconds=round(time.time() - t0, 1), cases_skipped_for_time=skipped,
                  accepted_draft_tokens=accepted, max_acceptable_draft_tokens=possible)  # fmt: skip
    run.report.data.setdefault("correctness", {})[key] = result
    run.report.save()
    return tally
