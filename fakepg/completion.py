"""Each rank's completion threads: where the done-callbacks of its collectives run.

In a deployment, each process completes its own futures on a progress thread of its own, so
one rank's callbacks never wait behind another rank's. The fake world does the same: a
collective that finishes posts each rank's callbacks to that rank's *lane*, and the lane runs
them on a thread of the rank's own. See Note [Completion lanes].

# Guarantees: ``post_locked`` is called with ``Completions.lock`` held (the collective holds it
# while it publishes ``done``), never blocks on a callback and never takes another lock. A
# lane runs its callbacks one at a time, in the order they were posted. ``current_lane`` and
# ``count_issue_locked`` are safe from any thread. ``close`` is called once by the owner (the
# world): it lets every lane deliver what is queued, joins every thread with a deadline, and
# returns the threads still alive after it. Lock order: the world's lock, a collective's lock,
# then ``Completions.lock``, then the timer's (a stall check is armed under it); a lane never
# calls out (a callback, the world) while holding it.

# Note [Completion lanes]
# A collective's done-callbacks for rank r (its torch future's ``then`` chains, ``add_done_
# callback``s) run on rank r's own completion thread, never on the thread that moved the data
# and never on another rank's. A callback may therefore block, e.g. wait for a collective that
# the other ranks issue from their own callbacks (torch's PowerSGD hook does), while the other
# ranks' callbacks run.
#
# Each rank has one lane per nesting level. A collective issued from the rank's own threads
# completes on its level-0 lane; one issued from a callback running on level k completes on
# level k + 1. Within a lane, callbacks run one at a time, in the order the collectives
# completed (the order ``done`` was set, which is the same for every rank, so callbacks that
# issue collectives issue them in the same order everywhere). A callback that waits for a
# collective it issued itself thus never waits behind itself. What it must not do is wait for
# something its own lane would deliver later (a collective of the same level that completes
# after it, a lock or an event that only a later callback releases): that stalls the lane.
#
# Stalls. A lane whose current callback has run for the world's timeout while no collective it
# issued is unfinished (those have deadlines of their own: see Note [Every collective has a
# deadline] in fakepg.world) is stuck: the world is aborted with an error naming the rank and
# the collective whose callback it is; the stuck thread is asked to stop (``CallbackStopped``
# is raised into it, which ends a callback blocked in Python code, and fails its future); and
# the lane goes on with a fresh thread, so that everything queued behind is still delivered
# and every waiter wakes, with its result or the abort's error. A callback blocked in a C call
# cannot be interrupted; its thread is left behind (a daemon), and ``close`` returns it.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from . import _threads
from ._homes import Home
from .executor import Timer
from .faults import interrupt_thread
from .schedule import _Scheduler

__all__: list[str] = []

# _local.lane: the lane whose thread this is (absent on every other thread).
_local = threading.local()

# What the owner is told: the rank, the collective whose callback it is, and the error the
# callback raised, or None for a stall.
FailureHandler = Callable[[int, str, BaseException | None], None]


class CallbackStopped(BaseException):
    """Raised into a completion thread whose callback was declared stuck: a callback blocked
    in Python code unwinds, and the future it was completing fails instead of hanging."""


@dataclass(slots=True)
class _Item:
    run: Callable[[], None]
    what: str  # the collective whose callbacks these are: "allreduce #3 (op=SUM)"


class Lane:
    """Rank ``rank``'s callbacks of the collectives issued at nesting ``level``, run in order
    on one thread at a time. Fields are guarded by the owner's lock."""

    def __init__(self, owner: Completions, rank: int, level: int) -> None:
        self.owner = owner
        self.rank = rank
        self.level = level
        self.queue: deque[_Item] = deque()
        self.wake = threading.Condition(owner.lock)  # notified on post, replacement and close
        self.thread: _threads.Runner | None = None  # the one thread that takes from queue
        self.current: _Item | None = None  # what ``thread`` is running; None while idle
        self.quiet_since_ns = 0  # the current item's start, or its last collective's end
        # Whether the timer holds this lane's one stall check (see _watch_locked): one entry
        # per lane, not one per callback run.
        self.watched = False
        self.in_flight = 0  # collectives its callbacks issued that are not finished yet
        self.in_callback: set[_threads.Runner] = set()  # threads inside item.run now
        self.retired: list[_threads.Runner] = []  # replaced after a stall; joined at close


