"""``keyed_randoms``: the sampled tree walk's randoms as a hash of each
request's (seed, position), validated and dispatched like the ops of ``api.py``.

A sampled walk (``verify_tree_sampling``) consumes coins [B, T] U[0, 1) and
exponentials [B, V] Exp(1). Drawn from a device RNG they differ between
tensor-parallel ranks as soon as the ranks' RNG streams do, and ranks that
accept different paths desync their KV silently. Keyed on the request's seed
and the tree root's position they are the same on every rank, as vLLM V2's
sampler keys its own Gumbel noise (murmur3 over seed, position, token:
``murmur3_hash32`` in vllm/v1/worker/gpu/sample/gumbel.py). Domains keep the
coins, the exponentials and V2's own draws apart.

Each value is murmur3_32 of 16 bytes (domain, seed low and high words,
position; then the node or token index): coins are its top 24 bits times
2**-24 (as torch.rand's), an exponential is -log u for u = (h + 1/2) 2**-32
in (0, 1), computed in float64 so no u rounds to 1 (an exponential of 0
would win the race whatever its token's probability). The torch reference
is int64 ops over chunks of the vocabulary (any device); the Triton kernel
is one launch. Neither reads the device on the host: capturable.
"""

from __future__ import annotations

import torch

from .api import _check_tensor, resolve_impl

_MASK32 = 0xFFFFFFFF
COIN_DOMAIN = 0x436F696E
EXPONENTIAL_DOMAIN = 0x45787031
# int64 temporaries of one chunk of the reference's [B, V] hash, at most (the loop is over host-known sizes)
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


def keyed_randoms_reference(seeds: torch.Tensor, positions: torch.Tensor, nodes: int, vocab: int,
                            chunk_bytes: int = HASH_CHUNK_BYTES) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification (module doc), in torch int64 ops over chunks of the vocabulary."""
    device = seeds.device
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


def keyed_randoms(seeds: torch.Tensor, positions: torch.Tensor, nodes: int, vocab: int, *,
                  impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """coins [B, nodes] U[0, 1) and exponentials [B, vocab] Exp(1) (> 0), float32,
    each request's a function of its (seed, position) only (module doc).

    seeds:     [B] int64, the requests' seeds (vLLM's per-request ones).
    positions: [B] int64 (or int32), the tree roots' positions.
    impl:      "auto" (Triton on CUDA, the reference elsewhere), "torch", "triton".
    """
    _check_tensor("seeds", seeds, 1, (torch.int64,))
    _check_tensor("positions", positions, 1, (torch.int64, torch.int32), seeds.device)
    if positions.shape != seeds.shape:
        raise ValueError(f"positions has shape {tuple(positions.shape)}, seeds {tuple(seeds.shape)}: both must be [B]")
    if nodes < 1 or vocab < 1:
        raise ValueError(f"nodes={nodes} and vocab={vocab} must be at least 1")
    positions = positions.to(torch.int64)
    if resolve_impl("keyed_randoms", impl, seeds.device) == "triton" and len(seeds):
        from . import keyed_randoms_triton

        # fresh copies: a slice's offset would make another Triton variant than the warmed one
        return keyed_randoms_triton.keyed_randoms(seeds.clone(), positions.clone(), nodes, vocab, COIN_DOMAIN,
                                                  EXPONENTIAL_DOMAIN)
    return keyed_randoms_reference(seeds, positions, nodes, vocab)
