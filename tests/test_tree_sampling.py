"""verify_tree_sampling (issue #13): target-only recursive rejection over the
tree for temperature > 0, with caller-supplied randoms.

* Exact: on small trees and vocabularies an oracle written here from the
  rules enumerates every accept / reject event of the walk with exact
  rational arithmetic; the emitted sequences must be distributed as the
  target's chain rule, and the reference must take exactly the oracle's
  decisions when handed coins just either side of each threshold.
* Statistical: one call on 1,000,000 copies of a tree; a chi-square test of
  the first and first-two emitted tokens against the chain rule passes, and
  fails for two deliberately broken samplers.
* The greedy limit, the empty-residual fallback, input validation.

Triton and CUDA against the reference: tests/test_triton_ops.py and
tests/test_cuda_emulated.py, on batches from ``random_sampling_batch`` here.
"""

from __future__ import annotations

import functools
import math
import random
from fractions import Fraction
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import chisquare
import spec_tree_kernels as K

# ------------------------------------------------------------------ helpers


def links_of(parents: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(retrieve_next_token [1, T], retrieve_next_sibling [1, T], depth) of one tree."""
    tree = K.tree_from_parents(torch.tensor([parents]), torch.zeros(1, dtype=torch.int64), "QLEN_ONLY")
    return tree.retrieve_next_token, tree.retrieve_next_sibling, int(tree.positions.max())


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """Children of every node in sibling order (ascending node index, SGLang's order)."""
    kids: dict[int, list[int]] = {n: [] for n in range(len(parents))}
    for j, par in enumerate(parents):
        if par >= 0:
            kids[par].append(j)
    return kids


def depth_of(parents: list[int], node: int) -> int:
    depth = 0
    while parents[node] >= 0:
        node, depth = parents[node], depth + 1
    return depth


# ------------------------------------------------------------------ the oracle


class Event(NamedTuple):
    """One outcome of the walk: its probability, the accepted nodes, every
    child test on the way ((child, accepted, threshold p_res / mass)), and the
    final draw (the node it is drawn at, the token, the tokens of positive
    residual probability there)."""

    prob: Fraction
    path: tuple[int, ...]
    tests: tuple[tuple[int, bool, Fraction], ...]
    node: int
    token: int
    residual_support: frozenset


def walk_events(parents, tokens, probs, max_depth) -> list[Event]:
    """Every event of the walk, by the rules, in exact arithmetic.

    At a node: test the children in sibling order; child c is accepted with
    probability p_res(c) / mass (p_res: p with the tokens rejected here so
    far zeroed; mass: 1 - their p_res); a rejection removes p_res(c) from
    mass. No child accepted (or none, or max_depth reached): the last token
    is drawn from p_res / sum(p_res) (from p when the residual is empty).
    """
    vocab = len(probs[0])
    exact = [[Fraction(x) for x in row] for row in probs]
    kids = children_of(parents)
    events: list[Event] = []

    def at_node(node, depth, prob, path, tests):
        children = kids[node] if depth < max_depth else []

        def scan(i, mass, rejected, prob, tests):
            if i == len(children):
                residual = [Fraction(0) if t in rejected else exact[node][t] for t in range(vocab)]
                if sum(residual) == 0:
                    residual = exact[node]
                total = sum(residual)
                support = frozenset(t for t in range(vocab) if residual[t] > 0)
                for t in sorted(support):
                    events.append(Event(prob * residual[t] / total, path, tests, node, t, support))
                return
            child = children[i]
            token = tokens[child]
            p_res = Fraction(0) if token in rejected or not 0 <= token < vocab else exact[node][token]
            threshold = min(p_res / mass, Fraction(1)) if mass > 0 else Fraction(int(p_res > 0))
            if threshold > 0:
                at_node(child, depth + 1, prob * threshold, path + (child,), tests + ((child, True, threshold),))
            if threshold < 1:
                rejected_tests = tests + ((child, False, threshold),)
                scan(i + 1, mass - p_res, rejected | {token}, prob * (1 - threshold), rejected_tests)

        scan(0, Fraction(1), frozenset(), prob, tests)

    at_node(0, 0, Fraction(1), (), ())
    return events


def emitted(event: Event, tokens) -> tuple[int, ...]:
    return tuple(tokens[c] for c in event.path) + (event.token,)


def walk_distribution(parents, tokens, probs, max_depth) -> dict[tuple[int, ...], Fraction]:
    dist: dict[tuple[int, ...], Fraction] = {}
    for event in walk_events(parents, tokens, probs, max_depth):
        key = emitted(event, tokens)
        dist[key] = dist.get(key, Fraction(0)) + event.prob
    return dist


def chain_distribution(parents, tokens, probs, max_depth) -> dict[tuple[int, ...], Fraction]:
    """The target's distribution of the emitted sequence: x_1 ~ p(root); while
    x_i is the token of a child of the current node (below max_depth), move to
    the first such child and draw x_{i+1} from p there; else stop."""
    kids = children_of(parents)
    dist: dict[tuple[int, ...], Fraction] = {}

    def expand(node, depth, prefix, prob):
        for t, q in enumerate(probs[node]):
            if q == 0:
                continue
            prob_t = prob * Fraction(q)
            nxt = [c for c in kids[node] if tokens[c] == t] if depth < max_depth else []
            if nxt:
                expand(nxt[0], depth + 1, prefix + (t,), prob_t)
            else:
                dist[prefix + (t,)] = dist.get(prefix + (t,), Fraction(0)) + prob_t

    expand(0, 0, (), Fraction(1))
    return dist


def chain_prefix_probabilities(parents, tokens, probs, length):
    """{first ``length`` emitted tokens (shorter when the sequence ends): probability}."""
    out: dict[tuple[int, ...], float] = {}
    depth = max(depth_of(parents, n) for n in range(len(parents)))
    for seq, prob in chain_distribution(parents, tokens, probs, depth).items():
        key = seq[:length]
        out[key] = out.get(key, 0.0) + float(prob)
    return out


# ------------------------------------------------------------- distributions


def truncated_row(rng: random.Random, vocab: int, kind: str) -> list[float]:
    """A float64 next-token distribution with exact zeros: dyadic (exact in
    binary, sums to exactly 1), softmax cut to top-k or top-p and
    renormalized, or one-hot."""
    if kind == "one_hot":
        row = [0.0] * vocab
        row[rng.randrange(vocab)] = 1.0
        return row
    if kind == "dyadic":
        support = rng.sample(range(vocab), rng.randint(1, vocab))
        cuts = sorted(rng.sample(range(1, 64), len(support) - 1))
        weights = [b - a for a, b in zip([0] + cuts, cuts + [64])]
        row = [0.0] * vocab
        for t, w in zip(support, weights):
            row[t] = w / 64
        return row
    logits = [rng.gauss(0.0, 2.0) for _ in range(vocab)]
    top = max(logits)
    soft = [math.exp(x - top) for x in logits]
    total = sum(soft)
    soft = [x / total for x in soft]
    order = sorted(range(vocab), key=lambda t: -soft[t])
    if kind == "top_k":
        keep = set(order[: rng.randint(1, vocab)])
    else:  # top_p: the smallest prefix of the sorted distribution reaching top_p
        top_p, acc, keep = rng.uniform(0.3, 0.95), 0.0, set()
        for t in order:
            keep.add(t)
            acc += soft[t]
            if acc >= top_p:
                break
    total = sum(soft[t] for t in keep)
    return [soft[t] / total if t in keep else 0.0 for t in range(vocab)]


ROW_KINDS = ("dyadic", "top_k", "top_p", "one_hot")


@st.composite
def sampling_problems(draw, max_nodes=8):
    """(parents, tokens, probs rows, max_depth): a random tree of <= max_nodes
    nodes over a vocabulary of 2..6 (duplicate-token siblings and zero-
    probability children are common), each node with a truncated distribution."""
    nodes = draw(st.integers(1, max_nodes))
    vocab = draw(st.integers(2, 6))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, nodes)]
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    probs = [truncated_row(rng, vocab, draw(st.sampled_from(ROW_KINDS))) for _ in range(nodes)]
    tokens = [rng.randrange(vocab)]
    for j in range(1, nodes):  # mostly tokens the parent's distribution can accept
        parent_row = probs[parents[j]]
        if rng.random() < 0.6:
            tokens.append(rng.choices(range(vocab), weights=parent_row)[0])
        else:
            tokens.append(rng.randrange(vocab))
    depth = max(depth_of(parents, n) for n in range(nodes))
    return parents, tokens, probs, max(1, depth + draw(st.integers(0, 1)))


