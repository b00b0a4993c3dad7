"""EAGLE_TREE configuration: names, environment knobs, startup validation.

Pure Python plus ``spec_tree_kernels``: nothing here imports SGLang, so the
rules can be read (and unit-tested) without the engine.

User-facing knobs (all read at startup; the scheduler processes inherit them):

``--speculative-tree-mask-mode`` (server flag), else ``SPEC_PLUGINS_TREE_MASK_MODE``
    Tree-mask layout the worker builds for the verify pass:
    ``SERVABLE_MASK_MODES`` (FULL_MASK, QLEN_ONLY, ANCESTOR_BITMASK or
    PARENT_POINTER; name, any case, or the integer value). The flag wins
    over the variable. Neither: the layout the target attention backend reads (ANCESTOR_BITMASK for ours,
    SGLang's own default for SGLang's backends). The flag is added to SGLang's
    parser by hooks on ``ServerArgs.add_cli_args`` / ``from_cli_args``
    (``engine_patches``) and carried in the server args (``MASK_MODE_RECORD``)
    to every process; ``sglang.Engine`` takes it as the keyword
    ``speculative_tree_mask_mode`` (``engine_patches.install_engine_keyword``).
``SPEC_PLUGINS_EAGLE_TREE_VARIANT``
    EAGLE or EAGLE3. Unset: detected from the draft head's config
    (``architectures`` naming ``Eagle3``). Either way decided once, where the
    server arguments are resolved, and carried in them to every process
    (``algorithm.resolve_head_variant``). Only the user sets it: a value the
    plugin wrote to the environment would leak into the next Engine of the
    process.
"""

from __future__ import annotations

import os
from typing import Iterable, Mapping, Optional

from spec_tree_kernels import TreeMaskMode, TreeShape, parse_mask_mode
from spec_tree_kernels.head_kinds import SGLANG_ALGORITHMS, head_kind_of_architectures
from spec_tree_kernels.modes import DEFAULT_TREE_ATTENTION_MODE, MAX_TREE_NODES, TREE_ATTENTION_MODES, max_nodes

TESTED_SGLANG = ("0.5.23",)  # releases whose internals engine_patches.SEAMS was read from
ALGORITHM_NAME = "EAGLE_TREE"
MASK_MODE_ENV = "SPEC_PLUGINS_TREE_MASK_MODE"
MASK_MODE_FLAG = "--speculative-tree-mask-mode"
MASK_MODE_DEST = "speculative_tree_mask_mode"  # the flag's argparse destination
# A bookkeeping attribute of ServerArgs (underscore, not a field: SGLang's
# ServerArgs has no field of ours; it pickles these with the record to its
# processes): the flag's raw value, None when not given.
MASK_MODE_RECORD = "_spec_plugins_tree_mask_mode"
VARIANT_ENV = "SPEC_PLUGINS_EAGLE_TREE_VARIANT"
VARIANTS = SGLANG_ALGORITHMS  # ("EAGLE", "EAGLE3")

# Our attention backends (attention.py): torch_native prefill/decode, or
# SGLang's Triton prefill/decode; target verify is ours in both.
BACKEND_TORCH = "spec_tree"
BACKEND_TRITON = "spec_tree_triton"
OUR_BACKENDS = (BACKEND_TORCH, BACKEND_TRITON)
# Ours with CUDA graphs off: spec_tree's torch verify is not capturable (it
# sizes each step by the host-side longest context). spec_tree_triton keeps
# SGLang's draft graphs and captures TARGET_VERIFY with our Triton plan.
GRAPHLESS_BACKENDS = (BACKEND_TORCH,)
# What our verify attention (spec_tree_kernels.tree_attention) reads: the
# kernel module's table of mask modes.
OUR_BACKEND_MODES = TREE_ATTENTION_MODES
OUR_BACKEND_DEFAULT_MODE = DEFAULT_TREE_ATTENTION_MODE


def _parse_requested(raw: str, source: str) -> TreeMaskMode:
    try:
        return parse_mask_mode(int(raw) if raw.lstrip("-").isdigit() else raw)
    except ValueError:
        given = f"{source}={raw!r}" if source == MASK_MODE_ENV else f"{source} {raw!r}"
        names = ", ".join(m.name for m in SERVABLE_MASK_MODES)
        message = f"{ALGORITHM_NAME}: {given}: unknown tree mask mode {raw!r}; expected one of: {names}"
        raise ValueError(message) from None


