"""CUDA graphs with ``spec_tree_triton`` (issue #38): TARGET_VERIFY captured
through our backend, driven by SGLang's own graph entry points.

Runs in ``.venv-sglang`` with ``TRITON_INTERPRET=1``. Real: SGLang's
``TritonAttnBackend`` under our mixin (the ``spec_tree_triton`` class, built
from the registry), ``ReqToTokenPool`` / ``MHATokenToKVPool``,
``ForwardBatch``, ``EagleVerifyInput`` from SGLang's ``build_eagle_verify_input``,
``ModelConfig`` of a config-only checkpoint and SGLang's
``build_replay_fb_view`` (the ForwardBatch view a replay hands the backend).

Stubbed, because there is no GPU here: the graph runner. ``StubVerifyGraphRunner``
makes the calls ``DecodeCudaGraphRunner`` makes for TARGET_VERIFY
(``init_cuda_graph_state``, ``get_cuda_graph_seq_len_fill_value``, static
input buffers padded with that fill value, ``init_forward_metadata_out_graph``
with ``in_capture=True`` then the in-graph prep and the forward; at replay the
input copies, the replay view, ``init_forward_metadata_out_graph`` and the
captured body). A CPU cannot record kernels, so "replay" re-runs the body
captured as a closure over the capture-time objects, which is what a CUDA
graph would read (the same tensors at the same addresses); the tests check
that replay hands the body the very plan and buffers of the capture.
"""

from __future__ import annotations

import contextlib
import types

import pytest

from sglang_gate import require_sglang_venv

require_sglang_venv()

from spec_plugins.sglang_ext import _testing  # noqa: E402

import torch  # noqa: E402
from sglang.srt.configs.model_config import ModelConfig  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import build_replay_fb_view  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleVerifyInput  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

import spec_tree_kernels.triton_launch as triton_launch  # noqa: E402
import spec_tree_kernels.triton_ops as triton_ops  # noqa: E402
from spec_plugins.sglang_ext import config  # noqa: E402
from spec_tree_kernels import TreeMaskMode  # noqa: E402
from test_plugin_attention import (  # noqa: E402
    DIM, HKV, HQ, NODES, POOL_SLOTS, STEPS, TOPK, dense_reference, setup_batch, verify_input_via_sglang,
)  # fmt: skip

pytestmark = pytest.mark.sglang

MAX_CTX = 64
CAPTURE_BS = 4  # the graph's batch; the replays below run 3 real requests padded to it
MODES = [TreeMaskMode.ANCESTOR_BITMASK, TreeMaskMode.PARENT_POINTER, TreeMaskMode.QLEN_ONLY]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    ckpt = _testing.write_tiny_checkpoint_configs(tmp_path_factory.mktemp("ckpt"))
    server_args = _testing.resolved_server_args(
        model_path=ckpt["target"], speculative_algorithm="EAGLE_TREE", speculative_draft_model_path=ckpt["eagle_head"],
        attention_backend=config.BACKEND_TRITON, speculative_num_steps=STEPS, speculative_eagle_topk=TOPK,
        speculative_num_draft_tokens=NODES,
    )  # fmt: skip
    _testing.publish(server_args)
    return server_args


