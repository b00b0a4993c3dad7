"""Attention backends whose target-verify pass reads our compact tree masks.

``spec_tree``         TorchNativeAttnBackend for prefill/decode (CPU; refused on CUDA).
``spec_tree_triton``  SGLang's TritonAttnBackend for prefill/decode (GPU).

Both route TARGET_VERIFY through ``spec_tree_kernels.attention_plan``'s
``TreeAttentionPlan`` (planned once per step in ``init_forward_metadata``,
run by every layer; Triton on CUDA tensors, torch otherwise) over SGLang's token pool,
viewed as a paged cache of block size 1 whose block table is the request's
``req_to_token`` row: the verify nodes sit at positions ``seq_len ..
seq_len + T - 1`` exactly as ``eagle_prepare_for_verify`` allocated them.

The backend exposes SGLang's verify-mask interface (``verify_mask``: a
``VerifyMask`` with our ``mode``), so ``build_eagle_verify_input`` builds the
layout this backend reads into its buffer. Modes read: ANCESTOR_BITMASK
(default), PARENT_POINTER, QLEN_ONLY (``--speculative-tree-mask-mode``, else
``SPEC_PLUGINS_TREE_MASK_MODE``).

CUDA graphs (``spec_tree_triton``): SGLang's decode graph runner captures
TARGET_VERIFY through the entry points below. Everything that needs the host
runs outside the graph (``init_forward_metadata_out_graph``): the requests'
``req_to_token`` rows narrowed to the batch's longest context (from the
host-side ``seq_lens_cpu``: no sync) are copied into a static block table,
the lengths into static context lengths, and the tree mask is the backend's
own ``verify_mask`` buffer (SGLang's builder writes it in place). The plan,
made once per captured batch size over those static buffers, launches only
Triton kernels whose grid follows shapes, so the graph holds the attention of
every layer; its split count is sized for the longest possible context (the
graph serves every length). ``spec_tree``'s torch path sizes its work by the
step's longest context on the host, so it is not captured (the resolution hook
keeps graphs off for it).

Not supported (clear errors): MLA, sliding-window / logit-capped /
cross-attention layers, attention sinks, a KV cache dtype other than the model
dtype, KV cache layouts other than token slots (SGLANG_USE_HND_KVCACHE),
decode context parallelism (--dcp-size > 1).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.attention.verify_mask import VerifyMask
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from spec_tree_kernels import TreeMaskMode, resolve_impl
from spec_tree_kernels.attention_plan import TreeAttentionPlan
from spec_tree_kernels.modes import MODES, TREE_ATTENTION_MODES, empty_tree_mask, mask_dtype

from .config import (
    ALGORITHM_NAME,
    BACKEND_TORCH,
    UNREADABLE_KV_CACHE_LAYOUTS,
    check_decode_context_parallel_size,
    check_torch_backend_device,
    kv_cache_layout_refusal,
    mask_mode_source,
    requested_mask_mode,
    resolve_mask_mode,
)


class TreeGraphState(NamedTuple):
    """Static buffers the captured TARGET_VERIFY graphs read (one set for every
    captured batch size; a graph of bs requests reads the first bs rows)."""

    max_bs: int
    block_table: torch.Tensor  # [max_bs, req_to_token width], req_to_token's dtype
    context_lens: torch.Tensor  # [max_bs] int64
    root_mask: torch.Tensor  # [max_bs, 1, 1] int64 ones: a one-node tree sees itself
    metas: dict  # (batch size, nodes) -> TreeVerifyMeta made at capture


class TreeVerifyMeta(NamedTuple):
    """One TARGET_VERIFY step: ``plan`` was made once in ``init_forward_metadata``
    and is run by every layer."""

    plan: TreeAttentionPlan
    batch: int
    nodes: int


def _spec_num_draft_tokens() -> Optional[int]:
    try:
        from sglang.srt.runtime_context import get_spec

        return get_spec().speculative_num_draft_tokens
    except Exception:  # noqa: BLE001 - no published server args (no speculation)
        return None


def allocate_verify_mask(mode: TreeMaskMode, max_bs: int, nodes: int, device) -> torch.Tensor:
    """The verify-mask buffer for ``max_bs`` requests of ``nodes`` nodes, zeroed
    (the kernel module's allocator, ``spec_tree_kernels.modes.empty_tree_mask``)."""
    if mode not in TREE_ATTENTION_MODES:
        raise ValueError(f"{BACKEND_TORCH}: tree attention does not read mask mode {mode.name}")
    return empty_tree_mask(mode, max_bs, nodes, 0, device, zeroed=True)


# ----------------------------------------------- startup checks (model runner)
# The backend is built after the model loads and the KV dtype is resolved, and
# before the first request: what tree verify cannot serve fails here, naming
# the option, rather than in the first verify step.


def check_kv_cache_dtype(model_runner, backend_name: str) -> None:
    """The pool's real dtype, as SGLang resolved it: ``--kv-cache-dtype auto``
    becomes FP8 when the checkpoint declares FP8 KV quantization
    (``mem_cache.kv_cache_dtype.configure_kv_cache_dtype``)."""
    kv_dtype, model_dtype = getattr(model_runner, "kv_cache_dtype", None), getattr(model_runner, "dtype", None)
    if kv_dtype is None or model_dtype is None or kv_dtype == model_dtype:
        return
    quant_config = getattr(getattr(model_runner, "model", None), "quant_config", None)
    algo = getattr(quant_config, "kv_cache_quant_algo", None)
    source = f" (the checkpoint declares {algo} KV cache quantization)" if algo else ""
    raise ValueError(
        f"{ALGORITHM_NAME}: attention backend {backend_name!r} reads the KV cache in the model dtype {model_dtype}, "
        f"but the KV cache is {kv_dtype}{source}; pass --kv-cache-dtype matching the model dtype (bf16 for a bf16 "
        "model), or use one of SGLang's attention backends"
    )


def check_target_layers(model, backend_name: str) -> None:
    """Every attention layer of the target is one tree verify can compute."""
    if model is None:
        return
    from sglang.srt.layers.radix_attention import RadixAttention

    bad = []
    for module in model.modules():
        if not isinstance(module, RadixAttention):
            continue
        reasons = [
            name for name, hit in (
                ("logit capping", (module.logit_cap or 0) > 0),
                ("sliding window", module.sliding_window_size > -1),
                ("cross-attention", module.is_cross_attention),
            ) if hit
        ]  # fmt: skip
        if reasons:
            bad.append(f"layer {module.layer_id}: {', '.join(reasons)}")
    if bad:
        raise ValueError(
            f"{ALGORITHM_NAME}: attention backend {backend_name!r} cannot verify trees on this model "
            f"({'; '.join(bad[:4])}{'; ...' if len(bad) > 4 else ''}); use one of SGLang's attention backends"
        )


def check_unpadded_verify_batches(backend_name: str) -> None:
    """The verify mask holds the real requests; SGLang pads TARGET_VERIFY
    batches under MLP sync (DP attention, gathered MoE buffers) and splits
    them (two-batch overlap) in FULL_MASK layout; under decode context
    parallelism each rank holds part of every context. The resolution hook
    refuses the flags; this catches any other route to them."""
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.utils.common import require_mlp_sync

    if require_mlp_sync():
        raise ValueError(
            f"{ALGORITHM_NAME}: attention backend {backend_name!r} does not support padded verify batches "
            "(DP attention / --attn-dp-size, or MoE layouts that gather across DP ranks)"
        )
    if get_exec().overlap.enable_two_batch_overlap:
        raise ValueError(f"{ALGORITHM_NAME}: attention backend {backend_name!r} does not support --enable-two-batch-overlap")
    from sglang.srt.runtime_context import get_parallel

    check_decode_context_parallel_size(get_parallel().attn_dcp_size, backend_name)


def check_kv_cache_layout(pool, backend_name: str) -> None:
    """The pool as SGLang built it: the variables that select its layout are
    read by the pool itself, so this covers every route to one (resolution
    refuses SGLANG_USE_HND_KVCACHE already)."""
    layout = getattr(pool, "kv_cache_layout", None)
    if layout in UNREADABLE_KV_CACHE_LAYOUTS:
        raise ValueError(kv_cache_layout_refusal(backend_name, layout))


GLUE_GRAPH_ENV = "SGLANG_ENABLE_METADATA_GLUE_GRAPH"


def _stream_capturing() -> bool:
    """Whether the current CUDA stream is recording a graph (False in a build without CUDA)."""
    try:
        return bool(torch.cuda.is_current_stream_capturing())
    except (RuntimeError, AssertionError):  # torch without CUDA
        return False


class GraphCaptureRefused(RuntimeError):
    """Our verify prep was called under a CUDA graph capture."""


def refuse_stream_capture(backend_name: str) -> None:
    """The verify prep runs outside every graph: it narrows its block-table copy
    by the host-side lengths each step, so a recording would replay the
    capture's width (wrong KV slots once contexts grow past it). SGLang's
    metadata glue graph (``SGLANG_ENABLE_METADATA_GLUE_GRAPH=1``) records the
    replay prep (``MetadataGlueGraph.run``); on a capture failure it falls back
    to the eager prep for good, which is what this refusal gets: ours is
    prepared eagerly every step (SGLang's EAGLE draft runners have no glue
    graph)."""
    if _stream_capturing():
        raise GraphCaptureRefused(
            f"{ALGORITHM_NAME}: attention backend {backend_name!r} prepares target verify outside CUDA graphs "
            f"(its block-table copy is sized from the host-side lengths each step); not capturing it into "
            f"{GLUE_GRAPH_ENV}'s metadata glue graph, SGLang prepares it eagerly"
        )


class TreeVerifyMixin:
    """Target verify through a ``TreeAttentionPlan``; everything else is the parent's."""

    backend_name = BACKEND_TORCH
    tree_attention_impl = "auto"  # "torch" | "triton" | "auto" (spec_tree_kernels.resolve_impl)

    def _init_tree_verify(self, model_runner) -> None:
        if getattr(model_runner, "use_mla_backend", False):
            raise ValueError(f"attention backend {self.backend_name!r} does not support MLA models")
        window = getattr(model_runner, "sliding_window_size", None)
        if window is not None and window > 0:
            raise ValueError(f"attention backend {self.backend_name!r} does not support sliding-window attention")
        if not getattr(model_runner, "is_draft_worker", False):  # the draft never runs target verify
            check_kv_cache_dtype(model_runner, self.backend_name)
            check_target_layers(getattr(model_runner, "model", None), self.backend_name)
            check_unpadded_verify_batches(self.backend_name)
            check_kv_cache_layout(getattr(model_runner, "token_to_kv_pool", None), self.backend_name)
        self.tree_is_draft = bool(getattr(model_runner, "is_draft_worker", False))
        from .algorithm import published_mask_mode_flag

        flag = published_mask_mode_flag()
        self.tree_mask_mode = resolve_mask_mode(
            requested_mask_mode(flag=flag), self.backend_name, mask_mode_source(flag)
        )
        self.tree_max_bs = model_runner.req_to_token_pool.size
        self.tree_num_draft_tokens = _spec_num_draft_tokens()
        self._tree_meta: Optional[TreeVerifyMeta] = None
        self._tree_graph: Optional[TreeGraphState] = None
        self._tree_impls: dict = {}  # (tree_attention_impl, device) -> resolved impl, resolved once
        self._tree_verify_mask = None
        if self.tree_num_draft_tokens and not getattr(model_runner, "is_draft_worker", False):
            self._tree_verify_mask = VerifyMask(
                buffer=allocate_verify_mask(
                    self.tree_mask_mode, self.tree_max_bs, self.tree_num_draft_tokens, model_runner.device
                ),
                mode=self.tree_mask_mode,
                max_bs=self.tree_max_bs,
                is_read=True,
            )

    # --- SGLang's verify-mask interface
    @property
    def verify_mask(self) -> Optional[VerifyMask]:
        return self._tree_verify_mask

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
        """The mask is read from spec_info at forward time: nothing to refresh."""

    # --- metadata
    def init_forward_metadata(self, forward_batch):
        if forward_batch.forward_mode.is_target_verify():
            self._tree_meta = self.tree_verify_metadata(forward_batch)
            return
        self._tree_meta = None
        super().init_forward_metadata(forward_batch)

    # --- CUDA graphs (SGLang's decode graph runner captures TARGET_VERIFY)
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        if self.tree_is_draft:
            # a draft runner never runs target verify: its graphs are the parent's
            return super().init_cuda_graph_state(max_bs, max_num_tokens)
        # A target runner captures TARGET_VERIFY only (DecodeCudaGraphRunner's mode for any
        # speculative runner), all of it ours: the parent's decode state (Triton's kv-indices
        # of max_num_tokens x max_context_len and its FULL_MASK buffer) would never be read.
        r2t = self.req_to_token_pool.req_to_token
        self._tree_graph = TreeGraphState(
            max_bs=max_bs,
            block_table=torch.zeros(max_bs, r2t.shape[1], dtype=r2t.dtype, device=r2t.device),
            context_lens=torch.zeros(max_bs, dtype=torch.int64, device=r2t.device),
            root_mask=torch.ones(max_bs, 1, 1, dtype=torch.int64, device=r2t.device),
            metas={},
        )

    def glue_target_verify_metadata(self) -> str:
        # SGLang's metadata glue graph would capture the prep below; it takes host inputs per step
        return f"{self.backend_name}: the verify prep narrows its block-table copy by the host-side lengths"

    def get_cuda_graph_seq_len_fill_value(self):
        # padded requests of a replayed batch attend one prefix position (row
        # 0 of req_to_token) besides their tree: finite, and never read back
        return 1

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if forward_batch.forward_mode.is_target_verify():
            refuse_stream_capture(self.backend_name)
            self._tree_meta = self.graph_verify_metadata(forward_batch, in_capture)
            return None
        return super().init_forward_metadata_out_graph(forward_batch, in_capture)

    def init_forward_metadata_in_graph(self, forward_batch):
        if forward_batch.forward_mode.is_target_verify():
            return None  # all of verify's prep is the out-of-graph copies: the graph holds the attention only
        return super().init_forward_metadata_in_graph(forward_batch)

    def graph_verify_metadata(self, forward_batch, in_capture: bool) -> TreeVerifyMeta:
        """Capture: plan over the static buffers (kept per batch size). Replay
        and capture: refill those buffers for this batch, outside the graph."""
        impl = self._resolve_impl(forward_batch.seq_lens.device)
        if impl != "triton":
            raise RuntimeError(
                f"attention backend {self.backend_name!r} captures target verify only with the Triton tree "
                f"attention (resolved implementation: {impl!r}); use --attention-backend spec_tree_triton on a "
                "GPU, or run with --disable-cuda-graph"
            )
        graph = self._tree_graph
        if graph is None:
            raise RuntimeError(
                f"attention backend {self.backend_name!r}: init_cuda_graph_state was not called before the "
                "TARGET_VERIFY graph's metadata"
            )
        bs = len(forward_batch.req_pool_indices)
        nodes = int(forward_batch.spec_info.draft_token_num)
        if bs > graph.max_bs:
            raise RuntimeError(f"{self.backend_name!r}: a graph batch of {bs} requests exceeds max_bs={graph.max_bs}")
        longest = None if in_capture else self._host_longest(forward_batch)
        used = self._used_width(longest, nodes)
        # a plain copy of the columns the batch reads (the kernels read nothing past context + T)
        graph.block_table[:bs, :used].copy_(self._block_table_rows(forward_batch.req_pool_indices, used))
        graph.context_lens[:bs].copy_(forward_batch.seq_lens)
        if nodes > 1:
            self._fill_graph_mask(forward_batch.spec_info.custom_mask, bs, nodes, forward_batch, in_capture)
        meta = graph.metas.get((bs, nodes))
        if in_capture or meta is None:
            if nodes == 1:
                mask, mode = graph.root_mask[:bs], TreeMaskMode.ANCESTOR_BITMASK
            else:
                mask, mode = self._mask_view(self._tree_verify_mask.buffer, bs, nodes)
            # max_context_len None: the split plan covers the block table's reach, as
            # the graph is replayed for any context length
            plan = TreeAttentionPlan.create(
                graph.block_table[:bs], graph.context_lens[:bs], mask, mode, nodes, 1, None, impl=impl
            )
            meta = graph.metas[(bs, nodes)] = TreeVerifyMeta(plan, bs, nodes)
        return meta

    def _fill_graph_mask(self, custom_mask, bs, nodes, forward_batch, in_capture) -> None:
        """The graph reads the backend's own buffer; SGLang's builder writes the
        batch's masks there. Anything else (a mask built elsewhere) is copied in;
        at capture SGLang hands its FULL_MASK placeholder, which is not read."""
        buffer = self._tree_verify_mask.buffer if self._tree_verify_mask is not None else None
        if buffer is None:
            raise RuntimeError(f"attention backend {self.backend_name!r} has no verify-mask buffer to capture")
        if in_capture or custom_mask is None or custom_mask.data_ptr() == buffer.data_ptr():
            return
        real = bs - int(getattr(forward_batch, "num_padding", 0) or 0)
        source, _ = self._mask_view(custom_mask, real, nodes)
        target, _ = self._mask_view(buffer, real, nodes)
        target.copy_(source)

    def _resolve_impl(self, device: torch.device) -> str:
        key = (self.tree_attention_impl, device.type, device.index)
        impl = self._tree_impls.get(key)
        if impl is None:  # resolved once: the environment is read at the first step, not per op
            impl = self._tree_impls[key] = resolve_impl("attention", self.tree_attention_impl, device)
        return impl

    @staticmethod
    def _host_longest(forward_batch) -> Optional[int]:
        """The longest committed context, from SGLang's host copy of the lengths
        (no device read); None when the batch carries none."""
        cpu_lens = getattr(forward_batch, "seq_lens_cpu", None)
        if cpu_lens is None or cpu_lens.numel() == 0:
            return None
        return max(cpu_lens.tolist())  # a host list: no torch op per step

    def _used_width(self, longest: Optional[int], nodes: int) -> int:
        width = self.req_to_token_pool.req_to_token.shape[1]
        return width if longest is None else max(1, min(width, longest + nodes))

    def _block_table_rows(self, req_pool_indices, used: int) -> torch.Tensor:
        """The requests' req_to_token rows, their first ``used`` columns only."""
        return self.req_to_token_pool.req_to_token[:, :used].index_select(0, req_pool_indices)

    def tree_verify_metadata(self, forward_batch) -> TreeVerifyMeta:
        """Plan the step's verify attention: the token pool is a paged cache of
        block size 1 whose block table rows are the requests' req_to_token rows,
        narrowed to the batch's longest context plus the tree."""
        spec = forward_batch.spec_info
        bs = len(forward_batch.req_pool_indices)
        nodes = int(spec.draft_token_num)
        impl = self._resolve_impl(forward_batch.seq_lens.device)
        longest = self._host_longest(forward_batch)
        if longest is None and impl != "triton" and bs:
            # The torch path reads every position up to the bound, so it needs one: a device
            # read, only where SGLang keeps no host copy (the CPU path: no sync to speak of).
            longest = int(forward_batch.seq_lens.max())
        rows = self._block_table_rows(forward_batch.req_pool_indices, self._used_width(longest, nodes))
        mask, mode = self._mask_view(self._step_mask(spec, bs, nodes), bs, nodes)
        plan = TreeAttentionPlan.create(rows, forward_batch.seq_lens, mask, mode, nodes, 1, longest, impl=impl)
        return TreeVerifyMeta(plan, bs, nodes)

    def _step_mask(self, spec, bs: int, nodes: int) -> torch.Tensor:
        """The verify input's mask, or ours in place of SGLang's placeholder.

        SGLang's dummy verify (``create_dummy_verify_input``: the warm-up's
        ``BaseRunner._dummy_run``, run on CUDA for FlashInfer's autotune with
        ModelOpt FP8/FP4 targets and flashinfer MoE runners) drafts no tree
        (``draft_token`` None) and hands its FULL_MASK placeholder, a bool
        buffer of ones, whatever mode the backend reads. Its outputs are not
        read: the dummy attends through the backend's own mask buffer (zeroed
        at allocation, or a real step's valid masks), as the graph capture does."""
        custom_mask = spec.custom_mask
        placeholder = (
            nodes > 1
            and getattr(spec, "draft_token", None) is None
            and custom_mask is not None
            and custom_mask.dtype == torch.bool
            and mask_dtype(self.tree_mask_mode, nodes) != torch.bool
        )
        if not placeholder:
            return custom_mask
        own = self._tree_verify_mask
        if own is not None and own.max_bs >= bs and nodes == self.tree_num_draft_tokens:
            return own.buffer
        return allocate_verify_mask(self.tree_mask_mode, bs, nodes, custom_mask.device)

    def _mask_view(self, custom_mask: torch.Tensor, bs: int, nodes: int):
        if nodes == 1:  # a one-node tree (speculative_num_steps == 0): the root sees itself
            return torch.ones(bs, 1, 1, dtype=torch.int64, device=custom_mask.device), TreeMaskMode.ANCESTOR_BITMASK
        mode = self.tree_mask_mode
        want = mask_dtype(mode, nodes)
        if custom_mask is None or custom_mask.dtype != want:
            got = None if custom_mask is None else custom_mask.dtype
            raise RuntimeError(
                f"{ALGORITHM_NAME}: attention backend {self.backend_name!r} reads {mode.name} tree masks "
                f"({want}) but the verify input carries {got}: the worker built another mask mode"
            )
        shape = MODES[mode].shape(bs, nodes, 0)  # the first bs requests' part of the buffer
        view = custom_mask.reshape(-1, *shape[1:])[: shape[0]]
        if view.shape[0] < shape[0]:
            raise RuntimeError(f"{ALGORITHM_NAME}: tree mask of shape {tuple(custom_mask.shape)} is too small for {bs} requests")
        return view, mode

    # --- forward
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        if not forward_batch.forward_mode.is_target_verify():
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)
        return self.forward_target_verify(q, k, v, layer, forward_batch, save_kv_cache=save_kv_cache, **kwargs)

    # Out of dynamo (--enable-torch-compile compiles the model forward, and with it the
    # attention layers' backend calls): the plan's work is sized on the host and launches
    # Triton kernels, as SGLang's TritonAttnBackend keeps its kernel calls out with
    # torch.compiler.disable. Under a CUDA graph the call is recorded like any other.
    @torch.compiler.disable
    def forward_target_verify(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        unsupported = [name for name in ("sinks", "score_mod", "aux_tensors") if kwargs.get(name) is not None]
        if layer.is_cross_attention or layer.sliding_window_size > -1 or (layer.logit_cap or 0) > 0 or unsupported:
            raise NotImplementedError(
                f"attention backend {self.backend_name!r}: tree verify does not support cross-attention, "
                f"sliding windows, logit capping or {unsupported or 'sinks'} (layer {layer.layer_id})"
            )
        meta = self._tree_meta
        if meta is None:
            meta = self._tree_meta = self.tree_verify_metadata(forward_batch)
        if save_kv_cache and k is not None and v is not None:
            loc = KVWriteLoc(
                forward_batch.out_cache_loc, physical=getattr(forward_batch, "out_cache_loc_is_physical", False)
            )
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        if k_cache.dtype != q.dtype:
            raise TypeError(
                f"attention backend {self.backend_name!r} needs the KV cache in the model dtype {q.dtype}, "
                f"got {k_cache.dtype} (--kv-cache-dtype)"
            )
        q4 = q.reshape(meta.batch, meta.nodes, layer.tp_q_head_num, layer.qk_head_dim)
        out = meta.plan.run(q4, k_cache.unsqueeze(1), v_cache.unsqueeze(1), scale=layer.scaling)
        return out.reshape(meta.batch * meta.nodes, layer.tp_q_head_num * layer.v_head_dim)


class TreeVerifyTorchNativeBackend(TreeVerifyMixin, TorchNativeAttnBackend):
    """``--attention-backend spec_tree``: torch_native prefill/decode, our verify."""

    backend_name = BACKEND_TORCH

    def __init__(self, model_runner):
        # resolution refuses it already (--device); this covers a runner on CUDA however it got there
        check_torch_backend_device(BACKEND_TORCH, getattr(model_runner, "device", None))
        super().__init__(model_runner)
        self._init_tree_verify(model_runner)


_TRITON_CLASS = None


def triton_tree_backend_class():
    """The ``spec_tree_triton`` class, defined on first use: importing SGLang's
    Triton backend pulls in its kernels."""
    global _TRITON_CLASS
    if _TRITON_CLASS is None:
        from sglang.srt.layers.attention.triton_backend import TritonAttnBackend

        from .config import BACKEND_TRITON

        class TreeVerifyTritonBackend(TreeVerifyMixin, TritonAttnBackend):
            backend_name = BACKEND_TRITON

            def __init__(self, model_runner):
                TritonAttnBackend.__init__(self, model_runner)
                self._init_tree_verify(model_runner)

        _TRITON_CLASS = TreeVerifyTritonBackend
    return _TRITON_CLASS


def make_triton_tree_backend(model_runner):
    """``--attention-backend spec_tree_triton``: SGLang's Triton prefill/decode
    (GPU), our verify."""
    return triton_tree_backend_class()(model_runner)
