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

Layout translations done here (SGLang side -> ours):

* selection: SGLang's score/token/parent lists -> flat pool scores and
  ``parent_list``; ours returns the same ``top_scores_index`` (ascending pool
  indices) but ancestor-closed under ties.
* build: SGLang's 6-tuple (mask, flat positions, retrieve_index,
  retrieve_next_token, retrieve_next_sibling, flat draft tokens); our modes 3
  and 4 are written into the first ``bs`` rows of the backend's buffer.
* verify: our node-local ``accept_index`` (root = 0, -1 padded) -> SGLang's
  flat ``retrieve_index`` values (``b * T + i``, int32) written in place;
  ``predicts[retrieve_index[b, i]]`` = target argmax at every accepted node;
  ``accept_token_num`` = accepted draft nodes.
* sampled verify: the same accept_index / accept_token_num; predicts at
  every accepted node = the token emitted after it (next draft, then the
  drawn token); coins = SGLang's ``uniform_samples``.
* KV move: SGLang's flat accept_index -> node-local; verify slots are
  ``out_cache_loc.view(bs, T)``; the token pool's ``[slots, H, D]`` buffers are
  viewed as ``[slots, 1, H, D]`` (block size 1).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
import pkgutil
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

import spec_tree_kernels as stk
from spec_tree_kernels import TreeMaskMode, parse_mask_mode

from .config import ALGORITHM_NAME, BACKEND_TORCH, BACKEND_TRITON, TESTED_SGLANG

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
         "resolution writes (draft attention backend, CUDA graphs off)"),
    Seam("sglang.srt.arg_groups.overrides:resolving_view", "srt/arg_groups/overrides.py", "read the args"),
    Seam("sglang.srt.arg_groups.overrides:resolved_view", "srt/arg_groups/overrides.py", "read resolved args"),
    Seam("sglang.srt.arg_groups.model_override_base:attention_backends_of", "srt/arg_groups/model_override_base.py",
         "(prefill, decode) attention backends"),
    Seam("sglang.srt.model_executor.cuda_graph_config:with_phase", "srt/model_executor/cuda_graph_config.py",
         "disable CUDA graphs for our backends"),
    Seam("sglang.srt.utils.hf_transformers_utils:get_config", "srt/utils/hf_transformers_utils.py",
         "read the draft head's config (EAGLE vs EAGLE3)"),
    Seam("sglang.srt.runtime_context:get_spec", "srt/runtime_context.py", "speculative config in workers"),
    Seam("sglang.srt.layers.attention.attention_registry:register_attention_backend",
         "srt/layers/attention/attention_registry.py", "register spec_tree / spec_tree_triton"),
    Seam("sglang.srt.arg_groups.choices:add_attention_backend_choices", "srt/arg_groups/choices.py",
         "--attention-backend choices"),
    Seam("sglang.srt.plugins.hook_registry:HookRegistry", "srt/plugins/hook_registry.py",
         "AROUND hooks on the functions below"),
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


@dataclass(frozen=True)
class TreeRuntime:
    """What the hooks need; set by the EAGLE_TREE worker of this process."""

    mask_mode: TreeMaskMode
    impl: str = "auto"  # spec_tree_kernels implementation ("auto": fastest for the device)


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


# ------------------------------------------------------- the four operations


def organize_draft_results_closed(score_list, token_list, parents_list, num_draft_token, *, impl="auto"):
    """Drop-in for ``eagle_utils.organize_draft_results`` with our tie-safe,
    ancestor-closed selection (``select_tree_nodes``)."""
    topk = score_list[0].shape[-1]
    num_steps = len(score_list)
    scores = torch.cat(score_list, dim=1).flatten(1)
    tokens = torch.cat(token_list, dim=1)
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1], dim=1)
    else:
        parent_list = torch.empty(parents_list[0].shape[0], 0, dtype=torch.long, device=parents_list[0].device)
    top_scores_index = stk.select_tree_nodes(
        scores, parent_list.long(), topk, num_steps, num_draft_token, validate=False, impl=impl
    )
    draft_tokens = torch.gather(tokens, 1, top_scores_index)
    return parent_list, top_scores_index, draft_tokens


_OUR_MODES = (TreeMaskMode.ANCESTOR_BITMASK, TreeMaskMode.PARENT_POINTER)