def make_triton_backend(published, monkeypatch, mode):
    """The registry's ``spec_tree_triton`` backend over a fake model runner (a
    namespace of real pools and SGLang's ModelConfig of the tiny checkpoint)."""
    monkeypatch.setenv(config.MASK_MODE_ENV, mode.name)
    r2t = ReqToTokenPool(size=6, max_context_len=MAX_CTX, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(
        size=POOL_SLOTS, page_size=1, dtype=torch.float32, head_num=HKV, head_dim=DIM, layer_num=2, device="cpu",
        enable_memory_saver=False,
    )  # fmt: skip
    runner = types.SimpleNamespace(
        device="cpu", gpu_id=0, req_to_token_pool=r2t, token_to_kv_pool=kv, token_to_kv_pool_allocator=None,
        use_mla_backend=False, sliding_window_size=None, is_draft_worker=False, dtype=torch.float32,
        kv_cache_dtype=torch.float32, model=torch.nn.ModuleList(), model_config=ModelConfig.from_server_args(published),
        page_size=1, kv_index_translator=None, decode_num_tokens_per_req=lambda num_draft_tokens=None: NODES,
        spec_algorithm=SpeculativeAlgorithm.from_string("EAGLE_TREE"),
    )  # fmt: skip
    # no process groups here: the rank SGLang's Triton backend reads, as a single-GPU server has it
    with get_parallel().override(attn_dcp_rank=0):
        backend = ATTENTION_BACKENDS[config.BACKEND_TRITON](runner)
    backend.tree_attention_impl = "triton"  # CPU tensors under TRITON_INTERPRET=1: the GPU's kernels
    return backend, runner


LAYERS = [RadixAttention(num_heads=HQ, head_dim=DIM, scaling=DIM**-0.5, num_kv_heads=HKV, layer_id=i) for i in range(2)]


class StubVerifyGraphRunner:
    """SGLang's DecodeCudaGraphRunner for TARGET_VERIFY, as far as it talks to
    the attention backend (see the module docstring)."""

    def __init__(self, backend, max_bs, nodes):
        self.backend, self.max_bs, self.nodes = backend, max_bs, nodes
        tokens = max_bs * nodes
        backend.init_cuda_graph_state(max_bs, tokens)
        self.fill = backend.get_cuda_graph_seq_len_fill_value()
        # DecodeInputBuffers.create's verify inputs
        self.buffers = types.SimpleNamespace(
            input_ids=torch.zeros(tokens, dtype=torch.int64), positions=torch.zeros(tokens, dtype=torch.int64),
            req_pool_indices=torch.zeros(max_bs, dtype=torch.int64),
            seq_lens=torch.full((max_bs,), self.fill, dtype=torch.int64),
            seq_lens_cpu=torch.full((max_bs,), self.fill, dtype=torch.int64),
            out_cache_loc=torch.zeros(tokens, dtype=torch.int64), encoder_lens=None, mamba_track_indices=None,
            custom_mask=torch.ones((max_bs * self.fill + tokens) * nodes, dtype=torch.bool),
        )  # fmt: skip
        self.q = torch.zeros(tokens, HQ * DIM)
        self.k = torch.zeros(tokens, HKV, DIM)
        self.v = torch.zeros(tokens, HKV, DIM)
        self.graphs = {}
        self.replayed = []  # the captured batch size each replay ran

    def capture(self, bs):
        b, n = self.buffers, bs * self.nodes
        # get_spec_info(): SGLang's verify input at capture, its FULL_MASK placeholder as the mask
        spec = EagleVerifyInput(
            draft_token=None, custom_mask=b.custom_mask, positions=None, retrieve_index=None,
            retrieve_next_token=None, retrieve_next_sibling=None, retrieve_cum_len=None, spec_steps=STEPS,
            topk=TOPK, draft_token_num=self.nodes, capture_hidden_mode=None, seq_lens_sum=None, seq_lens_cpu=None,
        )  # fmt: skip
        fb = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=b.input_ids[:n],
            req_pool_indices=b.req_pool_indices[:bs], seq_lens=b.seq_lens[:bs], seq_lens_cpu=b.seq_lens_cpu[:bs],
            out_cache_loc=b.out_cache_loc[:n], seq_lens_sum=int(b.seq_lens[:bs].sum()), spec_info=spec,
            positions=b.positions[:n],
        )  # fmt: skip
        self.backend.init_forward_metadata_out_graph(fb, in_capture=True)
        captured_meta = self.backend._tree_meta

        def body():
            self.backend.init_forward_metadata_in_graph(fb)
            return [self.backend.forward(self.q[:n], self.k[:n], self.v[:n], layer, fb) for layer in LAYERS]

        body()  # the warm-up run before capture
        self.graphs[bs] = (body, captured_meta)
        return captured_meta

    def replay(self, fb, q, k, v):
        """``fb``: the real verify batch. Returns each layer's output rows of its requests."""
        raw_bs = fb.batch_size
        bs = min(s for s in self.graphs if s >= raw_bs)
        b, n, raw_n = self.buffers, bs * self.nodes, raw_bs * self.nodes
        # replay_prepare: copy the inputs, pad the rest
        b.req_pool_indices[:raw_bs].copy_(fb.req_pool_indices)
        b.req_pool_indices[raw_bs:bs].zero_()
        b.seq_lens[:raw_bs].copy_(fb.seq_lens)
        b.seq_lens[raw_bs:bs].fill_(self.fill)
        b.seq_lens_cpu[:raw_bs].copy_(fb.seq_lens_cpu)
        b.seq_lens_cpu[raw_bs:bs].fill_(self.fill)
        b.out_cache_loc[:raw_n].copy_(fb.out_cache_loc)
        b.out_cache_loc[raw_n:n].zero_()  # slot 0: the padding slot
        self.q[:raw_n].copy_(q)
        self.k[:raw_n].copy_(k)
        self.v[:raw_n].copy_(v)
        view = build_replay_fb_view(
            forward_batch=fb, buffers=b, bs=bs, raw_bs=raw_bs, num_tokens=n, global_num_tokens_cpu=None,
            seq_len_fill_value=self.fill, capture_forward_mode=ForwardMode.TARGET_VERIFY, is_encoder_decoder=False,
        )  # fmt: skip
        self.backend.init_forward_metadata_out_graph(view)
        body, captured_meta = self.graphs[bs]
        self.replayed.append(bs)
        # a graph replays the capture's kernels: the prep above must have kept the capture's plan
        assert self.backend._tree_meta is captured_meta
        return [out[:raw_n] for out in body()]


