"""EAGLE_TREE registration and startup resolution against SGLang 0.5.23.

Runs in ``.venv-sglang`` (``ci/setup_sglang_venv.sh``):

    TRITON_INTERPRET=1 .venv-sglang/bin/python -m pytest tests/sglang/test_plugin_*.py -q

What is real here: SGLang's plugin registry, its ``SpeculativeAlgorithm``,
its CLI parser (``prepare_server_args``) and its whole ``ServerArgs``
resolution pipeline, run on config-only checkpoints (nothing is loaded).
What is faked: ``torchvision`` (see ``spec_plugins.sglang_ext._testing``),
imported by SGLang's multimodal modules and unusable with CPU-only torch.
SGLang's server itself cannot start on these machines (no CPU kernels on
PyPI), so the scheduler-facing methods are called directly.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
import types

import pytest

from sglang_gate import require_sglang_venv

require_sglang_venv()

from spec_plugins.sglang_ext import _testing  # noqa: E402

import torch  # noqa: E402
from sglang.srt.arg_groups.overrides import resolved_view  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

import spec_plugins.sglang_ext as ext  # noqa: E402
from spec_plugins import engine_versions  # noqa: E402
from spec_plugins.sglang_ext import config, engine_patches, registration  # noqa: E402

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return _testing.write_tiny_checkpoint_configs(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    # the user's knobs, unset unless a test sets them
    monkeypatch.delenv(config.VARIANT_ENV, raising=False)
    monkeypatch.delenv(config.MASK_MODE_ENV, raising=False)
    monkeypatch.delenv("SGLANG_USE_HND_KVCACHE", raising=False)
    monkeypatch.delenv(engine_versions.ALLOW_UNTESTED_ENV, raising=False)


def resolve(ckpt, head="eagle3_head", **kwargs):
    kwargs.setdefault("attention_backend", config.BACKEND_TORCH)
    return _testing.resolved_server_args(
        model_path=ckpt["target"],
        speculative_algorithm="eagle_tree",
        speculative_draft_model_path=ckpt[head],
        **kwargs,
    )


# ----------------------------------------------------------- registration


def test_register_is_idempotent_and_the_name_resolves():
    ext.register()
    ext.register()  # a second call (SGLang loads plugins once per process, tests call it again)
    registration.register_all()  # even the inner step is idempotent
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.speculative.spec_registry import _REGISTRY

    assert list(_REGISTRY).count("EAGLE_TREE") == 1
    for target, hook in engine_patches.HOOKS:
        assert sum(h is hook for _, h, _ in HookRegistry._hooks[target]) == 1
    algo = SpeculativeAlgorithm.from_string("eagle_tree")
    assert algo is SpeculativeAlgorithm.from_string("EAGLE_TREE")
    assert type(algo).__name__ == "EagleTreeSpecAlgo"
    assert algo.name == "EAGLE_TREE" and algo.supports_overlap


def test_scheduler_facing_methods(ckpt):
    """The methods 0.5.23's scheduler calls but CustomSpecAlgo lacks, and the
    EAGLE-family answers that route it through the EAGLE code paths."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    algo = SpeculativeAlgorithm.from_string("EAGLE_TREE")
    for method in ("carries_draft_hidden_states", "create_future_map", "need_topk"):
        assert not hasattr(CustomSpecAlgo, method), f"SGLang's CustomSpecAlgo now has {method}: re-check the plugin"
        assert callable(getattr(algo, method))
    assert algo.is_eagle() and algo.carries_draft_hidden_states() and algo.need_topk()
    assert algo.supports_mixed_chunk() and algo.supports_grammar_overlap() and algo.has_draft_kv()
    assert not (algo.is_dflash() or algo.is_ngram() or algo.is_standalone() or algo.is_none())
    # scheduler init builds the overlap FutureMap through the spec object
    pool = ReqToTokenPool(size=4, max_context_len=32, device="cpu", enable_memory_saver=False)
    future_map = algo.create_future_map(torch.device("cpu"), pool)
    assert type(future_map).__name__ == "FutureMap"
    # the worker factory: the scheduler builds Cls(server_args=, gpu_id=, nccl_port=, target_worker=)
    server_args = resolve(ckpt)
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2

    from spec_plugins.sglang_ext.worker import EagleTreeWorker

    worker_cls = algo.create_worker(server_args)
    assert worker_cls is EagleTreeWorker and issubclass(worker_cls, EAGLEWorkerV2)


