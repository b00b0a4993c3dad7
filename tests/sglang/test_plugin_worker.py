"""The EAGLE_TREE worker path on CPU tensors, through SGLang's own code.

Runs in ``.venv-sglang`` with ``TRITON_INTERPRET=1`` (see
test_plugin_registration.py). What runs for real: SGLang 0.5.23's
``EagleDraftWorker.draft`` and ``draft_forward`` (the multi-step draft loop,
``select_top_k_tokens``), ``build_eagle_verify_input``, ``eagle_sample``,
``_finalize_accept_tree_path``, ``EagleVerifyInput`` / ``EagleDraftInput`` /
``ForwardBatch``, ``MHATokenToKVPool``, SGLang's Triton verify kernel and its
own KV move (as references), with our hooks applied by SGLang's
``HookRegistry``.

Test doubles, for what cannot exist without a loaded model and a scheduler
(SGLang's move, where only whether ours hands a pool to it is asserted):
the draft model (a lookup table of logits per input token), the draft
worker's ``self`` (a namespace with the fields ``draft``/``draft_forward``
read), ``prepare_for_draft`` (it builds the ForwardBatch from a full
ScheduleBatch and ModelRunner; replaced by one that returns a ForwardBatch we
build), the schedule batch and the logits output (namespaces with the fields
read), and ``torchvision`` (``spec_plugins.sglang_ext._testing``).
``torch.compile`` is disabled around SGLang's draft loop (its
``_select_top_k_tokens_later`` is compiled; inductor would build C++ here).
"""

from __future__ import annotations

import contextlib
import types

import pytest

from sglang_gate import require_sglang_venv

require_sglang_venv()

from spec_plugins.sglang_ext import _testing  # noqa: E402

import torch  # noqa: E402
from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.srt.speculative import eagle_utils, eagle_worker_common, eagle_worker_v2, spec_utils  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleDraftInput  # noqa: E402

import spec_tree_kernels as stk  # noqa: E402
from spec_plugins.sglang_ext import config, engine_patches, layout  # noqa: E402
from spec_plugins.sglang_ext.worker import EagleTreeWorker, check_backend_reads, configured_mask_mode  # noqa: E402
from spec_plugins.sglang_ext.worker import startup_build_timeout  # noqa: E402
from spec_tree_kernels import TreeMaskMode, cuda_build_guard, cuda_ops  # noqa: E402

pytestmark = pytest.mark.sglang

VOCAB = 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _testing.write_tiny_checkpoint_configs(tmp_path_factory.mktemp("ckpt"))


def publish(ckpt, steps, topk, nodes, backend=config.BACKEND_TORCH):
    server_args = _testing.resolved_server_args(
        model_path=ckpt["target"], speculative_algorithm="EAGLE_TREE", speculative_draft_model_path=ckpt["eagle_head"],
        attention_backend=backend, speculative_num_steps=steps, speculative_eagle_topk=topk,
        speculative_num_draft_tokens=nodes,
    )  # fmt: skip
    _testing.publish(server_args)
    return server_args


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    monkeypatch.delenv(config.VARIANT_ENV, raising=False)
    # empty reads as unset; set through monkeypatch so that teardown also
    # removes what make_backend writes (delenv of an absent name records nothing)
    monkeypatch.setenv(config.MASK_MODE_ENV, "")
    engine_patches.deactivate()
    with torch._dynamo.config.patch(disable=True):
        yield
    engine_patches.deactivate()


class TableDraftModel:
    """Draft model double: next-token logits are a fixed row per input token."""

    canary_manager = None
    model_config = types.SimpleNamespace(
        hf_config=types.SimpleNamespace(architectures=["LlamaForCausalLMEagle"]), model_is_mrope=False
    )

    def __init__(self, logits_table):
        self.table = logits_table
        self.calls = 0

    def forward(self, forward_batch):
        self.calls += 1
        logits = self.table[forward_batch.input_ids]
        out = types.SimpleNamespace(next_token_logits=logits, hidden_states=forward_batch.spec_info.hidden_states)
        return types.SimpleNamespace(logits_output=out)


