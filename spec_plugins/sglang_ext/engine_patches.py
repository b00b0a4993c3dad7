"""Every SGLang 0.5.23 seam the EAGLE_TREE plugin touches, in one place.

``SEAMS`` names each class or function we subclass, hook, register against or
call, with its file inside the ``sglang`` package of 0.5.23; ``check_seams``
resolves them all and is run by the version gate's callers (the worker at
startup, the tests), so a release that moved one fails loudly at startup
rather than mid-request.

The tree-pipeline functions are module-level calls inside SGLang's EAGLE
worker code (``EagleDraftWorker.draft_forward`` ->
``organize_draft_results``, ``build_eagle_verify_input`` ->
``build_tree_kernel_efficient``, ``eagle_sample`` ->
``verify_tree_greedy_func``, ``_finalize_accept_tree_path`` ->
``move_accept_tokens_to_target_kvcache``): a worker subclass cannot reach
them without copying those functions, so they are wrapped through SGLang's
``HookRegistry`` (AROUND hooks, applied by ``load_plugins``). Each wrapper
runs our op only while the EAGLE_TREE worker has activated it in this process
(``activate``); otherwise it calls SGLang's original, so EAGLE / EAGLE3 /
NGRAM in the same install are untouched.

Temperature > 0 (the sampled branch of ``eagle_sample``): its
``tree_speculative_sampling_target_only`` call is our
``verify_tree_sampling`` (exact target-only recursive rejection), on every
platform: ``_verify_uses_greedy`` no longer forces greedy verify on CPU/XPU,
and where SGLang resolved the sampling kernel or the top-k/top-p renorms to
None (CPU, XPU) ``eagle_utils``'s bindings are filled (``install_kernel_slots``)
rather than hooked. ``eagle_sample`` itself is wrapped to hand the request
seeds, seq_lens and min-p to our drop-in; relaxed accept thresholds are
refused (startup: ``algorithm``; runtime updates: ``_threshold_update_hook``).
Details next to ``verify_tree_sampling_sglang_layout``.

``--speculative-tree-mask-mode``: AROUND hooks on ``ServerArgs.add_cli_args``
(the flag on SGLang's parser) and ``ServerArgs.from_cli_args`` (its value
carried in the server args, ``config.MASK_MODE_RECORD``), active in every
process; validated by ``algorithm.resolve_eagle_tree``. The same value as an
``sglang.Engine`` keyword (``speculative_tree_mask_mode=``): Engine's
``server_args_class`` takes it (``install_engine_keyword``).

The layout translations (SGLang's lists, tuples and flat indices <-> our ops'
arrays) live in ``layout``; registration with SGLang in ``registration``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import pkgutil
from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from spec_tree_kernels import TreeMaskMode

from . import layout
from .config import ALGORITHM_NAME, TESTED_SGLANG

logger = logging.getLogger(__name__)


class Seam(NamedTuple):
    target: str  # dotted path resolvable with pkgutil.resolve_name
    file: str  # file inside the sglang package (0.5.23)
    use: str  # how we use it


SEAMS: tuple[Seam, ...] = (
    # registration
    Seam("sglang.srt.speculative.spec_info:SpeculativeAlgorithm.register", "srt/speculative/spec_info.py",
         "register EAGLE_TREE (worker factory, spec_class)"),
    Seam("sglang.srt.speculative.spec_info:SpeculativeAlgorithm.create_future_map", "srt/speculative/spec_info.py",
         "delegated to from our spec class (CustomSpecAlgo lacks it)"),
    Seam("sglang.srt.speculative.spec_info:SpeculativeAlgorithm.build_disagg_draft_input",
         "srt/speculative/spec_info.py", "delegated to from our spec class"),
    Seam("sglang.srt.speculative.spec_registry:CustomSpecAlgo", "srt/speculative/spec_registry.py",
         "subclassed: EagleTreeSpecAlgo"),
    Seam("sglang.srt.speculative.spec_registry:get_spec", "srt/speculative/spec_registry.py",
         "idempotent registration check"),
    Seam("sglang.srt.arg_groups.resolution_hooks:register_resolution_hook", "srt/arg_groups/resolution_hooks.py",
         "wrap the 'handle_speculative_decoding' step"),
    Seam("sglang.srt.arg_groups.speculative_hook:_handle_eagle_family", "srt/arg_groups/speculative_hook.py",
         "SGLang's EAGLE defaults and validation, applied to EAGLE_TREE"),
    Seam("sglang.srt.arg_groups.overrides:declare_resolution", "srt/arg_groups/overrides.py",
         "resolution writes (draft attention backend; CUDA graphs off with spec_tree)"),
    Seam("sglang.srt.arg_groups.overrides:resolving_view", "srt/arg_groups/overrides.py", "read the args"),
    Seam("sglang.srt.arg_groups.overrides:resolved_view", "srt/arg_groups/overrides.py", "read resolved args"),
    Seam("sglang.srt.arg_groups.model_override_base:attention_backends_of", "srt/arg_groups/model_override_base.py",
         "(prefill, decode) attention backends"),
    Seam("sglang.srt.model_executor.cuda_graph_config:with_phase", "srt/model_executor/cuda_graph_config.py",
         "disable CUDA graphs for spec_tree"),
    Seam("sglang.srt.utils.hf_transformers_utils:get_config", "srt/utils/hf_transformers_utils.py",
         "read the draft head's config (EAGLE vs EAGLE3; a DFlash block drafter is refused)"),
    Seam("sglang.srt.runtime_context:get_spec", "srt/runtime_context.py", "speculative config in workers"),
    Seam("sglang.srt.layers.attention.attention_registry:register_attention_backend",
         "srt/layers/attention/attention_registry.py", "register spec_tree / spec_tree_triton"),
    Seam("sglang.srt.arg_groups.choices:add_attention_backend_choices", "srt/arg_groups/choices.py",
         "--attention-backend choices"),
    Seam("sglang.srt.plugins.hook_registry:HookRegistry", "srt/plugins/hook_registry.py",
         "AROUND hooks on the functions below"),
    Seam("sglang.srt.server_args:ServerArgs.add_cli_args", "srt/server_args.py",
         "AROUND: add --speculative-tree-mask-mode to SGLang's parser"),
    Seam("sglang.srt.server_args:ServerArgs.from_cli_args", "srt/server_args.py",
         "AROUND: carry --speculative-tree-mask-mode in the server args (a bookkeeping attribute)"),
    Seam("sglang.srt.plugins:load_plugins", "srt/plugins/__init__.py",
         "AROUND: make speculative_tree_mask_mode an Engine keyword (Engine.server_args_class, "
         "srt/entrypoints/engine.py, replaced where that module is imported: install_engine_keyword)"),
    # the worker
    Seam("sglang.srt.speculative.eagle_worker_v2:EAGLEWorkerV2", "srt/speculative/eagle_worker_v2.py",
         "subclassed: EagleTreeWorker"),
    Seam("sglang.srt.speculative.eagle_worker_v2:EAGLEWorkerV2.init_attention_backends",
         "srt/speculative/eagle_worker_v2.py (BaseSpecWorker)", "overridden: set the draft worker's mask mode"),
    Seam("sglang.srt.speculative.eagle_worker_v2:EagleDraftWorker.draft_forward", "srt/speculative/eagle_worker_v2.py",
         "calls organize_draft_results (hooked)"),
    Seam("sglang.srt.speculative.eagle_worker_common:build_eagle_verify_input",
         "srt/speculative/eagle_worker_common.py", "calls build_tree_kernel_efficient (hooked) with verify_mask.mode"),
    Seam("sglang.srt.speculative.eagle_worker_common:_finalize_accept_tree_path",
         "srt/speculative/eagle_worker_common.py", "calls move_accept_tokens_to_target_kvcache (hooked)"),
    Seam("sglang.srt.speculative.eagle_utils:eagle_sample", "srt/speculative/eagle_utils.py",
         "calls verify_tree_greedy_func / tree_speculative_sampling_target_only (hooked); AROUND: verify context"),
    Seam("sglang.srt.speculative.eagle_utils:_verify_coins", "srt/speculative/eagle_utils.py",
         "the coins our sampled verify consumes (torch.rand, or murmur of sampling_seed)"),
    # the hooked functions
    Seam("sglang.srt.speculative.eagle_utils:organize_draft_results", "srt/speculative/eagle_utils.py",
         "AROUND: tie-safe closed selection"),
    Seam("sglang.srt.speculative.eagle_utils:build_tree_kernel_efficient", "srt/speculative/eagle_utils.py",
         "AROUND: our builder, every mask mode"),
    Seam("sglang.kernels.ops.speculative.spec_tree:verify_tree_greedy_func", "kernels/ops/speculative/spec_tree.py",
         "AROUND: our greedy verify"),
    Seam("sglang.srt.speculative.spec_utils:move_accept_tokens_to_target_kvcache", "srt/speculative/spec_utils.py",
         "AROUND: our accepted-path KV move"),
    # the sampled verify (temperature > 0)
    Seam("sglang.srt.speculative.eagle_utils:_verify_uses_greedy", "srt/speculative/eagle_utils.py",
         "AROUND: sampled verify on every platform (SGLang verifies greedily on CPU / XPU)"),
    Seam("sglang.kernels.ops.speculative.verify_sampling:tree_speculative_sampling_target_only",
         "kernels/ops/speculative/verify_sampling.py", "AROUND (filled where the platform has none): our sampled verify"),
    Seam("sglang.kernels.ops.speculative.sampling:tree_speculative_sampling_target_only",
         "kernels/ops/speculative/sampling.py", "the CUDA kernel's signature, which our drop-in takes"),
    Seam("sglang.srt.speculative.eagle_utils:tree_speculative_sampling_target_only", "srt/speculative/eagle_utils.py",
         "the binding eagle_sample calls"),
    Seam("sglang.srt.speculative.eagle_utils:top_k_renorm_prob", "srt/speculative/eagle_utils.py",
         "filled with a torch drop-in where the platform has none (CPU / XPU)"),
    Seam("sglang.srt.speculative.eagle_utils:top_p_renorm_prob", "srt/speculative/eagle_utils.py",
         "filled with a torch drop-in where the platform has none (CPU / XPU)"),
    Seam("sglang.kernels.ops.sampling.murmur_hash:murmur_hash32", "kernels/ops/sampling/murmur_hash.py",
         "the seeded final-draw exponentials (deterministic inference)"),
    Seam("sglang.srt.managers.scheduler_components.internal_state:SchedulerInternalStateController._validate_accept_threshold",
         "srt/managers/scheduler_components/internal_state.py", "AROUND: refuse relaxed accept thresholds at runtime"),
    Seam("sglang.srt.managers.scheduler_components.internal_state:UpdateRejected",
         "srt/managers/scheduler_components/internal_state.py", "how a runtime update is refused"),
    # the attention backend
    Seam("sglang.srt.layers.attention.torch_native_backend:TorchNativeAttnBackend",
         "srt/layers/attention/torch_native_backend.py", "parent of spec_tree"),
    Seam("sglang.srt.layers.attention.triton_backend:TritonAttnBackend", "srt/layers/attention/triton_backend.py",
         "parent of spec_tree_triton"),
    Seam("sglang.srt.layers.attention.base_attn_backend:AttentionBackend.verify_mask",
         "srt/layers/attention/base_attn_backend.py", "overridden: our VerifyMask"),
    # TARGET_VERIFY CUDA graphs (spec_tree_triton): what DecodeCudaGraphRunner calls on the backend
    Seam("sglang.srt.layers.attention.base_attn_backend:AttentionBackend.init_cuda_graph_state",
         "srt/layers/attention/base_attn_backend.py", "overridden: our static verify buffers"),
    Seam("sglang.srt.layers.attention.base_attn_backend:AttentionBackend.get_cuda_graph_seq_len_fill_value",
         "srt/layers/attention/base_attn_backend.py", "overridden: padded requests' length"),
    Seam("sglang.srt.layers.attention.base_attn_backend:AttentionBackend.init_forward_metadata_out_graph",
         "srt/layers/attention/base_attn_backend.py", "overridden: verify prep outside the graph (capture, replay)"),
    Seam("sglang.srt.layers.attention.base_attn_backend:AttentionBackend.init_forward_metadata_in_graph",
         "srt/layers/attention/base_attn_backend.py", "overridden: nothing recorded for verify"),
    Seam("sglang.srt.layers.attention.base_attn_backend:AttentionBackend.glue_target_verify_metadata",
         "srt/layers/attention/base_attn_backend.py", "overridden: our prep stays out of SGLang's glue graph"),
    Seam("sglang.srt.model_executor.runner.decode_cuda_graph_runner:build_replay_fb_view",
         "srt/model_executor/runner/decode_cuda_graph_runner.py", "the replay ForwardBatch view our prep reads"),
    Seam("sglang.srt.layers.attention.verify_mask:VerifyMask", "srt/layers/attention/verify_mask.py",
         "the verify-mask interface the worker reads"),
    Seam("sglang.srt.mem_cache.memory_pool:KVWriteLoc", "srt/mem_cache/memory_pool.py", "verify KV write"),
    Seam("sglang.srt.mem_cache.memory_pool:MHATokenToKVPool", "srt/mem_cache/memory_pool.py",
         "k_buffer / v_buffer [slots, H, D]: our KV move and verify attention read them"),
    Seam("sglang.srt.mem_cache.memory_pool:MHATokenToKVPool.is_quantized_kv_cache", "srt/mem_cache/memory_pool.py",
         "quantized pools keep SGLang's KV move"),
    # startup refusals (resolution hook, attention backend init)
    Seam("sglang.srt.runtime_context:attn_dp_enabled_of", "srt/runtime_context.py",
         "DP attention pads verify batches: refused with our backends"),
    Seam("sglang.srt.utils.common:require_mlp_sync", "srt/utils/common.py",
         "when SGLang pads verify batches (ForwardBatch.prepare_mlp_sync_batch)"),
    Seam("sglang.srt.runtime_context:get_exec", "srt/runtime_context.py", "two-batch overlap setting"),
    Seam("sglang.srt.layers.radix_attention:RadixAttention", "srt/layers/radix_attention.py",
         "logit_cap / sliding_window_size / is_cross_attention of the target's layers"),
    # NEXTN / MTP drafts (algorithm.check_mtp_target, check_nextn_runs_in_eagle_worker)
    Seam("sglang.srt.configs.model_config:ModelConfig._config_draft_model", "srt/configs/model_config.py",
         "the MTP architecture SGLang's draft worker loads a path-less (target) draft as; run on a copy"),
    Seam("sglang.srt.utils.hf_transformers_utils:get_hf_text_config", "srt/utils/hf_transformers/common.py",
         "the text config _config_draft_model reads"),
    Seam("sglang.srt.arg_groups.speculative_hook:_resolve_speculative_algorithm_alias",
         "srt/arg_groups/speculative_hook.py", "what SGLang runs a draft given to NEXTN as (EAGLE, or FROZEN_KV_MTP)"),
)

# HookRegistry targets (dotted, as HookRegistry.register wants them).
HOOK_ORGANIZE = "sglang.srt.speculative.eagle_utils.organize_draft_results"
HOOK_BUILD = "sglang.srt.speculative.eagle_utils.build_tree_kernel_efficient"
HOOK_VERIFY = "sglang.kernels.ops.speculative.spec_tree.verify_tree_greedy_func"
HOOK_MOVE_KV = "sglang.srt.speculative.spec_utils.move_accept_tokens_to_target_kvcache"
HOOK_SAMPLE_CONTEXT = "sglang.srt.speculative.eagle_utils.eagle_sample"
HOOK_USES_GREEDY = "sglang.srt.speculative.eagle_utils._verify_uses_greedy"
HOOK_THRESHOLD_UPDATE = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController._validate_accept_threshold"
)
HOOK_ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
HOOK_FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"
# Resolved per platform by SGLang, None where the platform has no kernel (CPU,
# XPU): hooked through HookRegistry where it is a function, else the binding
# eagle_sample calls is filled (``install_kernel_slots``).
HOOK_SAMPLE = "sglang.kernels.ops.speculative.verify_sampling.tree_speculative_sampling_target_only"


def check_seams() -> None:
    """Resolve every seam; raise one RuntimeError listing any that moved."""
    missing = []
    for seam in SEAMS:
        try:
            pkgutil.resolve_name(seam.target)
        except (ImportError, AttributeError, ValueError) as err:
            missing.append(f"{seam.target} ({seam.file}): {type(err).__name__}: {err}")
    if missing:
        raise RuntimeError(
            f"spec-plugins: SGLang does not have the internals the {ALGORITHM_NAME} plugin was written against "
            f"(tested: SGLang {', '.join(TESTED_SGLANG)}):\n  " + "\n  ".join(missing)
        )


# --------------------------------------------------------------- activation


# The spec_tree_kernels ops the hooks run, by the name ``resolve_impl`` knows them.
HOOKED_OPS = ("select", "build", "verify", "verify_sampling", "move_kv")


@dataclass(frozen=True)
class TreeRuntime:
    """What the hooks need; set by the EAGLE_TREE worker of this process.

    ``device`` (the worker's): each op's implementation is resolved once, here
    (``SPEC_TREE_KERNELS_IMPL`` read once), rather than by every op of every
    step. Without it the ops resolve ``impl`` per call (tests, tools)."""

    mask_mode: TreeMaskMode
    impl: str = "auto"  # spec_tree_kernels implementation ("auto": fastest for the device)
    device: Optional[str] = None
    impls: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        if self.device is not None and not self.impls:
            import torch

            from spec_tree_kernels import resolve_impl

            device = torch.device(self.device)
            self.impls.update({op: resolve_impl(op, self.impl, device) for op in HOOKED_OPS})

    def impl_for(self, op: str) -> str:
        return self.impls.get(op, self.impl)


_ACTIVE: Optional[TreeRuntime] = None


def activate(runtime: TreeRuntime) -> None:
    global _ACTIVE
    _ACTIVE = runtime


def deactivate() -> None:
    global _ACTIVE
    _ACTIVE = None


def active() -> Optional[TreeRuntime]:
    return _ACTIVE


@contextlib.contextmanager
def activated(runtime: TreeRuntime):
    """Activate the hooks for a block (tests, tools)."""
    previous = _ACTIVE
    activate(runtime)
    try:
        yield runtime
    finally:
        globals()["_ACTIVE"] = previous


# -------------------------------------------------------------- the hooks


def _drop_in_hook(ours, op: str):
    """An AROUND hook running ``ours`` (SGLang's arguments plus the active
    runtime's implementation of ``op``) while EAGLE_TREE is active, else
    SGLang's original."""

    def hook(original, *args, **kwargs):
        rt = _ACTIVE
        if rt is None:
            return original(*args, **kwargs)
        return ours(*args, **kwargs, impl=rt.impl_for(op))

    hook.__name__ = f"hook_{ours.__name__}"
    return hook


_organize_hook = _drop_in_hook(layout.organize_draft_results_closed, "select")
_build_hook = _drop_in_hook(layout.build_tree_sglang_layout, "build")
_verify_hook = _drop_in_hook(layout.verify_tree_greedy_sglang_layout, "verify")
_sample_hook = _drop_in_hook(layout.verify_tree_sampling_sglang_layout, "verify_sampling")


def _sample_context_hook(original, *args, **kwargs):
    """Around ``eagle_sample(verify_input, batch, ...)``: publish what the
    sampling drop-in needs."""
    if _ACTIVE is None:
        return original(*args, **kwargs)
    batch = args[1] if len(args) > 1 else kwargs["batch"]
    with layout.verify_context(batch):
        return original(*args, **kwargs)


@functools.lru_cache(maxsize=None)
def _signature(function) -> inspect.Signature:
    return inspect.signature(function)


def _uses_greedy_hook(original, *args, **kwargs):
    """SGLang verifies sampled batches greedily where it has no sampling
    kernel (CPU, XPU; HIP without rejection sampling); ours runs everywhere."""
    if _ACTIVE is None:
        return original(*args, **kwargs)
    # SGLang 0.5.23's parameters are keyword-only: read them; bind only a positional call
    arguments = _signature(original).bind(*args, **kwargs).arguments if args else kwargs
    if arguments.get("use_rejection_sampling"):  # SGLang's chain sampler, not ours (refused for EAGLE_TREE)
        return original(*args, **kwargs)
    return bool(arguments["is_all_greedy"])


def _threshold_update_hook(original, controller, key, value):
    """Refuse ``speculative_accept_threshold_*`` updates != 1 in our process."""
    if _ACTIVE is not None and float(value) != 1.0:
        from sglang.srt.managers.scheduler_components.internal_state import UpdateRejected

        raise UpdateRejected(
            f"{ALGORITHM_NAME}: updating {key} to {value} is rejected: relaxed acceptance is lossy and "
            "EAGLE_TREE verifies exactly (thresholds stay 1.0)"
        )
    return original(controller, key, value)


def _add_cli_args_hook(original, parser):
    """SGLang's parser, plus ``--speculative-tree-mask-mode`` (a string: it is
    validated where the server arguments are resolved, with the other
    speculative flags, by ``algorithm.resolve_eagle_tree``). In every process,
    whether or not EAGLE_TREE is active: the flag exists wherever SGLang parses."""
    from .config import MASK_MODE_DEST, MASK_MODE_ENV, MASK_MODE_FLAG, OUR_BACKEND_MODES, SERVABLE_MASK_MODES

    result = original(parser)
    if MASK_MODE_FLAG not in parser._option_string_actions:
        parser.add_argument(
            MASK_MODE_FLAG,
            dest=MASK_MODE_DEST,
            type=str,
            default=None,
            help=(
                f"{ALGORITHM_NAME} (spec-plugins): the tree mask layout the verify pass builds, "
                f"{', '.join(m.name for m in SERVABLE_MASK_MODES)} (name, any case, or number); unset: what the "
                f"verify attention backend reads ({', '.join(m.name for m in OUR_BACKEND_MODES)} for spec_tree*). "
                f"Wins over ${MASK_MODE_ENV}."
            ),
        )
    return result


def _from_cli_args_hook(original, cls, args):
    """SGLang's ServerArgs of the parsed arguments, carrying the flag's value
    (ServerArgs has no field of ours: a bookkeeping attribute, which SGLang
    pickles with the record to its processes)."""
    from .config import MASK_MODE_DEST, MASK_MODE_RECORD

    server_args = original(cls, args)
    value = getattr(args, MASK_MODE_DEST, None)
    if value is not None:
        setattr(server_args, MASK_MODE_RECORD, value)
    return server_args


# ------------------------------------ --speculative-tree-mask-mode as an Engine keyword

ENGINE_MODULE = "sglang.srt.entrypoints.engine"
HOOK_LOAD_PLUGINS = "sglang.srt.plugins.load_plugins"


def mask_mode_record_value(value) -> str:
    """What the server args record for a mask mode given as a keyword: the
    flag's text (a mode member by its name, a number or a name as given);
    validated where the server arguments are resolved, as the flag is."""
    return value.name if isinstance(value, TreeMaskMode) else str(value)


def engine_server_args_class(base):
    """``base`` (SGLang's ServerArgs) as ``sglang.Engine`` builds it from its
    keywords (``self.server_args_class(**kwargs)``), also taking
    ``speculative_tree_mask_mode``. ServerArgs is a msgspec Struct whose
    fields are fixed when SGLang imports it, so a plugin cannot add one; this
    subclass's metaclass takes the keyword off, builds ``base`` itself (the
    record SGLang pickles to its processes stays its own class) and records
    the value where the CLI hook records the flag (``MASK_MODE_RECORD``)."""
    from .config import MASK_MODE_DEST, MASK_MODE_RECORD

    class TakesTreeMaskMode(type(base)):
        def __call__(cls, *args, **kwargs):
            value = kwargs.pop(MASK_MODE_DEST, None)
            server_args = base(*args, **kwargs)
            if value is not None:
                setattr(server_args, MASK_MODE_RECORD, mask_mode_record_value(value))
            return server_args

    subclass = TakesTreeMaskMode(base.__name__, (base,), {"__module__": base.__module__})
    subclass.spec_plugins_base = base
    return subclass


def install_engine_keyword() -> bool:
    """Let ``sglang.Engine(speculative_tree_mask_mode=...)`` through, as
    every other speculative flag is an Engine keyword: Engine's
    ``server_args_class`` becomes ``engine_server_args_class`` of it. Only
    where SGLang's Engine module is already imported: importing it here would
    load the tokenizer manager and HTTP stack into every scheduler process;
    ``Engine.__init__`` calls ``load_plugins`` before it builds its
    ServerArgs, and that call installs it (``_load_plugins_hook``)."""
    import sys

    module = sys.modules.get(ENGINE_MODULE)
    engine = getattr(module, "Engine", None)
    if engine is None:
        return False
    current = engine.server_args_class
    if not hasattr(current, "spec_plugins_base"):
        engine.server_args_class = engine_server_args_class(current)
    return True


def _load_plugins_hook(original, *args, **kwargs):
    """``load_plugins`` runs our ``register`` once per process; an Engine
    built after that (its module imported later) calls it again, a no-op for
    the plugins, before it builds its ServerArgs: the keyword is installed then."""
    result = original(*args, **kwargs)
    install_engine_keyword()
    return result


def _missing_kernel(name: str):
    def missing(*args, **kwargs):
        raise TypeError(f"SGLang has no {name} kernel on this platform ({name} is None)")

    missing.__name__ = name
    return missing


class KernelSlot:
    """Fills a binding SGLang left None (the platform has no kernel): our
    hook, with an ``original`` that fails as calling None would."""

    def __init__(self, name: str, hook):
        self.name, self.hook = name, hook
        self.original = _missing_kernel(name)
        self.__wrapped__ = None  # what SGLang had

    def __call__(self, *args, **kwargs):
        return self.hook(self.original, *args, **kwargs)

    def __repr__(self):
        return f"<{ALGORITHM_NAME} slot for {self.name}>"


def _renorm_hook(ours):
    def hook(original, probs, value):
        if _ACTIVE is None:
            return original(probs, value)
        return ours(probs, value)

    return hook


_top_k_renorm_hook = _renorm_hook(layout.top_k_renorm_prob_torch)
_top_p_renorm_hook = _renorm_hook(layout.top_p_renorm_prob_torch)

# eagle_utils bindings filled where SGLang 0.5.23 leaves them None.
SLOTS = (
    ("tree_speculative_sampling_target_only", _sample_hook),
    ("top_k_renorm_prob", _top_k_renorm_hook),
    ("top_p_renorm_prob", _top_p_renorm_hook),
)
SLOT_MODULE = "sglang.srt.speculative.eagle_utils"


def install_kernel_slots() -> list[str]:
    """Fill the None bindings of ``SLOTS`` in ``eagle_utils`` (only there: a
    HookRegistry hook on a None target would be propagated to every module
    global that is None, and other modules test these names for None)."""
    import importlib

    module = importlib.import_module(SLOT_MODULE)
    filled = []
    for name, hook in SLOTS:
        if getattr(module, name) is None:
            setattr(module, name, KernelSlot(name, hook))
            filled.append(name)
    return filled


def _sglang_has_sampling_kernel() -> bool:
    return pkgutil.resolve_name(HOOK_SAMPLE) is not None


def _move_hook(original, batch, accept_index, num_correct_drafts, token_to_kv_pool_allocator):
    rt = _ACTIVE
    if rt is None:
        return original(batch, accept_index, num_correct_drafts, token_to_kv_pool_allocator)
    return layout.move_accepted_kv_sglang_layout(
        batch, accept_index, num_correct_drafts, token_to_kv_pool_allocator, impl=rt.impl_for("move_kv"),
        fallback=original,
    )


HOOKS = (
    (HOOK_ORGANIZE, _organize_hook),
    (HOOK_BUILD, _build_hook),
    (HOOK_VERIFY, _verify_hook),
    (HOOK_MOVE_KV, _move_hook),
    (HOOK_SAMPLE_CONTEXT, _sample_context_hook),
    (HOOK_USES_GREEDY, _uses_greedy_hook),
    (HOOK_THRESHOLD_UPDATE, _threshold_update_hook),
    (HOOK_ADD_CLI_ARGS, _add_cli_args_hook),
    (HOOK_FROM_CLI_ARGS, _from_cli_args_hook),
    (HOOK_LOAD_PLUGINS, _load_plugins_hook),
)


def registry_hooks() -> tuple:
    """HOOKS, plus the sampling kernel where SGLang has one for this platform."""
    return HOOKS + (((HOOK_SAMPLE, _sample_hook),) if _sglang_has_sampling_kernel() else ())


def ensure_hooks_applied() -> None:
    """Apply the registered hooks if ``load_plugins`` has not (register()
    called by hand); HookRegistry skips targets it already patched."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    hooks = registry_hooks()
    if any(target not in HookRegistry._patched for target, _ in hooks):
        HookRegistry.apply_hooks()
    missing = [target for target, _ in hooks if target not in HookRegistry._patched]
    if missing:
        raise RuntimeError(f"{ALGORITHM_NAME}: SGLang's HookRegistry did not apply hooks to {missing}")
    filled = install_kernel_slots()
    if filled:
        logger.info("%s: SGLang has no %s on this platform; ours serve the sampled verify", ALGORITHM_NAME,
                    ", ".join(filled))
