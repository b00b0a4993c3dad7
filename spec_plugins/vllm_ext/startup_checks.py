"""Checks the tree runner runs once at startup (``initialize_kv_cache``).

Everything about the layout and the attention layers is decided when the KV
cache is allocated, so it is checked there: a configuration the tree rows
cannot serve stops the engine before it takes a request, instead of killing
the first request and everything in flight with it.

* Every target attention layer is one the tree rows compute exactly: its
  sliding window, attention sinks, logit soft-cap and ALiBi slopes are read
  off vLLM's impl into ``impl.tree_features`` (what the tree kernels take per
  layer, for the verify rows and, on the head's layers, the draft steps); the
  variants the kernels do not compute or that have no end-to-end test
  (``REFUSED_LAYER_FEATURES``: sqrt-ALiBi; chunked local attention) are
  refused, and so is a KV cache in another dtype than the model's
  (``tree_attention`` requires cache dtype == query dtype).
* The K/V layout of every cache the runner or the tree rows read is resolved
  now: on CPU that runs the probe through vLLM's own cache-write op. Strided
  layouts ("vec", "vec16") give plain views, AMX's tiles (bf16 on a CPU with
  AMX) ``TiledKV`` views (``spec_tree_kernels.kv_layout``: the torch paths of
  the tree rows, the draft steps and the KV move read them); a layout that is
  no tiling of strided tokens and dims is refused, naming the isa.

Then ``warm_tree_kernels`` launches every Triton kernel variant serving can
make (``spec_tree_kernels.startup.warm_up``), so none JIT-compiles inside a
step.
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
        layer = ctx[name]
        layer.impl.tree_features = tree_features(name, layer)  # the head's draft steps pass them too
        runner.kv_views(layer_kv(layer))  # as the proposer reads the head's cache


def layer_kv(layer) -> torch.Tensor:
    kv = layer.kv_cache
    return kv[0] if isinstance(kv, list) else kv


# impl attribute -> (what it is, used?) for attention variants tree mode does not serve. Windows, sinks,
# soft-caps (Gemma-2) and ALiBi slopes (BLOOM) the tree kernels compute and have their end-to-end tests
# (tests/model/test_vllm_tree_oracle.py); Step1's sqrt-ALiBi (bias slope * sqrt(distance), vLLM's
# ``use_alibi_sqrt``: its Triton backends only) the kernels do not compute.
REFUSED_LAYER_FEATURES = {
    "use_alibi_sqrt": ("sqrt-ALiBi (use_alibi_sqrt)", bool),
}


def unsupported_attention(layer) -> list[str]:
    """What in this attention layer tree mode does not serve."""
    impl = layer.impl
    found = [what.format(getattr(impl, attr)) for attr, (what, used) in REFUSED_LAYER_FEATURES.items()
             if used(getattr(impl, attr, None))]
    if type(layer).__name__ == "ChunkedLocalAttention" or getattr(layer, "attention_chunk_size", None):
        found.append(f"chunked local attention (attention_chunk_size={getattr(layer, 'attention_chunk_size', None)})")
    return found


def tree_features(name: str, layer) -> dict:
    """The layer's sliding window, sinks, logit soft-cap and ALiBi slopes as
    the tree kernels take them (``window`` / ``sinks`` / ``soft_cap`` /
    ``alibi_slopes``: ``TreeAttentionPlan.run`` / ``BranchAttentionPlan.run`` /
    ``cpu_attention.run_branch`` keywords), read once off vLLM's impl after the
    weights are loaded (sinks are weights). vLLM-CPU's impl stores "no soft-cap"
    as 0 and the slopes as a CPU float32 tensor (``CPUAttentionBackendImpl``):
    ``features_from_vllm`` drops the former and puts the latter on the cache's
    device."""
    from spec_tree_kernels.attention_reference import features_from_vllm

    impl = layer.impl
    try:
        features = features_from_vllm(getattr(impl, "sliding_window", None), getattr(impl, "sinks", None),
                                      getattr(impl, "logits_soft_cap", None), getattr(impl, "alibi_slopes", None),
                                      device=layer_kv(layer).device)
    except ValueError as e:
        raise TreeConfigError(f"spec_tree: attention layer {name}: {e}") from None
    return {key: value for key, value in features.items() if value is not None}


def check_attention_layer(name: str, layer, model_dtype: torch.dtype) -> None:
    found = unsupported_attention(layer)
    if found:
        raise TreeConfigError(f"spec_tree: attention layer {name} uses {', '.join(found)}, which tree mode does not "
                              "serve yet (no end-to-end test of a model with it)")
    layer.impl.tree_features = tree_features(name, layer)
    cache_dtype = str(getattr(layer.impl, "kv_cache_dtype", "auto"))
    kv = layer_kv(layer)
    if cache_dtype not in ("auto", str(model_dtype).removeprefix("torch.")) or kv.dtype != model_dtype:
        raise TreeConfigError(f"spec_tree: attention layer {name} has a {cache_dtype} KV cache of {kv.dtype}, model "
                              f"dtype {model_dtype}: the tree rows read the cache in the model dtype "
                              "(kv_cache_dtype='auto')")


def warm_tree_kernels(runner, target_layers, draft_layers):
    """Launch once every Triton variant the runner's steps can make (on CUDA:
    tree attention and selection, or a block drafter's tree build, and the
    walks and the KV move where the CUDA ops did not build; on the host CPU
    nothing unless SPEC_TREE_KERNELS_IMPL=triton).

    What varies mid-serving is covered: the scheduler cuts a request's drafts
    to any BFS prefix (every tree size 2..T), the adaptive budget drafts each
    menu shape, batches group trees by size (1..max_num_seqs) and contexts
    grow to max_model_len (the split-KV plan follows both). Every layer with
    tree rows takes part (the head's too: its extend runs them), read through
    its real cache views; the head's layer also with its draft steps' kernel
    (every shape's K and levels). Returns ``spec_tree_kernels.startup.WarmUp``."""
    from spec_tree_kernels.startup import TRITON_OPS, AttentionLayer, ServingConfig, warm_up

    settings = runner.tree_settings
    shapes = [s for s in settings.menu if s is not None] if settings.menu else [settings.shape]
    config = ServingConfig(shapes=shapes, mode=settings.mask_mode, prefix_trim=True,
                           verify_depth=runner.verify_depth, max_batch=runner.scheduler_config.max_num_seqs,
                           max_context_len=runner.max_model_len, vocab_size=runner.model_config.get_vocab_size(),
                           block_drafter=runner.block_drafter)
    ctx = runner.compilation_config.static_forward_context
    group_of = {name: gid for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups)
                for name in group.layer_names}
    layers = []
    for name in [*target_layers, *draft_layers]:
        layer = ctx[name]
        k_view, v_view = layer.impl.kv_views(layer, layer_kv(layer))
        block_table = runner.group_block_table(group_of[name])  # what attn_metadata carries
        layers.append(AttentionLayer(layer.impl.num_heads, k_view, v_view, block_table, layer.impl.tree_impl,
                                     **layer.impl.tree_features))
    kv_caches = [view for name in group_of for view in runner.kv_views(layer_kv(ctx[name]))]  # as the KV move reads
    # the head's draft steps (BranchAttention) read its cache through a kernel of their own
    return warm_up(config, runner.device, impls=dict.fromkeys(TRITON_OPS, runner.tree_impl), layers=layers,
                   kv_caches=kv_caches, draft_layers=layers[len(target_layers):])