def test_variant_follows_each_engines_head(ckpt, monkeypatch):
    """Engines started one after another in one process, with heads of both
    kinds (issue 19, item 7): each one's scheduler (here: this process after
    ``publish``, as SGLang's scheduler does) sees its own head's variant, and
    resolution leaves the environment alone (scheduler processes inherit it)."""
    algo = SpeculativeAlgorithm.from_string("EAGLE_TREE")
    for head, eagle3 in (("eagle3_head", True), ("eagle_head", False), ("eagle3_head", True)):
        server_args = resolve(ckpt, head=head)
        assert config.VARIANT_ENV not in os.environ
        _testing.publish(server_args)
        assert (algo.variant(), algo.is_eagle3()) == (("EAGLE3", True) if eagle3 else ("EAGLE", False)), head
    monkeypatch.setenv(config.VARIANT_ENV, "eagle3")  # the user's explicit override wins over detection
    _testing.publish(resolve(ckpt, head="eagle_head"))
    assert algo.is_eagle3()
    monkeypatch.delenv(config.VARIANT_ENV)
    assert algo.is_eagle3()  # decided at resolution: what the scheduler processes are handed
    _testing.publish(resolve(ckpt, head="eagle_head"))
    assert not algo.is_eagle3()  # and not cached for that head


# Issue 36, item 5: EAGLE vs EAGLE3 is decided once, where the arguments are
# resolved, with SGLang's draft-config arguments, and carried to every process.


def test_unreadable_head_config_fails_startup_naming_the_path(ckpt, tmp_path):
    """Not a guess of EAGLE: an EAGLE-3 head loaded as EAGLE crashes or barely accepts."""
    (tmp_path / "no_config_json").mkdir()
    for head in (tmp_path / "no_config_json", tmp_path / "missing"):
        with pytest.raises(ValueError, match="cannot read the draft head's config from --speculative-draft-model-path "
                                             + re.escape(repr(str(head)))):  # fmt: skip
            _testing.resolved_server_args(
                model_path=ckpt["target"], speculative_algorithm="EAGLE_TREE", speculative_draft_model_path=str(head),
                attention_backend=config.BACKEND_TORCH,
            )  # fmt: skip


def test_head_config_is_read_with_sglangs_draft_config_arguments(ckpt, monkeypatch):
    """trust_remote_code, the revision, the model overrides and the config
    parser: what ``ModelConfig.from_server_args`` loads the draft with."""
    from sglang.srt.utils import hf_transformers_utils

    real_get_config, calls = hf_transformers_utils.get_config, []

    def recording_get_config(model, **kwargs):
        calls.append((model, kwargs))
        return real_get_config(model, **kwargs)

    monkeypatch.setattr(hf_transformers_utils, "get_config", recording_get_config)
    server_args = resolve(
        ckpt, trust_remote_code=True, speculative_draft_model_revision="v2",
        json_model_override_args='{"rope_theta": 20000.0}',
    )  # fmt: skip
    expected = {"trust_remote_code": True, "revision": "v2", "model_override_args": {"rope_theta": 20000.0},
                "model_config_parser": resolved_view(server_args).model_config_parser}  # fmt: skip
    assert (ckpt["eagle3_head"], expected) in calls, calls
    _testing.publish(server_args)
    assert SpeculativeAlgorithm.from_string("EAGLE_TREE").is_eagle3()


SCHEDULER_PROCESS = """
import pickle, sys
from spec_plugins.sglang_ext import _testing
_testing.install_import_stubs()  # torchvision only
import spec_plugins.sglang_ext as ext
ext.register()  # what load_plugins does in the scheduler
from sglang.srt.runtime_context import publish
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
publish(pickle.load(open(sys.argv[1], "rb")), role="scheduler")
print("VARIANT:", SpeculativeAlgorithm.from_string("EAGLE_TREE").variant())
"""


def test_scheduler_process_uses_the_variant_resolved_in_the_main_process(ckpt, tmp_path):
    """A fresh process handed the pickled server args, as SGLang's scheduler
    is, answers from them without reading the head again: here the head is
    gone by then (as on a process that cannot read it, e.g. without
    trust_remote_code), which a re-read would have turned into EAGLE."""
    head = tmp_path / "eagle3_head"
    shutil.copytree(ckpt["eagle3_head"], head)
    server_args = _testing.resolved_server_args(
        model_path=ckpt["target"], speculative_algorithm="EAGLE_TREE", speculative_draft_model_path=str(head),
        attention_backend=config.BACKEND_TORCH,
    )  # fmt: skip
    args_file = tmp_path / "server_args.pickle"
    args_file.write_bytes(pickle.dumps(server_args))
    shutil.rmtree(head)
    out = subprocess.run(
        [sys.executable, "-c", SCHEDULER_PROCESS, str(args_file)], capture_output=True, text=True, timeout=300
    )
    assert "VARIANT: EAGLE3" in out.stdout, (out.stdout, out.stderr[-3000:])