def eager_verify(backend, fb, q, k, v):
    backend.init_forward_metadata(fb)
    return [backend.forward(q, k, v, layer, fb) for layer in LAYERS]


def real_batch(gen, backend, runner, bs):
    ctx, rows, slots, out_cache_loc = setup_batch(gen, runner, bs, NODES)
    verify_input, parents = verify_input_via_sglang(backend, gen, ctx, rows, runner)
    fb = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=verify_input.draft_token,
        req_pool_indices=rows, seq_lens=ctx, out_cache_loc=out_cache_loc, seq_lens_sum=int(ctx.sum()),
        seq_lens_cpu=ctx.clone(), spec_info=verify_input, positions=verify_input.positions,
    )  # fmt: skip
    q = torch.randn(bs * NODES, HQ * DIM, generator=gen)
    k = torch.randn(bs * NODES, HKV, DIM, generator=gen)
    v = torch.randn(bs * NODES, HKV, DIM, generator=gen)
    return fb, q, k, v, (slots, ctx, parents)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_target_verify_capture_and_replay_equal_eager(published, monkeypatch, mode):
    gen = torch.Generator().manual_seed(100 + int(mode))
    backend, runner = make_triton_backend(published, monkeypatch, mode)
    graphs = StubVerifyGraphRunner(backend, CAPTURE_BS, NODES)
    small = graphs.capture(2).plan  # SGLang captures several batch sizes, largest first or not
    meta = graphs.capture(CAPTURE_BS)
    plan = meta.plan
    # the captured plan reads the backend's static buffers, and its own verify-mask buffer
    static = backend._tree_graph
    assert plan.block_table.data_ptr() == static.block_table.data_ptr()
    assert plan.context_lens.data_ptr() == static.context_lens.data_ptr()
    assert plan.mask.data_ptr() == backend.verify_mask.buffer.data_ptr()
    assert plan.impl == "triton" and plan.max_context_len is None  # split plan for any context
    pointers = (plan.block_table.data_ptr(), plan.context_lens.data_ptr(), plan.mask.data_ptr())

    # every captured size reads the same static buffers
    assert (small.block_table.data_ptr(), small.context_lens.data_ptr(), small.mask.data_ptr()) == pointers

    longest = []
    for step in range(3):  # batches of different sequence lengths through the graphs
        if step == 0:
            fb, q, k, v, (slots, ctx, parents) = real_batch(gen, backend, runner, CAPTURE_BS - 1)
        elif step == 1:  # longer contexts than the first batch's: columns the first replay did not copy are read
            ctx = torch.tensor([3, MAX_CTX - NODES - 2, MAX_CTX - NODES - 3])
            fb, q, k, v, (slots, ctx, parents) = _with_lens(gen, backend, runner, ctx)
        else:  # one request: the graph of 2, padded
            fb, q, k, v, (slots, ctx, parents) = _with_lens(gen, backend, runner, torch.tensor([MAX_CTX - NODES - 4]))
        longest.append(int(ctx.max()))
        expected = eager_verify(backend, fb, q, k, v)
        replayed = graphs.replay(fb, q, k, v)
        for layer, (got, want) in enumerate(zip(replayed, expected)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            dense = dense_reference(q, k, v, runner.token_to_kv_pool, layer, slots, ctx, parents, DIM**-0.5)
            torch.testing.assert_close(got.double(), dense, atol=2e-5, rtol=2e-5)
        assert (plan.block_table.data_ptr(), plan.context_lens.data_ptr(), plan.mask.data_ptr()) == pointers
    assert longest[1] > longest[0]
    assert graphs.replayed == [CAPTURE_BS, CAPTURE_BS, 2]


def _with_lens(gen, backend, runner, ctx):
    """A verify batch whose requests have the given context lengths."""
    bs = ctx.shape[0]
    _, rows, slots, _ = setup_batch(gen, runner, bs, NODES)
    out_cache_loc = torch.stack([slots[b, ctx[b] : ctx[b] + NODES] for b in range(bs)]).flatten().long()
    verify_input, parents = verify_input_via_sglang(backend, gen, ctx, rows, runner)
    fb = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=verify_input.draft_token,
        req_pool_indices=rows, seq_lens=ctx, out_cache_loc=out_cache_loc, seq_lens_sum=int(ctx.sum()),
        seq_lens_cpu=ctx.clone(), spec_info=verify_input, positions=verify_input.positions,
    )  # fmt: skip
    q = torch.randn(bs * NODES, HQ * DIM, generator=gen)
    k = torch.randn(bs * NODES, HKV, DIM, generator=gen)
    v = torch.randn(bs * NODES, HKV, DIM, generator=gen)
    return fb, q, k, v, (slots, ctx, parents)


