"""The corpus: races in published-style DDP classes (constructor broadcasts, several layers,
their own ``finish_gradient_synchronization``), each found under the default exploration
and the ci profile with its shrunk schedule printed; each fix passes every schedule."""

from dataclasses import replace

import pytest
import torch
from corpus_published_ddp import (
    BucketRewritten,
    CopiesBackAfterWaiting,
    CopiesBackBeforeWaiting,
    DividesBeforeWaiting,
    DividesFirstInHook,
    DividesInHook,
    IndividualParameters,
    WaitsBeforeRefilling,
    divide_first_hook,
    divide_in_flight_hook,
)
from hypothesis import given
from torch import nn

import fakepg
from reducer.testing import (
    TrainingScenario,
    check_comm_hook,
    check_data_parallel,
    schedules,
    training_scenarios,
)

RACE = r"Replay it with schedule=Schedule\("


def model() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3), nn.Linear(3, 2))


def batch(generator: torch.Generator, skip: frozenset[int]) -> tuple[torch.Tensor]:
    return (torch.randn(3, 4, generator=generator),)


def finish(wrapper: nn.Module) -> None:
    wrapper.finish_gradient_synchronization()  # type: ignore[operator]


def two_micro_batches_then_finish(model: nn.Module, optimizer, batch, step) -> None:  # type: ignore[no-untyped-def]
    optimizer.zero_grad()
    for args in batch.micro_batches:
        batch.loss(model(*args)).backward()
    finish(model)
    optimizer.step()


def one_finish_per_step(wrapper: object) -> object:
    @given(training_scenarios(model, batch), schedules())
    def test(scenario: object, schedule: fakepg.Schedule) -> None:
        check_data_parallel(wrapper, scenario, after_backward=finish, schedule=schedule)  # type: ignore[arg-type]

    return test


@pytest.mark.slow  # finding and shrinking take tens of seconds
def test_dividing_before_waiting_is_caught() -> None:
    with pytest.raises(AssertionError, match=RACE):
        one_finish_per_step(DividesBeforeWaiting)()  # type: ignore[operator]


def test_waiting_then_dividing_passes() -> None:
    one_finish_per_step(IndividualParameters)()  # type: ignore[operator]


@pytest.mark.slow  # finding and shrinking take tens of seconds
def test_dividing_in_the_hook_after_issuing_is_caught() -> None:
    with pytest.raises(AssertionError, match=RACE):
        one_finish_per_step(DividesInHook)()  # type: ignore[operator]


def test_dividing_in_the_hook_before_issuing_passes() -> None:
    one_finish_per_step(DividesFirstInHook)()  # type: ignore[operator]


@pytest.mark.slow  # finding and shrinking take tens of seconds
def test_copying_back_before_waiting_is_caught() -> None:
    with pytest.raises(AssertionError, match=RACE):
        one_finish_per_step(CopiesBackBeforeWaiting)()  # type: ignore[operator]


def test_copying_back_after_waiting_passes() -> None:
    one_finish_per_step(CopiesBackAfterWaiting)()  # type: ignore[operator]


def _synced(modes: tuple[str, ...]) -> tuple[str, ...]:
    """The class reduces every micro-batch; the reference averages what they accumulate."""
    return ("require_backward_grad_sync",) * (len(modes) - 1) + ("sync",)


def micro_batches(wrapper: object) -> object:
    # Every micro-batch reduces (the class has no no_sync); one finish per step.
    @given(training_scenarios(model, batch, micro_batches=2), schedules())
    def test(scenario: TrainingScenario, schedule: fakepg.Schedule) -> None:
        check_data_parallel(
            wrapper,  # type: ignore[arg-type]
            replace(scenario, micro_batches=tuple(map(_synced, scenario.micro_batches or ()))),
            train_step=two_micro_batches_then_finish,
            schedule=schedule,
        )

    return test


@pytest.mark.slow  # finding and shrinking take tens of seconds
def test_a_bucket_refilled_while_in_flight_is_caught() -> None:
    with pytest.raises(AssertionError, match=RACE):
        micro_batches(BucketRewritten)()  # type: ignore[operator]


def test_waiting_before_refilling_a_bucket_passes() -> None:
    micro_batches(WaitsBeforeRefilling)()  # type: ignore[operator]


def hook_under_schedules(hook: object) -> object:
    @given(training_scenarios(model, batch), schedules())
    def test(scenario: object, schedule: fakepg.Schedule) -> None:
        check_comm_hook(hook, scenario, schedule=schedule)  # type: ignore[arg-type]

    return test


@pytest.mark.slow  # finding and shrinking take tens of seconds
def test_a_hook_dividing_in_flight_is_caught() -> None:
    with pytest.raises(AssertionError, match=RACE):
        hook_under_schedules(divide_in_flight_hook)()  # type: ignore[operator]


def test_a_hook_dividing_first_passes() -> None:
    hook_under_schedules(divide_first_hook)()  # type: ignore[operator]
