"""The EAGLE_TREE speculative algorithm: SGLang spec class and resolution hook.

Imported only from ``register()`` (SGLang must be importable).
"""

from __future__ import annotations

import logging

import spec_tree_kernels as stk

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from .config import (
    ALGORITHM_NAME,
    OUR_BACKENDS,
    detect_variant,
    requested_mask_mode,
    requested_variant,
    resolve_mask_mode,
    validate_tree,
)

logger = logging.getLogger(__name__)


class EagleTreeSpecAlgo(CustomSpecAlgo):
    """EAGLE_TREE: SGLang's EAGLE family (EAGLE or EAGLE3 after the head's
    config) with our tree ops.

    0.5.23's ``CustomSpecAlgo`` answers ``is_eagle() == False`` and lacks
    ``carries_draft_hidden_states`` (called at scheduler init),
    ``create_future_map`` (scheduler init) and ``need_topk`` (overlap
    FutureMap): a plain registration crashes the scheduler. We add them,
    delegating to ``SpeculativeAlgorithm``'s own implementations with ``self``
    standing in for ``SpeculativeAlgorithm.EAGLE`` / ``EAGLE3``.
    """

    # --- EAGLE family identity
    def is_eagle(self) -> bool:
        return True

    def is_eagle3(self) -> bool:
        return self.variant() == "EAGLE3"

    def supports_mixed_chunk(self) -> bool:
        return True

    def supports_grammar_overlap(self) -> bool:
        return True

    def has_draft_kv(self) -> bool:
        return True

    # --- the methods CustomSpecAlgo lacks in 0.5.23
    def carries_draft_hidden_states(self) -> bool:
        return SpeculativeAlgorithm.carries_draft_hidden_states(self)

    def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True, needs_confidence_relay=False):
        return SpeculativeAlgorithm.create_future_map(
            self, device, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay
        )

    def need_topk(self) -> bool:
        return SpeculativeAlgorithm.need_topk(self)

    def build_disagg_draft_input(self, batch, last_tokens_tensor, future_map):
        return SpeculativeAlgorithm.build_disagg_draft_input(self, batch, last_tokens_tensor, future_map)

    # --- EAGLE-1 vs EAGLE-3
    def variant(self) -> str:
        """The user's SPEC_PLUGINS_EAGLE_TREE_VARIANT, else what the published
        server args' draft head declares. SGLang keeps one instance of this
        class per process, so the detection is cached per head, never once
        for the process: a second Engine with another head gets its own."""
        explicit = requested_variant()
        if explicit is not None:
            return explicit
        return _variant_from_runtime()


def make_spec_class():
    return EagleTreeSpecAlgo


def _draft_architectures(path, trust_remote_code=False, revision=None) -> list:
    from sglang.srt.utils.hf_transformers_utils import get_config

    config = get_config(path, trust_remote_code=trust_remote_code, revision=revision)
    return list(getattr(config, "architectures", None) or [])


_DETECTED: dict = {}  # (draft path, revision) -> variant


def _variant_from_runtime() -> str:
    """Variant of the draft head in this process's published speculative
    config (what SGLang's scheduler and workers read)."""
    try:
        from sglang.srt.runtime_context import get_spec

        spec = get_spec()
        key = (spec.speculative_draft_model_path, spec.speculative_draft_model_revision)
    except Exception as err:  # noqa: BLE001 - no published config in this process
        logger.warning("%s: no published speculative config (%s); assuming EAGLE", ALGORITHM_NAME, err)
        return "EAGLE"
    if key[0] is None:
        return "EAGLE"
    if key not in _DETECTED:
        _DETECTED[key] = _detect_or_eagle(*key)
    return _DETECTED[key]


def _detect_or_eagle(path, revision) -> str:
    try:
        return detect_variant(_draft_architectures(path, revision=revision))
    except Exception as err:  # noqa: BLE001 - detection is best effort here
        logger.warning("%s: could not read the draft head's config (%s); assuming EAGLE", ALGORITHM_NAME, err)
        return "EAGLE"


# ------------------------------------------------------------ resolution


def handle_speculative_decoding_hook(server_args, previous):
    """Wraps SGLang's ``handle_speculative_decoding`` resolution step: the
    built-in step runs first (it uppercases the name and runs the registry's
    callbacks); for EAGLE_TREE we then apply what it applies to EAGLE."""
    previous(server_args)
    from sglang.srt.arg_groups.overrides import resolving_view

    if resolving_view(server_args).speculative_algorithm != ALGORITHM_NAME:
        return
    resolve_eagle_tree(server_args)


