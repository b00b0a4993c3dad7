"""Sampled requests (temperature > 0) in tree mode: the target's distribution at
every tree node, and the random numbers ``spec_tree_kernels.verify_tree_sampling``
consumes.

The distribution is the one vLLM's Sampler draws from without speculation, in
its order (``vllm/v1/sample/sampler.py``): float32 logits, divided by the
temperature, min-p (the builtin argmax-invariant processor), then vLLM's own
``apply_top_k_top_p``, softmax. Everything that can act earlier in vLLM's
Sampler (penalties, bad words, allowed tokens, min_tokens, logit_bias, custom
processors) makes a request non-speculated (``requests.params_allow_speculation``),
so the logits reach this function untouched, as they reach the Sampler.

Randoms: ``coins`` [B, T] U[0, 1) and ``exponentials`` [B, V] Exp(1), float32.
A request with a seed draws its own from its vLLM generator (the same
``torch.Generator`` vLLM's Sampler uses for it), so a seeded request is
reproducible under one engine configuration; the others share one batched
draw. The per-seeded-request loop is vLLM's own pattern (``random_sample``).
On Model Runner V2 (``verify_v2``) every request's randoms are instead a hash
of V2's per-request seed and the root's position (``keyed_randoms``).
"""

from __future__ import annotations

import torch

_SAMPLING_EPS = 1e-5  # vLLM's: temperature below it is greedy (SamplingType.GREEDY)


# Rows per block of ``node_probs``: a block's float32 [rows, V] temporaries (the scaled logits, min-p's
# softmax, vLLM's sort: values, int64 indices and cumulative sums, the block's softmax) are bounded by
# about BLOCK_TEMPORARIES x BLOCK_BYTES, whatever the batch; only the [N, V] result spans every row.
BLOCK_BYTES = 32 << 20
# [rows, V] float32-sized temporaries of one block alive at once, at most: the scaled logits, vLLM's
# sort (values, int64 indices: 2), its softmax / cumulative sums, masks, the block's result (measured 9.5)
BLOCK_TEMPORARIES = 10


