"""Run a function on the rank threads of a new fake world under a replica check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TextIO, TypeVar

from ._check import ReplicaCheck

__all__ = ["run_checked"]

T = TypeVar("T")


def run_checked(
    fn: Callable[[Any], T],
    world_size: int,
    *,
    timeout: float = 60.0,
    stop: bool = True,
    out: TextIO | None = None,
) -> ReplicaCheck:
    """Run ``fn(pg)`` on ``world_size`` rank threads of a new fake world, as
    ``fakepg.run_torch`` does (torch.distributed's default group on the fake world), under a
    :class:`ReplicaCheck`; the check, with the ranks' results in ``results`` (None when the
    check stopped the run). A failure of a rank that is not the check's is re-raised."""
    import torch.distributed as dist

    import fakepg

    with fakepg.World(world_size, timeout=timeout) as world:
        check = ReplicaCheck(world_size, world=world, stop=stop, out=out)

        def rank_main(pg: Any) -> T:
            rank = pg.rank()
            check.bind(rank)
            fakepg.init_torch_group(world, rank)
            try:
                return fn(pg)
            finally:
                try:
                    dist.destroy_process_group()
                finally:
                    check.unbind()
                    check.rank_ended(rank)

        with check:
            try:
                check.results = world.run(rank_main)
            except BaseException:
                if not check.stopped:
                    raise
                check.results = None
    return check