def draft_worker_double(table, topk, steps, nodes, target_backend):
    """The fields of EagleDraftWorker that draft()/draft_forward() read; its
    draft_forward is SGLang's."""
    worker = types.SimpleNamespace(
        hot_token_id=None, topk=topk, speculative_num_steps=steps, speculative_num_draft_tokens=nodes,
        index_share_for_mtp_iteration=False, seed_dsa_topk_from_draft_extend=False,
        draft_runner=TableDraftModel(table), draft_attn_backend=types.SimpleNamespace(
            attn_backends=[None] * steps, init_forward_metadata=lambda forward_batch: None
        ),
        req_to_token_pool=None, cuda_graph_runner=None, device="cpu",
        target_worker=types.SimpleNamespace(
            model_runner=types.SimpleNamespace(attn_backend=target_backend, kv_index_translator=None)
        ),
        tree_mask_mode=engine_patches.active().mask_mode if engine_patches.active() else TreeMaskMode.FULL_MASK,
    )  # fmt: skip
    worker.draft_forward = types.MethodType(eagle_worker_v2.EagleDraftWorker.draft_forward, worker)
    return worker


def run_sglang_draft(monkeypatch, worker, topk_p, topk_index, seq_lens):
    """SGLang's EagleDraftWorker.draft() with prepare_for_draft doubled."""
    bs, topk = topk_p.shape
    steps = worker.speculative_num_steps
    draft_input = EagleDraftInput(
        topk_p=topk_p, topk_index=topk_index, hidden_states=torch.zeros(bs, 8),
        bonus_tokens=torch.arange(bs) + 100,
    )  # fmt: skip

    def prepare_for_draft_double(draft_input, *args, **kwargs):
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=None, req_pool_indices=torch.arange(bs) + 1,
            seq_lens=seq_lens, out_cache_loc=torch.zeros(1, dtype=torch.long), seq_lens_sum=int(seq_lens.sum()),
            spec_info=draft_input, positions=seq_lens.repeat_interleave(topk),
            sampling_info=types.SimpleNamespace(is_all_greedy=True),
        )  # fmt: skip
        fb.out_cache_loc = torch.arange(bs * topk * steps)  # (the ForwardBatch ctor takes a view)
        return fb, False, None

    monkeypatch.setattr(eagle_worker_v2, "prepare_for_draft", prepare_for_draft_double)
    batch = types.SimpleNamespace(
        spec_info=draft_input, forward_mode=ForwardMode.DECODE, seq_lens=seq_lens, seq_lens_sum=int(seq_lens.sum()),
    )  # fmt: skip
    return eagle_worker_v2.EagleDraftWorker.draft(worker, batch, with_topology=True)


def tree_by_walk(selected, parent_list, topk):
    parents = []
    for b in range(selected.shape[0]):
        sel = selected[b].tolist()
        row = [-1]
        for pool_index in sel:
            group = pool_index // topk
            parent = 0 if group == 0 else (sel.index(int(parent_list[b, group])) + 1 if int(parent_list[b, group]) in sel else None)
            row.append(parent)
        parents.append(row)
    return parents


def is_closed(parents):
    return all(p is not None for row in parents for p in row)


def depth_of(row, i):
    d = 0
    while row[i] >= 0:
        i, d = row[i], d + 1
    return d


def make_backend(mode, size=4, max_ctx=64):
    import os

    os.environ[config.MASK_MODE_ENV] = mode.name  # the fixture's monkeypatch restores it
    runner = types.SimpleNamespace(
        device="cpu", req_to_token_pool=ReqToTokenPool(size=size, max_context_len=max_ctx, device="cpu", enable_memory_saver=False),
        token_to_kv_pool=None, use_mla_backend=False, sliding_window_size=None, is_draft_worker=False,
    )  # fmt: skip
    return ATTENTION_BACKENDS[config.BACKEND_TORCH](runner)


# ---------------------------------------------------------- the tree build


def tie_table():
    """Every token's successor has probability exactly 1: a child's path
    score ties its parent's (ENGINES.md's tie case)."""
    table = torch.full((VOCAB, VOCAB), -1e4)
    for token in range(VOCAB):
        table[token, (token + 1) % VOCAB] = 0.0
    return table


