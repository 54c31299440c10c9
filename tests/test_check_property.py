"""The replica check as an oracle, on drawn gradient-accumulation schedules.

Each rank syncs on some of its micro-steps (``require_backward_grad_sync``), drawn per rank,
with torch's DDP or this project's, at 2 to 4 ranks. What the ranks end with follows from the
schedule alone: the last reduction averages whatever each rank accumulated, so the
gradients agree exactly when every rank syncs its last micro-step and all ranks sync equally
often (with unequal counts the reductions no longer pair up, and the rank with more waits for
one the others would issue only after the step). The check must say so: stop with an error
exactly then, naming the right kind, and warn of waste exactly when a rank synced more than
once. A check that compares only ranks 0 and 1 (a realistic slip) dies on a drawn schedule.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import reducer
from reducer.tools.check import ReplicaCheck, _audit, run_checked


@st.composite
def schedules(draw: st.DrawFn) -> tuple[int, list[list[bool]]]:
    """(world size, per rank: which micro-steps sync), one micro-step count for all ranks."""
    world = draw(st.integers(2, 4))
    micro = draw(st.integers(1, 3))
    pattern = st.lists(st.booleans(), min_size=micro, max_size=micro)
    common = draw(pattern)
    # The same schedule on every rank (the usual case), or one rank's own: the same syncs in
    # another order (the reductions still pair up), or any.
    ranks = [common] * world
    odd = draw(st.sampled_from(["none", "reordered", "any"]))
    if odd != "none":
        ranks = list(ranks)
        own = draw(st.permutations(common)) if odd == "reordered" else draw(pattern)
        ranks[draw(st.integers(0, world - 1))] = list(own)
    return world, ranks


def _train(kind: str, schedule: list[list[bool]]) -> Any:
    def train(pg: Any) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
        wrapper = (
            nn.parallel.DistributedDataParallel
            if kind == "torch"
            else reducer.DistributedDataParallel
        )
        ddp = wrapper(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for micro, synced in enumerate(schedule[pg.rank()]):
            ddp.require_backward_grad_sync = synced
            seed = 100 * pg.rank() + micro
            x = torch.randn(2, 3, generator=torch.Generator().manual_seed(seed))
            ddp(x).square().mean().backward()
        optimizer.step()

    return train


def check_schedule(kind: str, world: int, schedule: list[list[bool]]) -> ReplicaCheck:
    check = run_checked(_train(kind, schedule), world_size=world, timeout=20, out=io.StringIO())
    counts = [sum(s) for s in schedule]
    in_sync = all(s[-1] for s in schedule) and len(set(counts)) == 1
    assert check.diverged == (not in_sync), (schedule, check.findings)
    if in_sync:
        assert check.steps == 1 and not check.errors
        waste = [f for f in check.findings if f.level == "warning"]
        assert bool(waste) == (counts[0] > 1), check.findings
    else:
        [error] = check.errors
        expected = "only some ranks reduced" if len(set(counts)) > 1 else "gradients differ"
        assert error.title == expected, (schedule, error)
    return check


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["torch", "ours"]), drawn=schedules())
def test_the_check_agrees_with_the_schedule(kind: str, drawn: tuple[int, list[list[bool]]]) -> None:
    world, schedule = drawn
    check_schedule(kind, world, schedule)


@pytest.mark.slow
def test_a_check_that_compares_only_two_ranks_dies(monkeypatch: pytest.MonkeyPatch) -> None:
    differ, agree = _audit._differ, _audit._agree
    monkeypatch.setattr(_audit, "_differ", lambda values: differ(values[:2]))
    monkeypatch.setattr(_audit, "_agree", lambda per_rank: agree(per_rank[:2]))
    # Rank 2 alone skips the sync of the last micro-step: only ranks 0 and 1 agree.
    with pytest.raises(AssertionError):
        check_schedule("torch", 3, [[False, True], [False, True], [True, False]])

    # The search finds such a schedule by itself.
    @settings(
        max_examples=100, deadline=None, database=None, derandomize=True, phases=[Phase.generate]
    )
    @given(drawn=schedules())
    def search(drawn: tuple[int, list[list[bool]]]) -> None:
        check_schedule("torch", *drawn)

    with pytest.raises(AssertionError):
        search()
