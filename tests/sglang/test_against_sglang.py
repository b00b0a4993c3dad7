"""Cross-check of spec_tree_kernels against SGLang 0.5.23's own tree kernels.

Runs only in ``.venv-sglang`` (``ci/setup_sglang_venv.sh``) on CPU with
``TRITON_INTERPRET=1``:

    TRITON_INTERPRET=1 .venv-sglang/bin/python -m pytest tests/sglang -q

Everywhere else the module skips, so the main venv can collect ``tests/``.

What is compared, and against what:

* selection: SGLang's ``organize_draft_results`` (re-implemented below: its
  module needs transformers to import) on draft pools built the way SGLang's
  draft loop builds them;
* build (FULL_MASK, QLEN_ONLY): SGLang's Triton kernel
  ``sgl_build_tree_kernel_triton``, buffers allocated as SGLang's
  ``build_tree_kernel_efficient`` allocates them;
* build (QLEN_ONLY_BITPACKING): a Python transcription of the CUDA kernel
  ``build_tree_efficient_partial_packed`` (SGLang's Triton kernel does not
  implement this mode);
* verify: SGLang's Triton kernel ``verify_tree_greedy_triton``, buffers
  allocated as ``eagle_utils.eagle_sample`` allocates them.

Our side runs with ``impl="torch"`` and ``impl="triton"``.
"""

from __future__ import annotations

import math

import pytest

from sglang_gate import require_sglang_venv  # noqa: E402

require_sglang_venv(register_plugin=False)

import torch  # noqa: E402
from hypothesis import HealthCheck, assume, event, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode as SglMaskMode  # noqa: E402
from sglang.kernels.ops.speculative.spec_tree import (  # noqa: E402
    sgl_build_tree_kernel_triton,
    verify_tree_greedy_triton,
)

import spec_tree_kernels as stk  # noqa: E402
from spec_tree_kernels import TreeMaskMode  # noqa: E402

pytestmark = pytest.mark.sglang

IMPLS = ("torch", "triton")
VOCAB = 32  # draft vocabulary: small, so verify walks accept by chance too
# The Triton interpreter is slow: SGLang's build kernel costs ~B * T^2 * S
# interpreted scalar ops, so random trees stay at T <= 32 (the bitpacked
# limit) and the largest tree is one explicit example.
MAX_RANDOM_NODES = 32


