"""Checks the tree runner runs once at startup (``initialize_kv_cache``).

Everything about the layout and the attention layers is decided when the KV
cache is allocated, so it is checked there: a configuration the tree rows
cannot serve stops the engine before it takes a request, instead of killing
the first request and everything in flight with it.

* Every target attention layer is one the tree rows compute exactly: no ALiBi
  slopes, logits soft-cap, attention sinks, sliding window or chunked local
  attention (the tree rows are a plain scaled softmax), and a KV cache in the
  model dtype (``tree_attention`` requires cache dtype == query dtype).
* The K layout of every cache the runner or the tree rows read is resolved
  now: on CPU that runs the probe through vLLM's own cache-write op, which
  refuses a tiled layout (AMX with bf16).
"""

from __future__ import annotations

import torch

from .config import TreeConfigError


def check_at_startup(runner, target_layers, draft_layers) -> None:
    """``runner``: the tree model runner after vLLM allocated the KV cache."""
    ctx = runner.compilation_config.static_forward_context
    dtype = runner.model_config.dtype
    for name in target_layers:
        layer = ctx[name]
        check_attention_layer(name, layer, dtype)
        kv_views = getattr(layer.impl, "kv_views", None)
        if kv_views is not None:
            kv_views(layer, layer_kv(layer))  # as the tree rows will read it (CPU: probes the K layout)
        runner.kv_views(layer_kv(layer))  # as the accepted-path KV move will read it
    for name in draft_layers:
        runner.kv_views(layer_kv(ctx[name]))  # as the proposer reads the head's cache


def layer_kv(layer) -> torch.Tensor:
    kv = layer.kv_cache
    return kv[0] if isinstance(kv, list) else kv


def unsupported_attention(layer) -> list[str]:
    """What in this attention layer the tree rows would not compute."""
    impl = layer.impl
    found = []
    if getattr(impl, "alibi_slopes", None) is not None:
        found.append("ALiBi slopes (alibi_slopes)")
    if getattr(impl, "logits_soft_cap", None) not in (None, 0, 0.0):
        found.append(f"logits soft-cap (logits_soft_cap={impl.logits_soft_cap})")
    if getattr(impl, "sinks", None) is not None:
        found.append("attention sinks (sinks)")
    if getattr(impl, "sliding_window", None) not in (None, -1, (-1, -1)):
        found.append(f"sliding window (sliding_window={impl.sliding_window})")
    if type(layer).__name__ == "ChunkedLocalAttention" or getattr(layer, "attention_chunk_size", None):
        found.append(f"chunked local attention (attention_chunk_size={getattr(layer, 'attention_chunk_size', None)})")
    return found


def check_attention_layer(name: str, layer, model_dtype: torch.dtype) -> None:
    found = unsupported_attention(layer)
    if found:
        raise TreeConfigError(f"spec_tree: attention layer {name} uses {', '.join(found)}; the tree rows compute a "
                              "plain scaled softmax, so tree verification would be wrong")
    cache_dtype = str(getattr(layer.impl, "kv_cache_dtype", "auto"))
    kv = layer_kv(layer)
    if cache_dtype not in ("auto", str(model_dtype).removeprefix("torch.")) or kv.dtype != model_dtype:
        raise TreeConfigError(f"spec_tree: attention layer {name} has a {cache_dtype} KV cache of {kv.dtype}, model "
                              f"dtype {model_dtype}: the tree rows read the cache in the model dtype "
                              "(kv_cache_dtype='auto')")
