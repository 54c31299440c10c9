"""Differential: ``reducer.powerSGD_hook`` in ``reducer.DistributedDataParallel`` against torch's
``powerSGD_hook`` in torch's ``DistributedDataParallel``, on two and three fake ranks.

Both wrappers run in the same rank threads of one fake world (the "fakepg" torch backend), on
copies of one model fed the same data, for five steps: two of warm-up (a plain allreduce),
then three compressed ones, whose memory (error feedback, warm start) carries over. Each rank
gives each wrapper a state of its own (``reducer.PowerSGDState``, torch's ``PowerSGDState``),
with the same hyperparameters.

The gradients must be bit-identical, on every rank and step, for any world size: the two
hooks do the same arithmetic in the same order. The reductions are the fake world's (rank
order, the same bits on every rank); both divide with ``div_(W)`` at the same points (the
buffer before the warm-up allreduce; the uncompressed gradients and the Qs after theirs; the
Ps not at all); the products and the orthogonalization are the same calls. The random initial
Qs are the same numbers: torch seeds its global generator with the state's next draw
(``manual_seed(state.rng.randint(1e9))``) and draws from it; reducer.hooks._powersgd seeds a
generator of its own with the same draw (see its docstring), and the fake world gives each
rank thread a global generator of its own, so no rank disturbs another's draws. The
difference that docstring lists, that torch issues its P and Q allreduces from future
callbacks and waits there while this hook issues them from the hook, changes where the
collectives are issued, not what they compute: every rank still issues them in the same
order (the model fits one bucket, as the test checks, so a rank's callbacks never race its
next bucket's hook). The fake world runs each rank's callbacks on threads of that rank's own,
which torch's hook needs (see Note [Completion lanes] in fakepg.completion).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import POWERSGD_CONFIGS, rank_input, seeded
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

import fakepg
import reducer

STEPS = 5
WARM_UP = 2


pytestmark = pytest.mark.usefixtures("fakepg_torch_backend")


class Layers(nn.Module):
    """Matrices PowerSGD compresses (8 x 16, two 8 x 8) and vectors it does not (biases)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        out: Tensor = self.d(torch.tanh(self.c(h)))
        return out


def layers() -> Layers:
    return seeded(Layers, seed=11)


def loss(model: nn.Module, rank: int, step: int) -> Tensor:
    out: Tensor = model(rank_input(rank, (5, 16), step))
    return out.pow(2).sum()


Trace = list[list[Tensor]]  # per step, the gradients


def run_both(world_size: int, config: dict[str, Any], *, wrap: bool) -> list[tuple[Trace, Trace]]:
    """Per rank: this wrapper's trace and torch's, step by step in the same rank thread."""
    kwargs = {"start_powerSGD_iter": WARM_UP, **config}

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[Trace, Trace]:
        ours, theirs = layers(), layers()
        ddp = reducer.DistributedDataParallel(ours, pg)
        torch_ddp = nn.parallel.DistributedDataParallel(theirs)
        our_hook: reducer.CommHook = reducer.powerSGD_hook
        their_hook: Any = torch_powersgd.powerSGD_hook
        if wrap:
            our_hook = reducer.fp16_compress_wrapper(our_hook)
            their_hook = default_hooks.fp16_compress_wrapper(their_hook)
        ddp.register_comm_hook(reducer.PowerSGDState(None, **kwargs), our_hook)
        torch_ddp.register_comm_hook(torch_powersgd.PowerSGDState(None, **kwargs), their_hook)
        traces: tuple[Trace, Trace] = ([], [])
        for step in range(STEPS):
            for model, wrapper, trace in ((ours, ddp, traces[0]), (theirs, torch_ddp, traces[1])):
                model.zero_grad(set_to_none=True)
                loss(wrapper, pg.rank(), step).backward()
                trace.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        assert ddp.reducer.bucket_indices == [list(range(7, -1, -1))]  # one bucket, as torch's
        return traces

    return fakepg.run_torch(fn, world_size, timeout=30.0)


def plain_average(world_size: int, step: int) -> list[Tensor]:
    """The uncompressed average of ``step``'s gradients (sum in rank order, then / W)."""
    per_rank = []
    for rank in range(world_size):
        model = layers()
        loss(model, rank, step).backward()
        per_rank.append([p.grad for p in model.parameters()])
    out = []
    for i in range(len(per_rank[0])):
        total = per_rank[0][i].clone()  # type: ignore[union-attr]
        for rank in range(1, world_size):
            total += per_rank[rank][i]  # type: ignore[operator]
        out.append(total / world_size)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("config", list(POWERSGD_CONFIGS))
def test_powersgd_matches_torchs_hook_in_torchs_ddp_bit_for_bit(
    world_size: int, config: str
) -> None:
    results = run_both(world_size, POWERSGD_CONFIGS[config], wrap=False)
    for rank, (ours, theirs) in enumerate(results):
        for step in range(STEPS):
            for i, (got, want) in enumerate(zip(ours[step], theirs[step], strict=True)):
                assert torch.equal(got, want), f"rank {rank}, step {step}, parameter {i}"
                assert torch.equal(got, results[0][0][step][i]), f"rank {rank} vs rank 0"
    # After warm-up the weight of ``a`` is compressed in every config: not the plain average.
    for step in range(WARM_UP, STEPS):
        assert not torch.equal(results[0][0][step][0], plain_average(world_size, step)[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_powersgd_in_the_fp16_wrapper_matches_torchs_bit_for_bit(world_size: int) -> None:
    results = run_both(
        world_size, POWERSGD_CONFIGS["rank 1, error feedback, warm start"], wrap=True
    )
    for rank, (ours, theirs) in enumerate(results):
        for step in range(STEPS):
            for i, (got, want) in enumerate(zip(ours[step], theirs[step], strict=True)):
                assert torch.equal(got, want), f"rank {rank}, step {step}, parameter {i}"