def test_no_published_variant_is_an_error_not_a_guess(ckpt):
    eagle_args = _testing.resolved_server_args(
        model_path=ckpt["target"], speculative_algorithm="EAGLE", speculative_draft_model_path=ckpt["eagle_head"],
        attention_backend="triton",
    )  # fmt: skip
    _testing.publish(eagle_args)  # resolved for EAGLE: our hook decided nothing
    with pytest.raises(RuntimeError, match="carry no head variant"):
        SpeculativeAlgorithm.from_string("EAGLE_TREE").is_eagle3()


def test_seams_resolve_and_a_moved_one_is_reported(monkeypatch):
    engine_patches.check_seams()
    moved = engine_patches.Seam("sglang.srt.speculative.eagle_utils:no_such_function", "srt/x.py", "test")
    monkeypatch.setattr(engine_patches, "SEAMS", engine_patches.SEAMS + (moved,))
    with pytest.raises(RuntimeError, match="no_such_function"):
        engine_patches.check_seams()


def test_version_gate(monkeypatch):
    real = engine_versions.importlib.metadata.version
    monkeypatch.setattr(
        engine_versions.importlib.metadata, "version", lambda d: "0.5.99" if d == "sglang" else real(d)
    )
    monkeypatch.setattr(ext, "_registered", False)
    with pytest.raises(RuntimeError, match="0.5.99.*not a tested release"):
        ext.register()
    assert ext._registered is False
    monkeypatch.setenv(engine_versions.ALLOW_UNTESTED_ENV, "1")
    ext.register()
    assert ext._registered is True


def test_attention_backends_registered_and_on_the_cli(ckpt):
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import prepare_server_args

    for name in config.OUR_BACKENDS:
        assert name in ATTENTION_BACKENDS and ATTENTION_BACKEND_CHOICES.count(name) == 1
    argv = [
        "--model-path", ckpt["target"], "--speculative-algorithm", "EAGLE_TREE",
        "--speculative-draft-model-path", ckpt["eagle3_head"], "--speculative-num-steps", "5",
        "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8",
        "--attention-backend", "spec_tree", "--device", "cpu", "--skip-tokenizer-init",
    ]  # fmt: skip
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    view = resolved_view(server_args)
    assert (view.speculative_algorithm, view.attention_backend) == ("EAGLE_TREE", "spec_tree")
    assert (view.speculative_num_steps, view.speculative_eagle_topk, view.speculative_num_draft_tokens) == (5, 4, 8)


# ------------------------------- --speculative-tree-mask-mode (issue #53, item 5)


def parse(ckpt, *extra, algorithm="EAGLE_TREE", backend="spec_tree"):
    """SGLang's own CLI parsing (``prepare_server_args``), then its resolution."""
    from sglang.srt.server_args import prepare_server_args

    argv = [
        "--model-path", ckpt["target"], "--speculative-algorithm", algorithm,
        "--speculative-draft-model-path", ckpt["eagle3_head"], "--attention-backend", backend,
        "--device", "cpu", "--skip-tokenizer-init", *extra,
    ]  # fmt: skip
    server_args = prepare_server_args(argv)
    server_args.resolve_once()
    return server_args