class Completions:
    """The completion lanes of one world's ranks, started on first use. See Note
    [Completion lanes]."""

    def __init__(
        self,
        name: str,
        *,
        timeout: float,
        timer: Timer,
        on_failure: FailureHandler,
        scheduler: _Scheduler | None = None,
    ) -> None:
        self._name = name
        # Under a controlled schedule, a lane takes its next callback only when chosen (see
        # Note [Controlled scheduling] in fakepg.schedule).
        self._scheduler = scheduler
        self._timeout_ns = int(timeout * 1e9)
        self._timer = timer
        self._on_failure = on_failure
        # lock guards every lane's fields, _lanes and _closed. A collective holds it while it
        # sets ``done`` and posts, so that lanes receive collectives in completion order.
        self.lock = threading.Lock()
        self._lanes: dict[tuple[int, int], Lane] = {}
        self._closed = False
        self._late: list[_threads.Runner] = []  # lane threads started after closing
        # Each rank's thread-local state, lent to its lanes' callbacks: set by the rank's
        # thread as its run starts, read by its lanes (see Note [Callbacks run in their rank]
        # in fakepg._homes). A dict item's assignment and read are atomic.
        self.homes: dict[int, Home] = {}

    def current_lane(self) -> Lane | None:
        """The lane whose callback the calling thread is running, if it is one of ours."""
        lane: Lane | None = getattr(_local, "lane", None)
        return lane if lane is not None and lane.owner is self else None

    def count_issue_locked(self, lane: Lane) -> None:
        """A callback on ``lane`` issued a collective: the lane is not stuck while it is in
        flight (it has a deadline of its own). Undone by ``collective_finished_locked``."""
        lane.in_flight += 1

    def collective_finished_locked(self, lane: Lane, now_ns: int) -> None:
        lane.in_flight -= 1
        lane.quiet_since_ns = now_ns

    def post_locked(self, rank: int, level: int, run: Callable[[], None], what: str) -> None:
        """Queue ``run`` on rank ``rank``'s lane of ``level``; start its thread if needed."""
        lane = self._lanes.get((rank, level))
        if lane is None:
            lane = self._lanes[(rank, level)] = Lane(self, rank, level)
        lane.queue.append(_Item(run, what))
        if self._scheduler is not None:
            self._scheduler.lane_posted(rank, level, what)
        if lane.thread is None:
            # After close nothing should be posted (every collective is finished by then);
            # if something is, it still runs, on a thread that ends once the queue is empty.
            self._start_locked(lane)
        else:
            lane.wake.notify()

    def _start_locked(self, lane: Lane) -> None:
        thread = _threads.Job(
            target=self._work,
            args=(lane,),
            name=f"{self._name}-rank{lane.rank}-completion{lane.level}",
        )
        lane.thread = thread
        lane.current = None
        if self._closed:
            self._late.append(thread)
        thread.start()

    def _work(self, lane: Lane) -> None:
        _local.lane = lane  # cleared at the end: see Note [Thread-local state of cached threads]
        me = _threads.current()
        scheduler = self._scheduler
        try:
            while True:
                with self.lock:
                    while lane.thread is me and not lane.queue and not self._closed:
                        lane.wake.wait()  # idle: woken by a post or by close
                    if lane.thread is not me:
                        return  # replaced after a stall: the new thread has the queue
                    if not lane.queue:
                        lane.thread = None  # closed and drained
                        return
                    if scheduler is not None and scheduler.active:
                        self.lock.release()  # wait for the turn without the lanes' lock
                        try:
                            scheduler.lane_acquire(lane.rank, lane.level)
                        finally:
                            self.lock.acquire()
                        if lane.thread is not me or not lane.queue:
                            continue  # replaced meanwhile
                    item = lane.queue.popleft()
                    lane.current = item
                    lane.quiet_since_ns = time.perf_counter_ns()
                    lane.in_callback.add(me)
                    self._watch_locked(lane, lane.quiet_since_ns + self._timeout_ns)
                error: BaseException | None = None
                home = self.homes.get(lane.rank)
                try:
                    with home.lent() if home is not None else contextlib.nullcontext():
                        item.run()
                except CallbackStopped:
                    pass  # declared stuck: the world was told (see _check)
                except BaseException as exc:  # a done-callback must not raise
                    error = exc
                with self.lock:
                    lane.in_callback.discard(me)
                    if lane.thread is me:
                        lane.current = None
                if scheduler is not None:
                    # After the item is over: deciding what runs next (it may wait for actors
                    # outside to settle) is not the callback's time, for the stall check.
                    scheduler.lane_release()
                if error is not None:
                    self._on_failure(lane.rank, item.what, error)
        except CallbackStopped:
            return  # arrived after the callback had returned: this thread was retired anyway
        finally:
            _local.lane = None

    # ---------------------------------------------------------------------------------------
    # Stalls. See Note [Completion lanes].

    def _watch_locked(self, lane: Lane, at_ns: int) -> None:
        """Have the lane checked at ``at_ns``, unless a check is due already (it looks at
        whatever item runs then, and re-arms for it)."""
        if lane.watched:
            return
        with contextlib.suppress(RuntimeError):  # closing: close() bounds what is left
            self._timer.call_at(at_ns, lambda: self._check(lane))
            lane.watched = True

    def _check(self, lane: Lane) -> None:
        """On the timer thread: has the lane's current item been quiet (no collective of its
        own in flight) for the timeout?"""
        now = time.perf_counter_ns()
        with self.lock:
            lane.watched = False
            if lane.current is None or self._closed:
                return  # idle (the next item arms a check) or closing (close() bounds it)
            if lane.in_flight > 0:
                self._watch_locked(lane, now + self._timeout_ns)
                return
            if now - lane.quiet_since_ns < self._timeout_ns:
                self._watch_locked(lane, lane.quiet_since_ns + self._timeout_ns)
                return
            what = lane.current.what
            stuck = self._replace_locked(lane)
        self._on_failure(lane.rank, what, None)
        self._stop(lane, stuck)

    def _replace_locked(self, lane: Lane) -> _threads.Runner:
        """Give the lane a fresh thread; return the stuck one (it exits once its callback
        returns, if ever)."""
        stuck = lane.thread
        assert stuck is not None
        lane.retired.append(stuck)
        self._start_locked(lane)
        return stuck

    def _stop(self, lane: Lane, stuck: _threads.Runner) -> None:
        # Under the lock, so that a thread that has left the callback (it needs the lock to
        # say so) is never interrupted in the lane's own code.
        with self.lock:
            if stuck in lane.in_callback:
                interrupt_thread(stuck, CallbackStopped)

    # ---------------------------------------------------------------------------------------

    def close(self, grace: float) -> list[_threads.Runner]:
        """Deliver what is queued, then stop and join every lane thread. A lane still busy
        after ``grace`` seconds is treated as stuck (its thread interrupted, the rest of its
        queue delivered by a fresh thread, joined for ``grace`` more). Returns the threads
        still alive."""
        with self.lock:
            if self._closed:
                return []
            self._closed = True
            lanes = list(self._lanes.values())
            # Taken in the same hold of the lock that closes: a lane thread sees ``_closed``
            # only under the lock, after this, and then clears ``lane.thread`` before its job
            # ends (the per-thread resets run after). Read later, a lane could already say
            # None while its thread still runs, and close would return with it alive.
            running = [thread for lane in lanes for thread in self._threads_locked(lane)]
            for lane in lanes:
                lane.wake.notify_all()
        me = _threads.current()
        deadline = time.monotonic() + grace
        for thread in running:
            if thread is not me:
                thread.join(max(0.0, deadline - time.monotonic()))
        for lane in lanes:
            with self.lock:
                busy = lane.thread
                if busy is None or busy is me or not busy.is_alive():
                    continue
                stuck = self._replace_locked(lane)
            self._stop(lane, stuck)
        deadline = time.monotonic() + grace
        with self.lock:
            # Every thread started since closing (replacements, a post after close) is in
            # _late: one that drained its queue has cleared ``lane.thread`` already.
            last = [
                *running,
                *self._late,
                *(t for lane in lanes for t in self._threads_locked(lane)),
            ]
        left = []
        for thread in dict.fromkeys(last):  # each once, in order
            if thread is not me:
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    left.append(thread)
        return left

    @staticmethod
    def _threads_locked(lane: Lane) -> list[_threads.Runner]:
        return [*lane.retired, *([lane.thread] if lane.thread is not None else [])]
