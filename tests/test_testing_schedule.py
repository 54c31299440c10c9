"""reducer.testing.schedule: the schedules strategy, the race report, and the checks' note."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import fakepg
from reducer.testing import TrainingScenario, check_data_parallel, race_report, schedules
from reducer.testing.schedule import RaceWindowNotReached


@given(schedules(max_choices=5, adversarial=True))
@settings(max_examples=20)
def test_schedules_draws_what_it_is_told(schedule: fakepg.Schedule) -> None:
    assert schedule.adversarial and len(schedule.choices) <= 5
    assert all(0 <= c <= 7 for c in schedule.choices)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"max_choices": -1}, "max_choices"), ({"adversarial": "yes"}, "adversarial")],
)
def test_bad_arguments_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        schedules(**kwargs)  # type: ignore[arg-type]


def test_the_race_report_names_the_schedule_and_marks_its_choices() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> None:
        pg.allreduce([torch.ones(3)]).wait()

    schedule = fakepg.Schedule({0: 1})
    fakepg.run(fn, 2, schedule=schedule)
    report = race_report(schedule)
    assert report.startswith("Under Schedule({0: 1}) (")
    assert "1 away from the natural order" in report and "schedule=Schedule({0: 1})" in report
    assert "rank 1  run                <- choice: option 1 of 2" in report
    assert "complete        allreduce #0 (op=SUM) float32[3]" in report


class _NoSync(torch.nn.Module):
    """A wrapper that never reduces: every rank keeps its own gradient."""

    def __init__(self, module: torch.nn.Module, pg: object) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(2, 1)


def test_a_failing_check_carries_the_schedule_as_a_note() -> None:
    g = torch.Generator().manual_seed(0)
    inputs = (tuple((torch.randn(1, 2, generator=g),) for _ in range(2)),)
    with pytest.raises(AssertionError) as failure:
        check_data_parallel(_NoSync, TrainingScenario(_model, inputs), schedule=fakepg.Schedule())
    notes = getattr(failure.value, "__notes__", [])
    assert any(note.startswith("Under Schedule({})") for note in notes), notes


class _WaitsAtOnce(torch.nn.Module):
    """Reduces each gradient after backward, waiting for each at once: nothing in flight."""

    def __init__(self, module: torch.nn.Module, pg: object) -> None:
        super().__init__()
        self.module, self.pg = module, pg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def finish(self) -> None:
        for p in self.module.parameters():
            assert p.grad is not None
            self.pg.allreduce([p.grad]).wait()  # type: ignore[attr-defined]
            p.grad.div_(self.pg.size())  # type: ignore[attr-defined]


class _Overlaps(_WaitsAtOnce):
    """Issues every reduction, then waits for them all: each is in flight across the next."""

    def finish(self) -> None:
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        works = [self.pg.allreduce([g]) for g in grads]  # type: ignore[attr-defined]
        for work, g in zip(works, grads, strict=True):
            work.wait()
            g.div_(self.pg.size())  # type: ignore[attr-defined]


def _scenario() -> TrainingScenario:
    g = torch.Generator().manual_seed(0)
    inputs = (tuple((torch.randn(1, 2, generator=g),) for _ in range(2)),)
    return TrainingScenario(_model, inputs)


def test_a_passing_check_says_how_many_collectives_were_left_in_flight() -> None:
    report = check_data_parallel(
        _Overlaps, _scenario(), after_backward=lambda w: w.finish(), schedule=fakepg.Schedule()
    )
    assert report.in_flight == (2, 4), report  # the first of each rank's two
    assert "2 of 4 collectives left in flight across a later operation" in str(report)


def test_a_check_that_never_left_a_collective_in_flight_warns() -> None:
    with pytest.warns(RaceWindowNotReached, match="none of the 4 collectives"):
        report = check_data_parallel(
            _WaitsAtOnce,
            _scenario(),
            after_backward=lambda w: w.finish(),
            schedule=fakepg.Schedule(),
        )
    assert report.in_flight == (0, 4)
