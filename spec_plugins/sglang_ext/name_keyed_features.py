"""SGLang 0.5.23's code keyed on the literal algorithm names EAGLE / EAGLE3,
and what each such site means for EAGLE_TREE.

EAGLE_TREE is a plugin algorithm (``CustomSpecAlgo``); SGLang branches on
``is_eagle()`` / ``is_eagle3()`` reach it (it answers True / per head,
``algorithm.EagleTreeSpecAlgo``), but a comparison with the names does not:
``cfg.speculative_algorithm in ("EAGLE", "EAGLE3")`` or
``spec_algorithm == SpeculativeAlgorithm.EAGLE`` is False for it.

``SITES`` lists every such site in SGLang's ``srt`` sources, keyed by
(file under ``sglang/srt``, scope: the enclosing ``Class.function``, or for
module-level code the assigned name). ``tests/sglang/test_name_keyed_features.py``
finds the sites with ``ast`` and fails on a site missing here or an entry
SGLang no longer has. A site is a string constant equal to EAGLE or EAGLE3 in
any case (docstrings excepted) or an attribute named EAGLE or EAGLE3
(``SpeculativeAlgorithm`` members). Calls of ``is_eagle()`` / ``is_eagle3()``
are not sites: they include EAGLE_TREE.

Each feature a site gates gets one verdict:

``GETS``            EAGLE_TREE gets it anyway (the note says how);
``REFUSED``         we refuse it at startup (``refuse_unsupported``, called by the
                    resolution hook), naming the option: a user can turn it on,
                    and SGLang would skip it for EAGLE_TREE, warn, or only assert;
``SGLANG_REFUSES``  SGLang raises for any algorithm but the named ones, so
                    EAGLE_TREE with it fails at startup with SGLang's message;
``ABSENT``          not applied to EAGLE_TREE; the note says what that costs;
``UNRELATED``       the literal does not select on the running algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from .config import ALGORITHM_NAME

GETS = "gets"
REFUSED = "refused"
SGLANG_REFUSES = "sglang refuses"
ABSENT = "absent"
UNRELATED = "unrelated"
VERDICTS = (GETS, REFUSED, SGLANG_REFUSES, ABSENT, UNRELATED)


@dataclass(frozen=True)
class Refusal:
    """``option`` (the flag as typed) is refused when ``applies(value of
    field, head variant)``."""

    option: str
    field: str
    applies: Callable[[Any, str], bool]


@dataclass(frozen=True)
class Feature:
    name: str
    verdict: str
    note: str
    refusal: Optional[Refusal] = None


@dataclass(frozen=True)
class Site:
    file: str
    scope: str
    features: tuple[Feature, ...]


def _on(value, variant) -> bool:
    return bool(value)


# why three model overrides that default to multi-layer EAGLE do not apply
SINGLE_LAYER_DRAFT = "EAGLE_TREE drafts single-layer (it refuses --enable-multi-layer-eagle)"
SITES = (
    # --- the algorithm itself
    Site("speculative/spec_info.py", "SpeculativeAlgorithm.is_eagle", (
        Feature("EAGLE family routing", GETS, "EagleTreeSpecAlgo.is_eagle answers True"),)),
    Site("speculative/spec_info.py", "SpeculativeAlgorithm.is_eagle3", (
        Feature("EAGLE-3 aux hidden states", GETS, "EagleTreeSpecAlgo.is_eagle3 answers per head (resolved variant)"),)),
    Site("speculative/spec_info.py", "SpeculativeAlgorithm.supports_mixed_chunk", (
        Feature("mixed chunked prefill", GETS, "EagleTreeSpecAlgo.supports_mixed_chunk answers True"),)),
    Site("speculative/spec_info.py", "SpeculativeAlgorithm.from_string", (
        Feature("NEXTN alias", UNRELATED,
                "maps the NEXTN alias to EAGLE; EAGLE_TREE comes from the plugin registry, and serves NEXTN's MTP "
                "drafts in the same EAGLE worker (algorithm.check_mtp_target; docs/sglang.md, NEXTN / MTP drafts)"),)),
    # --- startup resolution
    Site("arg_groups/speculative_hook.py", "handle_speculative_decoding", (
        Feature("--disaggregation-decode-enable-radix-cache", SGLANG_REFUSES, "ValueError for other algorithms"),
        Feature("--speculative-use-block-verification", SGLANG_REFUSES, "ValueError for other algorithms"),
        Feature("--speculative-draft-window-size", GETS,
                "its consumers read the field, not the name (spec_utils.resolve_draft_decode_window, "
                "llama_eagle3), so it applies as for EAGLE; SGLang's warning that it has no effect is wrong here"),
        Feature("SGLANG_ENABLE_DP_SPEC_PREFILL_COORDINATION", SGLANG_REFUSES, "ValueError for other algorithms"),
    )),
    Site("arg_groups/speculative_hook.py", "_handle_eagle_family", (
        Feature("--speculative-use-rejection-sampling", SGLANG_REFUSES,
                "NotImplementedError for other algorithms; EAGLE_TREE verifies sampled batches with its own "
                "exact sampler"),)),
    Site("arg_groups/speculative_hook.py", "_resolve_speculative_algorithm_alias", (
        Feature("Gemma4 assistant drafts promoted to FROZEN_KV_MTP", ABSENT,
                "EAGLE_TREE is never promoted: it runs the EAGLE worker, so a draft SGLang would promote is "
                "refused at startup (algorithm.check_nextn_runs_in_eagle_worker)"),)),
    Site("arg_groups/speculative_hook.py", "_should_auto_enable_hip_rejection_sampling", (
        Feature("rejection sampling on by default on HIP", ABSENT,
                "EAGLE_TREE keeps its own exact sampled verify (SGLang's rejection sampler is refused for it)"),)),
    Site("speculative/adaptive_spec_params.py", "adaptive_unsupported_reason", (
        Feature("adaptive speculation", REFUSED,
                "SGLang would only warn and turn it off; its controller varies the steps of a chain (topk 1), "
                "the tree's buffers and masks are sized once",
                Refusal("--speculative-adaptive", "speculative_adaptive", _on)),)),
    Site("arg_groups/validation_hook.py", "check_pipeline_parallel_compat", (
        Feature("pipeline parallelism", REFUSED,
                "SGLang only asserts EAGLE (gone under python -O); EAGLE_TREE is neither built nor tested for "
                "pipeline stages",
                Refusal("--pp-size", "pp_size", lambda value, variant: (value or 1) > 1)),)),
    Site("arg_groups/validation_hook.py", "check_watermark_server_args", (
        Feature("--enable-watermark", SGLANG_REFUSES, "ValueError for other algorithms"),)),
    Site("arg_groups/validation_hook.py", "_AUX_HIDDEN_STATE_CAPTURE_METHODS", (
        Feature("--enable-return-aux-hidden-states", SGLANG_REFUSES,
                "ValueError unless --speculative-algorithm names EAGLE3, DFLASH or DSPARK (a capture convention, "
                "with speculative decoding off)"),)),
    Site("arg_groups/validation_hook.py", "handle_aux_hidden_state_capture", (
        Feature("--enable-return-aux-hidden-states layer ids", SGLANG_REFUSES,
                "reached only past the check on _AUX_HIDDEN_STATE_CAPTURE_METHODS"),)),
    Site("arg_groups/lora_hook.py", "check_lora_speculative_compatibility", (
        Feature("LoRA", SGLANG_REFUSES, "ValueError: LoRA is only compatible with the named algorithms"),)),
    Site("arg_groups/kv_cache_hook.py", "handle_unified_memory_pool", (
        Feature("unified memory", REFUSED,
                "SGLang only asserts the algorithm names (gone under python -O), and the unified pool's "
                "page-granular KV move cannot express tree verify",
                Refusal("--enable-unified-memory", "enable_unified_memory", _on)),)),
    Site("arg_groups/kv_cache_hook.py", "handle_kv4_compatibility", (
        Feature("SM100 native NVFP4 KV cache", SGLANG_REFUSES, "ValueError for other algorithms"),)),
    Site("arg_groups/kv_shard_hook.py", "handle_kv_cache_sharding", (
        Feature("--enable-kv-cache-sharding", SGLANG_REFUSES, "ValueError unless EAGLE MTP on GLM DSA"),)),
    Site("arg_groups/cp_tp_group_sharing_hook.py", "resolve_cp_tp_group_sharing", (
        Feature("CP-TP group sharing", SGLANG_REFUSES, "ValueError unless DFLASH or native MTP"),)),
    # --- model-specific resolution
    Site("arg_groups/deepseek_v4_hook.py", "apply_deepseek_v4_defaults", (
        Feature("DeepSeek V4 targets", SGLANG_REFUSES, "asserts EAGLE or DSPARK"),)),
    Site("arg_groups/model_overrides/iquest_q1.py", "_iquest_q1_overrides", (
        Feature("IQuest Q1 targets", SGLANG_REFUSES, "ValueError unless EAGLE or NEXTN"),)),
    Site("arg_groups/model_overrides/gigachat35.py", "_gigachat35_overrides", (
        Feature("multi-layer EAGLE by default for GigaChat 3.5", ABSENT,
                SINGLE_LAYER_DRAFT),)),
    Site("arg_groups/model_overrides/mimo_v2.py", "_mimo_v2_overrides", (
        Feature("multi-layer EAGLE by default for MiMo V2", ABSENT,
                SINGLE_LAYER_DRAFT),)),
    Site("arg_groups/overrides.py", "_step3p_overrides", (
        Feature("multi-layer EAGLE by default for Step3p5", ABSENT,
                SINGLE_LAYER_DRAFT),)),
    Site("arg_groups/model_overrides/nemotron_h.py", "_nemotron_h_overrides", (
        Feature("Nemotron-H draft attention backend default", ABSENT,
                "the draft runs on the target's backend (ours: triton / intel_amx) unless "
                "--speculative-draft-attention-backend says otherwise"),)),
    Site("arg_groups/overrides.py", "_deepseek_spec_moe_resolution", (
        Feature("DeepSeek FP4 draft MoE backends on HIP", ABSENT,
                "set --speculative-moe-runner-backend / --speculative-moe-a2a-backend yourself"),)),
    # --- runtime
    Site("managers/scheduler_components/metrics_reporter.py", "_SPEC_DECODE_SNAPSHOT_ALGORITHMS", (
        Feature("forward-pass metrics snapshot of speculative decode batches", ABSENT,
                "with --enable-forward-pass-metrics, EAGLE_TREE decode batches report the decode KV counts "
                "SGLang takes from the batch after the step, not the snapshot before it"),)),
    Site("layers/attention/attention_registry.py", "create_flashinfer_backend", (
        Feature("FlashInfer plan stream", ABSENT,
                "no effect: nothing in SGLang 0.5.23 reads runner.plan_stream_for_flashinfer (EAGLE3 lacks it "
                "too)"),)),
    Site("layers/layer_boundary/adapters/attention.py", "AttnTpContext.init_context", (
        Feature("input-scattered attention TP, off for EAGLE-3", REFUSED,
                "SGLang turns it off for EAGLE3 by name; with an EAGLE-3 head EAGLE_TREE would keep it on",
                Refusal("--enable-attn-tp-input-scattered", "enable_attn_tp_input_scattered",
                        lambda value, variant: bool(value) and variant == "EAGLE3")),)),
    Site("kernel_plugins/amd/binding.py", "_PROBES", (
        Feature("AMD monokernels (EAGLE-3 hidden states probe)", REFUSED,
                "the probe misses EAGLE_TREE's EAGLE-3 heads, and a monokernel verify step would bypass our "
                "tree verify",
                Refusal("--enable-amd-monokernel", "enable_amd_monokernel", _on)),)),
    Site("lora/utils.py", "warn_if_adapter_targets_embeddings", (
        Feature("LoRA embedding warning", SGLANG_REFUSES, "LoRA itself is refused (lora_hook)"),)),
    Site("mem_cache/kv_cache_configurator.py", "KVCacheConfigurator._build_mtp_kv_shard_pool", (
        Feature("KV sharding MTP draft pool", SGLANG_REFUSES, "KV sharding is refused at startup (kv_shard_hook)"),)),
    Site("mem_cache/page_interleave.py", "compute_page_shard_scratch_bytes", (
        Feature("KV sharding MTP scratch", SGLANG_REFUSES, "KV sharding is refused at startup (kv_shard_hook)"),)),
    # --- not the running algorithm
    Site("model_executor/model_runner_components/spec_aux_hidden_state.py", "_resolve_capture_only_aux_hidden_state", (
        Feature("capture-only aux hidden states", UNRELATED,
                "the capture convention's name, used only without speculative decoding"),)),
    Site("speculative/pp_draft_embedding.py", "_DRAFT_SUBMODULE_MARKERS", (
        Feature("draft submodule name markers", UNRELATED, "parameter-name substrings"),)),
    Site("utils/hf_transformers/mistral_utils.py", "adapt_config_dict", (
        Feature("Mistral EAGLE checkpoint names", UNRELATED, "a model name containing 'eagle'"),)),
    Site("utils/hf_transformers/mistral_utils.py", "is_mistral_model", (
        Feature("Mistral EAGLE checkpoint names", UNRELATED, "a model name containing 'eagle'"),)),
)  # fmt: skip


def refused_features() -> list[Feature]:
    return [feature for site in SITES for feature in site.features if feature.refusal is not None]


def refuse_unsupported(cfg, variant: str) -> None:
    """ValueError naming the option of a ``REFUSED`` feature that is on.
    ``cfg``: the server args before SGLang's speculative step, which turns
    some of these off (for EAGLE_TREE silently)."""
    for feature in refused_features():
        refusal = feature.refusal
        value = getattr(cfg, refusal.field)
        if refusal.applies(value, variant):
            shown = refusal.option if isinstance(value, bool) else f"{refusal.option} {value}"
            raise ValueError(f"{ALGORITHM_NAME} ({variant} head) does not support {shown}: {feature.note}")