def test_mask_mode_flag_on_sglangs_parser_wins_over_the_variable(ckpt, monkeypatch):
    """The flag is on SGLang's parser (hooks on ServerArgs.add_cli_args /
    from_cli_args, applied by the plugin registry), travels in the server
    args to every process (pickled, as SGLang hands them to its schedulers),
    and wins over SPEC_PLUGINS_TREE_MASK_MODE; the variable stays the fallback."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    from spec_plugins.sglang_ext import worker

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert config.MASK_MODE_FLAG in parser.format_help()
    monkeypatch.setenv(config.MASK_MODE_ENV, "QLEN_ONLY")
    server_args = parse(ckpt, config.MASK_MODE_FLAG, "parent_pointer")
    child = pickle.loads(pickle.dumps(server_args))  # what a scheduler process is handed
    assert getattr(child, config.MASK_MODE_RECORD) == "parent_pointer"
    _testing.publish(child)
    try:
        assert worker.configured_mask_mode() == config.TreeMaskMode.PARENT_POINTER  # the flag, not the variable
        _testing.publish(parse(ckpt))  # no flag: the variable
        assert worker.configured_mask_mode() == config.TreeMaskMode.QLEN_ONLY
        monkeypatch.delenv(config.MASK_MODE_ENV)
        assert worker.configured_mask_mode() == config.TreeMaskMode.ANCESTOR_BITMASK  # neither: the backend's default
        # the flag overrides a variable the backend cannot read, in resolution and in the worker
        monkeypatch.setenv(config.MASK_MODE_ENV, "FULL_MASK")
        _testing.publish(parse(ckpt, config.MASK_MODE_FLAG, "3"))
        assert worker.configured_mask_mode() == config.TreeMaskMode.ANCESTOR_BITMASK
    finally:
        monkeypatch.delenv(config.MASK_MODE_ENV, raising=False)
        _testing.publish(resolve(ckpt))


def engine_server_args(monkeypatch, **kwargs):
    """The ServerArgs ``sglang.Engine(**kwargs)`` builds: SGLang's own
    ``Engine.__init__`` (its load_plugins, its ServerArgs construction from
    the keywords), stopped where it would launch the scheduler processes."""
    import sglang
    from sglang.srt.entrypoints import engine

    class Launching(Exception):
        pass

    def launch(cls, server_args, **launch_kwargs):
        raise Launching(server_args)

    monkeypatch.setattr(engine.Engine, "_launch_subprocesses", classmethod(launch))
    monkeypatch.setattr(engine.atexit, "register", lambda function: function)  # no shutdown of an unlaunched Engine
    with pytest.raises(Launching) as launched:
        sglang.Engine(**kwargs)
    return launched.value.args[0]


def test_mask_mode_is_an_engine_keyword(ckpt, monkeypatch):
    """``sglang.Engine(speculative_tree_mask_mode=...)``, as every other
    speculative flag is an Engine keyword: the value arrives in the ServerArgs
    Engine builds (SGLang's own class, so what SGLang pickles to its
    schedulers is unchanged), and from there it is what the flag is: resolved
    and validated with the speculative flags, carried to the scheduler, read
    by the worker."""
    from sglang.srt.server_args import ServerArgs

    from spec_plugins.sglang_ext import worker

    engine_kwargs = dict(
        model_path=ckpt["target"], speculative_algorithm="EAGLE_TREE", speculative_draft_model_path=ckpt["eagle3_head"],
        attention_backend=config.BACKEND_TORCH, device="cpu", skip_tokenizer_init=True,
    )  # fmt: skip
    monkeypatch.setenv(config.MASK_MODE_ENV, "QLEN_ONLY")  # the keyword wins over it, as the flag does
    given_as = (("parent_pointer", "parent_pointer"), (config.TreeMaskMode.PARENT_POINTER, "PARENT_POINTER"), (4, "4"))
    for given, recorded in given_as:
        server_args = engine_server_args(monkeypatch, **engine_kwargs, speculative_tree_mask_mode=given)
        assert type(server_args) is ServerArgs
        assert getattr(server_args, config.MASK_MODE_RECORD) == recorded
        server_args.resolve_once()
        _testing.publish(pickle.loads(pickle.dumps(server_args)))  # what a scheduler process is handed
        assert worker.configured_mask_mode() == config.TreeMaskMode.PARENT_POINTER
    # not given: the variable, as without the flag
    server_args = engine_server_args(monkeypatch, **engine_kwargs)
    assert getattr(server_args, config.MASK_MODE_RECORD, None) is None
    server_args.resolve_once()
    _testing.publish(server_args)
    assert worker.configured_mask_mode() == config.TreeMaskMode.QLEN_ONLY
    # validated where the flag is, naming it
    server_args = engine_server_args(monkeypatch, **engine_kwargs, speculative_tree_mask_mode="qlen_only_bitpacking")
    message = "--speculative-tree-mask-mode QLEN_ONLY_BITPACKING: attention backend 'spec_tree' cannot read"
    with pytest.raises(ValueError, match=message):
        server_args.resolve_once()
    _testing.publish(resolve(ckpt))


FIRST_ENGINE_PROCESS = """
import sys
from spec_plugins.sglang_ext import _testing
_testing.install_import_stubs()  # torchvision only; the plugin is not registered by hand
import sglang
from sglang.srt.entrypoints import engine

class Launching(Exception):
    pass

def launch(cls, server_args, **kwargs):
    raise Launching(server_args)

engine.Engine._launch_subprocesses = classmethod(launch)
engine.atexit.register = lambda function: function
try:
    sglang.Engine(model_path=sys.argv[1], speculative_algorithm="EAGLE_TREE", speculative_draft_model_path=sys.argv[2],
                  attention_backend="spec_tree", device="cpu", skip_tokenizer_init=True,
                  speculative_tree_mask_mode="parent_pointer")
