"""What a schedule is to its user: the choices that decide the order, the timeline of what
happened, and the error of a schedule under which the code deadlocks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fakepg.faults import FakePGError

__all__ = ["Schedule", "ScheduleDeadlock", "ScheduleEvent"]


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
            choices = dense(raw)
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


def dense(sparse: Mapping[object, object]) -> list[int]:
    """``{point: choice}`` as the choice sequence it stands for (0 at every other point)."""
    for key, value in sparse.items():
        if isinstance(key, bool) or not isinstance(key, int) or key < 0:
            raise ValueError(f"Schedule: a choice's point must be an int >= 0, got {key!r}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"Schedule: the choice at point {key} must be an int >= 0, got {value!r}"
            )
    points = {int(k): int(v) for k, v in sparse.items()}  # type: ignore[call-overload]
    choices = [0] * (max(points) + 1 if points else 0)
    for point, choice in points.items():
        choices[point] = choice
    return choices
