"""Property: a callback runs in its rank (Note [Callbacks run in their rank] in fakepg._homes).

A future's done-callbacks run on the rank's completion lanes, threads of the fake world, not
on the rank's own thread; a gloo process runs them in the rank's process. Whatever chain of
callbacks a rank builds, with or without a controlled schedule, each one must see the rank's
torch.distributed state (``get_rank``, ``get_world_size``, the default group, through which
it may issue a collective) and draw from the rank's random stream, as it would there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import fakepg
from reducer.testing import schedules

Seen = tuple[int, int, float, float]  # rank, world size, a collective's sum, a random draw


def chained_callbacks(
    depth: int, collective: bool
) -> Callable[[fakepg.FakeProcessGroup], list[Seen]]:
    """Each rank seeds its generator with its rank, then chains ``depth`` callbacks to an
    async all_reduce; each records what it sees and, with ``collective``, all_reduces a one
    through the default group from inside the callback."""

    def fn(_pg: fakepg.FakeProcessGroup) -> list[Seen]:
        torch.manual_seed(dist.get_rank())
        seen: list[Seen] = []

        def callback(_f: object) -> None:
            total = -1.0
            if collective:
                t = torch.ones(1)
                dist.all_reduce(t)
                total = float(t.item())
            seen.append((dist.get_rank(), dist.get_world_size(), total, torch.rand(1).item()))

        work = dist.all_reduce(torch.ones(1), async_op=True)
        assert work is not None
        future = work.get_future()
        for _ in range(depth):
            future = future.then(callback)
        future.wait()
        return seen

    return fn


def callbacks_run_in_their_rank(
    world_size: int, depth: int, collective: bool, schedule: fakepg.Schedule | None
) -> None:
    got = fakepg.run_torch(
        chained_callbacks(depth, collective), world_size, schedule=schedule, timeout=20
    )
    for rank, seen in enumerate(got):
        torch.manual_seed(rank)
        draws = [torch.rand(1).item() for _ in range(depth)]  # the rank's own stream
        total = float(world_size) if collective else -1.0
        assert seen == [(rank, world_size, total, d) for d in draws], (rank, seen)


@given(
    world_size=st.integers(1, 4),
    depth=st.integers(1, 3),
    collective=st.booleans(),
    schedule=st.none() | schedules(),
)
@settings(max_examples=15, deadline=None)
def test_callbacks_run_in_their_rank(
    world_size: int, depth: int, collective: bool, schedule: fakepg.Schedule | None
) -> None:
    callbacks_run_in_their_rank(world_size, depth, collective, schedule)
