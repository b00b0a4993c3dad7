"""Tree verification through a hybrid model's recurrent layers, validated and
dispatched like the ops of ``api.py``.

Gated DeltaNet (Qwen3.5, Qwen3-Next) and Mamba2 (Nemotron-H) layers carry a
state from token to token and convolve a window of past inputs. In a
verified tree each node continues its own parent, not the row before it:

* ``tree_causal_conv1d``          every node's conv over its ancestor path,
                                  reaching into the committed conv state;
* ``tree_gated_delta_rule``       GDN's recurrence, each node from its parent's state;
* ``tree_selective_state_update`` Mamba2's SSM update, the same way;
* ``commit_path_states`` / ``conv_state_after``  after the walk: the accepted
                                  path's last state and conv window, for the
                                  request's state slot.

Trees are given as parents [R, T] int64: node 0 is the root (parent -1, the
committed context), every other node's parent precedes it (parents[:, t] < t,
which every tree of this module satisfies: BFS order). The ops keep every
node's state ([R, T, H, K, V] float32 for GDN, [R, T, H, P, N] for Mamba2:
T times the request's state per layer) so that the accepted path's state can
be committed after the walk. No op reads a device value on the host and
every shape follows from the inputs' shapes: capturable in a CUDA graph.
``recurrent_tree_reference`` is the specification; the Triton kernels equal
it up to float32 summation order.
"""

from __future__ import annotations

import torch

from . import recurrent_tree_reference as reference
from .api import _check_tensor, resolve_impl
from .recurrent_tree_reference import conv_state_after

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)

__all__ = ["commit_path_states", "conv_state_after", "tree_causal_conv1d", "tree_gated_delta_rule",
           "tree_selective_state_update", "validate_parents"]


def validate_parents(parents: torch.Tensor) -> None:
    """Raise ValueError unless parents [R, T] int64 is a forest of BFS-ordered
    trees (root -1, parents[:, t] in [0, t) otherwise). Reads the device: for
    tests and startup checks, not the step."""
    _check_tensor("parents", parents, 2, (torch.int64,))
    if parents.shape[1] == 0:
        raise ValueError("parents has no nodes: a tree holds at least its root")
    t = torch.arange(parents.shape[1], device=parents.device)
    ok = (parents[:, 0] == -1).all() & ((parents[:, 1:] >= 0) & (parents[:, 1:] < t[1:])).all()
    if not bool(ok):
        raise ValueError(f"parents must hold -1 at the root and an earlier node elsewhere, got {parents.tolist()}")


def _check_rows(parents: torch.Tensor, device: torch.device, **tensors) -> tuple[int, int]:
    _check_tensor("parents", parents, 2, (torch.int64,), device)
    R, T = parents.shape
    for name, (t, lead) in tensors.items():
        if tuple(t.shape[:len(lead)]) != lead:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; its leading dims must be {lead} (parents is [R, T] "
                             f"= [{R}, {T}])")
    return R, T


def tree_causal_conv1d(x: torch.Tensor, parents: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None, activation: str | None = "silu", *,
                       impl: str = "auto") -> torch.Tensor:
    """Depthwise causal conv1d of every tree node over its own ancestor path.

    x:          [R, T, C] float16/bfloat16/float32, the nodes' conv inputs.
    parents:    [R, T] int64 (module doc).
    conv_state: [R, C, S] (S >= W - 1), the request's committed inputs, newest
                last (column S - m is the m-th newest); a state slot's view.
    weight:     [C, W]; weight[:, W - 1] multiplies the node's own input.
    bias:       [C] or None.  activation: "silu" or None.
    Returns [R, T, C] in x's dtype (float32 accumulation).
    """
    _check_tensor("x", x, 3, _FLOATS)
    R, T = _check_rows(parents, x.device, x=(x, tuple(parents.shape)))
    C = x.shape[2]
    _check_tensor("conv_state", conv_state, 3, _FLOATS, x.device)
    _check_tensor("weight", weight, 2, _FLOATS, x.device)
    W = weight.shape[1]
    if weight.shape[0] != C or conv_state.shape[:2] != (R, C) or conv_state.shape[2] < W - 1:
        raise ValueError(f"weight {tuple(weight.shape)} and conv_state {tuple(conv_state.shape)} must be [C, W] and "
                         f"[R, C, S >= W - 1] for x {tuple(x.shape)}")
    if bias is not None:
        _check_tensor("bias", bias, 1, _FLOATS, x.device)
        if bias.shape[0] != C:
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected [{C}]")
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if resolve_impl("recurrent", impl, x.device) == "triton":
        from . import recurrent_tree_triton

        columns = reference.ancestor_columns(parents, W)
        return recurrent_tree_triton.tree_causal_conv1d(
            x.contiguous(), columns.contiguous(), conv_state.contiguous(), weight.float().contiguous(),
            None if bias is None else bias.float().contiguous(), activation)
    return reference.tree_causal_conv1d(x, parents, conv_state, weight, bias, activation)


