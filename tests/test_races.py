"""Races written as users write them, made repeatable by the fake world's schedule.

Each buggy version fails under a schedule that Hypothesis finds and shrinks, on every one of
20 runs of that schedule; each fixed version passes every schedule drawn. The wrappers and
hooks below are the shapes found in systems-course DDP implementations and in comm hooks
modelled on torch's (``allreduce_hook``, ``quantization_pertensor_hook``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import find, given, settings
from torch import Tensor, nn

import fakepg
from reducer.testing import (
    TrainingScenario,
    check_comm_hook,
    check_data_parallel,
    fewest_deviations,
    schedules,
    sum_then_divide,
)

FIND = settings(max_examples=300, database=None, deadline=None)
PASS = settings(max_examples=15, database=None, deadline=None)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _inputs(world_size: int, steps: int) -> tuple[tuple[tuple[Tensor], ...], ...]:
    g = torch.Generator().manual_seed(1)
    return tuple(
        tuple((torch.randn(2, 4, generator=g),) for _ in range(world_size)) for _ in range(steps)
    )


SCENARIO = TrainingScenario(_model, _inputs(2, 1))
# torch 2.13 buckets a first backward by bucket_cap_mb only when it looks for unused parameters.
OPTIONS = {"bucket_cap_mb": 1e-5, "find_unused_parameters": True}
TWO_BUCKETS = TrainingScenario(_model, _inputs(2, 1), options=OPTIONS)


def _shrunk(check: Callable[[fakepg.Schedule], None]) -> fakepg.Schedule:
    """The smallest schedule Hypothesis finds under which ``check`` fails."""

    def fails(schedule: fakepg.Schedule) -> bool:
        try:
            check(schedule)
        except Exception:  # a wrong result, a desync, a deadlock, whatever the race causes
            return True
        return False

    return fewest_deviations(find(schedules(), fails, settings=FIND), fails)


def _repeatable(
    check: Callable[[fakepg.Schedule], None], schedule: fakepg.Schedule, *, exact: bool = True
) -> str:
    """``check`` fails on every one of 20 runs of ``schedule`` (``exact``: with the same first
    line every time); the first failure's first line."""
    messages = []
    for _ in range(20):
        replay = fakepg.Schedule(schedule.choices, adversarial=schedule.adversarial)
        with pytest.raises(Exception) as failure:  # noqa: PT011 - whatever the race causes
            check(replay)
        messages.append(str(failure.value).splitlines()[0])
    if exact:
        assert len(set(messages)) == 1, "\n".join(sorted(set(messages)))
    return messages[0]


# -------------------------------------------------------------------------------------------
# (a) A comm hook that divides the bucket while its all_reduce is in flight.


# Hooks are unannotated: torch refuses any annotation but its own classes (`from __future__
# import annotations` makes them strings).
def divide_in_flight_hook(state, bucket):  # type: ignore[no-untyped-def]
    t = bucket.buffer()
    fut = dist.all_reduce(t, async_op=True).get_future()
    t.div_(dist.get_world_size())  # BUG: the all_reduce may not have read t yet
    return fut.then(lambda f: f.value()[0])


def divide_first_hook(state, bucket):  # type: ignore[no-untyped-def]
    t = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])


@pytest.mark.slow
def test_a_divide_racing_the_all_reduce_fails_every_time_shrunk() -> None:
    def check(schedule: fakepg.Schedule) -> None:
        check_comm_hook(divide_in_flight_hook, SCENARIO, schedule=schedule)

    schedule = _shrunk(check)
    assert sum(1 for c in schedule.choices if c) == 1, schedule  # one switch from natural
    assert "not bitwise equal" in _repeatable(check, schedule)


@given(schedule=schedules())
@PASS
def test_a_dividing_before_the_all_reduce_passes_every_schedule(schedule: fakepg.Schedule) -> None:
    check_comm_hook(divide_first_hook, SCENARIO, schedule=schedule)


# -------------------------------------------------------------------------------------------
# (b) A hand-written DDP: per-parameter async all_reduce from post-accumulate-grad hooks,
# drained by finish_gradient_synchronization() at the end of backward.