def mask_mode_source(flag: Optional[str] = None) -> str:
    """Where the requested mode comes from, as errors name it."""
    return MASK_MODE_FLAG if flag is not None and str(flag).strip() else MASK_MODE_ENV


def requested_mask_mode(environ: Mapping[str, str] = os.environ, flag: Optional[str] = None) -> Optional[TreeMaskMode]:
    """The mode named by ``--speculative-tree-mask-mode`` (``flag``: its value,
    None when not given), else by ``SPEC_PLUGINS_TREE_MASK_MODE``; None when
    neither is set. ValueError naming the flag (or the variable) and the
    allowed values for an unknown mode."""
    if flag is not None and str(flag).strip():
        return _parse_requested(str(flag).strip(), MASK_MODE_FLAG)
    raw = environ.get(MASK_MODE_ENV, "").strip()
    if not raw:
        return None
    return _parse_requested(raw, MASK_MODE_ENV)


# SGLang 0.5.23's verify backends and the layout each reads: intel_amx (the
# CPU kernel) takes QLEN_ONLY; flashinfer, triton, fa3, aiter, wave, ... build
# their verify masks from FULL_MASK (``eagle_utils.default_tree_mask_mode``).
# QLEN_ONLY_BITPACKING has no attention consumer in SGLang 0.5.23.
SGLANG_QLEN_ONLY_BACKENDS = ("intel_amx",)


def sglang_backend_mode(verify_backend: Optional[str]) -> TreeMaskMode:
    """The layout one of SGLang's own attention backends reads."""
    return TreeMaskMode.QLEN_ONLY if verify_backend in SGLANG_QLEN_ONLY_BACKENDS else TreeMaskMode.FULL_MASK


def readable_modes(verify_backend: Optional[str]) -> tuple[TreeMaskMode, ...]:
    if verify_backend in OUR_BACKENDS:
        return OUR_BACKEND_MODES
    return (sglang_backend_mode(verify_backend),)


# What the flag offers: the modes some verify backend reads. QLEN_ONLY_BITPACKING
# is not among them (no reader in 0.5.23): asking for it fails at startup,
# naming the flag or variable and what the backend reads.
SERVABLE_MASK_MODES = tuple(
    m for m in TreeMaskMode
    if any(m in readable_modes(b) for b in (*OUR_BACKENDS, None, *SGLANG_QLEN_ONLY_BACKENDS))
)  # fmt: skip


def resolve_mask_mode(
    requested: Optional[TreeMaskMode], verify_backend: Optional[str], source: str = MASK_MODE_ENV
) -> TreeMaskMode:
    """The mode to build: the requested one if the verify backend reads it
    (else ValueError naming ``source``, the flag or variable that asked for
    it, and what the backend reads), or the backend's default."""
    allowed = readable_modes(verify_backend)
    if requested is None:
        return OUR_BACKEND_DEFAULT_MODE if verify_backend in OUR_BACKENDS else allowed[0]
    if requested not in allowed:
        hint = (
            f"; ANCESTOR_BITMASK and PARENT_POINTER need --attention-backend {BACKEND_TORCH} or {BACKEND_TRITON}"
            if verify_backend not in OUR_BACKENDS
            else ""
        )
        raise ValueError(
            f"{source}{'=' if source == MASK_MODE_ENV else ' '}{requested.name}: attention backend {verify_backend!r} cannot read this tree mask; "
            f"it reads {', '.join(m.name for m in allowed)}{hint}"
        )
    return requested


# Device types on which ``spec_tree`` (the torch verify) is refused: its torch
# path materialises fp32 scores of [batch, heads, T, context] per layer (about
# 1.6 GB a layer at batch 48 x 8k context), a size SGLang's memory profile does
# not see; ``spec_tree_triton`` serves those devices with split-KV kernels.
TORCH_BACKEND_REFUSED_DEVICES = ("cuda",)


def device_type(device) -> str:
    """``"cuda"`` for ``cuda``, ``cuda:1``, ``torch.device("cuda", 0)``; ``""`` for None."""
    if device is None:
        return ""
    return str(getattr(device, "type", device)).split(":", 1)[0].lower()


