"""fakepg.Schedule: one thread at a time, in the order the choices decide; repeatable."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import find, given, settings

import fakepg
from reducer.testing import fewest_deviations, race_report, schedules


def _divide_in_flight(pg: fakepg.FakeProcessGroup) -> list[float]:
    t = torch.ones(2) * (pg.rank() + 1)
    work = pg.allreduce([t])
    t.div_(pg.size())  # races the in-flight allreduce
    work.wait()
    return t.tolist()


def _race_free(pg: fakepg.FakeProcessGroup) -> list[float]:
    t = (torch.ones(2) * (pg.rank() + 1)).div_(pg.size())
    pg.allreduce([t]).wait()
    return t.tolist()


def test_the_natural_order_runs_each_thread_until_it_waits() -> None:
    schedule = fakepg.Schedule()
    assert fakepg.run(_divide_in_flight, 2, schedule=schedule) == [[1.5, 1.5]] * 2
    events = [(e.actor, e.event) for e in schedule.timeline]
    assert events[:3] == [("rank 0", "run"), ("rank 0", "issue"), ("rank 0", "wait")]
    assert ("world", "complete") in events and events[-1][1] == "return"


def test_a_choice_completes_the_collective_before_a_rank_divides_every_time() -> None:
    results = set()
    for _ in range(20):
        out = fakepg.run(_divide_in_flight, 2, schedule=fakepg.Schedule({0: 0, 1: 1}))
        results.add(tuple(map(tuple, out)))
    assert len(results) == 1 and results != {((1.5, 1.5), (1.5, 1.5))}, results


def test_the_property_finds_the_race_and_shrinks_it_to_one_switch() -> None:
    def wrong(schedule: fakepg.Schedule) -> bool:
        return fakepg.run(_divide_in_flight, 2, schedule=schedule) != [[1.5, 1.5]] * 2

    found = fewest_deviations(
        find(schedules(), wrong, settings=settings(database=None, max_examples=200)), wrong
    )
    assert sum(1 for c in found.choices if c) == 1, found
    replay = fakepg.Schedule(found.choices, adversarial=found.adversarial)
    fakepg.run(_divide_in_flight, 2, schedule=replay)
    report = race_report(replay)
    assert "complete" in report and "<- choice" in report


@given(schedule=schedules())
@settings(max_examples=30, deadline=None, database=None)
def test_race_free_code_gives_the_same_bits_under_every_schedule(
    schedule: fakepg.Schedule,
) -> None:
    assert fakepg.run(_race_free, 3, schedule=schedule) == [[2.0, 2.0]] * 3


def test_a_scheduler_that_ignores_its_choices_lets_the_race_through() -> None:
    """The mutant: with every choice read as 0 (a scheduler that ignores the sequence), no
    schedule shows the race, so the property above is what catches it."""

    def ignoring(schedule: fakepg.Schedule) -> fakepg.Schedule:
        return fakepg.Schedule([0] * len(schedule.choices), adversarial=schedule.adversarial)

    def wrong(schedule: fakepg.Schedule) -> bool:
        out = fakepg.run(_divide_in_flight, 2, schedule=ignoring(schedule))
        return out != [[1.5, 1.5]] * 2

    with pytest.raises(Exception, match="No examples"):
        find(schedules(), wrong, settings=settings(database=None, max_examples=40))


def test_adversarial_completes_last_and_reorders_callbacks_across_ranks() -> None:
    order: list[tuple[int, int]] = []

    def fn(pg: fakepg.FakeProcessGroup) -> None:
        works = [pg.allreduce([torch.ones(1)]) for _ in range(2)]
        for i, work in enumerate(works):
            work.get_future().then(lambda _f, i=i: order.append((pg.rank(), i)))
        for work in works:
            work.wait()

    schedule = fakepg.Schedule(adversarial=True)
    fakepg.run(fn, 2, schedule=schedule)
    events = [e.event for e in schedule.timeline]
    assert events.index("complete") > max(i for i, e in enumerate(events) if e == "issue")
    # Across ranks the newest posted first (rank 1's, posted after rank 0's); within a rank,
    # in completion order, as its completion thread runs them.
    assert order == [(1, 0), (0, 0), (1, 1), (0, 1)], order


def test_a_deadlock_is_reported_with_every_ranks_stack() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> None:
        peer = 1 - pg.rank()
        pg.send([torch.ones(1)], peer).wait()  # both send first: each waits for a recv
        pg.recv([torch.ones(1)], peer).wait()

    with pytest.raises(fakepg.ScheduleDeadlock) as failure:
        fakepg.run(fn, 2, schedule=fakepg.Schedule(), timeout=30)
    text = str(failure.value)
    assert "rank 0 waits for send/recv #0" in text and "rank 1 waits for send/recv #0" in text
    assert text.count("in fn") == 2, text  # each rank's stack, down to the user's line


def test_a_failure_wakes_every_rank() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> None:
        if pg.rank() == 1:
            raise ValueError("rank 1 fails")
        pg.allreduce([torch.ones(1)]).wait()

    with pytest.raises(ValueError, match="rank 1 fails"):
        fakepg.run(fn, 3, schedule=fakepg.Schedule([1, 2, 1]), timeout=30)


def test_a_thread_the_schedule_does_not_control_is_refused() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> None:
        errors: list[BaseException] = []

        def other() -> None:
            try:
                pg.allreduce([torch.ones(1)])
            except fakepg.FakePGError as exc:
                errors.append(exc)

        thread = threading.Thread(target=other)
        thread.start()
        thread.join(10)
        assert errors and "does not control" in str(errors[0])

    fakepg.run(fn, 2, schedule=fakepg.Schedule())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"choices": [1, -1]}, r"choices\[1\] must be an int >= 0"),
        ({"choices": "01"}, "sequence of ints"),
        ({"choices": {2: 1.5}}, "choice at point 2"),
        ({"adversarial": 1}, "adversarial must be a bool"),
    ],
)
def test_bad_schedules_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        fakepg.Schedule(**kwargs)  # type: ignore[arg-type]


def test_a_schedule_and_a_network_model_are_refused_together() -> None:
    with pytest.raises(ValueError, match="one or the other"):
        fakepg.World(2, schedule=fakepg.Schedule(), network=fakepg.FixedLatency(0.001))


def test_a_schedule_prints_sparse_and_replays_from_its_print() -> None:
    schedule = fakepg.Schedule([0, 0, 3, 0])
    assert repr(schedule) == "Schedule({2: 3})"
    assert fakepg.Schedule({2: 3}).choices == (0, 0, 3)


def test_a_schedule_replays_from_its_start_on_every_run() -> None:
    schedule = fakepg.Schedule({0: 0, 1: 1})
    first = fakepg.run(_divide_in_flight, 2, schedule=schedule)
    steps, used = list(schedule.timeline), schedule.used
    assert first != [[1.5, 1.5]] * 2  # the race shows under this schedule
    for _ in range(3):
        assert fakepg.run(_divide_in_flight, 2, schedule=schedule) == first
        assert schedule.timeline == steps and schedule.used == used


@given(schedule=schedules())
@settings(max_examples=20, deadline=None, database=None)
def test_an_explored_schedule_prints_what_replays_its_run(schedule: fakepg.Schedule) -> None:
    first = fakepg.run(_divide_in_flight, 2, schedule=schedule)
    pasted = eval(repr(schedule), {"Schedule": fakepg.Schedule})
    assert fakepg.run(_divide_in_flight, 2, schedule=pasted) == first
    assert pasted.timeline == schedule.timeline
    assert fakepg.run(_divide_in_flight, 2, schedule=schedule) == first  # and itself again


def test_a_lane_taken_for_blocked_outside_on_its_way_to_its_callback_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The monitor's looks are a heuristic: a lane handed its next callback that sleeps before
    # it reaches the turn (here in a wait of this test's, which the monitor takes for blocked
    # outside; on a busy machine, its idle wait while it waits for the GIL) is back once it
    # waits for the turn, and the run goes on instead of waiting out its timeout.
    from fakepg._schedule.scheduler import Scheduler

    acquire = Scheduler.lane_acquire

    def slow_lane_acquire(self: Scheduler, rank: int, level: int) -> None:
        threading.Event().wait(0.05)
        acquire(self, rank, level)

    monkeypatch.setattr(Scheduler, "lane_acquire", slow_lane_acquire)

    def step(pg: fakepg.FakeProcessGroup) -> list[float]:
        out = []
        for _ in range(3):
            future = pg.allreduce([torch.ones(1)]).get_future()
            out.append(future.then(lambda f: f.value()[0] * 2).wait().item())
        return out

    schedule = fakepg.Schedule()
    assert fakepg.run(step, 2, schedule=schedule, timeout=5) == [[4.0] * 3] * 2
    outside = [e.actor for e in schedule.timeline if e.event == "blocked outside"]
    # A lane was taken outside: the case was played.
    assert any("callbacks" in actor for actor in outside), schedule.format()
