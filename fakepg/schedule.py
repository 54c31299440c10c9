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
# Python frame is such a wait (a wait of the threading module, not a thread's start nor the
# fake world's own: the scheduler's, a lane's between callbacks, a kept thread's between jobs;
# autograd's engine running backward) and stays the same, and the OS shows the
# thread sleeping without having run between two looks (Linux: its CPU clock and /proc;
# elsewhere the frame alone, sampled longer), it is *outside*: the monitor decides in its place
# and the world goes on (see Note [How often the monitor looks] in fakepg._schedule.monitor).
# An outside thread that a later event wakes (a callback completes its future) parks at its
# next point (a wait for the turn is one: a thread taken outside wrongly, on its way to the
# turn, is back there and may be chosen again); before each decision that follows a segment
# of code, the scheduler waits until every outside thread has either parked or is seen
# blocked again, so that the options do not depend on how fast it woke. This is a sampling
# heuristic: decisions stay exact as long as an outside thread can move only when the world
# does. A thread sleeping elsewhere (``time.sleep``, a lock of its own) is only slow: the
# others wait for it, up to the world's timeout, which then reports it with every rank's
# stack.
"""

from __future__ import annotations

# The parts live in fakepg._schedule, one job each; the world, its backend and its tools import
# these names from here.
from ._schedule.probe import current_frames as current_frames
from ._schedule.scheduler import Scheduler
from ._schedule.scheduler import current_scheduler as current_scheduler
from ._schedule.timeline import Schedule, ScheduleDeadlock, ScheduleEvent
from ._schedule.waits import install_future_wait as install_future_wait
from ._schedule.waits import wait_event as wait_event

__all__ = ["Schedule", "ScheduleDeadlock", "ScheduleEvent"]

_Scheduler = Scheduler  # a world's scheduler (the name the world and the mutants use)