def check_torch_backend_device(backend: Optional[str], device) -> None:
    """Refuse ``spec_tree`` on CUDA, naming ``spec_tree_triton`` (ValueError).
    ``device``: the server's device (``--device``, as SGLang resolved it) or the
    model runner's; a string or ``torch.device``."""
    kind = device_type(device)
    if backend == BACKEND_TORCH and kind in TORCH_BACKEND_REFUSED_DEVICES:
        raise ValueError(
            f"{ALGORITHM_NAME}: --attention-backend {BACKEND_TORCH} is not served on {kind} (its torch tree verify "
            f"builds fp32 buffers of batch x heads x draft tokens x context per layer, about 1.6 GB a layer at "
            f"batch 48 x 8k context); use --attention-backend {BACKEND_TRITON} on a GPU"
        )


def check_decode_context_parallel_size(dcp_size, backend: Optional[str]) -> None:
    """Refuse ``--dcp-size > 1`` with our verify (ValueError naming the flag).
    Under decode context parallelism each rank stores only the positions it
    owns (SGLang's Triton backend writes ``out_cache_loc // dcp_size`` under a
    rank mask and merges partial attention across the group); our verify
    writes and reads every position in the local pool, so its attention would
    be wrong or read past the pool. SGLang's own Triton tree verify refuses
    custom masks under DCP too."""
    if backend in OUR_BACKENDS and dcp_size is not None and int(dcp_size) > 1:
        raise ValueError(
            f"{ALGORITHM_NAME}: attention backend {backend!r} does not support decode context parallelism "
            f"(--dcp-size {dcp_size}): its tree verify reads each request's whole context from the local KV "
            "cache; use --dcp-size 1"
        )


# SGLang's KV pool layouts (``MHATokenToKVPool.kv_cache_layout``) our verify
# cannot read, and what selects each: it reads token slots [slots, heads, dim]
# (NHD), while HND stores [pages, heads, page_size, dim] and AITER's
# vectorized_5d tiles the head dim.
HND_KV_CACHE_ENV = "SGLANG_USE_HND_KVCACHE"
UNREADABLE_KV_CACHE_LAYOUTS = {"hnd": HND_KV_CACHE_ENV, "vectorized_5d": "SGLANG_AITER_KV_CACHE_LAYOUT"}


def kv_cache_layout_refusal(backend: Optional[str], layout: str) -> str:
    """The startup error for a KV pool of ``layout``, naming what selected it."""
    variable = UNREADABLE_KV_CACHE_LAYOUTS[layout]
    return (
        f"{ALGORITHM_NAME}: attention backend {backend!r} does not support the {layout.upper()} KV cache layout "
        f"({variable}): its tree verify reads the KV cache as token slots [slots, heads, head_dim] (NHD); "
        f"unset {variable}, or use one of SGLang's attention backends"
    )


def validate_tree(num_steps, topk, num_draft_tokens, mode: TreeMaskMode) -> TreeShape:
    """Startup check of the draft-tree shape against the mask mode and the
    selection pool (ValueError with the offending flag); the shape."""
    for flag, value in (
        ("--speculative-num-steps", num_steps),
        ("--speculative-eagle-topk", topk),
        ("--speculative-num-draft-tokens", num_draft_tokens),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{ALGORITHM_NAME}: {flag} must be a positive integer, got {value!r}")
    if num_draft_tokens > max_nodes(mode):
        raise ValueError(
            f"{ALGORITHM_NAME}: --speculative-num-draft-tokens={num_draft_tokens} exceeds what tree mask mode "
            f"{mode.name} supports ({max_nodes(mode)} nodes)"
        )
    try:
        return TreeShape(num_steps, topk, num_draft_tokens)
    except ValueError as err:
        raise ValueError(
            f"{ALGORITHM_NAME}: {err} (--speculative-num-steps={num_steps}, --speculative-eagle-topk={topk}, "
            f"--speculative-num-draft-tokens={num_draft_tokens}: the draft pool holds topk + "
            f"(num_steps - 1) * topk^2 candidates)"
        ) from None


def detect_variant(architectures: Iterable[str]) -> str:
    """EAGLE3 when the head's architecture names EAGLE-3 (SGLang's
    ``LlamaForCausalLMEagle3``, ``Eagle3DeepseekV2ForCausalLM``), else EAGLE:
    ``spec_tree_kernels.head_kinds``' rule, in SGLang's spelling."""
    return head_kind_of_architectures(architectures).sglang_algorithm


# --------------------------------------------- DFlash block drafters (issue 52)

# SGLang 0.5.23's DFlash-family draft models: the ``EntryClass`` of
# sglang/srt/models/{dflash,dspark,lilicorr,dspark_minimax}.py, every one a
# ``DFlashDraftModel`` subclass, which SGLang loads by the checkpoint's
# ``architectures`` for ``--speculative-algorithm DFLASH`` / ``DSPARK``
# (tests/sglang/test_dflash_sglang.py diffs this tuple against those modules).
SGLANG_BLOCK_DRAFTER_ARCHITECTURES = (
    "DFlashDraftModel", "DFlashLagunaForCausalLM", "MuseGlimmerAssistantModel", "DFlash2DraftModel",
    "DFlash2BeamDraftModel", "MiniMaxDFlash2DraftModel", "Qwen3DSparkModel", "LingDSparkModel", "DSparkDraftModel",
    "LiLiCorrDraftModel", "DSparkMiniMaxDraftModel",
)  # fmt: skip
# The config field SGLang's DFlash config parser reads its block fields from
# (``dflash_utils._get_dflash_config`` / ``parse_dflash_draft_config``).
BLOCK_DRAFTER_CONFIG_KEY = "dflash_config"


def _config_field(config, key: str):
    return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)


