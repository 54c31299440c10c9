"""One world's controlled scheduler: the run's life on each thread, the points the world
calls, the decision at each point and the hand-over of the turn. See Note [Controlled
scheduling] in :mod:`fakepg.schedule`."""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fakepg.faults import FakePGError

from .actors import BLOCKED, DONE, IDLE, OUTSIDE, READY, RUNNING, Actor, Key, Ready
from .deadlock import deadlock
from .monitor import Monitor
from .timeline import Schedule, ScheduleDeadlock, Tensors

# Which scheduler and actor the calling thread is (absent on every other thread).
_local = threading.local()


def current_scheduler() -> Scheduler | None:
    """The scheduler controlling the calling thread, while it controls it."""
    sched: Scheduler | None = getattr(_local, "scheduler", None)
    return sched if sched is not None and sched.active else None


class Scheduler:
    """One world's controlled scheduler. See Note [Controlled scheduling]."""

    def __init__(
        self,
        schedule: Schedule,
        world_size: int,
        *,
        timeout: float,
        on_deadlock: Callable[[int, BaseException], None],
        call_at: Callable[[int, Callable[[], None]], None],
    ) -> None:
        self.schedule = schedule
        self._world_size = world_size
        self._timeout = timeout
        self._on_deadlock = on_deadlock
        # _lock guards every field below and every actor's fields.
        self._lock = threading.Lock()
        self._actors: dict[Key, Actor] = {}
        self._by_key: list[Actor] = []  # the same actors, in key order (rank, then level)
        self._holder: Actor | None = None
        self._ready: list[Ready] = []
        self._posts = 0  # numbers the callbacks posted, for the lanes' order
        self._gen = 0  # bumped at each hand-over: the monitor's "has the holder moved?"
        self._active = False
        self._run = 0  # numbers the runs: a monitor serves one
        self._monitor = Monitor(self, self._lock, timeout=timeout, call_at=call_at)
        self._quiet = threading.Condition(self._lock)  # notified when nobody holds the baton

    @property
    def active(self) -> bool:
        return self._active

    # What the monitor reads, with the lock held.

    @property
    def holder(self) -> Actor | None:
        return self._holder

    @property
    def generation(self) -> int:
        return self._gen

    def serves(self, run: int) -> bool:
        return self._active and self._run == run

    def actors(self) -> Iterator[Actor]:
        return iter(list(self._actors.values()))

    # ---------------------------------------------------------------------------------------
    # The run: begin on the caller's thread, enter and leave on each rank's, end on the caller's.

    def begin(self) -> None:
        """Before the rank threads start: every rank is ready; the first decision is made."""
        self.schedule.start()  # every run replays the schedule from its start
        with self._lock:
            self._active = True
            for rank in range(self._world_size):
                actor = self._actor_locked((rank, -1))
                actor.state = READY
                actor.probe = None
            self._holder = None
            self._run += 1
            self._monitor.start_locked(self._run)
        self._switch(None, settle=False)

    def enter(self, rank: int) -> None:
        """On rank ``rank``'s thread, first thing: wait to be chosen."""
        self._attach((rank, -1))

    def leave(self) -> None:
        """On a rank's thread, after its function returned (or raised)."""
        self._detach(DONE, "return")

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
        self.schedule.finish()

    def abort(self) -> None:
        """Release every thread: from now on nothing is controlled (a failure wakes all)."""
        with self._lock:
            self._active = False
            self._wake_all_locked()

    def close(self) -> None:
        self.abort()
        self._monitor.join(5.0)

    def _wake_all_locked(self) -> None:
        for actor in self._actors.values():
            actor.wake.signal_locked()
        self._monitor.wake_locked()
        self._quiet.notify_all()

    def _attach(self, key: Key) -> None:
        """The calling thread runs actor ``key`` now: wait to be chosen."""
        with self._lock:
            if not self._active:
                return
            actor = self._actor_locked(key)
            actor.attach(threading.current_thread())
            if actor.state == OUTSIDE:
                # Taken for blocked outside on its way here (a lane between its idle wait and
                # its next callback on a busy machine): it is back, at a point. Left outside,
                # it would wait for a turn nobody can give it (an outside actor is no option),
                # and the monitor's settle for it to block again, which it never does here.
                self._arrive_locked(actor, READY)
        _local.scheduler, _local.actor = self, actor
        self._await_baton(actor)

    def _detach(self, state: str, event: str | None) -> None:
        """The calling thread's actor ended what it ran (``state``: done, or an idle lane):
        if it held the turn, decide what runs next."""
        actor = self._me()
        _local.scheduler = _local.actor = None
        if actor is None:
            return
        with self._lock:
            if not self._active:
                return
            if event is not None:
                self._record_locked(actor, event)
            actor.state = state
            if self._holder is not actor:  # it ran outside: it came back (see settle)
                self._monitor.wake_locked()
                return
        self._switch(actor)

    # ---------------------------------------------------------------------------------------
    # Points, called by the world on controlled threads.

    def controls_current_thread(self) -> bool:
        return self._active and getattr(_local, "scheduler", None) is self

    def check_thread(self, what: Callable[[], str]) -> None:
        """Refuse a collective issued, while this schedule runs, from a thread it does not
        control (its timing would decide the order again). ``what()`` names it."""
        if self._active and getattr(_local, "scheduler", None) is not self:
            raise FakePGError(
                f"fakepg: {what()} was issued from thread {threading.current_thread().name!r}, "
                "which the world's schedule does not control; under a Schedule, issue "
                "collectives only from World.run's rank threads and their done-callbacks"
            )

    def issued(self, what: str, tensors: Tensors, complete: Callable[[], None] | None) -> None:
        """The calling actor issued ``what``; ``complete``, if it was the last rank to, moves
        its data and finishes it when a decision says so."""
        actor = self._me()
        with self._lock:
            controlled = self._active and actor is not None
            if controlled and actor is not None:
                self._record_locked(actor, "issue", what, tensors)
                if complete is not None:
                    self._ready.append(Ready(what, tensors, complete))
                self._arrive_locked(actor, READY)
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
            self._arrive_locked(actor, BLOCKED)
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
        self._attach((rank, level))

    def lane_release(self) -> None:
        """On the lane's thread, after its callback returned."""
        self._detach(IDLE, None)

    # ---------------------------------------------------------------------------------------
    # The monitor's part (see fakepg._schedule.monitor).

    def taken_outside_locked(self, holder: Actor) -> None:
        """The monitor saw the holder blocked outside: it gives up the turn."""
        holder.state = OUTSIDE
        holder.samples.clear()
        self._record_locked(holder, "blocked outside")
        self._holder = None

    def decide_for_outside(self) -> None:
        """On the monitor's thread, for the holder it took outside."""
        self._switch(None)

    def holder_stuck(self, holder: Actor, held: float) -> None:
        """On the monitor's thread: ``holder`` has held the turn ``held`` s, more than the
        world's timeout, without reaching a point. See Note [A holder that never comes
        back] in fakepg._schedule.monitor."""
        with self._lock:
            if not self._active or self._holder is not holder:
                return
            why = (
                f"{holder.label} held the turn {held:.3g} s without reaching a scheduling point "
                "or being seen blocked (a wait the scheduler does not recognize, or a "
                "computation longer than the world's timeout)"
            )
            rank, error = self._deadlock_locked(why)
        self._on_deadlock(rank, error)

    # ---------------------------------------------------------------------------------------
    # Deciding and handing over.

    def _me(self) -> Actor | None:
        if getattr(_local, "scheduler", None) is not self:
            return None
        actor: Actor | None = getattr(_local, "actor", None)
        return actor

    def _actor_locked(self, key: Key) -> Actor:
        actor = self._actors.get(key)
        if actor is None:
            state = IDLE if key[1] >= 0 else READY
            actor = self._actors[key] = Actor(key, state)
            bisect.insort(self._by_key, actor, key=lambda a: a.key)
        return actor

    def _arrive_locked(self, actor: Actor, state: str) -> None:
        if actor.state == OUTSIDE:
            self._monitor.wake_locked()  # see Monitor.settle_locked
        actor.arrive(state)

    def _switch_or_park(self, actor: Actor) -> None:
        """Decide if ``actor`` holds the baton; else (it came back from outside) park."""
        with self._lock:
            holds = self._holder is actor
            # Back from outside, it arrived while another held the turn, and that one has
            # since handed it the turn (the hand-over is the decision at this point): it
            # goes on. Deciding again here would leave itself out of the options (it holds
            # the turn, so it is not among those waiting for it), and with nothing else to
            # run the world would look deadlocked.
            handed = holds and actor.state == RUNNING
        if handed:
            return
        if holds:
            self._switch(actor)
        else:
            self._await_baton(actor)

    def _record_locked(
        self,
        actor: Actor | None,
        event: str,
        what: str = "",
        tensors: Tensors = "",
        choice: tuple[int, int] | None = None,
    ) -> None:
        if actor is None:
            self.schedule.record("world", None, event, what, tensors, choice)
        else:
            self.schedule.record(actor.label, actor.rank, event, what, tensors, choice)

    def _options_locked(self, me: Actor | None) -> list[tuple[str, Any]]:
        # The holder goes on first only from a point it passes (an issue); once it waited, it
        # resumes among the others, after what completes meanwhile. One pass over the actors
        # in key order (the decision runs at every point: its cost is the scheduler's).
        goes_on = me is not None and me.state == READY
        runs: list[tuple[str, Any]] = []
        callbacks: list[Actor] = []
        for a in self._by_key:
            if a.state == IDLE:
                if a.posted:
                    callbacks.append(a)
            elif not (a is me and goes_on) and (a.runnable() or self._orphaned_locked(a, me)):
                runs.append(("run", a))
        mine: list[tuple[str, Any]] = [("run", me)] if goes_on else []
        completes: list[tuple[str, Any]] = [("complete", r) for r in self._ready]
        if self.schedule.adversarial:
            callbacks.sort(key=lambda a: -a.posted[-1][0])  # newest first
            return mine + runs + [("callback", a) for a in callbacks] + completes
        callbacks.sort(key=lambda a: a.posted[0][0])  # oldest first
        return mine + completes + [("callback", a) for a in callbacks] + runs

    def _orphaned_locked(self, actor: Actor, me: Actor | None) -> bool:
        """``actor`` was handed the turn and has not been seen at a point since, but another
        decides now (the monitor took it for blocked outside, then it ran on): it waits for
        the turn, or runs uncontrolled, and may go on. Without this it could never be chosen,
        and a world with nothing else to run would be taken for a deadlock."""
        return actor.state == RUNNING and actor is not self._holder and actor is not me

    def _choose_locked(self, options: list[tuple[str, Any]]) -> tuple[int, tuple[int, int] | None]:
        """The option to take, and (it, how many) to show where it is not the natural one."""
        n = len(options)
        if n == 1:
            return 0, None
        index = self.schedule.decide(n, lambda: [_who(kind, target) for kind, target in options])
        return index, ((index, n) if index else None)

    def _complete_locked(self, ready: Ready) -> Ready:
        """Take the collective a decision chose to complete off the ready list."""
        self._ready.remove(ready)
        return ready

    def _switch(self, me: Actor | None, *, settle: bool = True) -> None:
        """The holder ``me`` (None: the monitor, for an outside holder) is at a point: decide
        until an actor is handed the baton; then, if ``me`` may go on later, wait for it.
        ``settle``: first wait for outside actors that the segment just ended may have woken."""
        while True:
            with self._lock:
                if not self._active:
                    return
                if settle:
                    settle = False
                    if self._monitor.settle_locked(self._timeout):
                        continue  # it let the lock go: the schedule may have stopped meanwhile
                options = self._options_locked(me)
                if not options:
                    if self._monitor.wait_for_outside_locked(self._timeout):
                        continue
                    done = all(a.state in (DONE, IDLE) for a in self._actors.values())
                    if done:
                        self._holder = None
                        self._quiet.notify_all()
                        return
                    rank, error = self._deadlock_locked("no actor can move")
                    stuck = True
                else:
                    stuck = False
                    index, choice = self._choose_locked(options)
                    kind, target = options[index]
                    if kind == "complete":
                        target = self._complete_locked(target)
                        self._record_locked(None, "complete", target.what, target.tensors, choice)
                    else:
                        self._hand_locked(me, target, kind, choice)
                        if target is me:
                            return  # it goes on: nothing to wait for
            if stuck:
                self._on_deadlock(rank, error)
                return
            if kind != "complete":
                break
            target.complete()  # moves the data, posts callbacks; on this thread, no lock held
        if me is not None and me.state in (READY, BLOCKED, RUNNING):
            self._await_baton(me)

    def _hand_locked(
        self, me: Actor | None, target: Actor, kind: str, choice: tuple[int, int] | None
    ) -> None:
        if kind == "callback":
            _, what = target.posted.popleft()
            self._record_locked(target, "callback", what, choice=choice)
        elif target is not me:
            event = "resume" if target.state == BLOCKED else "run"
            self._record_locked(
                target, event, target.waits_for if event == "resume" else "", choice=choice
            )
        target.state = RUNNING
        target.pred, target.waits_for = None, ""
        target.samples.clear()
        self._holder = target
        self._gen += 1
        target.wake.signal_locked()  # if it waits; else it finds the turn when it looks
        self._monitor.handed_locked()

    def _await_baton(self, actor: Actor) -> None:
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
                actor.wake.wait_locked(self._lock, left)
            else:
                return
        self._on_deadlock(rank, error)

    def _deadlock_locked(self, why: str) -> tuple[int, ScheduleDeadlock]:
        return deadlock(self.schedule, self._actors.values(), why)


def _who(kind: str, target: Any) -> Key | str:
    """Who an option runs, as PCT gives priorities: an actor (a rank's thread, a rank's
    callbacks) by its key; every completion is the network's."""
    if kind == "complete":
        return "network"
    key: Key = target.key
    return key
