"""No false verdicts: correct code with torch's DDP passes under every drawn schedule, with
collectives issued from a future's callback too, at 1 to 4 ranks: no ScheduleDeadlock, no
FlakyFailure (the same example deciding alike on every replay)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import fakepg
from reducer.testing import TrainingScenario, check_comm_hook, schedules


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


def _scenario(world_size: int, per_parameter: bool) -> TrainingScenario:
    g = torch.Generator().manual_seed(1)
    inputs = tuple(
        tuple((torch.randn(2, 4, generator=g),) for _ in range(world_size)) for _ in range(2)
    )
    # One bucket, or one bucket per parameter (torch buckets by the cap only when it looks
    # for unused parameters in its first iteration).
    options = {"bucket_cap_mb": 1e-6, "find_unused_parameters": True} if per_parameter else {}
    return TrainingScenario(_model, inputs, options=options)


def allreduce_in_callback_hook(state, bucket):  # type: ignore[no-untyped-def]
    """A quantization-style hook: a first collective from the hook, the second from its
    future's callback (correct with one bucket in flight at a time)."""
    t = bucket.buffer().div_(dist.get_world_size())
    flags = [torch.empty(1) for _ in range(dist.get_world_size())]
    fut = dist.all_gather(flags, torch.ones(1), async_op=True).get_future()

    def reduce(_: torch.futures.Future[Any]) -> Tensor:
        assert all(f.item() == 1.0 for f in flags)
        reduced: Tensor = dist.all_reduce(t, async_op=True).get_future().wait()[0]
        return reduced

    return fut.then(reduce)


def allreduce_hook(state, bucket):  # type: ignore[no-untyped-def]
    t = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(t, async_op=True).get_future().then(lambda f: f.value()[0])


@pytest.mark.slow
@given(
    world_size=st.integers(1, 4),
    hook=st.sampled_from([allreduce_hook, allreduce_in_callback_hook]),
    schedule=schedules(),
)
@settings(max_examples=1000, deadline=None, database=None)
def test_correct_hooks_pass_every_drawn_schedule(
    world_size: int, hook: Any, schedule: fakepg.Schedule
) -> None:
    # One bucket for the callback's collectives: with more, their order across ranks would
    # follow the ranks' callbacks (a real race, tests/test_races.py's third).
    per_parameter = hook is allreduce_hook and world_size % 2 == 0
    check_comm_hook(hook, _scenario(world_size, per_parameter), schedule=schedule, timeout=20)
