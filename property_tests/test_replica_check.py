"""Property 10: the replica check (``reducer.tools.check``) sees one bit on one rank.

Training scripts drawn as nanoGPT's are written: torch's DDP or this project's over 2 to 4
ranks (three often), an optimizer with one parameter group or two (weight decay on the
matrices only, nanoGPT's split), one synced step. With no fault the check must pass; with
one rank's gradient of one parameter moved by one unit in the last place after the
reduction (a rank whose reduction went wrong by a rounding), it must stop with "gradients
differ", whichever group the parameter is in: a check that compares with a tolerance, or
reads only the first parameter group, lets it pass. Or, with no fault, the ranks train a
drawn number of steps each under the wrapper's ``join()`` (uneven inputs): the check must
pass, with a note of the uneven inputs where the counts differ (a check that takes a rank
that ran out for a stalled one stops a correct run).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import event, given
from hypothesis import strategies as st
from torch import nn

import reducer
from reducer.tools.check import run_checked


@dataclass(frozen=True)
class CheckScenario:
    """One synced step. ``fault``: None, or (rank, parameter index) whose gradient that rank
    moves one ulp up before the optimizer step."""

    kind: str  # "torch" or "ours"
    world_size: int
    groups: int  # 1, or 2: weight decay on the matrices only
    fault: tuple[int, int] | None
    joined: tuple[int, ...] | None = None  # per rank, its steps under join() (no fault)


_PARAMS = 2  # the model below: a Linear layer's weight (decayed) and bias


@st.composite
def check_scenarios(draw: st.DrawFn) -> CheckScenario:
    world = draw(st.sampled_from([2, 3, 3, 4]))
    fault = None
    if draw(st.sampled_from([True, True, False])):  # a fault two times in three
        fault = (draw(st.integers(0, world - 1)), draw(st.integers(0, _PARAMS - 1)))
    joined = None
    if fault is None and draw(st.booleans()):
        joined = tuple(draw(st.integers(1, 3)) for _ in range(world))
    return CheckScenario(
        draw(st.sampled_from(["torch", "ours"])),
        world,
        draw(st.sampled_from([2, 1])),
        fault,
        joined,
    )


def _train(s: CheckScenario) -> Any:
    def train(pg: Any) -> None:
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        wrapper = (
            nn.parallel.DistributedDataParallel
            if s.kind == "torch"
            else reducer.DistributedDataParallel
        )
        ddp = wrapper(model)
        params = list(model.parameters())
        if s.groups == 1:
            optimizer = torch.optim.SGD(params, lr=0.1)
        else:
            decay = [p for p in params if p.dim() >= 2]
            rest = [p for p in params if p.dim() < 2]
            optimizer = torch.optim.SGD(
                [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                lr=0.1,
            )
        if s.joined is not None:
            with ddp.join():
                for k in range(s.joined[pg.rank()]):
                    seed = 100 * pg.rank() + k
                    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(seed))
                    ddp(x).square().mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
            return
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(100 * pg.rank()))
        ddp(x).square().mean().backward()
        if s.fault is not None and s.fault[0] == pg.rank():
            grad = params[s.fault[1]].grad
            assert grad is not None
            grad.copy_(torch.nextafter(grad, torch.full_like(grad, float("inf"))))
        optimizer.step()

    return train


def check_replica_check(s: CheckScenario) -> None:
    """The property: the check passes a clean step, and stops one with a one-ulp fault;
    under join, it passes, noting uneven inputs where the ranks' step counts differ."""
    check = run_checked(_train(s), world_size=s.world_size, timeout=20, out=io.StringIO())
    if s.fault is None:
        assert not check.diverged, check.findings
        if s.joined is not None:
            uneven = [f for f in check.findings if f.title == "uneven inputs"]
            assert bool(uneven) == (len(set(s.joined)) > 1), (s.joined, check.findings)
        return
    assert check.diverged, f"one ulp on rank {s.fault[0]}, parameter {s.fault[1]}: not seen"
    assert [e.title for e in check.errors] == ["gradients differ"], check.errors


@given(check_scenarios())
def test_the_replica_check_sees_one_bit_on_one_rank(s: CheckScenario) -> None:
    event(f"{s.kind}, {s.world_size} ranks, {s.groups} group(s), fault: {s.fault is not None}")
    if s.joined is not None:
        event(f"under join(), uneven inputs: {len(set(s.joined)) > 1}")
    check_replica_check(s)
