"""Recurrent layers over a tree (spec_tree_kernels.recurrent_tree) against a
path-replay oracle: every node's output and state must equal running the
plain sequential recurrence (GDN's delta rule, Mamba2's SSM, the causal conv)
over that node's root-to-node path alone, from the request's committed state.
The oracle is written from the models' sequential equations in float64, one
request, head and path at a time; it shares no code with the ops.

Trees come from the package's own EAGLE selection over synthetic pools
(ties included), depth 1 to 8 and topk 1 to 8. Triton runs under
TRITON_INTERPRET=1 without a GPU (kernel_device).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import spec_tree_kernels as K
from kernel_device import DEVICE
from pools import random_batch
from spec_tree_kernels import recurrent_tree as RT
from spec_tree_kernels.recurrent_tree_reference import ancestor_columns

IMPLS = ("torch", "triton")


# ------------------------------------------------------------------ trees


def eagle_trees(rng: random.Random, batch: int, topk: int, num_steps: int, flavor: str) -> torch.Tensor:
    """[batch, T] parents of trees EAGLE's selection makes (T random within the pool)."""
    scores, parent_list = random_batch(rng, batch, topk, num_steps, flavor)
    pool = scores.shape[1]
    tokens = rng.randint(1, min(pool, 24)) + 1
    selected = K.select_tree_nodes(scores, parent_list, topk, num_steps, tokens, impl="torch")
    return K.node_parents(selected, parent_list, topk)


def tree_cases():
    """(seed, topk, num_steps, flavor): depth 1..8, topk 1..8, every flavor."""
    rng = random.Random(7)
    flavors = ("random", "ties", "mixed", "onehot")
    cases = [(0, 1, 1, "random"), (1, 8, 1, "ties"), (2, 1, 8, "random"), (3, 8, 8, "ties")]
    cases += [(10 + i, rng.randint(1, 8), rng.randint(1, 8), flavors[i % 4]) for i in range(4)]
    return cases


def case_inputs(case, batch: int):
    """(python RNG, torch generator, parents [batch, T]) of a tree case, all from its seed."""
    seed, topk, num_steps, flavor = case
    rng = random.Random(seed)
    return rng, torch.Generator().manual_seed(seed), eagle_trees(rng, batch, topk, num_steps, flavor)


def path(parents: list[int], node: int) -> list[int]:
    nodes = [node]
    while parents[nodes[-1]] >= 0:
        nodes.append(parents[nodes[-1]])
    return nodes[::-1]


# ------------------------------------------------------------------ oracle


def replay_paths(parents, heads: int, init, step):
    """Every node's (output, state) from running ``step(state, r, n, h) -> (state, out)``
    over its root-to-node path, from the request's committed state init[r, h], float64."""
    R, T = parents.shape
    outs, states = {}, {}
    for r in range(R):
        rows = parents[r].tolist()
        for t in range(T):
            for h in range(heads):
                state = init[r, h].double().clone()
                for n in path(rows, t):
                    state, out = step(state, r, n, h)
                outs[r, t, h], states[r, t, h] = out, state

    def stacked(d):
        return torch.stack([torch.stack([torch.stack([d[r, t, h] for h in range(heads)]) for t in range(T)])
                            for r in range(R)])
    return stacked(outs), stacked(states)


