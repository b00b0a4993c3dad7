"""Tree attention for vLLM's verify rows and for the tree drafter's steps.

Verify: the runner publishes the step's trees (``publish_verify_trees``) before
the target forward and withdraws them after the drafter's extend pass (which
runs the head over the same rows). While published, every decoder attention
layer computes the tree requests' rows with the compact tree mask over the
paged KV cache. When every row of the batch is a tree row (steady-state decode)
vLLM's kernel is skipped: each row is computed once. When the batch also holds
prefill or plain decode rows, vLLM's kernel runs over the batch (those rows
are exactly vLLM's) and the tree rows are overwritten.

Uniform decode steps on Model Runner V2 (every request of the batch decodes
one tree of T nodes, T = 1 + num_speculative_tokens: the batches vLLM
replays as FULL CUDA graphs): the trees' description comes from persistent
buffers only (``UniformTrees``): the masks, written by the runner before the
step into a buffer of its own, and vLLM's attention metadata (block table,
sequence lengths). The same function derives the step's trees from them
whether the forward runs eager (the runner publishes a ``UniformStep``) or is
being captured into a FULL graph (nothing published; the stream is
capturing), so the captured forward reads what the eager one reads and a
replay sees each step's trees.

Draft steps: the tree drafter runs vLLM's EAGLE model on the frontier nodes of
every tree with ``BranchAttention`` as the draft layer's attention metadata;
the impl hands the rows to it (committed head KV from the paged cache, branch
KV in a scratch tensor, ancestor mask).

* CPU: ``TreeCPUAttentionBackend`` takes CPU_ATTN's place (the CPU platform
  ignores ``--attention-backend`` and always asks for CPU_ATTN's path, so the
  override of that path is the only way in).
* GPU (vLLM 0.33, written against its source, not executed here):
  ``TreeFlashAttentionBackend`` registered as CUSTOM.

Tree rows go through ``spec_tree_kernels.attention_plan.TreeAttentionPlan``:
planned by the first layer of a step (per tree size), run by every layer;
the host C kernel on CPU (torch where it did not build), the Triton kernels
on CUDA (``TreeRowsMixin.tree_impl``). Draft steps read the committed head KV
in place as well: the host kernel on CPU (``cpu_attention.run_branch``), a
``BranchAttentionPlan`` elsewhere (Triton on CUDA, bounded torch chunks
without Triton).

KV views handed to the kernels are [num_blocks, block_size, Hkv, D]:
CPU cache [num_blocks, Hkv, block_size, 2 * D] holds per block and head
block_size K rows then block_size V rows; FlashAttention's (0.32/0.33) has the
same shape but K | V halves on the last dim. Both backends write the KV cache
outside ``forward`` (``forward_includes_kv_cache_update = False``, checked as a
seam), which is what lets the tree path skip vLLM's kernel.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from vllm.v1.attention.backend import AttentionType

from spec_tree_kernels.attention_plan import TreeAttentionPlan


@dataclass
class VerifyTrees:
    """The step's tree requests, grouped by node count.

    groups: node count T -> (req_indices [B_T] int64 rows of the batch,
    query_starts [B_T] int64 first query token, context_lens [B_T] int64,
    tree_mask in ``mode``'s layout for B_T trees of T nodes).
    max_context: host int >= every context length (sizes the plan); None:
    the block table's reach (a shape, for a captured forward).
    covers_batch: every query row of the step is a tree row.
    first_rows: T -> first query row when the group's B_T * T rows are one
    range in order (its queries and outputs are then views), else None.
    """

    mode: str
    groups: dict
    max_context: int | None = 0
    covers_batch: bool = False
    first_rows: dict = field(default_factory=dict)
    plans: dict = field(default_factory=dict)  # (block table, T, impl) -> (plan, rows), made by the first layer

    def plan(self, nodes: int, block_table: torch.Tensor, block_size: int, impl: str):
        """(TreeAttentionPlan, rows [B_T, T] int64 query rows of those trees'
        nodes) for the trees of ``nodes`` nodes: made by the first layer of the
        step, reused by the others (same block table, same trees)."""
        key = (block_table.data_ptr(), nodes, impl)
        if key not in self.plans:
            req_idx, q_starts, ctx, mask = self.groups[nodes]
            plan = TreeAttentionPlan.create(block_table[req_idx], ctx, mask, self.mode, nodes, block_size,
                                            self.max_context, impl=impl)
            self.plans[key] = plan, q_starts[:, None] + torch.arange(nodes, device=q_starts.device)
        return self.plans[key]


@dataclass
class BranchAttention:
    """Attention metadata of one tree-drafting step (R requests x K frontier nodes).

    Frontier node j of request r attends to the request's committed head KV
    (the paged views ``k_cache`` / ``v_cache`` [num_blocks, block_size, Hkv, D],
    its blocks ``blocks`` [R, nb] int64 covering ``kv_lens`` [R] int64
    positions) and to the branch entries it descends from plus itself
    (``branch_k/branch_v`` [R, E, Hkv, D] scratch, E = (num_steps - 1) * K,
    filled K entries per level). ``ancestors`` [R, K, filled] bool is set by
    the drafter before each level. The committed KV is read in place from the
    paged cache, never copied: ``host_kernel``: the host C kernel
    (``cpu_attention.run_branch``); otherwise ``plan``
    (``spec_tree_kernels.branch_attention.BranchAttentionPlan``: Triton on
    CUDA, 1 launch per level or split + merge = 2; else torch over bounded
    chunks of blocks with an online softmax).
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    blocks: torch.Tensor
    kv_lens: torch.Tensor
    branch_k: torch.Tensor
    branch_v: torch.Tensor
    scale: float
    host_kernel: bool = False
    ancestors: torch.Tensor | None = None
    filled: int = 0
    plan: "BranchAttentionPlan | None" = None  # spec_tree_kernels.branch_attention's (Triton / torch paths)

    @classmethod
    def from_paged(cls, k_cache: torch.Tensor, v_cache: torch.Tensor, block_rows: torch.Tensor,
                   kv_lens: torch.Tensor, max_kv_len: int, branch_entries: int, scale: float,
                   impl: str = "auto") -> "BranchAttention":
        """k_cache / v_cache: the head layer's paged K, V [num_blocks, block_size,
        Hkv, D]; block_rows [R, >= nb] its block table rows; kv_lens [R] int64
        committed positions per request, max_kv_len a host bound on them;
        impl: tree attention's implementation (``spec_tree_kernels`` names)."""
        from spec_tree_kernels import cpu_attention, resolve_impl
        # here, not at import: it defines Triton kernels, which must see TRITON_INTERPRET as set by then
        from spec_tree_kernels.branch_attention import BranchAttentionPlan

        R, hkv, dim = len(kv_lens), k_cache.shape[2], k_cache.shape[3]
        scratch = torch.empty(2, R, branch_entries, hkv, dim, dtype=k_cache.dtype, device=k_cache.device)
        host = (resolve_impl("attention", impl, k_cache.device) == "cpu"
                and cpu_attention.branch_supports(k_cache, v_cache))
        plan = BranchAttentionPlan.create(block_rows, kv_lens, max_kv_len, k_cache.shape[1], impl=impl)
        return cls(k_cache=k_cache, v_cache=v_cache, blocks=plan.blocks, kv_lens=plan.kv_lens,
                   branch_k=scratch[0], branch_v=scratch[1], scale=scale, host_kernel=host, plan=plan)

    @property
    def num_rows(self) -> int:
        """R * K: the level's query rows (set by ``ancestors``)."""
        return self.ancestors.shape[0] * self.ancestors.shape[1]

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, output: torch.Tensor,
               features: dict | None = None):
        """query [R*K, Hq, D], key/value [R*K, Hkv, D] (RoPE applied) -> output [R*K, Hq, D];
        features: the layer's window / sinks (``TreeRowsMixin.tree_features``)."""
        features = features or {}
        R, K = self.ancestors.shape[:2]
        hkv, dim = self.branch_k.shape[2:]
        hq = query.shape[-2]
        new = slice(self.filled, self.filled + K)
        self.branch_k[:, new] = key.view(R, K, hkv, dim).to(self.branch_k.dtype)
        self.branch_v[:, new] = value.view(R, K, hkv, dim).to(self.branch_v.dtype)
        self.filled += K
        dst = output.view(R, K, hq, dim)
        if self.host_kernel and query.dtype == torch.float32:
            from spec_tree_kernels import cpu_attention

            visible = torch.cat([self.ancestors, torch.eye(K, dtype=torch.bool, device=query.device).expand(R, K, K)],
                                -1)
            res = cpu_attention.run_branch(query.view(R, K, hq, dim), self.k_cache, self.v_cache, self.blocks,
                                           self.kv_lens, self.branch_k, self.branch_v, self.filled, visible,
                                           self.scale, out=dst, **features)
            if res is not dst:
                dst.copy_(res)
            return output
        self.plan.run(query.view(R, K, hq, dim), self.k_cache, self.v_cache, self.branch_k, self.branch_v,
                      self.filled, self.ancestors, self.scale, out=dst, **features)
        return output