# ------------------------------------------------------ no host reads per step


class HostReadError(AssertionError):
    pass


class NoHostReads(TorchDispatchMode):
    """Fails on any read of a tensor's value into Python (``item``, ``int()``,
    ``bool()``: aten._local_scalar_dense) and on a copy to the CPU from another
    device. On this CPU-only machine every tensor is a CPU tensor, so a "D2H
    read" is a value read of any tensor other than SGLang's host mirror of the
    lengths (``allowed``: ``seq_lens_cpu``, which the scheduler keeps on the
    host precisely for this). ``tolist``/``numpy`` do not dispatch: the
    function-mode half below catches them."""

    def __init__(self, allowed):
        super().__init__()
        self.allowed = {t.untyped_storage().data_ptr() for t in allowed}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            if args[0].untyped_storage().data_ptr() not in self.allowed:
                raise HostReadError(f"host read of a device value: {func} on {tuple(args[0].shape)}")
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            src = args[1] if func is torch.ops.aten.copy_.default else args[0]
            dst_device = args[0].device if func is torch.ops.aten.copy_.default else kwargs.get("device")
            if src.device.type != "cpu" and dst_device is not None and torch.device(dst_device).type == "cpu":
                raise HostReadError(f"D2H copy: {func}")
        return func(*args, **kwargs)


