"""The report of a schedule under which no actor can move: what each waits for, its stack
(the user's frames only), and the last steps of the timeline."""

from __future__ import annotations

import traceback
from collections.abc import Iterable

from .actors import BLOCKED, DONE, IDLE, OUTSIDE, READY, RUNNING, Actor
from .probe import current_frames, internal
from .timeline import Schedule, ScheduleDeadlock

_WAITS = {
    BLOCKED: "waits for {}",
    OUTSIDE: "is blocked outside any collective (a lock, an event, a C++ wait)",
    READY: "is ready",
    RUNNING: "holds the turn",
}


def deadlock(schedule: Schedule, actors: Iterable[Actor], why: str) -> tuple[int, ScheduleDeadlock]:
    """The lowest stuck rank and the error that reports the deadlock (``why``: what showed it)."""
    frames = current_frames()
    lines = [
        f"fakepg: deadlock under the controlled schedule ({why}); after "
        f"{len(schedule.timeline)} steps and {schedule.used} choices of "
        f"{schedule!r}. What each waits for:"
    ]
    stuck = sorted((a for a in actors if a.state not in (DONE, IDLE)), key=lambda a: a.key)
    for actor in stuck:
        lines.append(f"  {actor.label} {_WAITS[actor.state].format(actor.waits_for)}")
    lines.append("Stacks:")
    for actor in stuck:
        thread = actor.thread
        frame = None if thread is None or thread.ident is None else frames.get(thread.ident)
        lines.append(f"  {actor.label} (thread {getattr(thread, 'name', '?')}):")
        if frame is None:
            lines.append("    (not started)")
            continue
        stack = [s for s in traceback.extract_stack(frame) if not internal(s.filename)]
        lines.extend("    " + line.rstrip() for line in traceback.format_list(stack[-12:]))
    lines.append("The schedule so far (last 30 steps):")
    lines.append(schedule.format(last=30))
    rank = min((a.rank for a in stuck), default=0)
    return rank, ScheduleDeadlock("\n".join(lines))
