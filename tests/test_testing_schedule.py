"""reducer.testing.schedule: the schedules strategy, the race report, and the checks' note."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import fakepg
from reducer.testing import TrainingScenario, check_data_parallel, race_report, schedules


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
