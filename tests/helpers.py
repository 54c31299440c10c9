"""Helpers the unit tests share: worlds with short timeouts, models, local reference gradients."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn

import fakepg
import reducer
from reducer.testing.reference import rank_order_average

T = TypeVar("T")
M = TypeVar("M", bound=nn.Module)


def run_ranks(fn: Callable[[fakepg.FakeProcessGroup], T], world_size: int) -> list[T]:
    """fakepg.run with a short timeout, so a test that would hang fails quickly instead."""
    return fakepg.run(fn, world_size, timeout=20.0)


# torch's default generator is shared by every thread: rank threads that seed and build models
# at once would interleave its draws, so building takes this lock. Reentrant checkpointing
# sets and restores that generator's state during backward, outside the lock, so the tests
# that use it on rank threads pass preserve_rng_state=False (their models draw nothing).
_INIT_LOCK = threading.Lock()


def seeded(build: Callable[[], M], seed: int = 0) -> M:
    """``build()`` with the global generator seeded, safe to call from several rank threads."""
    with _INIT_LOCK:
        torch.manual_seed(seed)
        return build()


def mlp(seed: int = 0, widths: tuple[int, ...] = (6, 5, 4, 3)) -> nn.Sequential:
    """The same small MLP on every rank (same seed)."""

    def build() -> nn.Sequential:
        layers: list[nn.Module] = []
        for a, b in itertools.pairwise(widths):
            layers += [nn.Linear(a, b), nn.Tanh()]
        return nn.Sequential(*layers)

    return seeded(build, seed)


def rank_input(rank: int, shape: tuple[int, ...], step: int = 0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + rank))


def names_of(model: nn.Module) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def reducer_for(
    model: nn.Module, pg: reducer.ProcessGroup, cap_mb: float = 1e-4, **kwargs: object
) -> reducer.Reducer:
    """A Reducer over ``model`` with small buckets (several buckets even for a tiny model)."""
    params = list(model.parameters())
    buckets = reducer.ddp_bucket_assignment(params, bucket_cap_mb=cap_mb, first_bucket_mb=cap_mb)
    return reducer.Reducer([params], buckets, pg, param_names=names_of(model), **kwargs)  # type: ignore[arg-type]


def local_grads(
    build: Callable[[], nn.Module], loss_of: Callable[[nn.Module, int], torch.Tensor], rank: int
) -> list[torch.Tensor | None]:
    """The gradients plain autograd gives on ``rank`` (no reducer involved)."""
    model = build()
    loss_of(model, rank).backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def expected_average(
    build: Callable[[], nn.Module],
    loss_of: Callable[[nn.Module, int], torch.Tensor],
    world_size: int,
) -> list[torch.Tensor | None]:
    """Per parameter, the rank-order reference of DESIGN.md from local gradients."""
    per_rank = [local_grads(build, loss_of, r) for r in range(world_size)]
    return [
        rank_order_average([per_rank[r][i] for r in range(world_size)], world_size)
        for i in range(len(per_rank[0]))
    ]


# PowerSGD settings that the differential tests against torch's hook run, one per code path
# (error feedback, QR for rank > 1, batching, no error feedback).
POWERSGD_CONFIGS: dict[str, dict[str, object]] = {
    "rank 1, error feedback, warm start": {"matrix_approximation_rank": 1},
    "rank 3 (QR), no warm start": {
        "matrix_approximation_rank": 3,
        "warm_start": False,
        "min_compression_rate": 0.5,
    },
    "rank 2, batched same shapes": {
        "matrix_approximation_rank": 2,
        "batch_tensors_with_same_shape": True,
        "min_compression_rate": 0.5,
    },
    "rank 1, no error feedback, epsilon": {
        "matrix_approximation_rank": 1,
        "use_error_feedback": False,
        "orthogonalization_epsilon": 1e-8,
    },
}