def test_tie_case_sglang_selection_is_open_ours_is_closed(ckpt, monkeypatch):
    """Scores [0.6, 0.4 | 0.6, 0, 0.4, 0], T = 4: SGLang's top-k picks the child
    of node 1 without node 1; with the worker's hooks active the selection is
    the closed tree {0, 1, 2}."""
    steps, topk, nodes = 2, 2, 4
    publish(ckpt, steps, topk, nodes)
    topk_p, topk_index, seq_lens = torch.tensor([[0.6, 0.4]]), torch.tensor([[1, 2]]), torch.tensor([10])
    backend = make_backend(TreeMaskMode.ANCESTOR_BITMASK)

    worker = draft_worker_double(tie_table(), topk, steps, nodes, backend)
    # hooks inactive: SGLang's organize_draft_results (the build would need SGLang's CUDA/CPU kernels)
    monkeypatch.setattr(eagle_worker_v2, "build_eagle_verify_input", lambda *a, **k: types.SimpleNamespace())
    _, parent_list, sglang_selected = run_sglang_draft(monkeypatch, worker, topk_p, topk_index, seq_lens)
    assert sglang_selected.tolist() == [[0, 2, 4]]
    assert not is_closed(tree_by_walk(sglang_selected, parent_list, topk))
    monkeypatch.undo()

    with engine_patches.activated(engine_patches.TreeRuntime(TreeMaskMode.ANCESTOR_BITMASK, impl="torch")):
        worker = draft_worker_double(tie_table(), topk, steps, nodes, backend)
        verify_input, parent_list, selected = run_sglang_draft(monkeypatch, worker, topk_p, topk_index, seq_lens)
    assert selected.tolist() == [[0, 1, 2]]
    assert is_closed(tree_by_walk(selected, parent_list, topk))
    # root 100, then tokens of pool 0 (1), pool 1 (2) and pool 2 (2: successor of 1)
    assert verify_input.draft_token.tolist() == [100, 1, 2, 2]
    assert verify_input.positions.tolist() == [10, 11, 11, 12]


@pytest.mark.parametrize("mode", [TreeMaskMode.ANCESTOR_BITMASK, TreeMaskMode.PARENT_POINTER, TreeMaskMode.QLEN_ONLY],
                         ids=lambda m: m.name)  # fmt: skip
def test_worker_tree_build_runs_on_cpu(ckpt, monkeypatch, mode):
    """SGLang's draft() with a random draft model: our closed selection and our
    build, in the mode the target backend reads, written into its buffer."""
    steps, topk, nodes, bs = 4, 3, 12, 3
    publish(ckpt, steps, topk, nodes)
    gen = torch.Generator().manual_seed(int(mode))
    table = torch.randn(VOCAB, VOCAB, generator=gen) * 3
    probs = torch.softmax(torch.randn(bs, VOCAB, generator=gen) * 3, -1)
    topk_p, topk_index = probs.topk(topk, dim=-1)
    seq_lens = torch.randint(5, 40, (bs,), generator=gen)
    backend = make_backend(mode)
    with engine_patches.activated(engine_patches.TreeRuntime(mode, impl="torch")):
        worker = draft_worker_double(table, topk, steps, nodes, backend)
        verify_input, parent_list, selected = run_sglang_draft(monkeypatch, worker, topk_p, topk_index, seq_lens)
    assert worker.draft_runner.calls == steps - 1
    parents = tree_by_walk(selected, parent_list, topk)
    assert is_closed(parents)
    assert verify_input.custom_mask.data_ptr() == backend.verify_mask.buffer.data_ptr()
    mask = verify_input.custom_mask
    for b in range(bs):
        row = parents[b]
        expect_pos = [int(seq_lens[b]) + depth_of(row, i) for i in range(nodes)]
        assert verify_input.positions.view(bs, nodes)[b].tolist() == expect_pos
        for i in range(nodes):
            anc, j = {i}, i
            while row[j] >= 0:
                j = row[j]
                anc.add(j)
            if mode == TreeMaskMode.ANCESTOR_BITMASK:
                got = {c for c in range(nodes) if (int(mask[b, i, 0]) >> c) & 1}
            elif mode == TreeMaskMode.PARENT_POINTER:
                assert int(mask[b, 0, i]) == row[i] and int(mask[b, 1, i]) == depth_of(row, i)
                continue
            else:
                got = {c for c in range(nodes) if bool(mask[(b * nodes + i) * nodes + c])}
            assert got == anc, (b, i)
        # first child / next sibling, children in node order
        children = {p: [i for i in range(1, nodes) if row[i] == p] for p in range(nodes)}
        for p in range(nodes):
            first = children[p][0] if children[p] else -1
            assert int(verify_input.retrieve_next_token[b, p]) == first
            for a, c in zip(children[p], children[p][1:] + [-1]):
                assert int(verify_input.retrieve_next_sibling[b, a]) == c
    assert verify_input.retrieve_index.tolist() == torch.arange(bs * nodes).view(bs, nodes).tolist()