except Launching as launched:
    print("RECORDED:", getattr(launched.args[0], sys.argv[3], None))
"""


def test_mask_mode_is_a_keyword_of_the_first_engine_of_a_process(ckpt):
    """The usual case: a fresh interpreter whose first ``sglang.Engine(...)``
    loads the plugins itself (SGLang's entry points), just before it builds
    its ServerArgs from the keywords."""
    out = subprocess.run(
        [sys.executable, "-c", FIRST_ENGINE_PROCESS, ckpt["target"], ckpt["eagle3_head"], config.MASK_MODE_RECORD],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "RECORDED: parent_pointer" in out.stdout, (out.stdout, out.stderr[-3000:])


MASK_MODE_FLAG_ERRORS = [
    pytest.param(("BOGUS",), {}, "--speculative-tree-mask-mode 'BOGUS': unknown tree mask mode 'BOGUS'; expected one "
                 "of: FULL_MASK, QLEN_ONLY, ANCESTOR_BITMASK, PARENT_POINTER", id="unknown"),
    pytest.param(("qlen_only_bitpacking",), {}, "--speculative-tree-mask-mode QLEN_ONLY_BITPACKING: attention backend "
                 "'spec_tree' cannot read", id="bitpacking-has-no-reader"),
    pytest.param(("2",), {"backend": "triton"}, "--speculative-tree-mask-mode QLEN_ONLY_BITPACKING: attention backend "
                 "'triton' cannot read", id="bitpacking-by-number"),
    pytest.param(("full_mask",), {}, "--speculative-tree-mask-mode FULL_MASK: attention backend 'spec_tree' cannot "
                 "read this tree mask; it reads ANCESTOR_BITMASK, PARENT_POINTER, QLEN_ONLY", id="backend-cannot-read"),
    pytest.param(("ANCESTOR_BITMASK",), {"backend": "triton"}, "--speculative-tree-mask-mode ANCESTOR_BITMASK: "
                 "attention backend 'triton' cannot read", id="sglang-backend-cannot-read"),
    pytest.param(("parent_pointer",), {"algorithm": "EAGLE", "backend": "triton"},
                 "--speculative-tree-mask-mode 'parent_pointer' applies to --speculative-algorithm EAGLE_TREE only",
                 id="other-algorithm"),
]  # fmt: skip


@pytest.mark.parametrize("value,kwargs,message", MASK_MODE_FLAG_ERRORS)
def test_mask_mode_flag_is_validated_at_resolution(ckpt, monkeypatch, value, kwargs, message):
    monkeypatch.setenv(config.MASK_MODE_ENV, "PARENT_POINTER")  # valid: the error is the flag's
    with pytest.raises(ValueError, match=re.escape(message)):
        parse(ckpt, config.MASK_MODE_FLAG, *value, **kwargs)


MASK_MODE_READERS = (config.BACKEND_TORCH, config.BACKEND_TRITON, "triton", "flashinfer", "intel_amx")


def test_mask_mode_flag_offers_only_modes_a_backend_reads():
    """The flag's help on SGLang's parser lists exactly the modes some verify
    backend reads: QLEN_ONLY_BITPACKING has no reader in SGLang 0.5.23, so
    offering it offers a startup failure."""
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    help_text = parser._option_string_actions[config.MASK_MODE_FLAG].help
    named = [name for name in re.findall(r"\b[A-Z_]+\b", help_text) if name in config.TreeMaskMode.__members__]
    offered = list(dict.fromkeys(named))  # the help also says which of them ours read
    read = [m.name for m in config.TreeMaskMode if any(m in config.readable_modes(b) for b in MASK_MODE_READERS)]
    assert offered == read == ["FULL_MASK", "QLEN_ONLY", "ANCESTOR_BITMASK", "PARENT_POINTER"], help_text
    for name in offered:
        mode = config.TreeMaskMode[name]
        readers = [b for b in MASK_MODE_READERS if mode in config.readable_modes(b)]
        assert readers and all(config.resolve_mask_mode(mode, b, config.MASK_MODE_FLAG) == mode for b in readers)


# ------------------------------------------------------------- resolution


def test_resolution_applies_sglang_eagle_defaults(ckpt):
    view = resolved_view(resolve(ckpt))
    # SGLang's _auto_choose_speculative_params for a Llama target, and the EAGLE family defaults
    assert (view.speculative_num_steps, view.speculative_eagle_topk, view.speculative_num_draft_tokens) == (5, 4, 8)
    assert view.max_running_requests == 48
    assert view.disable_overlap_schedule  # CPU: SGLang turns overlap off for speculative decoding
    # ours: spec_tree's torch verify is not capturable; the draft needs one of SGLang's draft backends
    assert view.cuda_graph_config.decode.backend == "disabled"
    assert view.cuda_graph_config.prefill.backend == "disabled"
    assert view.speculative_draft_attention_backend == "intel_amx"
    # topk == 1: SGLang pins draft tokens to steps + 1, as for EAGLE
    view = resolved_view(resolve(ckpt, speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=8))
    assert view.speculative_num_draft_tokens == 4


@pytest.mark.parametrize("head", ["eagle_head", "eagle3_head"])
def test_cuda_graphs_stay_enabled_with_spec_tree_triton(ckpt, head):
    """Issue #38: spec_tree_triton keeps every CUDA graph SGLang's own triton
    backend gets (draft decode and draft extend follow the DECODE phase in
    eagle_worker_v2._capture_cuda_graphs; TARGET_VERIFY is the target's decode
    graph runner through our backend, tests/sglang/test_plugin_graphs.py).
    Resolved for a GPU server (device cuda: resolution reads no device)."""
    ours = resolved_view(resolve(ckpt, head=head, attention_backend=config.BACKEND_TRITON, device="cuda"))
    sglangs = resolved_view(resolve(ckpt, head=head, attention_backend="triton", device="cuda"))
    assert ours.cuda_graph_config.decode.backend == sglangs.cuda_graph_config.decode.backend == "full"
    assert ours.cuda_graph_config.prefill.backend == sglangs.cuda_graph_config.prefill.backend
    assert ours.cuda_graph_config == sglangs.cuda_graph_config
    assert ours.speculative_draft_attention_backend == "triton"  # SGLang's Triton backend runs the draft
    # spec_tree (torch verify) turns them off (on the CPU: it is refused on CUDA, issue #53 item 4)
    torch_view = resolved_view(resolve(ckpt, head=head, attention_backend=config.BACKEND_TORCH, device="cpu"))
    assert torch_view.cuda_graph_config.decode.backend == torch_view.cuda_graph_config.prefill.backend == "disabled"


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_spec_tree_is_refused_on_cuda_naming_spec_tree_triton(ckpt, device):
    """Issue #53, item 4: spec_tree's torch verify builds fp32 buffers of
    batch x heads x T x context per layer (about 1.6 GB a layer at batch 48 x
    8k context) outside SGLang's memory profile; on CUDA it is refused where
    SGLang resolves the arguments (its --device, as SGLang resolved it; no
    CUDA needed to decide), and by the backend itself for a runner on CUDA
    (a fake runner: only its device is read, before anything is built)."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.server_args import prepare_server_args

    message = "--attention-backend spec_tree is not served on cuda.*use --attention-backend spec_tree_triton"
    with pytest.raises(ValueError, match=message):
        resolve(ckpt, attention_backend=config.BACKEND_TORCH, device=device)
    argv = [
        "--model-path", ckpt["target"], "--speculative-algorithm", "EAGLE_TREE", "--speculative-draft-model-path",
        ckpt["eagle3_head"], "--attention-backend", "spec_tree", "--device", device, "--skip-tokenizer-init",
    ]  # fmt: skip
    with pytest.raises(ValueError, match=message):
        prepare_server_args(argv).resolve_once()
    with pytest.raises(ValueError, match=message):
        ATTENTION_BACKENDS[config.BACKEND_TORCH](types.SimpleNamespace(device=device))
    with pytest.raises(ValueError, match=message):
        ATTENTION_BACKENDS[config.BACKEND_TORCH](types.SimpleNamespace(device=torch.device(device)))
    # the CPU keeps it; spec_tree_triton serves CUDA
    assert resolved_view(resolve(ckpt, attention_backend=config.BACKEND_TORCH, device="cpu")).attention_backend == "spec_tree"
    resolve(ckpt, attention_backend=config.BACKEND_TRITON, device=device)


def test_resolution_with_sglang_backend_keeps_its_mode(ckpt, monkeypatch):
    # (intel_amx, SGLang's CPU verify backend, falls back to torch_native on CPUs without AMX)
    view = resolved_view(resolve(ckpt, attention_backend="triton"))
    assert view.attention_backend == "triton" and view.speculative_draft_attention_backend is None
    assert config.resolve_mask_mode(None, "triton") == config.TreeMaskMode.FULL_MASK
    assert config.resolve_mask_mode(None, "intel_amx") == config.TreeMaskMode.QLEN_ONLY
    monkeypatch.setenv(config.MASK_MODE_ENV, "full_mask")  # what SGLang's GPU backends read
    resolve(ckpt, attention_backend="triton")
    # large trees with our backend
    monkeypatch.setenv(config.MASK_MODE_ENV, "ANCESTOR_BITMASK")
    view = resolved_view(resolve(ckpt, speculative_num_steps=9, speculative_eagle_topk=4, speculative_num_draft_tokens=128))
    assert view.speculative_num_draft_tokens == 128


STARTUP_ERRORS = [
    pytest.param({config.MASK_MODE_ENV: "BOGUS"}, {}, "unknown tree mask mode 'BOGUS'", id="unknown-mode"),
    pytest.param({config.MASK_MODE_ENV: "FULL_MASK"}, {}, "'spec_tree'.*cannot read", id="ours-cannot-read-full"),
    pytest.param({config.MASK_MODE_ENV: "QLEN_ONLY_BITPACKING"}, {}, "cannot read", id="bitpacking-has-no-reader"),
    pytest.param(
        {config.MASK_MODE_ENV: "ANCESTOR_BITMASK"}, {"attention_backend": "triton"},
        "'triton' cannot read.*it reads FULL_MASK.*need --attention-backend spec_tree",
        id="sglang-backend-cannot-read-ours",
    ),
    pytest.param(
        {config.MASK_MODE_ENV: "QLEN_ONLY"}, {"attention_backend": "triton"}, "'triton' cannot read",
        id="triton-reads-full-mask-only",
    ),
    pytest.param(
        {}, {"speculative_num_steps": 2, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 8},
        "num_draft_tokens=8 needs 7 draft nodes but num_steps=2, topk=2 only draft 6", id="tree-larger-than-pool",
    ),
    pytest.param(
        {}, {"speculative_num_steps": 40, "speculative_eagle_topk": 8, "speculative_num_draft_tokens": 1100},
        "1100 exceeds what tree mask mode ANCESTOR_BITMASK supports \\(1024", id="tree-beyond-mode",
    ),
    pytest.param(
        {}, {"speculative_eagle_topk": 4}, "need --speculative-num-steps too", id="topk-without-steps",
    ),
    pytest.param({}, {"attention_backend": "torch_native"}, "no tree-verify support", id="torch-native-tree"),
    pytest.param({}, {"kv_cache_dtype": "fp8_e4m3"}, "--kv-cache-dtype fp8_e4m3 is not supported", id="fp8-kv"),
    pytest.param(
        {}, {"prefill_attention_backend": "spec_tree", "decode_attention_backend": "triton",
             "attention_backend": None}, "for both prefill and decode", id="split-backends",
    ),
    # issue 19, item 3: tokenizer worker processes never load plugins (any attention backend)
    pytest.param({}, {"tokenizer_worker_num": 2}, "does not support --tokenizer-worker-num 2.*do not load plugins",
                 id="tokenizer-workers"),
    pytest.param({}, {"tokenizer_worker_num": 2, "attention_backend": "triton"}, "--tokenizer-worker-num 2",
                 id="tokenizer-workers-sglang-backend"),
    # issue 19, item 5: verify batches padded (DP attention) or split (two-batch overlap)
    pytest.param({}, {"attn_dp_size": 2, "tp_size": 2}, "does not support DP attention \\(--attn-dp-size 2",
                 id="dp-attention"),
    pytest.param({}, {"enable_dp_attention": True, "dp_size": 2, "tp_size": 2}, "--enable-dp-attention",
                 id="dp-attention-deprecated-flag"),
    pytest.param({}, {"enable_two_batch_overlap": True}, "does not support --enable-two-batch-overlap",
                 id="two-batch-overlap"),
    # decode context parallelism: each rank holds part of every context, our verify reads it whole
    pytest.param({}, {"attention_backend": config.BACKEND_TRITON, "device": "cuda", "dcp_size": 2, "tp_size": 2},
                 "'spec_tree_triton' does not support decode context parallelism \\(--dcp-size 2\\)", id="dcp"),
    pytest.param({}, {"dcp_size": 2, "tp_size": 2}, "'spec_tree' does not support decode context parallelism",
                 id="dcp-spec-tree"),
    # an HND pool is [pages, heads, page_size, dim]; our verify reads token slots
    pytest.param({"SGLANG_USE_HND_KVCACHE": "1"}, {"attention_backend": config.BACKEND_TRITON, "device": "cuda"},
                 "'spec_tree_triton' does not support the HND KV cache layout \\(SGLANG_USE_HND_KVCACHE\\)",
                 id="hnd-kv-cache"),
    pytest.param({"SGLANG_USE_HND_KVCACHE": "true"}, {}, "unset SGLANG_USE_HND_KVCACHE", id="hnd-kv-cache-spec-tree"),
    # SGLang's own EAGLE-family check (_handle_eagle_family), applied to EAGLE_TREE
    pytest.param({}, {"page_size": 4}, "speculative_eagle_topk > 1 with page_size > 1 is only supported on",
                 id="sglang-eagle-check-page-size"),
]  # fmt: skip


@pytest.mark.parametrize("env,kwargs,message", STARTUP_ERRORS)
def test_clear_startup_errors(ckpt, monkeypatch, env, kwargs, message):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=message):
        resolve(ckpt, **kwargs)


