"""Count, on any device, what would make the host wait for the GPU.

On CUDA a device->host read (``item``, ``tolist``, ``.cpu()``, ``numpy``,
``bool``/``int``/``float`` of a tensor, ``nonzero``, boolean-mask indexing,
``unique``, a ``repeat_interleave`` without ``output_size``) and a blocking
host->device copy from pageable memory (``torch.tensor(list, device=...)``,
``.to(device)`` without ``non_blocking``) wait until the GPU queue drains. On
the CPU nothing waits, so a step that reads its device tensors 26 times runs
as fast as one that reads them twice, and only a census shows the difference.

``HostReadCensus`` is a ``TorchFunctionMode`` (plus a dispatch-level op
counter) that classifies tensors by where they would live on a GPU:

* **host**: registered host buffers (vLLM's ``CpuGpuBuffer.cpu`` halves, the
  input batch's ``*_cpu_tensor``; see ``register_host``), tensors made from
  Python or numpy data (``torch.tensor``, ``as_tensor``, ``from_numpy``),
  tensors our code makes with a factory (``zeros``, ``arange``, ...) without a
  ``device`` argument, ``.cpu()`` results, and every result of an op whose
  tensor inputs are all host;
* **device**: everything else (model outputs, KV caches, the ``.gpu`` halves,
  tensors made with a ``device`` argument or moved with ``.to(device)``, and
  the engine's factory results without one: vLLM-CPU's kernels allocate their
  outputs that way, and on a GPU those are device tensors).

Our code asking ``is_cpu`` of a device tensor hears False, so it takes the
branch it takes on a GPU (the CPU reference kernels skip early exits that
read the device only there).

A ``device`` argument names the host when it is the string ``"cpu"`` or the
``.device`` of a host tensor (the census marks those objects), else the device.

On the CPU ``x.to(device)`` returns ``x`` itself; under the census a host
``x`` is copied instead, so the result is a device tensor as on a GPU.
vLLM-CPU aliases its buffers' halves (``CPUModelRunner._postprocess_tensors``:
``.gpu = .cpu``), so a census of a vLLM-CPU engine needs them apart:
``separate_cpu_runner_buffers`` (the GPU runner's layout, with its explicit
copies).

Counts are split into ours (the innermost caller outside torch lives in
``spec_plugins`` or ``spec_tree_kernels``) and the engine's, per kind:
``reads`` (device->host) and ``blocking_uploads``; ``ops``: aten ops on device
tensors that are not views (about one kernel launch each on a GPU).
"""

from __future__ import annotations

import contextlib
import os
import sys
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_OUR_PACKAGES = (os.sep + "spec_plugins" + os.sep, os.sep + "spec_tree_kernels" + os.sep,
                 os.sep + "kernels" + os.sep)
_TORCH_DIR = os.path.dirname(torch.__file__)
_THIS_FILE = os.path.abspath(__file__)
_CENSUS_FILES = {_THIS_FILE}  # the census's own frames (host_reads_v2 adds its file): never "the caller"

# Tensor methods / torch functions whose result the host must wait for.
_READS = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy,
    torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
    torch.Tensor.nonzero, torch.nonzero, torch.argwhere, torch.Tensor.argwhere, torch.masked_select,
    torch.Tensor.masked_select, torch.unique, torch.Tensor.unique, torch.unique_consecutive,
    torch.Tensor.unique_consecutive,
}
# Make a tensor from Python / numpy data: host unless a device is named (then a blocking upload).
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.from_numpy, torch.asarray}
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.rand, torch.randn,
              torch.randint, torch.eye, torch.linspace, torch.zeros_like, torch.ones_like, torch.empty_like,
              torch.full_like, torch.rand_like}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}
_DEVICE_GET = torch.Tensor.device.__get__  # a method-wrapper: compare with ==, not ``is``
_IS_CPU_GET = torch.Tensor.is_cpu.__get__


@dataclass
class CensusCounts:
    reads: Counter = field(default_factory=Counter)  # (owner, what) -> count; owner "ours" | "engine"
    blocking_uploads: Counter = field(default_factory=Counter)
    ops: int = 0  # non-view aten ops on device tensors
    sites: Counter = field(default_factory=Counter)  # "file:line what" of our reads and blocking uploads

    def total(self, kind: str, owner: str | None = None) -> int:
        counter = getattr(self, kind)
        return sum(n for (who, _), n in counter.items() if owner is None or who == owner)

    def syncs(self, owner: str | None = None) -> int:
        """Reads + blocking uploads: the host waits on a GPU for either."""
        return self.total("reads", owner) + self.total("blocking_uploads", owner)


