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

from ._audit import Finding
from ._check import DIVERGED_EXIT_CODE, RanksDiverged, ReplicaCheck
from ._run import run_checked

__all__ = ["DIVERGED_EXIT_CODE", "Finding", "RanksDiverged", "ReplicaCheck", "run_checked"]
