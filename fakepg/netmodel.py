"""Simulated network time: how long after its data moved a collective counts as complete.

The fake world moves data at memory speed. A network model adds, per collective, the time a
real interconnect would need, so that overlap of communication with backward can be seen and
measured on one machine. Once every rank has joined, the world waits that long (off every
rank's thread) before the data lands in the ranks' tensors and the collective completes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["FixedLatency", "NetworkModel"]


@runtime_checkable
class NetworkModel(Protocol):
    """Seconds a collective takes on the simulated network."""

    def collective_time_s(self, kind: str, nbytes: int, world_size: int) -> float:
        """``kind`` is "allreduce", "allgather", "broadcast" or "barrier"; ``nbytes`` is the
        size of one rank's input."""
        ...


@dataclass(frozen=True, slots=True)
class FixedLatency:
    """Every collective takes ``seconds``, whatever its size: the simplest slow link."""

    seconds: float

    def __post_init__(self) -> None:
        if not self.seconds >= 0:
            raise ValueError(f"FixedLatency: seconds must be >= 0, got {self.seconds!r}")

    def collective_time_s(self, kind: str, nbytes: int, world_size: int) -> float:
        return self.seconds