def _caller() -> tuple[str, str]:
    """(owner, "file:line") of the innermost frame outside torch and this file."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if not path.startswith(_TORCH_DIR) and os.path.abspath(path) not in _CENSUS_FILES:
            owner = "ours" if any(p in path for p in _OUR_PACKAGES) else "engine"
            return owner, f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return "engine", "?"


class _OpCounter(TorchDispatchMode):
    def __init__(self, census: "HostReadCensus"):
        super().__init__()
        self.census = census

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func.is_view and self.census.counting:
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            if any(not self.census.is_host(t) for t in tensors):
                self.census.counts.ops += 1
        return out


class HostReadCensus(TorchFunctionMode):
    """``with HostReadCensus() as census: ...`` then ``census.counts``;
    ``census.counting`` can pause the count (registration still applies)."""

    def __init__(self, host_tensors=()):
        super().__init__()
        self._host: dict[int, weakref.ref] = {}
        self._host_devices: dict[int, torch.device] = {}  # ``.device`` of host tensors, kept alive: ids stay unique
        self.counts = CensusCounts()
        self.counting = True
        for t in host_tensors:
            self.register_host(t)
        self._ops = _OpCounter(self)

    # ------------------------------------------------------------ classes
    def register_host(self, t: torch.Tensor) -> None:
        key = id(t)
        self._host[key] = weakref.ref(t, lambda _, k=key: self._host.pop(k, None))

    def is_host(self, t: torch.Tensor) -> bool:
        for x in (t, getattr(t, "_base", None)):
            if x is not None and (ref := self._host.get(id(x))) is not None and ref() is x:
                return True
        return False

    def _count(self, kind: str, what: str) -> None:
        if not self.counting:
            return
        owner, site = _caller()
        getattr(self.counts, kind)[(owner, what)] += 1
        if owner == "ours":
            self.counts.sites[f"{site} {what}"] += 1

    def names_host(self, device) -> bool:
        """A ``device`` argument that names the host."""
        if isinstance(device, str):
            return device.startswith("cpu")
        return self._host_devices.get(id(device)) is device

    def reset(self) -> CensusCounts:
        counts, self.counts = self.counts, CensusCounts()
        self._host_devices.clear()
        return counts

    # ------------------------------------------------------------ the mode
    def __enter__(self):
        super().__enter__()
        self._ops.__enter__()
        return self

    def __exit__(self, *exc):
        self._ops.__exit__(*exc)
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        name = getattr(func, "__name__", str(func))
        if func == _DEVICE_GET:
            device = func(*args, **kwargs)
            if self.is_host(args[0]):
                self._host_devices[id(device)] = device
            return device
        if func == _IS_CPU_GET and not self.is_host(args[0]) and _caller()[0] == "ours":
            return False  # our code takes the branch it takes on a GPU (e.g. no early exit that reads)
        if func in _READS and tensors and not self.is_host(tensors[0]):
            self._count("reads", name)
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and self._bool_index(args):
            self._count("reads", "bool-mask index")
        elif func in (torch.repeat_interleave, torch.Tensor.repeat_interleave) and self._sized_by_data(args, kwargs):
            self._count("reads", "repeat_interleave")
        elif func is torch.Tensor.copy_ and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            self._count_copy(args[0], args[1], kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
        out = func(*args, **kwargs)
        return self._classify(func, args, kwargs, tensors, out)

    def _classify(self, func, args, kwargs, tensors, out):
        if func in _MOVES and tensors:
            return self._classify_move(func, args, kwargs, tensors, out)
        if func in _FROM_DATA or func in _FACTORIES:
            device = kwargs.get("device")
            if device is not None and not self.names_host(device):
                if func in _FROM_DATA:
                    self._count("blocking_uploads", getattr(func, "__name__", "tensor"))
                return out
            if func.__name__.endswith("_like") and device is None:  # where its input is
                if self.is_host(tensors[0]):
                    self._register_all(out)
            elif device is not None or func in _FROM_DATA or _caller()[0] == "ours":
                self._register_all(out)
            return out
        if tensors and all(self.is_host(t) for t in tensors):
            self._register_all(out)
        return out

    def _classify_move(self, func, args, kwargs, tensors, out):
        """``.to`` / ``.cuda`` / ``.cpu``: an upload, a download, or a move within one side."""
        source_host, target = self.is_host(tensors[0]), self._move_target(func, args, kwargs)
        if target is None:  # a dtype change: stays where it is
            if source_host:
                self._register_all(out)
            return out
        if source_host == target:  # host -> host or device -> device
            if source_host:
                self._register_all(out)
            return out
        out = out.clone() if out is tensors[0] else out  # as on a GPU: a new tensor on the other side
        if target:  # device -> host
            self._count("reads", "cpu" if func is torch.Tensor.cpu else "to(cpu)")
            self._register_all(out)
        elif not kwargs.get("non_blocking", False):
            self._count("blocking_uploads", "to(device)")
        return out

    def _move_target(self, func, args, kwargs) -> bool | None:
        """True: the host; False: the device; None: no device named."""
        if func is torch.Tensor.cuda:
            return False
        if func is torch.Tensor.cpu:
            return True
        target = kwargs.get("device")
        for a in args[1:]:
            if isinstance(a, torch.Tensor):
                return self.is_host(a)
            if isinstance(a, (str, torch.device)):
                target = a
        return None if target is None else self.names_host(target)

    def _register_all(self, out) -> None:
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.register_host(t)

    def _count_copy(self, dst: torch.Tensor, src: torch.Tensor, non_blocking) -> None:
        dst_host, src_host = self.is_host(dst), self.is_host(src)
        if dst_host and not src_host:
            self._count("reads", "copy_ to host")
        elif src_host and not dst_host and not non_blocking:
            self._count("blocking_uploads", "copy_ from host")

    def _bool_index(self, args) -> bool:
        index = args[1] if len(args) > 1 else None
        parts = index if isinstance(index, tuple) else (index,)
        return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool and p.dim() > 0 and not self.is_host(p)
                   for p in parts)

    def _sized_by_data(self, args, kwargs) -> bool:
        repeats = kwargs.get("repeats", args[1] if len(args) > 1 else None)
        return (isinstance(repeats, torch.Tensor) and repeats.numel() > 1 and not self.is_host(repeats)
                and kwargs.get("output_size") is None)


# ----------------------------------------------------------- vLLM runners


def runner_host_buffers(runner) -> list[torch.Tensor]:
    """The host halves of a vLLM V1 runner's buffers: ``CpuGpuBuffer.cpu``
    (runner, block tables) and the input batch's ``*_cpu_tensor``."""
    from vllm.v1.utils import CpuGpuBuffer

    found = [v.cpu for v in vars(runner).values() if isinstance(v, CpuGpuBuffer)]
    batch = runner.input_batch
    found += [v for k, v in vars(batch).items() if k.endswith("_cpu_tensor") and isinstance(v, torch.Tensor)]
    for table in batch.block_table.block_tables:
        found += [v.cpu for v in vars(table).values() if isinstance(v, CpuGpuBuffer)]
    return found


