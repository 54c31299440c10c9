"""Rank 1 sleeps in C (time.sleep) while rank 0 waits for it in a barrier: after the timeout,
the launch cannot stop rank 1 and must say that it abandoned the thread."""

import time

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(60)
dist.barrier()
