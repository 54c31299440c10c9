"""torch's DistributedDataParallel wrapper, around the core reducer.

What ``torch.nn.parallel.DistributedDataParallel`` adds to the C++ reducer lives here, as torch
keeps it in ``torch/nn/parallel/distributed.py``: the module wrapper and its setup (parameter
checks, the initial broadcast, ignored parameters), the output sink that finds unused outputs,
join for uneven inputs, mixed precision, static graph bookkeeping and logging. It builds on
the core (``reducer.reducer``, ``reducer.buckets``, ...) and on the built-in comm hooks
(``reducer.hooks``); the core never imports it.
"""

from __future__ import annotations

from reducer.ddp._logging import DDPLoggingData
from reducer.ddp._wrapper import DistributedDataParallel

__all__ = ["DDPLoggingData", "DistributedDataParallel"]
