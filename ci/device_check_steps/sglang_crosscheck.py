"""Section [sglang_crosscheck]: SGLang 0.5.23's own Triton build (FULL_MASK,
QLEN_ONLY) and greedy verify against ours, where $SGLANG_SPEC_TREE_PY names a
copy of its spec_tree.py (ci/sglang_spec_tree.py loads it without sglang).
"random" pools have no ties, so SGLang's selection is then ours too."""

from __future__ import annotations

import os

import sglang_spec_tree
import torch

from spec_plugins.kernel_bench.tree_ops import draft_tree, tokens_with_acceptance
from spec_tree_kernels import TreeMaskMode, reference

from .plumbing import CheckRun, Tally, same

FULL_SHAPES, FULL_BATCHES = [(4, 3, 8), (4, 5, 16), (8, 4, 32), (8, 6, 64), (1, 6, 7)], (1, 9, 64)  # (topk, steps, T)
REDUCED_SHAPES, REDUCED_BATCHES = [(2, 3, 6), (3, 1, 3)], (2,)


def load_or_skip(section: dict):
    """SGLang's kernel module, or None with the reason in ``section["skipped"]``."""
    if not sglang_spec_tree.available():
        section["skipped"] = f"${sglang_spec_tree.ENV_VAR} does not name a copy of SGLang's spec_tree.py"
        return None
    try:
        return sglang_spec_tree.load()
    except Exception as exc:
        section["skipped"] = f"loading SGLang's kernels failed: {type(exc).__name__}: {exc}"
        return None


def run_sglang_crosscheck(run: CheckRun, min_left: float = 0.0) -> None:
    section = run.report.data.setdefault("sglang_crosscheck", {})
    mod = load_or_skip(section)
    if mod is None:
        run.report.save()
        return
    tally = Tally()
    for topk, num_steps, nodes in REDUCED_SHAPES if run.reduced else FULL_SHAPES:
        for batch in REDUCED_BATCHES if run.reduced else FULL_BATCHES:
            if run.budget.left() < min_left:
                section["stopped_for_time"] = True
                break
            crosscheck_case(tally, mod, run.device, topk, num_steps, nodes, batch, max_context=20 if run.reduced else 3000)
    section.update(tally.as_dict())
    section["source"] = os.environ.get(sglang_spec_tree.ENV_VAR)
    run.report.save()


def crosscheck_case(tally: Tally, mod, dev, topk: int, num_steps: int, nodes: int, batch: int, max_context: int) -> None:
    """Build in FULL_MASK and QLEN_ONLY, then greedy verify on the QLEN_ONLY
    build's retrieve arrays (SGLang's accept_index is flat: b * T + node)."""
    t = draft_tree(topk, num_steps, nodes, batch, "random", topk * 1000 + nodes * 10 + batch, max_context)
    pl, sel, sl = (t[k].to(dev) for k in ("parent_list", "selected", "seq_lens"))
    total = int(t["seq_lens"].sum())
    label = dict(topk=topk, num_steps=num_steps, nodes=nodes, batch=batch)
    for mode in (TreeMaskMode.FULL_MASK, TreeMaskMode.QLEN_ONLY):
        ours, _ = reference.build_tree(sel, pl, sl, topk, num_steps, mode, total)
        mask, positions, index, nxt, sib = sglang_spec_tree.build_tree(mod, pl, sel, sl, total, topk, num_steps, nodes, int(mode))
        agree = (same(mask, ours.tree_mask) and same(positions.view(batch, nodes), ours.positions)
                 and same(index, ours.retrieve_index) and same(nxt, ours.retrieve_next_token)
                 and same(sib, ours.retrieve_next_sibling))  # fmt: skip
        tally.add(f"build_{mode.name}", agree, **label)
    candidates, target = (x.to(dev) for x in tokens_with_acceptance(t["selected"], t["parent_list"], topk, t["gen"]))
    want = reference.verify_tree_greedy(candidates, ours.retrieve_next_token, ours.retrieve_next_sibling, target, num_steps)
    _, accept_index, accept_num = sglang_spec_tree.verify(mod, candidates, index, nxt, sib, target, num_steps)
    flat = torch.where(want.accept_index >= 0, want.accept_index + nodes * torch.arange(batch, device=dev)[:, None], -1)
    tally.add("verify", same(accept_index, flat.to(torch.int32)) and same(accept_num, want.accept_length), **label)
