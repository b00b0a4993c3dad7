"""The spec_tree attention backend: target-verify attention over SGLang's KV pool.

Runs in ``.venv-sglang`` with ``TRITON_INTERPRET=1`` (see
test_plugin_registration.py). Real SGLang pieces: ``ReqToTokenPool``,
``MHATokenToKVPool``, ``ForwardBatch``, ``RadixAttention``, ``EagleVerifyInput``
built by SGLang's own ``build_eagle_verify_input`` against our backend's
``verify_mask``, and ``TorchNativeAttnBackend`` for prefill/decode. Faked: the
model runner (a namespace holding the pools, the dtypes and a module of
RadixAttention layers standing for the model; a real one loads one) and the
schedule batch handed to ``build_eagle_verify_input`` (a namespace with the
fields it reads), plus ``torchvision`` (``spec_plugins.sglang_ext._testing``).

The expected output is a dense float64 softmax over each node's prefix and
ancestors, the ancestors found by walking SGLang's ``parent_list`` in Python:
nothing of ``spec_tree_kernels`` is used to compute it.
"""

from __future__ import annotations

import math
import types

import pytest

from sglang_gate import require_sglang_venv

require_sglang_venv()

from spec_plugins.sglang_ext import _testing  # noqa: E402

import torch  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.speculative.eagle_worker_common import build_eagle_verify_input  # noqa: E402

import spec_tree_kernels as stk  # noqa: E402
from spec_plugins.sglang_ext import config, engine_patches, layout  # noqa: E402
from spec_tree_kernels import TreeMaskMode  # noqa: E402

pytestmark = pytest.mark.sglang

STEPS, TOPK, NODES = 3, 3, 10
HQ, HKV, DIM = 4, 2, 16
MAX_CTX, POOL_SLOTS = 64, 512


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    ckpt = _testing.write_tiny_checkpoint_configs(tmp_path_factory.mktemp("ckpt"))
    server_args = _testing.resolved_server_args(
        model_path=ckpt["target"], speculative_algorithm="EAGLE_TREE", speculative_draft_model_path=ckpt["eagle_head"],
        attention_backend=config.BACKEND_TORCH, speculative_num_steps=STEPS, speculative_eagle_topk=TOPK,
        speculative_num_draft_tokens=NODES,
    )  # fmt: skip
    _testing.publish(server_args)
    return server_args


def target_model(*layers):
    """The model a runner holds, as far as the backend inspects it: its
    RadixAttention layers (default: two plain ones)."""
    layers = layers or tuple(RadixAttention(HQ, DIM, DIM**-0.5, HKV, layer_id=i) for i in range(2))
    return torch.nn.ModuleList(layers)