# ------------------------------------------------------ exact distribution


@settings(max_examples=400, deadline=None)
@given(problem=sampling_problems())
def test_emitted_sequences_follow_the_chain_rule(problem):
    """The oracle's walk emits every sequence with the target's chain-rule
    probability (1e-9: non-dyadic rows sum to 1 only in float64)."""
    parents, tokens, probs, max_depth = problem
    walk = walk_distribution(parents, tokens, probs, max_depth)
    chain = chain_distribution(parents, tokens, probs, max_depth)
    assert abs(float(sum(walk.values())) - 1.0) < 1e-12
    for seq in set(walk) | set(chain):
        got, want = float(walk.get(seq, 0)), float(chain.get(seq, 0))
        assert abs(got - want) <= 1e-9, (seq, got, want)
    exact = all(Fraction(x).denominator <= 64 for row in probs for x in row)
    if exact:  # dyadic / one-hot rows: the identity holds exactly
        assert walk == {k: v for k, v in chain.items() if v > 0}


def test_the_chain_rule_check_fails_a_walk_that_keeps_rejected_mass():
    """The comparison above has teeth: the oracle's rules with mass never
    reduced (threshold p_res / 1) break the chain rule."""
    parents, tokens = [-1, 0, 0], [0, 1, 2]
    probs = [[0.5, 0.25, 0.25], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    chain = chain_distribution(parents, tokens, probs, 1)
    # second child accepted with probability (1 - 0.25) * 0.25 instead of 0.25
    broken_second = (1 - Fraction(1, 4)) * Fraction(1, 4)
    assert chain[(2, 0)] == Fraction(1, 4) != broken_second
    assert walk_distribution(parents, tokens, probs, 1)[(2, 0)] == Fraction(1, 4)


# ---------------------------------------------- the reference against the oracle

MARGIN = 1e-6  # coins this far (relative) either side of the oracle's exact threshold


def realize(events, tokens, nodes, vocab, seed):
    """Coins and exponentials that make the walk take each event's decisions
    and draw its token: a coin just below the threshold accepts, just above
    rejects; the drawn token's Exp is 2^-60 and every token of zero residual
    probability (rejected, or p = 0) has Exp 2^-120, so a residual that
    forgot to zero a rejected token draws that token instead."""
    gen = torch.Generator().manual_seed(seed)
    coins = torch.rand(len(events), nodes, generator=gen, dtype=torch.float64)
    exps = torch.ones(len(events), vocab, dtype=torch.float64)
    for i, event in enumerate(events):
        for child, accepted, threshold in event.tests:
            coins[i, child] = float(threshold) * ((1 - MARGIN) if accepted else (1 + MARGIN))
        for t in range(vocab):
            if t not in event.residual_support:
                exps[i, t] = 2.0**-120
        exps[i, event.token] = 2.0**-60
    return coins, exps


def realizable(event: Event) -> bool:
    """A rejection at a threshold within MARGIN of 1 has no coin in [0, 1)."""
    return event.prob > 1e-12 and all(accepted or t < 1 - 2 * MARGIN for _, accepted, t in event.tests)


def check_decisions(sampler, parents, tokens, probs, max_depth, seed=0) -> list[str]:
    """Run ``sampler`` (verify_tree_sampling's signature) on one copy of the
    tree per oracle event with that event's coins; return the mismatches."""
    nodes, vocab = len(parents), len(probs[0])
    events = [e for e in walk_events(parents, tokens, probs, max_depth) if realizable(e)]
    coins, exps = realize(events, tokens, nodes, vocab, seed)
    next_token, next_sibling, _ = links_of(parents)
    batch = len(events)
    result = sampler(
        torch.tensor([tokens]).expand(batch, -1),
        next_token.expand(batch, -1),
        next_sibling.expand(batch, -1),
        torch.tensor([probs], dtype=torch.float64).expand(batch, -1, -1),
        coins,
        exps,
        max_depth,
    )
    bad = []
    width = max_depth + 1
    for i, event in enumerate(events):
        want_index = [0, *event.path] + [-1] * (width - 1 - len(event.path))
        want_tokens = list(emitted(event, tokens)) + [-1] * (width - 1 - len(event.path))
        got = (result.accept_index[i].tolist(), int(result.accept_length[i]), result.accept_tokens[i].tolist())
        if got != (want_index, len(event.path), want_tokens):
            bad.append(f"event {event.path}->{event.token} (p={float(event.prob):.3g}): got {got}")
    return bad


def reference_sampler(*args):
    return K.verify_tree_sampling(*args, impl="torch")


@settings(max_examples=200, deadline=None)
@given(problem=sampling_problems())
def test_reference_takes_the_oracles_decisions(problem):
    """For every event of positive probability, coins just either side of the
    oracle's thresholds make the reference walk exactly that path and draw
    exactly that token."""
    parents, tokens, probs, max_depth = problem
    assert check_decisions(reference_sampler, parents, tokens, probs, max_depth) == []


# The tree of the statistical test and of the broken-sampler checks (V = 6):
#   root (0): children 1 (token 2), 2 (token 0), 3 (token 2 again: a duplicate
#             of a sibling), 4 (token 4, probability 0 at the root)
#   node 1: children 5 (token 1), 6 (token 3); node 2: child 7 (token 5, p = 1)
#   node 5: child 8 (token 0)
STAT_PARENTS = [-1, 0, 0, 0, 0, 1, 1, 2, 5]
STAT_TOKENS = [0, 2, 0, 2, 4, 1, 3, 5, 0]
STAT_PROBS = [
    [0.10, 0.20, 0.35, 0.15, 0.00, 0.20],  # top-k cut: token 4 has p = 0
    [0.40, 0.30, 0.00, 0.30, 0.00, 0.00],
    [0.00, 0.00, 0.00, 0.00, 0.00, 1.00],  # probability one
    [0.20, 0.20, 0.20, 0.20, 0.20, 0.00],
    [0.00, 1.00, 0.00, 0.00, 0.00, 0.00],
    [0.25, 0.25, 0.25, 0.25, 0.00, 0.00],
    [0.50, 0.50, 0.00, 0.00, 0.00, 0.00],
    [0.10, 0.10, 0.10, 0.10, 0.10, 0.50],
    [0.00, 0.00, 0.00, 0.00, 0.50, 0.50],
]
STAT_DEPTH = 3


def broken_sampler(remove_rejected_mass=True, zero_rejected_tokens=True):
    """A sampler with the walk's rules, one of them broken: a rejected
    child's p_res is not removed from mass, or the final draw does not zero
    the rejected tokens (vectorized over the batch; any trees)."""

    def sample(candidates, next_token, next_sibling, probs, coins, exps, max_depth):
        batch, nodes = candidates.shape
        rows = torch.arange(batch)
        cur = torch.zeros(batch, dtype=torch.int64)
        alive = torch.ones(batch, dtype=torch.bool)
        index = torch.full((batch, max_depth + 1), -1, dtype=torch.int64)
        index[:, 0] = 0
        zero_out = torch.zeros(batch, probs.shape[2], dtype=torch.bool)
        for depth in range(1, max_depth + 1):
            child = next_token[rows, cur]
            mass = torch.ones(batch, dtype=probs.dtype)
            rejected_here = torch.zeros(batch, probs.shape[2], dtype=torch.bool)
            chosen = torch.full((batch,), -1, dtype=torch.int64)
            for _ in range(nodes):
                scan = alive & (chosen < 0) & (child >= 0)
                if not bool(scan.any()):
                    break
                c = child.clamp(min=0)
                token = candidates[rows, c]
                p = torch.where(rejected_here[rows, token], 0.0, probs[rows, cur, token])
                hit = scan & (coins[rows, c] * mass < p)
                miss = scan & ~hit
                chosen = torch.where(hit, c, chosen)
                if remove_rejected_mass:
                    mass = torch.where(miss, mass - p, mass)
                rejected_here[rows[miss], token[miss]] = True
                child = torch.where(miss, next_sibling[rows, c], child)
            stops = alive & (chosen < 0)
            if zero_rejected_tokens:
                zero_out[stops] = rejected_here[stops]
            alive = alive & (chosen >= 0)
            index[:, depth] = torch.where(alive, chosen, -1)
            cur = torch.where(alive, chosen, cur)
        residual = torch.where(zero_out, 0.0, probs[rows, cur])
        drawn = (residual / exps).argmax(dim=1)
        length = (index[:, 1:] >= 0).sum(dim=1)
        tokens = torch.full_like(index, -1)
        for d in range(1, max_depth + 1):
            tokens[:, d - 1] = torch.where(index[:, d] >= 0, candidates[rows, index[:, d].clamp(min=0)], -1)
        tokens[rows, length] = drawn
        return K.VerifyResult(index.to(torch.int32), length.to(torch.int32), tokens)

    return sample


BROKEN = {
    "keeps rejected mass": broken_sampler(remove_rejected_mass=False),
    "keeps rejected tokens in the residual": broken_sampler(zero_rejected_tokens=False),
}


def test_sound_sampler_copy_passes_the_decision_check():
    """The test-side sampler without a bug agrees with the oracle (so its broken
    variants below fail for their bug, not for being different code)."""
    assert check_decisions(broken_sampler(), STAT_PARENTS, STAT_TOKENS, STAT_PROBS, STAT_DEPTH) == []


@pytest.mark.parametrize("bug", list(BROKEN))
def test_decision_check_catches_a_broken_sampler(bug):
    assert check_decisions(BROKEN[bug], STAT_PARENTS, STAT_TOKENS, STAT_PROBS, STAT_DEPTH) != []


# ---------------------------------------------------------------- statistics

SAMPLES = 1_000_000


def emitted_prefix_counts(result, length: int, vocab: int) -> dict[tuple[int, ...], int]:
    """Counts of each request's first ``length`` emitted tokens (fewer when it
    emitted fewer: accept_length + 1 tokens)."""
    tokens = result.accept_tokens[:, :length]
    emitted_count = result.accept_length.to(torch.int64) + 1
    tokens = torch.where(torch.arange(length)[None, :] < emitted_count[:, None], tokens, -1)
    assert bool(((tokens >= -1) & (tokens < vocab)).all())
    code = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for i in range(length):  # one base-(V + 1) digit per position, 0 = no token
        code = code * (vocab + 1) + tokens[:, i] + 1
    counts = torch.bincount(code, minlength=(vocab + 1) ** length)
    out = {}
    for value in counts.nonzero()[:, 0].tolist():
        digits, rest = [], value
        for _ in range(length):
            rest, digit = divmod(rest, vocab + 1)
            digits.append(digit - 1)
        out[tuple(t for t in reversed(digits) if t >= 0)] = int(counts[value])
    return out


@functools.lru_cache(maxsize=1)
def statistical_inputs(seed=1234):
    """SAMPLES copies of the STAT tree (float32) and their randoms, shared by the tests below."""
    gen = torch.Generator().manual_seed(seed)
    nodes, vocab = len(STAT_PARENTS), len(STAT_PROBS[0])
    next_token, next_sibling, _ = links_of(STAT_PARENTS)
    coins = torch.rand(SAMPLES, nodes, generator=gen, dtype=torch.float32)
    exps = torch.empty(SAMPLES, vocab, dtype=torch.float32).exponential_(generator=gen)
    return (
        torch.tensor([STAT_TOKENS]).expand(SAMPLES, -1).contiguous(),
        next_token.expand(SAMPLES, -1).contiguous(),
        next_sibling.expand(SAMPLES, -1).contiguous(),
        torch.tensor([STAT_PROBS], dtype=torch.float32).expand(SAMPLES, -1, -1).contiguous(),
        coins,
        exps,
        STAT_DEPTH,
    )


def statistical_p_values(sampler) -> dict[int, float]:
    """Chi-square p-values of the first emitted token (1) and the first two (2)."""
    result = sampler(*statistical_inputs())
    out = {}
    for length in (1, 2):
        expected = chain_prefix_probabilities(STAT_PARENTS, STAT_TOKENS, STAT_PROBS, length)
        total = sum(expected.values())
        expected = {k: q / total for k, q in expected.items()}  # float32 rows: renormalize
        counts = emitted_prefix_counts(result, length, len(STAT_PROBS[0]))
        assert sum(counts.values()) == SAMPLES
        out[length] = chisquare.goodness_of_fit(counts, expected)[2]
    return out


def test_first_two_tokens_pass_a_chi_square_test():
    """One call on 1,000,000 copies of the tree (float32): the first emitted
    token and the first two are distributed as the target's chain rule."""
    p_values = statistical_p_values(reference_sampler)
    assert min(p_values.values()) > 1e-3, p_values


@pytest.mark.parametrize("bug", list(BROKEN))
def test_chi_square_test_fails_a_broken_sampler(bug):
    p_values = statistical_p_values(BROKEN[bug])
    assert min(p_values.values()) < 1e-12, p_values


# --------------------------------------------------------------- greedy limit


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), nodes=st.integers(1, 24), vocab=st.integers(2, 8), extra=st.integers(0, 2),
       dtype=st.sampled_from([torch.float32, torch.float64]))  # fmt: skip
