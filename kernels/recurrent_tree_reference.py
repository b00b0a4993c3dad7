"""Tree verification through recurrent layers: the specification (torch).

A hybrid model's recurrent layers (Gated DeltaNet, Mamba2) carry a state from
token to token, and their causal convolution reads a window of past inputs.
A verified tree is not a sequence: node t's state is its parent's state
advanced by node t's input, and its convolution window is the inputs along
its own ancestor path, reaching past the root into the request's committed
conv state. These functions compute exactly that, vectorized over requests
and heads with one step per node (nodes in topological order, parents[:, t] <
t), from shapes alone: no host read, capturable.

``recurrent_tree.py`` validates and dispatches; ``recurrent_tree_triton.py``
computes the same values on a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ancestor_columns(parents: torch.Tensor, width: int) -> torch.Tensor:
    """[R, T] parents (-1: the root's parent, the committed context) ->
    [R, T, width] int64: column j is the node j steps up each node's path
    (column 0 the node itself). Past the root, -m stands for the m-th last
    committed input (-1 the newest)."""
    cols = [torch.arange(parents.shape[1], device=parents.device, dtype=torch.int64).expand_as(parents)]
    for _ in range(width - 1):
        up = cols[-1]
        in_tree = up >= 0
        cols.append(torch.where(in_tree, parents.gather(1, up.clamp(min=0)), up - 1))
    return torch.stack(cols, dim=2)


def _inputs_at(x: torch.Tensor, conv_state: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """x [R, T, C], conv_state [R, C, S] (newest last), columns [R, T', J]
    (``ancestor_columns`` or rows of it) -> [R, T', J, C] float32: the input each column names."""
    R, T, J = columns.shape
    C = x.shape[2]
    committed = conv_state.shape[2]
    from_tree = x.float().gather(1, columns.clamp(min=0).reshape(R, T * J, 1).expand(R, T * J, C))
    back = (committed + columns).clamp(0, committed - 1)  # -m -> committed - m (tree columns: any, unused)
    from_state = conv_state.float().gather(2, back.reshape(R, 1, T * J).expand(R, C, T * J)).transpose(1, 2)
    picked = torch.where((columns >= 0).reshape(R, T * J, 1), from_tree, from_state)
    return picked.reshape(R, T, J, C)


def tree_causal_conv1d(x: torch.Tensor, parents: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None, activation: str | None) -> torch.Tensor:
    """Depthwise causal conv of every node over its ancestor path. weight [C, W]
    (weight[:, W-1] multiplies the node's own input, as torch's conv1d over a
    left-padded sequence); returns [R, T, C] in x's dtype."""
    width = weight.shape[1]
    window = _inputs_at(x, conv_state, ancestor_columns(parents, width))  # [R, T, W, C], column 0 newest
    out = torch.einsum("rtjc,cj->rtc", window, weight.float().flip(1))
    if bias is not None:
        out = out + bias.float()
    if activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype)


def conv_state_after(x: torch.Tensor, parents: torch.Tensor, conv_state: torch.Tensor,
                     last_node: torch.Tensor) -> torch.Tensor:
    """The conv state once the path ending at ``last_node`` [R] is accepted: the
    W-1 newest inputs along that path, oldest first, [R, C, W-1] in conv_state's dtype."""
    R, _, C = x.shape
    keep = conv_state.shape[2]
    columns = ancestor_columns(parents, keep)  # column j: j steps up
    path = columns.gather(1, last_node.reshape(R, 1, 1).expand(R, 1, keep)).flip(2)  # oldest first
    return _inputs_at(x, conv_state, path)[:, 0].transpose(1, 2).to(conv_state.dtype)


def node_rows(per_node: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
    """per_node [R, T, ...], node [R] int64 in [0, T) -> [R, ...]: each request's row of its node."""
    index = node.reshape((-1, 1) + (1,) * (per_node.dim() - 2)).expand((node.shape[0], 1) + per_node.shape[2:])
    return per_node.gather(1, index)[:, 0]


def _parent_states(states: torch.Tensor, initial: torch.Tensor, parent: torch.Tensor) -> torch.Tensor:
    """Each request's state before its node: the committed one under the root,
    else the parent's (states [R, T, ...], initial [R, ...], parent [R])."""
    under_root = (parent < 0).reshape((-1,) + (1,) * (initial.dim() - 1))
    return torch.where(under_root, initial, node_rows(states, parent.clamp(min=0)))


def tree_gated_delta_rule(q, k, v, g, beta, parents, initial_state, scale: float):
    """Gated delta rule (Gated DeltaNet's recurrence) over a tree.

    Per node t with state S of its parent (the committed state at the root):
    S' = exp(g_t) S;  S' += k_t (beta_t (v_t - S'^T k_t))^T;  o_t = S'^T (scale q_t).
    Returns (out [R, T, Hv, V] in v's dtype, states [R, T, Hv, K, V] float32).
    """
    R, T, Hk, _ = k.shape
    Hv = v.shape[2]
    group = Hv // Hk
    out_dtype = v.dtype
    q = (q.float() * scale).repeat_interleave(group, dim=2)
    k = k.float().repeat_interleave(group, dim=2)
    v, g, beta = v.float(), g.float(), beta.float()
    states = torch.zeros((R, T) + tuple(initial_state.shape[1:]), dtype=torch.float32, device=v.device)
    out = torch.empty(R, T, Hv, v.shape[3], dtype=torch.float32, device=v.device)
    initial = initial_state.float()
    for t in range(T):
        state = _parent_states(states, initial, parents[:, t]) * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("rhk,rhkv->rhv", k[:, t], state)) * beta[:, t][..., None]
        state = state + k[:, t][..., :, None] * delta[..., None, :]
        out[:, t] = torch.einsum("rhk,rhkv->rhv", q[:, t], state)
        states[:, t] = state
    return out.to(out_dtype), states


def tree_selective_state_update(x, dt, A, B, C, D, dt_bias, parents, initial_state, z=None, dt_softplus=True):
    """Mamba2's selective state update (scalar A and dt per head) over a tree.

    Per node t with state h of its parent (the committed state at the root):
    dt_t = softplus(dt_t + dt_bias);  h' = exp(dt_t A) h + dt_t x_t B_t^T;
    y_t = h' C_t + D x_t, times silu(z_t) when z is given.
    Returns (out [R, T, H, P] in x's dtype, states [R, T, H, P, N] float32).
    """
    R, T, H, P = x.shape
    G = B.shape[2]
    x32 = x.float()
    dt = dt.float() + dt_bias.float()
    if dt_softplus:
        dt = F.softplus(dt)
    B = B.float().repeat_interleave(H // G, dim=2)
    C = C.float().repeat_interleave(H // G, dim=2)
    decay = (dt * A.float()).exp()  # [R, T, H]
    states = torch.zeros((R, T) + tuple(initial_state.shape[1:]), dtype=torch.float32, device=x.device)
    out = torch.empty(R, T, H, P, dtype=torch.float32, device=x.device)
    initial = initial_state.float()
    for t in range(T):
        state = _parent_states(states, initial, parents[:, t]) * decay[:, t][..., None, None]
        state = state + (dt[:, t][..., None] * x32[:, t])[..., :, None] * B[:, t][..., None, :]
        y = torch.einsum("rhpn,rhn->rhp", state, C[:, t]) + D.float()[:, None] * x32[:, t]
        if z is not None:
            y = y * F.silu(z[:, t].float())
        out[:, t] = y
        states[:, t] = state
    return out.to(x.dtype), states