@pytest.mark.parametrize("mode", [TreeMaskMode.ANCESTOR_BITMASK, TreeMaskMode.PARENT_POINTER, TreeMaskMode.QLEN_ONLY],
                         ids=lambda m: m.name)  # fmt: skip
def test_worker_step_equals_the_reference_decoders_step(ckpt, monkeypatch, mode):
    """The per-step oracle: SGLang's draft loop with our hooks, then its greedy
    verify with our hook, against the reference decoder's sub-steps on the same
    draft model (``tree_drafting.expand_pool`` over the table, then
    ``reference_decoder.select_tree`` / ``build_verify_tree`` / ``walk_tree``):
    the same tree (tokens, positions, links, ancestor sets in the backend's
    mode) and the same accepted tokens."""
    from sglang.srt.speculative.eagle_info import EagleVerifyInput  # noqa: F401  (the type eagle_sample reads)

    from spec_plugins.reference_decoder import build_verify_tree, select_tree, walk_tree
    from spec_plugins.tree_drafting import TreeShape, expand_pool
    from spec_tree_kernels.attention_reference import tree_mask_to_dense

    shape, bs = TreeShape(4, 3, 10), 3
    publish(ckpt, shape.num_steps, shape.topk, shape.num_draft_tokens)
    gen = torch.Generator().manual_seed(7 + int(mode))
    table = torch.randn(VOCAB, VOCAB, generator=gen) * 3
    first_logits = torch.randn(bs, VOCAB, generator=gen) * 3
    topk_p, topk_index = torch.softmax(first_logits, -1).topk(shape.topk, dim=-1)
    seq_lens = torch.randint(5, 40, (bs,), generator=gen)
    backend = make_backend(mode)
    with engine_patches.activated(engine_patches.TreeRuntime(mode, impl="torch")):
        worker = draft_worker_double(table, shape.topk, shape.num_steps, shape.num_draft_tokens, backend)
        verify_input, _, _ = run_sglang_draft(monkeypatch, worker, topk_p, topk_index, seq_lens)

    def table_step(level, tokens, hidden, ancestors):  # the draft model double, as a drafting step
        return table[tokens], hidden

    scores, pool_tokens, parent_list = expand_pool(first_logits, torch.zeros(bs, 8), None, shape.num_steps,
                                                   shape.topk, table_step)
    selected = select_tree(scores, parent_list, shape)
    candidates, tree = build_verify_tree(pool_tokens, parent_list, selected, torch.arange(bs) + 100, seq_lens, shape)
    T = shape.num_draft_tokens
    assert verify_input.draft_token.view(bs, T).tolist() == candidates.tolist()
    assert verify_input.positions.view(bs, T).tolist() == tree.positions.tolist()
    assert verify_input.retrieve_next_token.tolist() == tree.retrieve_next_token.tolist()
    assert verify_input.retrieve_next_sibling.tolist() == tree.retrieve_next_sibling.tolist()
    theirs = tree_mask_to_dense(backend._mask_view(verify_input.custom_mask, bs, T)[0], mode, bs, T)
    assert torch.equal(theirs, tree_mask_to_dense(tree.tree_mask, TreeMaskMode.QLEN_ONLY, bs, T))

    # target logits that follow the drafts part of the way: some paths accepted, none whole
    logits = torch.randn(bs, T, VOCAB, generator=gen)
    for b in range(bs):
        for i in range(T):
            child = int(tree.retrieve_next_token[b, i])
            if child >= 0 and (b + i) % 3:
                logits[b, i, int(candidates[b, child])] += 50.0
    sampling_info = types.SimpleNamespace(
        is_all_greedy=True, acc_additive_penalties=None, acc_scaling_penalties=None, logit_bias=None,
        has_watermark_candidates=False,
    )  # fmt: skip
    batch = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, seq_lens=seq_lens, device="cpu",
                                  sampling_info=sampling_info)
    with engine_patches.activated(engine_patches.TreeRuntime(mode, impl="torch")):
        predict, accept_lens, accept_index = eagle_utils.eagle_sample(
            verify_input, batch, types.SimpleNamespace(next_token_logits=logits.view(bs * T, VOCAB).clone()))
    ours = walk_tree(candidates, tree, logits, shape.num_steps)
    assert accept_lens.tolist() == (ours.accept_length + 1).tolist()
    assert int(ours.accept_length.max()) > 0  # a path beyond the root was accepted somewhere
    for b in range(bs):
        n = int(accept_lens[b])
        assert [int(predict[i]) for i in accept_index[b, :n]] == ours.accept_tokens[b, :n].tolist()
        assert (accept_index[b, :n] - b * T).tolist() == ours.accept_index[b, :n].tolist()