def test_one_hot_target_is_the_greedy_walk(seed, nodes, vocab, extra, dtype):
    """With one-hot target distributions the sampled walk is the greedy walk
    on their argmax, whatever the coins: same path, length and tokens."""
    rng = random.Random(seed)
    batch = 4
    parents = [[-1] + [rng.randrange(i) for i in range(1, nodes)] for _ in range(batch)]
    tree = K.tree_from_parents(torch.tensor(parents), torch.zeros(batch, dtype=torch.int64), "QLEN_ONLY")
    steps = int(tree.positions.max()) + extra or 1
    candidates = torch.tensor([[rng.randrange(vocab) for _ in range(nodes)] for _ in range(batch)])
    target = torch.tensor([[rng.randrange(vocab) for _ in range(nodes)] for _ in range(batch)])
    for b in range(batch):  # the target agrees along a random path
        node = rng.randrange(nodes)
        while parents[b][node] >= 0:
            target[b, parents[b][node]] = candidates[b, node]
            node = parents[b][node]
    probs = torch.nn.functional.one_hot(target, vocab).to(dtype)
    gen = torch.Generator().manual_seed(seed)
    coins = torch.rand(batch, nodes, generator=gen, dtype=dtype)
    exps = torch.empty(batch, vocab, dtype=dtype).exponential_(generator=gen)
    links = (tree.retrieve_next_token, tree.retrieve_next_sibling)
    sampled = K.verify_tree_sampling(candidates, *links, probs, coins, exps, steps)
    greedy = K.verify_tree_greedy(candidates, *links, target, steps)
    for name in greedy._fields:
        assert torch.equal(getattr(sampled, name), getattr(greedy, name)), name


