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
of V2's per-request seed and the root's position (``spec_tree_kernels.keyed_randoms``).
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
