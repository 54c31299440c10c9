"""What ``DistributedDataParallel.logging_data()`` reports, and the sums behind its averages."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch.distributed as dist
from torch import nn

from .stats import IterationStats

__all__ = ["DDPLoggingData"]


@dataclasses.dataclass(frozen=True, slots=True)
class DDPLoggingData:
    """What torch's ``_get_ddp_logging_data()`` reports, as a plain record.

    Times are in milliseconds. The plain ones are the last synced iteration's (0 before the
    first): ``forward_ms`` the wrapped module's forward, ``backward_compute_ms`` from
    ``prepare_for_backward`` until the last gradient was ready, ``comm_ms`` from the first
    bucket launch to the last completion, ``overlap_ms`` the part of it during backward. The
    ``avg_`` ones average every synced iteration so far. ``unused_parameters`` counts the
    parameters that got no gradient on this rank in the last synced iteration (found unused,
    or reached only by outputs the loss did not use). ``grad_ready_order`` is the order their
    gradients became ready in it (see ``Reducer.ready_order``).
    """

    rank: int
    world_size: int
    module_name: str
    process_group: str
    bucket_cap_mb: float
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    static_graph: bool
    broadcast_buffers: bool
    comm_hook: str | None
    num_parameters: int
    total_parameter_size_bytes: int
    dtypes: tuple[str, ...]
    num_buckets: int
    bucket_sizes: tuple[int, ...]
    bucket_param_indices: tuple[tuple[int, ...], ...]
    buckets_rebuilt: bool
    grad_ready_order: tuple[int, ...]
    iterations: int
    forward_ms: float
    backward_compute_ms: float
    comm_ms: float
    overlap_ms: float
    avg_forward_ms: float
    avg_backward_compute_ms: float
    avg_comm_ms: float
    avg_overlap_ms: float
    unused_parameters: int


class Timings:
    """Sums of the synced iterations' timings, for the averages of :class:`DDPLoggingData`.

    The forward time of a synced iteration is measured before its backward; it is counted
    once that iteration's stats appear (a forward whose backward never ran is left out).
    """

    def __init__(self) -> None:
        self.totals = {"forward": 0, "backward": 0, "comm": 0, "overlap": 0}
        self.count = 0
        self.last_forward_ns = 0
        self._pending_forward_ns: int | None = None
        self._seen: IterationStats | None = None

    def forward(self, forward_ns: int, last: IterationStats | None) -> None:
        """A synced forward took ``forward_ns``; ``last`` is the reducer's newest stats."""
        self.absorb(last)
        self._pending_forward_ns = forward_ns

    def absorb(self, last: IterationStats | None) -> None:
        """Count ``last`` if it is an iteration not counted yet."""
        if last is None or last is self._seen:
            return
        self._seen = last
        forward_ns = self._pending_forward_ns or 0
        self._pending_forward_ns = None
        self.last_forward_ns = forward_ns
        for key, value in (
            ("forward", forward_ns),
            ("backward", last.backward_ns),
            ("comm", last.comm_ns),
            ("overlap", last.overlap_ns),
        ):
            self.totals[key] += value
        self.count += 1

    def average(self, key: str) -> float:
        return self.totals[key] / self.count if self.count else 0.0


class _Wrapper(Protocol):
    """What torch_logging_data reads of the wrapper (reducer.ddp imports this module)."""

    device_ids: list[int] | None
    output_device: int | None
    bucket_bytes_cap: int
    module: nn.Module
    _torch_group: Any
    _buckets_rebuilt: bool
    _join_config: Any
    reducer: Any


# How torch's C++ logger names dtypes (c10's names).
_TORCH_DTYPE_NAMES = {
    "float32": "float",
    "float64": "double",
    "float16": "c10::Half",
    "bfloat16": "c10::BFloat16",
}


def torch_logging_data(ddp: _Wrapper, data: DDPLoggingData) -> dict[str, Any]:
    """The keys of torch's ``_get_ddp_logging_data()`` that mean something here, in torch's
    formats (flags as 0/1, lists as strings, times in ns). torch's keys that describe its
    C++ logger's sampling, CUDA events or NCCL settings are absent (see the README)."""
    failure = ddp.reducer._failure
    errors = {} if failure is None else {"has_error": 1, "error": str(failure)}
    group = ddp._torch_group
    backend = dist.get_backend(group) if group is not None else data.process_group
    ns = 1_000_000  # the record keeps milliseconds
    return {
        "device_ids": ", ".join(map(str, ddp.device_ids or [])),
        "output_device": -1 if ddp.output_device is None else ddp.output_device,
        "broadcast_buffers": int(data.broadcast_buffers),
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "backend_name": backend,
        "iteration": data.iterations,
        "dtypes": ", ".join(_TORCH_DTYPE_NAMES.get(d, d) for d in data.dtypes),
        "num_parameter_tensors": data.num_parameters,
        "bucket_sizes": ", ".join(map(str, data.bucket_sizes)),
        "has_rebuilt_buckets": int(ddp._buckets_rebuilt),
        "rebuilt_bucket_sizes": ", ".join(map(str, data.bucket_sizes))
        if ddp._buckets_rebuilt
        else "",
        "rebuilt_per_bucket_param_indices": " ".join(
            ", ".join(map(str, b)) for b in data.bucket_param_indices
        )
        if ddp._buckets_rebuilt
        else "",
        "prev_iteration_grad_ready_order_indices": ", ".join(map(str, data.grad_ready_order)),
        "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in ddp.module.modules())),
        "join_uneven_inputs": int(bool(ddp._join_config.enable)),
        "num_buckets_reduced": ddp.reducer.buckets_reduced,
        "forward_compute_time": int(data.forward_ms * ns),
        "backward_compute_time": int(data.backward_compute_ms * ns),
        "backward_comm_time": int(data.comm_ms * ns),
        "backward_compute_comm_overlap_time": int(data.overlap_ms * ns),
        "avg_forward_compute_time": int(data.avg_forward_ms * ns),
        "avg_backward_compute_time": int(data.avg_backward_compute_ms * ns),
        "avg_backward_comm_time": int(data.avg_comm_ms * ns),
        "avg_backward_compute_comm_overlap_time": int(data.avg_overlap_ms * ns),
        **errors,
    }