def build_tree_sglang_layout(
    bonus_tokens,
    parent_list,
    top_scores_index,
    draft_tokens,
    seq_lens,
    seq_lens_sum,
    topk,
    spec_steps,
    num_verify_tokens,
    tree_mask_mode=TreeMaskMode.FULL_MASK,
    tree_mask_buf=None,
    fill_prefix_mask=True,
    *,
    impl="auto",
):
    """Drop-in for ``eagle_utils.build_tree_kernel_efficient`` using our builder
    (every mode, incl. ANCESTOR_BITMASK and PARENT_POINTER)."""
    mode = parse_mask_mode(int(tree_mask_mode))
    bs = seq_lens.numel()
    if top_scores_index.shape[1] + 1 != num_verify_tokens:
        raise ValueError(
            f"{ALGORITHM_NAME}: {top_scores_index.shape[1]} selected nodes + root != "
            f"num_verify_tokens={num_verify_tokens}"
        )
    buf = tree_mask_buf
    if buf is not None and mode in _OUR_MODES:
        buf = buf[:bs]  # the backend's buffer holds max_bs rows
    build = stk.build_tree(
        top_scores_index.long(),
        parent_list.long(),
        seq_lens.long(),
        topk,
        spec_steps,
        mode,
        seq_lens_sum=seq_lens_sum,
        fill_prefix_mask=fill_prefix_mask,
        tree_mask_buf=buf,
        validate=False,
        impl=impl,
    )
    flat_tokens = torch.cat((bonus_tokens.unsqueeze(1), draft_tokens), dim=1).flatten()
    return (
        build.tree_mask,
        build.positions.flatten(),
        build.retrieve_index,
        build.retrieve_next_token,
        build.retrieve_next_sibling,
        flat_tokens,
    )


def verify_tree_greedy_sglang_layout(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrieve_index,
    retrieve_next_token,
    retrieve_next_sibling,
    target_predict,
    topk=-1,
    *,
    impl="auto",
):
    """Drop-in for ``spec_tree.verify_tree_greedy_func`` (fills the three
    mutable outputs in SGLang's layout and returns them)."""
    bs, nodes = candidates.shape
    result = stk.verify_tree_greedy(
        candidates.long(),
        retrieve_next_token.long(),
        retrieve_next_sibling.long(),
        target_predict.long().view(bs, nodes),
        accept_index.shape[1] - 1,
        impl=impl,
    )
    node = result.accept_index.long()  # [bs, D+1] node-local, -1 padded
    valid = node >= 0
    flat = retrieve_index.long().gather(1, node.clamp(min=0))
    accept_index.copy_(torch.where(valid, flat, torch.full_like(flat, -1)).to(accept_index.dtype))
    accept_token_num.copy_(result.accept_length.to(accept_token_num.dtype))
    on_path = torch.zeros(bs, nodes + 1, dtype=torch.bool, device=candidates.device)
    on_path.scatter_(1, torch.where(valid, node, nodes), True)
    slots = retrieve_index.long().flatten()
    current = predicts.gather(0, slots).view(bs, nodes)
    updated = torch.where(on_path[:, :nodes], target_predict.view(bs, nodes).to(predicts.dtype), current)
    predicts.scatter_(0, slots, updated.flatten())
    return predicts, accept_index, accept_token_num


