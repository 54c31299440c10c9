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
import dataclasses
import functools
import random
import warnings
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

from hypothesis import strategies as st

import fakepg
from fakepg._schedule import explore as _explore

from ._judge import CheckReport

__all__ = [
    "RaceWindowNotReached",
    "fewest_deviations",
    "in_flight",
    "race_report",
    "reporting",
    "schedules",
]

P = ParamSpec("P")
R = TypeVar("R")

# A choice is taken modulo the number of options; at most a handful of ranks, completions
# and callbacks are ever on offer at once, so small values reach every option.
_MAX_CHOICE = 7

EXPLORATIONS = ("walk", "pct")


def schedules(
    *,
    explore: str | None = None,
    adversarial: bool | None = None,
    depth: int = 3,
    max_choices: int | None = None,
) -> st.SearchStrategy[fakepg.Schedule]:
    """A :class:`fakepg.Schedule` that decides, at every choice point of the run however many
    there are, by ``explore``:

    - ``"walk"``: a uniform random choice at each point, drawn as the run reaches it;
    - ``"pct"``: probabilistic concurrency testing: random priorities for the ranks' threads,
      their callbacks and the network, and up to ``depth - 1`` priority change points drawn
      uniformly over the run's number of choice points (the longest run this strategy has
      seen); a race of depth d is found with probability at least 1 / (n k^(d-1)) per example
      for n actors and k choice points, however long the code before it runs;
    - None (the default): either, drawn.

    ``adversarial``: the completion policy: early (False: a collective may complete as soon
    as its ranks issued it) or late (True: as late as allowed; a missing wait shows with no
    switch at all); None draws it. ``max_choices``: instead, a fixed list of at most that many
    choices (each in 0..7, taken modulo the options at its point; past its end the natural
    order), the strategy of earlier versions. See Note [Exploration] in
    :mod:`fakepg._schedule.timeline`.

    A failing check reports the run's decisions shrunk to the fewest deviations from the
    natural order (:func:`fewest_deviations`), as a plain schedule that replays it.

    # Note [Exploration draws from a seed]
    # Each example draws one seed, and its walk or PCT draws from a generator seeded with it,
    # as many times as its run has choice points. Drawn from the example's data instead, one
    # draw per choice point, Hypothesis would shrink each choice toward the natural one; but
    # the number of draws then follows the run, and a run whose number of choice points
    # varies between replays (torch's C++ DDP blocked outside the scheduler, whose wake-ups
    # the scheduler samples: Note [Blocked outside the scheduler]) would fail as a flaky
    # strategy although the code under test is correct. The seed's generator also draws
    # PCT's priorities and change points uniformly, which its guarantee assumes and
    # Hypothesis's integers (biased toward their bounds) would not."""
    if max_choices is not None and (
        isinstance(max_choices, bool) or not isinstance(max_choices, int) or max_choices < 0
    ):
        raise ValueError(f"schedules: max_choices must be an int >= 0, got {max_choices!r}")
    if adversarial is not None and not isinstance(adversarial, bool):
        raise ValueError(f"schedules: adversarial must be a bool or None, got {adversarial!r}")
    if explore is not None and explore not in EXPLORATIONS:
        raise ValueError(
            f"schedules: explore must be one of {EXPLORATIONS} or None (both), got {explore!r}"
        )
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"schedules: depth must be an int >= 1 (PCT's d), got {depth!r}")
    modes = st.booleans() if adversarial is None else st.just(adversarial)
    if max_choices is not None:
        choices = st.lists(st.integers(0, _MAX_CHOICE), max_size=max_choices)
        return st.builds(lambda c, a: fakepg.Schedule(c, adversarial=a), choices, modes)
    kinds = st.sampled_from(EXPLORATIONS) if explore is None else st.just(explore)
    horizon = _explore.Horizon()  # shared by this strategy's examples: the longest run seen

    @st.composite
    def explored(draw: st.DrawFn) -> fakepg.Schedule:
        kind, late = draw(kinds), draw(modes)
        # See Note [Exploration draws from a seed].
        source = random.Random(draw(st.integers(0, 2**64 - 1))).randrange
        exploration: _explore.Exploration
        if kind == "walk":
            exploration = _explore.Walk(source)
        else:
            d = draw(st.integers(1, depth))
            exploration = _explore.Pct(source, depth=d, horizon=horizon)
        return fakepg.Schedule(adversarial=late, explore=exploration)

    return explored()


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


