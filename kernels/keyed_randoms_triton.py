"""Triton implementation of ``keyed_randoms`` (one launch; ``keyed_randoms.py``
is the specification). One program per (request, block of columns) hashes
its columns' tokens (and, in the first blocks, its nodes) in int64 registers:
the same murmur3 arithmetic mod 2**32 as the reference, so the hashes are
equal bit for bit, and coins with them; exponentials take float64 -log as the
reference does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import launch

_BLOCK = 1024


@triton.jit
def _mul32(x, c: tl.constexpr):
    # int64 products wrap mod 2**64, which keeps their low 32 bits
    return (x * c) & 0xFFFFFFFF


@triton.jit
def _rotl32(x, r: tl.constexpr):
    return ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF


@triton.jit
def _mix(h, key):
    key = _mul32(_rotl32(_mul32(key, 0xCC9E2D51), 15), 0x1B873593)
    h = _rotl32(h ^ key, 13)
    return (h * 5 + 0xE6546B64) & 0xFFFFFFFF


@triton.jit
def _fmix(h):
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    return h ^ (h >> 16)


@triton.jit
def _prefix(domain: tl.constexpr, seed, position):
    h = _mix(tl.full([], domain, tl.int64), seed & 0xFFFFFFFF)
    h = _mix(h, (seed >> 32) & 0xFFFFFFFF)
    return _mix(h, position & 0xFFFFFFFF)


@triton.jit
def _keyed_randoms_kernel(
    seeds_ptr, positions_ptr,  # [B] int64
    coins_ptr,  # [B, nodes] float32 (out)
    exponentials_ptr,  # [B, vocab] float32 (out)
    nodes, vocab,
    COIN: tl.constexpr, EXPONENTIAL: tl.constexpr, BLOCK: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    seed = tl.load(seeds_ptr + b)
    position = tl.load(positions_ptr + b)
    bits = _fmix(_mix(_prefix(EXPONENTIAL, seed, position), cols) ^ 16)
    u = (bits.to(tl.float64) + 0.5) * (2.0 ** -32)
    tl.store(exponentials_ptr + b * vocab + cols, (-tl.log(u)).to(tl.float32), mask=cols < vocab)
    coin_bits = _fmix(_mix(_prefix(COIN, seed, position), cols) ^ 16)
    coins = (coin_bits >> 8).to(tl.float32) * (2.0 ** -24)
    tl.store(coins_ptr + b * nodes + cols, coins, mask=cols < nodes)


def keyed_randoms(seeds: torch.Tensor, positions: torch.Tensor, nodes: int, vocab: int, coin_domain: int,
                  exponential_domain: int):
    batch = seeds.shape[0]
    coins = torch.empty(batch, nodes, dtype=torch.float32, device=seeds.device)
    exponentials = torch.empty(batch, vocab, dtype=torch.float32, device=seeds.device)
    grid = (batch, triton.cdiv(max(nodes, vocab), _BLOCK))
    launch(_keyed_randoms_kernel, grid, seeds, positions, coins, exponentials, nodes, vocab,
           COIN=coin_domain, EXPONENTIAL=exponential_domain, BLOCK=_BLOCK)
    return coins, exponentials