def block_drafter_evidence(config) -> Optional[str]:
    """What marks a draft checkpoint's config (a dict or a transformers config)
    as a DFlash block drafter, as SGLang would load it; None for an EAGLE head."""
    names = [str(a) for a in _config_field(config, "architectures") or ()]
    family = [a for a in names if a in SGLANG_BLOCK_DRAFTER_ARCHITECTURES]
    if family:
        return f"architectures {family}"
    if _config_field(config, BLOCK_DRAFTER_CONFIG_KEY) is not None:
        return f"a {BLOCK_DRAFTER_CONFIG_KEY} entry"
    return None


def block_drafter_refusal(path: str, evidence: str) -> str:
    """The startup error for EAGLE_TREE given a DFlash drafter: what SGLang's
    DFlash worker does that a DDTree tree would have to change."""
    return (
        f"{ALGORITHM_NAME}: --speculative-draft-model-path {path!r} is a DFlash block drafter ({evidence}); "
        f"--speculative-algorithm {ALGORITHM_NAME} cannot serve it on SGLang 0.5.23. {ALGORITHM_NAME} runs SGLang's "
        "EAGLE worker, which drafts one tree level per draft forward over the draft model's own KV cache; a block "
        "drafter runs in SGLang's DFlash worker (dflash_worker_v2.DFlashWorkerV2), which drafts one chain: each "
        "block position's argmax (_greedy_sample_from_vocab_parallel_head), a causal verify of exactly block-size "
        "tokens (custom_mask=None) and prefix acceptance (compute_dflash_correct_drafts_and_bonus). DDTree needs "
        "each position's top-K, a tree-masked verify of --speculative-num-draft-tokens nodes and the accepted "
        "path's KV compacted, inside that worker. Use --speculative-algorithm DFLASH for the drafter's chain, or "
        "vLLM (spec_tree with speculative_config method 'dflash') for DDTree trees"
    )


def requested_variant(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    raw = environ.get(VARIANT_ENV, "").strip().upper()
    if not raw:
        return None
    if raw not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV}={raw!r}: expected one of {', '.join(VARIANTS)}")
    return raw


__all__ = [
    "ALGORITHM_NAME",
    "TESTED_SGLANG",
    "BACKEND_TORCH",
    "BACKEND_TRITON",
    "GRAPHLESS_BACKENDS",
    "MASK_MODE_ENV",
    "MASK_MODE_FLAG",
    "MASK_MODE_RECORD",
    "MAX_TREE_NODES",
    "OUR_BACKENDS",
    "OUR_BACKEND_MODES",
    "SERVABLE_MASK_MODES",
    "TORCH_BACKEND_REFUSED_DEVICES",
    "VARIANT_ENV",
    "BLOCK_DRAFTER_CONFIG_KEY",
    "SGLANG_BLOCK_DRAFTER_ARCHITECTURES",
    "block_drafter_evidence",
    "block_drafter_refusal",
    "HND_KV_CACHE_ENV",
    "check_decode_context_parallel_size",
    "check_torch_backend_device",
    "kv_cache_layout_refusal",
    "detect_variant",
    "device_type",
    "mask_mode_source",
    "readable_modes",
    "requested_mask_mode",
    "requested_variant",
    "resolve_mask_mode",
    "sglang_backend_mode",
    "validate_tree",
]
