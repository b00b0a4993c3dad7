"""Child process of ``test_vllm_cuda_guard.py``: the CUDA path against vLLM 0.33's source.

Run with vLLM 0.33.0's ``.py`` files first on PYTHONPATH (``ci/fetch_vllm_src.py``)
and CPU torch. Prints one JSON report on its last stdout line; the test asserts
on it. What cannot run here is stubbed, and only that:

* vLLM's compiled parts are absent from the sources: ``vllm._C_stable_libtorch``
  and ``vllm.vllm_flash_attn._vllm_fa2_C`` become empty modules (their import
  registers CUDA ops), and the two ``torch.ops._C`` capability queries vLLM
  calls at import time (``cutlass_scaled_mm_supports_fp8`` / ``_block_fp8``)
  answer False;
* no GPU: ``current_platform`` is vLLM's own ``NonNvmlCudaPlatform`` with the
  three device queries it would ask the driver (capability 9.0, name, memory)
  answered by a subclass. ``torch.cuda`` itself is left untouched: that is
  what the guard checks;
* ``CUDA_VISIBLE_DEVICES=""`` (set by the test) keeps vLLM's Triton import on
  with no active driver, as for its Ray workers.

Nothing else is replaced: the plugin's modules, vLLM's registry, selector,
EngineArgs, envs and config classes are the real 0.33 ones.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import sys
import traceback
import types

import torch

# vLLM's CPU worker (vllm/v1/worker/cpu/shm.py) replaces these process-wide.
PATCH_TARGETS = {
    "torch.Event": (torch, "Event"),
    "torch.cuda.Event": (torch.cuda, "Event"),
    "torch.cuda.Stream": (torch.cuda, "Stream"),
    "torch.cuda.set_stream": (torch.cuda, "set_stream"),
    "torch.cuda.current_stream": (torch.cuda, "current_stream"),
    "torch.cuda.stream": (torch.cuda, "stream"),
    "torch.accelerator.synchronize": (torch.accelerator, "synchronize"),
    "torch.accelerator.empty_cache": (torch.accelerator, "empty_cache"),
    "torch.accelerator.get_memory_info": (torch.accelerator, "get_memory_info"),
    "torch.Tensor.pin_memory": (torch.Tensor, "pin_memory"),
    "torch.Tensor.record_stream": (torch.Tensor, "record_stream"),
}
CPU_ONLY_MODULES = ("vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu", "vllm.v1.worker.cpu_model_runner",
                    "vllm.v1.attention.backends.cpu_attn")


def snapshot() -> dict:
    objs = {name: getattr(owner, attr, None) for name, (owner, attr) in PATCH_TARGETS.items()}
    try:
        import triton.language as tl

        objs["triton.language.debug_barrier"] = tl.debug_barrier
    except ImportError:
        pass
    return objs


def stub_compiled_parts() -> None:
    for name in ("vllm._C_stable_libtorch", "vllm.vllm_flash_attn._vllm_fa2_C"):
        sys.modules[name] = types.ModuleType(name)
    lib = torch.library.Library("_C", "FRAGMENT")
    for op in ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8"):
        lib.define(f"{op}(int cuda_device_capability) -> bool")
        lib.impl(op, lambda cap: False, "CompositeExplicitAutograd")
    stub_compiled_parts.lib = lib  # the registration lives as long as the Library object


def use_cuda_platform() -> None:
    import vllm.platforms
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class GuardCudaPlatform(NonNvmlCudaPlatform):  # the driver queries only; everything else is vLLM's
        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(major=9, minor=0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H200 (guard: no GPU)"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return 141 << 30

    vllm.platforms.current_platform = GuardCudaPlatform()


def plugin_modules(cpu_side: bool) -> list[str]:
    """spec_plugins.vllm_ext and its modules: the CPU-only ones (``*_cpu``) or the rest."""
    import spec_plugins.vllm_ext as pkg

    names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__))
    picked = [n for n in names if n.endswith("_cpu") == cpu_side]
    return ([] if cpu_side else [pkg.__name__]) + [f"{pkg.__name__}.{n}" for n in picked]


def guard_target() -> str:
    """The target model folder (SmolLM2, converted by the test): EngineArgs
    resolves its model at construction when HF_HUB_OFFLINE is set."""
    return os.environ["SPEC_PLUGINS_GUARD_TARGET"]


def run_step(report: dict, name: str, fn) -> None:
    try:
        result = fn()
        report["steps"][name] = "ok" if result is None else result
    except Exception:  # noqa: BLE001 - the report carries every failure
        report["steps"][name] = "FAILED: " + traceback.format_exc(limit=6)[-3000:]


# ------------------------------------------------------------------ CUDA steps


def step_register():
    import spec_plugins.vllm_ext as ext

    ext.register()
    from vllm.engine.arg_utils import EngineArgs

    assert getattr(EngineArgs.create_engine_config, "_spec_plugins_tree_patch", False), "EngineArgs not patched"


def step_seams():
    from spec_plugins.vllm_ext.seams import check_seams

    return f"ok: {len(check_seams('0.33.0', 'cuda'))} seams"


def step_worker_class():
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.worker.gpu_worker import Worker

    from spec_plugins.vllm_ext import config

    assert config.tree_worker_cls() == config.GPU_WORKER, config.tree_worker_cls()
    cls = resolve_obj_by_qualname(config.GPU_WORKER)
    assert issubclass(cls, Worker), cls.__mro__


def step_custom_backend():
    from vllm.config import AttentionConfig, VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import get_attn_backend

    from spec_plugins.vllm_ext import attention_gpu

    attention_gpu.install_gpu_backend()
    assert AttentionBackendEnum.CUSTOM.get_path() == attention_gpu.TREE_BACKEND_PATH
    assert AttentionBackendEnum.CUSTOM.get_class() is attention_gpu.TreeFlashAttentionBackend
    # vLLM's own resolution: selector -> CudaPlatform.get_attn_backend_cls -> our class
    config = VllmConfig(attention_config=AttentionConfig(backend=AttentionBackendEnum.CUSTOM))
    with set_current_vllm_config(config):
        got = get_attn_backend(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto")
    assert got is attention_gpu.TreeFlashAttentionBackend, got
    impl = got.get_impl_cls()
    assert impl is attention_gpu.TreeFlashAttentionImpl, impl


def step_runners():
    """Tree mode follows vLLM's runner choice: V2 by default (0.33 on CUDA), V1
    when VLLM_USE_V2_MODEL_RUNNER=0; the worker builds the matching tree runner."""
    from vllm import envs
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as V2Runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as V1Runner

    from spec_plugins.vllm_ext import runner_choice, runner_gpu, runner_v2, runner_v2_gpu, worker_gpu

    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER", None)
    runner_choice.prepare_gpu_engine_args(EngineArgs(model=guard_target()))
    assert "VLLM_USE_V2_MODEL_RUNNER" not in os.environ and envs.VLLM_USE_V2_MODEL_RUNNER is None
    assert runner_choice.expects_v2_runner()
    # vLLM's own decision (VllmConfig.use_v2_model_runner) on a config without features V2 lacks
    plain = types.SimpleNamespace(attention_config=types.SimpleNamespace(hisparse_config=None),
                                  _get_v2_model_runner_unsupported_features=lambda: [])
    assert VllmConfig.use_v2_model_runner.fget(plain) is True
    v2 = runner_v2_gpu.TreeGPUModelRunnerV2
    assert issubclass(v2, V2Runner) and v2.__mro__[1] is runner_v2.TreeRunnerV2Mixin, v2.__mro__
    v1 = tree_gpu_runner_class()
    assert issubclass(v1, V1Runner)
    built = {}
    for module, name in ((runner_v2_gpu, "TreeGPUModelRunnerV2"), (runner_gpu, "TreeGPUModelRunner")):
        setattr(module, name, lambda vllm_config, device, name=name: built.setdefault("runner", name))
    worker = object.__new__(worker_gpu.TreeGPUWorker)
    worker.vllm_config, worker.device = None, "cuda:0"
    try:
        for use_v2, want in ((True, "TreeGPUModelRunnerV2"), (False, "TreeGPUModelRunner")):
            built.clear()
            worker.use_v2_model_runner = use_v2
            worker._make_model_runner()
            assert built.get("runner") == want, (use_v2, built)
    finally:
        runner_v2_gpu.TreeGPUModelRunnerV2, runner_gpu.TreeGPUModelRunner = v2, v1
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    try:
        assert not runner_choice.expects_v2_runner()
        args = EngineArgs(model=guard_target(), speculative_config={"method": "eagle3", "model": "x"},
                          additional_config={"spec_tree": {}})
        runner_choice.prepare_gpu_engine_args(args)
        assert args.compilation_config.cudagraph_mode.name == "PIECEWISE", args.compilation_config.cudagraph_mode
    finally:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")


def tree_gpu_runner_class():
    """``TreeGPUModelRunner`` from runner_gpu.py (the split layout) or runner.py."""
    for name in ("spec_plugins.vllm_ext.runner_gpu", "spec_plugins.vllm_ext.runner"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        if hasattr(module, "TreeGPUModelRunner"):
            return module.TreeGPUModelRunner
    raise AssertionError("no TreeGPUModelRunner in spec_plugins.vllm_ext.runner_gpu or .runner")


def step_cudagraph_mode():
    """V2: the mode is vLLM's (unset: its default FULL_AND_PIECEWISE, decided
    later; any mode asked for is vLLM's to resolve against the tree backend's
    declared UNIFORM_BATCH). V1: PIECEWISE pinned, full modes refused by name."""
    from vllm.config import CompilationConfig, CUDAGraphMode
    from vllm.engine.arg_utils import EngineArgs

    from spec_plugins.vllm_ext import attention_gpu, config, runner_choice

    args = EngineArgs(model=guard_target())
    runner_choice.prepare_gpu_engine_args(args)
    assert args.compilation_config.cudagraph_mode is None, args.compilation_config.cudagraph_mode
    assert args.attention_backend == "CUSTOM", args.attention_backend
    for mode in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE):
        kept = EngineArgs(model=guard_target(), compilation_config=CompilationConfig(cudagraph_mode=mode))
        runner_choice.prepare_gpu_engine_args(kept)
        assert kept.compilation_config.cudagraph_mode == mode
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    try:
        for mode in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE):
            full = EngineArgs(model=guard_target(), compilation_config=CompilationConfig(cudagraph_mode=mode))
            try:
                runner_choice.prepare_gpu_engine_args(full)
            except config.TreeConfigError as exc:
                assert f"cudagraph_mode={mode.name} on vLLM's V1" in str(exc), exc
            else:
                raise AssertionError(f"{mode.name} was not refused on V1")
    finally:
        os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")
    support = attention_gpu.TreeFlashAttentionBackend.get_builder_cls().get_cudagraph_support(None, None)
    assert support.name == "UNIFORM_BATCH", support


def resolved_cudagraph_mode(vllm_config, support) -> str:
    """What V2's runner resolves (``GPUModelRunner.initialize_kv_cache`` ->
    ``CompilationConfig.resolve_cudagraph_mode_and_sizes``) for the tree
    backend's declared support, on a copy of the engine's compilation config."""
    import copy

    compilation = copy.deepcopy(vllm_config.compilation_config)
    spec = vllm_config.speculative_config
    return compilation.resolve_cudagraph_mode_and_sizes(
        support, "TreeFlashAttentionBackend", 1 + spec.num_speculative_tokens, use_v2_model_runner=True,
        kv_cache_config=None, max_num_reqs=vllm_config.scheduler_config.max_num_seqs, is_profiling=False,
        piecewise_capture_available=True).name


def step_engine_args():
    from vllm.engine.arg_utils import EngineArgs

    from spec_plugins.heads import head_path
    from spec_plugins.vllm_ext import config

    args = EngineArgs(model=guard_target(), speculative_config={"method": "eagle3", "model": str(head_path("eagle3"))},
                      additional_config={"spec_tree": {}})
    assert config.prepare_engine_args(args) is not None
    assert args.worker_cls == config.GPU_WORKER, args.worker_cls
    assert args.speculative_config["num_speculative_tokens"] == 7


def step_command_lines(report: dict):
    """docs/vllm.md's command lines through 0.33's parser and create_engine_config
    under the CUDA platform (``command_lines.run_rows``), and per tree row the
    attention backend vLLM resolves for the target's layers (the engine config)
    and for the head's (the config vLLM's EAGLE drafter builds for it with
    ``_create_draft_vllm_config``, which does not inherit the target's backend)."""
    import command_lines
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend
    from vllm.v1.spec_decode.eagle import EagleProposer

    from spec_plugins.vllm_ext import attention_gpu

    def backends(vllm_config) -> dict:
        attention_gpu.install_gpu_backend()  # as TreeGPUWorker.init_device does before the model is built
        drafter = types.SimpleNamespace(speculative_config=vllm_config.speculative_config, vllm_config=vllm_config)
        draft_config = EagleProposer._create_draft_vllm_config(drafter)  # V1's head config
        # V2's head config (spec_decode/eagle/utils.py load_eagle_model)
        draft_config_v2 = vllm_config.speculative_config.apply_draft_overrides(vllm_config)
        resolved = {}
        for who, config in (("target_backend", vllm_config), ("draft_backend", draft_config),
                            ("draft_backend_v2", draft_config_v2)):
            with set_current_vllm_config(config):
                resolved[who] = get_attn_backend(head_size=64, dtype=torch.bfloat16, kv_cache_dtype="auto").__name__
        builder = attention_gpu.TreeFlashAttentionBackend.get_builder_cls()
        resolved.update(
            v2_runner=bool(vllm_config.use_v2_model_runner),
            async_scheduling=bool(vllm_config.scheduler_config.async_scheduling),
            cudagraph_mode=vllm_config.compilation_config.cudagraph_mode.name,
            runtime_cudagraph_mode=resolved_cudagraph_mode(
                vllm_config, builder.get_cudagraph_support(vllm_config, None)))
        return resolved

    report["command_lines"] = command_lines.run_rows(guard_target(), inspect=backends)
    return f"ok: {len(report['command_lines'])} command lines"


