"""Callbacks run in their rank: a future's callback and a comm hook's then() see the rank's
torch.distributed state and random generator, as on a gloo process."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fakepg
from reducer.testing import TrainingScenario, check_comm_hook


def test_a_futures_callback_sees_its_ranks_group_and_generator() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> tuple[int, int, int, bool, float]:
        torch.manual_seed(pg.rank())
        expected = torch.rand(1).item()
        torch.manual_seed(pg.rank())
        seen: list[tuple[int, int, int, bool, float]] = []

        def callback(_f: object) -> None:
            t = torch.ones(1)
            dist.all_reduce(t)  # a collective of the rank's default group, from its callback
            seen.append(
                (
                    dist.get_rank(),
                    dist.get_world_size(),
                    int(t.item()),
                    dist.group.WORLD is not None,
                    torch.rand(1).item(),
                )
            )

        work = dist.all_reduce(torch.ones(1), async_op=True)
        assert work is not None
        work.get_future().then(callback).wait()
        assert seen[0][4] == expected  # the rank's own stream
        return seen[0]

    out = fakepg.run_torch(fn, 3)
    assert [o[:4] for o in out] == [(r, 3, 3, True) for r in range(3)]


def world_size_in_then_hook(state, bucket):  # type: ignore[no-untyped-def]
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


@pytest.mark.parametrize("schedule", [None, fakepg.Schedule(), fakepg.Schedule(adversarial=True)])
def test_a_comm_hooks_then_callback_sees_its_ranks_world_size(
    schedule: fakepg.Schedule | None,
) -> None:
    g = torch.Generator().manual_seed(1)
    inputs = tuple(tuple((torch.randn(2, 4, generator=g),) for _ in range(2)) for _ in range(2))
    check_comm_hook(world_size_in_then_hook, TrainingScenario(_model, inputs), schedule=schedule)
