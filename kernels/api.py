"""The public, dispatching API of the tree kernel module.

Each op validates its arguments (shapes, dtypes, devices: no host sync), then
runs one implementation:

* ``impl="torch"``  the reference in ``reference.py`` (any device);
* ``impl="triton"`` the Triton kernels in ``triton_ops.py`` (CUDA tensors, or
  CPU tensors under ``TRITON_INTERPRET=1``);
* ``impl="cuda"``   the CUDA C++ kernels in ``cuda_ops.py`` (JIT-built);
* ``impl="cpu"``    tree attention only: the host C kernel of ``cpu_attention.py``
  (built at engine startup by ``startup.prepare``);
* ``impl="auto"``   (default) the fastest available for the tensors' device:
  see ``_AUTO_PREFERENCE``; on CPU the reference, except tree attention,
  which takes the host kernel once it is built (3.7-6x the torch path on
  2 cores: ``python -m spec_plugins.kernel_bench.cpu_attention``).

``SPEC_TREE_KERNELS_IMPL`` overrides ``auto`` process-wide (``resolve_impl``,
which tree attention honours too).

Value checks that need the data (NaN scores, an open tree) cost a host sync
and run only with ``validate=True`` (the default); engine hot paths pass
``validate=False`` after validating their configuration at startup. Even
unvalidated, NaN scores rank last and never open the tree.
"""

from __future__ import annotations

import functools
import os
from typing import Sequence

import torch

from . import reference
from .kv_layout import TiledKV
from .modes import MAX_TREE_NODES, TreeMaskMode, max_nodes, parse_mask_mode
from .reference import TreeBuild, VerifyResult
from .tree_shape import check_positive as _check_positive
from .tree_shape import parent_list_width, pool_size, validate_tree_shape  # noqa: F401  (the public API)
from .triton_launch import triton_interpreting

IMPLS = ("torch", "triton", "cuda", "cpu")
# Per op, the faster GPU implementation as measured on an H200 (results/): CUDA
# wins build, verify and the KV move (one launch for all layers); selection has
# no CUDA kernel.
_AUTO_PREFERENCE = {
    "select": ("triton", "torch"),
    "build": ("cuda", "triton", "torch"),
    "verify": ("cuda", "triton", "torch"),
    "verify_sampling": ("cuda", "triton", "torch"),
    "move_kv": ("cuda", "triton", "torch"),
    "attention": ("triton", "torch"),  # tree attention (``attention.py``): no CUDA C++ kernel
    "block_tree": ("triton", "torch"),  # DDTree's block tree (``block_tree.py``): no CUDA C++ kernel
    "from_parents": ("triton", "torch"),  # tree_from_parents: 1 launch vs ~120 ops (not timed on a GPU yet); no C++
    "recurrent": ("triton", "torch"),  # recurrent layers over a tree (``recurrent_tree.py``): one launch per op; no C++
    "keyed_randoms": ("triton", "torch"),  # the sampled walk's hashed randoms: 1 launch vs ~50 per vocab chunk; no C++
}
# The implementations an op accepts where not all of IMPLS: asked for another
# one it raises ValueError, and ``SPEC_TREE_KERNELS_IMPL`` naming another one
# leaves the op on ``auto``. (Selection accepts "cuda" and runs the reference.)
_OP_IMPLS = {"attention": ("torch", "triton", "cpu"), "block_tree": ("torch", "triton"),
             "recurrent": ("torch", "triton"), "keyed_randoms": ("torch", "triton")}  # others: no "cpu"
_OP_IMPLS.update({op: ("torch", "triton", "cuda") for op in _AUTO_PREFERENCE if op not in _OP_IMPLS})
IMPL_ENV = "SPEC_TREE_KERNELS_IMPL"


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Triton is installed and imports. A missing or broken Triton is the
    environment's (the reference still works); an error in our own Triton
    module is ours and raises, so it never turns into a quiet fallback or a
    skipped test."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:
        return False
    from . import triton_ops  # noqa: F401
    return True


def triton_usable(device: torch.device) -> bool:
    if not triton_available():
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and triton_interpreting()


def cpu_attention_usable() -> bool:
    from . import cpu_attention

    return cpu_attention.available()


