"""A rank-dependent branch that deadlocks: rank 0 waits in an all_reduce that rank 1 never
issues, and rank 1 waits for a message rank 0 never sends."""

from __future__ import annotations

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)
dist.all_reduce(t)  # every rank takes part in this one
print(f"step 0 done: {t.item()}")
if rank == 0:
    dist.all_reduce(t)  # rank 1 never calls this
else:
    dist.recv(t, src=0)  # rank 0 never sends
dist.destroy_process_group()
