"""The models the benchmarks share, built the same way in every script."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def many_small(depth: int = 100, width: int = 64) -> nn.Module:
    """``depth`` x [Linear(width, width), LayerNorm(width)]: 4 parameters per block (400)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width)]
    return nn.Sequential(*layers)


def few_large(depth: int = 8, width: int = 1024) -> nn.Module:
    """``depth`` x Linear(width, width): 16 parameters, 32 MiB of float32 for 8 x 1024."""
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


MODELS = {
    "400 params (100 x [Linear(64), LayerNorm(64)])": (many_small, 64),
    "8 x Linear(1024, 1024)": (few_large, 1024),
}


def batch(width: int, batch_size: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch_size, width, generator=torch.Generator().manual_seed(seed))


def with_copies(build: Callable[[], nn.Module]) -> tuple[nn.Module, Callable[[], nn.Module]]:
    """A model built under seed 0, and a function that builds more with the same weights (one
    per variant that a benchmark compares, so that all compute the same)."""
    torch.manual_seed(0)
    base = build()

    def copy_of() -> nn.Module:
        model = build()
        model.load_state_dict(base.state_dict())
        return model

    return base, copy_of
