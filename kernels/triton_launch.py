"""The one seam every Triton launch of the kernel module goes through, and
what a launch compiles.

Triton compiles a kernel once per *variant* of its launches, on first use:
the constexpr values, the argument dtypes, and its specialization of the
other arguments (an integer equal to 1 becomes a constant, one divisible by
16 and a pointer aligned to 16 bytes are marked so), plus the launch
options. On a GPU each new variant costs seconds of compile, so an engine
launches every one it can make at startup (``startup.warm_up``), and tests
check that serving makes no other.

* ``launch``        ``kernel[grid](*args, **kwargs)`` for ``triton_ops`` and
                    ``attention_triton``;
* ``variant_key``   a launch's ``Variant``: Triton's own cache key of it;
* ``recording()``   the variants launched while open (tests);
* ``capturing()``   the launches made while open, held instead of run (the
                    warm-up computes a case's variants before running them).

Not thread-safe: recording and capturing are process-wide switches for one
engine thread at a time.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch

# The target Triton specializes for when no GPU says which (the interpreter):
# argument specialization is the same for every NVIDIA target (Triton's
# BaseBackend rules), so variants recorded under TRITON_INTERPRET=1 are the
# ones a GPU compiles.
NOMINAL_TARGET = ("cuda", 90, 32)


@dataclass(frozen=True)
class Variant:
    """One compiled variant: ``kernel`` (the Triton function's name) and ``key``,
    Triton's cache key of the launch (what ``JITFunction.run`` looks its
    compiled kernels up by). ``constexprs``: the constexpr values, for people."""

    kernel: str
    key: str
    constexprs: tuple = field(default=(), compare=False)

    def __str__(self) -> str:
        # the digest tells apart variants that differ only in argument specialization
        digest = hashlib.sha256(self.key.encode()).hexdigest()[:8]
        return f"{self.kernel}({', '.join(f'{k}={v}' for k, v in self.constexprs)}) #{digest}"


@dataclass
class Launch:
    """``kernel[grid](*args, **kwargs)``, held (``capturing``) to be run later."""

    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict

    @functools.cached_property
    def variant(self) -> Variant:
        return variant_key(self.kernel, self.args, self.kwargs)

    def run(self) -> None:
        launch(self.kernel, self.grid, *self.args, **self.kwargs)


_recordings: list[list[Variant]] = []
_capture: list[Launch] | None = None


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``: every Triton launch of the module
    comes here, so what it launches can be recorded (``recording``) or held
    (``capturing``). Nothing but the launch when neither is open."""
    if _capture is not None:
        _capture.append(Launch(kernel, grid, args, kwargs))
        return
    if _recordings:
        variant = variant_key(kernel, args, kwargs)
        for recorded in _recordings:
            recorded.append(variant)
    kernel[grid](*args, **kwargs)


@contextlib.contextmanager
def recording():
    """Yields a list that collects the ``Variant`` of every launch made while open."""
    recorded: list[Variant] = []
    _recordings.append(recorded)
    try:
        yield recorded
    finally:
        _recordings.remove(recorded)


@contextlib.contextmanager
def capturing():
    """Yields a list that collects every launch made while open as a ``Launch``;
    none runs (outputs stay unwritten: for callers that read no result)."""
    global _capture
    outer, _capture = _capture, []
    try:
        yield _capture
    finally:
        _capture = outer


_binders: dict = {}


def triton_interpreting() -> bool:
    """Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``, read when they are defined)."""
    return os.environ.get("TRITON_INTERPRET") == "1"




def _binder(kernel, device_type: str):
    """(constexpr names, Triton's argument binder) of ``kernel`` for the
    device's target. Under the interpreter ``kernel`` is an
    InterpretedFunction: its binder is the one of the JITFunction Triton
    would have made of the same function and decorator arguments."""
    cache_key = (id(kernel), device_type)
    if cache_key not in _binders:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
        if device_type == "cuda" and not triton_interpreting():
            from triton.runtime import driver

            target = driver.active.get_current_target()
        else:
            target = GPUTarget(*NOMINAL_TARGET)
        binder = create_function_from_signature(jit.signature, jit.params, make_backend(target))
        _binders[cache_key] = ([p.name for p in jit.params if p.is_constexpr], binder, kernel)  # kernel: keeps id
    return _binders[cache_key][:2]


def variant_key(kernel, args: Sequence, kwargs: dict) -> Variant:
    """The variant ``kernel[grid](*args, **kwargs)`` runs: Triton's binder
    specializes the arguments exactly as ``JITFunction.run`` does, and
    ``compute_cache_key`` makes its key. (``run`` also adds the process-wide
    debug / instrumentation options; constant within a process, they never
    tell a warmed variant from a served one, so they are left out.)"""
    name = getattr(kernel, "__name__", None) or kernel.fn.__name__
    try:
        from triton.runtime.jit import compute_cache_key

        device = next((a.device.type for a in args if isinstance(a, torch.Tensor)), "cuda")
        constexpr_names, binder = _binder(kernel, device)
        bound, specialization, options = binder(*args, **kwargs)
    except (ImportError, AttributeError, TypeError, ValueError) as exc:  # another Triton's internals
        return _finer_key(name, args, kwargs, exc)
    return Variant(name, compute_cache_key({}, specialization, options),
                   tuple((n, bound[n]) for n in constexpr_names))


def _finer_key(name: str, args: Sequence, kwargs: dict, why: Exception) -> Variant:
    """Where this Triton's binder cannot be called: a key finer than any
    Triton's (each tensor's dtype and 16-byte alignment, every other argument's
    value), so two launches that share it share Triton's key too. Deduplicating
    by it warms more launches than needed, never fewer."""
    if not _warned_finer_key:
        _warned_finer_key.append(True)
        import logging

        logging.getLogger("spec_tree_kernels").warning(
            "spec_tree_kernels: Triton's argument binder is not callable here (%s: %s); Triton variants are told "
            "apart by a finer key (more warm-up launches, none missed)", type(why).__name__, why)

    def part(value):
        if isinstance(value, torch.Tensor):
            return f"{value.dtype}@{value.data_ptr() % 16}"
        return repr(value)

    key = "|".join([*map(part, args), *(f"{k}={part(v)}" for k, v in sorted(kwargs.items()))])
    return Variant(name, key, tuple(sorted((k, v) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))))


_warned_finer_key: list = []