def make_runner(max_ctx=MAX_CTX, model=None, kv_cache_dtype=torch.float32):
    r2t = ReqToTokenPool(size=6, max_context_len=max_ctx, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(
        size=POOL_SLOTS, page_size=1, dtype=torch.float32, head_num=HKV, head_dim=DIM, layer_num=2, device="cpu",
        enable_memory_saver=False,
    )  # fmt: skip
    return types.SimpleNamespace(
        device="cpu", req_to_token_pool=r2t, token_to_kv_pool=kv, use_mla_backend=False, sliding_window_size=None,
        is_draft_worker=False, dtype=torch.float32, kv_cache_dtype=kv_cache_dtype, model=model or target_model(),
    )  # fmt: skip


def make_backend(monkeypatch, mode, impl="torch", runner=None):
    monkeypatch.setenv(config.MASK_MODE_ENV, mode.name)
    runner = runner or make_runner()
    backend = ATTENTION_BACKENDS[config.BACKEND_TORCH](runner)
    backend.tree_attention_impl = impl
    return backend, runner


def parents_by_walk(selected, parent_list, topk):
    """Node parents from SGLang's layout, by a plain Python walk (root = -1)."""
    out = []
    for b in range(selected.shape[0]):
        sel = selected[b].tolist()
        row = [-1]
        for pool_index in sel:
            group = pool_index // topk
            row.append(0 if group == 0 else sel.index(int(parent_list[b, group])) + 1)
        out.append(row)
    return out


def ancestors(parents, i):
    seen = [i]
    while parents[seen[-1]] >= 0:
        seen.append(parents[seen[-1]])
    return seen


def setup_batch(gen, runner, bs, nodes):
    """Requests with scattered (paged) slots: row b of req_to_token maps
    positions 0..ctx+T-1 to random distinct pool slots."""
    max_ctx = runner.req_to_token_pool.max_context_len
    ctx = torch.randint(3, max_ctx - nodes - 1, (bs,), generator=gen)
    slots = torch.randperm(POOL_SLOTS, generator=gen)[: bs * max_ctx].view(bs, max_ctx) + 1  # slot 0: padding
    rows = torch.arange(1, bs + 1)
    runner.req_to_token_pool.req_to_token[rows] = slots.to(torch.int32)
    kv = runner.token_to_kv_pool
    for layer in range(kv.layer_num):
        kv.k_buffer[layer].copy_(torch.randn(kv.k_buffer[layer].shape, generator=gen))
        kv.v_buffer[layer].copy_(torch.randn(kv.v_buffer[layer].shape, generator=gen))
    out_cache_loc = torch.stack([slots[b, ctx[b] : ctx[b] + nodes] for b in range(bs)]).flatten().long()
    return ctx.long(), rows.long(), slots, out_cache_loc


def verify_input_via_sglang(backend, gen, ctx, rows, runner, nodes=NODES):
    """Draft a random closed tree and let SGLang's build_eagle_verify_input
    build the verify input for ``backend`` (our build hook active)."""
    bs = ctx.shape[0]
    parent_list = _testing.random_parent_list(gen, bs, TOPK, STEPS)
    scores = torch.rand(bs, stk.pool_size(TOPK, STEPS), generator=gen)
    selected = stk.select_tree_nodes(scores, parent_list, TOPK, STEPS, nodes)
    draft_tokens = torch.randint(0, 100, (bs, nodes - 1), generator=gen)
    batch = types.SimpleNamespace(
        forward_mode=ForwardMode.DECODE, seq_lens=ctx, seq_lens_sum=int(ctx.sum()), req_pool_indices=rows,
        req_to_token_pool=runner.req_to_token_pool,
    )  # fmt: skip
    target_worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(attn_backend=backend))
    draft_input = types.SimpleNamespace(bonus_tokens=torch.randint(0, 100, (bs,), generator=gen))
    with engine_patches.activated(engine_patches.TreeRuntime(mask_mode=backend.tree_mask_mode, impl="torch")):
        verify_input = build_eagle_verify_input(
            batch, draft_input, parent_list, selected, draft_tokens, None, target_worker=target_worker, topk=TOPK,
            num_steps=STEPS, num_draft_tokens=nodes, tree_mask_mode=TreeMaskMode.FULL_MASK, device="cpu",
        )  # fmt: skip
    return verify_input, parents_by_walk(selected, parent_list, TOPK)


def verify_forward_batch(ctx, rows, out_cache_loc, verify_input):
    bs = ctx.shape[0]
    return ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=verify_input.draft_token,
        req_pool_indices=rows, seq_lens=ctx, out_cache_loc=out_cache_loc, seq_lens_sum=int(ctx.sum()),
        seq_lens_cpu=ctx.clone(), spec_info=verify_input, positions=verify_input.positions,
    )  # fmt: skip