def block_rows_for(vocab: int, block_bytes: int) -> int:
    """Rows per block: one float32 [rows, V] temporary within ``block_bytes``."""
    return max(1, block_bytes // (4 * max(1, vocab)))


def node_probs(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor | None,
               top_k: torch.Tensor | None, top_p: torch.Tensor | None, block_rows: int | None = None) -> torch.Tensor:
    """[N, V] float32 probabilities for N rows of logits; temperature [N] float32 (> eps),
    min_p [N] float32 (0 = off) or None, top_k [N] int / top_p [N] float32 or None
    (vLLM's per-request tensors, expanded to rows).

    Computed block by block (``block_rows`` rows; default: a float32 [rows, V] within BLOCK_BYTES):
    each block sorts its rows once (one batched sort in vLLM's ``apply_top_k_top_p``, shared by top-k and top-p), and
    its temporaries are freed before the next block, so the step's memory beyond the result is one
    block's, not [N, V] several times over. Every row is computed alone, so the result is bit-identical
    to one call over all N rows (``tests/model/test_vllm_tree_sampling_blocks.py``)."""
    n, vocab = logits.shape
    rows = block_rows or block_rows_for(vocab, BLOCK_BYTES)
    if n <= rows:
        return _block_probs(logits, temperature, min_p, top_k, top_p)
    out = torch.empty((n, vocab), dtype=torch.float32, device=logits.device)
    for start in range(0, n, rows):
        block = slice(start, min(n, start + rows))
        out[block] = _block_probs(logits[block], temperature[block], *(None if t is None else t[block]
                                                                     for t in (min_p, top_k, top_p)))
    return out


def _block_probs(logits, temperature, min_p, top_k, top_p) -> torch.Tensor:
    """vLLM's Sampler's distribution for a block of rows (see the module docstring)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    scaled = logits.to(torch.float32).div(temperature[:, None])
    if min_p is not None:
        probs = scaled.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True).mul_(min_p[:, None])
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))
        del probs, threshold
    scaled = apply_top_k_top_p(scaled, top_k, top_p)
    return scaled.softmax(dim=-1, dtype=torch.float32)


# Requests per block of ``verify_in_blocks``: a block's [requests, T, V] float32 node distribution
# (the walk reads every node's at once) within PROBS_BLOCK_BYTES (64 requests at T 8, V 128k).
PROBS_BLOCK_BYTES = 256 << 20


def verify_in_blocks(shape: tuple[int, int, int], probs_of, randoms_of, walk_of,
                     block_bytes: int = PROBS_BLOCK_BYTES):
    """Target-only rejection for B sampled trees, block by block of requests, so
    the step holds one block's [b, T, V] distribution and [b, V] randoms, not
    the batch's (vLLM profiles its sampler with 2 rows per request, not T).

    shape (B, T, V); ``probs_of(block)`` -> [b, T, V] float32 the node
    distributions of the requests in ``block`` (a slice); ``randoms_of(block)`` ->
    (coins [b, T], exponentials [b, V]); ``walk_of(block, probs, coins,
    exponentials)`` -> ``VerifyResult``. Returns the batch's ``VerifyResult``.
    Each request's walk reads only its own rows and randoms, so blocking leaves
    every result as one call over the batch would give it with the same randoms."""
    batch, nodes, vocab = shape
    per_block = max(1, block_bytes // (4 * nodes * max(1, vocab)))
    parts = []
    for start in range(0, batch, per_block):  # host-known sizes: one iteration per block, not per request
        block = slice(start, min(batch, start + per_block))
        probs = probs_of(block)
        parts.append(walk_of(block, probs, *randoms_of(block)))
        del probs
    if len(parts) == 1:
        return parts[0]
    return type(parts[0])(*(torch.cat(field) for field in zip(*parts)))


# The V2 walk's randoms are a hash of (vLLM's per-request seed, the root's position, an offset), the
# way V2's own sampler keys its Gumbel noise (murmur3 over seed, position, token: ``murmur3_hash32`` in
# vllm/v1/worker/gpu/sample/gumbel.py). Tensor-parallel ranks hold the same seeds (vLLM draws an
# unseeded request's seed from numpy, seeded alike on every rank), so they walk alike whatever their
# CUDA RNG streams did. vLLM's helpers are Triton device functions; these are torch ops (any device,
# capturable, no host read). The domains keep the walk's streams apart from each other and from V2's
# own draws (its domains: 0 and 0x9E3779B9).
_MASK32 = 0xFFFFFFFF
COIN_DOMAIN = 0x436F696E
EXPONENTIAL_DOMAIN = 0x45787031
# int64 temporaries of one hash chunk of the [B, V] exponentials, at most (the loop is over host-known sizes)
HASH_CHUNK_BYTES = 16 << 20


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for x in [0, 2**32): c split in 16-bit halves, so no int64 product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _rotl32(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def _murmur3_mix(h: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    key = _mul32(_rotl32(_mul32(key, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ key, 13)
    return (h * 5 + 0xE6546B64) & _MASK32


def _murmur3_fmix(h: torch.Tensor) -> torch.Tensor:
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


def _hash_prefix(seeds: torch.Tensor, positions: torch.Tensor, domain: int) -> torch.Tensor:
    """[B, 1] the hash state after (domain, seed, position): shared by every offset of a request."""
    h = torch.full_like(seeds, domain)
    h = _murmur3_mix(h, seeds & _MASK32)
    h = _murmur3_mix(h, (seeds >> 32) & _MASK32)
    return _murmur3_mix(h, positions & _MASK32)[:, None]


def _hash32(prefix: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[B, n] int64 in [0, 2**32): murmur3 of (prefix's keys, offset), 16 bytes hashed."""
    return _murmur3_fmix(_murmur3_mix(prefix, offsets[None, :]) ^ 16)


def keyed_randoms(seeds: torch.Tensor, positions: torch.Tensor, nodes: int, vocab: int,
                  chunk_bytes: int = HASH_CHUNK_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """coins [B, nodes] U[0, 1) and exponentials [B, vocab] Exp(1) (> 0), float32, for B requests,
    each a function of its (seed, position) only: seeds [B] int64 (vLLM's per-request seeds),
    positions [B] int64 (the tree root's). Coins are multiples of 2**-24, as torch.rand's; an
    exponential is -log u for u = (h + 1/2) 2**-32 in (0, 1), computed in float64 so no u
    rounds to 1 (an exponential of 0 would win the race whatever its token's probability)."""
    device = seeds.device
    seeds, positions = seeds.to(torch.int64), positions.to(torch.int64)
    coin_bits = _hash32(_hash_prefix(seeds, positions, COIN_DOMAIN), torch.arange(nodes, device=device))
    coins = (coin_bits >> 8).to(torch.float32).mul_(2.0 ** -24)
    prefix = _hash_prefix(seeds, positions, EXPONENTIAL_DOMAIN)
    exponentials = torch.empty((len(seeds), vocab), dtype=torch.float32, device=device)
    columns = max(1, chunk_bytes // (8 * max(1, len(seeds))))
    for start in range(0, vocab, columns):
        stop = min(vocab, start + columns)
        bits = _hash32(prefix, torch.arange(start, stop, device=device))
        exponentials[:, start:stop] = bits.to(torch.float64).add_(0.5).mul_(2.0 ** -32).log_().neg_()
    return coins, exponentials


def draw_randoms(batch_rows: list[int], nodes: int, vocab: int, generators: dict, device) -> tuple:
    """coins [B, T] and exponentials [B, V] (float32) for the requests at
    ``batch_rows``; ``generators``: vLLM's {batch row: torch.Generator} of seeded requests."""
    coins = torch.rand(len(batch_rows), nodes, device=device)
    exponentials = torch.empty(len(batch_rows), vocab, device=device).exponential_()
    for i, row in enumerate(batch_rows):
        generator = generators.get(row)
        if generator is not None:
            coins[i] = torch.rand(nodes, device=device, generator=generator)
            exponentials[i].exponential_(generator=generator)
    return coins, exponentials


def expand(values: torch.Tensor | None, batch_rows: torch.Tensor, nodes: int) -> torch.Tensor | None:
    """A per-request tensor [num_reqs] -> per node row [B * T] for ``batch_rows``."""
    if values is None:
        return None
    return values[batch_rows.to(values.device)].repeat_interleave(nodes)
