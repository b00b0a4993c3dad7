"""The one "bench a point" routine and the one sweep loop of the kernel benchmarks.

A point is a dict of what defines it (batch, T, context, ...). ``bench_point``
times a list of ``Call``s there, (op, impl, fn) each, and returns one row per
call: the point, op, impl and the timer's figures, or ``error`` when the call
raised. ``run_sweep`` walks the points of a grid under a time budget, one
bench function per point, and collects the rows, the points skipped for time
and the points whose bench raised. Every benchmark of the kernels (the tree
ops, tree attention, its split-count scan) is these two and ``Timer``.
"""

from __future__ import annotations

import time
import traceback
from typing import Callable, Iterable, NamedTuple

from .timer import describe_error


class Call(NamedTuple):
    """One thing to time at a point: ``fn()`` runs ``op`` through ``impl``."""

    op: str
    impl: str
    fn: Callable[[], object]


def time_left(deadline: float | None) -> float:
    """Seconds until ``deadline`` (a time.time() value; None: no limit)."""
    return float("inf") if deadline is None else deadline - time.time()


def bench_point(point: dict, calls: Iterable[Call], measure: Callable[[Call], dict], *,
                deadline: float | None = None, reserve: float = 0.0) -> list[dict]:  # fmt: skip
    """Rows ``dict(point, op, impl, **measure(call))`` for each call, in order
    (``error`` instead of figures when it raised). Stops, leaving the rest
    out, once under ``reserve`` seconds remain before ``deadline``. ``calls``
    may be a generator: its inputs then exist only while they are timed."""
    rows = []
    for call in calls:
        if time_left(deadline) < reserve:
            break
        row = dict(point, op=call.op, impl=call.impl)
        try:
            row.update(measure(call))
        except Exception as exc:
            row["error"] = describe_error(exc)
        rows.append(row)
    return rows


def run_sweep(points: list[dict], bench: Callable[[dict], list[dict]], *, name: str, deadline: float | None = None,
              reserve: float = 0.0, log: Callable[[str], None] | None = None,
              summary: Callable[[list[dict]], str] | None = None, rows: list | None = None,
              after_point: Callable[[], None] | None = None) -> dict:  # fmt: skip
    """``bench(point)`` for each point: {"rows": every point's rows (appended
    to ``rows`` when given, so a report holding that list sees them as they
    come), "skipped": points not started because under ``reserve`` seconds
    remained, "errors": dict(point, error=traceback) of benches that raised}.
    Logs one line per point (``summary`` of its rows appended) and calls
    ``after_point`` after each (a report's save)."""
    result = {"rows": [] if rows is None else rows, "skipped": [], "errors": []}
    for i, point in enumerate(points, 1):
        if time_left(deadline) < reserve:
            result["skipped"].append(point)
            continue
        t0 = time.time()
        try:
            new_rows = bench(point)
            note = summary(new_rows) if summary else ""
        except Exception as exc:
            result["errors"].append(dict(point, error=traceback.format_exc(limit=4)[-1500:]))
            new_rows, note = [], f"raised {describe_error(exc)}"
        result["rows"].extend(new_rows)
        if log:
            where = " ".join(f"{k}={v}" for k, v in point.items())
            log(f"  {name} [{i}/{len(points)}] {where} ({time.time() - t0:.1f}s) {note}".rstrip())
        if after_point:
            after_point()
    return result
