"""Recurrent layers over a tree (``spec_tree_kernels.recurrent_tree``) on the device.

* correctness: the Triton kernels against the reference at a hybrid model's
  sizes (Qwen3-Next's GDN heads of 128 x 128, Nemotron-H's Mamba2 heads of
  64 x 128, a 4-wide conv), within float32 summation-order tolerance;
* graphs: one layer's tree step (conv, recurrence, commit of the accepted
  path's state and conv window into the state pool) captured and replayed
  (reduced mode: compiled whole, as the other graph cases).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spec_tree_kernels import recurrent_tree as RT

from .cases import random_parents
from .plumbing import Tally

# (batch, nodes, GDN heads k/v, K = V, Mamba2 heads, groups, P, N)
FULL = [(1, 8, 2, 4, 128, 8, 1, 64, 128), (8, 16, 2, 4, 128, 8, 2, 64, 128), (32, 32, 1, 2, 128, 4, 1, 64, 128)]
REDUCED = [(2, 6, 1, 2, 16, 2, 1, 8, 16)]


def recurrent_inputs(case, seed: int, device):
    batch, nodes, hk, hv, dim, heads, groups, p, n = case
    g = torch.Generator().manual_seed(seed)
    parents = random_parents(g, batch, nodes)
    gdn = [F.normalize(torch.randn(batch, nodes, hk, dim, generator=g), dim=-1),
           F.normalize(torch.randn(batch, nodes, hk, dim, generator=g), dim=-1),
           torch.randn(batch, nodes, hv, dim, generator=g), -torch.rand(batch, nodes, hv, generator=g),
           torch.rand(batch, nodes, hv, generator=g), parents, torch.randn(batch, hv, dim, dim, generator=g)]
    ssm = [torch.randn(batch, nodes, heads, p, generator=g), torch.randn(batch, nodes, heads, generator=g),
           -torch.rand(heads, generator=g) - 0.1, torch.randn(batch, nodes, groups, n, generator=g),
           torch.randn(batch, nodes, groups, n, generator=g), torch.randn(heads, generator=g),
           torch.randn(heads, generator=g), parents, torch.randn(batch, heads, p, n, generator=g)]
    conv = [torch.randn(batch, nodes, 3 * hv * dim, generator=g), parents,
            torch.randn(batch, 3 * hv * dim, 3, generator=g), torch.randn(3 * hv * dim, 4, generator=g),
            torch.randn(3 * hv * dim, generator=g)]
    return [[t.to(device) for t in part] for part in (gdn, ssm, conv)]


def check_recurrent_trees(tally: Tally, reduced: bool, device: torch.device) -> None:
    """Triton against the reference, every output and node state."""
    for case in REDUCED if reduced else FULL:
        label = dict(batch=case[0], nodes=case[1], dim=case[4])
        gdn, ssm, conv = recurrent_inputs(case, 0, device)
        checks = {"gdn": (RT.tree_gated_delta_rule, gdn), "ssm": (RT.tree_selective_state_update, ssm),
                  "conv": (RT.tree_causal_conv1d, conv)}
        for name, (op, args) in checks.items():
            want, got = op(*args, impl="torch"), op(*args, impl="triton")
            pairs = list(zip(want, got)) if isinstance(want, tuple) else [(want, got)]
            worst = max(float((a - b).abs().max()) for a, b in pairs)
            ok = all(torch.allclose(a, b, rtol=1e-4, atol=1e-4) for a, b in pairs)
            tally.add(f"recurrent_{name}/triton", ok, max_abs_diff=worst, **label)


def recurrent_graph_inputs(seed: int, device):
    """One tree step of a hybrid layer, plus the state pools it commits into."""
    gdn, ssm, conv = recurrent_inputs(REDUCED[0], seed, device)
    batch, nodes = gdn[5].shape
    g = torch.Generator().manual_seed(seed + 100)
    last = torch.randint(0, nodes, (batch,), generator=g).to(device)
    slots = torch.randperm(2 * batch, generator=g)[:batch].to(device)
    pool = torch.zeros((2 * batch,) + tuple(gdn[6].shape[1:]), device=device)
    return gdn + ssm + conv + [last, slots, pool]


def recurrent_step(impl: str):
    def step(*inputs):
        gdn, ssm, conv, (last, slots, pool) = inputs[:7], inputs[7:16], inputs[16:21], inputs[21:]
        mixed = RT.tree_causal_conv1d(*conv, impl=impl)
        out, states = RT.tree_gated_delta_rule(*gdn, impl=impl)
        y, _ = RT.tree_selective_state_update(*ssm, impl=impl)
        committed = pool.clone()
        RT.commit_path_states(states, last, committed, slots)
        window = RT.conv_state_after(conv[0], conv[1], conv[2], last)
        return mixed, out, y, committed, window

    return step