def detect_head_variant(view) -> str:
    """EAGLE / EAGLE3 from the head's config, cached for this head.

    Not written to the environment: the scheduler processes detect it from
    the published server args themselves (a recorded value would leak into
    the next Engine of this process, whose head may be the other kind)."""
    key = (view.speculative_draft_model_path, view.speculative_draft_model_revision)
    variant = detect_variant(_draft_architectures(key[0], trust_remote_code=view.trust_remote_code, revision=key[1]))
    _DETECTED[key] = variant
    return variant


def verify_attention_backend(view) -> str | None:
    """The backend that serves target verify (HybridAttnBackend's rule)."""
    from sglang.srt.arg_groups.model_override_base import attention_backends_of

    prefill, decode = attention_backends_of(view)
    if prefill == decode:
        return prefill
    return decode if getattr(view, "speculative_attention_mode", "prefill") == "decode" else prefill


def resolve_eagle_tree(server_args) -> None:
    """EAGLE family defaults and validation plus ours; raises ValueError with
    the offending flag on a configuration that cannot serve."""
    from sglang.srt.arg_groups.overrides import resolved_view, resolving_view
    from sglang.srt.arg_groups.speculative_hook import _handle_eagle_family

    check_flags_before_eagle_family(resolving_view(server_args))
    mask_mode_request = requested_mask_mode()  # an unknown mode fails before SGLang's own checks

    _handle_eagle_family(server_args)

    view = resolved_view(server_args)
    variant = requested_variant() or detect_head_variant(view)
    backend = checked_verify_backend(view)
    mode = resolve_mask_mode(mask_mode_request, backend)
    validate_tree(view.speculative_num_steps, view.speculative_eagle_topk, view.speculative_num_draft_tokens, mode)
    if backend in OUR_BACKENDS:
        check_our_backend_flags(view, backend)
        declare_our_backend_settings(server_args, view, backend)
    log_resolved_tree(view, variant, mode, backend)


def checked_verify_backend(view) -> str | None:
    """The verify attention backend, refusing ours on one phase only and a
    tree on ``torch_native``."""
    from sglang.srt.arg_groups.model_override_base import attention_backends_of

    prefill, decode = attention_backends_of(view)
    if (prefill in OUR_BACKENDS) != (decode in OUR_BACKENDS):
        raise ValueError(
            f"{ALGORITHM_NAME}: use --attention-backend {prefill if prefill in OUR_BACKENDS else decode} for "
            f"both prefill and decode (got prefill={prefill!r}, decode={decode!r})"
        )
    backend = verify_attention_backend(view)
    topk = view.speculative_eagle_topk
    if backend == "torch_native" and topk is not None and topk > 1:
        raise ValueError(
            f"{ALGORITHM_NAME}: attention backend 'torch_native' has no tree-verify support (it runs verify "
            f"causally and ignores the tree mask); use --attention-backend spec_tree"
        )
    return backend


def log_resolved_tree(view, variant: str, mode, backend) -> None:
    nodes = view.speculative_num_draft_tokens
    logger.info(
        "%s: %s head, steps=%d topk=%d draft tokens=%d, tree mask %s (%d bytes per request at 4k context), "
        "verify attention %r",
        ALGORITHM_NAME,
        variant,
        view.speculative_num_steps,
        view.speculative_eagle_topk,
        nodes,
        mode.name,
        stk.mask_bytes_per_request(mode, nodes, 4096),
        backend,
    )


