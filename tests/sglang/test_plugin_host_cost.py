"""Per-step host cost of the EAGLE_TREE hooks and the verify attention prep
(issue #38, items 3 and 5).

On a GPU every torch op of a step is a kernel launch and some microseconds
of host time, and the SGLang adapter runs between SGLang's own kernels every
step. These tests count the aten ops each hooked call dispatches (a
``TorchDispatchMode`` counter) and the Triton launches it makes, against a
budget per call; Triton launches run outside the counter (under
``TRITON_INTERPRET=1`` a launch is a host program that itself runs torch
ops, which a GPU launch does not).

Runs in ``.venv-sglang`` with ``TRITON_INTERPRET=1``; real: SGLang's
``MHATokenToKVPool``, ``ReqToTokenPool``, ``ForwardBatch``, its
``_verify_uses_greedy`` as the hook's original; doubles: the batch handed to
the KV move (a namespace with the two fields read), the allocator (it hands
out the pool).
"""

from __future__ import annotations

import collections
import inspect
import types

import pytest

from sglang_gate import require_sglang_venv

require_sglang_venv()

from spec_plugins.sglang_ext import _testing  # noqa: E402

import torch  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.speculative import eagle_utils  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes  # noqa: E402

import spec_tree_kernels as stk  # noqa: E402
import spec_tree_kernels.triton_launch as triton_launch  # noqa: E402
import spec_tree_kernels.triton_ops as triton_ops  # noqa: E402
from spec_plugins.sglang_ext import engine_patches  # noqa: E402
from spec_tree_kernels import TreeMaskMode  # noqa: E402

pytestmark = pytest.mark.sglang

BS, TOPK, STEPS, NODES, LAYERS = 4, 4, 5, 8, 32


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.ops.values())


@pytest.fixture
def count(monkeypatch):
    """count(fn) -> (aten ops dispatched by fn outside its Triton launches,
    Triton launches, the ops by name)."""
    launches = []
    launch = triton_launch.launch

    def counted_launch(*args, **kwargs):
        launches.append(args[0])
        with _disable_current_modes():
            return launch(*args, **kwargs)

    # the seam, where the op modules call it (triton_ops holds its own name for it)
    monkeypatch.setattr(triton_launch, "launch", counted_launch)
    monkeypatch.setattr(triton_ops, "launch", counted_launch)

    def run(fn):
        launches.clear()
        with OpCounter() as counter:
            fn()
        return counter.total, len(launches), dict(counter.ops)

    return run


@pytest.fixture
def triton_runtime():
    """An active runtime on the Triton ops (the GPU path)."""
    with engine_patches.activated(
        engine_patches.TreeRuntime(TreeMaskMode.ANCESTOR_BITMASK, impl="triton")
    ) as runtime:
        yield runtime


def tree_case(gen):
    parent_list = _testing.random_parent_list(gen, BS, TOPK, STEPS)
    selected = stk.select_tree_nodes(torch.rand(BS, stk.pool_size(TOPK, STEPS), generator=gen), parent_list, TOPK,
                                     STEPS, NODES)  # fmt: skip
    build = stk.build_tree(selected, parent_list, torch.full((BS,), 10), TOPK, STEPS, TreeMaskMode.ANCESTOR_BITMASK)
    return parent_list, selected, build


# Budgets: aten ops per call outside the kernels (their outputs' allocations
# included), and launches. Before issue #38: greedy verify 26 ops; the KV move
# 73 ops and one launch per K/V tensor (64 for 32 layers) in every step.
GREEDY_VERIFY_OPS = 18
SAMPLED_VERIFY_OPS = 21  # before: 29 (the exponentials' draw is 4 of them)
KV_MOVE_OPS, KV_MOVE_LAUNCHES = 10, 1
ORGANIZE_OPS, BUILD_OPS = 8, 23  # concatenating SGLang's per-step lists; the build's outputs


