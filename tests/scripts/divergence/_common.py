"""What the divergence scripts share: arguments, the process group, a tiny model, each rank's
batches, and the data-parallel wrapper (torch's DistributedDataParallel or this project's).

Every script runs as torchrun runs it, and under ``python -m reducer launch``:

    torchrun --nproc-per-node 2 module_bypass.py --ddp torch --variant buggy
    python -m reducer launch --nproc 2 module_bypass.py --ddp ours --variant fixed
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def parse(
    description: str, *, variants: tuple[str, ...] = ("buggy", "fixed")
) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--ddp", choices=["torch", "ours"], default="torch")
    parser.add_argument("--variant", choices=variants, default=variants[0])
    parser.add_argument("--steps", type=int, default=2)
    return parser.parse_args()


def setup() -> tuple[int, int]:
    """init_process_group from torchrun's environment; (rank, world size)."""
    dist.init_process_group(os.environ.get("BACKEND", "gloo"))
    return dist.get_rank(), dist.get_world_size()


def model(width: int = 8) -> nn.Module:
    """Seeded alike on every rank (DDP would broadcast rank 0's anyway)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 2))


def batch(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    """Different data on every rank, as a sampler would hand out."""
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(3, 4, generator=g)


def wrap(module: nn.Module, kind: str, **kwargs: Any) -> nn.Module:
    """torch's DistributedDataParallel, or this project's with the same arguments."""
    if kind == "torch":
        return nn.parallel.DistributedDataParallel(module, **kwargs)
    import reducer

    return reducer.DistributedDataParallel(module, **kwargs)


def finish(module: nn.Module) -> None:
    total = sum(float(p.detach().double().sum()) for p in module.parameters())
    print(f"param sum {total:.17g}")
    dist.destroy_process_group()
