"""Helpers shared by the benchmark scripts: interleaved timing, statistics, tables, machine
description, and the reducer-against-torch-DDP variants several scripts time."""

from __future__ import annotations

import functools
import os
import platform
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch
from torch import nn

import reducer

K = TypeVar("K")
V = TypeVar("V")


def machine() -> str:
    """One line describing where the numbers came from."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (
        f"{cpu}, {cores} cores, Python {platform.python_version()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads"
    )


def median_ms(seconds: Sequence[float]) -> float:
    return statistics.median(seconds) * 1e3


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table, right-aligned, that pastes into Markdown as is."""
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if isinstance(value, float):
        if value >= 100:
            return f"{value:.0f}"
        if value >= 10:
            return f"{value:.1f}"
        return f"{value:.2f}"
    return str(value)


def human_bytes(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= size:
            return f"{n / size:g} {unit}"
    return f"{n} B"


def interleave(
    variants: Mapping[K, V], steps: int, warmup: int, timed_step: Callable[[int, V], float]
) -> dict[K, list[float]]:
    """Per variant, the seconds of each of its ``steps`` timed steps after ``warmup`` more.

    Every step runs every variant once, in turn, so that drift and noise (other processes,
    clock changes) affect all alike; the turn rotates from step to step (step k starts with
    variant k mod n), so that no variant always runs right after the same other one (whose
    leftover work, such as a backend thread still finishing, it would pay for).
    ``timed_step(step, variant)`` runs one step and returns the seconds it timed (only the
    part it means to measure).
    """
    samples: dict[K, list[float]] = {key: [] for key in variants}
    items = list(variants.items())
    for step in range(steps + warmup):
        shift = step % len(items)
        for key, variant in items[shift:] + items[:shift]:
            elapsed = timed_step(step, variant)
            if step >= warmup:
                samples[key].append(elapsed)
    return samples


def paired_ratio(ours: Sequence[float], theirs: Sequence[float]) -> str:
    """The median of the per-step ratios ``ours / theirs``, as ``1.05x``. The steps of the two
    ran back to back (see :func:`interleave`): this cancels drift that shifts both, so it is
    less noisy than the ratio of the medians."""
    return f"{statistics.median(a / b for a, b in zip(ours, theirs, strict=True)):.2f}x"


# A variant of a training step: (module whose grads are zeroed, forward callable, hook called
# between forward and backward, e.g. the reducer's prepare_for_backward).
Variant = tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor], Callable[[], None]]


def reducer_and_torch_ddp(
    base: nn.Module,
    copy_of: Callable[[], nn.Module],
    pg: reducer.ProcessGroup,
    bucket_cap_mb: float,
    *,
    plain: str,
) -> tuple[dict[str, Variant], list[reducer.Reducer]]:
    """Five variants of one model: ``plain`` (``base`` alone, no communication); this reducer
    over ``pg``, copying gradients into buckets (``reducer``) and with
    ``gradient_as_bucket_view`` (``reducer views``); torch's DistributedDataParallel on the
    default torch.distributed group with the same two settings (``torch DDP``, ``torch DDP
    views``). Every copy has ``base``'s weights. Returns the reducers too, to be closed."""
    variants: dict[str, Variant] = {plain: (base, base, lambda: None)}
    reducers = []
    for view in (False, True):
        model = copy_of()
        params: list[torch.Tensor] = list(model.parameters())
        red = reducer.Reducer(
            [params],
            reducer.ddp_bucket_assignment(params, bucket_cap_mb=bucket_cap_mb),
            pg,
            gradient_as_bucket_view=view,
        )
        reducers.append(red)
        prepare = functools.partial(red.prepare_for_backward, [])
        variants[f"reducer{' views' if view else ''}"] = (model, model, prepare)
    for view in (False, True):
        model = copy_of()
        ddp = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=view
        )
        variants[f"torch DDP{' views' if view else ''}"] = (model, ddp, lambda: None)
    return variants, reducers