def test_greedy_verify_hook_op_budget(count, triton_runtime):
    gen = torch.Generator().manual_seed(1)
    _, _, build = tree_case(gen)
    candidates = torch.randint(0, 5, (BS, NODES), generator=gen)
    target = torch.randint(0, 5, (BS * NODES,), generator=gen)
    predicts = torch.zeros(BS * NODES, dtype=torch.int32)
    accept_index = torch.zeros(BS, STEPS + 1, dtype=torch.int32)
    accept_num = torch.zeros(BS, dtype=torch.int32)
    ops, launches, by_name = count(lambda: engine_patches._verify_hook(
        None, predicts, accept_index, accept_num, candidates, build.retrieve_index, build.retrieve_next_token,
        build.retrieve_next_sibling, target, TOPK,
    ))  # fmt: skip
    assert launches == 1
    assert ops <= GREEDY_VERIFY_OPS, by_name
    # and the result is the op's: the accepted nodes' slots hold the target's argmax
    result = stk.verify_tree_greedy(candidates, build.retrieve_next_token, build.retrieve_next_sibling,
                                    target.view(BS, NODES), STEPS, impl="torch")  # fmt: skip
    assert accept_num.tolist() == result.accept_length.tolist()
    for b in range(BS):
        for d in range(int(result.accept_length[b]) + 1):
            node = int(result.accept_index[b, d])
            assert int(accept_index[b, d]) == int(build.retrieve_index[b, node])
            assert int(predicts[b * NODES + node]) == int(target[b * NODES + node])


def test_sampled_verify_hook_op_budget(count, triton_runtime):
    gen = torch.Generator().manual_seed(8)
    _, _, build = tree_case(gen)
    vocab = 512
    args = (
        torch.zeros(BS * NODES, dtype=torch.int32), torch.zeros(BS, STEPS + 1, dtype=torch.int32),
        torch.zeros(BS, dtype=torch.int32), torch.randint(0, vocab, (BS, NODES), generator=gen), build.retrieve_index,
        build.retrieve_next_token, build.retrieve_next_sibling, torch.rand(BS, NODES, generator=gen),
        torch.rand(BS, generator=gen), torch.softmax(torch.randn(BS * NODES, vocab, generator=gen), -1), torch.zeros(1),
    )  # fmt: skip
    ops, launches, by_name = count(lambda: engine_patches._sample_hook(None, *args))
    assert launches == 1
    assert ops <= SAMPLED_VERIFY_OPS, by_name


def make_pool():
    return MHATokenToKVPool(
        size=256, page_size=1, dtype=torch.float16, head_num=2, head_dim=16, layer_num=LAYERS, device="cpu",
        enable_memory_saver=False,
    )  # fmt: skip


def test_kv_move_hook_op_budget_and_one_launch(count, triton_runtime):
    """Steady state (the second step on one pool): the pool's 2 x layers views
    are not rebuilt, and the Triton move is one launch for all of them."""
    gen = torch.Generator().manual_seed(2)
    pool = make_pool()
    for buf in pool.k_buffer + pool.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen))
    before = [buf.clone() for buf in pool.k_buffer + pool.v_buffer]
    allocator = types.SimpleNamespace(get_kvcache=lambda: pool)
    out_cache_loc = torch.randperm(255, generator=gen)[: BS * NODES] + 1
    batch = types.SimpleNamespace(seq_lens=torch.full((BS,), 10), out_cache_loc=out_cache_loc)
    # request b accepts node 2 at depth 1 (flat b * T + 2), nothing after
    accept_index = torch.full((BS, STEPS + 1), -1, dtype=torch.int32)
    accept_index[:, 0] = torch.arange(BS) * NODES
    accept_index[:, 1] = torch.arange(BS) * NODES + 2
    accept_num = torch.ones(BS, dtype=torch.int32)
    engine_patches._move_hook(None, batch, accept_index, accept_num, allocator)  # the first step builds the views
    ops, launches, by_name = count(lambda: engine_patches._move_hook(None, batch, accept_index, accept_num, allocator))
    assert launches == KV_MOVE_LAUNCHES
    assert ops <= KV_MOVE_OPS, by_name
    slots = batch.out_cache_loc.view(BS, NODES)
    for buf, old in zip(pool.k_buffer + pool.v_buffer, before):  # every layer's K and V moved (twice: idempotent here)
        torch.testing.assert_close(buf[slots[:, 1]], old[slots[:, 2]], atol=0, rtol=0)