def dense_reference(q, k_new, v_new, kv, layer_id, slots, ctx, parents, scale):
    """float64 softmax attention: node i of request b sees the prefix and the
    verify tokens of its ancestors-or-self."""
    bs, nodes = len(parents), len(parents[0])
    q = q.double().view(bs, nodes, HQ, DIM)
    k_new = k_new.double().view(bs, nodes, HKV, DIM)
    v_new = v_new.double().view(bs, nodes, HKV, DIM)
    out = torch.zeros(bs, nodes, HQ, DIM, dtype=torch.float64)
    group = HQ // HKV
    for b in range(bs):
        prefix = slots[b, : ctx[b]].long()
        k_pre = kv.k_buffer[layer_id][prefix].double()
        v_pre = kv.v_buffer[layer_id][prefix].double()
        for i in range(nodes):
            anc = sorted(ancestors(parents[b], i))
            keys = torch.cat([k_pre, k_new[b, anc]])
            values = torch.cat([v_pre, v_new[b, anc]])
            for h in range(HQ):
                logits = keys[:, h // group] @ q[b, i, h] * scale
                out[b, i, h] = torch.softmax(logits, 0) @ values[:, h // group]
    return out.view(bs * nodes, HQ * DIM)


MODES = [TreeMaskMode.ANCESTOR_BITMASK, TreeMaskMode.PARENT_POINTER, TreeMaskMode.QLEN_ONLY]


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_verify_attention_equals_dense_reference(published, monkeypatch, mode, impl):
    gen = torch.Generator().manual_seed(int(mode) * 10 + (impl == "triton"))
    backend, runner = make_backend(monkeypatch, mode, impl)
    assert backend.tree_mask_mode == mode and backend.verify_mask.mode == mode
    bs = 3
    ctx, rows, slots, out_cache_loc = setup_batch(gen, runner, bs, NODES)
    verify_input, parents = verify_input_via_sglang(backend, gen, ctx, rows, runner)
    # SGLang's builder wrote our layout straight into the backend's buffer
    assert verify_input.custom_mask.data_ptr() == backend.verify_mask.buffer.data_ptr()
    fb = verify_forward_batch(ctx, rows, out_cache_loc, verify_input)
    layer = RadixAttention(num_heads=HQ, head_dim=DIM, scaling=DIM**-0.5, num_kv_heads=HKV, layer_id=1)
    q = torch.randn(bs * NODES, HQ * DIM, generator=gen)
    k = torch.randn(bs * NODES, HKV, DIM, generator=gen)
    v = torch.randn(bs * NODES, HKV, DIM, generator=gen)
    kv = runner.token_to_kv_pool
    expected_out = dense_reference(q, k, v, kv, 1, slots, ctx, parents, DIM**-0.5)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, layer, fb)
    assert out.shape == (bs * NODES, HQ * DIM)
    # the verify tokens' K/V went to their slots
    torch.testing.assert_close(kv.k_buffer[1][out_cache_loc], k)
    torch.testing.assert_close(kv.v_buffer[1][out_cache_loc], v)
    torch.testing.assert_close(out.double(), expected_out, atol=2e-5, rtol=2e-5)


def test_large_tree_ancestor_bitmask(published, monkeypatch):
    """66 nodes: two bitmask words per row (QLEN_ONLY_BITPACKING stops at 32).
    The tree is larger than the backend's buffer, so the mask is allocated."""
    gen = torch.Generator().manual_seed(7)
    steps, topk, nodes, bs = 5, 4, 66, 2
    runner = make_runner(max_ctx=96)
    backend, _ = make_backend(monkeypatch, TreeMaskMode.ANCESTOR_BITMASK, runner=runner)
    ctx, rows, slots, out_cache_loc = setup_batch(gen, runner, bs, nodes)
    parent_list = _testing.random_parent_list(gen, bs, topk, steps)
    scores = torch.rand(bs, stk.pool_size(topk, steps), generator=gen)
    selected = stk.select_tree_nodes(scores, parent_list, topk, steps, nodes)
    mask, positions, *_ = layout.build_tree_sglang_layout(
        torch.zeros(bs, dtype=torch.long), parent_list, selected, torch.zeros(bs, nodes - 1, dtype=torch.long), ctx,
        int(ctx.sum()), topk, steps, nodes, TreeMaskMode.ANCESTOR_BITMASK,
    )  # fmt: skip
    assert mask.shape == (bs, nodes, 2) and mask.dtype == torch.int64
    spec = types.SimpleNamespace(draft_token_num=nodes, custom_mask=mask, draft_token=None, positions=positions)
    fb = verify_forward_batch(ctx, rows, out_cache_loc, spec)
    layer = RadixAttention(num_heads=HQ, head_dim=DIM, scaling=0.3, num_kv_heads=HKV, layer_id=0)
    q = torch.randn(bs * nodes, HQ * DIM, generator=gen)
    k = torch.randn(bs * nodes, HKV, DIM, generator=gen)
    v = torch.randn(bs * nodes, HKV, DIM, generator=gen)
    parents = parents_by_walk(selected, parent_list, topk)
    expected = dense_reference(q, k, v, runner.token_to_kv_pool, 0, slots, ctx, parents, 0.3)
    out = backend.forward(q, k, v, layer, fb)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_prefill_and_decode_are_torch_native(published, monkeypatch):
    gen = torch.Generator().manual_seed(11)
    backend, runner = make_backend(monkeypatch, TreeMaskMode.ANCESTOR_BITMASK)
    native = TorchNativeAttnBackend(runner)
    bs = 2
    ctx, rows, slots, _ = setup_batch(gen, runner, bs, 1)
    layer = RadixAttention(num_heads=HQ, head_dim=DIM, scaling=0.25, num_kv_heads=HKV, layer_id=0)
    # decode: one new token per request at position ctx (written to slots[b, ctx])
    loc = torch.stack([slots[b, ctx[b]] for b in range(bs)]).long()
    q = torch.randn(bs, HQ * DIM, generator=gen)
    k = torch.randn(bs, HKV, DIM, generator=gen)
    v = torch.randn(bs, HKV, DIM, generator=gen)
    seq = ctx + 1
    outs = []
    for be in (backend, native):
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.long),
            req_pool_indices=rows, seq_lens=seq, out_cache_loc=loc, seq_lens_sum=int(seq.sum()),
        )  # fmt: skip
        be.init_forward_metadata(fb)
        outs.append(be.forward(q, k, v, layer, fb))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    # extend (prefill) of 3 tokens after the prefix
    ext = torch.tensor([3, 3])
    loc = torch.stack([slots[b, ctx[b] : ctx[b] + 3] for b in range(bs)]).flatten().long()
    q = torch.randn(6, HQ * DIM, generator=gen)
    k = torch.randn(6, HKV, DIM, generator=gen)
    v = torch.randn(6, HKV, DIM, generator=gen)
    outs = []
    for be in (backend, native):
        fb = ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=bs, input_ids=torch.zeros(6, dtype=torch.long),
            req_pool_indices=rows, seq_lens=ctx + ext, out_cache_loc=loc, seq_lens_sum=int((ctx + ext).sum()),
            extend_prefix_lens=ctx, extend_seq_lens=ext,
        )  # fmt: skip
        be.init_forward_metadata(fb)
        outs.append(be.forward(q, k, v, layer, fb))
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