# ------------------------------------------------------ verify and KV move


def random_verify_case(gen, bs, steps, topk, nodes, vocab=4):
    parent_list = _testing.random_parent_list(gen, bs, topk, steps)
    selected = stk.select_tree_nodes(torch.rand(bs, stk.pool_size(topk, steps), generator=gen), parent_list, topk, steps, nodes)
    seq_lens = torch.randint(5, 30, (bs,), generator=gen)
    # vocab 4: siblings collide and random targets accept paths; a large vocab: tokens unique
    if vocab >= nodes:
        draft_tokens = torch.stack([torch.randperm(vocab, generator=gen)[: nodes - 1] for _ in range(bs)])
    else:
        draft_tokens = torch.randint(0, vocab, (bs, nodes - 1), generator=gen)
    bonus = torch.randint(0, vocab, (bs,), generator=gen)
    tree = layout.build_tree_sglang_layout(
        bonus, parent_list, selected, draft_tokens, seq_lens, int(seq_lens.sum()), topk, steps, nodes,
        TreeMaskMode.QLEN_ONLY,
    )  # fmt: skip
    return seq_lens, tree


def test_verify_hook_equals_sglang_triton_verify(ckpt):
    """SGLang's eagle_sample (greedy path) with our verify hook, against
    SGLang's own Triton verify kernel on the same tree and logits."""
    steps, topk, nodes, bs = 4, 3, 12, 6
    publish(ckpt, steps, topk, nodes)
    gen = torch.Generator().manual_seed(1)
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    for trial in range(4):
        seq_lens, (mask, positions, r_index, r_next, r_sib, tokens) = random_verify_case(gen, bs, steps, topk, nodes)
        verify_input = EagleVerifyInput(
            draft_token=tokens, custom_mask=mask, positions=positions, retrieve_index=r_index,
            retrieve_next_token=r_next, retrieve_next_sibling=r_sib, retrieve_cum_len=None, spec_steps=steps,
            topk=topk, draft_token_num=nodes, capture_hidden_mode=None, seq_lens_sum=None, seq_lens_cpu=None,
        )  # fmt: skip
        logits = torch.randn(bs * nodes, 4, generator=gen)
        sampling_info = types.SimpleNamespace(
            is_all_greedy=True, acc_additive_penalties=None, acc_scaling_penalties=None, logit_bias=None,
            has_watermark_candidates=False,
        )  # fmt: skip
        batch = types.SimpleNamespace(
            forward_mode=ForwardMode.TARGET_VERIFY, seq_lens=seq_lens, device="cpu", sampling_info=sampling_info
        )
        with engine_patches.activated(engine_patches.TreeRuntime(TreeMaskMode.QLEN_ONLY, impl="torch")):
            predict, accept_lens, accept_index = eagle_utils.eagle_sample(
                verify_input, batch, types.SimpleNamespace(next_token_logits=logits.clone())
            )
        ref_predict = torch.zeros(bs * nodes, dtype=torch.int32)
        ref_index = torch.full((bs, steps + 1), -1, dtype=torch.int32)
        ref_num = torch.empty(bs, dtype=torch.int32)
        verify_tree_greedy_triton(
            ref_predict, ref_index, ref_num, tokens.view(bs, nodes), r_index, r_next, r_sib,
            logits.argmax(-1).view(bs, nodes),
        )  # fmt: skip
        assert accept_index.dtype == torch.int32 and predict.dtype == torch.int32
        assert accept_index.tolist() == ref_index.tolist()
        assert accept_lens.tolist() == (ref_num + 1).tolist()
        assert predict.tolist() == ref_predict.tolist()
    assert int(accept_lens.max()) > 1  # some trial accepted a path, not only the bonus


