"""Did my ranks stay in sync? A check of the data-parallel invariants of any training script
run on rank threads of the fake world, at every optimizer step, whatever does the reduction
(torch's DistributedDataParallel, this project's, FSDP2, a hand-written all_reduce).

Before each ``optimizer.step()``: every replicated parameter and every gradient is
bit-identical on every rank (the fake world reduces in one order, so any difference is a
bug); where they differ, why (no reduction since the last step: the wrapper's forward did not
run, ran under ``no_sync`` or with ``require_backward_grad_sync=False``, or only some ranks
reduced); where a wrapper reduced, each gradient is the exact rank-order average of the ranks'
local gradients (a missing or doubled division, or an unreduced bucket, is named); more than
one reduction between two steps is a warning. After it: the parameters are bit-identical;
buffers that differ are a note. The first divergence stops every rank (:class:`RanksDiverged`,
exit code :data:`DIVERGED_EXIT_CODE` under ``python -m reducer launch``).

    python -m reducer launch --nproc 2 train.py          # checked (--no-check to turn off)

    from reducer.tools.check import run_checked
    check = run_checked(train, world_size=2)             # train(pg) on 2 rank threads
    assert not check.diverged, check.summary()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TextIO, TypeVar

from ._audit import Finding
from ._check import DIVERGED_EXIT_CODE, RanksDiverged, ReplicaCheck

__all__ = ["DIVERGED_EXIT_CODE", "Finding", "RanksDiverged", "ReplicaCheck", "run_checked"]

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
