"""CI guard for the vLLM CUDA path, which cannot run here (issue 19).

No CUDA build of vLLM runs on these machines, so the CUDA path is imported
and configured against vLLM 0.33.0's own Python sources (its PyPI wheel,
``.py`` files only, cached by ``ci/fetch_vllm_src.py``) with the CPU torch of
this venv, in child processes (``vllm_cuda_guard_child.py``, which documents
the few stubs: vLLM's compiled modules and the GPU's device queries). It
asserts that:

* every GPU-path module of ``spec_plugins.vllm_ext`` (all but ``*_cpu``) imports;
* the CUDA-side configuration runs on vLLM's real objects: register(), every
  CUDA seam (``seams.py``), the GPU worker class path, CUSTOM backend
  registration and vLLM's own resolution of it, the runner choice (V2 by
  default, V1 when asked for), the CUDA graph modes, the full engine-argument
  preparation;
* no CPU-only vLLM module was imported (``vllm.v1.worker.cpu_worker`` imports
  ``vllm.v1.worker.cpu.shm``, which replaces torch.cuda.Event/Stream/
  current_stream, torch.accelerator memory queries, Tensor.pin_memory and
  Triton's debug_barrier process-wide) and none of those was replaced.

A second child imports the CPU-only modules against 0.33 and checks the CPU
seams there; it is also the guard's positive control (the detector must see
the CPU worker's patches when the CPU worker is imported).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("vllm_cuda_guard_child.py")
VLLM_SOURCE_VERSION = "0.33.0"
# vLLM's own GPU-path wrapper (records the stream per thread, then calls torch's).
ALLOWED_REPLACEMENTS = {"torch.cuda.set_stream": "vllm.utils.torch_utils"}
GPU_PATH_MODULES = ("spec_plugins.vllm_ext", "spec_plugins.vllm_ext.worker_gpu", "spec_plugins.vllm_ext.runner",
                    "spec_plugins.vllm_ext.runner_v2_gpu", "spec_plugins.vllm_ext.runner_v2",
                    "spec_plugins.vllm_ext.attention", "spec_plugins.vllm_ext.attention_gpu",
                    "spec_plugins.vllm_ext.proposer", "spec_plugins.vllm_ext.config",
                    "spec_plugins.vllm_ext.engine_patches", "spec_plugins.vllm_ext.seams")
CUDA_STEPS = ("register", "seams", "worker_class", "custom_backend", "runners", "cudagraph_mode", "engine_args",
              "command_lines")
TREE_BACKEND = "TreeFlashAttentionBackend"

sys.path.insert(0, str(ROOT / "ci"))
import command_lines  # noqa: E402  (tests/model: docs/vllm.md's command-line table)
import fetch_vllm_src  # noqa: E402
from smollm2_gate import require_smollm2  # noqa: E402

require_smollm2()


@pytest.fixture(scope="module")
def source_dir() -> Path:
    return fetch_vllm_src.source_dir(VLLM_SOURCE_VERSION)


@pytest.fixture(scope="module")
def reports(source_dir, tmp_path_factory) -> dict:
    """Both children at once (one per core): {"cuda": report, "cpu": report}.
    The CUDA child also runs docs/vllm.md's command lines (target SmolLM2, the
    head as a folder and as a hub id from a local offline hub cache)."""
    from spec_plugins.models.smollm2 import ensure_converted

    hub = command_lines.make_hub_cache(tmp_path_factory.mktemp("hub"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(source_dir), str(ROOT)]), "CUDA_VISIBLE_DEVICES": "",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONHASHSEED": "0", "HF_HUB_CACHE": str(hub),
           "HF_HUB_OFFLINE": "1", "SPEC_PLUGINS_GUARD_TARGET": str(ensure_converted())}
    env.pop("SPEC_PLUGINS_ALLOW_UNTESTED_ENGINE", None)
    procs = {side: subprocess.Popen([sys.executable, str(CHILD), side], env=env, cwd=ROOT, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for side in ("cuda", "cpu")}
    out = {}
    for side, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{side} guard child failed ({proc.returncode}):\n{stderr[-6000:]}"
        out[side] = json.loads(stdout.strip().splitlines()[-1])
    return out


def test_children_run_vllm_033_source(reports, source_dir):
    for report in reports.values():
        assert report["vllm_version"] == VLLM_SOURCE_VERSION
        assert report["vllm_file"].startswith(str(source_dir)), report["vllm_file"]


def test_every_gpu_path_module_imports(reports):
    cuda = reports["cuda"]
    assert cuda["import_errors"] == {}, "\n\n".join(f"{m}:\n{tb}" for m, tb in cuda["import_errors"].items())
    assert set(GPU_PATH_MODULES) <= set(cuda["imported"])
    assert not [m for m in cuda["imported"] if m.endswith("_cpu")]


def test_no_cpu_only_vllm_module_on_the_cuda_path(reports):
    found = reports["cuda"]["cpu_only_modules"]
    by = reports["cuda"].get("cpu_only_first_loaded_by")
    assert found == [], (f"the CUDA path imported CPU-only vLLM modules {found} (first loaded by: {by}); keep "
                         "CPU-specific code in spec_plugins/vllm_ext/*_cpu.py (vllm.v1.worker.cpu_worker patches "
                         "torch.cuda process-wide)")


def test_torch_cuda_and_triton_untouched_on_the_cuda_path(reports):
    replaced = reports["cuda"]["replaced"]
    unexpected = {k: v for k, v in replaced.items() if ALLOWED_REPLACEMENTS.get(k) != v}
    assert unexpected == {}, f"replaced process-wide on the CUDA path (target: replacement's module): {unexpected}"


@pytest.mark.parametrize("step", CUDA_STEPS)
def test_cuda_configuration_against_033(reports, step):
    result = reports["cuda"]["steps"].get(step, "not run")
    assert result.startswith("ok"), result


def test_readme_command_lines_start_on_cuda_033(reports):
    """Every docs/vllm.md command line through vLLM 0.33's parser and
    create_engine_config under the CUDA platform does what its row says."""
    results = reports["cuda"].get("command_lines")
    assert results, reports["cuda"]["steps"].get("command_lines")
    assert len(results) == 2 * len(command_lines.readme_rows())
    problems = [p for r in results for p in command_lines.check_row(r)]
    assert problems == [], "\n".join(problems)


def test_target_and_head_layers_get_the_tree_backend_on_cuda(reports):
    """vLLM builds the head's config apart, with the attention backend reset to
    speculative_config.attention_backend; unset, the selector gives the head
    FlashAttention and the runner's startup check refuses it. Every tree row's
    target and head must resolve to the tree backend."""
    trees = [r for r in reports["cuda"]["command_lines"] if r.get("tree")]
    assert len(trees) >= 10
    wrong = [(r["command"], r["head"], r["target_backend"], r["draft_backend"], r["draft_backend_v2"])
             for r in trees if {r["target_backend"], r["draft_backend"], r["draft_backend_v2"]} != {TREE_BACKEND}]
    assert wrong == []


def test_tree_rows_run_on_vllms_default_engine_on_cuda(reports):
    """Issue 49: every tree command line builds vLLM 0.33's default engine: Model
    Runner V2, async scheduling on, FULL_AND_PIECEWISE; and what V2's runner
    then resolves for the tree backend's declared graph support (UNIFORM_BATCH:
    uniform decode batches read their trees from persistent buffers) is still
    FULL_AND_PIECEWISE, by vLLM's own code."""
    trees = [r for r in reports["cuda"]["command_lines"] if r.get("tree")]
    assert len(trees) >= 10
    engine = {(r["v2_runner"], r["async_scheduling"], r["cudagraph_mode"], r["runtime_cudagraph_mode"])
              for r in trees}
    assert engine == {(True, True, "FULL_AND_PIECEWISE", "FULL_AND_PIECEWISE")}, engine