def oracle_gdn(q, k, v, g, beta, parents, init, scale):
    """Sequential gated delta rule: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q."""
    Hk, Hv = k.shape[2], v.shape[2]

    def step(S, r, n, h):
        kn, vn, qn = k[r, n, h * Hk // Hv].double(), v[r, n, h].double(), q[r, n, h * Hk // Hv].double() * scale
        S = S * torch.exp(g[r, n, h].double())
        S = S + torch.outer(kn, beta[r, n, h].double() * (vn - S.T @ kn))
        return S, S.T @ qn

    return replay_paths(parents, Hv, init, step)


def oracle_ssm(x, dt, A, B, C, D, dt_bias, parents, init, z):
    """Sequential Mamba2: d = softplus(dt + bias); s = exp(d A) s + d x B^T; y = s C + D x (* silu(z))."""
    H, G = x.shape[2], B.shape[2]

    def step(s, r, n, h):
        gi, xn = h * G // H, x[r, n, h].double()
        d = F.softplus(dt[r, n, h].double() + dt_bias[h].double())
        s = s * torch.exp(d * A[h].double()) + torch.outer(d * xn, B[r, n, gi].double())
        y = s @ C[r, n, gi].double() + D[h].double() * xn
        return s, y if z is None else y * F.silu(z[r, n, h].double())

    return replay_paths(parents, H, init, step)


def path_inputs(x, conv_state, parents, r, node):
    """[C, S + depth] float64: the committed inputs, then the path's own."""
    return torch.cat([conv_state[r].double(), x[r, path(parents[r].tolist(), node)].double().T], dim=1)


def oracle_conv(x, parents, conv_state, weight, bias):
    R, T, C = x.shape
    W = weight.shape[1]
    out = torch.zeros(R, T, C, dtype=torch.float64)
    for r in range(R):
        for t in range(T):
            seq = path_inputs(x, conv_state, parents, r, t)[:, -W:]
            y = F.conv1d(seq[None], weight.double()[:, None, :], bias.double(), groups=C)[0, :, -1]
            out[r, t] = F.silu(y)
    return out


# ------------------------------------------------------------------ tests


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", tree_cases())
def test_gated_delta_rule_equals_path_replay(case, impl):
    rng, gen, parents = case_inputs(case, batch=2)
    R, T = parents.shape
    Hk, Hv, Kd, Vd = 1, 2, 16, 8
    q, k = (F.normalize(torch.randn(R, T, Hk, Kd, generator=gen), dim=-1) for _ in range(2))
    v = torch.randn(R, T, Hv, Vd, generator=gen)
    g = -torch.rand(R, T, Hv, generator=gen)
    beta = torch.rand(R, T, Hv, generator=gen)
    init = torch.randn(R, Hv, Kd, Vd, generator=gen)
    args = [t.to(DEVICE) for t in (q, k, v, g, beta, parents, init)]
    out, states = RT.tree_gated_delta_rule(*args, impl=impl)
    want_out, want_states = oracle_gdn(q, k, v, g, beta, parents, init, Kd ** -0.5)
    torch.testing.assert_close(out.cpu().double(), want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states.cpu().double(), want_states, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("case", tree_cases()[::2])
def test_selective_state_update_equals_path_replay(case, gated, impl):
    rng, gen, parents = case_inputs(case, batch=2)
    R, T = parents.shape
    H, G, P, N = 4, 2, 8, 16
    x = torch.randn(R, T, H, P, generator=gen)
    dt = torch.randn(R, T, H, generator=gen)
    A = -torch.rand(H, generator=gen) - 0.1
    B, C = torch.randn(R, T, G, N, generator=gen), torch.randn(R, T, G, N, generator=gen)
    D, dt_bias = torch.randn(H, generator=gen), torch.randn(H, generator=gen)
    init = torch.randn(R, H, P, N, generator=gen)
    z = torch.randn(R, T, H, P, generator=gen) if gated else None
    dev = [t.to(DEVICE) for t in (x, dt, A, B, C, D, dt_bias, parents, init)]
    out, states = RT.tree_selective_state_update(*dev, z=None if z is None else z.to(DEVICE), impl=impl)
    want_out, want_states = oracle_ssm(x, dt, A, B, C, D, dt_bias, parents, init, z)
    torch.testing.assert_close(out.cpu().double(), want_out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(states.cpu().double(), want_states, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", tree_cases())
def test_conv_reads_each_nodes_ancestor_path(case, impl):
    rng, gen, parents = case_inputs(case, batch=3)
    R, T = parents.shape
    C, W, S = 6, 4, 5  # a conv state longer than W - 1, as vLLM's spec-decode buffers are
    x = torch.randn(R, T, C, generator=gen)
    conv_state = torch.randn(R, C, S, generator=gen)
    weight, bias = torch.randn(C, W, generator=gen), torch.randn(C, generator=gen)
    dev = [t.to(DEVICE) for t in (x, parents, conv_state, weight, bias)]
    out = RT.tree_causal_conv1d(*dev, activation="silu", impl=impl)
    torch.testing.assert_close(out.cpu().double(), oracle_conv(x, parents, conv_state, weight, bias),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", tree_cases())
def test_commit_takes_the_accepted_paths_state_and_window(case):
    rng, gen, parents = case_inputs(case, batch=3)
    R, T = parents.shape
    x, conv_state = torch.randn(R, T, 5, generator=gen), torch.randn(R, 5, 3, generator=gen)
    last = torch.tensor([rng.randrange(T) for _ in range(R)])
    window = RT.conv_state_after(x, parents, conv_state, last)
    for r in range(R):
        assert torch.equal(window[r].double(), path_inputs(x, conv_state, parents, r, int(last[r]))[:, -3:])
    node_states = torch.randn(R, T, 2, 3, generator=gen)
    pool = torch.zeros(R + 4, 2, 3)
    slots = torch.tensor(rng.sample(range(R + 4), R))
    RT.commit_path_states(node_states, last, pool, slots)
    for r in range(R):
        assert torch.equal(pool[slots[r]], node_states[r, last[r]])
    untouched = sorted(set(range(R + 4)) - set(slots.tolist()))
    assert not pool[untouched].any()


def test_a_flat_order_recurrence_is_caught():
    """The oracle tells a tree from its rows read in order: a branching tree's
    states, run as if each row continued the one before it, differ."""
    parents = torch.tensor([[-1, 0, 0, 1, 2]])  # two branches from the root
    flat = torch.tensor([[-1, 0, 1, 2, 3]])
    gen = torch.Generator().manual_seed(0)
    R, T, Kd, Vd = 1, 5, 8, 4
    q, k = (F.normalize(torch.randn(R, T, 1, Kd, generator=gen), dim=-1) for _ in range(2))
    v, g, beta = torch.randn(R, T, 1, Vd, generator=gen), -torch.rand(R, T, 1, generator=gen), torch.rand(R, T, 1)
    init = torch.randn(R, 1, Kd, Vd, generator=gen)
    want, _ = oracle_gdn(q, k, v, g, beta, parents, init, Kd ** -0.5)
    tree, _ = RT.tree_gated_delta_rule(q, k, v, g, beta, parents, init, impl="torch")
    wrong, _ = RT.tree_gated_delta_rule(q, k, v, g, beta, flat, init, impl="torch")
    torch.testing.assert_close(tree.double(), want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(wrong.double(), want, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(wrong[:, :2].double(), want[:, :2], rtol=1e-5, atol=1e-5)  # rows 0, 1 agree


def test_ancestor_columns_count_past_the_root_into_the_committed_inputs():
    parents = torch.tensor([[-1, 0, 0, 1]])
    cols = ancestor_columns(parents, 4)
    assert cols[0].tolist() == [[0, -1, -2, -3], [1, 0, -1, -2], [2, 0, -1, -2], [3, 1, 0, -1]]


def test_bad_inputs_are_named():
    parents = torch.tensor([[-1, 0]])
    x = torch.zeros(1, 2, 4)
    with pytest.raises(ValueError, match="conv_state"):
        RT.tree_causal_conv1d(x, parents, torch.zeros(1, 4, 2), torch.zeros(4, 4))  # S < W - 1
    with pytest.raises(ValueError, match="activation"):
        RT.tree_causal_conv1d(x, parents, torch.zeros(1, 4, 3), torch.zeros(4, 4), activation="gelu")
    q = torch.zeros(1, 2, 2, 8)
    with pytest.raises(ValueError, match="multiple of Hk"):
        RT.tree_gated_delta_rule(q, q, torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), parents,
                                 torch.zeros(1, 3, 8, 8))
    with pytest.raises(ValueError, match="initial_state"):
        RT.tree_gated_delta_rule(q, q, torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2), torch.zeros(1, 2, 2), parents,
                                 torch.zeros(1, 2, 8, 4))
    with pytest.raises(ValueError, match="parents must hold -1"):
        RT.validate_parents(torch.tensor([[-1, 1]]))
    RT.validate_parents(torch.tensor([[-1, 0, 0, 2]]))


def test_reference_compiles_as_one_graph():
    """No host read or data-dependent Python: the reference ops trace whole
    (the property a CUDA graph capture needs)."""
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]])
    gen = torch.Generator().manual_seed(0)
    R, T = parents.shape
    q, k = torch.randn(R, T, 1, 8, generator=gen), torch.randn(R, T, 1, 8, generator=gen)
    v, g, beta = torch.randn(R, T, 1, 4, generator=gen), -torch.rand(R, T, 1, generator=gen), torch.rand(R, T, 1)
    init = torch.randn(R, 1, 8, 4, generator=gen)
    x, conv_state, weight = torch.randn(R, T, 3, generator=gen), torch.randn(R, 3, 3), torch.randn(3, 4)

    def step(q, k, v, g, beta, parents, init, x, conv_state, weight):
        out, states = RT.tree_gated_delta_rule(q, k, v, g, beta, parents, init, impl="torch")
        conv = RT.tree_causal_conv1d(x, parents, conv_state, weight, impl="torch")
        return out, states, conv

    args = (q, k, v, g, beta, parents, init, x, conv_state, weight)
    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend="aot_eager")
    for got, want in zip(compiled(*args), step(*args)):
        torch.testing.assert_close(got, want)