def slow(max_examples: int) -> settings:
    """Interpreted kernels take far longer than hypothesis' default deadline."""
    return settings(max_examples=max_examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------- SGLang's draft loop


def fast_topk(values, topk, dim):
    """sglang.srt.utils.common.fast_topk (its module needs the full server deps)."""
    if topk == 1:
        return torch.max(values, dim=dim, keepdim=True)
    return torch.topk(values, topk, dim=dim)


def random_draft_forward(gen: torch.Generator, topk: int, logit_scale: float):
    """One draft-model forward over ``rows`` inputs: top-k of a softmax over
    random logits, as EagleWorkerV2.draft_forward computes topk_p/topk_index."""

    def forward(rows: int):
        probs = torch.softmax(torch.randn(rows, VOCAB, generator=gen) * logit_scale, dim=-1)
        return fast_topk(probs, topk, dim=-1)

    return forward


def draft_loop(draft_forward, batch: int, topk: int, num_steps: int):
    """SGLang's draft loop: the score/token/parent lists that
    ``select_top_k_tokens`` (``_select_top_k_tokens_first`` for step 0,
    ``_select_top_k_tokens_later`` after) appends, step by step; only the
    tree bookkeeping, with ``draft_forward(rows)`` in place of the model."""
    topk_p, topk_index = draft_forward(batch)
    score_list = [topk_p.unsqueeze(1)]  # (b, 1, topk)
    token_list = [topk_index]  # (b, topk)
    parents_list = [torch.arange(-1, topk, dtype=torch.long).expand(batch, -1)]  # (b, topk + 1)
    scores = topk_p
    for i in range(1, num_steps):
        topk_p, topk_index = draft_forward(batch * topk)  # one row per survivor of step i - 1
        expand_scores = scores.unsqueeze(2) * topk_p.view(-1, topk, topk)  # (b, topk, topk)
        topk_cs_p, topk_cs_index = fast_topk(expand_scores.flatten(start_dim=1), topk, dim=-1)
        score_list.append(expand_scores)
        token_list.append(topk_index.view(-1, topk * topk))
        parents_list.append(topk_cs_index + (topk * topk * (i - 1) + topk))
        scores = topk_cs_p
    return score_list, token_list, parents_list


def organize_draft_results(score_list, token_list, parents_list, num_draft_token):
    """sglang.srt.speculative.eagle_utils.organize_draft_results, verbatim but
    for its OOB debug probe (eagle_utils needs transformers to import)."""
    score_list = torch.cat(score_list, dim=1).flatten(1)
    ss_token_list = torch.cat(token_list, dim=1)
    top_scores = torch.topk(score_list, num_draft_token - 1, dim=-1)
    top_scores_index = top_scores.indices
    top_scores_index = torch.sort(top_scores_index).values
    draft_tokens = torch.gather(ss_token_list, index=top_scores_index, dim=1)
    if len(parents_list) > 1:
        parent_list = torch.cat(parents_list[:-1], dim=1)
    else:
        batch_size = parents_list[0].shape[0]
        parent_list = torch.empty(batch_size, 0, dtype=torch.long, device=parents_list[0].device)
    return parent_list, top_scores_index, draft_tokens


class Draft:
    """One draft step's output in both APIs' terms."""

    def __init__(self, draft_forward, batch, topk, num_steps, num_draft_tokens):
        score_list, token_list, parents_list = draft_loop(draft_forward, batch, topk, num_steps)
        self.scores = torch.cat(score_list, dim=1).flatten(1)  # [B, P] what our select takes
        self.parent_list, self.top_scores_index, self.draft_tokens = organize_draft_results(
            score_list, token_list, parents_list, num_draft_token=num_draft_tokens
        )
        self.batch, self.topk, self.num_steps, self.nodes = batch, topk, num_steps, num_draft_tokens

    def boundary_is_strict(self) -> bool:
        """True when the (T-1)-th best score beats the T-th in every request:
        then the top T-1 set is unique and any correct top-k returns it."""
        k = self.nodes - 1
        if k == 0 or k == self.scores.shape[1]:
            return True
        ranked = torch.sort(self.scores, dim=1, descending=True).values
        return bool((ranked[:, k - 1] > ranked[:, k]).all())


def is_closed(selected: torch.Tensor, parent_list: torch.Tensor, topk: int) -> bool:
    """Every selected candidate's parent candidate is selected or is the root."""
    for row, parents in zip(selected.tolist(), parent_list.tolist()):
        chosen = set(row)
        if any(c // topk > 0 and parents[c // topk] not in chosen for c in row):
            return False
    return True


# --------------------------------------------------------- SGLang's kernels


def sglang_build(parent_list, selected, seq_lens, topk, num_steps, nodes, mode, tree_mask_buf=None):
    """sgl_build_tree_kernel_triton with buffers allocated as SGLang's
    ``eagle_utils.build_tree_kernel_efficient`` allocates them (retrieve
    arrays prefilled with -1, masks prefilled with True). A given
    ``tree_mask_buf`` is FULL_MASK with ``fill_prefix_mask=False``: used as is."""
    batch = seq_lens.numel()
    if tree_mask_buf is not None:
        tree_mask = tree_mask_buf
    elif mode == SglMaskMode.QLEN_ONLY:
        tree_mask = torch.full((nodes * batch * nodes,), True, dtype=torch.bool)
    else:
        tree_mask = torch.full((int(seq_lens.sum()) * nodes + nodes * nodes * batch,), True, dtype=torch.bool)
    retrieve_buf = torch.full((3, batch, nodes), -1, dtype=torch.long)
    retrieve_index, retrieve_next_token, retrieve_next_sibling = retrieve_buf
    positions = torch.empty((batch * nodes,), dtype=torch.long)
    sgl_build_tree_kernel_triton(
        parent_list,
        selected,
        seq_lens,
        tree_mask,
        positions,
        retrieve_index,
        retrieve_next_token,
        retrieve_next_sibling,
        topk,
        num_steps,
        nodes,
        mode,
    )
    return tree_mask, positions, retrieve_index, retrieve_next_token, retrieve_next_sibling


def cuda_build_tree_partial_packed(parent_list, selected_index, verified_seq_len, topk, depth, draft_token_num):
    """Python transcription of SGLang's CUDA kernel
    ``build_tree_efficient_partial_packed`` (kernels/jit/include/sgl_kernel/
    speculative/eagle.cuh), the only QLEN_ONLY_BITPACKING implementation
    SGLang has. One (bid, tid) iteration per CUDA thread; the threads of a
    block touch disjoint bytes, so running them in order is equivalent. Works
    on flat Python lists, indexed exactly as the kernel indexes its pointers.

    Returns (tree_mask bytes, positions, retrieve_index, retrieve_next_token,
    retrieve_next_sibling), starting from the buffers eagle_utils allocates:
    a zero-filled mask and retrieve arrays of -1 (the kernel writes every
    position). Only closed trees are fed in: for an open one the kernel's
    parent search runs past the request's row.
    """
    selected_index = selected_index.flatten().tolist()
    parent_list = parent_list.flatten().tolist()
    verified_seq_len = verified_seq_len.tolist()
    bs = len(verified_seq_len)
    num_bytes_per_item = 4 if draft_token_num > 16 else (2 if draft_token_num > 8 else 1)
    tree_mask = bytearray(bs * draft_token_num * num_bytes_per_item)
    positions = [-1] * (bs * draft_token_num)
    retrive_index = [-1] * (bs * draft_token_num)
    retrive_next_token = [-1] * (bs * draft_token_num)
    retrive_next_sibling = [-1] * (bs * draft_token_num)
    parent_width = topk * (depth - 1) + 1
    for bid in range(bs):
        for tid in range(draft_token_num):
            seq_len = verified_seq_len[bid]
            token_tree_idx = (bid * draft_token_num + tid) * num_bytes_per_item
            tree_mask[token_tree_idx] = 1  # little endian
            position = 0
            if tid == 0:
                positions[bid * draft_token_num] = seq_len
                retrive_index_offset = bid * draft_token_num
                for i in range(draft_token_num - 1, 0, -1):
                    current_token_idx = retrive_index_offset + i
                    retrive_index[bid * draft_token_num + i] = current_token_idx
                    parent_tb_idx = selected_index[bid * (draft_token_num - 1) + i - 1] // topk
                    parent_position = 0
                    if parent_tb_idx > 0:
                        parent_token_idx = parent_list[bid * parent_width + parent_tb_idx]
                        while parent_position < draft_token_num:
                            if selected_index[bid * (draft_token_num - 1) + parent_position] == parent_token_idx:
                                parent_position += 1
                                break
                            parent_position += 1
                    if parent_position == draft_token_num:
                        continue  # the kernel prints "invalid eagle tree" and skips the token
                    if retrive_next_token[bid * draft_token_num + parent_position] == -1:
                        retrive_next_token[bid * draft_token_num + parent_position] = i
                    else:
                        origin_next_token = retrive_next_token[bid * draft_token_num + parent_position]
                        retrive_next_token[bid * draft_token_num + parent_position] = i
                        retrive_next_sibling[bid * draft_token_num + i] = origin_next_token
                retrive_index[bid * draft_token_num] = bid * draft_token_num
            else:
                cur_position = tid - 1
                while True:
                    position += 1
                    byte_idx = (cur_position + 1) // 8
                    bit_idx = (cur_position + 1) % 8
                    tree_mask[token_tree_idx + byte_idx] |= 1 << bit_idx
                    parent_tb_idx = selected_index[bid * (draft_token_num - 1) + cur_position] // topk
                    if parent_tb_idx == 0:
                        break
                    token_idx = parent_list[bid * parent_width + parent_tb_idx]
                    cur_position = 0
                    while cur_position < draft_token_num:
                        if selected_index[bid * (draft_token_num - 1) + cur_position] == token_idx:
                            break
                        cur_position += 1
                positions[bid * draft_token_num + tid] = position + seq_len
    shape = (bs, draft_token_num)
    return (
        torch.frombuffer(tree_mask, dtype=torch.uint8) if tree_mask else torch.empty(0, dtype=torch.uint8),
        torch.tensor(positions, dtype=torch.long),
        torch.tensor(retrive_index, dtype=torch.long).view(shape),
        torch.tensor(retrive_next_token, dtype=torch.long).view(shape),
        torch.tensor(retrive_next_sibling, dtype=torch.long).view(shape),
    )


def sglang_bitpacked_dtype(nodes: int) -> torch.dtype:
    """The word dtype eagle_utils.build_tree_kernel_efficient allocates."""
    return [torch.uint8, torch.uint16, torch.uint32][int(math.ceil(math.log2((nodes + 7) // 8)))]


def sglang_verify(candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling, target_predict, num_steps):
    """verify_tree_greedy_triton with buffers allocated as
    ``eagle_utils.eagle_sample`` allocates them (predict int32 zeros over all
    B*T nodes, accept_index int32 [B, spec_steps + 1] of -1, accept count int32)."""
    batch, nodes = candidates.shape
    predict = torch.zeros(batch * nodes, dtype=torch.int32)
    accept_index = torch.full((batch, num_steps + 1), -1, dtype=torch.int32)
    accept_token_num = torch.empty((batch,), dtype=torch.int32)
    verify_tree_greedy_triton(
        predicts=predict,
        accept_index=accept_index,
        accept_token_num=accept_token_num,
        candidates=candidates,
        retrieve_index=retrieve_index,
        retrieve_next_token=retrieve_next_token,
        retrieve_next_sibling=retrieve_next_sibling,
        target_predict=target_predict,
    )
    return predict, accept_index, accept_token_num


def assert_bytes_equal(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    """Same dtype and the same bytes (a bool mask stores 0/1 bytes on both sides)."""
    assert ours.dtype == theirs.dtype, f"{what}: dtype {ours.dtype} vs SGLang's {theirs.dtype}"
    a, b = ours.contiguous().view(torch.uint8), theirs.contiguous().view(torch.uint8)
    assert a.shape == b.shape, f"{what}: {a.numel()} bytes vs SGLang's {b.numel()}"
    if not torch.equal(a, b):
        bad = (a != b).nonzero().flatten()[:8].tolist()
        raise AssertionError(f"{what}: bytes differ at {bad}: ours {a[bad].tolist()} vs SGLang {b[bad].tolist()}")


# ---------------------------------------------------------------- strategies


@st.composite
def tree_configs(draw, max_nodes=MAX_RANDOM_NODES):
    """(batch, topk, num_steps, T, seed) with batch 1..4, topk 1..4, num_steps
    1..6 (typical EAGLE settings) and 1 <= T <= min(pool + 1, max_nodes)."""
    topk = draw(st.integers(1, 4))
    num_steps = draw(st.integers(1, 6))
    pool = stk.pool_size(topk, num_steps)
    nodes = draw(st.integers(1, min(pool + 1, max_nodes)))
    batch = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    return batch, topk, num_steps, nodes, seed


def make_draft(config, logit_scale=2.0) -> tuple[Draft, torch.Generator]:
    """Continuous random probabilities: ties have probability ~0."""
    batch, topk, num_steps, nodes, seed = config
    gen = torch.Generator().manual_seed(seed)
    return Draft(random_draft_forward(gen, topk, logit_scale), batch, topk, num_steps, nodes), gen


EDGE_CONFIGS = [
    (1, 1, 1, 1, 0),  # T == 1: the root alone
    (3, 2, 3, 1, 1),  # T == 1 with a deep pool
    (2, 4, 1, 5, 2),  # num_steps == 1: parent_list is [B, 0], all four step-0 candidates
    (2, 1, 6, 7, 3),  # topk == 1: a chain of depth num_steps
    (4, 3, 2, 13, 4),  # the whole pool selected
    (1, 4, 6, 32, 5),  # bitpacked words: uint32, T at its limit
    (2, 2, 3, 9, 6),  # bitpacked words: uint16 just past the uint8 limit
]


def with_edge_examples(**other_args):
    """Always run EDGE_CONFIGS too, with ``other_args`` for the rest."""

    def decorate(test):
        for config in EDGE_CONFIGS:
            test = example(config=config, **other_args)(test)
        return test

    return decorate


# ----------------------------------------------------------------- a. select


@slow(100)
@given(config=tree_configs(max_nodes=stk.pool_size(4, 6) + 1), logit_scale=st.sampled_from([0.5, 2.0, 4.0]))
@with_edge_examples(logit_scale=2.0)
def test_select_equals_organize_draft_results(config, logit_scale):
    """Without ties at the selection boundary, our selection is exactly
    SGLang's ``top_scores_index`` (torch.topk + sort)."""
    draft, _ = make_draft(config, logit_scale)
    assume(draft.boundary_is_strict())
    for impl in IMPLS:
        ours = stk.select_tree_nodes(
            draft.scores, draft.parent_list, draft.topk, draft.num_steps, draft.nodes, impl=impl
        )
        theirs = draft.top_scores_index
        assert ours.dtype == theirs.dtype == torch.int64
        assert torch.equal(ours, theirs), f"impl={impl}: {ours.tolist()} vs SGLang {theirs.tolist()}"


# ------------------------------------------------------------------ b. build


def check_build_against_sglang(draft: Draft, seq_lens: torch.Tensor, gen: torch.Generator) -> None:
    """Our build_tree vs SGLang on SGLang's own (closed) selection, every mode."""
    topk, num_steps, nodes, batch = draft.topk, draft.num_steps, draft.nodes, draft.batch
    selected, parent_list = draft.top_scores_index, draft.parent_list
    seq_lens_sum = int(seq_lens.sum())
    qlen = sglang_build(parent_list, selected, seq_lens, topk, num_steps, nodes, SglMaskMode.QLEN_ONLY)
    full = sglang_build(parent_list, selected, seq_lens, topk, num_steps, nodes, SglMaskMode.FULL_MASK)
    # FULL_MASK with fill_prefix_mask=False into a preallocated, larger buffer of
    # arbitrary bits: neither side may touch anything but the tree columns.
    stale = torch.randint(0, 2, (seq_lens_sum * nodes + nodes * nodes * batch + 7,), generator=gen).bool()
    full_nofill = sglang_build(
        parent_list, selected, seq_lens, topk, num_steps, nodes, SglMaskMode.FULL_MASK, tree_mask_buf=stale.clone()
    )
    _, sgl_positions, sgl_retrieve_index, sgl_next_token, sgl_next_sibling = qlen
    for other in (full, full_nofill):  # SGLang agrees with itself across modes
        assert torch.equal(other[1], sgl_positions) and torch.equal(other[3], sgl_next_token)

    qlen_matrix = qlen[0].view(batch, nodes, nodes)
    sgl_depth = sgl_positions.view(batch, nodes) - seq_lens[:, None]

    def build(mode, impl, **kwargs):
        return stk.build_tree(selected, parent_list, seq_lens, topk, num_steps, mode, impl=impl, **kwargs)

    for impl in IMPLS:
        where = f"impl={impl}"
        ours_qlen = build(TreeMaskMode.QLEN_ONLY, impl)
        assert_bytes_equal(ours_qlen.tree_mask, qlen[0], f"{where} QLEN_ONLY mask")
        assert torch.equal(ours_qlen.positions.flatten(), sgl_positions), f"{where} positions"
        assert torch.equal(ours_qlen.retrieve_index, sgl_retrieve_index), f"{where} retrieve_index"
        assert torch.equal(ours_qlen.retrieve_next_token, sgl_next_token), f"{where} retrieve_next_token"
        assert torch.equal(ours_qlen.retrieve_next_sibling, sgl_next_sibling), f"{where} retrieve_next_sibling"

        ours_full = build(TreeMaskMode.FULL_MASK, impl, seq_lens_sum=seq_lens_sum, fill_prefix_mask=True)
        assert_bytes_equal(ours_full.tree_mask, full[0], f"{where} FULL_MASK mask")
        ours_nofill = build(
            TreeMaskMode.FULL_MASK, impl, seq_lens_sum=seq_lens_sum, fill_prefix_mask=False, tree_mask_buf=stale.clone()
        )
        assert_bytes_equal(ours_nofill.tree_mask, full_nofill[0], f"{where} FULL_MASK fill_prefix_mask=False mask")

        if nodes <= 32:
            cuda = cuda_build_tree_partial_packed(parent_list, selected, seq_lens, topk, num_steps, nodes)
            ours_packed = build(TreeMaskMode.QLEN_ONLY_BITPACKING, impl)
            assert ours_packed.tree_mask.dtype == sglang_bitpacked_dtype(nodes), f"{where} bitpacked dtype"
            assert_bytes_equal(ours_packed.tree_mask.view(torch.uint8), cuda[0], f"{where} QLEN_ONLY_BITPACKING mask")
            for ours_t, cuda_t in zip(ours_packed[1:], cuda[1:]):
                assert torch.equal(ours_t.flatten(), cuda_t.flatten()), f"{where} bitpacked-mode links/positions"

        # our own modes carry the same tree: decode them against SGLang's QLEN_ONLY
        words = build(TreeMaskMode.ANCESTOR_BITMASK, impl).tree_mask  # [B, T, W] int64
        col = torch.arange(nodes)
        decoded = (words[:, :, col // 64] >> (col % 64)) & 1
        assert torch.equal(decoded.bool(), qlen_matrix), f"{where} ANCESTOR_BITMASK"
        pointers = build(TreeMaskMode.PARENT_POINTER, impl).tree_mask  # [B, 2, T] int16
        assert torch.equal(pointers[:, 1].long(), sgl_depth), f"{where} PARENT_POINTER depth"
        # the parent is the ancestor one level up
        one_up = qlen_matrix & (sgl_depth[:, None, :] == sgl_depth[:, :, None] - 1)
        expected_parent = torch.where(one_up.any(2), one_up.to(torch.int8).argmax(2), -1)
        assert torch.equal(pointers[:, 0].long(), expected_parent), f"{where} PARENT_POINTER parent"


@slow(30)
@given(config=tree_configs(), seq_lens_seed=st.integers(0, 2**31 - 1))
@with_edge_examples(seq_lens_seed=0)
@example(config=(1, 4, 6, stk.pool_size(4, 6) + 1, 7), seq_lens_seed=1)  # the largest tree SGLang drafts
def test_build_equals_sglang(config, seq_lens_seed):
    """Mask bytes, positions and retrieve links equal SGLang's for every mode
    both have, on the closed trees SGLang's draft loop produces."""
    draft, gen = make_draft(config)
    assume(draft.boundary_is_strict())
    seq_lens = torch.randint(0, 48, (draft.batch,), generator=torch.Generator().manual_seed(seq_lens_seed))
    check_build_against_sglang(draft, seq_lens, gen)


# ----------------------------------------------------------------- c. verify


def random_root_to_leaf_path(next_token: list, next_sibling: list, gen: torch.Generator) -> list:
    """Nodes from the root to a leaf, each step a uniformly chosen child."""
    path = [0]
    while next_token[path[-1]] != -1:
        children, child = [], next_token[path[-1]]
        while child != -1:
            children.append(child)
            child = next_sibling[child]
        path.append(children[int(torch.randint(len(children), (1,), generator=gen))])
    return path


@slow(40)
@given(config=tree_configs(), follow=st.floats(0.0, 1.0), collide=st.booleans())
@with_edge_examples(follow=0.7, collide=False)
def test_verify_equals_sglang(config, follow, collide):
    """Greedy verify equals SGLang's: accepted flat indices, count, tokens.

    target_predict follows a random root-to-leaf path for a random number of
    levels in each request (with probability ``follow``), so real acceptance
    of every length happens; ``collide`` folds tokens into {0, 1, 2}, giving
    siblings equal tokens (first in sibling order wins) and chance matches.
    The links come from our reference build (equal to SGLang's, see
    test_build_equals_sglang) and are fed to both sides.
    """
    draft, gen = make_draft(config)
    assume(draft.boundary_is_strict())
    batch, nodes, num_steps = draft.batch, draft.nodes, draft.num_steps
    seq_lens = torch.zeros(batch, dtype=torch.long)  # verify reads only the links
    tree = stk.build_tree(draft.top_scores_index, draft.parent_list, seq_lens, draft.topk, num_steps, impl="torch")
    bonus = torch.randint(VOCAB, (batch,), generator=gen)
    candidates = torch.cat((bonus.unsqueeze(1), draft.draft_tokens), dim=1)  # as build_tree_kernel_efficient
    target_predict = torch.randint(VOCAB, (batch, nodes), generator=gen)
    for b in range(batch):
        if float(torch.rand((), generator=gen)) < follow:
            path = random_root_to_leaf_path(
                tree.retrieve_next_token[b].tolist(), tree.retrieve_next_sibling[b].tolist(), gen
            )
            full = float(torch.rand((), generator=gen)) < 0.5
            levels = len(path) - 1 if full else int(torch.randint(len(path), (1,), generator=gen))
            for node, child in list(zip(path, path[1:]))[:levels]:
                target_predict[b, node] = candidates[b, child]
    if collide:
        candidates, target_predict = candidates % 3, target_predict % 3

    predict, accept_index, accept_token_num = sglang_verify(
        candidates, tree.retrieve_index, tree.retrieve_next_token, tree.retrieve_next_sibling, target_predict, num_steps
    )
    event(f"longest acceptance: {'full depth' if int(accept_token_num.max()) == num_steps else 'partial or none'}")
    for impl in IMPLS:
        ours = stk.verify_tree_greedy(
            candidates, tree.retrieve_next_token, tree.retrieve_next_sibling, target_predict, num_steps, impl=impl
        )
        flat = torch.where(ours.accept_index >= 0, ours.accept_index + nodes * torch.arange(batch)[:, None], -1)
        assert ours.accept_index.dtype == accept_index.dtype == torch.int32
        assert torch.equal(flat.int(), accept_index), f"impl={impl}: {flat.tolist()} vs SGLang {accept_index.tolist()}"
        assert ours.accept_length.dtype == accept_token_num.dtype == torch.int32
        assert torch.equal(ours.accept_length, accept_token_num), f"impl={impl} accept_length"
        accepted = accept_index >= 0
        sgl_tokens = predict[accept_index[accepted].long()].long()
        assert torch.equal(ours.accept_tokens[accepted], sgl_tokens), f"impl={impl} tokens"
        assert bool((ours.accept_tokens[~accepted] == -1).all()), f"impl={impl} padding"


# --------------------------------------------------------- d. the tie bug


def fixed_draft_forward(step_probs):
    """A draft 'model' whose step i returns the rows of step_probs[i], sorted
    as top-k returns them; token ids are the within-row ranks."""
    steps = iter(step_probs)

    def forward(rows: int):
        probs = torch.tensor(next(steps), dtype=torch.float32).repeat(rows, 1)
        return probs, torch.arange(probs.shape[1]).repeat(rows, 1)

    return forward


def test_tie_opens_sglang_tree_but_not_ours():
    """A probability-1 draft step makes a child tie its parent's score; SGLang's
    torch.topk then can select a child without its parent.

    Draft loop with topk=2, num_steps=2, T=4: step 0 proposes p=[0.6, 0.4],
    step 1 (saturated softmax) p=[1.0, 0.0] after each survivor, so the pool is
    scores [0.6, 0.4 | 0.6, 0.0, 0.4, 0.0], parent_list [[-1, 0, 1]].
    torch.topk (CPU, torch 2.13) returns {0, 2, 4}: candidate 4's parent,
    candidate 1, is not selected. SGLang's Triton build then:
      * links no node to node 3 (candidate 4): unreachable, never verified;
      * gives it position seq_len + 1 although it is at depth 2, and a mask
        row of {root, itself} only (its own parent chain is cut).
    Ours selects the closed {0, 1, 2} (ties go to the shallower candidate) and
    builds positions [L, L+1, L+1, L+2]; it rejects SGLang's open selection.
    """
    topk, num_steps, nodes, seq_len = 2, 2, 4, 10
    draft = Draft(fixed_draft_forward([[0.6, 0.4], [1.0, 0.0]]), 1, topk, num_steps, nodes)
    assert draft.scores[0].tolist() == pytest.approx([0.6, 0.4, 0.6, 0.0, 0.4, 0.0])
    assert draft.parent_list.tolist() == [[-1, 0, 1]]

    # SGLang: open selection
    sgl_selected = draft.top_scores_index
    assert sgl_selected.tolist() == [[0, 2, 4]], "torch.topk broke this tie differently on this machine"
    assert not is_closed(sgl_selected, draft.parent_list, topk)
    seq_lens = torch.tensor([seq_len])
    mask, positions, _, next_token, next_sibling = sglang_build(
        draft.parent_list, sgl_selected, seq_lens, topk, num_steps, nodes, SglMaskMode.QLEN_ONLY
    )
    orphan = 3  # node of candidate 4
    assert orphan not in next_token.tolist()[0] + next_sibling.tolist()[0], "SGLang links the orphan"
    assert positions.tolist() == [seq_len, seq_len + 1, seq_len + 2, seq_len + 1]
    assert mask.view(nodes, nodes)[orphan].tolist() == [True, False, False, True]

    # ours: closed, same score multiset, builds; refuses SGLang's selection
    for impl in IMPLS:
        ours = stk.select_tree_nodes(draft.scores, draft.parent_list, topk, num_steps, nodes, impl=impl)
        assert ours.tolist() == [[0, 1, 2]]
        assert is_closed(ours, draft.parent_list, topk)
        assert sorted(draft.scores[0, ours[0]].tolist()) == sorted(draft.scores[0, sgl_selected[0]].tolist())
        tree = stk.build_tree(ours, draft.parent_list, seq_lens, topk, num_steps, impl=impl)
        assert tree.positions.tolist() == [[seq_len, seq_len + 1, seq_len + 1, seq_len + 2]]
        with pytest.raises(ValueError, match="not a closed tree"):
            stk.build_tree(sgl_selected, draft.parent_list, seq_lens, topk, num_steps, impl=impl)


@st.composite
def tied_step_probs(draw, topk):
    """Top-k rows whose products tie exactly: dyadic probabilities (exact in
    float32), saturated rows [1, 0, ...] and underflowed zeros."""
    row = draw(
        st.sampled_from(
            [
                [1.0] + [0.0] * (topk - 1),
                [0.5, 0.25, 0.125, 0.125][:topk],
                [0.5, 0.5, 0.0, 0.0][:topk],
                [0.25] * topk,
            ]
        )
    )
    return sorted(row, reverse=True)


@slow(60)
@given(data=st.data())
def test_ties_ours_closed_and_as_good_as_sglang(data):
    """Under exact ties (saturated/dyadic draft probabilities) our selection is
    closed, builds, and has the same score multiset as SGLang's selection:
    the same T-1 best scores, tie-broken toward ancestors. How often SGLang's
    own selection is open is reported as a hypothesis event."""
    topk = data.draw(st.integers(2, 4), label="topk")
    num_steps = data.draw(st.integers(2, 6), label="num_steps")
    nodes = data.draw(st.integers(2, min(stk.pool_size(topk, num_steps) + 1, MAX_RANDOM_NODES)), label="T")
    steps = [data.draw(tied_step_probs(topk), label=f"step {i} probs") for i in range(num_steps)]
    draft = Draft(fixed_draft_forward(steps), 1, topk, num_steps, nodes)
    sgl_open = not is_closed(draft.top_scores_index, draft.parent_list, topk)
    event(f"SGLang selection open: {sgl_open}")
    for impl in IMPLS:
        ours = stk.select_tree_nodes(draft.scores, draft.parent_list, topk, num_steps, nodes, impl=impl)
        assert is_closed(ours, draft.parent_list, topk), f"impl={impl}: {ours.tolist()}"
        assert sorted(draft.scores[0, ours[0]].tolist()) == sorted(draft.scores[0, draft.top_scores_index[0]].tolist())
        stk.build_tree(ours, draft.parent_list, torch.tensor([5]), topk, num_steps, impl=impl)


# ------------------------------------------------------------- e. edge cases


@pytest.mark.parametrize("num_steps", [1, 2, 5])
def test_topk1_matches_sglang_chain_fast_path(num_steps):
    """topk == 1: SGLang skips organize_draft_results and uses preallocated
    ``arange(num_steps)`` / ``arange(-1, num_steps - 1)`` (base_spec_worker);
    on CPU its draft scores are all 1.0 (``torch.ones_like``), a full tie.
    Our selection on those scores, and the loop's own parent list, equal the
    preallocated ones."""
    batch, nodes = 3, num_steps + 1
    draft = Draft(fixed_draft_forward([[1.0]] * num_steps), batch, 1, num_steps, nodes)
    prealloc_selected = torch.arange(num_steps, dtype=torch.long).repeat(batch, 1)
    prealloc_parents = torch.arange(-1, num_steps - 1, dtype=torch.long).repeat(batch, 1)
    if num_steps == 1:
        prealloc_parents = prealloc_parents[:, :0]  # parent width is 0 with one step
    assert torch.equal(draft.parent_list, prealloc_parents)
    for impl in IMPLS:
        ours = stk.select_tree_nodes(draft.scores, draft.parent_list, 1, num_steps, nodes, impl=impl)
        assert torch.equal(ours, prealloc_selected)


@pytest.mark.parametrize("nodes", range(1, 34))
def test_bitpacked_word_dtype_matches_sglang(nodes):
    """Word size per T (the uint8/16/32 boundaries at 8/9, 16/17, 32) equals
    eagle_utils' allocation; T > 32 is refused as the CUDA launcher does."""
    num_steps = max(nodes - 1, 1)
    chain = torch.arange(nodes - 1, dtype=torch.long)[None]  # topk=1 chain
    parent_list = torch.arange(-1, num_steps - 1, dtype=torch.long)[None][:, : stk.parent_list_width(1, num_steps)]
    seq_lens, mode = torch.tensor([3]), TreeMaskMode.QLEN_ONLY_BITPACKING
    if nodes > 32:
        with pytest.raises(ValueError):
            stk.build_tree(chain, parent_list, seq_lens, 1, num_steps, mode)
        return
    tree = stk.build_tree(chain, parent_list, seq_lens, 1, num_steps, mode, impl="torch")
    assert tree.tree_mask.dtype == sglang_bitpacked_dtype(nodes)
    cuda = cuda_build_tree_partial_packed(parent_list, chain, seq_lens, 1, num_steps, nodes)
    assert_bytes_equal(tree.tree_mask.view(torch.uint8), cuda[0], "chain bitpacked mask")
