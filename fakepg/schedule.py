"""A controlled scheduler for a fake world: races as values, repeatable and shrinkable.

With ``World(n, schedule=Schedule(choices))`` the ranks' threads still exist, but only one of
them runs at a time between *scheduling points*: where a rank issues a collective, waits for
one (``Work.wait``, a torch work's ``wait``, any torch future's ``wait``), returns, and where
a done-callback (a torch future's ``then`` chain) starts and ends. At each point the scheduler
lists what may happen next (the thread that reached it goes on, another thread resumes, a
collective whose ranks have all issued it completes, a rank's next callback runs) and a
*choice sequence* picks one. The same choices give the same order, so a race fails every time
its schedule is replayed, and Hypothesis can draw the choices and shrink them (see
``reducer.testing.schedules``). See Note [Controlled scheduling].

    import fakepg, torch
    def step(pg):
        t = torch.ones(2)
        work = pg.allreduce([t])
        t.div_(pg.size())          # races the in-flight allreduce
        work.wait()
        return t
    schedule = fakepg.Schedule([0, 1])   # after rank 0's issue, rank 1 runs: it divides
                                         # before the data moves, rank 0 after
    fakepg.run(step, 2, schedule=schedule)
    print(schedule.format())       # the timeline: rank, event, collective, tensors

# Guarantees: a Schedule belongs to one world at a time; its timeline is written by the
# scheduler (one thread at a time, under its lock) and read after the run. Every method of
# _Scheduler is safe from any thread. Lock order: the world's lock, a collective's lock, the
# completions' lock, then the scheduler's lock; the scheduler never calls out (a completion,
# the world) while holding its lock. Every wait for the baton has the world's timeout, and an
# abort (any failure in the world) releases every thread at once.

# Note [Controlled scheduling]
# *Actors* are the things that run: each rank's own thread (its autograd included: see Note
# [Each rank runs its own backward] in fakepg.world), and each rank's completion lanes (see
# Note [Completion lanes] in fakepg.completion). One actor holds the *baton*; the others wait
# on conditions of their own. The holder gives it up only at a point, where it decides, under
# the scheduler's lock, what happens next, from the options in a fixed order:
#   1. the holder itself goes on, from a point it passes (an issue);
#   2. a collective that every rank has issued completes (its data moves now, on the deciding
#      thread, and its callbacks are posted to the ranks' lanes), oldest first;
#   3. a rank's lane runs its next callback, oldest posted first;
#   4. an actor resumes (one parked at a point, or one waiting for something now done, the
#      holder included), in rank order.
# The choice sequence indexes that list (value modulo its length; a point with one option
# uses no choice; past its end every choice is 0). All zeros is the *natural* order: each
# thread runs until it must wait, then collectives complete, then callbacks run, so a schedule
# that shrinks to a few non-zero choices names the few switches that break the code. The
# *adversarial* order puts completions last (as late as allowed), other actors before
# callbacks, and callbacks newest first (reordered), for code that forgets to wait.
# What the options are depends only on what happened before (nothing is timed), so the
# decisions replay exactly. With no option left while some actor still waits, the code
# deadlocks under this schedule: the world is aborted with a ScheduleDeadlock that shows what
# each actor waits for and its stack.

# Note [Blocked outside the scheduler]
# A thread may block where no point sees it: torch's C++ DDP waits for a comm hook's future in
# C++, this project's DDP on a threading.Event. Holding the baton, it would stall the world.
# A monitor thread therefore samples a holder that has not reached a point: when its innermost
# Python frame is such a wait (a wait of the threading module, not a thread's start nor this
# module's own; autograd's engine running backward) and stays the same, and the OS shows the
# thread sleeping without having run between two looks (Linux /proc; elsewhere the frame
# alone, sampled longer), it is *outside*: the monitor decides in its place and the world
# goes on. An outside thread that a later event wakes (a callback completes its future)
# parks at its next point; before each decision that follows a segment of code, the scheduler
# waits until every outside thread has either parked or is seen blocked again, so that the
# options do not depend on how fast it woke. This is a sampling heuristic: decisions stay
# exact as long as an outside thread can move only when the world does. A thread sleeping
# elsewhere (``time.sleep``, a lock of its own) is only slow: the others wait for it, up to the
# world's timeout, which then reports it with every rank's stack.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import torch

from .faults import FakePGError

__all__ = ["Schedule", "ScheduleDeadlock", "ScheduleEvent"]

_THIS_FILE = os.path.abspath(__file__)
_FAKEPG_DIR = os.path.dirname(_THIS_FILE)

# Actor states.
_READY = "ready"  # parked at a point; may go on
_RUNNING = "running"  # holds the baton
_BLOCKED = "blocked"  # parked in a wait; may go on once its predicate holds
_OUTSIDE = "outside"  # blocked where no point sees it (Note [Blocked outside the scheduler])
_IDLE = "idle"  # a lane between callbacks
_DONE = "done"  # a rank thread that returned

# Sampling of a holder that does not come back (Note [Blocked outside the scheduler]).
_TICK_S = 0.0005  # between the samples of an outside actor that may have woken
_FIRST_TICK_S = 0.0002  # the monitor's first look at a holder, doubling up to the last
_LAST_TICK_S = 0.002
_SAMPLES_TO_STALL = 2
_SAMPLES_TO_SETTLE = 3


class ScheduleDeadlock(FakePGError):
    """Under the controlled schedule no actor can move while some still wait: the user's code
    deadlocks on this schedule. The message shows what each waits for, and its stack."""


@dataclass(frozen=True, slots=True)
class ScheduleEvent:
    """One line of a schedule's timeline.

    ``actor``: "rank 0", "rank 1 callbacks" (a completion lane; nested ones add the level),
    or "world" (a completion). ``event``: "issue", "wait", "resume", "complete", "callback",
    "return", "blocked outside". ``collective``: as errors name it (``allreduce #3
    (op=SUM)``), with ``tensors`` what it moves (``float32[12]``). ``choice``: (the option
    taken, how many there were) where this step was a choice, else None.
    """

    actor: str
    rank: int | None
    event: str
    collective: str = ""
    tensors: str = ""
    choice: tuple[int, int] | None = None


class Schedule:
    """What decides a scheduled world's order: a choice sequence and a policy.

    ``choices``: non-negative ints, one per point with more than one option (taken modulo
    the number of options; past the end, 0), or a mapping from such a point's number to its
    choice (the others 0): ``Schedule({11: 1})`` is ``Schedule([0] * 11 + [1])``, and is how
    a schedule prints. ``adversarial``: order the options so that the
    default runs threads before completing anything and callbacks newest first (see Note
    [Controlled scheduling]). After a run, :attr:`timeline` holds what happened and
    :attr:`used` how many choices were consumed; :meth:`format` prints it.
    """

    def __init__(
        self, choices: Sequence[int] | Mapping[int, int] = (), *, adversarial: bool = False
    ) -> None:
        raw: object = choices
        if isinstance(raw, Mapping):
            choices = _dense(raw)
        elif isinstance(raw, str | bytes) or not isinstance(raw, Sequence):
            raise ValueError(f"Schedule: choices must be a sequence of ints, got {choices!r}")
        for i, c in enumerate(choices):
            if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                raise ValueError(f"Schedule: choices[{i}] must be an int >= 0, got {c!r}")
        if not isinstance(adversarial, bool):
            raise ValueError(f"Schedule: adversarial must be a bool, got {adversarial!r}")
        self.choices = tuple(choices)
        self.adversarial = adversarial
        self.timeline: list[ScheduleEvent] = []
        self.used = 0

    def format(self, *, last: int | None = None) -> str:
        """The timeline as a table, one event a line; ``last``: only the last that many. A
        step that a choice decided shows ``<- option i of n``."""
        events = self.timeline if last is None else self.timeline[-last:]
        skipped = len(self.timeline) - len(events)
        width = max([len(e.actor) for e in events] + [5])
        lines = [f"{'step':>4}  {'actor':<{width}}  {'event':<15} collective (tensors)"]
        if skipped:
            lines.append(f"{'':>4}  ({skipped} earlier steps)")
        for i, e in enumerate(events, start=skipped):
            what = e.collective + (f" {e.tensors}" if e.tensors else "")
            mark = f"   <- choice: option {e.choice[0]} of {e.choice[1]}" if e.choice else ""
            lines.append(f"{i:>4}  {e.actor:<{width}}  {e.event:<15} {what}{mark}".rstrip())
        return "\n".join(lines)

    def __repr__(self) -> str:
        mode = ", adversarial=True" if self.adversarial else ""
        sparse = {i: c for i, c in enumerate(self.choices) if c}
        return f"Schedule({sparse!r}{mode})"


def _dense(sparse: Mapping[object, object]) -> list[int]:
    for key, value in sparse.items():
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise ValueError(f"Schedule: a choice's point must be an int >= 0, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"Schedule: the choice at point {key} must be an int >= 0, got {value!r}"
            )
    points = {int(k): int(v) for k, v in sparse.items()}  # type: ignore[call-overload]
    dense = [0] * (max(points) + 1 if points else 0)
    for point, choice in points.items():
        dense[point] = choice
    return dense


@dataclass(eq=False)
class _Actor:
    key: tuple[int, int]  # (rank, level): level -1 is the rank's own thread, k a lane
    state: str
    cond: threading.Condition
    pred: Callable[[], bool] | None = None
    waits_for: str = ""
    thread: threading.Thread | None = None
    # Lanes: the callbacks posted and not yet started, oldest first: (post number, what).
    posted: deque[tuple[int, str]] = field(default_factory=deque)
    # Samples of a holder that does not come back, or of an outside actor.
    samples: list[tuple[Any, str, int | None]] = field(default_factory=list)
    # The last sample that showed it blocked outside: while its CPU time has not grown since,
    # it has not run, so it is still blocked there (the fast path of _settle_locked).
    stalled_at: tuple[Any, str, int | None] | None = None

    @property
    def rank(self) -> int:
        return self.key[0]

    @property
    def is_lane(self) -> bool:
        return self.key[1] >= 0

    @property
    def label(self) -> str:
        rank, level = self.key
        if level < 0:
            return f"rank {rank}"
        return f"rank {rank} callbacks" + (f" (level {level})" if level else "")

    def runnable(self) -> bool:
        if self.state == _READY:
            return True
        return self.state == _BLOCKED and self.pred is not None and bool(self.pred())


@dataclass(eq=False, slots=True)
class _Ready:
    """A collective every rank has issued, waiting for a decision to complete it."""

    what: str
    tensors: str
    complete: Callable[[], None]


# Which scheduler and actor the calling thread is (absent on every other thread).
_local = threading.local()


def current_scheduler() -> _Scheduler | None:
    """The scheduler controlling the calling thread, while it controls it."""
    sched: _Scheduler | None = getattr(_local, "scheduler", None)
    return sched if sched is not None and sched.active else None


def wait_event(event: threading.Event, timeout: float, what: str) -> bool:
    """``event.wait(timeout)``, as a scheduling point on a controlled thread."""
    sched = current_scheduler()
    if sched is not None and not event.is_set():
        sched.block(event.is_set, "wait", what)
    return event.wait(timeout)


class _Scheduler:
    """One world's controlled scheduler. See Note [Controlled scheduling]."""

    def __init__(
        self,
        schedule: Schedule,
        world_size: int,
        *,
        timeout: float,
        on_deadlock: Callable[[int, BaseException], None],
    ) -> None:
        self.schedule = schedule
        self._world_size = world_size
        self._timeout = timeout
        self._on_deadlock = on_deadlock
        # _lock guards every field below and every actor's fields.
        self._lock = threading.Lock()
        self._actors: dict[tuple[int, int], _Actor] = {}
        self._holder: _Actor | None = None
        self._ready: list[_Ready] = []
        self._posts = 0  # numbers the callbacks posted, for the lanes' order
        self._gen = 0  # bumped at each hand-over: the monitor's "has the holder moved?"
        self._active = False
        self._run = 0  # numbers the runs: a monitor serves one
        self._monitor: threading.Thread | None = None
        self._monitor_cond = threading.Condition(self._lock)
        self._quiet = threading.Condition(self._lock)  # notified when nobody holds the baton
        self._proc = os.path.isdir("/proc/self/task")

    @property
    def active(self) -> bool:
        return self._active

    # ---------------------------------------------------------------------------------------
    # The run: begin on the caller's thread, enter and leave on each rank's, end on the caller's.

    def begin(self) -> None:
        """Before the rank threads start: every rank is ready; the first decision is made."""
        with self._lock:
            self._active = True
            for rank in range(self._world_size):
                actor = self._actor_locked((rank, -1))
                actor.state = _READY
                actor.thread = None
            self._holder = None
            self._run += 1
            self._monitor = threading.Thread(
                target=self._watch, args=(self._run,), name="fakepg-schedule-monitor", daemon=True
            )
            self._monitor.start()
        self._switch(None, settle=False)

    def enter(self, rank: int) -> None:
        """On rank ``rank``'s thread, first thing: wait to be chosen."""
        actor = self._actors[(rank, -1)]
        _local.scheduler, _local.actor = self, actor
        with self._lock:
            actor.thread = threading.current_thread()
        self._await_baton(actor)

    def leave(self) -> None:
        """On a rank's thread, after its function returned (or raised)."""
        actor = self._me()
        _local.scheduler = _local.actor = None
        if actor is None:
            return
        with self._lock:
            if not self._active:
                return
            self._record_locked(actor, "return")
            was_outside = actor.state == _OUTSIDE
            actor.state = _DONE
            if was_outside or self._holder is not actor:
                self._monitor_cond.notify_all()  # an outside actor came back (see _settle)
                return
        self._switch(actor)

    def end(self) -> None:
        """After the rank threads ended: let pending callbacks run, then stop controlling."""
        deadline = time.monotonic() + self._timeout
        with self._lock:
            while self._active and self._holder is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._quiet.wait(left)
            self._active = False
            self._wake_all_locked()

    def abort(self) -> None:
        """Release every thread: from now on nothing is controlled (a failure wakes all)."""
        with self._lock:
            self._active = False
            self._wake_all_locked()

    def close(self) -> None:
        self.abort()
        monitor = self._monitor
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join(5.0)

    def _wake_all_locked(self) -> None:
        for actor in self._actors.values():
            actor.cond.notify_all()
        self._monitor_cond.notify_all()
        self._quiet.notify_all()

    # ---------------------------------------------------------------------------------------
    # Points, called by the world on controlled threads.

    def controls_current_thread(self) -> bool:
        return self._active and getattr(_local, "scheduler", None) is self

    def check_thread(self, what: str) -> None:
        """Refuse a collective issued, while this schedule runs, from a thread it does not
        control (its timing would decide the order again)."""
        if self._active and getattr(_local, "scheduler", None) is not self:
            raise FakePGError(
                f"fakepg: {what} was issued from thread {threading.current_thread().name!r}, "
                "which the world's schedule does not control; under a Schedule, issue "
                "collectives only from World.run's rank threads and their done-callbacks"
            )

    def issued(self, what: str, tensors: str, complete: Callable[[], None] | None) -> None:
        """The calling actor issued ``what``; ``complete``, if it was the last rank to, moves
        its data and finishes it when a decision says so."""
        actor = self._me()
        with self._lock:
            if not self._active or actor is None:
                controlled = False
            else:
                controlled = True
                self._record_locked(actor, "issue", what, tensors)
                if complete is not None:
                    self._ready.append(_Ready(what, tensors, complete))
                self._arrive_locked(actor, _READY)
        if not controlled or actor is None:
            if complete is not None:
                complete()
            return
        self._switch_or_park(actor)

    def block(self, pred: Callable[[], bool], event: str, what: str) -> None:
        """The calling actor waits until ``pred()``; returns once it holds, or once nothing is
        controlled any more (the caller then waits for real, with its own deadline)."""
        actor = self._me()
        with self._lock:
            if not self._active or actor is None:
                return
            if pred():
                return  # nothing to wait for: not a point
            self._record_locked(actor, event, what)
            actor.pred, actor.waits_for = pred, what
            self._arrive_locked(actor, _BLOCKED)
        self._switch_or_park(actor)

    def lane_posted(self, rank: int, level: int, what: str) -> None:
        """A callback was queued on rank ``rank``'s lane ``level`` (completions' lock held)."""
        with self._lock:
            if not self._active:
                return
            actor = self._actor_locked((rank, level))
            self._posts += 1
            actor.posted.append((self._posts, what))

    def lane_acquire(self, rank: int, level: int) -> None:
        """On the lane's thread, before it takes its next callback: wait to be chosen."""
        with self._lock:
            if not self._active:
                return
            actor = self._actor_locked((rank, level))
            actor.thread = threading.current_thread()
        _local.scheduler, _local.actor = self, actor
        self._await_baton(actor)

    def lane_release(self) -> None:
        """On the lane's thread, after its callback returned."""
        actor = self._me()
        _local.scheduler = _local.actor = None
        if actor is None:
            return
        with self._lock:
            if not self._active:
                return
            was_holder = self._holder is actor
            actor.state = _IDLE
            if not was_holder:
                self._monitor_cond.notify_all()
                return
        self._switch(actor)

    # ---------------------------------------------------------------------------------------
    # Deciding and handing over.

    def _me(self) -> _Actor | None:
        if getattr(_local, "scheduler", None) is not self:
            return None
        actor: _Actor | None = getattr(_local, "actor", None)
        return actor

    def _actor_locked(self, key: tuple[int, int]) -> _Actor:
        actor = self._actors.get(key)
        if actor is None:
            state = _IDLE if key[1] >= 0 else _READY
            actor = self._actors[key] = _Actor(key, state, threading.Condition(self._lock))
        return actor

    def _arrive_locked(self, actor: _Actor, state: str) -> None:
        if actor.state == _OUTSIDE:
            self._monitor_cond.notify_all()  # see _settle_locked
        actor.state = state
        actor.samples.clear()
        actor.stalled_at = None

    def _switch_or_park(self, actor: _Actor) -> None:
        """Decide if ``actor`` holds the baton; else (it came back from outside) park."""
        with self._lock:
            holds = self._holder is actor
        if holds:
            self._switch(actor)
        else:
            self._await_baton(actor)

    def _record_locked(
        self,
        actor: _Actor | None,
        event: str,
        what: str = "",
        tensors: str = "",
        choice: tuple[int, int] | None = None,
    ) -> None:
        label = "world" if actor is None else actor.label
        rank = None if actor is None else actor.rank
        self.schedule.timeline.append(ScheduleEvent(label, rank, event, what, tensors, choice))

    def _options_locked(self, me: _Actor | None) -> list[tuple[str, Any]]:
        # The holder goes on first only from a point it passes (an issue); once it waited, it
        # resumes among the others, after what completes meanwhile.
        goes_on = me is not None and me.state == _READY
        others = sorted(
            (
                a
                for a in self._actors.values()
                if (a.runnable() or self._orphaned_locked(a, me)) and not (a is me and goes_on)
            ),
            key=lambda a: a.key,
        )
        callbacks = sorted(
            (a for a in self._actors.values() if a.state == _IDLE and a.posted),
            key=lambda a: a.posted[0][0],
        )
        mine: list[tuple[str, Any]] = [("run", me)] if goes_on else []
        completes: list[tuple[str, Any]] = [("complete", r) for r in self._ready]
        runs: list[tuple[str, Any]] = [("run", a) for a in others]
        if self.schedule.adversarial:
            newest = sorted(callbacks, key=lambda a: -a.posted[-1][0])
            return mine + runs + [("callback", a) for a in newest] + completes
        return mine + completes + [("callback", a) for a in callbacks] + runs

    def _orphaned_locked(self, actor: _Actor, me: _Actor | None) -> bool:
        """``actor`` was handed the turn and has not been seen at a point since, but another
        decides now (the monitor took it for blocked outside, then it ran on): it waits for
        the turn, or runs uncontrolled, and may go on. Without this it could never be chosen,
        and a world with nothing else to run would be taken for a deadlock."""
        return actor.state == _RUNNING and actor is not self._holder and actor is not me

    def _choose_locked(self, n: int) -> tuple[int, tuple[int, int] | None]:
        """The option to take among ``n``, and (it, n) to show where it is not the natural
        one."""
        if n == 1:
            return 0, None
        s = self.schedule
        raw = s.choices[s.used] if s.used < len(s.choices) else 0
        s.used += 1
        index = raw % n
        return index, ((index, n) if index else None)

    def _switch(self, me: _Actor | None, *, settle: bool = True) -> None:
        """The holder ``me`` (None: the monitor, for an outside holder) is at a point: decide
        until an actor is handed the baton; then, if ``me`` may go on later, wait for it.
        ``settle``: first wait for outside actors that the segment just ended may have woken."""
        while True:
            with self._lock:
                if not self._active:
                    return
                if settle:
                    settle = False
                    self._settle_locked()
                    continue  # look again: the schedule may have stopped meanwhile
                options = self._options_locked(me)
                if not options:
                    if self._wait_for_outside_locked():
                        continue
                    done = all(a.state in (_DONE, _IDLE) for a in self._actors.values())
                    if done:
                        self._holder = None
                        self._quiet.notify_all()
                        return
                    rank, error = self._deadlock_locked("no actor can move")
                    deadlock = True
                else:
                    deadlock = False
                    index, choice = self._choose_locked(len(options))
                    kind, target = options[index]
                    if kind == "complete":
                        self._ready.remove(target)
                        self._record_locked(None, "complete", target.what, target.tensors, choice)
                    else:
                        self._hand_locked(me, target, kind, choice)
            if deadlock:
                self._on_deadlock(rank, error)
                return
            if kind != "complete":
                break
            target.complete()  # moves the data, posts callbacks; on this thread, no lock held
        if me is not None and me.state in (_READY, _BLOCKED, _RUNNING):
            self._await_baton(me)

    def _hand_locked(
        self, me: _Actor | None, target: _Actor, kind: str, choice: tuple[int, int] | None
    ) -> None:
        if kind == "callback":
            _, what = target.posted.popleft()
            self._record_locked(target, "callback", what, choice=choice)
        elif target is not me:
            event = "resume" if target.state == _BLOCKED else "run"
            self._record_locked(
                target, event, target.waits_for if event == "resume" else "", choice=choice
            )
        target.state = _RUNNING
        target.pred, target.waits_for = None, ""
        target.samples.clear()
        self._holder = target
        self._gen += 1
        target.cond.notify_all()

    def _await_baton(self, actor: _Actor) -> None:
        deadline = time.monotonic() + self._timeout
        with self._lock:
            while self._active and self._holder is not actor:
                left = deadline - time.monotonic()
                if left <= 0:
                    holder = self._holder
                    why = (
                        f"{actor.label} waited {self._timeout:g} s for its turn while "
                        f"{'nobody' if holder is None else holder.label} held it"
                    )
                    rank, error = self._deadlock_locked(why)
                    break
                actor.cond.wait(left)
            else:
                return
        self._on_deadlock(rank, error)

    # ---------------------------------------------------------------------------------------
    # Outside actors. See Note [Blocked outside the scheduler].

    def _watch(self, run: int) -> None:
        """The monitor of run ``run``: sample a holder that does not come back; decide in its
        place once it is blocked outside. Ends with the run (end, abort, close)."""
        tick, seen = _FIRST_TICK_S, -1
        while True:
            with self._lock:
                if not self._active or self._run != run:
                    return
                gen, holder = self._gen, self._holder
                # Look soon after a hand-over, then less and less often: a holder that blocks
                # is seen within about a millisecond, one that computes long costs few wakes.
                tick = _FIRST_TICK_S if gen != seen else min(2 * tick, _LAST_TICK_S)
                seen = gen
                # Not woken by hand-overs (that would cost a thread switch each): the
                # generation says whether the holder moved since.
                self._monitor_cond.wait(tick if holder is not None else 0.05)
                if not self._active or holder is None or gen != self._gen:
                    continue
                if holder is not self._holder or holder.state != _RUNNING:
                    continue
                holder.samples.append(self._sample(holder))
                if not self._stalled(holder, _SAMPLES_TO_STALL):
                    continue
                holder.state = _OUTSIDE
                holder.samples.clear()
                self._record_locked(holder, "blocked outside")
                self._holder = None
            self._switch(None)

    def _sample(self, actor: _Actor) -> tuple[Any, str, int | None]:
        """Where the actor's thread is (its innermost Python frame and instruction), its OS
        state ("S" sleeping, "R" running or runnable, ...) and its CPU time in ns (None where
        the OS does not say)."""
        thread = actor.thread
        if thread is None or thread.ident is None:
            return (None, "?", None)
        frame = current_frames().get(thread.ident)
        # Only where a thread may wait for the world without a point (see Note [Blocked
        # outside the scheduler]); elsewhere a sleeping thread is slow, not blocked.
        where = None if frame is None or not _blocking_site(frame) else (id(frame), frame.f_lasti)
        state, ran = "S", None
        if self._proc and thread.native_id is not None:
            task = f"/proc/self/task/{thread.native_id}"
            try:
                with open(f"{task}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
                with open(f"{task}/schedstat") as f:
                    ran = int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                state = "?" if state == "S" else state
        return (where, state, ran)

    def _stalled(self, actor: _Actor, count: int) -> bool:
        if not self._proc:
            count *= 3  # the frame alone says less: look longer
        samples = actor.samples[-count:]
        if len(samples) < count:
            return False
        first, ran = samples[0][0], samples[0][2]
        if first is None or not all(
            w == first and s in ("S", "D") and r == ran for w, s, r in samples
        ):
            return False
        actor.stalled_at = samples[-1]
        return True

    def _still_stalled(self, actor: _Actor) -> bool:
        """One look: asleep where it was last seen blocked, without having run since."""
        if actor.stalled_at is None or actor.stalled_at[2] is None:
            return False
        where, state, ran = self._sample(actor)
        return state in ("S", "D") and (where, ran) == (actor.stalled_at[0], actor.stalled_at[2])

    def _settle_locked(self) -> None:
        """Before a decision: every outside actor has parked at a point or is blocked again.

        Passes over the outside actors repeat until one passes with no arrival: an actor that
        comes back may wake another that an earlier pass had seen blocked (a callback that
        returns completes the future a rank waits for in C++)."""
        deadline = time.monotonic() + self._timeout
        while self._active and time.monotonic() < deadline:
            arrived = False
            for actor in list(self._actors.values()):
                if actor.state != _OUTSIDE or self._still_stalled(actor):
                    continue
                actor.samples.clear()
                while self._active and time.monotonic() < deadline:
                    self._monitor_cond.wait(_TICK_S)
                    if actor.state != _OUTSIDE:
                        arrived = True
                        break
                    actor.samples.append(self._sample(actor))
                    if self._stalled(actor, _SAMPLES_TO_SETTLE):
                        break
            if not arrived:
                return

    def _wait_for_outside_locked(self) -> bool:
        """No option: if some actor is outside, wait (up to the timeout) for it to come back.
        True if one did (decide again)."""
        outside = [a for a in self._actors.values() if a.state == _OUTSIDE]
        if not outside:
            return False
        deadline = time.monotonic() + self._timeout
        while self._active and time.monotonic() < deadline:
            if any(a.state != _OUTSIDE for a in outside):
                return True
            self._monitor_cond.wait(0.01)
        return False

    # ---------------------------------------------------------------------------------------
    # Deadlocks.

    def _deadlock_locked(self, why: str) -> tuple[int, ScheduleDeadlock]:
        frames = current_frames()
        lines = [
            f"fakepg: deadlock under the controlled schedule ({why}); after "
            f"{len(self.schedule.timeline)} steps and {self.schedule.used} choices of "
            f"{self.schedule!r}. What each waits for:"
        ]
        stuck = [a for a in self._actors.values() if a.state not in (_DONE, _IDLE)]
        for actor in sorted(stuck, key=lambda a: a.key):
            what = {
                _BLOCKED: f"waits for {actor.waits_for}",
                _OUTSIDE: "is blocked outside any collective (a lock, an event, a C++ wait)",
                _READY: "is ready",
                _RUNNING: "holds the turn",
            }[actor.state]
            lines.append(f"  {actor.label} {what}")
        lines.append("Stacks:")
        for actor in sorted(stuck, key=lambda a: a.key):
            thread = actor.thread
            frame = None if thread is None or thread.ident is None else frames.get(thread.ident)
            lines.append(f"  {actor.label} (thread {getattr(thread, 'name', '?')}):")
            if frame is None:
                lines.append("    (not started)")
                continue
            stack = [s for s in traceback.extract_stack(frame) if not _internal(s.filename)]
            lines.extend("    " + line.rstrip() for line in traceback.format_list(stack[-12:]))
        lines.append("The schedule so far (last 30 steps):")
        lines.append(self.schedule.format(last=30))
        rank = min((a.rank for a in stuck), default=0)
        return rank, ScheduleDeadlock("\n".join(lines))


# The innermost Python frames of a thread that waits without a scheduling point: a wait of
# the threading module (this project's DDP waits for a hook's future on an Event), and
# autograd's engine (torch's C++ DDP waits for its buckets' futures inside backward).
_ENGINE_FRAMES = frozenset({"_engine_run_backward", "run_backward"})


_THREADING_WAITS = frozenset({"wait", "acquire", "join", "_wait_for_tstate_lock"})


def _blocking_site(frame: FrameType) -> bool:
    code = frame.f_code
    if not code.co_filename.endswith("threading.py"):
        return code.co_name in _ENGINE_FRAMES
    if code.co_name not in _THREADING_WAITS:
        return False  # a thread's own start (_bootstrap...)
    # Not Thread.start waiting for the new thread to run (the world's timer starts so), and
    # not this module's own waits (a holder that was just handed the turn wakes from one).
    outer: FrameType | None = frame
    while outer is not None and outer.f_code.co_filename.endswith("threading.py"):
        if outer.f_code.co_name == "start":
            return False
        outer = outer.f_back
    return outer is None or os.path.abspath(outer.f_code.co_filename) != _THIS_FILE


def _internal(filename: str) -> bool:
    """Frames of the fake world and of threading: not what the user needs to see."""
    return os.path.dirname(os.path.abspath(filename)) == _FAKEPG_DIR or filename.endswith(
        "threading.py"
    )


def current_frames() -> dict[int, FrameType]:
    """``sys._current_frames()``, safe while other threads start.

    # Note [Reading every thread's frame]
    # On CPython before 3.12, sys._current_frames() holds the interpreter's thread-list lock
    # while it builds its dict, and the allocation can start a garbage collection whose
    # finalizers release the GIL; a thread being started meanwhile (a rank, the world's
    # timer) waits for that lock while it holds the GIL, and neither can go on: a hang of
    # every thread (CPython gh-106883). No collection starts while the collector is off.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


# -------------------------------------------------------------------------------------------
# torch futures: a Python-level wait on a controlled thread is a point. (torch.futures.Future
# is a Python subclass of torch._C.Future; then() returns the C++ type itself.)

_installed = False
_install_lock = threading.Lock()


def install_future_wait() -> None:
    """Make a Python-level wait on any torch future (``fut.wait()``, on the futures ``then``
    returns too) a scheduling point on controlled threads, and nothing else anywhere else.
    Process-wide and permanent; idempotent."""
    global _installed
    with _install_lock:
        if _installed:
            return
        future_type: Any = torch._C.Future
        original = future_type.wait

        def wait(self: Any) -> Any:
            sched = current_scheduler()
            if sched is not None and not self.done():
                sched.block(self.done, "wait", "a torch future")
            return original(self)

        wait.__doc__ = original.__doc__
        future_type.wait = wait
        _installed = True
