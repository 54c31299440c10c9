"""The things a schedule orders: each rank's own thread and each rank's completion lanes
(*actors*), their states, and the collectives waiting for a decision to complete."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .probe import Sample, ThreadProbe

# Actor states.
READY = "ready"  # parked at a point; may go on
RUNNING = "running"  # holds the baton
BLOCKED = "blocked"  # parked in a wait; may go on once its predicate holds
OUTSIDE = "outside"  # blocked where no point sees it (Note [Blocked outside the scheduler])
IDLE = "idle"  # a lane between callbacks
DONE = "done"  # a rank thread that returned

Key = tuple[int, int]  # (rank, level): level -1 is the rank's own thread, k >= 0 a lane


@dataclass(eq=False)
class Actor:
    """One actor's state; every field is guarded by the scheduler's lock."""

    key: Key
    state: str
    cond: threading.Condition
    pred: Callable[[], bool] | None = None
    waits_for: str = ""
    probe: ThreadProbe | None = None  # its thread, once it ran
    # Lanes: the callbacks posted and not yet started, oldest first: (post number, what).
    posted: deque[tuple[int, str]] = field(default_factory=deque)
    # Samples of a holder that does not come back, or of an outside actor.
    samples: list[Sample] = field(default_factory=list)
    # The last sample that showed it blocked outside: while its CPU time has not grown since,
    # it has not run, so it is still blocked there (the fast path of the monitor's settle).
    stalled_at: Sample | None = None

    @property
    def rank(self) -> int:
        return self.key[0]

    @property
    def is_lane(self) -> bool:
        return self.key[1] >= 0

    @property
    def thread(self) -> threading.Thread | None:
        return None if self.probe is None else self.probe.thread

    @property
    def label(self) -> str:
        rank, level = self.key
        if level < 0:
            return f"rank {rank}"
        return f"rank {rank} callbacks" + (f" (level {level})" if level else "")

    def attach(self, thread: threading.Thread) -> None:
        """``thread`` runs this actor now (a rank's thread for a run, a lane's worker)."""
        if self.probe is None or self.probe.thread is not thread:
            self.probe = ThreadProbe(thread)

    def runnable(self) -> bool:
        if self.state == READY:
            return True
        return self.state == BLOCKED and self.pred is not None and bool(self.pred())

    def arrive(self, state: str) -> None:
        """It reached a point (parked there in ``state``): what was sampled is stale."""
        self.state = state
        self.samples.clear()
        self.stalled_at = None


@dataclass(eq=False, slots=True)
class Ready:
    """A collective every rank has issued, waiting for a decision to complete it."""

    what: str
    tensors: str
    complete: Callable[[], None]
