"""What one synced iteration looked like, for logging, summaries and timeline traces."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IterationStats"]


@dataclass(frozen=True, slots=True)
class IterationStats:
    """Timings of one synced backward, in ns on the ``time.perf_counter_ns`` clock.

    ``start_ns`` is absolute (when ``prepare_for_backward`` ran); every other time is an offset
    from it. ``done_ns[b]`` is when bucket ``b``'s reduction completed (the work's own
    completion time where the backend records one, else when finalize saw it complete).
    """

    start_ns: int
    ready_ns: tuple[tuple[int, ...], ...]  # per replica, per parameter
    launch_ns: tuple[int, ...]  # per bucket
    done_ns: tuple[int, ...]  # per bucket
    finalize_start_ns: int
    finalize_end_ns: int
    bucket_nbytes: tuple[int, ...]
    unused_parameters: int

    @property
    def backward_ns(self) -> int:
        """Until the last gradient was ready: the backward computation as the reducer saw it."""
        return max(max(r) for r in self.ready_ns)

    @property
    def comm_ns(self) -> int:
        """From the first launch to the last completion."""
        return max(self.done_ns) - min(self.launch_ns)

    @property
    def overlap_ns(self) -> int:
        """How much of the communication ran while backward was still computing."""
        first = min(self.launch_ns)
        return max(0, min(self.backward_ns, max(self.done_ns)) - first)