class NoHostListReads(TorchFunctionMode):
    def __init__(self, allowed):
        super().__init__()
        self.allowed = {t.untyped_storage().data_ptr() for t in allowed}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item):
            if args[0].untyped_storage().data_ptr() not in self.allowed:
                raise HostReadError(f"host read of a device value: {func.__name__} on {tuple(args[0].shape)}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_reads(monkeypatch, allowed):
    """NoHostReads around our code, not around the kernels: under
    TRITON_INTERPRET=1 a launch *is* a host program that reads its tensors
    (on a GPU it reads nothing on the host), so launches run with the modes off."""
    launch = triton_launch.launch

    def launch_outside_the_modes(*args, **kwargs):
        with _disable_current_modes(), torch._C.DisableTorchFunction():
            return launch(*args, **kwargs)

    # the seam, where the op modules call it (triton_ops holds its own name for it)
    monkeypatch.setattr(triton_launch, "launch", launch_outside_the_modes)
    monkeypatch.setattr(triton_ops, "launch", launch_outside_the_modes)
    with NoHostListReads(allowed), NoHostReads(allowed):
        yield


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
def test_verify_step_makes_no_host_reads(published, monkeypatch, mode):
    gen = torch.Generator().manual_seed(200 + int(mode))
    backend, runner = make_triton_backend(published, monkeypatch, mode)
    graphs = StubVerifyGraphRunner(backend, CAPTURE_BS, NODES)
    graphs.capture(CAPTURE_BS)
    fb, q, k, v, _ = real_batch(gen, backend, runner, CAPTURE_BS - 1)
    expected = eager_verify(backend, fb, q, k, v)
    # the detector itself: a value read of a device tensor fails
    with pytest.raises(HostReadError), no_host_reads(monkeypatch, [graphs.buffers.seq_lens_cpu]):
        int(fb.seq_lens.max())
    # the graph's replay prep and body, then the eager step (its host mirror is fb.seq_lens_cpu)
    with no_host_reads(monkeypatch, [graphs.buffers.seq_lens_cpu, fb.seq_lens_cpu]):
        replayed = graphs.replay(fb, q, k, v)
        eager = eager_verify(backend, fb, q, k, v)
    for got, again, want in zip(replayed, eager, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(again, want, atol=0, rtol=0)


def test_graph_prep_with_the_torch_path_fails_naming_the_way_out(published, monkeypatch):
    """A torch (host-sized) verify path cannot be captured: a clear error
    rather than a wrong graph."""
    backend, _ = make_triton_backend(published, monkeypatch, TreeMaskMode.ANCESTOR_BITMASK)
    backend.tree_attention_impl = "torch"
    graphs = types.SimpleNamespace()
    with pytest.raises(RuntimeError, match="resolved implementation: 'torch'.*--disable-cuda-graph"):
        graphs = StubVerifyGraphRunner(backend, CAPTURE_BS, NODES)
        graphs.capture(CAPTURE_BS)


# ------------------------------------------------- the eager step's block table


def test_eager_verify_plan_reads_only_the_batchs_longest_context(published, monkeypatch):
    """The eager verify copies the requests' req_to_token columns up to the
    longest context + T (from the host-side lengths), not whole rows (about
    25 MB a step at batch 48 with 128k-token rows), and sizes the split plan
    with that longest context rather than the longest possible one."""
    backend, runner = make_triton_backend(published, monkeypatch, TreeMaskMode.ANCESTOR_BITMASK)
    gen = torch.Generator().manual_seed(5)
    fb, *_ = real_batch(gen, backend, runner, 3)
    longest = int(fb.seq_lens_cpu.max())
    backend.init_forward_metadata(fb)
    plan = backend._tree_meta.plan
    assert plan.block_table.shape == (3, longest + NODES) and longest + NODES < MAX_CTX
    assert plan.max_context_len == longest
    rows = runner.req_to_token_pool.req_to_token[fb.req_pool_indices]
    assert torch.equal(plan.block_table, rows[:, : longest + NODES])
    # without SGLang's host copy of the lengths: whole rows, and still no device read
    fb.seq_lens_cpu = None
    backend.init_forward_metadata(fb)
    assert backend._tree_meta.plan.block_table.shape == (3, MAX_CTX) and backend._tree_meta.plan.max_context_len is None


# ------------------------------- SGLANG_ENABLE_METADATA_GLUE_GRAPH (issue #53, item 1)


class _RecordingGraph:
    """CPU stand-in for ``torch.cuda.CUDAGraph``: the ops run under its capture
    are recorded (aten ops, their tensor arguments by identity and every
    Python value as it was), and ``replay`` re-runs exactly those ops on the
    same tensors, as a CUDA graph replays its kernels on the same addresses.
    Host logic (lengths read with ``tolist``, widths) ran once, at capture."""

    def __init__(self):
        self.ops = []

    def record(self):
        graph = self

        class Recorder(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                graph.ops.append((func, args, kwargs, out))
                return out

        return Recorder()

    def replay(self):
        produced = {}  # id(capture-time result) -> this replay's result

        def sub(value):
            if isinstance(value, torch.Tensor):
                return produced.get(id(value), value)
            if isinstance(value, (list, tuple)):
                return type(value)(sub(v) for v in value)
            return value

        for func, args, kwargs, out in self.ops:
            result = func(*sub(args), **{k: sub(v) for k, v in kwargs.items()})
            for old, new in zip(out if isinstance(out, (list, tuple)) else [out],
                                result if isinstance(result, (list, tuple)) else [result]):
                if isinstance(old, torch.Tensor):
                    produced[id(old)] = new

    def capture_end(self):
        pass


def fake_cuda_graphs(monkeypatch):
    """What ``MetadataGlueGraph`` uses of ``torch.cuda``, on the CPU: its capture
    stream, ``CUDAGraph``, the ``torch.cuda.graph`` context (during which
    ``is_current_stream_capturing`` is True and ops are recorded)."""
    capturing = [False]

    @contextlib.contextmanager
    def graph(cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        capturing[0] = True
        try:
            with cuda_graph.record():
                yield cuda_graph
        finally:
            capturing[0] = False
            cuda_graph.capture_end()

    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: types.SimpleNamespace())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _RecordingGraph)
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])


