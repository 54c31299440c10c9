"""reducer: PyTorch's DDP gradient reducer in Python, against an abstract process group.

import fakepg, reducer, torch

def train_step(pg):
    torch.manual_seed(0)                       # the same model on every rank
    model = torch.nn.Linear(8, 2)
    params = list(model.parameters())
    buckets = reducer.compute_bucket_assignment_by_size(params, [1 << 20])
    with reducer.Reducer([params], buckets, pg) as r:
        r.prepare_for_backward([])
        model(torch.randn(4, 8) * (pg.rank() + 1)).sum().backward()
    return model.weight.grad                   # the average over ranks, on every rank

fakepg.run(train_step, world_size=4)
"""

from __future__ import annotations

# First: refuse a torch older than the supported range before any module below uses it.
from . import _torch_version as _torch_version

# isort: split
from .buckets import (
    compute_bucket_assignment_by_size,
    ddp_bucket_assignment,
    sparse_gradient_flags,
)
from .comm_hook import CommHook, GradBucket
from .ddp import DDPLoggingData, DistributedDataParallel
from .errors import (
    BucketAssignmentError,
    InvalidArgument,
    InvalidArgumentType,
    InvalidModel,
    MixedBucketError,
    ReducerError,
    ReductionError,
)
from .hooks import (
    PostLocalSGDState,
    PowerSGDState,
    allreduce_hook,
    batched_powerSGD_hook,
    bf16_compress_hook,
    bf16_compress_wrapper,
    fp16_compress_hook,
    fp16_compress_wrapper,
    post_localSGD_hook,
    powerSGD_hook,
)
from .process_group import ProcessGroup, ReduceOp, Work
from .reducer import Reducer
from .stats import IterationStats
from .torch_backend import TorchCollectiveError, TorchCollectiveTimeout, TorchProcessGroup

__all__ = [
    "BucketAssignmentError",
    "CommHook",
    "DDPLoggingData",
    "DistributedDataParallel",
    "GradBucket",
    "InvalidArgument",
    "InvalidArgumentType",
    "InvalidModel",
    "IterationStats",
    "MixedBucketError",
    "PostLocalSGDState",
    "PowerSGDState",
    "ProcessGroup",
    "ReduceOp",
    "Reducer",
    "ReducerError",
    "ReductionError",
    "TorchCollectiveError",
    "TorchCollectiveTimeout",
    "TorchProcessGroup",
    "Work",
    "allreduce_hook",
    "batched_powerSGD_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "compute_bucket_assignment_by_size",
    "ddp_bucket_assignment",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
    "post_localSGD_hook",
    "powerSGD_hook",
    "sparse_gradient_flags",
]