# ------------------------------------------- the sampled verify (temperature > 0)
#
# SGLang 0.5.23's ``eagle_sample``, for a batch that is not all greedy:
# target_probs = softmax(logits / temperature) -> top_k_renorm_prob ->
# top_p_renorm_prob (each only when some request needs it; min-p is not
# applied), coins from ``_verify_coins``, then
# ``tree_speculative_sampling_target_only`` (CUDA JIT; None on CPU / XPU,
# where ``_verify_uses_greedy`` makes SGLang verify greedily instead: temperature
# is silently ignored there). In our worker's process the hooks below make that
# branch run on every platform through ``spec_tree_kernels.verify_tree_sampling``:
#
# * coins: SGLang's ``uniform_samples`` [bs, T] are our per-node coins as they
#   are (ours reads node j's coin when j is tested as a child; SGLang's kernel
#   reads the parent's: both one U[0, 1) per node). Its
#   ``uniform_samples_for_final_sampling`` (one coin per request, for an
#   inverse-CDF draw) is not used: our final draw is an exponential race.
# * exponentials [bs, V]: drawn the way SGLang draws its own randomness, so they
#   are reproducible exactly when SGLang's coins are. Unseeded requests: torch's
#   default generator of the device (``exponential_``, as SGLang's sampler and
#   ``fast_sample`` do; seeded by ``--random-seed`` through ``set_random_seed``,
#   the same stream ``torch.rand_like`` draws the coins from). With
#   ``sampling_seed`` (``--enable-deterministic-inference``): SGLang's
#   ``murmur_hash32(sampling_seed + salt, seq_lens, token)``, the scheme
#   ``fast_sample`` uses for seeded draft draws, in its own salted stream apart
#   from the coins (unsalted seed, columns 0..T) and the draft draws.
# * min-p: applied to target_probs (then renormalised) when the batch needs it,
#   as SGLang's non-speculative sampler does after top-k / top-p.
# * thresholds: ``threshold_single`` / ``threshold_acc`` != 1 relax acceptance
#   (lossy); refused at startup and on runtime updates; if one still arrives it
#   is ignored (warned once): our law is exact.
# * top_k_renorm_prob / top_p_renorm_prob: None on CPU / XPU in SGLang 0.5.23;
#   there ``eagle_utils``'s bindings get torch drop-ins with FlashInfer's
#   threshold semantics (a port of SGLang's own HIP fallback, ``renorm_triton``).
#
# Layout (SGLang's kernel, ``speculative/sampling.cuh``): accept_index[b, d] =
# retrieve_index[b, node at depth d] (root first, -1 after), accept_token_num =
# accepted drafts, predicts[retrieve_index[b, node at depth d]] = the token
# emitted after it (the next accepted draft, then the drawn token); predicts
# elsewhere is left as it is (SGLang: undefined).

# fast_sample salts seeded draft draws with "DRAFT_"; ours: "VERIFYEX".
VERIFY_EXP_SEED_SALT = 0x5645524946594558


@dataclass(frozen=True)
class VerifyContext:
    """What ``eagle_sample`` knows and does not pass to the sampling kernel."""

    seq_lens: Optional[torch.Tensor]  # [bs]
    sampling_seed: Optional[torch.Tensor] = None  # [bs] int64 (deterministic inference)
    min_ps: Optional[torch.Tensor] = None  # [bs], when some request needs min-p


_VERIFY_CONTEXT: contextvars.ContextVar[Optional[VerifyContext]] = contextvars.ContextVar(
    "spec_plugins_sglang_verify_context", default=None
)


def verify_context_of(batch) -> VerifyContext:
    info = getattr(batch, "sampling_info", None)
    need_min_p = bool(getattr(info, "need_min_p_sampling", False))
    return VerifyContext(
        seq_lens=getattr(batch, "seq_lens", None),
        sampling_seed=getattr(info, "sampling_seed", None),
        min_ps=getattr(info, "min_ps", None) if need_min_p else None,
    )


def verify_exponentials(bs, vocab, device, dtype=torch.float32, *, sampling_seed=None, seq_lens=None):
    """[bs, vocab] Exp(1) draws for the final token (see the notes above):
    torch's default generator, or SGLang's murmur hash of the request seed."""
    if sampling_seed is None:
        draws = torch.empty(bs, vocab, device=device, dtype=torch.float32).exponential_()
        return draws.clamp_min_(torch.finfo(torch.float32).tiny).to(dtype)
    if seq_lens is None:
        raise ValueError(f"{ALGORITHM_NAME}: seeded exponentials need the requests' seq_lens")
    from sglang.kernels.ops.sampling.murmur_hash import murmur_hash32

    salted = sampling_seed.to(torch.int64) + VERIFY_EXP_SEED_SALT
    cols = torch.arange(vocab, dtype=torch.int64, device=device)
    hashed = murmur_hash32(salted.to(torch.uint64), seq_lens.to(torch.uint64), cols)
    # midpoint mapping strictly inside (0, 1), as fast_sample: finite, > 0
    return hashed.to(torch.float64).add_(0.5).div_(2.0**32).log_().neg_().to(dtype)