def test_cpu_modules_and_cpu_seams_against_033(reports):
    cpu = reports["cpu"]
    assert cpu["import_errors"] == {}, "\n\n".join(f"{m}:\n{tb}" for m, tb in cpu["import_errors"].items())
    assert "spec_plugins.vllm_ext.worker_cpu" in cpu["imported"]
    assert cpu["steps"]["seams"].startswith("ok"), cpu["steps"]["seams"]


def test_detector_sees_the_cpu_workers_patches(reports):
    """Positive control: importing the CPU worker is caught by both checks above."""
    cpu = reports["cpu"]
    assert "vllm.v1.worker.cpu_worker" in cpu["cpu_only_modules"]
    assert cpu["replaced"].get("torch.cuda.current_stream") == "vllm.v1.worker.cpu.shm"
    assert cpu["replaced"].get("torch.Tensor.pin_memory") == "vllm.v1.worker.cpu.shm"


def test_source_download_is_cached(source_dir, monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the cached sources were downloaded again")

    monkeypatch.setattr(fetch_vllm_src, "_download_wheel", no_network)
    assert fetch_vllm_src.source_dir(VLLM_SOURCE_VERSION) == source_dir
    assert (source_dir / "vllm" / "v1" / "worker" / "gpu_worker.py").is_file()
    assert not list(source_dir.rglob("*.so")), "only .py files are unpacked"
