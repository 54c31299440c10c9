"""torch's ``fp16_compress_hook`` before and after its overflow fix.

Source: pytorch/pytorch, ``torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py``.
The bug: each rank's bucket was cast to float16 and summed over ranks there, and the sum
divided by the world size afterwards, so gradients whose sum passes 65504 came back inf
although each rank's share fits. Fixed by pull request #59576 ("Apply division first to avoid
overflow", June 2021, a reland of #59522): divide, then sum. Re-written here from that
description (the hook's contract: ``(state, bucket) -> Future[Tensor]``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _compressed(
    process_group: object, bucket: dist.GradBucket, divide_first: bool
) -> torch.futures.Future[torch.Tensor]:
    group = process_group if process_group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)  # type: ignore[arg-type]
    buffer = bucket.buffer()
    half = buffer.to(torch.float16)
    if divide_first:
        half.div_(world_size)
    work = dist.all_reduce(half, group=group, async_op=True)  # type: ignore[arg-type]

    def decompress(future: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        total = future.value()[0]
        return buffer.copy_(total if divide_first else total.div_(world_size))

    return work.get_future().then(decompress)  # type: ignore[union-attr]


def fp16_compress_hook_before_fix(
    process_group: object, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Sum in float16, then divide (the bug)."""
    return _compressed(process_group, bucket, divide_first=False)


def fp16_compress_hook_fixed(
    process_group: object, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Divide, then sum in float16 (the fix)."""
    return _compressed(process_group, bucket, divide_first=True)


# torch's DDP reads a hook's annotations; ``from __future__ import annotations`` makes
# strings of them.
for _hook in (fp16_compress_hook_before_fix, fp16_compress_hook_fixed):
    _hook.__annotations__ = {
        "process_group": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