def test_sglang_backends_keep_dp_attention_and_two_batch_overlap(ckpt, monkeypatch):
    """They build SGLang's FULL_MASK, which SGLang itself pads and splits."""
    view = resolved_view(resolve(ckpt, attention_backend="triton", attn_dp_size=2, tp_size=2))
    assert view.attn_dp_size == 2
    assert resolved_view(resolve(ckpt, attention_backend="triton", enable_two_batch_overlap=True)).enable_two_batch_overlap
    # and decode context parallelism and the HND KV cache are SGLang's own business there
    assert resolved_view(resolve(ckpt, attention_backend="triton", dcp_size=2, tp_size=2)).dcp_size == 2
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    resolve(ckpt, attention_backend="triton")


def test_other_algorithms_are_untouched(ckpt, monkeypatch):
    monkeypatch.setenv(config.MASK_MODE_ENV, "BOGUS")  # would fail EAGLE_TREE; EAGLE never reads it
    server_args = _testing.resolved_server_args(
        model_path=ckpt["target"], speculative_algorithm="EAGLE", speculative_draft_model_path=ckpt["eagle_head"],
        attention_backend="triton",
    )  # fmt: skip
    view = resolved_view(server_args)
    assert view.speculative_algorithm == "EAGLE" and view.speculative_draft_attention_backend is None
    assert config.VARIANT_ENV not in os.environ


