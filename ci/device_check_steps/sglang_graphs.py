"""Section [sglang_graphs], issue #38: TARGET_VERIFY captured in a CUDA graph
the way ``spec_tree_triton`` lets SGLang's decode graph runner capture it,
replayed after the batch's sequence lengths change, against the eager step.

The device check runs without SGLang (its venv holds torch and Triton only),
so this is the closest stand-in for SGLang's graph runner around our backend
(``spec_plugins.sglang_ext.attention.TreeVerifyMixin.graph_verify_metadata``):

* static buffers, as the backend keeps them: a block table [max_bs,
  req_to_token width], context lengths [max_bs], the verify-mask buffer of
  the mode (``modes.empty_tree_mask``, zeroed);
* capture: ``TreeAttentionPlan.create`` over the first bs rows of those
  buffers with ``max_context_len=None`` (the split plan for any length),
  one warm-up run, then every layer's ``run`` recorded in a
  ``torch.cuda.CUDAGraph``;
* replay, per step: the requests' ``req_to_token`` columns up to the longest
  context + T copied into the block table (the host-side lengths bound it),
  the lengths copied, the tree masks written into the mask buffer (as
  SGLang's builder writes them through our build hook), the padded requests
  at length 1 on row 0 (SGLang's fill value), then ``graph.replay()``;
* expected: the eager step (a plan over the narrowed rows, the backend's
  eager path) and the torch reference, on the real requests.

Steps replay twice per mask mode, the second batch with longer contexts than
the first. Reduced mode (CPU, TRITON_INTERPRET=1): no CUDA graph exists, so
"replay" re-runs the captured closure over the same static tensors (what a
graph would read); the JSON says ``graph: false``. The CPU test of the
backend itself through SGLang's entry points is
tests/sglang/test_plugin_graphs.py.
"""

from __future__ import annotations

import torch

from spec_plugins.kernel_bench import attention as ab
from spec_tree_kernels.attention_plan import TreeAttentionPlan
from spec_tree_kernels.attention_reference import tree_attention_reference
from spec_tree_kernels.attention_triton import plan_tree_attention
from spec_tree_kernels.modes import MODES, TreeMaskMode, empty_tree_mask

from .plumbing import CheckRun

GRAPH_MODES = (TreeMaskMode.ANCESTOR_BITMASK, TreeMaskMode.PARENT_POINTER, TreeMaskMode.QLEN_ONLY)
FILL = 1  # SGLang's seq-len fill value for padded requests (our backend's get_cuda_graph_seq_len_fill_value)


def shapes_for(run: CheckRun) -> dict:
    if run.reduced:
        return dict(max_bs=4, nodes=8, hq=4, hkv=2, dim=16, width=96, layers=2, dtype=torch.float32, tol=1e-4,
                    contexts=((5, 40, 17), (3, 80, 61)))  # fmt: skip
    # a Llama-3-8B layer, 8k-token req_to_token rows
    return dict(max_bs=16, nodes=8, hq=32, hkv=8, dim=128, width=8192, layers=4, dtype=torch.bfloat16, tol=3e-2,
                contexts=((100, 3000, 17, 800, 5, 2048, 1, 4000, 63, 64, 65, 129, 7, 900, 333),
                          (7000, 5, 8000, 64, 1, 6000, 4096, 4095, 3, 2, 7500, 300, 8100, 20, 1)))  # fmt: skip


def run_sglang_graphs(run: CheckRun) -> int:
    """Capture / replay / eager per mask mode; returns the failures."""
    shapes = shapes_for(run)
    rows = [graph_case(run.device, mode, shapes, seed=i) for i, mode in enumerate(GRAPH_MODES)]
    failed = sum(not row["ok"] for row in rows)
    run.report.data["sglang_graphs"] = dict(rows=rows, failed=failed, passed=len(rows) - failed,
                                            graph=run.device.type == "cuda")  # fmt: skip
    run.report.save()
    for row in rows:
        run.report.log(f"  {row['mode']}: {'ok' if row['ok'] else 'FAILED'} {row.get('max_abs_err', row.get('error'))}")
    return failed


def graph_case(device: torch.device, mode: TreeMaskMode, shapes: dict, seed: int) -> dict:
    entry = dict(mode=mode.name, graph=device.type == "cuda")
    try:
        entry.update(_graph_case(device, mode, shapes, torch.Generator().manual_seed(seed)))
    except Exception as exc:  # noqa: BLE001 - recorded: the section goes on with the next mode
        entry.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[:400]}")
    return entry


