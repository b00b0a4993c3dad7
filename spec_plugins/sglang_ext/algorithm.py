"""The EAGLE_TREE speculative algorithm: SGLang spec class and resolution hook.

Imported only from ``register()`` (SGLang must be importable).
"""

from __future__ import annotations

import json
import logging

import spec_tree_kernels as stk

from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from . import name_keyed_features
from .config import (
    ALGORITHM_NAME,
    check_decode_context_parallel_size,
    kv_cache_layout_refusal,
    GRAPHLESS_BACKENDS,
    MASK_MODE_FLAG,
    MASK_MODE_RECORD,
    OUR_BACKENDS,
    block_drafter_evidence,
    block_drafter_refusal,
    check_torch_backend_device,
    detect_variant,
    mask_mode_source,
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
        """EAGLE or EAGLE3: decided once where the server arguments were
        resolved (``resolve_head_variant``) and read here from the published
        ones, which SGLang hands every process it spawns. SGLang keeps one
        instance of this class per process, so nothing is cached on it: a
        second Engine with another head publishes its own answer."""
        return published_variant()


def make_spec_class():
    return EagleTreeSpecAlgo


# A bookkeeping attribute of ServerArgs (underscore, not a field): SGLang lets
# resolution set those, and pickles them with the record to its processes.
VARIANT_RECORD = "_spec_plugins_eagle_tree_variant"


def published_variant() -> str:
    from sglang.srt.runtime_context import get_context

    try:
        server_args = get_context().server_args
    except ValueError as err:
        raise RuntimeError(
            f"{ALGORITHM_NAME}: no server args are published in this process, so its head variant is unknown ({err})"
        ) from err
    variant = getattr(server_args, VARIANT_RECORD, None)
    if variant is None:
        raise RuntimeError(
            f"{ALGORITHM_NAME}: the published server args carry no head variant: they were resolved without the "
            "spec-plugins SGLang plugin (its handle_speculative_decoding hook decides EAGLE vs EAGLE3)"
        )
    return variant


def published_mask_mode_flag():
    """``--speculative-tree-mask-mode`` as given to the server arguments this
    process was handed (None: not given, or none published)."""
    from sglang.srt.runtime_context import get_context

    try:
        server_args = get_context().server_args
    except ValueError:
        return None
    return getattr(server_args, MASK_MODE_RECORD, None)


def draft_checkpoint(view) -> tuple:
    """(path, revision) of the draft checkpoint SGLang's draft worker loads.
    Without --speculative-draft-model-path that is the target checkpoint
    (``ModelConfig.from_server_args`` falls back to --model-path and
    --revision): NEXTN / MTP, whose draft is the target's own MTP layer."""
    if view.speculative_draft_model_path is None:
        return view.model_path, view.speculative_draft_model_revision or view.revision
    return view.speculative_draft_model_path, view.speculative_draft_model_revision


def read_draft_config(view):
    """The draft head's config, read with the arguments SGLang loads the draft
    model's config with (``ModelConfig.from_server_args`` for a draft), so we
    read the config SGLang will serve."""
    from sglang.srt.utils.hf_transformers_utils import get_config

    path, revision = draft_checkpoint(view)
    return get_config(
        path,
        trust_remote_code=view.trust_remote_code,
        revision=revision,
        model_override_args=json.loads(view.json_model_override_args),
        model_config_parser=view.model_config_parser,
        **draft_config_kwargs(view),
    )


def draft_config_kwargs(view) -> dict:
    """--decrypted-draft-config-file, as SGLang hands it to ``get_config``."""
    config_file = view.decrypted_draft_config_file
    return {"_configuration_file": config_file.strip()} if config_file and config_file.strip() else {}


def checked_draft_config(view, variant_requested: bool):
    """The draft head's config; refuses a DFlash block drafter (ValueError
    naming the path and why). Unreadable: ValueError naming the path, unless
    the user named the variant (SGLang then reports the path when it loads
    the draft; None here)."""
    path, revision = draft_checkpoint(view)
    try:
        draft_config = read_draft_config(view)
    except Exception as err:  # noqa: BLE001 - re-raised with the path and the reason
        if variant_requested:
            return None
        # a guess would load the wrong draft model: an EAGLE-3 head's fc takes 3 x hidden
        raise ValueError(
            f"{ALGORITHM_NAME}: cannot read the draft head's config from {draft_path_flag(view)} {path!r}"
            f"{f' (revision {revision!r})' if revision else ''} to tell an EAGLE from an EAGLE-3 head: "
            f"{type(err).__name__}: {err}"
        ) from err
    evidence = block_drafter_evidence(draft_config)
    if evidence is not None:
        raise ValueError(block_drafter_refusal(path, evidence))
    return draft_config


def draft_path_flag(view) -> str:
    if view.speculative_draft_model_path is None:
        return "--model-path (no --speculative-draft-model-path: the target's own MTP layer drafts)"
    return "--speculative-draft-model-path"


# --------------------------------------------- NEXTN / MTP drafts (issue 51)
#
# SGLang's NEXTN is EAGLE: speculative_hook._resolve_speculative_algorithm_alias
# turns NEXTN into EAGLE, SpeculativeAlgorithm.create_worker gives EAGLE
# EAGLEWorkerV2 (which EagleTreeWorker subclasses), and what makes a draft an
# MTP head is keyed on the draft's config, not on the name: the draft worker's
# ModelConfig (is_draft_model) rewrites the target's architecture to its MTP
# form (ModelConfig._config_draft_model: DeepseekV3ForCausalLM ->
# DeepseekV3ForCausalLMNextN, MiMoForCausalLM -> MiMoMTP, ...), and
# EagleDraftWorker.init_lm_head shares the target's embedding and lm_head with
# any non-EAGLE-3 draft. So EAGLE_TREE serves NEXTN drafts as they are; what
# it must add is NEXTN's resolution: no --speculative-draft-model-path means
# the target's own MTP layer, and a draft SGLang's NEXTN would not run in the
# EAGLE worker is refused.


def sglang_draft_architecture(config) -> str:
    """The architecture SGLang's draft worker loads a checkpoint of this
    config as: SGLang's own rewrite (``ModelConfig._config_draft_model``),
    run on a copy, since ``get_config`` caches the object the target's
    ModelConfig later reads. ``_config_draft_model`` reads only the fields
    given here."""
    import copy
    import types

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.utils.hf_transformers_utils import get_hf_text_config

    hf_config = copy.deepcopy(config)
    draft = types.SimpleNamespace(
        is_draft_model=True, hf_config=hf_config, hf_text_config=get_hf_text_config(hf_config),
        speculative_algorithm=ALGORITHM_NAME, is_draft_quantization_explicit=False, quantization=None,
        sliding_window_size=None,
    )  # fmt: skip
    ModelConfig._config_draft_model(draft)
    return draft.hf_config.architectures[0]


def check_mtp_target(target_config, model_path) -> str:
    """Without --speculative-draft-model-path the draft is the target's own MTP
    layer (as for NEXTN): its MTP architecture, or ValueError when SGLang has
    no MTP form of the target's architecture (it would load the whole target
    as the draft)."""
    archs = list(getattr(target_config, "architectures", None) or [])
    target_arch = archs[0] if archs else None
    draft_arch = sglang_draft_architecture(target_config) if target_arch else None
    if draft_arch is None or draft_arch == target_arch:
        raise ValueError(
            f"{ALGORITHM_NAME} needs --speculative-draft-model-path (the EAGLE / EAGLE-3 head): without it the "
            f"draft is the target's own MTP (NextN) layer, as for --speculative-algorithm NEXTN, and SGLang 0.5.23 "
            f"has no MTP form of --model-path {model_path!r}'s architecture {target_arch!r} "
            "(ModelConfig._config_draft_model keeps it)"
        )
    return draft_arch


def check_nextn_runs_in_eagle_worker(view) -> None:
    """A draft that SGLang's NEXTN would not run in the EAGLE worker (0.5.23:
    a Gemma4 assistant, promoted to FROZEN_KV_MTP, FrozenKVMTPWorkerV2) is
    refused: EAGLE_TREE's worker is EAGLEWorkerV2. Asked of SGLang's own
    alias resolution."""
    from sglang.srt.arg_groups.speculative_hook import _resolve_speculative_algorithm_alias

    if view.speculative_draft_model_path is None:
        return
    nextn_as = _resolve_speculative_algorithm_alias(
        "NEXTN", view.speculative_draft_model_path, trust_remote_code=view.trust_remote_code,
        kwargs=draft_config_kwargs(view),
    )
    if nextn_as != "EAGLE":
        raise ValueError(
            f"{ALGORITHM_NAME}: --speculative-draft-model-path {view.speculative_draft_model_path!r} is a draft "
            f"SGLang 0.5.23 runs as --speculative-algorithm {nextn_as} "
            "(speculative_hook._resolve_speculative_algorithm_alias), in that algorithm's own worker, not the EAGLE "
            f"worker (EAGLEWorkerV2) {ALGORITHM_NAME} extends; use --speculative-algorithm NEXTN"
        )


# ------------------------------------------------------------ resolution


def handle_speculative_decoding_hook(server_args, previous):
    """Wraps SGLang's ``handle_speculative_decoding`` resolution step. For
    EAGLE_TREE our checks, the head's variant and our refusals come first
    (SGLang's step reads the head's config too but fails less clearly, and
    turns some refused options off); then the built-in step (it uppercases
    the name and runs the registry's callbacks), then what it applies to
    EAGLE."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    if cfg.speculative_algorithm is None or cfg.speculative_algorithm.upper() != ALGORITHM_NAME:
        flag = getattr(server_args, MASK_MODE_RECORD, None)
        if flag is not None:
            raise ValueError(
                f"{MASK_MODE_FLAG} {flag!r} applies to --speculative-algorithm {ALGORITHM_NAME} only "
                f"(got --speculative-algorithm {cfg.speculative_algorithm})"
            )
        previous(server_args)
        return
    check_flags_before_eagle_family(cfg)
    variant = resolve_head_variant(server_args)
    name_keyed_features.refuse_unsupported(cfg, variant)
    previous(server_args)
    resolve_eagle_tree(server_args, variant)


def resolve_head_variant(server_args) -> str:
    """EAGLE or EAGLE3 (the user's SPEC_PLUGINS_EAGLE_TREE_VARIANT, else the
    head's config; a DFlash block drafter, a target without an MTP form when
    no draft path is given, and a draft NEXTN would not run in the EAGLE
    worker are refused either way), recorded in the server args for every
    process SGLang hands them to. A path-less NEXTN / MTP draft is the
    target's MTP layer: EAGLE (it is no EAGLE-3 head)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    requested = requested_variant()
    view = resolving_view(server_args)
    draft_config = checked_draft_config(view, requested is not None)
    architectures = getattr(draft_config, "architectures", None) or []
    if view.speculative_draft_model_path is None:
        architectures = [check_mtp_target(draft_config, view.model_path)]
    check_nextn_runs_in_eagle_worker(view)
    variant = requested or detect_variant(architectures)
    setattr(server_args, VARIANT_RECORD, variant)
    return variant


def verify_attention_backend(view) -> str | None:
    """The backend that serves target verify (HybridAttnBackend's rule)."""
    from sglang.srt.arg_groups.model_override_base import attention_backends_of

    prefill, decode = attention_backends_of(view)
    if prefill == decode:
        return prefill
    return decode if getattr(view, "speculative_attention_mode", "prefill") == "decode" else prefill


def resolve_eagle_tree(server_args, variant: str) -> None:
    """EAGLE family defaults and validation plus ours; raises ValueError with
    the offending flag on a configuration that cannot serve."""
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.arg_groups.speculative_hook import _handle_eagle_family

    # --speculative-tree-mask-mode, else SPEC_PLUGINS_TREE_MASK_MODE: an unknown mode fails
    # before SGLang's own checks, naming the flag (or the variable) and the allowed values
    flag = getattr(server_args, MASK_MODE_RECORD, None)
    mask_mode_request = requested_mask_mode(flag=flag)

    _handle_eagle_family(server_args)

    view = resolved_view(server_args)
    backend = checked_verify_backend(view)
    mode = resolve_mask_mode(mask_mode_request, backend, mask_mode_source(flag))
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

    check_torch_backend_device(backend, view.device)  # spec_tree on CUDA: use spec_tree_triton
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
    check_decode_context_parallel_size(view.dcp_size, backend)
    check_kv_cache_layout_env(backend)


def check_kv_cache_layout_env(backend: str) -> None:
    """SGLANG_USE_HND_KVCACHE, read as SGLang's KV pool reads it (the scheduler
    processes inherit the variable), so a layout our verify cannot read fails
    here rather than at graph capture."""
    from sglang.srt.environ import envs

    if envs.SGLANG_USE_HND_KVCACHE.get():
        raise ValueError(kv_cache_layout_refusal(backend, "hnd"))


def declare_our_backend_settings(server_args, view, backend: str) -> None:
    """A draft attention backend of SGLang's (ours serves target verify only);
    with ``spec_tree`` CUDA graphs off (its torch verify path sizes each step's
    work by the host-side longest context, and torch_native has no graph
    state). ``spec_tree_triton`` keeps SGLang's graphs: the draft's decode and
    extend graphs run on SGLang's Triton backend, and TARGET_VERIFY is captured
    through our backend's graph entry points (``attention.TreeVerifyMixin``)."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    source = "spec_plugins.eagle_tree"
    if backend in GRAPHLESS_BACKENDS:
        logger.warning("%s: CUDA graphs are disabled with attention backend %r", ALGORITHM_NAME, backend)
        for phase in (Phase.DECODE, Phase.PREFILL):
            declare_resolution(
                server_args,
                source,
                cuda_graph_config=with_phase(
                    resolving_view(server_args).cuda_graph_config, phase, backend=Backend.DISABLED
                ),
            )
    if view.speculative_draft_attention_backend is None:
        draft_backend = "intel_amx" if str(view.device).startswith("cpu") else "triton"
        declare_resolution(server_args, source, speculative_draft_attention_backend=draft_backend)
        logger.info("%s: the draft head runs on attention backend %r", ALGORITHM_NAME, draft_backend)