def cuda_usable(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    from . import cuda_ops

    return cuda_ops.available()


def resolve_impl(op: str, impl: str, device: torch.device) -> str:
    """Pick the implementation for ``op`` on ``device`` (see module doc): the
    one rule every op, tree attention included, dispatches by."""
    accepted = _OP_IMPLS.get(op, IMPLS)
    if impl == "auto":
        forced = os.environ.get(IMPL_ENV, "auto")
        impl = "auto" if forced in IMPLS and forced not in accepted else forced
    if impl == "auto":
        if device.type != "cuda":
            return "cpu" if op == "attention" and device.type == "cpu" and cpu_attention_usable() else "torch"
        for choice in _AUTO_PREFERENCE[op]:
            if choice == "torch" or (choice == "triton" and triton_usable(device)) or (
                choice == "cuda" and cuda_usable(device)
            ):
                return choice
        return "torch"
    if impl not in accepted:
        raise ValueError(f"impl must be one of {('auto',) + accepted}, got {impl!r}")
    if impl == "triton" and not triton_usable(device):
        raise RuntimeError(
            f"impl='triton' needs CUDA tensors or TRITON_INTERPRET=1 for CPU tensors "
            f"(device={device}, triton importable={triton_available()})"
        )
    if impl == "cuda" and not cuda_usable(device):
        raise RuntimeError(f"impl='cuda' needs CUDA tensors and a built CUDA extension (device={device})")
    if impl == "cpu" and not (device.type == "cpu" and cpu_attention_usable()):
        from . import cpu_attention

        raise RuntimeError(f"impl='cpu' needs CPU tensors and the built host kernel (device={device}; "
                           f"cpu_attention.build(): {cpu_attention.build_error() or 'not called'})")
    return impl


def _implementation(op: str, impl: str, device: torch.device):
    """The module whose functions run ``op`` (``resolve_impl``): ``reference``,
    ``triton_ops`` or ``cuda_ops``, each with the op's reference signature.
    Imported here, on first use, because each needs its own toolchain."""
    which = resolve_impl(op, impl, device)
    if which == "triton":
        from . import triton_ops

        return triton_ops
    if which == "cuda":
        from . import cuda_ops

        return cuda_ops
    return reference


# ---------------------------------------------------------------- validation


def _check_tensor(name: str, t, ndim: int, dtypes: tuple, device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} like the other inputs")


# ----------------------------------------------------------------------- ops


def select_tree_nodes(
    scores: torch.Tensor,
    parent_list: torch.Tensor,
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
    *,
    validate: bool = True,
    impl: str = "auto",
) -> torch.Tensor:
    """Choose the T - 1 best draft candidates as a closed tree (EAGLE-2).

    scores:      [B, P] float16/bfloat16/float32/float64, P = K + (S-1)*K^2,
                 cumulative path scores in SGLang's pool order (step-major;
                 within a later step, survivor-major then child).
    parent_list: [B, 1 + (S-1)*K] int64 ([B, 0] when S == 1), SGLang's
                 parent_list: pool index of the parent of each group of K.
    Returns:     [B, T - 1] int64 pool indices, ascending (SGLang's
                 ``top_scores_index``). Ties rank the shallower candidate, then
                 the lower pool index, first; every selected candidate's parent
                 is selected or is the root. Equals SGLang's selection whenever
                 the T-1 best scores are strictly ordered.
    """
    _check_positive("topk", topk)
    _check_positive("num_steps", num_steps)
    _check_positive("num_draft_tokens", num_draft_tokens)
    _check_tensor("scores", scores, 2, (torch.float16, torch.bfloat16, torch.float32, torch.float64))
    _check_tensor("parent_list", parent_list, 2, (torch.int64,), scores.device)
    batch, pool = scores.shape
    if pool != pool_size(topk, num_steps):
        raise ValueError(
            f"scores has {pool} candidates per request; topk={topk}, num_steps={num_steps} "
            f"give {pool_size(topk, num_steps)}"
        )
    if tuple(parent_list.shape) != (batch, parent_list_width(topk, num_steps)):
        raise ValueError(
            f"parent_list must have shape {(batch, parent_list_width(topk, num_steps))}, "
            f"got {tuple(parent_list.shape)}"
        )
    if num_draft_tokens - 1 > pool:
        raise ValueError(
            f"num_draft_tokens={num_draft_tokens} asks for {num_draft_tokens - 1} nodes from a pool "
            f"of {pool} candidates (topk={topk}, num_steps={num_steps})"
        )
    if validate:
        if bool(torch.isnan(scores).any()):
            raise ValueError("scores contain NaN: the draft's probabilities are broken")
        _check_parent_list_values(parent_list, topk, num_steps)
    scores = torch.nan_to_num(scores.float(), nan=float("-inf"))
    if batch == 0 or num_draft_tokens == 1:
        return torch.empty(batch, num_draft_tokens - 1, dtype=torch.int64, device=scores.device)
    which = resolve_impl("select", impl, scores.device)
    if which == "triton":
        from . import triton_ops

        return triton_ops.select_tree_nodes(scores, parent_list, topk, num_steps, num_draft_tokens)
    return reference.select_tree_nodes(scores, parent_list, topk, num_steps, num_draft_tokens)


def _check_parent_list_values(parent_list: torch.Tensor, topk: int, num_steps: int) -> None:
    """Group g >= 1 (expansion at step s = 1 + (g - 1) // K) must name a pool
    index of step s - 1, and group 0 must be the root sentinel -1."""
    if parent_list.shape[1] == 0:
        return
    groups = torch.arange(parent_list.shape[1], device=parent_list.device)
    step = torch.where(groups == 0, 0, 1 + (groups - 1) // topk)
    bounds = torch.tensor([(-1, 0)] + reference.pool_step_bounds(topk, num_steps), device=parent_list.device)
    lo, hi = bounds[step, 0], bounds[step, 1]  # parent of a step-s group lives in step s-1
    bad = (parent_list < lo) | (parent_list >= hi)
    if bool(bad.any()):
        b, g = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"parent_list[{b}, {g}] = {int(parent_list[b, g])} is not a candidate of the previous "
            f"draft step (expected in [{int(lo[g])}, {int(hi[g])}))"
        )


def build_tree(
    selected_index: torch.Tensor,
    parent_list: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    mode: "TreeMaskMode | int | str" = TreeMaskMode.QLEN_ONLY,
    *,
    seq_lens_sum: int | None = None,
    fill_prefix_mask: bool = True,
    tree_mask_buf: torch.Tensor | None = None,
    validate: bool = True,
    impl: str = "auto",
) -> TreeBuild:
    """Positions, retrieve links and the tree mask for B requests of T nodes.

    selected_index: [B, T - 1] int64 pool indices (``select_tree_nodes``);
                    node i + 1 is candidate selected_index[:, i], node 0 the root.
    parent_list:    as for ``select_tree_nodes``.
    seq_lens:       [B] int64 committed context length per request.
    mode:           a ``TreeMaskMode`` (layouts in ``modes``).
    seq_lens_sum:   sum(seq_lens) as a host int (FULL_MASK only; computed with
                    a host sync when omitted).
    fill_prefix_mask: FULL_MASK only: write True into the prefix columns.
                    Pass False when the consumer never reads them.
    tree_mask_buf:  optional preallocated mask buffer (large enough).
    Returns ``TreeBuild``; with validate=True raises ValueError on a selection
    that is not a closed tree.
    """
    mode = parse_mask_mode(mode)
    _check_positive("topk", topk)
    _check_positive("num_steps", num_steps)
    _check_tensor("selected_index", selected_index, 2, (torch.int64,))
    device = selected_index.device
    _check_tensor("parent_list", parent_list, 2, (torch.int64,), device)
    _check_tensor("seq_lens", seq_lens, 1, (torch.int64,), device)
    batch, num_selected = selected_index.shape
    nodes = num_selected + 1
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for {batch} requests in selected_index")
    if tuple(parent_list.shape) != (batch, parent_list_width(topk, num_steps)):
        raise ValueError(
            f"parent_list must have shape {(batch, parent_list_width(topk, num_steps))}, "
            f"got {tuple(parent_list.shape)}"
        )
    if nodes > max_nodes(mode):
        raise ValueError(f"num_draft_tokens={nodes} exceeds mask mode {mode.name}'s limit of {max_nodes(mode)}")
    if num_selected > pool_size(topk, num_steps):
        raise ValueError(
            f"selected_index has {num_selected} nodes per request, more than the pool of "
            f"{pool_size(topk, num_steps)} (topk={topk}, num_steps={num_steps})"
        )
    if mode == TreeMaskMode.FULL_MASK and seq_lens_sum is None:
        seq_lens_sum = int(seq_lens.sum())
    seq_lens_sum = int(seq_lens_sum or 0)
    if validate:
        pool = pool_size(topk, num_steps)
        if bool(((selected_index < 0) | (selected_index >= pool)).any()):
            raise ValueError(f"selected_index has entries outside the candidate pool [0, {pool})")
        _check_parent_list_values(parent_list, topk, num_steps)
    out, ok = _implementation("build", impl, device).build_tree(
        selected_index, parent_list, seq_lens, topk, num_steps, mode, seq_lens_sum, fill_prefix_mask, tree_mask_buf
    )
    if validate and not bool(ok.all()):
        bad = int((~ok).nonzero()[0, 0])
        raise ValueError(
            f"selection of request {bad} is not a closed tree of depth <= num_steps={num_steps}: "
            f"some node's parent candidate was not selected (selected_index[{bad}] = "
            f"{selected_index[bad].tolist()})"
        )
    return out


def tree_from_parents(
    parent: torch.Tensor,
    seq_lens: torch.Tensor,
    mode: "TreeMaskMode | int | str" = TreeMaskMode.ANCESTOR_BITMASK,
    *,
    max_depth: int | None = None,
    validate: bool = True,
    impl: str = "auto",
) -> TreeBuild:
    """``build_tree``'s outputs for trees given as parent pointers.

    For engines that keep each request's tree as parents (vLLM: a request's
    drafts may be cut to a BFS prefix by the scheduler, and a prefix of a
    parents array is still a tree).
    parent:   [B, T] int64 node-local parent, -1 for the root (node 0); every
              parent must precede its child.
    seq_lens: [B] int64 committed context length (positions = seq_lens + depth).
    mode:     any mode but FULL_MASK (whose prefix columns need the context).
    max_depth: levels climbed (default T - 1); a node deeper than that gets
              depth max_depth + 1 and misses its upper ancestors.
    validate: check the parents (reads the device); a caller whose parents
              are trees by construction (its own drafter's) passes False, so
              the build stays on the device (no host sync, capturable).
    impl:     "torch" the reference (~120 small ops: ``ancestor_matrix`` climbs
              one level per op group); "triton" one launch
              (``triton_ops.tree_from_parents``); "cuda" has no C++ kernel of
              its own and runs the Triton one where Triton is usable (else the
              reference); "auto" Triton on CUDA, the reference elsewhere
              (``SPEC_TREE_KERNELS_IMPL`` honoured where Triton can run: on
              host tensors outside the interpreter "auto" is the reference).
              Every implementation returns the same bits.
    Raises ValueError on a parents array that is not such a tree.
    """
    mode = parse_mask_mode(mode)
    if mode == TreeMaskMode.FULL_MASK:
        raise ValueError("tree_from_parents does not build FULL_MASK; use a compact mode")
    _check_tensor("parent", parent, 2, (torch.int64,))
    _check_tensor("seq_lens", seq_lens, 1, (torch.int64,), parent.device)
    batch, nodes = parent.shape
    if nodes < 1 or nodes > max_nodes(mode):
        raise ValueError(f"trees must have 1..{max_nodes(mode)} nodes for mask mode {mode.name}, got {nodes}")
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries for {batch} trees")
    if validate and (bool((parent[:, 0] != -1).any()) or bool(
            ((parent[:, 1:] < 0) | (parent[:, 1:] >= torch.arange(1, nodes, device=parent.device))).any())):
        raise ValueError(f"parent must be -1 for node 0 and in [0, i) for node i, got {parent.tolist()}")
    max_depth = nodes - 1 if max_depth is None else max_depth
    if impl == "auto" and not triton_usable(parent.device):
        impl = "torch"  # host tensors (V1 builds its trees on the host): the reference, whatever IMPL_ENV forces
    which = resolve_impl("from_parents", impl, parent.device)
    if which == "cuda":  # no C++ kernel of its own: the GPU's one launch
        which = "triton" if triton_usable(parent.device) else "torch"
    return _implementation("from_parents", which, parent.device).tree_from_parents(parent, seq_lens, mode, max_depth)


def node_parents(selected_index: torch.Tensor, parent_list: torch.Tensor, topk: int,
                 validate: bool = True) -> torch.Tensor:
    """[B, T] int64 node-local parents (-1 root) of a closed selection.

    selected_index / parent_list as for ``build_tree``. Raises ValueError when
    some node's parent candidate was not selected (an open tree); the check
    reads the device, so a caller whose selection is closed by construction
    (``select_tree_nodes``) passes ``validate=False``.
    """
    parent, found = reference.node_parents(selected_index, parent_list, topk)
    if validate and not bool(found.all()):
        raise ValueError(f"selection is not ancestor-closed: {selected_index.tolist()}")
    return parent


def _check_verify_tree(
    candidates: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    num_steps: int,
    **node_arrays: torch.Tensor,
) -> None:
    """The inputs both verify ops walk: candidates, the links and any other
    ``node_arrays`` (by name), all [B, T] int64 on candidates' device with
    1 <= T <= MAX_TREE_NODES, and a positive num_steps."""
    _check_positive("num_steps", num_steps)
    _check_tensor("candidates", candidates, 2, (torch.int64,))
    links = {"retrieve_next_token": retrieve_next_token, "retrieve_next_sibling": retrieve_next_sibling}
    for name, t in {**links, **node_arrays}.items():
        _check_tensor(name, t, 2, (torch.int64,), candidates.device)
        if t.shape != candidates.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, candidates has {tuple(candidates.shape)}")
    if candidates.shape[1] < 1 or candidates.shape[1] > MAX_TREE_NODES:
        raise ValueError(f"candidates must have 1..{MAX_TREE_NODES} nodes per request, got {candidates.shape[1]}")


def verify_tree_greedy(
    candidates: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
    num_steps: int,
    *,
    impl: str = "auto",
) -> VerifyResult:
    """Greedy tree walk (SGLang's ``verify_tree_greedy``, node-local indices).

    candidates:     [B, T] int64 node tokens (node 0 = the root/bonus token).
    retrieve_next_token / retrieve_next_sibling: [B, T] int64 from ``build_tree``.
    target_predict: [B, T] int64 target argmax at every node.
    num_steps:      D; the accepted-path arrays are D + 1 wide.
    Returns ``VerifyResult`` (accept_index [B, D+1] int32, accept_length [B]
    int32, accept_tokens [B, D+1] int64).
    """
    _check_verify_tree(candidates, retrieve_next_token, retrieve_next_sibling, num_steps, target_predict=target_predict)
    return _implementation("verify", impl, candidates.device).verify_tree_greedy(
        candidates, retrieve_next_token, retrieve_next_sibling, target_predict, num_steps
    )


def verify_tree_sampling(
    candidates: torch.Tensor,
    retrieve_next_token: torch.Tensor,
    retrieve_next_sibling: torch.Tensor,
    target_probs: torch.Tensor,
    coins: torch.Tensor,
    exponentials: torch.Tensor,
    num_steps: int,
    *,
    impl: str = "auto",
) -> VerifyResult:
    """Tree walk for sampled requests: target-only recursive rejection
    (``reference.verify_tree_sampling`` is the specification).

    candidates:     [B, T] int64 node tokens (node 0 = the root).
    retrieve_next_token / retrieve_next_sibling: [B, T] int64 from ``build_tree``.
    target_probs:   [B, T, V] float32 | float64, the target's distribution at
                    every node after temperature / top-k / top-p / min-p.
    coins:          [B, T] same dtype, U[0, 1), one per node (used when the
                    node is tested as a child).
    exponentials:   [B, V] same dtype, Exp(1), one per token per request (the
                    final draw: argmax p_res / exponentials).
    num_steps:      D >= the tree depth; outputs are D + 1 wide.
    impl:           as for the other ops ("auto": CUDA, else Triton on a GPU;
                    the reference on the CPU).
    Every implementation consumes the same randoms and returns the same result.
    Returns ``VerifyResult``: accept_tokens = accepted drafts, then the drawn token.
    """
    _check_verify_tree(candidates, retrieve_next_token, retrieve_next_sibling, num_steps)
    device = candidates.device
    _check_tensor("target_probs", target_probs, 3, (torch.float32, torch.float64), device)
    batch, nodes = candidates.shape
    if tuple(target_probs.shape[:2]) != (batch, nodes):
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}, expected [{batch}, {nodes}, V]")
    vocab = target_probs.shape[2]
    for name, t, shape in (("coins", coins, (batch, nodes)), ("exponentials", exponentials, (batch, vocab))):
        _check_tensor(name, t, 2, (target_probs.dtype,), device)
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {list(shape)}")
    if vocab < 1:
        raise ValueError(f"target_probs has shape {tuple(target_probs.shape)}: the vocabulary V must be at least 1")
    return _implementation("verify_sampling", impl, device).verify_tree_sampling(
        candidates, retrieve_next_token, retrieve_next_sibling, target_probs.contiguous(), coins.contiguous(),
        exponentials.contiguous(), num_steps,
    )  # fmt: skip