class PerParameterDDP(nn.Module):
    def __init__(self, module: nn.Module, pg: object = None, *, wait_all: bool = True) -> None:
        super().__init__()
        self.module, self.wait_all, self.handles = module, wait_all, []
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._reduce)

    def forward(self, *args: Any) -> Any:
        return self.module(*args)

    def _reduce(self, p: Tensor) -> None:
        if not self.handles:  # the first hook of this backward: drain at its end
            engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
            engine.queue_callback(self.finish_gradient_synchronization)
        self.handles.append((dist.all_reduce(p.grad, async_op=True), p))

    def finish_gradient_synchronization(self) -> None:
        # The bug: an off-by-one that skips the last handle's wait.
        waited = self.handles if self.wait_all else self.handles[:-1]
        for handle, _ in waited:
            handle.wait()
        for _, p in self.handles:
            p.grad.div_(dist.get_world_size())
        self.handles = []


def _check_per_parameter(wait_all: bool, schedule: fakepg.Schedule) -> None:
    def make(module: nn.Module, pg: object) -> nn.Module:
        return PerParameterDDP(module, pg, wait_all=wait_all)

    check_data_parallel(make, SCENARIO, average=sum_then_divide, schedule=schedule)


@pytest.mark.slow
def test_b_a_forgotten_wait_fails_every_time_shrunk() -> None:
    def check(schedule: fakepg.Schedule) -> None:
        _check_per_parameter(False, schedule)

    schedule = _shrunk(check)
    assert sum(1 for c in schedule.choices if c) <= 2, schedule
    assert "not bitwise equal" in _repeatable(check, schedule)


@given(schedule=schedules())
@PASS
def test_b_waiting_on_every_handle_passes_every_schedule(schedule: fakepg.Schedule) -> None:
    _check_per_parameter(True, schedule)


# -------------------------------------------------------------------------------------------
# (c) A hook that issues its second collective from a callback (as torch's
# quantization_pertensor_hook does): the ranks' orders then follow their threads' timing.


def _finite_everywhere(t: Tensor) -> tuple[list[Tensor], Tensor]:
    flags = [torch.empty(1) for _ in range(dist.get_world_size())]
    return flags, torch.isfinite(t).all().float().reshape(1)


def reduce_in_callback_hook(state, bucket):  # type: ignore[no-untyped-def]
    group = dist.group.WORLD  # the callback runs on another thread: name the group
    t = bucket.buffer().div_(dist.get_world_size())
    flags, mine = _finite_everywhere(t)
    fut = dist.all_gather(flags, mine, async_op=True).get_future()

    def reduce(_: torch.futures.Future[Any]) -> Tensor:  # BUG: issued on the callback's thread
        assert all(f.item() == 1.0 for f in flags), "a rank overflowed: skip this step"
        return dist.all_reduce(t, group=group, async_op=True).get_future().wait()[0]

    return fut.then(reduce)


def reduce_in_hook_hook(state, bucket):  # type: ignore[no-untyped-def]
    t = bucket.buffer().div_(dist.get_world_size())
    flags, mine = _finite_everywhere(t)
    dist.all_gather(flags, mine)  # both collectives from the hook's own thread, in order
    assert all(f.item() == 1.0 for f in flags), "a rank overflowed: skip this step"
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])


@pytest.mark.slow
def test_c_collectives_issued_from_callbacks_desync_every_time_shrunk() -> None:
    def check(schedule: fakepg.Schedule) -> None:
        check_comm_hook(reduce_in_callback_hook, TWO_BUCKETS, schedule=schedule)

    schedule = _shrunk(check)
    assert sum(1 for c in schedule.choices if c) <= 2, schedule
    assert "ranks disagree on collective" in _repeatable(check, schedule)


@given(schedule=schedules())
@PASS
def test_c_collectives_issued_in_order_pass_every_schedule(schedule: fakepg.Schedule) -> None:
    check_comm_hook(reduce_in_hook_hook, TWO_BUCKETS, schedule=schedule)