def fewest_deviations(
    schedule: fakepg.Schedule, fails: Callable[[fakepg.Schedule], bool], *, rounds: int = 3
) -> fakepg.Schedule:
    """A plain schedule with as few deviations from the natural order as this search finds,
    under which ``fails`` still holds, starting from ``schedule``'s last run (which failed).

    First no deviation at all, under either completion policy; then each deviation of the
    recorded run is dropped in turn and kept out where the code still fails (a schedule
    found by PCT deviates wherever priorities differ, while its race needs a few of them);
    where more than one remains, a single switch at each of the first choice points. Each
    try is a run of ``fails``; at most ``rounds`` passes of dropping."""
    for late in (False, True):
        bare = fakepg.Schedule(adversarial=late)
        if fails(bare):
            return bare
    best = schedule.recorded()
    for _ in range(rounds):
        shrunk = False
        for point in [i for i, c in enumerate(best.choices) if c]:
            choices = list(best.choices)
            if point >= len(choices) or not choices[point]:
                continue
            choices[point] = 0
            candidate = fakepg.Schedule(choices, adversarial=best.adversarial)
            if fails(candidate):
                best, shrunk = candidate.recorded(), True
        if not shrunk:
            break
    if sum(1 for c in best.choices if c) > 1:
        # One switch anywhere among the first choice points, under either policy.
        for point in range(min(len(best.choices), _ONE_SWITCH_POINTS)):
            for late in (best.adversarial, not best.adversarial):
                candidate = fakepg.Schedule({point: 1}, adversarial=late)
                if fails(candidate):
                    return candidate.recorded()
    return best


# How far fewest_deviations looks for a single switch, when dropping deviations leaves more.
_ONE_SWITCH_POINTS = 32


class RaceWindowNotReached(UserWarning):
    """A check passed under a schedule in which no collective was ever left in flight across
    a later operation of its rank: no race between a rank and its collectives was tried."""


def in_flight(schedule: fakepg.Schedule) -> tuple[int, int]:
    """From ``schedule``'s last run: (how many collectives were left in flight across a later
    operation of the rank that issued them, how many were issued), counted per rank.

    A collective is left in flight across a later operation when its rank went on before it
    completed: the rank issued another collective, one of its callbacks ran, it returned,
    or it resumed from waiting for something else. Only then can the rank's code touch the
    collective's buffers (write, read, divide them, run the next backward) while it is in
    flight, which is where races between a rank and its collectives live."""
    open_: dict[tuple[int, str], bool] = {}  # (rank, collective) -> the rank went on since
    left = issued = 0
    for e in schedule.timeline:
        rank = e.rank
        if e.event == "complete":
            for key in [k for k in open_ if k[1] == e.collective]:
                left += open_.pop(key)
            continue
        if rank is None or e.event == "wait":
            continue
        went_on = e.event in ("issue", "callback", "return", "run", "resume")
        if went_on:
            for key in open_:
                if key[0] == rank and not (e.event == "resume" and key[1] == e.collective):
                    open_[key] = True
        if e.event == "issue":
            open_[(rank, e.collective)] = False
            issued += 1
    left += sum(open_.values())  # never completed (the run failed meanwhile)
    return left, issued


def _final_example() -> bool:
    """Not inside a Hypothesis example, or inside its final replay (the one it reports)."""
    try:
        from hypothesis.control import _current_build_context

        context = _current_build_context.value
    except (ImportError, AttributeError):  # pragma: no cover - the checks run without it
        return True
    return context is None or bool(getattr(context, "is_final", True))


def reports_schedule(check: Callable[P, R]) -> Callable[P, R]:
    """Run ``check`` under :func:`reporting` of its ``schedule=`` keyword argument; where it
    fails under a schedule that deviates from the natural order, the report also shows the
    schedule with the fewest deviations that still fails (:func:`fewest_deviations`), on the
    failure Hypothesis reports (its final replay) or outside Hypothesis."""

    @functools.wraps(check)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        schedule = kwargs.get("schedule")
        if not isinstance(schedule, fakepg.Schedule):
            return check(*args, **kwargs)
        try:
            with reporting(schedule):
                result = check(*args, **kwargs)
        except Exception as exc:
            if any(schedule.choices) and _final_example():

                def fails(candidate: fakepg.Schedule) -> bool:
                    try:
                        check(*args, **{**kwargs, "schedule": candidate})  # type: ignore[arg-type]
                    except Exception:
                        return True
                    return False

                shrunk = fewest_deviations(schedule, fails)
                fails(shrunk)  # its timeline, for the report
                _add_note(exc, "Shrunk to the fewest deviations: " + race_report(shrunk))
            raise
        return _with_coverage(result, schedule)

    return run


def _with_coverage(result: R, schedule: fakepg.Schedule) -> R:
    """A passing check's report, with what its schedule covered; a warning where no
    collective was ever in flight across a later operation of its rank."""
    left, issued = in_flight(schedule)
    if issued and not left:
        warnings.warn(
            RaceWindowNotReached(
                f"the check passed under {schedule!r}, but none of the {issued} collectives "
                "was left in flight across a later operation of its rank (a write or read of "
                "its buffer, a division, the next backward): no race between a rank and its "
                "collectives was tried. Draw schedules with reducer.testing.schedules() "
                "(the late completion policy leaves every collective in flight as long as "
                "allowed)"
            ),
            stacklevel=3,
        )
    if isinstance(result, CheckReport):
        return dataclasses.replace(result, in_flight=(left, issued))
    return result


def _add_note(exc: BaseException, note: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10: the list pytest reads
        notes = getattr(exc, "__notes__", None)
        if not isinstance(notes, list):
            notes = []
            exc.__notes__ = notes  # type: ignore[attr-defined]
        notes.append(note)
