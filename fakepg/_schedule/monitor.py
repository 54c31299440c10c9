"""The monitor of a scheduled run: a holder blocked where no point sees it (torch's C++ DDP
waiting for its buckets' futures inside backward) is found by looking at its thread, and the
monitor decides in its place. See Note [Blocked outside the scheduler] in
:mod:`fakepg.schedule`.

# Note [How often the monitor looks]
# Right after a hand-over the monitor looks at the new holder soon (_FIRST_LOOK_S: a hand-over
# wakes the monitor if its next look is due later than that). While the holder runs, it looks
# less and less often (doubling up to _LAST_LOOK_S: a holder that computes long costs few
# wakes, each of which takes the GIL from it). Once a look shows it asleep at a blocking site,
# the next look, which confirms it, comes _CONFIRM_S later; but not while it keeps running
# between such looks (a thread that often waits for the GIL, which a look takes: looks every
# _CONFIRM_S would slow it down tenfold). So a holder that blocks is taken for outside about
# 0.1 + 0.1 ms after it blocks on an idle machine, or the last interval plus that after a
# long computation. An outside actor that may have woken is looked at the same way until it
# parks at a point or is asleep again for _LOOKS_TO_SETTLE looks. Looking is what costs, not
# waiting: a look takes a few microseconds (Note [A look at a thread]).
#
# Waking costs too, even where the monitor does not look: a wake takes the GIL from the
# holder, and a run whose points come every few tens of microseconds (the fake world alone)
# moves to another holder before each look is due, so most wakes are wasted; with a thread
# started, woken and joined per run besides, they cost such a run a third of its time. A
# process's runs are alike (a property replays one check hundreds of times), so after a run
# that took nobody outside, the next starts without a monitor thread: each hand-over arms
# one entry on the world's timer (if none is armed), and only a holder that has held the turn
# for _LAZY_START_NS (1 ms) starts the thread, which then looks as above. A run that takes a holder
# outside has its thread from the start in the next run. So a run that blocks outside after
# runs that did not is seen about 1 ms late, once; only timing depends on this, never a
# decision (see Note [Blocked outside the scheduler]).

# Note [A holder that never comes back]
# A holder that neither reaches a point nor looks blocked for the world's timeout (blocked
# where no look recognizes it, or computing that long) would hold every other actor, and,
# at one rank with nobody else waiting for the turn, the whole run, for ever. The monitor
# then reports it as a deadlock of the schedule (the others' waits for the turn do the same
# after the same timeout), which aborts the world and fails every unfinished collective.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from fakepg import _threads

from .actors import OUTSIDE, RUNNING, Actor
from .probe import Sample, asleep, stalled


class Scheduler(Protocol):
    """What the monitor reads and calls of its scheduler (fakepg._schedule.scheduler), named
    here so that the scheduler imports the monitor and not the other way round."""

    @property
    def active(self) -> bool: ...

    @property
    def holder(self) -> Actor | None: ...

    @property
    def generation(self) -> int: ...

    def serves(self, run: int) -> bool: ...

    def actors(self) -> Iterator[Actor]: ...

    def taken_outside_locked(self, holder: Actor) -> None: ...

    def decide_for_outside(self) -> None: ...

    def holder_stuck(self, holder: Actor, held: float) -> None: ...


_FIRST_LOOK_S = 0.0001
_LAZY_START_NS = 1_000_000  # a holder held this long starts the monitor thread (lazy start)
_CONFIRM_S = 0.0001
_LAST_LOOK_S = 0.001
_LOOKS_TO_STALL = 2
_LOOKS_TO_SETTLE = 3
_IDLE_LOOK_S = 0.05  # nobody holds the turn: only the end of the run to notice

# Whether the last run that ended with a monitor thread in this process took a holder
# outside (see Note [How often the monitor looks]); written by that thread as its run ends,
# read as the next run starts. A run without a thread leaves it False, as it found it. A
# lone bool: its reads and writes are atomic.
_last_run_outside = True


def _next_look(interval: float, samples: list[Sample]) -> float:
    """Soon if the last look found the thread asleep at a blocking site for the first time, or
    again without having run; else (it runs, or it ran between two such looks) later."""
    last = samples[-1]
    previous = samples[-2] if len(samples) > 1 else None
    if asleep(last) and (previous is None or not asleep(previous) or previous[2] == last[2]):
        return _CONFIRM_S
    return min(2 * interval, _LAST_LOOK_S)


def _look(actor: Actor) -> Sample:
    probe = actor.probe
    if probe is None:
        return (None, "?", None)
    return probe.look(actor.samples[-1] if actor.samples else None)


class Monitor:
    """One scheduler's monitor thread (one per run) and its waits for outside actors. Every
    method ending in ``_locked`` is called with the scheduler's lock held."""

    def __init__(
        self,
        sched: Scheduler,
        lock: threading.Lock,
        *,
        timeout: float,
        call_at: Callable[[int, Callable[[], None]], None],
    ) -> None:
        self._sched = sched
        self._timeout = timeout
        self._call_at = call_at  # the world's timer (perf_counter_ns deadlines)
        self._cond = threading.Condition(lock)  # the waits of deciders for outside actors
        self._watch_cond = threading.Condition(lock)  # the monitor thread's own waits
        self._look_due = math.inf  # when the monitor thread looks next (monotonic)
        # Guarded by the lock: the run served, its thread (None until started), and, while
        # it has none (see Note [How often the monitor looks]), when the holder was handed
        # the turn and whether a timer entry will look at it.
        self._run = 0
        self._job: _threads.Job | None = None
        self._handed_ns = 0
        self._armed = False

    def start_locked(self, run: int) -> None:
        """Run ``run`` begins: start its thread now, or once a holder holds long."""
        self._run, self._job, self._armed = run, None, False
        if _last_run_outside:
            self._start_thread_locked()

    def _start_thread_locked(self) -> None:
        # On a kept thread (fakepg._threads): starting a thread per run cost more than the
        # run's hand-overs on a busy machine (Thread.start waits for the new thread to run).
        job = _threads.Job(target=self._watch, args=(self._run,), name="fakepg-schedule-monitor")
        self._job = job
        job.start()

    def _arm_locked(self, at_ns: int) -> None:
        try:
            self._call_at(at_ns, functools.partial(self._due, self._run))
        except RuntimeError:
            return  # the world is closing: nothing is left to watch
        self._armed = True

    def _due(self, run: int) -> None:
        """On the timer's thread: start the run's thread if the holder has held the turn
        for _LAZY_START_NS; else look again when it will have."""
        with self._cond:
            self._armed = False
            if not self._sched.serves(run) or self._job is not None:
                return
            if self._sched.holder is None:
                return  # the next hand-over arms again
            due = self._handed_ns + _LAZY_START_NS
            if time.perf_counter_ns() < due:
                self._arm_locked(due)
            else:
                self._start_thread_locked()

    def join(self, timeout: float) -> None:
        job = self._job
        if job is not None and job is not _threads.current():
            job.join(timeout)

    def wake_locked(self) -> None:
        """Something the monitor may wait for happened: an outside actor came back, or the run
        stopped."""
        self._cond.notify_all()
        self._watch_cond.notify_all()

    def handed_locked(self) -> None:
        """The turn was handed over: the new holder is looked at soon (see Note [How often the
        monitor looks]); a wake only where the next look is due later than that. Without a
        thread yet, a timer entry looks at the holder later, if none is armed."""
        if self._job is None:
            self._handed_ns = time.perf_counter_ns()
            if not self._armed:
                self._arm_locked(self._handed_ns + _LAZY_START_NS)
        elif self._look_due > time.monotonic() + _FIRST_LOOK_S:
            self._watch_cond.notify_all()

    def _watch(self, run: int) -> None:
        """The monitor of run ``run``: look at a holder that does not come back; decide in its
        place once it is blocked outside. Ends with the run (end, abort, close)."""
        global _last_run_outside
        sched = self._sched
        took_outside = False
        interval, seen = _FIRST_LOOK_S, -1
        handed_at = time.monotonic()
        while True:
            stuck: tuple[Actor, float] | None = None
            with self._cond:
                if not sched.serves(run):
                    _last_run_outside = took_outside
                    return
                gen, holder = sched.generation, sched.holder
                if gen != seen:
                    interval, handed_at = _FIRST_LOOK_S, time.monotonic()
                elif holder is not None and holder.samples:
                    interval = _next_look(interval, holder.samples)
                seen = gen
                # Woken by a hand-over only where this wait is long (handed_locked): the
                # generation says whether the holder moved since.
                wait = interval if holder is not None else _IDLE_LOOK_S
                self._look_due = time.monotonic() + wait
                self._watch_cond.wait(wait)
                self._look_due = math.inf
                if not sched.active or holder is None or gen != sched.generation:
                    continue
                if holder is not sched.holder or holder.state != RUNNING:
                    continue
                held = time.monotonic() - handed_at
                if held > self._timeout:
                    # See Note [A holder that never comes back].
                    stuck = (holder, held)
                else:
                    holder.samples.append(_look(holder))
                    if not stalled(holder.samples, _LOOKS_TO_STALL):
                        continue
                    holder.stalled_at = holder.samples[-1]
                    sched.taken_outside_locked(holder)
                    took_outside = True
            if stuck is not None:
                sched.holder_stuck(*stuck)
                return
            sched.decide_for_outside()

    def settle_locked(self, timeout: float) -> bool:
        """Before a decision: every outside actor has parked at a point or is blocked again.
        False if nobody was outside (the lock was held throughout); True if it may have been
        released meanwhile.

        Passes over the outside actors repeat until one passes with no arrival: an actor that
        comes back may wake another that an earlier pass had seen blocked (a callback that
        returns completes the future a rank waits for in C++)."""
        sched = self._sched
        if not any(actor.state == OUTSIDE for actor in sched.actors()):
            return False  # the common case: nobody was taken outside
        deadline = time.monotonic() + timeout
        while sched.active and time.monotonic() < deadline:
            arrived = False
            for actor in sched.actors():
                if actor.state != OUTSIDE or actor.probe is None:
                    continue
                if actor.probe.still_stalled(actor.stalled_at):
                    continue
                actor.samples.clear()
                interval = _CONFIRM_S
                while sched.active and time.monotonic() < deadline:
                    self._cond.wait(interval)
                    if actor.state != OUTSIDE:
                        arrived = True
                        break
                    actor.samples.append(_look(actor))
                    if stalled(actor.samples, _LOOKS_TO_SETTLE):
                        actor.stalled_at = actor.samples[-1]
                        break
                    interval = _next_look(interval, actor.samples)
            if not arrived:
                return True
        return True

    def wait_for_outside_locked(self, timeout: float) -> bool:
        """No option: if some actor is outside, wait (up to ``timeout``) for it to come back.
        True if one did (decide again)."""
        sched = self._sched
        outside = [a for a in sched.actors() if a.state == OUTSIDE]
        if not outside:
            return False
        deadline = time.monotonic() + timeout
        while sched.active and time.monotonic() < deadline:
            if any(a.state != OUTSIDE for a in outside):
                return True
            self._cond.wait(0.01)
        return False
