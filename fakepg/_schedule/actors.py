"""The things a schedule orders: each rank's own thread and each rank's completion lanes
(*actors*), their states, and the collectives waiting for a decision to complete."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .probe import Sample, ThreadProbe
from .timeline import Tensors

# Actor states.
READY = "ready"  # parked at a point; may go on
RUNNING = "running"  # holds the baton
BLOCKED = "blocked"  # parked in a wait; may go on once its predicate holds
OUTSIDE = "outside"  # blocked where no point sees it (Note [Blocked outside the scheduler])
IDLE = "idle"  # a lane between callbacks
DONE = "done"  # a rank thread that returned

Key = tuple[int, int]  # (rank, level): level -1 is the rank's own thread, k >= 0 a lane


class Wake:
    """One actor's wait for the turn: a raw lock used as a binary semaphore, lighter than a
    ``threading.Condition`` (which allocates a lock and runs a page of Python per wait), since
    a hand-over to another thread is the scheduler's most frequent step.

    # Guarantees: ``waiting`` and ``_signaled`` are guarded by the scheduler's lock;
    # ``_signaled`` is True exactly while ``_lock`` is released (a signal not yet consumed),
    # so a signal never releases it twice. A signal that arrives after a wait timed out stays,
    # and makes the next wait return at once: the caller re-checks whether it holds the turn.
    """

    __slots__ = ("_lock", "_signaled", "waiting")

    def __init__(self) -> None:
        self.waiting = False
        self._signaled = False
        self._lock = threading.Lock()
        self._lock.acquire()  # released by a signal, taken again by the wait it ends

    def signal_locked(self) -> None:
        """Wake the actor's thread if it waits (the scheduler's lock held)."""
        if self.waiting and not self._signaled:
            self._signaled = True
            self._lock.release()

    def wait_locked(self, outer: threading.Lock, timeout: float) -> None:
        """Wait up to ``timeout`` s for a signal, with ``outer`` (the scheduler's lock, held
        on entry and on return) released meanwhile."""
        self.waiting = True
        outer.release()
        got = False
        try:
            got = self._lock.acquire(timeout=timeout)
        finally:
            outer.acquire()
            self.waiting = False
            if got:
                self._signaled = False


@dataclass(eq=False)
class Actor:
    """One actor's state; every field is guarded by the scheduler's lock."""

    key: Key
    state: str
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
    wake: Wake = field(default_factory=Wake)  # its thread's wait for the turn
    # How the timeline and errors name it ("rank 0", "rank 1 callbacks (level 1)"): a step's
    # record reads it at every decision.
    label: str = field(init=False)
    rank: int = field(init=False)

    def __post_init__(self) -> None:
        rank, level = self.key
        self.rank = rank
        if level < 0:
            self.label = f"rank {rank}"
        else:
            self.label = f"rank {rank} callbacks" + (f" (level {level})" if level else "")

    @property
    def is_lane(self) -> bool:
        return self.key[1] >= 0

    @property
    def thread(self) -> threading.Thread | None:
        return None if self.probe is None else self.probe.thread

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
    tensors: Tensors
    complete: Callable[[], None]