# ----------------------------------------------------------------- edge cases


def test_empty_residual_draws_from_p_not_token_0():
    """Rows that sum to less than 1 can reject every token of positive
    probability; the draw then races over p (tokens 2, 3), not over an
    all-zero residual (whose first index would be token 0, of probability 0)."""
    parents, tokens = [-1, 0, 0], [0, 2, 3]
    probs = torch.tensor([[[0.0, 0.0, 0.25, 0.25], [1.0, 0, 0, 0], [1.0, 0, 0, 0]]], dtype=torch.float64)
    next_token, next_sibling, _ = links_of(parents)
    coins = torch.tensor([[0.0, 0.9, 0.9]], dtype=torch.float64)  # 0.9 >= 0.25 / 1 and >= 0.25 / 0.75
    exps = torch.tensor([[1.0, 1.0, 2.0, 1.0]], dtype=torch.float64)
    result = K.verify_tree_sampling(torch.tensor([tokens]), next_token, next_sibling, probs, coins, exps, 1)
    assert int(result.accept_length[0]) == 0
    assert result.accept_tokens[0].tolist() == [3, -1]  # 0.25 / 1 beats 0.25 / 2


def test_out_of_vocabulary_candidates_have_probability_zero():
    parents, tokens = [-1, 0, 0], [0, 7, 1]
    probs = torch.tensor([[[0.5, 0.5], [1.0, 0.0], [1.0, 0.0]]], dtype=torch.float64)
    next_token, next_sibling, _ = links_of(parents)
    coins = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)  # accepts anything of p > 0
    exps = torch.ones(1, 2, dtype=torch.float64)
    result = K.verify_tree_sampling(torch.tensor([tokens]), next_token, next_sibling, probs, coins, exps, 1)
    assert result.accept_index[0].tolist() == [0, 2] and result.accept_tokens[0].tolist() == [1, 0]