def _children(next_token, next_sibling, p):
    c = int(next_token[p])
    while c >= 0:
        yield c
        c = int(next_sibling[c])


def test_kv_move_hook_equals_sglang_move(ckpt, monkeypatch):
    """SGLang's _finalize_accept_tree_path with our move hook, against the same
    call with SGLang's own move (its Triton slot kernels + native row move)."""
    steps, topk, nodes, bs = 4, 3, 12, 4
    publish(ckpt, steps, topk, nodes)
    monkeypatch.setenv("SGLANG_NATIVE_MOVE_KV_CACHE", "1")  # SGLang's tiled copy kernel needs device pointers
    gen = torch.Generator().manual_seed(2)
    seq_lens, (_, _, r_index, r_next, r_sib, tokens) = random_verify_case(gen, bs, steps, topk, nodes, vocab=1000)
    # the target accepts the path to the last node (a deep, non-front path: its KV must move)
    tokens = tokens.view(bs, nodes)
    target = torch.randint(1000, 2000, (bs, nodes), generator=gen)
    for b in range(bs):
        parent = {int(c): p for p in range(nodes) for c in _children(r_next[b], r_sib[b], p)}
        child = nodes - 1
        while child in parent:
            target[b, parent[child]] = tokens[b, child]
            child = parent[child]
    result = stk.verify_tree_greedy(tokens, r_next, r_sib, target, steps)
    accept_index = torch.where(
        result.accept_index >= 0, result.accept_index + (torch.arange(bs) * nodes)[:, None], -1
    ).to(torch.int32)
    accept_lens = result.accept_length + 1
    assert int(result.accept_length.max()) >= 2

    def fresh_pool():
        pool = MHATokenToKVPool(
            size=256, page_size=1, dtype=torch.float32, head_num=2, head_dim=8, layer_num=3, device="cpu",
            enable_memory_saver=False,
        )  # fmt: skip
        assert layout.plain_kv_views(pool) is not None
        g = torch.Generator().manual_seed(9)
        for buf in pool.k_buffer + pool.v_buffer:
            buf.copy_(torch.randn(buf.shape, generator=g))
        return pool

    pools = [fresh_pool(), fresh_pool()]
    before = fresh_pool()
    out_cache_loc = torch.randperm(255, generator=gen)[: bs * nodes] + 1
    hidden = torch.randn(bs * nodes, 5, generator=gen)
    predicts = []
    for pool, active in zip(pools, (True, False)):
        batch = types.SimpleNamespace(seq_lens=seq_lens, out_cache_loc=out_cache_loc.clone())
        logits_output = types.SimpleNamespace(hidden_states=hidden.clone())
        allocator = types.SimpleNamespace(get_kvcache=lambda pool=pool: pool)
        runtime = engine_patches.TreeRuntime(TreeMaskMode.QLEN_ONLY, impl="torch")
        with engine_patches.activated(runtime) if active else contextlib.nullcontext():
            predicts.append(
                eagle_worker_common._finalize_accept_tree_path(
                    batch, accept_index, accept_lens, torch.arange(bs * nodes, dtype=torch.int32), logits_output, bs,
                    token_to_kv_pool_allocator=allocator, num_draft_tokens=nodes,
                )  # fmt: skip
            )
    assert predicts[0].tolist() == predicts[1].tolist()
    # expected: the slot of depth d holds node accept_index[d]'s row, d <= accepted drafts
    slots = out_cache_loc.view(bs, nodes)
    expected = [buf.clone() for buf in before.k_buffer + before.v_buffer]
    for buf, orig in zip(expected, before.k_buffer + before.v_buffer):
        for b in range(bs):
            for d in range(int(result.accept_length[b]) + 1):
                buf[slots[b, d]] = orig[slots[b, int(result.accept_index[b, d])]]
    assert any(not torch.equal(w, o) for w, o in zip(expected, before.k_buffer + before.v_buffer))
    for ours, theirs, want in zip(pools[0].k_buffer + pools[0].v_buffer, pools[1].k_buffer + pools[1].v_buffer, expected):
        torch.testing.assert_close(ours, want, atol=0, rtol=0)
        torch.testing.assert_close(theirs, want, atol=0, rtol=0)