def check_flags_before_eagle_family(cfg) -> None:
    """Ours first, where SGLang's EAGLE checks would fail less clearly."""
    if cfg.speculative_draft_model_path is None:
        raise ValueError(f"{ALGORITHM_NAME} needs --speculative-draft-model-path (the EAGLE / EAGLE-3 head)")
    if cfg.speculative_num_steps is None and (
        cfg.speculative_eagle_topk is not None or cfg.speculative_num_draft_tokens is not None
    ):
        # SGLang asserts this without a message: it fills all three or none.
        raise ValueError(
            f"{ALGORITHM_NAME}: --speculative-eagle-topk / --speculative-num-draft-tokens need "
            "--speculative-num-steps too (set all three, or none for SGLang's defaults)"
        )
    if cfg.enable_multi_layer_eagle:
        raise ValueError(f"{ALGORITHM_NAME} does not support --enable-multi-layer-eagle")
    check_accept_thresholds(cfg)
    if (cfg.tokenizer_worker_num or 1) > 1:
        # SGLang 0.5.23's tokenizer worker processes (uvicorn/granian workers
        # started from http_server's app path) never call load_plugins, so
        # EAGLE_TREE is unknown there: TokenizerManager.__init__ ->
        # compute_num_reserved_tokens -> SpeculativeAlgorithm.from_string fails
        # (tests/sglang/test_gpu_call_sites.py checks both facts).
        raise ValueError(
            f"{ALGORITHM_NAME} does not support --tokenizer-worker-num {cfg.tokenizer_worker_num}: SGLang's "
            "tokenizer worker processes do not load plugins; use --tokenizer-worker-num 1"
        )


ACCEPT_THRESHOLD_FLAGS = (
    ("speculative_accept_threshold_single", "--speculative-accept-threshold-single"),
    ("speculative_accept_threshold_acc", "--speculative-accept-threshold-acc"),
)


def check_accept_thresholds(cfg) -> None:
    """SGLang's accept thresholds != 1 relax acceptance (lossy); EAGLE_TREE's
    sampled verify is exact target-only rejection, so they are refused
    (runtime updates too: ``engine_patches._threshold_update_hook``)."""
    for field, flag in ACCEPT_THRESHOLD_FLAGS:
        value = getattr(cfg, field, 1.0)
        if value is not None and float(value) != 1.0:
            raise ValueError(
                f"{ALGORITHM_NAME} does not support {flag} {value}: a relaxed acceptance threshold is lossy, "
                f"and EAGLE_TREE samples exactly from the target's distribution; leave it at 1.0"
            )


def check_our_backend_flags(view, backend: str) -> None:
    """What our verify attention cannot serve, refused before any weights load."""
    from sglang.srt.runtime_context import attn_dp_enabled_of

    kv_dtype = str(view.kv_cache_dtype or "auto")
    if kv_dtype not in ("auto", "bfloat16", "bf16", "float16", "fp16", "half", "float32", "fp32"):
        raise ValueError(
            f"{ALGORITHM_NAME}: attention backend {backend!r} reads the KV cache in the model dtype; "
            f"--kv-cache-dtype {kv_dtype} is not supported"
        )
    # DP attention pads TARGET_VERIFY batches (ForwardBatch.prepare_mlp_sync_batch)
    # beyond the requests our tree mask holds; two-batch overlap splits the
    # mask with FULL_MASK offsets (two_batch_overlap.split_spec_info).
    if attn_dp_enabled_of(view):
        raise ValueError(
            f"{ALGORITHM_NAME}: attention backend {backend!r} does not support DP attention "
            f"(--attn-dp-size {view.attn_dp_size} / --enable-dp-attention): padded verify batches; "
            "use one of SGLang's attention backends (FULL_MASK)"
        )
    if view.enable_two_batch_overlap:
        raise ValueError(
            f"{ALGORITHM_NAME}: attention backend {backend!r} does not support --enable-two-batch-overlap "
            "(it splits the verify mask in FULL_MASK layout); use one of SGLang's attention backends"
        )


def declare_our_backend_settings(server_args, view, backend: str) -> None:
    """CUDA graphs off (no graph-captured tree verify); a draft attention
    backend of SGLang's (ours serves target verify only)."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    source = "spec_plugins.eagle_tree"
    logger.warning("%s: CUDA graphs are disabled with attention backend %r", ALGORITHM_NAME, backend)
    for phase in (Phase.DECODE, Phase.PREFILL):
        declare_resolution(
            server_args,
            source,
            cuda_graph_config=with_phase(resolving_view(server_args).cuda_graph_config, phase, backend=Backend.DISABLED),
        )
    if view.speculative_draft_attention_backend is None:
        draft_backend = "intel_amx" if str(view.device).startswith("cpu") else "triton"
        declare_resolution(server_args, source, speculative_draft_attention_backend=draft_backend)
        logger.info("%s: the draft head runs on attention backend %r", ALGORITHM_NAME, draft_backend)
