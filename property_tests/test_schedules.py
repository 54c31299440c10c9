"""Property: under the fake world's controlled scheduler, a race is a schedule.

Every racy program shows its race under some schedule that Hypothesis finds and shrinks to
at most one switch away from the natural order or the adversarial one (which completes
collectives as late as allowed: a missing wait shows there with no switch at all), and fails
on every replay of it; every race-free
program gives the same bits under every schedule. The racy programs are the two shapes that
races between ranks and their collectives take: a tensor written while its collective is in
flight, and a result read without waiting for it. ``property_tests/test_mutants.py`` checks
that a scheduler which ignores its choices, or completes collectives at once, lets a race
through: the property then fails.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import find, given, settings

import fakepg
from reducer.testing import fewest_deviations, schedules

SEARCH = settings(max_examples=200, database=None, deadline=None, derandomize=True)

Program = Callable[[fakepg.FakeProcessGroup], list[float]]


def write_in_flight(pg: fakepg.FakeProcessGroup) -> list[float]:
    t = torch.ones(2) * (pg.rank() + 1)
    work = pg.allreduce([t])
    t.div_(pg.size())  # written while the allreduce may not have read it
    work.wait()
    return t.tolist()


def read_without_waiting(pg: fakepg.FakeProcessGroup) -> list[float]:
    t, u = torch.ones(1) * (pg.rank() + 1), torch.ones(1) * (pg.rank() + 1)
    first, _second = pg.allreduce([t]), pg.allreduce([u])
    first.wait()  # the second allreduce is never waited for
    return t.tolist() + u.tolist()


def write_before_issuing(pg: fakepg.FakeProcessGroup) -> list[float]:
    t = (torch.ones(2) * (pg.rank() + 1)).div_(pg.size())
    pg.allreduce([t]).wait()
    return t.tolist()


def read_after_waiting(pg: fakepg.FakeProcessGroup) -> list[float]:
    t, u = torch.ones(1) * (pg.rank() + 1), torch.ones(1) * (pg.rank() + 1)
    works = [pg.allreduce([t]), pg.allreduce([u])]
    for work in works:
        work.wait()
    return t.tolist() + u.tolist()


RACY: dict[str, tuple[Program, list[list[float]]]] = {
    "write in flight": (write_in_flight, [[1.5, 1.5]] * 2),
    "read without waiting": (read_without_waiting, [[3.0, 3.0]] * 2),
}
RACE_FREE: dict[str, tuple[Program, list[list[float]]]] = {
    "write before issuing": (write_before_issuing, [[1.5, 1.5]] * 2),
    "read after waiting": (read_after_waiting, [[3.0, 3.0]] * 2),
}


def race_is_found_and_shrunk(name: str) -> None:
    """The property for the racy program ``name``: some schedule shows its race, shrunk to
    at most one switch from the natural or the adversarial order, and every replay of that
    schedule shows it."""
    program, right = RACY[name]

    def wrong(schedule: fakepg.Schedule) -> bool:
        return fakepg.run(program, 2, schedule=schedule, timeout=20) != right

    found = fewest_deviations(find(schedules(), wrong, settings=SEARCH), wrong)
    switches = sum(1 for c in found.choices if c)
    assert switches == 1 or (switches == 0 and found.adversarial), found
    for _ in range(20):
        assert wrong(fakepg.Schedule(found.choices, adversarial=found.adversarial))


@pytest.mark.parametrize("name", sorted(RACY))
def test_a_race_is_a_schedule_found_and_shrunk(name: str) -> None:
    race_is_found_and_shrunk(name)


@pytest.mark.parametrize("name", sorted(RACE_FREE))
@given(schedule=schedules())
@settings(max_examples=25, deadline=None)
def test_race_free_code_gives_the_same_bits_under_every_schedule(
    name: str, schedule: fakepg.Schedule
) -> None:
    program, right = RACE_FREE[name]
    assert fakepg.run(program, 2, schedule=schedule, timeout=20) == right
