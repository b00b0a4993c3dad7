"""Time device work without making the host wait for it.

On CUDA the host runs ahead of the GPU: a host clock around a kernel launch
measures the launch, not the kernel, and feeds the adaptive budget wrong
costs. ``StepClock`` marks points in the device's stream (CUDA events) and
reads their distances once the work is known to be done (after the step's
one host read, which waits for everything queued before it). Where ops run
synchronously (the CPU) a mark is the host clock. The budget, the runner's
statistics and the startup profile use this one helper.
"""

from __future__ import annotations

import time

import torch


class StepClock:
    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        """A point in the device's work queue (a float on synchronous devices)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ready(self, mark) -> bool:
        """Whether the device has passed ``mark`` (a non-blocking query: readers that
        must never wait, V2's budget, call ``seconds`` only once it is)."""
        return mark.query() if self.cuda else True

    def seconds(self, start, end) -> float:
        """Device time between two marks. On CUDA ``end`` must have completed
        (it is waited for here: free once the step's host read has returned)."""
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start

    def synchronize(self) -> None:
        """Wait for queued work (startup profiles only: never in a step)."""
        if self.cuda:
            torch.cuda.synchronize()