def tree_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          parents: torch.Tensor, initial_state: torch.Tensor, scale: float | None = None, *,
                          impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's recurrence over a tree (``recurrent_tree_reference``).

    q, k:          [R, T, Hk, K] (already L2-normalized where the model does so).
    v:             [R, T, Hv, V], Hv a multiple of Hk (v head h reads q/k head h // (Hv / Hk)).
    g:             [R, T, Hv] log decay (<= 0);  beta: [R, T, Hv].
    parents:       [R, T] int64 (module doc).
    initial_state: [R, Hv, K, V] float32, each request's committed state.
    scale:         q's scale, default K ** -0.5.
    Returns (out [R, T, Hv, V] in v's dtype, states [R, T, Hv, K, V] float32:
    each node's state after its own token).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 4, _FLOATS, None if name == "q" else q.device)
    R, T = _check_rows(parents, q.device, q=(q, tuple(parents.shape)))
    Hk, K = k.shape[2], k.shape[3]
    Hv, V = v.shape[2], v.shape[3]
    if q.shape != k.shape or v.shape[:2] != (R, T) or Hv % Hk:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: q and k must be [R, T, Hk, K] "
                         f"and v [R, T, Hv, V] with Hv a multiple of Hk")
    for name, t in (("g", g), ("beta", beta)):
        _check_tensor(name, t, 3, _FLOATS, q.device)
        if t.shape != (R, T, Hv):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [R, T, Hv] = {(R, T, Hv)}")
    _check_tensor("initial_state", initial_state, 4, (torch.float32,), q.device)
    if initial_state.shape != (R, Hv, K, V):
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected [R, Hv, K, V] = "
                         f"{(R, Hv, K, V)}")
    scale = K ** -0.5 if scale is None else float(scale)
    if resolve_impl("recurrent", impl, q.device) == "triton":
        from . import recurrent_tree_triton

        return recurrent_tree_triton.tree_gated_delta_rule(
            q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(), parents.contiguous(),
            initial_state.contiguous(), scale)
    return reference.tree_gated_delta_rule(q, k, v, g, beta, parents, initial_state, scale)


def tree_selective_state_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                                C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, parents: torch.Tensor,
                                initial_state: torch.Tensor, z: torch.Tensor | None = None, dt_softplus: bool = True,
                                *, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba2's selective state update over a tree (``recurrent_tree_reference``).

    x:             [R, T, H, P];  z: [R, T, H, P] or None (gate: y * silu(z)).
    dt:            [R, T, H];  A, D, dt_bias: [H] (A negative: A = -exp(A_log)).
    B, C:          [R, T, G, N], H a multiple of G (head h reads group h // (H / G)).
    parents:       [R, T] int64 (module doc).
    initial_state: [R, H, P, N] float32, each request's committed state.
    Returns (out [R, T, H, P] in x's dtype, states [R, T, H, P, N] float32).
    """
    _check_tensor("x", x, 4, _FLOATS)
    R, T = _check_rows(parents, x.device, x=(x, tuple(parents.shape)))
    H, P = x.shape[2], x.shape[3]
    _check_tensor("dt", dt, 3, _FLOATS, x.device)
    if dt.shape != (R, T, H):
        raise ValueError(f"dt has shape {tuple(dt.shape)}, expected [R, T, H] = {(R, T, H)}")
    for name, t in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        _check_tensor(name, t, 1, _FLOATS, x.device)
        if t.shape != (H,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected [H] = [{H}]")
    for name, t in (("B", B), ("C", C)):
        _check_tensor(name, t, 4, _FLOATS, x.device)
        if t.shape[:2] != (R, T) or t.shape != B.shape or H % B.shape[2]:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: B and C must be [R, T, G, N] with H = {H} a "
                             f"multiple of G")
    N = B.shape[3]
    if z is not None:
        _check_tensor("z", z, 4, _FLOATS, x.device)
        if z.shape != x.shape:
            raise ValueError(f"z has shape {tuple(z.shape)}, expected x's {tuple(x.shape)}")
    _check_tensor("initial_state", initial_state, 4, (torch.float32,), x.device)
    if initial_state.shape != (R, H, P, N):
        raise ValueError(f"initial_state has shape {tuple(initial_state.shape)}, expected [R, H, P, N] = "
                         f"{(R, H, P, N)}")
    if resolve_impl("recurrent", impl, x.device) == "triton":
        from . import recurrent_tree_triton

        return recurrent_tree_triton.tree_selective_state_update(
            x.contiguous(), dt.contiguous(), A.float().contiguous(), B.contiguous(), C.contiguous(),
            D.float().contiguous(), dt_bias.float().contiguous(), parents.contiguous(), initial_state.contiguous(),
            None if z is None else z.contiguous(), dt_softplus)
    return reference.tree_selective_state_update(x, dt, A, B, C, D, dt_bias, parents, initial_state, z, dt_softplus)


def commit_path_states(node_states: torch.Tensor, last_node: torch.Tensor, state_pool: torch.Tensor,
                       slots: torch.Tensor) -> None:
    """state_pool[slots[r]] = node_states[r, last_node[r]]: the accepted path's
    final state becomes the request's committed one (node_states [R, T, ...]
    from a tree op, last_node [R] int64, state_pool [S, ...], slots [R] int64).
    A scatter on the device: no host read."""
    _check_tensor("last_node", last_node, 1, (torch.int64,), node_states.device)
    _check_tensor("slots", slots, 1, (torch.int64,), node_states.device)
    R = node_states.shape[0]
    if last_node.shape[0] != R or slots.shape[0] != R or state_pool.shape[1:] != node_states.shape[2:]:
        raise ValueError(f"node_states {tuple(node_states.shape)}, last_node {tuple(last_node.shape)}, slots "
                         f"{tuple(slots.shape)}, state_pool {tuple(state_pool.shape)}: expected [R, T, ...], [R], "
                         f"[R] and [S, ...] with the same trailing dims")
    state_pool.index_copy_(0, slots, reference.node_rows(node_states, last_node).to(state_pool.dtype))