def nvfp4_pool_for(backend):
    """SGLang's NVFP4 KV pool as its pool configurator builds it for ``backend``
    (recipe configured for the backend pair, then the pool). For trtllm_mha it
    holds only native FP4 scales (``native_k/v_scale_buffer``), no linear
    ``k_scale_buffer``; for flashinfer linear scales and a dequant workspace."""
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import NVFP4KVCacheMethod

    recipe = NVFP4KVCacheMethod(num_layers=2, device="cpu", page_size=4, native_scale_layout=True)
    recipe.configure_attention_backends(backend, backend)
    return MHATokenToKVPool(
        size=60, page_size=4, dtype=torch.float4_e2m1fn_x2, head_num=2, head_dim=64, layer_num=2, device="cpu",
        enable_memory_saver=False, quant_method=recipe,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["trtllm_mha", "flashinfer"])
def test_kv_move_leaves_quantized_pools_to_sglang(backend):
    """Issue 19, item 6: moving K/V without their scales is wrong output, so a
    quantized pool goes to SGLang's own move (which moves every scale buffer),
    however its scales are laid out."""
    pool = nvfp4_pool_for(backend)
    assert type(pool) is MHATokenToKVPool and pool.is_quantized_kv_cache
    if backend == "trtllm_mha":  # the layout a k_scale_buffer-only check missed
        assert pool.k_scale_buffer is None and pool.native_k_scale_buffer is not None
    assert_left_to_sglangs_move(pool)


def assert_left_to_sglangs_move(pool):
    """Our accepted-path move hands ``pool`` to SGLang's own move, once."""
    assert layout.plain_kv_views(pool) is None
    sglang_moves = []
    batch = types.SimpleNamespace(seq_lens=torch.tensor([5]), out_cache_loc=torch.arange(4, 8))
    allocator = types.SimpleNamespace(get_kvcache=lambda: pool)
    layout.move_accepted_kv_sglang_layout(
        batch, torch.tensor([[0, 2, -1]]), torch.tensor([1]), allocator, impl="torch",
        fallback=lambda *args: sglang_moves.append(args),
    )  # fmt: skip
    assert len(sglang_moves) == 1 and sglang_moves[0][3] is allocator


def test_hooks_delegate_when_inactive():
    """Outside an EAGLE_TREE worker the wrapped functions are SGLang's."""
    scores = [torch.tensor([[[0.6, 0.4]]]), torch.tensor([[[0.6, 0.0], [0.4, 0.0]]])]
    tokens = [torch.tensor([[1, 2]]), torch.tensor([[2, 3, 3, 4]])]
    parents = [torch.tensor([[-1, 0, 1]]), torch.tensor([[2, 4]])]
    assert eagle_utils.organize_draft_results.__wrapped__ is not None  # HookRegistry wrapped it
    _, sglang_index, _ = eagle_utils.organize_draft_results(scores, tokens, parents, 4)
    assert sglang_index.tolist() == [[0, 2, 4]]
    with engine_patches.activated(engine_patches.TreeRuntime(TreeMaskMode.FULL_MASK, impl="torch")):
        _, ours, _ = eagle_utils.organize_draft_results(scores, tokens, parents, 4)
    assert ours.tolist() == [[0, 1, 2]]
    # the same wrapper everywhere SGLang imported the name
    assert eagle_worker_v2.organize_draft_results is eagle_utils.organize_draft_results
    assert eagle_worker_common.build_tree_kernel_efficient is eagle_utils.build_tree_kernel_efficient
    assert spec_utils.move_accept_tokens_to_target_kvcache is eagle_worker_common.move_accept_tokens_to_target_kvcache


# ------------------------------------------------------------- the worker


