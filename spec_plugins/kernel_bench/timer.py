"""The one timer of the kernel benchmarks.

On CUDA a call is timed with CUDA events, two ways:

* eager: events around each call, the GPU idle before it, so the host's
  launch overhead counts (what an engine step without graphs pays);
* graph: a CUDA graph holding ``graph_calls`` back-to-back calls, replayed;
  the time of one replay / ``graph_calls`` is the GPU time of one call
  without the ~10 us of a graph launch.

With ``flush_l2`` every timed sample is preceded by a 256 MB write (more than
the 50 MB L2 of an H100/H200), so a small problem's inputs come from HBM, as
in a model whose other layers evict them (L2-cold); without it repeated calls
find their inputs in L2 (warm).

Without CUDA the wall clock stands in: CPU and TRITON_INTERPRET=1 timings
only exercise the code, they say nothing about a GPU.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

FLUSH_BYTES = 256 << 20  # > the 50 MB L2 of an H100/H200
CPU_TIMER = "cpu wall clock (meaningless)"


def describe_error(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` cut to ``limit`` characters (the type alone when the
    message is empty): the one spelling of an error in every benchmark row."""
    return f"{type(exc).__name__}: {exc}"[:limit] if str(exc) else type(exc).__name__


class Timer:
    """Median microseconds per call of a zero-argument ``fn``.

    iters        timed samples per figure (the median is reported)
    warmup       untimed calls before timing (compiles, allocator), and
                 untimed replays of a fresh graph
    graph_calls  calls captured in one CUDA graph (0: eager figures only)
    flush_l2     L2-cold samples (module docstring)
    """

    def __init__(self, device, *, iters: int = 10, warmup: int = 2, graph_calls: int = 1, flush_l2: bool = False):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.iters, self.warmup, self.graph_calls = iters, warmup, graph_calls
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=self.device) if self.cuda and flush_l2 else None

    # ---------------------------------------------------------------- figures

    def figures(self, fn: Callable[[], object], graph: bool = True) -> dict:
        """{"eager_us"} and, on CUDA when ``graph`` and graph_calls > 0,
        {"graph_us"} or {"graph_error"} (host syncs, such as the torch
        reference's data-dependent shapes, cannot be captured)."""
        result = {"eager_us": round(statistics.median(self.eager_samples(fn)), 2)}
        if self.cuda and graph and self.graph_calls:
            try:
                result["graph_us"] = round(statistics.median(self.graph_samples(fn)), 2)
            except Exception as exc:
                result["graph_error"] = describe_error(exc, 160).splitlines()[0]
                torch.cuda.synchronize()
        return result

    def cold(self, fn: Callable[[], object]) -> dict:
        """{"time_us", "min_us", "timer"}: graph replays, eager calls when
        ``fn`` cannot be captured (``timer`` says which and why)."""
        if not self.cuda:
            samples, method = self.eager_samples(fn), CPU_TIMER
        else:
            self._warm_up(fn)
            try:
                samples, method = self.graph_samples(fn), "cuda graph replay" + self._l2_note()
            except Exception as exc:  # not capturable: report it, time eagerly
                torch.cuda.synchronize()
                samples = self.eager_samples(fn)
                method = f"eager{self._l2_note()} (capture failed: {describe_error(exc, 120)})"
        return {"time_us": round(statistics.median(samples), 2), "min_us": round(min(samples), 2), "timer": method}

    # ---------------------------------------------------------------- samples

    def eager_samples(self, fn) -> list[float]:
        """Microseconds of ``iters`` eager calls, after ``warmup`` untimed ones."""
        self._warm_up(fn)
        if not self.cuda:
            samples = []
            for _ in range(self.iters):
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e6)
            return samples
        torch.cuda.synchronize()
        return self._event_samples(fn, calls=1)

    def graph_samples(self, fn) -> list[float]:
        """Microseconds per call of ``iters`` replays of a graph of
        ``graph_calls`` calls (CUDA only); raises when ``fn`` cannot be captured."""
        graph = self._capture(fn)
        for _ in range(self.warmup):
            graph.replay()
        return self._event_samples(graph.replay, calls=self.graph_calls)

    def _warm_up(self, fn) -> None:
        for _ in range(self.warmup):
            fn()

    def _capture(self, fn) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream()  # one call on a side stream first, as torch.cuda.graph wants
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(max(1, self.graph_calls)):
                fn()
        return graph

    def _event_samples(self, launch, calls: int) -> list[float]:
        """``launch()`` timed between two CUDA events ``iters`` times, per call."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(self.iters):
            if self.flush is not None:
                self.flush.zero_()
            start.record()
            launch()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / calls)
        return samples

    def _l2_note(self) -> str:
        return ", L2 flushed" if self.flush is not None else ", warm L2"