def _graph_case(device, mode, shapes, gen) -> dict:
    max_bs, nodes, hq, hkv, dim, width = (shapes[k] for k in ("max_bs", "nodes", "hq", "hkv", "dim", "width"))
    dtype, layers = shapes["dtype"], shapes["layers"]
    slots = (max_bs + 1) * width + 1
    # the pools: req_to_token rows of random distinct slots (row 0: the padding row), K/V per layer
    req_to_token = torch.zeros(max_bs + 1, width, dtype=torch.int32)
    req_to_token[1:] = torch.randperm(slots - 1, generator=gen)[: max_bs * width].view(max_bs, width).to(torch.int32) + 1
    req_to_token = req_to_token.to(device)
    caches = [(torch.randn(slots, 1, hkv, dim, generator=gen).to(device, dtype),
               torch.randn(slots, 1, hkv, dim, generator=gen).to(device, dtype)) for _ in range(layers)]  # fmt: skip
    # the backend's static buffers
    block_table = torch.zeros(max_bs, width, dtype=torch.int32, device=device)
    context_lens = torch.zeros(max_bs, dtype=torch.int64, device=device)
    mask_buffer = empty_tree_mask(mode, max_bs, nodes, 0, device, zeroed=True)
    q = torch.zeros(max_bs, nodes, hq, dim, dtype=dtype, device=device)

    def mask_rows(buffer, bs):
        shape = MODES[mode].shape(bs, nodes, 0)
        return buffer.reshape(-1, *shape[1:])[: shape[0]]

    bs = max_bs
    plan = TreeAttentionPlan.create(block_table[:bs], context_lens[:bs], mask_rows(mask_buffer, bs), mode, nodes, 1,
                                    None, impl="triton")  # fmt: skip

    def body():
        return [plan.run(q[:bs], k, v) for k, v in caches]

    body()  # warm-up: compiles, and makes the split workspace outside the capture
    graph = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = body()
    pointers = (block_table.data_ptr(), context_lens.data_ptr(), mask_buffer.data_ptr())

    errors, ref_errors = [], []
    for contexts in shapes["contexts"]:
        raw = len(contexts)
        ctx = torch.tensor(contexts, dtype=torch.int64)
        rows = torch.arange(1, raw + 1)
        mask = ab.mask_from_parents(ab.random_parents(raw, nodes, gen), mode).to(device)
        q_real = torch.randn(raw, nodes, hq, dim, generator=gen).to(device, dtype)
        # replay prep (out of the graph): narrowed rows, lengths, masks, padding
        used = min(width, int(ctx.max()) + nodes)
        index = torch.cat([rows, torch.zeros(bs - raw, dtype=torch.long)]).to(device)
        block_table[:bs, :used].copy_(req_to_token[:, :used].index_select(0, index))
        context_lens[:raw].copy_(ctx.to(device))
        context_lens[raw:bs].fill_(FILL)
        mask_rows(mask_buffer, raw).copy_(mask)
        q[:raw].copy_(q_real)
        if graph is not None:
            graph.replay()
            torch.cuda.synchronize()
        else:
            outputs = body()
        assert (block_table.data_ptr(), context_lens.data_ptr(), mask_buffer.data_ptr()) == pointers
        # eager: the backend's eager plan over the narrowed rows
        eager_table = req_to_token[:, :used].index_select(0, rows.to(device))
        eager = TreeAttentionPlan.create(eager_table, ctx.to(device), mask, mode, nodes, 1, int(ctx.max()),
                                         impl="triton")  # fmt: skip
        for (k, v), out in zip(caches, outputs):
            want = eager.run(q_real, k, v)
            errors.append((out[:raw].float() - want.float()).abs().max().item())
            ref = tree_attention_reference(q_real, k, v, eager_table, ctx.to(device), mask, mode)
            ref_errors.append((out[:raw].float() - ref.float()).abs().max().item())
            if not bool(torch.isfinite(out[:raw].float()).all()):
                errors.append(float("inf"))
    err = max(errors)
    kernel = plan_tree_attention(bs, nodes, hq, hkv, dim, 1, width, device).kernel  # what the captured plan launches
    return dict(ok=err <= shapes["tol"] and max(ref_errors) <= shapes["tol"], max_abs_err=err,
                max_abs_err_vs_reference=max(ref_errors), kernel=kernel, replays=len(shapes["contexts"]), batch=bs,
                real_requests=[len(c) for c in shapes["contexts"]])  # fmt: skip