def _glue_runner_class():
    from sglang.srt.environ import envs
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
    from sglang.srt.model_executor.runner.metadata_glue_graph import MetadataGlueGraph

    class GlueVerifyGraphRunner(StubVerifyGraphRunner):
        """The stub graph runner whose replay prep is SGLang's own:
        ``DecodeCudaGraphRunner._init_replay_attn_metadata`` (the glue route, its
        ``MetadataGlueGraph`` warm-ups, capture and replays, or the eager prep),
        with the glue graph created as the runner creates it, from
        ``SGLANG_ENABLE_METADATA_GLUE_GRAPH`` (EAGLE_TREE is not DFlash: no force-off)."""

        _init_replay_attn_metadata = DecodeCudaGraphRunner._init_replay_attn_metadata
        _init_replay_attn_metadata_from_view = DecodeCudaGraphRunner._init_replay_attn_metadata_from_view
        _glue_draft_inputs = DecodeCudaGraphRunner._glue_draft_inputs
        _prep_attention_variant = DecodeCudaGraphRunner._prep_attention_variant
        _glue_key = DecodeCudaGraphRunner._glue_key

        def __init__(self, backend, max_bs, nodes):
            super().__init__(backend, max_bs, nodes)
            self.attn_backend, self.device, self.seq_len_fill_value = backend, "cpu", self.fill
            self.model_runner = types.SimpleNamespace(lora_manager=None, is_draft_worker=False)
            self.enable_two_batch_overlap = self.enable_pdmux = self.is_encoder_decoder = False
            self.capture_forward_mode = ForwardMode.TARGET_VERIFY
            self._early_verify_metadata = None
            self._draft_metadata_glue = self._target_metadata_glue = False
            self._skip_glued_replay_view = envs.SGLANG_OPT_SKIP_GLUED_REPLAY_VIEW.get()
            enabled = envs.SGLANG_ENABLE_METADATA_GLUE_GRAPH.get()
            self._metadata_glue = MetadataGlueGraph(self.device) if enabled else None

        def _replay_attn_backend(self):
            return self.attn_backend

        def _global_num_tokens_for_graph(self, num_tokens):
            return None

        def replay(self, fb, q, k, v):
            """A replay of a full captured batch (the glue route needs raw_bs == bs)."""
            bs, b = fb.batch_size, self.buffers
            n = bs * self.nodes
            assert bs in self.graphs
            b.req_pool_indices[:bs].copy_(fb.req_pool_indices)
            b.seq_lens[:bs].copy_(fb.seq_lens)
            b.seq_lens_cpu[:bs].copy_(fb.seq_lens_cpu)
            b.out_cache_loc[:n].copy_(fb.out_cache_loc)
            self.q[:n].copy_(q)
            self.k[:n].copy_(k)
            self.v[:n].copy_(v)
            self.backend._tree_meta = None
            self._init_replay_attn_metadata(
                fb, raw_bs=bs, bs=bs, num_tokens=n, glue_key=self._glue_key(bs, str(fb.forward_mode), None),
                early_staged=False, attention_variant=None,
            )  # fmt: skip
            body, captured_meta = self.graphs[bs]
            if self.backend._tree_meta is None:  # a glue replay: no Python ran; the graph's kernels are the capture's
                self.backend._tree_meta = captured_meta
            assert self.backend._tree_meta is captured_meta
            return body()

    return GlueVerifyGraphRunner