@contextlib.contextmanager
def separate_cpu_runner_buffers():
    """vLLM-CPU runners built inside keep their buffers' device halves apart
    from the host halves, as the GPU runner does (the census tells them apart)."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    original = CPUModelRunner._postprocess_tensors
    CPUModelRunner._postprocess_tensors = lambda self: None
    try:
        yield
    finally:
        CPUModelRunner._postprocess_tensors = original


@dataclass
class StepCensus:
    """Per engine step (one ``execute_model`` + ``sample_tokens``): its counts and
    whether it verified trees or chains (``tree_step``: the runner's verify
    counter moved; for vLLM's own chain, drafts were scheduled)."""

    counts: CensusCounts
    tree_step: bool
    sampled: bool  # the step's batch had a request with temperature > 0


@contextlib.contextmanager
def census_runner_steps(runner):
    """Count every engine step of ``runner`` (a vLLM V1 runner built under
    ``separate_cpu_runner_buffers`` on CPU) while inside; yields the list the
    steps are appended to."""
    steps: list[StepCensus] = []
    census = HostReadCensus(runner_host_buffers(runner))
    execute, sample = runner.execute_model, runner.sample_tokens
    state = {}

    def execute_model(scheduler_output, *args, **kwargs):
        state["spec"] = bool(scheduler_output.scheduled_spec_decode_tokens)
        census.reset()
        with census:
            return execute(scheduler_output, *args, **kwargs)

    def sample_tokens(*args, **kwargs):
        sampled = not runner.input_batch.sampling_metadata.all_greedy
        with census:
            out = sample(*args, **kwargs)
        steps.append(StepCensus(census.reset(), state.get("spec", False), sampled))
        return out

    with steps_counted(runner, execute_model, sample_tokens):
        yield steps


@contextlib.contextmanager
def steps_counted(runner, execute_model, sample_tokens):
    """The runner's step methods replaced by counting wrappers while inside (instance
    attributes over the class's: deleting them restores vLLM's)."""
    runner.execute_model, runner.sample_tokens = execute_model, sample_tokens
    try:
        yield
    finally:
        del runner.execute_model, runner.sample_tokens
