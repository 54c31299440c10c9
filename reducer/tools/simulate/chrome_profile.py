"""A profile (:class:`reducer.tools.simulate.cluster.Profile`) from torch.profiler's trace.

torch.profiler's Chrome trace (``prof.export_chrome_trace``) of a few training steps of the
model holds, per backward, one ``AccumulateGrad`` operation per parameter, in the order the
autograd engine ran them. The same model run on the meta device gives that order by
parameter (its gradient hooks fire in the same order), so the k-th ``AccumulateGrad`` of the
last backward in the trace is the gradient of the k-th parameter to become ready.

Times: with CUDA activity in the trace, a gradient is ready when the last kernel launched
before its ``AccumulateGrad`` finished on the GPU (kernels and their launches are matched by
the trace's ``correlation`` ids); without it, the CPU timestamps are the times. Forward runs
from the end of the step's ``Optimizer.zero_grad`` (or the start of its ``ProfilerStep#``)
to the first backward operation; the optimizer is the step's ``Optimizer.step``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from . import shapes
from .profile import Profile

__all__: list[str] = []

_ACCUMULATE = "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"
_BACKWARD = "autograd::engine::evaluate_function: "
_KERNEL_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def hook_order(model: str) -> list[int]:
    """Parameter indices in the order their gradients become ready (a meta-device run)."""
    net = shapes.build(model)
    params = [p for p in net.parameters() if p.requires_grad]
    order: list[int] = []
    handles = [
        p.register_post_accumulate_grad_hook(lambda _p, i=i: order.append(i))  # type: ignore[no-untyped-call]
        for i, p in enumerate(params)
    ]
    try:
        x, y = net.make_batch(2, torch.device("meta"))  # type: ignore[operator]
        net.loss(net(x), y).backward()  # type: ignore[operator]
    finally:
        for handle in handles:
            handle.remove()
    return order


def load(path: str | Path, model: str, batch_size: int) -> Profile:
    """The profile of ``model``'s last step in the trace at ``path``; ValueError naming what
    the trace lacks."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"trace {path}: cannot read it as JSON: {exc}") from exc
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X"]
    net = shapes.build(model)
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    order = hook_order(model)
    accumulate = sorted((e for e in events if e.get("name") == _ACCUMULATE), key=_ts)
    count = len(named)
    if not accumulate or len(accumulate) % count:
        raise ValueError(
            f"trace {path}: {len(accumulate)} AccumulateGrad events, not a multiple of "
            f"{model}'s {count} parameters: profile whole steps of this model"
        )
    last = accumulate[-count:]
    previous_end = _end(accumulate[-count - 1]) if len(accumulate) > count else -math.inf
    backward_cpu = min(
        (_ts(e) for e in events if e.get("name", "").startswith(_BACKWARD)
         and previous_end < _ts(e) <= _ts(last[0])),
        default=_ts(last[0]),
    )  # fmt: skip
    forward_cpu = _forward_start(events, previous_end, backward_cpu, path)
    optimizer = [e for e in events if e.get("name", "").startswith("Optimizer.step#")
                 and _ts(e) >= _ts(last[-1])]  # fmt: skip
    gpu = _GpuClock(events)
    backward_start = gpu.start_after(backward_cpu)
    ready = [0.0] * count
    for k, event in enumerate(last):
        ready[order[k]] = max(0.0, gpu.ready(_end(event)) - backward_start) / 1e3
    optimizer_ms = 0.0
    if optimizer:
        step = min(optimizer, key=_ts)
        optimizer_ms = max(0.0, gpu.span(_ts(step), _end(step))) / 1e3
    return Profile(
        model=model,
        device=f"torch.profiler trace {Path(path).name}" + (" (GPU)" if gpu.kernels else ""),
        batch_size=batch_size,
        forward_ms=max(0.0, backward_start - gpu.start_after(forward_cpu)) / 1e3,
        optimizer_ms=optimizer_ms,
        names=tuple(n for n, _ in named),
        shapes=tuple(tuple(p.shape) for _, p in named),
        ready_ms=tuple(ready),
    )


def _ts(event: dict[str, Any]) -> float:
    return float(event["ts"])


def _end(event: dict[str, Any]) -> float:
    return float(event["ts"]) + float(event.get("dur", 0.0))


def _forward_start(
    events: list[dict[str, Any]], after: float, backward: float, path: str | Path
) -> float:
    zero = [_end(e) for e in events if e.get("name", "").startswith("Optimizer.zero_grad#")
            and after < _ts(e) < backward]  # fmt: skip
    if zero:
        return max(zero)
    steps = [_ts(e) for e in events if e.get("name", "").startswith("ProfilerStep#")
             and _ts(e) < backward]  # fmt: skip
    if steps:
        return max(steps)
    raise ValueError(
        f"trace {path}: no Optimizer.zero_grad or ProfilerStep# before the last backward, so "
        "forward has no start; profile with optimizer.zero_grad() or prof.step() per step"
    )


class _GpuClock:
    """CPU times to GPU times through the kernels launched (identity without kernels)."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        kernels = {
            e["args"]["correlation"]: e
            for e in events
            if e.get("cat") in _KERNEL_CATS and "correlation" in e.get("args", {})
        }
        launches = [
            (_ts(e), kernels[e["args"]["correlation"]])
            for e in events
            if e.get("cat") == "cuda_runtime" and e.get("args", {}).get("correlation") in kernels
        ]
        self.kernels = sorted(launches, key=lambda pair: pair[0])

    def ready(self, cpu_ts: float) -> float:
        """When the work the host had launched by ``cpu_ts`` was done on the GPU."""
        if not self.kernels:
            return cpu_ts
        done = [_end(k) for launched, k in self.kernels if launched <= cpu_ts]
        return max(done, default=cpu_ts)

    def start_after(self, cpu_ts: float) -> float:
        """When the GPU started the first kernel launched at or after ``cpu_ts``."""
        if not self.kernels:
            return cpu_ts
        starts = [_ts(k) for launched, k in self.kernels if launched >= cpu_ts]
        return min(starts, default=cpu_ts)

    def span(self, cpu_start: float, cpu_end: float) -> float:
        """GPU time from the first to the last kernel launched in the CPU interval."""
        if not self.kernels:
            return cpu_end - cpu_start
        inside = [k for launched, k in self.kernels if cpu_start <= launched <= cpu_end]
        if not inside:
            return 0.0
        return max(_end(k) for k in inside) - min(_ts(k) for k in inside)