# ----------------------------------------------------------------- validation


def valid_args(batch=2, nodes=3, vocab=5, dtype=torch.float32):
    parents = [-1, 0, 0][:nodes]
    next_token, next_sibling, _ = links_of(parents)
    return dict(
        candidates=torch.zeros(batch, nodes, dtype=torch.int64),
        retrieve_next_token=next_token.expand(batch, -1),
        retrieve_next_sibling=next_sibling.expand(batch, -1),
        target_probs=torch.full((batch, nodes, vocab), 1.0 / vocab, dtype=dtype),
        coins=torch.rand(batch, nodes, dtype=dtype),
        exponentials=torch.ones(batch, vocab, dtype=dtype),
        num_steps=2,
    )


@pytest.mark.parametrize(
    "change, error, message",
    [
        (dict(coins=torch.rand(2, 3, dtype=torch.float64)), TypeError, "coins must have dtype"),
        (dict(coins=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "coins must have dtype"),
        (dict(exponentials=torch.ones(2, 4)), ValueError, r"exponentials has shape \(2, 4\), expected \[2, 5\]"),
        (dict(exponentials=torch.ones(2, 5, 1)), ValueError, "exponentials must be 2-D"),
        (dict(coins=torch.rand(3, 3)), ValueError, "coins has shape"),
        (dict(target_probs=torch.ones(2, 3, 5, dtype=torch.float16)), TypeError, "target_probs must have dtype"),
        (dict(target_probs=torch.ones(2, 4, 5)), ValueError, "target_probs has shape"),
        (dict(target_probs=torch.ones(2, 3, 0), exponentials=torch.ones(2, 0)), ValueError, "V must be at least 1"),
        (dict(retrieve_next_token=torch.zeros(2, 4, dtype=torch.int64)), ValueError, "retrieve_next_token has shape"),
        (dict(num_steps=0), ValueError, "num_steps must be a positive int"),
    ],
)
def test_validation_names_the_bad_argument(change, error, message):
    args = valid_args()
    args.update(change)
    with pytest.raises(error, match=message):
        K.verify_tree_sampling(**args)


def test_valid_arguments_pass_validation_and_auto_is_the_reference_on_cpu():
    args = valid_args()
    assert K.resolve_impl("verify_sampling", "auto", torch.device("cpu")) == "torch"
    result = K.verify_tree_sampling(**args)
    assert result.accept_index.shape == (2, 3) and result.accept_tokens.dtype == torch.int64
    assert result.accept_length.dtype == torch.int32


# ------------------------------------------ random batches for the impl tests


def random_sampling_batch(seed, batch, nodes, vocab, dtype, device="cpu"):
    """verify_tree_sampling's arguments for B random trees of T nodes: parent
    pointers, per-node distributions (softmax, top-k, top-p, one-hot: exact
    zeros), node tokens mostly drawn from the parent's distribution (real
    acceptance) else uniform (duplicate siblings, zero-probability children),
    U[0, 1) coins and Exp(1) exponentials. Returns the positional argument
    tuple ending with num_steps (the deepest node's depth)."""
    gen = torch.Generator().manual_seed(seed)
    parent = torch.full((batch, nodes), -1, dtype=torch.int64)
    for i in range(1, nodes):
        parent[:, i] = torch.randint(0, i, (batch,), generator=gen)
    depth = [0] * nodes
    for i in range(1, nodes):
        depth[i] = 1 + max(depth[j] for j in parent[:, i].tolist())  # >= the depth of node i in every tree
    tree = K.tree_from_parents(parent, torch.zeros(batch, dtype=torch.int64), "QLEN_ONLY", max_depth=max(depth))
    probs = torch.softmax(torch.randn(batch, nodes, vocab, generator=gen, dtype=torch.float64) * 2.5, dim=-1)
    ranks = probs.argsort(dim=-1, descending=True).argsort(dim=-1)
    top_k = ranks < torch.randint(1, vocab + 1, (batch, nodes, 1), generator=gen)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    top_p = torch.rand(batch, nodes, 1, generator=gen, dtype=torch.float64) * 0.5 + 0.45
    top_p = torch.zeros_like(top_k).scatter(-1, order, (sorted_p.cumsum(-1) - sorted_p) < top_p)
    kind = torch.randint(0, 4, (batch, nodes, 1), generator=gen)
    keep = torch.where(kind == 0, True, torch.where(kind == 1, top_k, torch.where(kind == 2, top_p, ranks == 0)))
    probs = probs * keep
    probs = probs / probs.sum(dim=-1, keepdim=True)
    parent_rows = probs[torch.arange(batch)[:, None], parent.clamp(min=0)]  # [B, T, V]
    from_parent = torch.multinomial(parent_rows.view(-1, vocab), 1, generator=gen).view(batch, nodes)
    uniform = torch.randint(0, vocab, (batch, nodes), generator=gen)
    candidates = torch.where(torch.rand(batch, nodes, generator=gen) < 0.6, from_parent, uniform)
    coins = torch.rand(batch, nodes, generator=gen, dtype=dtype)
    exps = torch.empty(batch, vocab, dtype=dtype).exponential_(generator=gen)
    num_steps = max(1, int(tree.positions.max()))
    tensors = (candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, probs.to(dtype), coins, exps)
    return (*(t.to(device) for t in tensors), num_steps)


def degenerate_sampling_batch(seed, dtype, device="cpu"):
    """Inputs at or outside the edge of the op's contract on which every
    implementation must still agree (the reference defines them): candidate
    tokens outside the vocabulary, Exp(1) draws of 0 (p / 0 = inf, 0 / 0 =
    NaN), rows summing to less than 1 (empty residuals), exact ties in the
    race, coins of exactly 0 (0 * mass < p_res = 0 must reject)."""
    args = list(random_sampling_batch(seed, 12, 7, 9, dtype))
    gen = torch.Generator().manual_seed(seed + 1)
    candidates, probs, coins, exps = args[0].clone(), args[3].clone(), args[4].clone(), args[5].clone()
    coins[torch.rand(coins.shape, generator=gen) < 0.3] = 0.0
    odd = torch.rand(candidates.shape, generator=gen) < 0.15
    candidates[odd] = torch.tensor([-1, 9, 40])[torch.randint(0, 3, (int(odd.sum()),), generator=gen)]
    exps[torch.rand(exps.shape, generator=gen) < 0.1] = 0.0
    probs[:4] *= 0.5  # the first requests' rows sum to 1/2
    exps[4:8] = 1.0  # ties: equal probabilities over equal exponentials
    probs[4:8] = torch.where(probs[4:8] > 0, 0.25, 0.0).to(dtype)
    args[0], args[3], args[4], args[5] = candidates, probs, coins, exps
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def rejected_everywhere_batch(vocab, dtype, device="cpu"):
    """One request per token t: the root's two children, tokens t and
    t + 5 (mod V), are both rejected, and both would win the race were they
    not zeroed (Exp 1e-6, the others 1): a rejected token at every position
    of the vocabulary, block edges included."""
    batch = vocab
    parents = [-1, 0, 0]
    next_token, next_sibling, _ = links_of(parents)
    t = torch.arange(vocab)
    candidates = torch.stack([torch.zeros_like(t), t, (t + 5) % vocab], dim=1)
    probs = torch.full((batch, 3, vocab), 0.4 / (vocab - 2), dtype=torch.float64)
    probs[t, 0, t] = 0.3
    probs[t, 0, (t + 5) % vocab] = 0.3
    coins = torch.full((batch, 3), 0.999, dtype=dtype)  # rejects 0.3 / 1 and 0.3 / 0.7
    exps = torch.ones(batch, vocab, dtype=dtype)
    exps[t, t] = 1e-6
    exps[t, (t + 5) % vocab] = 1e-6
    tensors = (candidates, next_token.expand(batch, -1), next_sibling.expand(batch, -1), probs.to(dtype), coins, exps)
    return (*(x.to(device) for x in tensors), 1)