def test_verify_mask_interface(published, monkeypatch):
    for mode, shape, dtype in (
        (TreeMaskMode.ANCESTOR_BITMASK, (6, NODES, 1), torch.int64),
        (TreeMaskMode.PARENT_POINTER, (6, 2, NODES), torch.int16),
        (TreeMaskMode.QLEN_ONLY, (6 * NODES * NODES,), torch.bool),
    ):
        backend, _ = make_backend(monkeypatch, mode)
        mask = backend.verify_mask
        assert (mask.mode, tuple(mask.buffer.shape), mask.buffer.dtype) == (mode, shape, dtype)
        assert mask.is_read and mask.fits(6) and not mask.fits(7)
        bytes_per_request = mask.buffer.numel() * mask.buffer.element_size() // 6
        assert bytes_per_request == stk.mask_bytes_per_request(mode, NODES, 4096)
    monkeypatch.setenv(config.MASK_MODE_ENV, "FULL_MASK")
    with pytest.raises(ValueError, match="'spec_tree' cannot read"):
        ATTENTION_BACKENDS[config.BACKEND_TORCH](make_runner())


def test_verify_mask_buffer_comes_from_the_kernel_allocator():
    """The backend's buffer is ``spec_tree_kernels.modes.empty_tree_mask``'s
    (zeroed), for the modes tree attention reads and no other."""
    from spec_plugins.sglang_ext.attention import allocate_verify_mask
    from spec_tree_kernels.modes import TREE_ATTENTION_MODES, empty_tree_mask

    for mode in TREE_ATTENTION_MODES:
        buffer = allocate_verify_mask(mode, 3, NODES, "cpu")
        like = empty_tree_mask(mode, 3, NODES, 0, "cpu")
        assert (buffer.shape, buffer.dtype) == (like.shape, like.dtype) and not buffer.view(torch.uint8).any()
    for mode in set(TreeMaskMode) - set(TREE_ATTENTION_MODES):
        with pytest.raises(ValueError, match=f"does not read mask mode {mode.name}"):
            allocate_verify_mask(mode, 3, NODES, "cpu")