def test_metadata_glue_graph_prepares_our_verify_eagerly(published, monkeypatch):
    """Issue #53, item 1. With ``SGLANG_ENABLE_METADATA_GLUE_GRAPH=1`` SGLang's
    decode graph runner records the replay prep into a glue graph after two
    warm-ups. Ours copies the block table up to the step's longest context (a
    host value): recorded, every later replay would copy the capture step's
    width, and a batch whose contexts grew past it would read stale columns
    (wrong KV slots, no error). Our prep refuses to be recorded; SGLang's glue
    falls back to the eager prep for good, and every step equals the eager
    verify. Real: SGLang's env reading, its replay routing and its
    ``MetadataGlueGraph``. Faked: the CUDA graph (``_RecordingGraph``: the
    recorded ops replayed on the same tensors)."""
    from sglang.srt.environ import envs

    monkeypatch.setenv("SGLANG_ENABLE_METADATA_GLUE_GRAPH", "1")
    assert envs.SGLANG_ENABLE_METADATA_GLUE_GRAPH.get()
    fake_cuda_graphs(monkeypatch)
    gen = torch.Generator().manual_seed(53)
    backend, runner = make_triton_backend(published, monkeypatch, TreeMaskMode.ANCESTOR_BITMASK)
    graphs = _glue_runner_class()(backend, CAPTURE_BS, NODES)
    graphs.capture(CAPTURE_BS)
    short = torch.tensor([3, 5, 4, 6])
    long = torch.tensor([MAX_CTX - NODES - 2, MAX_CTX - NODES - 3, 30, MAX_CTX - NODES - 4])
    # two warm-ups, the glue capture (all short contexts), then contexts past the captured width
    for step, ctx in enumerate([short, short, short, long, long]):
        fb, q, k, v, (slots, ctx, parents) = _with_lens(gen, backend, runner, ctx)
        expected = eager_verify(backend, fb, q, k, v)
        replayed = graphs.replay(fb, q, k, v)
        for layer, (got, want) in enumerate(zip(replayed, expected)):
            dense = dense_reference(q, k, v, runner.token_to_kv_pool, layer, slots, ctx, parents, DIM**-0.5)
            torch.testing.assert_close(got.double(), dense, atol=2e-5, rtol=2e-5, msg=lambda m: f"step {step}: {m}")
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    glue = graphs._metadata_glue
    assert glue.disabled and glue.replays == 0  # SGLang prepared ours eagerly after the refused capture


def test_sglangs_eagle_draft_runners_have_no_glue_graph_as_the_docs_say():
    """docs/sglang.md says what SGLANG_ENABLE_METADATA_GLUE_GRAPH does on the
    draft side: nothing, since SGLang 0.5.23's EAGLE draft runners build no
    glue graph (the decode runner drops it, the draft-extend runner never
    makes one). Read from SGLang's sources."""
    import ast
    import importlib.util
    from pathlib import Path

    def source(module):
        return Path(importlib.util.find_spec(module).origin).read_text()

    draft = ast.parse(source("sglang.srt.speculative.eagle_draft_cuda_graph_runner"))
    init = next(
        node for node in ast.walk(draft) if isinstance(node, ast.ClassDef) and node.name == "EAGLEDraftCudaGraphRunner"
    )
    init = next(node for node in init.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")
    glue_writes = [
        node.value for node in ast.walk(init) if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Attribute) and t.attr == "_metadata_glue" for t in node.targets)
    ]  # fmt: skip
    assert glue_writes and all(isinstance(v, ast.Constant) and v.value is None for v in glue_writes)
    assert "MetadataGlueGraph" not in source("sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner")
    doc = " ".join((Path(__file__).parents[2] / "docs" / "sglang.md").read_text().split())
    assert "EAGLE draft runners have no glue graph" in doc
    assert "keep their glue graphs" not in doc
