"""Property 8: any training step, checked against a reference algorithm.

- Gradient accumulation: torch's DDP and this project's, over 1 to 3 micro-batches per step,
  the last one synced, the others not (``no_sync()``, or ``require_backward_grad_sync =
  False`` as nanoGPT sets it), ``zero_grad`` to None or to zeros,
  optional branches unused per rank and micro-batch: at each optimizer step every rank's
  gradients are what the reference accumulates and averages at each synced micro-batch (any
  of torch's roundings), and the parameters after SGD follow. A step that ends unsynced,
  followed by one that does not use what it used, is where both part from the reference
  (pinned at the end).
- Post-local SGD: this project's DDP with its ``post_localSGD_hook`` (gradients over every
  rank until ``start_localSGD_iter``, then within subgroups of consecutive ranks) and torch's
  ``PeriodicModelAverager`` after each optimizer step equal
  :func:`reducer.testing.periodic_averaging`, bit for bit, for any world size, subgroup size,
  warm-up and period drawn.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer

import reducer
from reducer.testing import (
    TrainingScenario,
    check_data_parallel,
    periodic_averaging,
    reducer_ddp,
    torch_ddp,
)
from reducer.testing.harness import note_size
from reducer.testing.model import BranchSpec, ModelSpec, branch_inputs, build_model, loss_of

from .test_wrappers import wrapper_scenarios

# Accumulation as training loops do it: the last micro-batch of each step synced. (A step that
# ends unsynced is where both DDPs part from the reference on a parameter used only there:
# pinned below.)
_MICRO = OUR_MICRO = wrapper_scenarios(
    buffers=False, ignore=False, micro_batches=3, max_world_size=3, sync_last_only=True
)


def _note(s: TrainingScenario) -> None:
    note_size(len(list(s.make_model().parameters())), s.world_size)


def check_micro_batches_torch(s: TrainingScenario) -> None:
    check_data_parallel(torch_ddp(), s)


def check_micro_batches_ours(s: TrainingScenario) -> None:
    check_data_parallel(reducer_ddp(), s)


@settings(max_examples=max(5, settings().max_examples // 2))
@given(_MICRO)
def test_torch_ddp_accumulates_micro_batches_exactly(s: TrainingScenario) -> None:
    _note(s)
    check_micro_batches_torch(s)


@given(OUR_MICRO)
def test_this_projects_ddp_accumulates_micro_batches_exactly(s: TrainingScenario) -> None:
    _note(s)
    check_micro_batches_ours(s)


LR = 0.1


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


LocalSGDCase = tuple[TrainingScenario, int, int, int]


@st.composite
def local_sgd_cases(draw: st.DrawFn) -> LocalSGDCase:
    """(scenario of an MLP, subgroup size, start_localSGD_iter = the averager's warm-up,
    period). World sizes 1, 2, 4 and 3 (shrinking in that order)."""
    world = draw(st.sampled_from([1, 2, 4, 3]))
    group = draw(st.sampled_from([g for g in (1, 2, 4, 3) if world % g == 0]))
    start = draw(st.integers(0, 2))
    period = draw(st.integers(1, 3))
    steps = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**16))
    spec = ModelSpec((BranchSpec("mlp"),), seed=seed)
    everything = frozenset({0})
    inputs = tuple(
        tuple((branch_inputs(spec, seed + 101 * r + 7 * k), everything) for r in range(world))
        for k in range(steps)
    )
    s = TrainingScenario(functools.partial(build_model, spec), inputs, loss=loss_of)
    return s, group, start, period


def check_post_local_sgd(case: LocalSGDCase) -> None:
    s, group, start, period = case

    def make(module: nn.Module, pg: reducer.ProcessGroup) -> nn.Module:
        ddp = reducer.DistributedDataParallel(module, pg)
        ranks = range(pg.size())
        # Every rank creates every subgroup, in the same order (as torch's new_subgroups).
        made = [pg.new_group(list(ranks[k : k + group])) for k in range(0, len(ranks), group)]  # type: ignore[attr-defined]
        sub = next(g for g in made if g is not None)
        state = reducer.PostLocalSGDState(None, subgroup=sub, start_localSGD_iter=start)
        ddp.register_comm_hook(state, reducer.post_localSGD_hook)
        return ddp

    def optimizer(params: list[nn.Parameter]) -> Any:
        return PostLocalSGDOptimizer(_sgd(params), PeriodicModelAverager(period, start))

    want = periodic_averaging(period, warmup_steps=start, gradient_group_size=group, optimizer=_sgd)
    check_data_parallel(make, s, optimizer=optimizer, reference=want)


@given(local_sgd_cases())
def test_post_local_sgd_is_periodic_averaging(case: LocalSGDCase) -> None:
    note_size(len(list(case[0].make_model().parameters())), case[0].world_size)
    check_post_local_sgd(case)


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.a, self.b = nn.Linear(2, 1), nn.Linear(2, 1)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.a(x) + self.b(x) if use_b else self.a(x)


def _used_only_in_an_unsynced_step() -> TrainingScenario:
    """Step 0 ends unsynced and uses head ``b``; ``zero_grad`` clears it; step 1 syncs and no
    rank uses ``b``: the reference expects no gradient for it."""

    def x(seed: int) -> torch.Tensor:
        return torch.randn(3, 2, generator=torch.Generator().manual_seed(seed))

    inputs = ((((x(0), True),), ((x(1), True),)), (((x(2), False),), ((x(3), False),)))
    modes = (("no_sync",), ("sync",))
    options = {"find_unused_parameters": True}
    return TrainingScenario(_TwoHeads, inputs, micro_batches=modes, options=options)


def test_torch_ddp_fails_on_a_parameter_used_only_in_an_unsynced_step() -> None:
    # torch's reducer reduces b's bucket slot as if b were used, finds no gradient there and
    # trips its own internal check ("please report a bug").
    with pytest.raises(RuntimeError, match="gradient which is undefined, but still allreduced"):
        check_data_parallel(torch_ddp(), _used_only_in_an_unsynced_step())


def test_this_projects_ddp_gives_zeros_to_a_parameter_used_only_in_an_unsynced_step() -> None:
    # This project's treats b as used too, and writes a zero gradient where none is due (an
    # optimizer with momentum or weight decay would then move it).
    with pytest.raises(
        AssertionError, match=r"step 1, parameter 2 \('b.weight'\).*expected no gradient"
    ):
        check_data_parallel(reducer_ddp(), _used_only_in_an_unsynced_step())