@dataclass
class UniformTrees:
    """The persistent part of uniform decode steps' trees (module docstring).

    mask: [max_num_reqs, *per request] the compact masks of ``mode`` for
    trees of ``nodes`` nodes, request i of the batch at row i (``batch_mask``
    reads B of them in the mode's own layout), written by the runner before
    each uniform step; rows past the batch hold valid trees (chains, from
    ``create``), so the requests padding a graph's batch read finite rows.
    Everything else comes from the attention metadata of the step:
    block_table [B_pad, nb] and seq_lens [B_pad] (context + nodes; 0 for the
    padding requests), both vLLM's persistent buffers on V2."""

    mode: str
    nodes: int
    mask: torch.Tensor
    _captured: tuple = (None, None)  # (forward context, its VerifyTrees): shared by one captured forward's layers

    @classmethod
    def create(cls, mode: str, nodes: int, max_num_reqs: int, device) -> "UniformTrees":
        import spec_tree_kernels as stk

        chains = torch.arange(-1, nodes - 1, device=device).expand(max_num_reqs, nodes)
        masks = stk.tree_from_parents(chains, torch.zeros(max_num_reqs, dtype=torch.int64, device=device), mode,
                                      max_depth=nodes - 1, validate=False, impl="torch").tree_mask  # once
        return cls(mode=mode, nodes=nodes, mask=masks.reshape(max_num_reqs, -1).clone())

    def batch_mask(self, batch: int) -> torch.Tensor:
        """The first ``batch`` requests' masks in the mode's layout (a view)."""
        from spec_tree_kernels.modes import MODES, parse_mask_mode

        return self.mask[:batch].view(MODES[parse_mask_mode(self.mode)].shape(batch, self.nodes, 0))

    def write(self, masks: torch.Tensor, batch: int) -> None:
        """This step's masks (mode's layout, ``batch`` trees) into rows 0..batch-1."""
        self.mask[:batch] = masks.reshape(batch, -1)

    def step_trees(self, attn_metadata, num_tokens: int, max_context: int | None) -> VerifyTrees:
        """The trees of a uniform batch of ``num_tokens`` query rows, from persistent
        buffers only; max_context: a host bound on the contexts, None for the block
        table's reach (a shape: what a graph captures).

        B, the batch's requests, is the metadata's request count (the length of
        ``seq_lens``, a host shape), at most num_tokens / nodes: a batch run
        piecewise pads its tokens to a graph size but not its requests (V2's
        PIECEWISE mode), so rows past B * nodes are padding, no tree's, and
        the block table and seq_lens hold B rows only."""
        nodes = self.nodes
        batch = min(num_tokens // nodes, attn_metadata.seq_lens.shape[0])
        context = (attn_metadata.seq_lens[:batch].to(torch.int64) - nodes).clamp(min=0)
        rows = torch.arange(batch, dtype=torch.int64, device=context.device)
        return VerifyTrees(mode=self.mode, groups={nodes: (rows, rows * nodes, context, self.batch_mask(batch))},
                           max_context=max_context, covers_batch=True, first_rows={nodes: 0})

    def captured_trees(self, attn_metadata, num_tokens: int) -> VerifyTrees:
        """``step_trees`` for the forward being captured, made by its first layer."""
        from vllm.forward_context import get_forward_context

        context = get_forward_context()
        if self._captured[0] is not context:
            self._captured = (context, self.step_trees(attn_metadata, num_tokens, None))
        return self._captured[1]


@dataclass
class UniformStep:
    """Published for an eager uniform step: its trees come from ``UniformTrees``
    (made by the step's first layer, kept for the others). max_context: a
    host bound on the contexts (sizes the plan), as for ``VerifyTrees``."""

    max_context: int | None = None
    trees: VerifyTrees | None = None


_published: VerifyTrees | UniformStep | None = None
_uniform: UniformTrees | None = None
_capturing = False  # V2 is capturing the target's CUDA graphs (its warm-up forwards included)


def publish_verify_trees(trees: VerifyTrees | UniformStep | None) -> None:
    global _published
    _published = trees


def install_uniform_trees(trees: UniformTrees | None) -> None:
    """The engine's uniform-step buffers (the V2 tree runner, at startup)."""
    global _uniform
    _uniform = trees


@contextlib.contextmanager
def capturing_graphs():
    """Around V2's ``CudaGraphManager.capture`` (the V2 tree runner wraps it):
    each captured batch is first run eager as a warm-up, then captured, both
    with the forward context saying NONE (FULL graphs are recorded by
    ``torch.cuda.graph`` around a plain forward), so neither the context nor a
    published step says it; this flag does."""
    global _capturing
    _capturing = True
    try:
        yield
    finally:
        _capturing = False


def full_graph_capture() -> bool:
    """Is this forward V2's warm-up or capture of a FULL graph's batch? Piecewise
    captures run attention eager between the pieces with the same flag up: only
    uniform batches take the uniform trees (``verify_trees_of`` checks it)."""
    return _capturing


def verify_trees_of(layer, attn_metadata, num_tokens: int) -> VerifyTrees | None:
    """The trees a decoder layer's forward computes rows of, or None."""
    published = _published
    if attn_metadata is None:
        return None
    if isinstance(published, VerifyTrees):  # every decoder layer: V1's head runs over the verify rows too
        return published
    uniform = _uniform
    if uniform is None or getattr(layer, "is_draft_layer", False):  # V2's head runs causal
        return None
    if isinstance(published, UniformStep):
        if published.trees is None:
            published.trees = uniform.step_trees(attn_metadata, num_tokens, published.max_context)
        return published.trees
    if published is None and full_graph_capture():
        uniform_batch = attn_metadata.max_query_len == uniform.nodes and num_tokens % uniform.nodes == 0
        if uniform_batch:
            return uniform.captured_trees(attn_metadata, num_tokens)
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():  # attention inside a graph
            raise RuntimeError(f"spec-plugins: a CUDA graph captures attention over {num_tokens} rows with "
                               f"max_query_len={attn_metadata.max_query_len}: only uniform batches of "
                               f"{uniform.nodes}-node trees can replay tree rows (attention_gpu declares "
                               "UNIFORM_BATCH)")
    return None


def flash_kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention cache [num_blocks, Hkv, block_size, 2D] read as K | V on the
    last dim (flash_attn.py: ``kv_cache.transpose(1, 2).split(head_size, -1)``)."""
    kv = kv_cache.transpose(1, 2)
    head_size = kv.shape[-1] // 2
    return kv[..., :head_size], kv[..., head_size:]


def compute_tree_rows(trees: VerifyTrees, query, output, k_view, v_view, block_table, num_heads: int,
                      head_size: int, scale: float, impl: str, features: dict | None = None) -> None:
    """Write the published trees' rows of ``output`` ([N, Hq*D] or [N, Hq, D]);
    features: the layer's window / sinks (``TreeAttentionPlan.run`` keywords)."""
    features = features or {}
    out = output.view(output.shape[0], num_heads, head_size)
    q_all = query.view(query.shape[0], num_heads, head_size)
    for nodes in trees.groups:
        plan, rows = trees.plan(nodes, block_table, k_view.shape[1], impl)
        first = trees.first_rows.get(nodes)
        if first is not None:  # one range of rows: read and write views, no gather or scatter
            span = slice(first, first + rows.numel())
            dst = out[span].view(-1, nodes, num_heads, head_size)
            res = plan.run(q_all[span].view(-1, nodes, num_heads, head_size), k_view, v_view, scale, out=dst,
                           **features)
            if res is not dst:
                dst.copy_(res)
            continue
        res = plan.run(q_all[rows], k_view, v_view, scale, **features)  # q_all[rows]: [B_T, T, Hq, D]
        out[rows.flatten()] = res.reshape(-1, num_heads, head_size).to(out.dtype)


class TreeRowsMixin:
    """Put before an engine attention impl: tree rows through ``compute_tree_rows``
    (alone when they are the whole batch), draft steps through ``BranchAttention``."""

    tree_impl = "torch"  # spec_tree_kernels.tree_attention implementation
    # the layer's sliding window / sinks as the tree kernels take them, set at startup
    # (startup_checks.tree_features); none until then
    tree_features: dict = {}

    def kv_views(self, layer, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if isinstance(attn_metadata, BranchAttention):  # a tree-drafting step (draft layer only)
            rows = attn_metadata.num_rows  # rows past them pad the batch to a CUDA-graph size: not computed
            attn_metadata.attend(query[:rows], key[:rows], value[:rows], output[:rows], self.tree_features)
            return output
        trees = verify_trees_of(layer, attn_metadata, query.shape[0]) if self.attn_type == AttentionType.DECODER \
            else None
        tree_step = attn_metadata is not None and trees is not None
        if not (tree_step and trees.covers_batch):  # vLLM's rows (the tree rows are recomputed below)
            output = super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale,
                                     output_block_scale)
        if tree_step:
            k_view, v_view = self.kv_views(layer, kv_cache)
            compute_tree_rows(trees, query, output, k_view, v_view, attn_metadata.block_table, self.num_heads,
                              self.head_size, self.scale, impl=self.tree_impl, features=self.tree_features)
        return output


# -------------------------------------------------------------------- startup


def forget_resolved_backends() -> None:
    # vLLM memoizes backend classes per process (selector._cached_get_attn_backend):
    # an engine built earlier in this process would otherwise hand us its class.
    from vllm.v1.attention import selector

    selector._cached_get_attn_backend.cache_clear()


TREE_IMPL_NAMES = ("TreeCPUAttentionImpl", "TreeFlashAttentionImpl")


def check_tree_attention_installed(static_forward_context: dict, layer_names) -> None:
    """Fail at startup if a target attention layer did not get a tree-aware impl."""
    for name in layer_names:
        impl = getattr(static_forward_context.get(name), "impl", None)
        if type(impl).__name__ not in TREE_IMPL_NAMES:
            raise RuntimeError(f"spec-plugins: attention layer {name} uses {type(impl).__name__}, not a tree-aware "
                               "backend: tree verification would be wrong")
