"""What ``DistributedDataParallel.logging_data()`` reports, and the sums behind its averages."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Protocol

import torch.distributed as dist
from torch import nn

from reducer.stats import IterationStats

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
        self._pending_start_ns = 0
        self._seen: IterationStats | None = None
        # torch's logger samples: the first 10 iterations, then every sample_rate-th. The
        # sampled one: its index, forward time and start, and its stats.
        self.sample_rate = 100
        self.sampled: tuple[int, int, int, IterationStats] | None = None

    def forward(self, forward_ns: int, last: IterationStats | None, start_ns: int = 0) -> None:
        """A synced forward took ``forward_ns`` from ``start_ns``; ``last`` is the reducer's
        newest stats."""
        self.absorb(last)
        self._pending_forward_ns = forward_ns
        self._pending_start_ns = start_ns

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
        if self.count < 10 or self.count % self.sample_rate == 0:
            self.sampled = (self.count, forward_ns, self._pending_start_ns, last)
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
    _built_bucket_sizes: tuple[int, ...]
    _join_config: Any
    _timings: Timings
    _logged_error: str | None
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
    formats (flags as 0/1, lists as strings, times in ns; the times and ``iteration`` those of
    the last iteration torch's logger would have sampled). Keys of CUDA events and NCCL
    settings are absent (see docs/design/reducer.md)."""
    sample = ddp._timings.sampled
    failure = ddp._logged_error or ddp.reducer._failure
    errors = {} if failure is None else {"has_error": 1, "error": str(failure)}
    group = ddp._torch_group
    backend = dist.get_backend(group) if group is not None else data.process_group
    ns = 1_000_000  # the record keeps milliseconds
    return {
        "device_ids": ", ".join(map(str, ddp.device_ids or [])),
        "output_device": -1 if ddp.output_device is None else ddp.output_device,
        "broadcast_buffers": int(data.broadcast_buffers),
        "find_unused_parameters": int(data.find_unused_parameters),
        "gradient_as_bucket_view": int(data.gradient_as_bucket_view),
        "static_graph": int(data.static_graph),
        "bucket_cap_bytes": ddp.bucket_bytes_cap,
        "backend_name": backend,
        "iteration": sample[0] if sample else 0,
        "dtypes": ", ".join(sorted(_TORCH_DTYPE_NAMES.get(d, d) for d in data.dtypes)),
        "num_parameter_tensors": data.num_parameters,
        "bucket_sizes": ", ".join(map(str, ddp._built_bucket_sizes)),
        "has_rebuilt_buckets": int(ddp._buckets_rebuilt),
        "rebuilt_bucket_sizes": ", ".join(map(str, data.bucket_sizes))
        if ddp._buckets_rebuilt
        else "",
        "rebuilt_per_bucket_param_indices": ", ".join(
            " ".join(map(str, b)) for b in data.bucket_param_indices
        )
        if ddp._buckets_rebuilt
        else "",
        "prev_iteration_grad_ready_order_indices": ", ".join(map(str, data.grad_ready_order)),
        "has_sync_bn": int(any(isinstance(m, nn.SyncBatchNorm) for m in ddp.module.modules())),
        "join_uneven_inputs": int(bool(ddp._join_config.enable)),
        "num_buckets_reduced": ddp.reducer.buckets_reduced,
        **_sampled_times(sample),
        "avg_forward_compute_time": int(data.avg_forward_ms * ns),
        "avg_backward_compute_time": int(data.avg_backward_compute_ms * ns),
        "avg_backward_comm_time": int(data.avg_comm_ms * ns),
        "avg_backward_compute_comm_overlap_time": int(data.avg_overlap_ms * ns),
        **errors,
        **_environment(backend),
    }


def _sampled_times(sample: tuple[int, int, int, IterationStats] | None) -> dict[str, int]:
    """The sampled iteration's times (ns), and torch's host-side timestamps of it."""
    if sample is None:
        return {}
    _, forward_ns, forward_start, stats = sample
    base = stats.start_ns
    return {
        "forward_compute_time": forward_ns,
        "backward_compute_time": stats.backward_ns,
        "backward_comm_time": stats.comm_ns,
        "backward_compute_comm_overlap_time": stats.overlap_ns,
        "forward_compute_time_start": forward_start,
        "backward_compute_time_start": base,
        "backward_compute_time_end": base + stats.backward_ns,
        "backward_comm_time_start": base + min(stats.launch_ns),
        "backward_comm_time_end": base + max(stats.done_ns),
    }


def _environment(backend: str) -> dict[str, Any]:
    """The environment torch's logger records (``N/A`` where unset), and gloo's thread
    count, torch's default (this wrapper starts no gloo threads of its own)."""
    names = ["MASTER_ADDR", "MASTER_PORT", "TORCH_DISTRIBUTED_DEBUG", "CUDA_VISIBLE_DEVICES"]
    if backend == "gloo":
        names += ["GLOO_SOCKET_IFNAME", "GLOO_DEVICE_TRANSPORT"]
    found: dict[str, Any] = {n.lower(): os.environ.get(n, "N/A") for n in names}
    if backend == "gloo":
        found["gloo_num_threads"] = 2
    return found