def _per_row(value, rows: int, device, dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        value = value.to(device=device, dtype=dtype).reshape(-1)
        if value.numel() == 1:
            return value.expand(rows)
        if value.numel() != rows:
            raise ValueError(f"expected a scalar or one value per row ({rows}), got {value.numel()}")
        return value
    return torch.full((rows,), value, device=device, dtype=dtype)


def _renormalize(kept: torch.Tensor) -> torch.Tensor:
    return kept / kept.sum(dim=-1, keepdim=True)


def top_k_renorm_prob_torch(probs: torch.Tensor, top_k) -> torch.Tensor:
    """Drop-in for ``top_k_renorm_prob`` (FlashInfer's semantics, as SGLang's
    ``top_k_renorm_probs_triton``): keep probabilities >= the k-th largest
    (ties at the pivot kept), renormalise. probs [rows, V]; top_k scalar or [rows]."""
    probs = probs.float()
    rows, vocab = probs.shape
    if rows == 0 or vocab == 0:
        return probs
    top_ks = _per_row(top_k, rows, probs.device, torch.int64)
    ordered = torch.sort(probs, dim=-1, descending=True).values
    pivot = ordered.gather(1, (top_ks - 1).clamp(min=0, max=vocab - 1)[:, None])
    return _renormalize(torch.where(probs >= pivot, probs, torch.zeros_like(probs)))


def top_p_renorm_prob_torch(probs: torch.Tensor, top_p) -> torch.Tensor:
    """Drop-in for ``top_p_renorm_prob`` (FlashInfer's semantics, as SGLang's
    ``top_p_renorm_probs_triton``): ascending sort, the pivot is the first
    token whose cumulative mass reaches 1 - p; keep probabilities >= it."""
    probs = probs.float()
    rows, vocab = probs.shape
    if rows == 0 or vocab == 0:
        return probs
    top_ps = _per_row(top_p, rows, probs.device, torch.float32)
    ordered = torch.sort(probs, dim=-1).values
    cdf = torch.cumsum(ordered, dim=-1)
    cutoff = torch.searchsorted(cdf, (1.0 - top_ps)[:, None].contiguous(), right=False).clamp_(max=vocab - 1)
    pivot = ordered.gather(1, cutoff)
    return _renormalize(torch.where(probs >= pivot, probs, torch.zeros_like(probs)))


def min_p_renorm_prob_torch(probs: torch.Tensor, min_p) -> torch.Tensor:
    """Keep probabilities >= min_p * the row's largest (SGLang's sampler:
    FlashInfer's ``min_p_sampling_from_probs`` and its torch path), renormalise."""
    rows = probs.shape[0]
    if rows == 0:
        return probs
    min_ps = _per_row(min_p, rows, probs.device, probs.dtype)
    threshold = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
    return _renormalize(torch.where(probs >= threshold, probs, torch.zeros_like(probs)))


_warned_thresholds: set = set()


def verify_tree_sampling_sglang_layout(
    predicts,
    accept_index,
    accept_token_num,
    candidates,
    retrive_index,
    retrive_next_token,
    retrive_next_sibling,
    uniform_samples,
    uniform_samples_for_final_sampling,
    target_probs,
    draft_probs,
    threshold_single=1.0,
    threshold_acc=1.0,
    deterministic=True,
    *,
    impl="auto",
    exponentials=None,
    context: Optional[VerifyContext] = None,
):
    """Drop-in for ``tree_speculative_sampling_target_only`` (SGLang's
    parameters, ``retrive_*`` spelling included): target-only recursive
    rejection through ``spec_tree_kernels.verify_tree_sampling``; fills the
    three mutable outputs in SGLang's layout and returns None, as SGLang's.

    ``draft_probs`` (zeros: target-only), ``uniform_samples_for_final_sampling``
    and ``deterministic`` are unused. ``exponentials`` [bs, V]: drawn here
    when not given (``verify_exponentials``, seeded from ``context``, by
    default the one ``eagle_sample`` runs in)."""
    if float(threshold_single) != 1.0 or float(threshold_acc) != 1.0:
        key = (float(threshold_single), float(threshold_acc))
        if key not in _warned_thresholds:
            _warned_thresholds.add(key)
            logger.warning(
                "%s: accept thresholds single=%s acc=%s ignored: EAGLE_TREE verifies exactly "
                "(--speculative-accept-threshold-single / -acc must stay 1.0)",
                ALGORITHM_NAME, threshold_single, threshold_acc,
            )  # fmt: skip
    bs, nodes = candidates.shape
    if bs == 0:
        return None
    if context is None:
        context = _VERIFY_CONTEXT.get()
    probs = target_probs.reshape(bs, nodes, -1)
    if probs.dtype not in (torch.float32, torch.float64):
        probs = probs.float()
    vocab = probs.shape[-1]
    if context is not None and context.min_ps is not None:
        min_ps = context.min_ps.reshape(-1).repeat_interleave(nodes)
        probs = min_p_renorm_prob_torch(probs.reshape(bs * nodes, vocab), min_ps).view(bs, nodes, vocab)
    if exponentials is None:
        exponentials = verify_exponentials(
            bs, vocab, probs.device, probs.dtype,
            sampling_seed=None if context is None else context.sampling_seed,
            seq_lens=None if context is None else context.seq_lens,
        )  # fmt: skip
    result = stk.verify_tree_sampling(
        candidates.long(),
        retrive_next_token.long(),
        retrive_next_sibling.long(),
        probs,
        uniform_samples.to(probs.dtype),
        exponentials.to(probs.dtype),
        accept_index.shape[1] - 1,
        impl=impl,
    )
    node = result.accept_index.long()  # [bs, D+1] node-local, -1 padded
    valid = node >= 0
    flat = retrive_index.long().gather(1, node.clamp(min=0))
    accept_index.copy_(torch.where(valid, flat, torch.full_like(flat, -1)).to(accept_index.dtype))
    accept_token_num.copy_(result.accept_length.to(accept_token_num.dtype))
    # predicts[slot of the node at depth d] = the token emitted after it; other slots kept
    slots = retrive_index.long().flatten()
    values = torch.cat([predicts.gather(0, slots).view(bs, nodes), predicts.new_zeros(bs, 1)], dim=1)
    values.scatter_(1, torch.where(valid, node, nodes), result.accept_tokens.to(predicts.dtype))
    predicts.scatter_(0, slots, values[:, :nodes].flatten())
    return None


_warned_pools: set = set()


def plain_kv_views(pool) -> Optional[list]:
    """[slots, 1, H, D] views of every K and V buffer of a plain token-major
    pool (SGLang's MHATokenToKVPool, NHD layout, unquantized), or None for any
    other pool (SWA/hybrid/quantized/paged-major): those keep SGLang's own
    ``move_kv_cache``, which also moves what ours does not know about."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if type(pool) is not MHATokenToKVPool:
        return None
    if getattr(pool, "use_hnd", False) or getattr(pool, "kv_cache_layout", "nhd") != "nhd":
        return None
    if is_quantized_pool(pool):
        return None
    if pool.k_buffer is None:
        return None
    return [b.unsqueeze(1) for b in pool.k_buffer] + [b.unsqueeze(1) for b in pool.v_buffer]


# Buffers SGLang 0.5.23's MHATokenToKVPool moves beside K and V, or keeps for
# a quantized cache: per-token scales (k/v_scale_buffer, NVFP4's native_k/v_
# scale_buffer) and dequant workspaces. Moving K/V without them is wrong output.
_SIDE_BUFFERS = ("k_scale_buffer", "v_scale_buffer", "native_k_scale_buffer", "native_v_scale_buffer",
                 "dq_k_buffer", "dq_v_buffer")  # fmt: skip


def is_quantized_pool(pool) -> bool:
    """SGLang's own predicate, plus any scale/workspace buffer present,
    plus any other ``*scale*`` buffer a later release may add."""
    if getattr(pool, "is_quantized_kv_cache", False):
        return True
    names = set(_SIDE_BUFFERS) | {n for n in vars(pool) if "scale" in n and n.endswith("buffer")}
    return any(getattr(pool, name, None) is not None for name in names)


def move_accepted_kv_sglang_layout(
    batch, accept_index, num_correct_drafts, token_to_kv_pool_allocator, *, impl="auto", fallback=None
):
    """Drop-in for ``spec_utils.move_accept_tokens_to_target_kvcache`` on plain
    pools (our ``move_accepted_kv``); other pools go to ``fallback``."""
    pool = token_to_kv_pool_allocator.get_kvcache()
    caches = plain_kv_views(pool)
    if caches is None:
        name = type(pool).__name__
        if name not in _warned_pools:
            _warned_pools.add(name)
            logger.info("%s: KV pool %s is not a plain MHA pool; the accepted-path move uses SGLang's", ALGORITHM_NAME, name)
        if fallback is None:
            raise RuntimeError(f"{ALGORITHM_NAME}: no KV move for pool {name}")
        return fallback(batch, accept_index, num_correct_drafts, token_to_kv_pool_allocator)
    bs = len(batch.seq_lens)
    if bs == 0:
        return None
    verify_slots = batch.out_cache_loc.long().view(bs, -1)
    nodes = verify_slots.shape[1]
    base = torch.arange(bs, device=accept_index.device, dtype=torch.long)[:, None] * nodes
    index = accept_index.long()
    node_local = torch.where(index >= 0, index - base, torch.full_like(index, -1))
    stk.move_accepted_kv(caches, verify_slots, node_local, num_correct_drafts, impl=impl)
    return None


# -------------------------------------------------------------- the hooks


def _organize_hook(original, score_list, token_list, parents_list, num_draft_token):
    rt = _ACTIVE
    if rt is None:
        return original(score_list, token_list, parents_list, num_draft_token)
    return organize_draft_results_closed(score_list, token_list, parents_list, num_draft_token, impl=rt.impl)


def _build_hook(original, *args, **kwargs):
    rt = _ACTIVE
    if rt is None:
        return original(*args, **kwargs)
    return build_tree_sglang_layout(*args, **kwargs, impl=rt.impl)


def _verify_hook(original, *args, **kwargs):
    rt = _ACTIVE
    if rt is None:
        return original(*args, **kwargs)
    return verify_tree_greedy_sglang_layout(*args, **kwargs, impl=rt.impl)


def _sample_hook(original, *args, **kwargs):
    rt = _ACTIVE
    if rt is None:
        return original(*args, **kwargs)
    return verify_tree_sampling_sglang_layout(*args, **kwargs, impl=rt.impl)


def _sample_context_hook(original, *args, **kwargs):
    """Around ``eagle_sample(verify_input, batch, ...)``: publish what the
    sampling drop-in needs."""
    if _ACTIVE is None:
        return original(*args, **kwargs)
    batch = args[1] if len(args) > 1 else kwargs["batch"]
    token = _VERIFY_CONTEXT.set(verify_context_of(batch))
    try:
        return original(*args, **kwargs)
    finally:
        _VERIFY_CONTEXT.reset(token)


@functools.lru_cache(maxsize=None)
def _signature(function) -> inspect.Signature:
    return inspect.signature(function)


def _uses_greedy_hook(original, *args, **kwargs):
    """SGLang verifies sampled batches greedily where it has no sampling
    kernel (CPU, XPU; HIP without rejection sampling); ours runs everywhere."""
    if _ACTIVE is None:
        return original(*args, **kwargs)
    arguments = _signature(original).bind(*args, **kwargs).arguments
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


_top_k_renorm_hook = _renorm_hook(top_k_renorm_prob_torch)
_top_p_renorm_hook = _renorm_hook(top_p_renorm_prob_torch)

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
    return move_accepted_kv_sglang_layout(
        batch, accept_index, num_correct_drafts, token_to_kv_pool_allocator, impl=rt.impl, fallback=original
    )


HOOKS = (
    (HOOK_ORGANIZE, _organize_hook),
    (HOOK_BUILD, _build_hook),
    (HOOK_VERIFY, _verify_hook),
    (HOOK_MOVE_KV, _move_hook),
    (HOOK_SAMPLE_CONTEXT, _sample_context_hook),
    (HOOK_USES_GREEDY, _uses_greedy_hook),
    (HOOK_THRESHOLD_UPDATE, _threshold_update_hook),
)


def registry_hooks() -> tuple:
    """HOOKS, plus the sampling kernel where SGLang has one for this platform."""
    return HOOKS + (((HOOK_SAMPLE, _sample_hook),) if _sglang_has_sampling_kernel() else ())


# ------------------------------------------------------------ registration


def _worker_factory(server_args):
    from .worker import EagleTreeWorker

    return EagleTreeWorker


def _create_torch_backend(runner):
    from .attention import TreeVerifyTorchNativeBackend

    return TreeVerifyTorchNativeBackend(runner)


def _create_triton_backend(runner):
    from .attention import make_triton_tree_backend

    return make_triton_tree_backend(runner)


def register_all() -> None:
    """Register EAGLE_TREE, its resolution hook, our attention backends and
    the AROUND hooks with SGLang. Each step skips what is already there."""
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention import attention_registry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from .algorithm import handle_speculative_decoding_hook, make_spec_class

    if get_spec(ALGORITHM_NAME) is None:
        SpeculativeAlgorithm.register(ALGORITHM_NAME, supports_overlap=True, spec_class=make_spec_class())(
            _worker_factory
        )
    step = "handle_speculative_decoding"
    if handle_speculative_decoding_hook not in resolution_hooks._HOOKS.get(step, ()):
        resolution_hooks.register_resolution_hook(step)(handle_speculative_decoding_hook)
    for name, factory in ((BACKEND_TORCH, _create_torch_backend), (BACKEND_TRITON, _create_triton_backend)):
        attention_registry.register_attention_backend(name)(factory)
        if name not in ATTENTION_BACKEND_CHOICES:
            add_attention_backend_choices([name])
    for target, hook in registry_hooks():
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
            HookRegistry.register(target, hook, HookType.AROUND)


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