def test_worker_mode_configuration(ckpt, monkeypatch):
    publish(ckpt, 3, 2, 6)
    assert configured_mask_mode() == TreeMaskMode.ANCESTOR_BITMASK
    monkeypatch.setenv(config.MASK_MODE_ENV, "parent_pointer")
    assert configured_mask_mode() == TreeMaskMode.PARENT_POINTER
    monkeypatch.delenv(config.MASK_MODE_ENV)
    publish(ckpt, 3, 2, 6, backend="triton")
    assert configured_mask_mode() == TreeMaskMode.FULL_MASK

    # init_attention_backends resets the draft worker's mode to SGLang's default; ours restores it
    worker = object.__new__(EagleTreeWorker)
    worker.tree_mask_mode = TreeMaskMode.PARENT_POINTER
    worker._draft_worker = types.SimpleNamespace(tree_mask_mode=TreeMaskMode.FULL_MASK)
    backend = make_backend(TreeMaskMode.PARENT_POINTER)
    worker._target_worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(attn_backend=backend))
    worker.apply_mask_mode()
    assert worker._draft_worker.tree_mask_mode == TreeMaskMode.PARENT_POINTER
    worker.tree_mask_mode = TreeMaskMode.ANCESTOR_BITMASK
    with pytest.raises(RuntimeError, match="reads PARENT_POINTER tree masks but this worker is configured for ANCESTOR"):
        worker.apply_mask_mode()
    check_backend_reads(types.SimpleNamespace(verify_mask=None), TreeMaskMode.FULL_MASK)  # no buffer: nothing to check


# ------------------------------------------------ kernel build at startup


def test_worker_builds_the_cuda_kernels_when_constructed_not_in_a_step(ckpt, monkeypatch, tmp_path, caplog):
    """Issue 36, item 4: the nvcc build runs in the worker's constructor, under
    a timeout below SGLang's watchdog; a failed build is logged, Triton serves,
    and the first tree op afterwards starts no build. No GPU or nvcc here:
    torch "sees" a GPU, nvcc is /bin/true and the build child is a recorder
    that fails; EAGLEWorkerV2's own constructor (draft model load) is
    skipped, the target worker is a namespace with the device it claimed."""
    server_args = publish(ckpt, 3, 2, 6)  # SGLang's default --watchdog-timeout: 300 s
    monkeypatch.setattr(cuda_ops, "_state", {"loaded": False, "backend": None, "error": None})
    monkeypatch.setenv("SPEC_TREE_KERNELS_BUILD_DIR", str(tmp_path))
    for name in (cuda_build_guard.TIMEOUT_ENV, "SPEC_TREE_KERNELS_CUDA_JIT", "SPEC_TREE_KERNELS_IMPL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_ops, "find_nvcc", lambda: "/bin/true")
    build_timeouts = []

    def failing_build_child(args, timeout):
        build_timeouts.append(timeout)
        raise RuntimeError("nvcc fatal: stand-in build failure")

    monkeypatch.setattr(cuda_build_guard, "run_build_child", failing_build_child)
    monkeypatch.setattr(eagle_worker_v2.EAGLEWorkerV2, "__init__", lambda self, *args, **kwargs: None)
    caplog.set_level("INFO", logger="spec_tree_kernels")

    EagleTreeWorker(server_args, gpu_id=0, nccl_port=0, target_worker=types.SimpleNamespace(device="cuda"))
    assert len(build_timeouts) == 1, "the worker's constructor did not build the CUDA kernels"
    assert 140.0 < build_timeouts[0] <= 150.0  # half the watchdog, less the lock wait
    assert "nvcc fatal: stand-in build failure" in caplog.text and "Triton" in caplog.text
    # what every tree op dispatches by on a CUDA tensor: Triton, and no second build
    assert stk.resolve_impl("build", "auto", torch.device("cuda")) == "triton"
    assert len(build_timeouts) == 1


def test_startup_build_timeout_stays_under_the_watchdog(monkeypatch):
    monkeypatch.delenv(cuda_build_guard.TIMEOUT_ENV, raising=False)
    assert startup_build_timeout(300) == 150.0
    assert startup_build_timeout(40) == 20.0
    assert startup_build_timeout(None) == cuda_build_guard.DEFAULT_BUILD_TIMEOUT_S  # watchdog off
    assert startup_build_timeout(3000) == cuda_build_guard.DEFAULT_BUILD_TIMEOUT_S
    monkeypatch.setenv(cuda_build_guard.TIMEOUT_ENV, "900")  # the user's explicit choice wins
    assert startup_build_timeout(300) == 900.0
