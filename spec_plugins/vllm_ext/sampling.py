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
"""

from __future__ import annotations

import torch

_SAMPLING_EPS = 1e-5  # vLLM's: temperature below it is greedy (SamplingType.GREEDY)


def node_probs(logits: torch.Tensor, temperature: torch.Tensor, min_p: torch.Tensor | None,
               top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """[N, V] probabilities for N rows of logits; temperature [N] float32 (> eps),
    min_p [N] float32 (0 = off) or None, top_k [N] int / top_p [N] float32 or None
    (vLLM's per-request tensors, expanded to rows)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    scaled = logits.to(torch.float32).div(temperature[:, None])
    if min_p is not None:
        probs = scaled.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True).mul_(min_p[:, None])
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))
    scaled = apply_top_k_top_p(scaled, top_k, top_p)
    return scaled.softmax(dim=-1, dtype=torch.float32)


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
