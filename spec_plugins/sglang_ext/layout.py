"""SGLang's tree layouts <-> ``spec_tree_kernels``' layouts: the drop-ins the
EAGLE_TREE hooks (``engine_patches``) call in place of SGLang's functions.

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
import logging
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

import spec_tree_kernels as stk
from spec_tree_kernels import TreeMaskMode, parse_mask_mode
from spec_tree_kernels.modes import OWN_MODES

from spec_plugins.tree_drafting import row_chunks

from .config import ALGORITHM_NAME

logger = logging.getLogger(__name__)


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
    if buf is not None and mode in OWN_MODES:
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


def write_accept_index(result, retrieve_index, accept_index, accept_token_num):
    """Our walk's node-local ``accept_index`` (root = 0, -1 padded) as SGLang's
    flat ``retrieve_index`` values, and the accepted draft count, written in
    place. Returns (node [bs, D+1] int64 with the padding clamped to the root,
    flat [bs, D+1] int64 slots of those nodes, valid [bs, D+1] bool).

    Per step on a GPU every op is a launch and host time: a few, each on [bs, D+1]."""
    node = result.accept_index.long()
    valid = node >= 0
    node = node.clamp_(min=0)  # the padding reads the root's slot: written with the root's value below
    flat = retrieve_index.long().gather(1, node)  # (.long() of int64: no op)
    accept_index.copy_(flat.masked_fill(~valid, -1))
    accept_token_num.copy_(result.accept_length)
    return node, flat, valid


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
    target = target_predict.view(bs, nodes).long()
    result = stk.verify_tree_greedy(
        candidates.long(), retrieve_next_token.long(), retrieve_next_sibling.long(), target,
        accept_index.shape[1] - 1, impl=impl,
    )  # fmt: skip
    node, flat, _ = write_accept_index(result, retrieve_index, accept_index, accept_token_num)
    # predicts[slot of each accepted node] = the target's argmax there; the padding
    # entries (clamped to the root) rewrite the root's slot with the root's own value
    predicts.scatter_(0, flat.flatten(), target.gather(1, node).flatten().to(predicts.dtype))
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
# * min-p: applied to target_probs in place (then renormalised) when the batch needs it,
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


@contextlib.contextmanager
def verify_context(batch):
    """Publish ``verify_context_of(batch)`` to the sampled-verify drop-in for
    a block (the ``eagle_sample`` hook runs SGLang's ``eagle_sample`` in it)."""
    token = _VERIFY_CONTEXT.set(verify_context_of(batch))
    try:
        yield
    finally:
        _VERIFY_CONTEXT.reset(token)


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


def _keep_renormalized(probs: torch.Tensor, pivot: torch.Tensor) -> torch.Tensor:
    """probs where probs >= pivot (else 0), renormalised per row. One [rows, V]
    result (renormalised in place) and its bool mask: at bs 48, T 8 and a 128k
    vocabulary each fp32 [rows, V] is about 200 MB, and a zeros_like plus an
    out-of-place division would add two more."""
    kept = torch.where(probs >= pivot, probs, 0.0)
    return kept.div_(kept.sum(dim=-1, keepdim=True))


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
    return _keep_renormalized(probs, pivot)


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
    return _keep_renormalized(probs, pivot)


def min_p_renorm_prob_(probs: torch.Tensor, min_p) -> torch.Tensor:
    """In place: keep probabilities >= min_p * the row's largest (SGLang's
    sampler: FlashInfer's ``min_p_sampling_from_probs`` and its torch path),
    renormalise; returns ``probs``. probs [rows, V]; min_p scalar or [rows].
    In place and by ``row_chunks`` (its one temporary, a bool mask of a chunk,
    stays within 16 MB however large the batch) so that the step allocates no
    [rows, V] tensor, about 200 MB in fp32 at bs 48, T 8 and a 128k vocabulary,
    outside SGLang's memory planner: the verify's ``target_probs`` is SGLang's,
    made for this call and dropped after it (``eagle_sample``). The chunks
    follow shapes: no host read, capturable."""
    rows, vocab = probs.shape
    if rows == 0 or vocab == 0:
        return probs
    min_ps = _per_row(min_p, rows, probs.device, probs.dtype)
    start = 0
    for chunk in row_chunks(probs):
        threshold = chunk.amax(dim=-1, keepdim=True).mul_(min_ps[start : start + len(chunk), None])
        start += len(chunk)
        # not (p >= threshold), rather than p < threshold: a NaN is dropped, as torch.where(p >= t, p, 0) drops it
        chunk.masked_fill_(chunk.ge(threshold).logical_not_(), 0.0)
        chunk.div_(chunk.sum(dim=-1, keepdim=True))
    return probs


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
        probs = probs.contiguous()  # a no-op for SGLang's target_probs: the view below renormalises it in place
        min_p_renorm_prob_(probs.view(bs * nodes, vocab), context.min_ps.reshape(-1).repeat_interleave(nodes))
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
    node, flat, valid = write_accept_index(result, retrive_index, accept_index, accept_token_num)
    # predicts[slot of the node at depth d] = the token emitted after it; other slots kept
    # (the padding, clamped to the root, rewrites the root's slot with the root's value)
    tokens = result.accept_tokens.to(predicts.dtype)
    predicts.scatter_(0, flat.flatten(), torch.where(valid, tokens, tokens[:, :1]).flatten())
    return None


_warned_pools: set = set()


# pool -> (its k_buffer list, its v_buffer list, the views or None): the pool's
# kind and its 2 x layers views are worked out once, not in every step
_POOL_VIEWS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def plain_kv_views(pool) -> Optional[list]:
    """``plain_kv_views_of(pool)``, kept per pool while its buffer lists are
    the same objects (a pool that reallocates its buffers gets new views)."""
    k_list, v_list = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    try:
        cached = _POOL_VIEWS.get(pool)
    except TypeError:  # not weak-referenceable: no caching
        return plain_kv_views_of(pool)
    if cached is not None and cached[0] is k_list and cached[1] is v_list:
        return cached[2]
    views = plain_kv_views_of(pool)
    _POOL_VIEWS[pool] = (k_list, v_list, views)
    return views


def plain_kv_views_of(pool) -> Optional[list]:
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
    index = accept_index.long()
    # flat b * T + i -> node i (the -1 padding stays negative: the move reads only
    # depths <= the accepted count, and a negative node moves nothing anyway)
    base = torch.arange(0, bs * nodes, nodes, device=index.device)[:, None]
    node_local = torch.where(index >= 0, index - base, -1)
    stk.move_accepted_kv(caches, verify_slots, node_local, num_correct_drafts, impl=impl)
    return None