# ------------------------------------------- docs/sglang.md: graphs per backend


def readme_graph_table() -> dict:
    """docs/sglang.md's CUDA-graphs section (README's SGLang section until
    issue #40): the table, {backend: (modes, [on/off x 3])}."""
    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "sglang.md")).read()
    section = doc[doc.index("\n## CUDA graphs\n"):]
    section = section[: section.index("\n## ", 1)]
    header = "| `--attention-backend` | mask modes | draft decode graph | draft extend graph | target verify graph |"
    assert header in section, "docs/sglang.md's CUDA graphs section lost its table"
    rows = {}
    for line in section[section.index(header):].splitlines()[2:]:
        if not line.startswith("|"):
            break
        names, modes, *graphs = [cell.strip() for cell in line.strip("|").split("|")]
        for name in re.findall(r"`([^`]+)`", names):
            rows[name] = ([m.strip() for m in modes.split(",")], graphs)
    return rows


def test_readme_graph_table_matches_resolution_and_backends(ckpt):
    """Each row: the modes the backend reads (config), and graphs on / off as
    resolution leaves them for a GPU server (``spec_tree``, refused on CUDA:
    for a CPU server): draft decode and draft extend follow the DECODE phase
    (eagle_worker_v2._capture_cuda_graphs), target verify is the target's
    decode graph runner, on our backend only where it has the capture entry
    points and is not graphless."""
    from spec_plugins.sglang_ext.attention import TreeVerifyMixin

    rows = readme_graph_table()
    assert {config.BACKEND_TRITON, config.BACKEND_TORCH, "flashinfer", "triton", "fa3"} <= set(rows)
    for backend, (modes, graphs) in rows.items():
        assert modes == [m.name for m in config.readable_modes(backend)], backend
        device = "cpu" if backend in config.GRAPHLESS_BACKENDS else "cuda"
        view = resolved_view(resolve(ckpt, attention_backend=backend, device=device))
        decode_on = view.cuda_graph_config.decode.backend != "disabled"
        expected = ["on" if decode_on else "off"] * 3
        if backend in config.OUR_BACKENDS:
            assert (backend not in config.GRAPHLESS_BACKENDS) == decode_on, backend
            assert "graph_verify_metadata" in vars(TreeVerifyMixin)
        assert graphs == expected, f"docs/sglang.md says {graphs} for {backend}, resolution gives {expected}"
