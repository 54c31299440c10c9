"""Timeline traces in the Chrome trace-event format (chrome://tracing, ui.perfetto.dev).

:func:`chrome_trace` turns what each rank did in each step (:class:`RankStep`: forward and
backward passes, the optimizer, the reducer's :class:`reducer.IterationStats`) into trace
events; :func:`write_chrome_trace` writes them as JSON (``{"traceEvents": [...]}``).

Layout: one process track per rank (``pid`` = rank, named "rank r"). Thread 0, "compute",
holds complete events (``"ph": "X"``) that nest: step > forward, backward > finalize, plus an
instant event (``"ph": "i"``) when each parameter's gradient became ready. A bucket's allreduce
runs from its launch to its completion, and several are in flight at once, which complete
events on one thread cannot show (they must nest), so allreduces go on threads 1, 2, ...
("allreduce lane k"), each event on the first lane free at its launch. Times are microseconds
from the earliest event of the trace.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from reducer.stats import IterationStats

__all__ = ["Pass", "RankStep", "Span", "chrome_trace", "write_chrome_trace"]

COMPUTE_TID = 0


@dataclass(frozen=True, slots=True)
class Span:
    """An interval on the ``time.perf_counter_ns`` clock (absolute ns)."""

    start_ns: int
    end_ns: int


@dataclass(frozen=True, slots=True)
class Pass:
    """One forward and backward; ``synced`` is False under ``no_sync`` (accumulation)."""

    forward: Span
    backward: Span
    synced: bool


@dataclass(frozen=True, slots=True)
class RankStep:
    """What one rank did in one training step.

    ``iteration`` is the reducer's record of the synced backward (None if the reduction did
    not finish), ``bucket_indices`` the bucket assignment it used, ``unused`` the parameters
    found unused in it.
    """

    rank: int
    step: int
    passes: tuple[Pass, ...]
    optimizer: Span | None = None
    iteration: IterationStats | None = None
    bucket_indices: tuple[tuple[int, ...], ...] = ()
    unused: tuple[int, ...] = ()


def chrome_trace(
    steps: Iterable[RankStep],
    param_names: Sequence[str],
    *,
    metadata: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The trace of ``steps`` as a JSON-ready dict: ``{"traceEvents": [...], ...}``."""
    steps = list(steps)
    starts = [s.optimizer.start_ns for s in steps if s.optimizer is not None]
    starts += [p.forward.start_ns for s in steps for p in s.passes]
    origin = min(starts, default=0)
    events: list[dict[str, Any]] = []
    lanes: dict[int, list[int]] = {}  # rank -> per lane, when its last allreduce ended
    for record in sorted(steps, key=lambda s: (s.rank, s.step)):
        events += _step_events(record, param_names, origin, lanes.setdefault(record.rank, []))
    events.sort(key=lambda e: (e["pid"], e["ts"], e["tid"]))
    meta: list[dict[str, Any]] = []
    for rank in sorted(lanes):
        meta.append(_meta(rank, None, "process_name", {"name": f"rank {rank}"}))
        meta.append(_meta(rank, None, "process_sort_index", {"sort_index": rank}))
        meta.append(_meta(rank, COMPUTE_TID, "thread_name", {"name": "compute"}))
        for lane in range(len(lanes[rank])):
            meta.append(_meta(rank, lane + 1, "thread_name", {"name": f"allreduce lane {lane}"}))
    trace: dict[str, Any] = {"traceEvents": meta + events, "displayTimeUnit": "ms"}
    if metadata:
        trace["otherData"] = metadata
    return trace


def write_chrome_trace(
    path: str | os.PathLike[str],
    steps: Iterable[RankStep],
    param_names: Sequence[str],
    *,
    metadata: dict[str, Any] | None = None,
) -> int:
    """Write the trace of ``steps`` to ``path``; returns the number of events written."""
    trace = chrome_trace(steps, param_names, metadata=metadata)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f, separators=(",", ":"))
    return len(trace["traceEvents"])


# -------------------------------------------------------------------------------------------


def _us(ns: int, origin: int) -> float:
    return (ns - origin) / 1000.0


def _complete(
    name: str, cat: str, rank: int, tid: int, span: Span, origin: int, **args: Any
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "name": name,
        "cat": cat,
        "ph": "X",
        "pid": rank,
        "tid": tid,
        "ts": _us(span.start_ns, origin),
        "dur": (span.end_ns - span.start_ns) / 1000.0,
    }
    if args:
        event["args"] = args
    return event


def _meta(rank: int, tid: int | None, name: str, args: dict[str, Any]) -> dict[str, Any]:
    event: dict[str, Any] = {"name": name, "ph": "M", "pid": rank, "args": args}
    if tid is not None:
        event["tid"] = tid
    return event


def _name(index: int, names: Sequence[str]) -> str:
    return names[index] if 0 <= index < len(names) else f"parameter {index}"


def _step_events(
    record: RankStep, names: Sequence[str], origin: int, lanes: list[int]
) -> list[dict[str, Any]]:
    rank, step = record.rank, record.step
    events: list[dict[str, Any]] = []
    if not record.passes:
        return events
    first = record.passes[0].forward.start_ns
    if record.optimizer is not None:
        first = min(first, record.optimizer.start_ns)
        events.append(_complete("optimizer", "optimizer", rank, 0, record.optimizer, origin))
    last = max(p.backward.end_ns for p in record.passes)
    events.append(_complete(f"step {step}", "step", rank, 0, Span(first, last), origin, step=step))
    for i, p in enumerate(record.passes):
        suffix = "" if p.synced else " (no_sync)"
        args = {"step": step, "micro_batch": i}
        events.append(_complete("forward" + suffix, "forward", rank, 0, p.forward, origin, **args))
        events.append(
            _complete("backward" + suffix, "backward", rank, 0, p.backward, origin, **args)
        )
    it = record.iteration
    if it is None:
        return events
    base = it.start_ns
    bucket_of = {i: b for b, indices in enumerate(record.bucket_indices) for i in indices}
    unused = set(record.unused)
    for index, offset in enumerate(it.ready_ns[0]):
        events.append(
            {
                "name": f"ready {_name(index, names)}",
                "cat": "ready",
                "ph": "i",
                "s": "t",
                "pid": rank,
                "tid": COMPUTE_TID,
                "ts": _us(base + offset, origin),
                "args": {
                    "parameter": index,
                    "bucket": bucket_of.get(index),
                    "unused": index in unused,
                    "step": step,
                },
            }
        )
    for b, (launch, done) in enumerate(zip(it.launch_ns, it.done_ns, strict=True)):
        span = Span(base + launch, base + max(done, launch))
        lane = next((k for k, free in enumerate(lanes) if free <= span.start_ns), len(lanes))
        if lane == len(lanes):
            lanes.append(span.end_ns)
        else:
            lanes[lane] = span.end_ns
        members = record.bucket_indices[b] if b < len(record.bucket_indices) else ()
        events.append(
            _complete(
                f"allreduce bucket {b}",
                "allreduce",
                rank,
                lane + 1,
                span,
                origin,
                bucket=b,
                bytes=it.bucket_nbytes[b],
                parameters=[_name(i, names) for i in members],
                step=step,
            )
        )
    finalize = Span(base + it.finalize_start_ns, base + it.finalize_end_ns)
    events.append(_complete("finalize", "finalize", rank, 0, finalize, origin, step=step))
    return events
