"""Races made repeatable: Hypothesis draws the fake world's schedule, and a failure shows it.

:func:`schedules` draws :class:`fakepg.Schedule` values (a choice sequence, and whether the
adversarial order applies) for the ``schedule=`` keyword of :func:`check_data_parallel`,
:func:`check_comm_hook`, ``fakepg.run`` and ``fakepg.run_torch``: under a schedule the ranks'
threads run one at a time and every decision (which thread goes on, when a collective
completes, which callback runs) is the schedule's, so a race fails on every run of the same
example and Hypothesis shrinks it to the few choices that matter. :func:`race_report` prints
what happened as a timeline, and :func:`reporting` attaches it to a failure::

    @given(schedule=schedules())
    def test_my_hook(schedule):
        check_comm_hook(my_hook, scenario, schedule=schedule)

See Note [Controlled scheduling] in :mod:`fakepg.schedule`.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

from hypothesis import strategies as st

import fakepg

__all__ = ["race_report", "reporting", "schedules"]

P = ParamSpec("P")
R = TypeVar("R")

# A choice is taken modulo the number of options; at most a handful of ranks, completions
# and callbacks are ever on offer at once, so small values reach every option.
_MAX_CHOICE = 7


def schedules(
    *, max_choices: int = 64, adversarial: bool | None = None
) -> st.SearchStrategy[fakepg.Schedule]:
    """A :class:`fakepg.Schedule`: up to ``max_choices`` choices (each in 0..7, taken modulo
    the options at its point; past the end the natural order), in the natural or the
    adversarial order (``adversarial``: None draws it). Shrinks toward fewer and smaller
    choices, which is toward the natural order: a shrunk race names only the switches that
    break the code."""
    if isinstance(max_choices, bool) or not isinstance(max_choices, int) or max_choices < 0:
        raise ValueError(f"schedules: max_choices must be an int >= 0, got {max_choices!r}")
    if adversarial is not None and not isinstance(adversarial, bool):
        raise ValueError(f"schedules: adversarial must be a bool or None, got {adversarial!r}")
    modes = st.booleans() if adversarial is None else st.just(adversarial)
    choices = st.lists(st.integers(0, _MAX_CHOICE), max_size=max_choices)
    return st.builds(lambda c, a: fakepg.Schedule(c, adversarial=a), choices, modes)


def race_report(schedule: fakepg.Schedule, *, last: int | None = 60) -> str:
    """What ``schedule``'s last run did, as a timeline: one line per step (actor, event,
    collective, its tensors), the steps a choice decided marked; ``last``: the last so many
    steps (None: all)."""
    used = schedule.used
    switches = sum(1 for e in schedule.timeline if e.choice is not None)
    head = (
        f"Under {schedule!r} ({len(schedule.timeline)} steps; {used} choice points, "
        f"{switches} away from the natural order"
        + (", adversarial order" if schedule.adversarial else "")
        + "). Replay it with schedule="
        + repr(schedule)
        + ":"
    )
    return head + "\n" + schedule.format(last=last)


@contextlib.contextmanager
def reporting(schedule: fakepg.Schedule | None) -> Iterator[None]:
    """Add :func:`race_report` to any exception raised inside (a PEP 678 note, which pytest
    and Hypothesis print with the failure). Nothing happens without a schedule."""
    try:
        yield
    except BaseException as exc:
        if schedule is not None and schedule.timeline:
            _add_note(exc, race_report(schedule))
        raise


def reports_schedule(check: Callable[P, R]) -> Callable[P, R]:
    """Run ``check`` under :func:`reporting` of its ``schedule=`` keyword argument."""

    @functools.wraps(check)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        schedule = kwargs.get("schedule")
        with reporting(schedule if isinstance(schedule, fakepg.Schedule) else None):
            return check(*args, **kwargs)

    return run


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: the list pytest reads
        notes = getattr(exc, "__notes__", None)
        if not isinstance(notes, list):
            notes = []
            exc.__notes__ = notes  # type: ignore[attr-defined]
        notes.append(note)
