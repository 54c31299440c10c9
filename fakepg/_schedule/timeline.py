"""What a schedule is to its user: the choices that decide the order, the timeline of what
happened, and the error of a schedule under which the code deadlocks.

# Note [Exploration]
# A schedule is a value: each run starts from its first choice (Schedule.start, called when
# a world's run begins), so a test pinned to a schedule tests the same order every run. Past
# its explicit choices it takes the natural option, or asks its exploration: a random walk
# (a draw at every choice point) or PCT (random priorities, change points uniform over the
# steps of the longest run seen), both drawing lazily, for as long as the run has choice
# points, from Hypothesis's data (fakepg._schedule.explore). What an exploration drew is
# remembered, so running the schedule again decides alike. Every decision is an index into
# the options in the completion policy's order; the decisions of a run, with the policy,
# are a plain schedule (Schedule.recorded) that replays it, and that is how a schedule that
# ran prints.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from fakepg.faults import FakePGError

from .explore import Exploration

__all__ = ["Schedule", "ScheduleDeadlock", "ScheduleEvent"]


class ScheduleDeadlock(FakePGError):
    """Under the controlled schedule no actor can move while some still wait: the user's code
    deadlocks on this schedule. The message shows what each waits for, and its stack."""


# What a step's collective moves: its text, or the tensors' specs whose str() are its parts
# (joined only when the timeline is read: a run records one per issue, and few are read).
Tensors = str | tuple[object, ...]


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
    """What decides a scheduled world's order: a choice sequence and a completion policy.

    ``choices``: non-negative ints, one per point with more than one option (taken modulo
    the number of options; past the end, 0), or a mapping from such a point's number to its
    choice (the others 0): ``Schedule({11: 1})`` is ``Schedule([0] * 11 + [1])``, and is how
    a schedule prints. ``adversarial``: the late completion policy: order the options so that
    the default runs threads before completing anything and callbacks newest first (see Note
    [Controlled scheduling]). ``explore``: how to decide past the choices (a random walk or
    PCT, see :func:`reducer.testing.schedules`, which draws them); None: the natural order.

    A schedule is a value: every run replays it from its start. After a run, :attr:`timeline`
    holds what happened, :attr:`used` how many choice points there were, :meth:`recorded` the
    decisions taken as a plain schedule (what ``repr`` prints once an explored schedule ran,
    and what pastes back into a test to replay the run); :meth:`format` prints the timeline.
    """

    def __init__(
        self,
        choices: Sequence[int] | Mapping[int, int] = (),
        *,
        adversarial: bool = False,
        explore: Exploration | None = None,
    ) -> None:
        raw: object = choices
        if isinstance(raw, Mapping):
            choices = dense(raw)
        elif isinstance(raw, str | bytes) or not isinstance(raw, Sequence):
            raise ValueError(f"Schedule: choices must be a sequence of ints, got {choices!r}")
        choices = tuple(choices)
        # Every example of a property builds one: the common case (plain ints) in one pass.
        if not all(type(c) is int and c >= 0 for c in choices):
            for i, c in enumerate(choices):
                if isinstance(c, bool) or not isinstance(c, int) or c < 0:
                    raise ValueError(f"Schedule: choices[{i}] must be an int >= 0, got {c!r}")
        if not isinstance(adversarial, bool):
            raise ValueError(f"Schedule: adversarial must be a bool, got {adversarial!r}")
        if explore is not None and not isinstance(explore, Exploration):
            raise ValueError(
                f"Schedule: explore must be an exploration (draw one with "
                f"reducer.testing.schedules()), got {explore!r}"
            )
        self._choices = choices
        self.adversarial = adversarial
        self.explore = explore
        # The run's steps as the scheduler records them (plain tuples: a step costs the
        # decision less than an event object would), made events when read.
        self._steps: list[tuple[str, int | None, str, str, Tensors, tuple[int, int] | None]] = []
        self._events: list[ScheduleEvent] = []
        self.used = 0
        self._taken: list[int] = []
        self._ran = False

    @property
    def choices(self) -> tuple[int, ...]:
        """The choice sequence: the one given, or for an explored schedule the decisions its
        last run took (its own choices are drawn as it runs)."""
        if self.explore is None:
            return self._choices
        return tuple(self._taken)

    @property
    def timeline(self) -> list[ScheduleEvent]:
        """What the last run did, one event per step, in order."""
        events, steps = self._events, self._steps
        for actor, rank, event, collective, tensors, choice in steps[len(events) :]:
            if not isinstance(tensors, str):
                tensors = ", ".join(map(str, tensors))
            events.append(ScheduleEvent(actor, rank, event, collective, tensors, choice))
        return events

    # The scheduler's part: a run starts, records its steps, decides at each choice point, ends.

    def record(
        self,
        actor: str,
        rank: int | None,
        event: str,
        collective: str,
        tensors: Tensors,
        choice: tuple[int, int] | None,
    ) -> None:
        """One step of the run (the fields of a :class:`ScheduleEvent`; ``tensors`` may be
        the tensors' specs, written out when the timeline is read)."""
        self._steps.append((actor, rank, event, collective, tensors, choice))

    def start(self) -> None:
        """A run begins: from the start of the schedule, every time. See Note [Exploration]."""
        self._steps, self._events = [], []
        self.used = 0
        self._taken = []
        self._ran = True
        if self.explore is not None:
            self.explore.start()

    def decide(self, n: int, keys: Callable[[], Sequence[Hashable]]) -> int:
        """The option taken at the next choice point, among ``n`` options (``keys()``: who
        each one runs, for an exploration's priorities; computed only where one asks)."""
        step = self.used
        self.used += 1
        if step < len(self._choices):
            index = self._choices[step] % n
        elif self.explore is not None:
            index = self.explore.decide(step - len(self._choices), n, keys)
        else:
            index = 0
        self._taken.append(index)
        return index

    def finish(self) -> None:
        """A run ended (what it saw tells an exploration how long runs are)."""
        if self.explore is not None:
            self.explore.finish(self.used)

    def recorded(self) -> Schedule:
        """The decisions of the last run as a plain schedule: it replays that run exactly."""
        return replay(self._taken, self)

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
        if self.explore is not None:
            if self._ran:
                return repr(self.recorded())
            return f"Schedule(<{self.explore.describe()}, drawn as it runs>{mode})"
        sparse = {i: c for i, c in enumerate(self._choices) if c}
        return f"Schedule({sparse!r}{mode})"


def replay(taken: Sequence[int], schedule: Schedule) -> Schedule:
    """The plain schedule that takes the decisions ``taken`` under ``schedule``'s completion
    policy: a decision is an index into the options in the policy's order, so a replay
    without the policy would take other options."""
    return Schedule(list(taken), adversarial=schedule.adversarial)


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
