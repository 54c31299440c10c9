"""Step time of reducer.DistributedDataParallel against torch's DDP, option by option, 2 gloo ranks.

Two processes on this machine (gloo over loopback) train the models of ``models.py``. Per
model, the variants run interleaved step by step, so that drift and noise affect all alike:
the bare ``reducer.Reducer`` (the anchor: what the wrapper adds is the difference), then this
wrapper and torch's DDP with the same settings: default, ``gradient_as_bucket_view``,
``find_unused_parameters``, ``static_graph``, and the fp16 compression comm hook. Both
wrappers rebuild their buckets after the first step (inside the warmup). A step is zero_grad
(set_to_none=False), forward, loss and backward, including the wait for every allreduce; the
ranks meet at an untimed barrier before each step. Each rank uses cores / 2 intra-op threads.
Rank 0 reports medians and, per option, the median of the per-step ratios of this wrapper to
torch's DDP (paired steps, less noisy than the ratio of medians).

    python benchmarks/ddp_wrapper.py [--steps 40] [--batch 32] [--bucket-cap-mb 25] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, median_ms, table
from models import MODELS, batch

import reducer

WORLD_SIZE = 2
WARMUP = 5
# option label -> keyword arguments for both wrappers, and whether to register the fp16 hook
OPTIONS: dict[str, tuple[dict[str, bool], bool]] = {
    "default": ({}, False),
    "gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, False),
    "find_unused_parameters": ({"find_unused_parameters": True}, False),
    "static_graph": ({"static_graph": True}, False),
    "fp16_compress_hook": ({}, True),
}

Step = tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor], Callable[[], None]]


def measure(name: str, args: argparse.Namespace, rank: int) -> list[list[object]]:
    build, width = MODELS[name]
    torch.manual_seed(0)
    base = build()
    x = batch(width, args.batch, seed=rank)
    pg = reducer.TorchProcessGroup(dist.group.WORLD)  # type: ignore[arg-type]

    def copy_of() -> nn.Module:
        model = build()
        model.load_state_dict(base.state_dict())
        return model

    # label -> (module whose grads are zeroed, forward callable, before-backward hook)
    variants: dict[str, Step] = {}
    anchor = copy_of()
    params = list(anchor.parameters())
    bare = reducer.Reducer(
        [params], reducer.ddp_bucket_assignment(params, bucket_cap_mb=args.bucket_cap_mb), pg
    )
    variants["bare Reducer (anchor)"] = (anchor, anchor, lambda: bare.prepare_for_backward([]))
    ours_of: dict[str, str] = {}
    for option, (kwargs, fp16) in OPTIONS.items():
        ours_model, theirs_model = copy_of(), copy_of()
        ours = reducer.DistributedDataParallel(
            ours_model, pg, bucket_cap_mb=args.bucket_cap_mb, **kwargs
        )
        theirs = nn.parallel.DistributedDataParallel(
            theirs_model, bucket_cap_mb=args.bucket_cap_mb, **kwargs
        )
        if fp16:
            ours.register_comm_hook(None, reducer.fp16_compress_hook)
            theirs.register_comm_hook(None, default_hooks.fp16_compress_hook)
        variants[f"this DDP, {option}"] = (ours_model, ours, lambda: None)
        variants[f"torch DDP, {option}"] = (theirs_model, theirs, lambda: None)
        ours_of[f"this DDP, {option}"] = f"torch DDP, {option}"

    samples: dict[str, list[float]] = {k: [] for k in variants}
    for step in range(args.steps + WARMUP):
        for label, (model, forward, prepare) in variants.items():
            model.zero_grad(set_to_none=False)
            dist.barrier()  # untimed: both ranks start the step together
            t0 = time.perf_counter()
            loss = forward(x).sum()
            prepare()
            loss.backward()
            elapsed = time.perf_counter() - t0
            if step >= WARMUP:
                samples[label].append(elapsed)
    bare.close()

    anchor_ms = median_ms(samples["bare Reducer (anchor)"])
    rows: list[list[object]] = []
    for label in variants:
        paired = ""
        if label in ours_of:
            theirs = samples[ours_of[label]]
            per_step = [a / b for a, b in zip(samples[label], theirs, strict=True)]
            paired = f"{statistics.median(per_step):.2f}x"
        med = median_ms(samples[label])
        rows.append([name if not rows else "", label, med, f"{med / anchor_ms:.2f}x", paired])
    return rows


def rank_main(rank: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=300)
    )
    try:
        rows = [row for name in MODELS for row in measure(name, args, rank)]
        if rank == 0:
            print(
                f"# step time (forward + backward + reduction), {WORLD_SIZE} gloo ranks on "
                f"loopback, batch {args.batch}, bucket cap {args.bucket_cap_mb:g} MiB, "
                f"median of {args.steps} steps"
            )
            print(f"# machine: {machine()}\n")
            headers = ["model", "variant", "step ms", "vs anchor", "this / torch (paired)"]
            print(table(headers, rows))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parser.add_argument(
        "--threads",
        type=int,
        default=max(1, (cores or 1) // WORLD_SIZE),
        help="intra-op threads per rank (default: cores / ranks, as torchrun's OMP_NUM_THREADS)",
    )
    args = parser.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    context = mp.spawn(rank_main, args=(args, port), nprocs=WORLD_SIZE, join=False)
    deadline = time.monotonic() + args.timeout
    # join() re-raises a rank's failure here; the deadline keeps a hung rank from hanging us.
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
                process.join(5.0)
            raise SystemExit(f"ddp_wrapper: the ranks did not finish within {args.timeout:g} s")


if __name__ == "__main__":
    main()
