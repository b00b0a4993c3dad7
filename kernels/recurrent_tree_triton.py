"""Triton implementations of the recurrent tree ops (``recurrent_tree``).

One program per (request, head, block of value / head dims) walks the tree's
nodes in order; a node's parent precedes it, so the parent's state was
written by the same program (a barrier orders the store before the next
node's load; one pipeline stage, so no load is hoisted above it). Grids and constexprs are fixed by the shapes: capturable, no
host read. Values equal the reference (``recurrent_tree_reference``) up to
float32 summation order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_launch import launch


@triton.jit
def _parent_state(init_ptr, states_ptr, parent, r, head, T, H, tile, mask, STATE: tl.constexpr):
    """The state a node starts from: the committed one under the root, else its
    parent's (a scalar branch: one tile loaded, one live)."""
    if parent < 0:
        state = tl.load(init_ptr + (r * H + head) * STATE + tile, mask=mask, other=0.0)
    else:
        state = tl.load(states_ptr + ((r * T + parent) * H + head) * STATE + tile, mask=mask, other=0.0)
    return state


@triton.jit
def _gated_delta_tree_kernel(
    q_ptr, k_ptr,  # [R, T, Hk, K]
    v_ptr,  # [R, T, Hv, V]
    g_ptr, beta_ptr,  # [R, T, Hv]
    parents_ptr,  # [R, T] int64
    init_ptr,  # [R, Hv, K, V] float32
    states_ptr,  # [R, T, Hv, K, V] float32 (out)
    out_ptr,  # [R, T, Hv, V] (out)
    scale, T, Hk, Hv,
    K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    rh = tl.program_id(0).to(tl.int64)
    r, hv = rh // Hv, rh % Hv
    hk = hv // (Hv // Hk)
    ks = tl.arange(0, BK)
    vs = tl.program_id(1) * BV + tl.arange(0, BV)
    k_ok, v_ok = ks < K, vs < V
    tile = ks[:, None] * V + vs[None, :]
    tile_ok = k_ok[:, None] & v_ok[None, :]
    for t in range(T):
        row = r * T + t
        parent = tl.load(parents_ptr + row)
        state = _parent_state(init_ptr, states_ptr, parent, r, hv, T, Hv, tile, tile_ok, K * V)
        state = state * tl.exp(tl.load(g_ptr + row * Hv + hv).to(tl.float32))
        k_t = tl.load(k_ptr + (row * Hk + hk) * K + ks, mask=k_ok, other=0.0).to(tl.float32)
        v_t = tl.load(v_ptr + (row * Hv + hv) * V + vs, mask=v_ok, other=0.0).to(tl.float32)
        beta_t = tl.load(beta_ptr + row * Hv + hv).to(tl.float32)
        delta = (v_t - tl.sum(state * k_t[:, None], axis=0)) * beta_t
        state = state + k_t[:, None] * delta[None, :]
        q_t = tl.load(q_ptr + (row * Hk + hk) * K + ks, mask=k_ok, other=0.0).to(tl.float32) * scale
        out = tl.sum(state * q_t[:, None], axis=0)
        tl.store(out_ptr + (row * Hv + hv) * V + vs, out.to(out_ptr.dtype.element_ty), mask=v_ok)
        tl.store(states_ptr + (row * Hv + hv) * (K * V) + tile, state, mask=tile_ok)
        tl.debug_barrier()


@triton.jit
def _ssm_tree_kernel(
    x_ptr,  # [R, T, H, P]
    dt_ptr,  # [R, T, H]
    a_ptr, d_ptr, dt_bias_ptr,  # [H] float32
    b_ptr, c_ptr,  # [R, T, G, N]
    z_ptr,  # [R, T, H, P] (read only when HAS_Z)
    parents_ptr,  # [R, T] int64
    init_ptr,  # [R, H, P, N] float32
    states_ptr,  # [R, T, H, P, N] float32 (out)
    out_ptr,  # [R, T, H, P] (out)
    T, H, G,
    P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_Z: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
):
    rh = tl.program_id(0).to(tl.int64)
    r, h = rh // H, rh % H
    g = h // (H // G)
    ps = tl.program_id(1) * BP + tl.arange(0, BP)
    ns = tl.arange(0, BN)
    p_ok, n_ok = ps < P, ns < N
    tile = ps[:, None] * N + ns[None, :]
    tile_ok = p_ok[:, None] & n_ok[None, :]
    a_h = tl.load(a_ptr + h)
    d_h = tl.load(d_ptr + h)
    dt_bias_h = tl.load(dt_bias_ptr + h)
    for t in range(T):
        row = r * T + t
        parent = tl.load(parents_ptr + row)
        state = _parent_state(init_ptr, states_ptr, parent, r, h, T, H, tile, tile_ok, P * N)
        dt_t = tl.load(dt_ptr + row * H + h).to(tl.float32) + dt_bias_h
        if DT_SOFTPLUS:  # torch's softplus: the identity above 20
            dt_t = tl.where(dt_t <= 20.0, tl.log(1.0 + tl.exp(dt_t)), dt_t)
        x_t = tl.load(x_ptr + (row * H + h) * P + ps, mask=p_ok, other=0.0).to(tl.float32)
        b_t = tl.load(b_ptr + (row * G + g) * N + ns, mask=n_ok, other=0.0).to(tl.float32)
        c_t = tl.load(c_ptr + (row * G + g) * N + ns, mask=n_ok, other=0.0).to(tl.float32)
        state = state * tl.exp(dt_t * a_h) + (dt_t * x_t)[:, None] * b_t[None, :]
        y = tl.sum(state * c_t[None, :], axis=1) + d_h * x_t
        if HAS_Z:
            z_t = tl.load(z_ptr + (row * H + h) * P + ps, mask=p_ok, other=0.0).to(tl.float32)
            y = y * (z_t * tl.sigmoid(z_t))
        tl.store(out_ptr + (row * H + h) * P + ps, y.to(out_ptr.dtype.element_ty), mask=p_ok)
        tl.store(states_ptr + (row * H + h) * (P * N) + tile, state, mask=tile_ok)
        tl.debug_barrier()


@triton.jit
def _tree_conv_kernel(
    x_ptr,  # [R, T, C]
    columns_ptr,  # [R, T, W] int64 (``ancestor_columns``)
    conv_state_ptr,  # [R, C, S], newest input last
    weight_ptr,  # [C, W] float32
    bias_ptr,  # [C] float32 (read only when HAS_BIAS)
    out_ptr,  # [R, T, C] (out)
    T, C, S,
    W: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    rt = tl.program_id(0).to(tl.int64)
    r = rt // T
    cs = tl.program_id(1) * BC + tl.arange(0, BC)
    c_ok = cs < C
    acc = tl.zeros([BC], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cs, mask=c_ok, other=0.0)
    for j in tl.static_range(W):
        col = tl.load(columns_ptr + rt * W + j)
        in_tree = tl.load(x_ptr + (r * T + tl.maximum(col, 0)) * C + cs, mask=c_ok, other=0.0)
        committed = tl.load(conv_state_ptr + (r * C + cs) * S + (S + tl.minimum(col, -1)), mask=c_ok, other=0.0)
        w = tl.load(weight_ptr + cs * W + (W - 1 - j), mask=c_ok, other=0.0)
        acc += w * tl.where(col >= 0, in_tree.to(tl.float32), committed.to(tl.float32))
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + rt * C + cs, acc.to(out_ptr.dtype.element_ty), mask=c_ok)


def tree_gated_delta_rule(q, k, v, g, beta, parents, initial_state, scale: float):
    R, T, Hk, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    states = torch.empty(R, T, Hv, K, V, dtype=torch.float32, device=v.device)
    out = torch.empty(R, T, Hv, V, dtype=v.dtype, device=v.device)
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), max(16, 4096 // BK))  # a [BK, BV] float32 tile: 32 registers a thread
    launch(_gated_delta_tree_kernel, (R * Hv, triton.cdiv(V, BV)), q, k, v, g, beta, parents, initial_state,
           states, out, float(scale), T, Hk, Hv, K=K, V=V, BK=BK, BV=BV, num_stages=1)
    return out, states


def tree_selective_state_update(x, dt, A, B, C, D, dt_bias, parents, initial_state, z=None, dt_softplus=True):
    R, T, H, P = x.shape
    G, N = B.shape[2], B.shape[3]
    states = torch.empty(R, T, H, P, N, dtype=torch.float32, device=x.device)
    out = torch.empty(R, T, H, P, dtype=x.dtype, device=x.device)
    BN = triton.next_power_of_2(N)
    BP = min(triton.next_power_of_2(P), max(16, 4096 // BN))
    launch(_ssm_tree_kernel, (R * H, triton.cdiv(P, BP)), x, dt, A, D, dt_bias, B, C, x if z is None else z,
           parents, initial_state, states, out, T, H, G, P=P, N=N, BP=BP, BN=BN, HAS_Z=z is not None,
           DT_SOFTPLUS=bool(dt_softplus), num_stages=1)
    return out, states


def tree_causal_conv1d(x, columns, conv_state, weight, bias, activation):
    R, T, C = x.shape
    W = weight.shape[1]
    out = torch.empty_like(x)
    BC = min(triton.next_power_of_2(C), 256)
    launch(_tree_conv_kernel, (R * T, triton.cdiv(C, BC)), x, columns, conv_state, weight,
           weight if bias is None else bias, out, T, C, conv_state.shape[2], W=W, BC=BC,
           HAS_BIAS=bias is not None, SILU=activation == "silu")
    return out
