"""Attention backends whose target-verify pass reads our compact tree masks.

``spec_tree``         TorchNativeAttnBackend for prefill/decode (CPU or GPU).
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
(default), PARENT_POINTER, QLEN_ONLY (``SPEC_PLUGINS_TREE_MASK_MODE``).

Not supported (clear errors): CUDA graphs for target verify (the resolution
hook turns them off), MLA, sliding-window / logit-capped / cross-attention
layers, attention sinks, a KV cache dtype other than the model dtype.
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

from .config import ALGORITHM_NAME, BACKEND_TORCH, requested_mask_mode, resolve_mask_mode


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
    them (two-batch overlap) in FULL_MASK layout. The resolution hook refuses
    the flags; this catches any other route to either."""
    from sglang.srt.runtime_context import get_exec
    from sglang.srt.utils.common import require_mlp_sync

    if require_mlp_sync():
        raise ValueError(
            f"{ALGORITHM_NAME}: attention backend {backend_name!r} does not support padded verify batches "
            "(DP attention / --attn-dp-size, or MoE layouts that gather across DP ranks)"
        )
    if get_exec().overlap.enable_two_batch_overlap:
        raise ValueError(f"{ALGORITHM_NAME}: attention backend {backend_name!r} does not support --enable-two-batch-overlap")


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
        self.tree_mask_mode = resolve_mask_mode(requested_mask_mode(), self.backend_name)
        self.tree_max_bs = model_runner.req_to_token_pool.size
        self.tree_num_draft_tokens = _spec_num_draft_tokens()
        self._tree_meta: Optional[TreeVerifyMeta] = None
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

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if forward_batch.forward_mode.is_target_verify():
            raise RuntimeError(
                f"attention backend {self.backend_name!r} does not capture target verify in CUDA graphs; "
                "run with --disable-cuda-graph"
            )
        return super().init_forward_metadata_out_graph(forward_batch, in_capture)

    def _resolve_impl(self, device: torch.device) -> str:
        return resolve_impl("attention", self.tree_attention_impl, device)

    def tree_verify_metadata(self, forward_batch) -> TreeVerifyMeta:
        """Plan the step's verify attention: the token pool is a paged cache of
        block size 1 whose block table rows are the requests' req_to_token rows."""
        spec = forward_batch.spec_info
        bs = len(forward_batch.req_pool_indices)
        nodes = int(spec.draft_token_num)
        impl = self._resolve_impl(forward_batch.seq_lens.device)
        rows = self.req_to_token_pool.req_to_token[forward_batch.req_pool_indices]
        longest = None
        if impl == "torch":
            # The torch path reads every position up to the bound: bound it (the CPU copy
            # SGLang keeps, so no sync; a device read only when it has none, on the CPU path).
            cpu_lens = getattr(forward_batch, "seq_lens_cpu", None)
            lens = cpu_lens if cpu_lens is not None else forward_batch.seq_lens
            longest = int(lens.max()) if bs else 0
        mask, mode = self._mask_view(spec.custom_mask, bs, nodes)
        plan = TreeAttentionPlan.create(rows, forward_batch.seq_lens, mask, mode, nodes, 1, longest, impl=impl)
        return TreeVerifyMeta(plan, bs, nodes)

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