def test_organize_and_build_hook_op_budgets(count, triton_runtime):
    gen = torch.Generator().manual_seed(3)
    parent_list, selected, _ = tree_case(gen)
    scores = [torch.rand(BS, 1, TOPK, generator=gen)] + [torch.rand(BS, TOPK, TOPK, generator=gen) for _ in range(STEPS - 1)]
    tokens = [torch.randint(0, 9, (BS, TOPK), generator=gen)] + [
        torch.randint(0, 9, (BS, TOPK * TOPK), generator=gen) for _ in range(STEPS - 1)
    ]
    parents = [parent_list[:, :1]] + [parent_list[:, 1 + i * TOPK : 1 + (i + 1) * TOPK] for i in range(STEPS - 1)]
    parents.append(torch.zeros(BS, TOPK, dtype=torch.long))  # the last step's (SGLang does not read it)
    ops, launches, by_name = count(lambda: engine_patches._organize_hook(None, scores, tokens, parents, NODES))
    assert launches == 1 and ops <= ORGANIZE_OPS, by_name
    buf = torch.zeros(8, NODES, 1, dtype=torch.int64)
    ops, launches, by_name = count(lambda: engine_patches._build_hook(
        None, torch.zeros(BS, dtype=torch.long), parent_list, selected, torch.zeros(BS, NODES - 1, dtype=torch.long),
        torch.full((BS,), 10), 40, TOPK, STEPS, NODES, TreeMaskMode.ANCESTOR_BITMASK, buf, True,
    ))  # fmt: skip
    assert launches == 1 and ops <= BUILD_OPS, by_name


def test_kv_views_are_built_once_per_pool():
    from spec_plugins.sglang_ext import layout

    pool = make_pool()
    first = layout.plain_kv_views(pool)
    assert len(first) == 2 * LAYERS and layout.plain_kv_views(pool) is first
    pool.k_buffer = list(pool.k_buffer)  # a pool that swaps its buffer lists gets fresh views
    assert layout.plain_kv_views(pool) is not first


def test_uses_greedy_hook_binds_no_signature_per_call(monkeypatch):
    """SGLang calls ``_verify_uses_greedy`` with keywords only; the hook reads
    them, without ``inspect.signature(...).bind`` every verify step."""
    def no_bind(*args, **kwargs):
        raise AssertionError("inspect.Signature.bind called per step")

    monkeypatch.setattr(inspect.Signature, "bind", no_bind)
    original = inspect.unwrap(eagle_utils._verify_uses_greedy)
    flags = dict(is_cpu=True, is_hip=False, is_xpu=False, use_rejection_sampling=False)
    with engine_patches.activated(engine_patches.TreeRuntime(TreeMaskMode.QLEN_ONLY, impl="torch")):
        assert engine_patches._uses_greedy_hook(original, is_all_greedy=False, **flags) is False
        assert engine_patches._uses_greedy_hook(original, is_all_greedy=True, **flags) is True
        # SGLang's chain sampler (use_rejection_sampling) stays SGLang's decision
        assert engine_patches._uses_greedy_hook(original, is_all_greedy=False, **dict(flags, use_rejection_sampling=True))


def test_implementations_are_resolved_once_when_the_worker_activates(monkeypatch, count):
    """The worker's runtime resolves each op's implementation at activation
    (``SPEC_TREE_KERNELS_IMPL`` read then): a later change of the environment
    does not reach the ops of a running worker, which no longer read it."""
    monkeypatch.setenv(stk.api.IMPL_ENV, "triton")
    runtime = engine_patches.TreeRuntime(TreeMaskMode.ANCESTOR_BITMASK, device="cpu")
    assert runtime.impl_for("verify") == "triton" and runtime.impl_for("move_kv") == "triton"
    monkeypatch.setenv(stk.api.IMPL_ENV, "torch")
    gen = torch.Generator().manual_seed(4)
    _, _, build = tree_case(gen)
    candidates = torch.randint(0, 5, (BS, NODES), generator=gen)
    target = torch.randint(0, 5, (BS * NODES,), generator=gen)
    outputs = (torch.zeros(BS * NODES, dtype=torch.int32), torch.zeros(BS, STEPS + 1, dtype=torch.int32),
               torch.zeros(BS, dtype=torch.int32))  # fmt: skip
    with engine_patches.activated(runtime):
        _, launches, _ = count(lambda: engine_patches._verify_hook(
            None, *outputs, candidates, build.retrieve_index, build.retrieve_next_token, build.retrieve_next_sibling,
            target, TOPK,
        ))  # fmt: skip
    assert launches == 1  # still Triton


# ------------------------------------------------------ sampled verify memory