def distinct_views(caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``caches`` without repeats of one view (same address, shape, strides and
    element size: the same bytes, whatever the dtype).

    The move is not idempotent when a path's sources and destinations overlap
    (path [0, 2, 5]: a second pass reads node 5's row from node 2's slot and
    writes it into depth 1), and one launch over a view listed twice races.
    Engines can list one storage twice (vLLM's KV-sharing layers join their
    target layer's cache group with the same tensor), so repeats are dropped.
    """
    seen, unique = set(), []
    for cache in caches:
        key = (cache.data_ptr(), tuple(cache.shape), cache.stride(), cache.element_size())  # same bytes
        if key not in seen:
            seen.add(key)
            unique.append(cache)
    return unique


def move_accepted_kv(
    caches: Sequence[torch.Tensor],
    verify_slots: torch.Tensor,
    accept_index: torch.Tensor,
    accept_length: torch.Tensor,
    *,
    impl: str = "auto",
) -> None:
    """Compact each request's accepted path to the front of its verify slots.

    caches:       per-layer K and V tensors, each viewed as
                  [num_blocks, block_size, H, D] (slot s lives at
                  [s // block_size, s % block_size]; any strides, e.g. vLLM's
                  flash layout ``kv[0]``, vLLM CPU's ``[blocks, H, bs, D]``
                  permuted, SGLang's token pool ``[slots, H, D].unsqueeze(1)``),
                  or ``kv_layout.TiledKV`` (vLLM-CPU's AMX tiles): those
                  are moved by the reference's indexing whatever ``impl``
                  (the Triton and CUDA moves address strided views only).
    verify_slots: [B, T] int64 slot of each verify node.
    accept_index: [B, D + 1] int32/int64 node indices (root first, -1 padded).
    accept_length:[B] int32/int64 accepted draft nodes.
    In place: the slot of depth d receives node accept_index[d]'s row, for
    d <= accept_length; safe although sources and destinations overlap. A view
    listed more than once is moved once (``distinct_views``).
    """
    _check_tensor("verify_slots", verify_slots, 2, (torch.int64,))
    device = verify_slots.device
    _check_tensor("accept_index", accept_index, 2, (torch.int32, torch.int64), device)
    _check_tensor("accept_length", accept_length, 1, (torch.int32, torch.int64), device)
    if accept_index.shape[0] != verify_slots.shape[0] or accept_length.shape[0] != verify_slots.shape[0]:
        raise ValueError(
            f"batch sizes differ: verify_slots {verify_slots.shape[0]}, accept_index "
            f"{accept_index.shape[0]}, accept_length {accept_length.shape[0]}"
        )
    caches = list(caches)
    for i, cache in enumerate(caches):
        if not isinstance(cache, (torch.Tensor, TiledKV)) or cache.dim() != 4:
            raise ValueError(f"caches[{i}] must be a 4-D [num_blocks, block_size, H, D] tensor view or a TiledKV, "
                             f"got {type(cache).__name__}")
        if cache.device != device:
            raise ValueError(f"caches[{i}] is on {cache.device}, verify_slots on {device}")
    if not caches or verify_slots.shape[0] == 0:
        return
    caches = distinct_views(caches)
    tiled = [cache for cache in caches if isinstance(cache, TiledKV)]
    if tiled:
        reference.move_accepted_kv(tiled, verify_slots, accept_index, accept_length)
        caches = [cache for cache in caches if not isinstance(cache, TiledKV)]
    if caches:
        _implementation("move_kv", impl, device).move_accepted_kv(caches, verify_slots, accept_index, accept_length)