def cpu_only_loaded() -> list[str]:
    return sorted(m for m in sys.modules if any(m == c or m.startswith(c + ".") for c in CPU_ONLY_MODULES))


def main_cuda(report: dict) -> None:
    report["cpu_only_first_loaded_by"] = {}
    for module in plugin_modules(cpu_side=False):
        seen = set(cpu_only_loaded())
        try:
            importlib.import_module(module)
            report["imported"].append(module)
        except Exception:  # noqa: BLE001
            report["import_errors"][module] = traceback.format_exc(limit=8)[-3000:]
        new = [m for m in cpu_only_loaded() if m not in seen]
        if new:
            report["cpu_only_first_loaded_by"][module] = new
    for name, fn in (("register", step_register), ("seams", step_seams), ("worker_class", step_worker_class),
                     ("custom_backend", step_custom_backend), ("runners", step_runners),
                     ("cudagraph_mode", step_cudagraph_mode), ("engine_args", step_engine_args),
                     ("command_lines", lambda: step_command_lines(report))):
        run_step(report, name, fn)


def main_cpu(report: dict) -> None:
    """The CPU-only modules import against 0.33 too, and its CPU seams hold."""
    for module in plugin_modules(cpu_side=True):
        try:
            importlib.import_module(module)
            report["imported"].append(module)
        except Exception:  # noqa: BLE001
            report["import_errors"][module] = traceback.format_exc(limit=8)[-3000:]

    def seams():
        from spec_plugins.vllm_ext.seams import check_seams

        return f"ok: {len(check_seams('0.33.0', 'cpu'))} seams"

    run_step(report, "seams", seams)


def main() -> None:
    side = sys.argv[1]
    before = snapshot()
    stub_compiled_parts()
    import vllm

    report = {"vllm_file": vllm.__file__, "vllm_version": vllm.__version__, "imported": [], "import_errors": {},
              "steps": {}}
    if side == "cuda":
        use_cuda_platform()
        main_cuda(report)
    else:
        import vllm.platforms
        from vllm.platforms.cpu import CpuPlatform

        vllm.platforms.current_platform = CpuPlatform()
        main_cpu(report)
    after = snapshot()
    # {target: module of its replacement}; the test allows vLLM's own GPU-path wrappers only
    report["replaced"] = {k: getattr(after.get(k), "__module__", "?") for k in before if after.get(k) is not before[k]}
    report["cpu_only_modules"] = cpu_only_loaded()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