def test_sampled_verify_with_min_p_allocates_one_probability_sized_temporary():
    """Issue #38 item 4: min-p on [bs*T, V] fp32 probabilities (about 200 MB
    at bs 48, T 8, V 128k) allocated three more fp32 tensors of that size (a
    zeros_like, the where and the division). Now one, plus its bool mask.
    Measured with torch.profiler's per-op memory at reduced sizes."""
    from torch.profiler import ProfilerActivity, profile

    from spec_plugins.sglang_ext import layout

    vocab = 4096
    gen = torch.Generator().manual_seed(6)
    _, _, build = tree_case(gen)
    probs = torch.softmax(torch.randn(BS * NODES, vocab, generator=gen), -1)
    context = layout.VerifyContext(seq_lens=torch.full((BS,), 10), min_ps=torch.full((BS,), 0.05))
    exponentials = torch.empty(BS, vocab).exponential_(generator=gen)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        layout.verify_tree_sampling_sglang_layout(
            torch.zeros(BS * NODES, dtype=torch.int32), torch.zeros(BS, STEPS + 1, dtype=torch.int32),
            torch.zeros(BS, dtype=torch.int32), torch.randint(0, vocab, (BS, NODES), generator=gen),
            build.retrieve_index, build.retrieve_next_token, build.retrieve_next_sibling,
            torch.rand(BS, NODES, generator=gen), torch.rand(BS, generator=gen), probs, torch.zeros(1),
            impl="torch", exponentials=exponentials, context=context,
        )  # fmt: skip
    full = BS * NODES * vocab  # elements of one [bs*T, V] tensor
    large = [(e.name, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage >= full]
    assert sum(size for _, size in large) <= full * 4 + full, large  # one fp32 [bs*T, V] and one bool mask


def test_hooked_calls_make_no_host_reads(monkeypatch, triton_runtime):
    """Selection, build, greedy verify and the KV move read no device value on
    the host (test_plugin_graphs.NoHostReads: item, int(), tolist, D2H copies)."""
    from test_plugin_graphs import no_host_reads

    gen = torch.Generator().manual_seed(7)
    parent_list, selected, build = tree_case(gen)
    scores = [torch.rand(BS, 1, TOPK, generator=gen)] + [torch.rand(BS, TOPK, TOPK, generator=gen) for _ in range(STEPS - 1)]
    tokens = [torch.randint(0, 9, (BS, TOPK), generator=gen)] + [
        torch.randint(0, 9, (BS, TOPK * TOPK), generator=gen) for _ in range(STEPS - 1)
    ]
    parents = [parent_list[:, :1]] + [parent_list[:, 1 + i * TOPK : 1 + (i + 1) * TOPK] for i in range(STEPS - 1)]
    parents.append(torch.zeros(BS, TOPK, dtype=torch.long))
    pool = make_pool()
    allocator = types.SimpleNamespace(get_kvcache=lambda: pool)
    batch = types.SimpleNamespace(seq_lens=torch.full((BS,), 10), out_cache_loc=torch.arange(BS * NODES) + 1)
    accept_index = torch.full((BS, STEPS + 1), -1, dtype=torch.int32)
    accept_index[:, 0] = torch.arange(BS) * NODES
    accept_num = torch.zeros(BS, dtype=torch.int32)
    with no_host_reads(monkeypatch, []):
        engine_patches._organize_hook(None, scores, tokens, parents, NODES)
        engine_patches._build_hook(
            None, torch.zeros(BS, dtype=torch.long), parent_list, selected, torch.zeros(BS, NODES - 1, dtype=torch.long),
            torch.full((BS,), 10), 40, TOPK, STEPS, NODES, TreeMaskMode.ANCESTOR_BITMASK,
            torch.zeros(8, NODES, 1, dtype=torch.int64), True,
        )  # fmt: skip
        engine_patches._verify_hook(
            None, torch.zeros(BS * NODES, dtype=torch.int32), torch.zeros(BS, STEPS + 1, dtype=torch.int32),
            torch.zeros(BS, dtype=torch.int32), torch.randint(0, 5, (BS, NODES), generator=gen), build.retrieve_index,
            build.retrieve_next_token, build.retrieve_next_sibling, torch.randint(0, 5, (BS * NODES,), generator=gen),
            TOPK,
        )  # fmt: skip
        engine_patches._move_hook(None, batch, accept_index, accept_num, allocator)