def test_a_mask_of_another_mode_is_refused(published, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    backend, runner = make_backend(monkeypatch, TreeMaskMode.ANCESTOR_BITMASK)
    ctx, rows, _, out_cache_loc = setup_batch(gen, runner, 2, NODES)
    # a drafted verify input (draft tokens: not SGLang's warm-up dummy, whose placeholder mask is served)
    spec = types.SimpleNamespace(
        draft_token_num=NODES, custom_mask=torch.ones(2 * NODES * NODES, dtype=torch.bool),
        draft_token=torch.zeros(2 * NODES, dtype=torch.int64), positions=None,
    )  # fmt: skip
    fb = verify_forward_batch(ctx, rows, out_cache_loc, spec)
    with pytest.raises(RuntimeError, match="reads ANCESTOR_BITMASK tree masks.*another mask mode"):
        backend.init_forward_metadata(fb)


def test_unsupported_layers_and_graphs_fail_clearly(published, monkeypatch):
    gen = torch.Generator().manual_seed(6)
    backend, runner = make_backend(monkeypatch, TreeMaskMode.ANCESTOR_BITMASK)
    ctx, rows, _, out_cache_loc = setup_batch(gen, runner, 1, NODES)
    verify_input, _ = verify_input_via_sglang(backend, gen, ctx, rows, runner)
    fb = verify_forward_batch(ctx, rows, out_cache_loc, verify_input)
    q = torch.randn(NODES, HQ * DIM)
    kv = torch.randn(NODES, HKV, DIM)
    windowed = RadixAttention(num_heads=HQ, head_dim=DIM, scaling=0.25, num_kv_heads=HKV, layer_id=0, sliding_window_size=8)
    with pytest.raises(NotImplementedError, match="sliding windows"):
        backend.forward(q, kv, kv, windowed, fb)
    with pytest.raises(RuntimeError, match="--disable-cuda-graph"):
        backend.init_forward_metadata_out_graph(fb, in_capture=True)
    assert math.isfinite(float(backend.forward(q, kv, kv, RadixAttention(HQ, DIM, 0.25, HKV, 0), fb).sum()))


# ------------------------------------------------- startup refusals (issue 19)
# The backend is built after the model loads and SGLang resolved the KV dtype,
# before the first request: these used to fail in the first verify.


def fp8_checkpoint_kv_dtype(model_dtype):
    """What SGLang resolves ``--kv-cache-dtype auto`` to for a checkpoint whose
    quantization config declares FP8 KV (SGLang's own Fp8Config and
    configure_kv_cache_dtype)."""
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype

    model = target_model()
    model.quant_config = Fp8Config.from_config(
        {"quant_method": "fp8", "activation_scheme": "dynamic", "kv_cache_quant_algo": "FP8"}
    )
    _, kv_dtype = configure_kv_cache_dtype(
        server_args_kv_cache_dtype="auto", model=model, model_dtype=model_dtype, is_draft_worker=False,
        is_dflash=False, speculative_draft_attention_backend=None,
    )  # fmt: skip
    return model, kv_dtype


def test_fp8_kv_from_the_checkpoint_is_refused_at_startup(published, monkeypatch):
    model, kv_dtype = fp8_checkpoint_kv_dtype(torch.float32)
    assert kv_dtype == torch.float8_e4m3fn  # --kv-cache-dtype auto, and still FP8
    runner = make_runner(model=model, kv_cache_dtype=kv_dtype)
    with pytest.raises(ValueError, match=r"KV cache is torch.float8_e4m3fn \(the checkpoint declares FP8.*--kv-cache-dtype"):
        make_backend(monkeypatch, TreeMaskMode.ANCESTOR_BITMASK, runner=runner)
    runner.is_draft_worker = True  # a draft runner never runs target verify: nothing to refuse
    make_backend(monkeypatch, TreeMaskMode.ANCESTOR_BITMASK, runner=runner)


@pytest.mark.parametrize(
    "layer,reason",
    [
        (dict(logit_cap=30.0), "logit capping"),
        (dict(sliding_window_size=128), "sliding window"),
        (dict(is_cross_attention=True), "cross-attention"),
    ],
    ids=["logit-cap", "sliding-window", "cross-attention"],
)
def test_layers_tree_verify_cannot_compute_are_refused_at_startup(published, monkeypatch, layer, reason):
    model = target_model(RadixAttention(HQ, DIM, 0.25, HKV, layer_id=0), RadixAttention(HQ, DIM, 0.25, HKV, 1, **layer))
    with pytest.raises(ValueError, match=f"cannot verify trees on this model \\(layer 1: {reason}\\)"):
        make_backend(monkeypatch, TreeMaskMode.ANCESTOR_BITMASK, runner=make_runner(model=model))


@pytest.mark.parametrize(
    "flags,message",
    [
        (dict(attn_dp_size=2, tp_size=2), "padded verify batches"),
        (dict(enable_two_batch_overlap=True), "--enable-two-batch-overlap"),
        (dict(dcp_size=2, tp_size=2), "does not support decode context parallelism \\(--dcp-size 2\\)"),
    ],
    ids=["dp-attention", "two-batch-overlap", "decode-context-parallel"],
)
def test_padded_or_split_verify_batches_are_refused_at_startup(published, tmp_path, monkeypatch, flags, message):
    """Resolution refuses these flags with our backend (test_plugin_registration);
    the backend checks the published runtime config too, as SGLang's scheduler
    will pad or split by it. Published here: the same flags with SGLang's own
    backend, which resolution accepts."""
    ckpt = _testing.write_tiny_checkpoint_configs(tmp_path)
    server_args = _testing.resolved_server_args(
        model_path=ckpt["target"], speculative_algorithm="EAGLE_TREE", speculative_draft_model_path=ckpt["eagle_head"],
        attention_backend="triton", speculative_num_steps=STEPS, speculative_eagle_topk=TOPK,
        speculative_num_draft_tokens=NODES, **flags,
    )  # fmt: skip
    _testing.publish(server_args)
    try:
        with pytest.raises(ValueError, match=message):
            make_backend(monkeypatch, TreeMaskMode.ANCESTOR_BITMASK)
    finally:
        _testing.publish(published)  # the module's configuration, for the tests after this one


def test_kv_cache_layouts_tree_verify_cannot_read_are_refused_at_startup(published, monkeypatch):
    """SGLANG_USE_HND_KVCACHE=1: SGLang's own pool, built under the variable,
    is [pages, heads, page_size, dim], which our verify would read as token
    slots (a shape error at graph capture, naming nothing). The backend refuses
    it when it is built, naming the variable (resolution refuses it too,
    test_plugin_registration); a draft runner never runs target verify."""
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    runner = make_runner()
    assert runner.token_to_kv_pool.kv_cache_layout == "hnd"
    assert runner.token_to_kv_pool.k_buffer[0].dim() == 4  # [pages, heads, page_size, dim]
    monkeypatch.delenv("SGLANG_USE_HND_KVCACHE")
    message = "'spec_tree' does not support the HND KV cache layout \\(SGLANG_USE_HND_KVCACHE\\)"
    with pytest.raises(ValueError, match=message):
        make_backend(monkeypatch, TreeMaskMode.ANCESTOR_BITMASK, runner=runner)
    runner.is_draft_worker = True
    make_backend(monkeypatch, TreeMaskMode.ANCESTOR_BITMASK, runner=runner)
    make_backend(monkeypatch, TreeMaskMode.ANCESTOR_BITMASK)  # the NHD pool, built without the variable


# ------------------------------------- --enable-torch-compile (issue #53, item 3)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_verify_attention_is_kept_out_of_dynamo(published, monkeypatch, impl):
    """``--enable-torch-compile`` compiles the model forward (SGLang's decode
    graph runner on a GPU, its CPU graph runner on a CPU); the attention
    layers reach the backend through ``RadixAttention.forward`` ->
    ``get_attn_backend().forward``. SGLang's own Triton backend keeps its
    kernel calls out of dynamo (``torch.compiler.disable``); ours keeps the
    tree verify out the same way, so dynamo never traces our plan (host-sized
    work, Triton launches): inside it ``torch.compiler.is_compiling()`` is
    False, and the compiled forward equals the eager one. Real: SGLang's
    RadixAttention and forward context, torch.compile (dynamo; the ``eager``
    compiler backend, as no C++ or GPU compile is needed for the question)."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    from spec_tree_kernels.attention_plan import TreeAttentionPlan

    gen = torch.Generator().manual_seed(53)
    backend, runner = make_backend(monkeypatch, TreeMaskMode.ANCESTOR_BITMASK, impl)
    bs = 2
    ctx, rows, slots, out_cache_loc = setup_batch(gen, runner, bs, NODES)
    verify_input, parents = verify_input_via_sglang(backend, gen, ctx, rows, runner)
    fb = verify_forward_batch(ctx, rows, out_cache_loc, verify_input)
    layer = RadixAttention(num_heads=HQ, head_dim=DIM, scaling=DIM**-0.5, num_kv_heads=HKV, layer_id=0)
    q = torch.randn(bs * NODES, HQ * DIM, generator=gen)
    k = torch.randn(bs * NODES, HKV * DIM, generator=gen)
    v = torch.randn(bs * NODES, HKV * DIM, generator=gen)
    expected = dense_reference(q, k.view(-1, HKV, DIM), v.view(-1, HKV, DIM), runner.token_to_kv_pool, 0, slots,
                               ctx, parents, DIM**-0.5)  # fmt: skip

    compiling = []
    run = TreeAttentionPlan.run

    def spy(self, *args, **kwargs):
        compiling.append(torch.compiler.is_compiling())
        return run(self, *args, **kwargs)

    monkeypatch.setattr(TreeAttentionPlan, "run", spy)

    def model_forward(q, k, v):  # what a model's attention layer does (qkv projections elided)
        return layer(q, k, v, fb) * 1.0

    torch._dynamo.reset()
    try:
        with forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
            backend.init_forward_metadata(fb)
            out = torch.compile(model_forward, backend="eager")(q, k, v)
    finally:
        torch._dynamo.reset()
    assert compiling and not any(compiling), f"dynamo traced the tree verify: is_compiling() = {compiling}"
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


# ---------------------- SGLang's warm-up dummy verify (issue #53, item 2)


class _DummyRunHost:
    """The runner object SGLang's ``BaseRunner._dummy_run`` is a method of (a
    stand-in: its one attribute is the model runner; the method is SGLang's)."""

    _dummy_run = None  # set below: SGLang's function

    def __init__(self, model_runner):
        self.model_runner = model_runner


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_sglang_warmup_dummy_verify_is_served(published, monkeypatch, mode, impl):
    """On CUDA, SGLang's warm-up runs FlashInfer's autotune for ModelOpt
    FP8/FP4 targets and flashinfer MoE runners (``should_run_flashinfer_autotune``):
    ``BaseRunner._dummy_run`` forwards a TARGET_VERIFY batch whose verify input
    is ``create_dummy_verify_input``'s (no drafted tree: ``draft_token`` None)
    with SGLang's FULL_MASK placeholder, a bool buffer of ones, as the mask;
    and it calls the backend's eager ``init_forward_metadata``. Ours serves it
    with its own (zeroed) mask buffer: finite outputs, no crash. Real:
    SGLang's ``_dummy_run`` (run as a method of a stand-in runner object),
    its decode buffers (``_allocate_decode_buffers``), ``create_dummy_verify_input``,
    ``ForwardBatch``, forward context and ``RadixAttention``. Faked: the model
    runner (a namespace of real pools and our backend) and the model (two
    attention layers on random q/k/v), the process group's barrier."""
    from sglang.srt.model_executor.runner.base_runner import BaseRunner, _allocate_decode_buffers
    from sglang.srt.runtime_context import get_parallel

    backend, runner = make_backend(monkeypatch, mode, impl)
    assert backend.verify_mask is not None and backend.verify_mask.mode == mode
    layers = [RadixAttention(HQ, DIM, DIM**-0.5, HKV, layer_id=i) for i in range(2)]
    outputs = []

    class Model(torch.nn.Module):
        def forward(self, input_ids, positions, forward_batch):
            n = input_ids.shape[0]
            gen = torch.Generator().manual_seed(n)
            for layer in layers:
                q, k, v = (torch.randn(n, h * DIM, generator=gen) for h in (HQ, HKV, HKV))
                outputs.append(layer(q, k, v, forward_batch))
            return outputs[-1]

    bs = 3
    runner.model = Model()
    runner.attn_backend = backend
    runner.is_generation = True
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    runner.spec_algorithm = SpeculativeAlgorithm.from_string("EAGLE_TREE")
    runner.decode_num_tokens_per_req = lambda num_draft_tokens=None: NODES
    runner.model_config = types.SimpleNamespace(hidden_size=HQ * DIM, vocab_size=256, dtype=torch.float32,
                                                is_encoder_decoder=False, hf_config=None)  # fmt: skip
    runner.lora_manager = runner.canary_manager = None
    runner.kv_index_translator = types.SimpleNamespace(bind_runner_slots=lambda fb: None)
    runner.prepare_dummy_forward_batch = lambda fb: fb
    buffers = _allocate_decode_buffers(
        device="cpu", max_bs=bs, max_num_token=bs * NODES, hidden_size=HQ * DIM, vocab_size=256, dtype=torch.float32,
        is_encoder_decoder=False, require_mlp_tp_gather=False,
        seq_len_fill_value=backend.get_cuda_graph_seq_len_fill_value(), encoder_len_fill_value=0,
        num_tokens_per_req=NODES, cache_loc_dtype=torch.int64, enable_mamba_track=False, allocate_logits_buffer=False,
    )  # fmt: skip
    assert buffers.custom_mask.dtype == torch.bool  # SGLang's FULL_MASK placeholder
    host = _DummyRunHost(runner)
    barrier = types.SimpleNamespace(barrier=lambda: None)  # no process group on this machine
    with get_parallel().override(tp_group=barrier):
        BaseRunner._dummy_run(host, batch_size=bs, buffers=buffers)
    assert len(outputs) == 2
    for out in outputs:
        assert out.shape == (bs * NODES, HQ * DIM) and torch.isfinite(out).all()
