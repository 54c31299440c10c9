"""Training-step time of this reducer against torch's DistributedDataParallel, on 2 gloo ranks.

Two processes on this machine (gloo over loopback) train the models of
``reducer_overhead.py``. Per model, five variants run interleaved step by step, so that drift
and noise affect all alike: a plain local step (no communication, the floor); this reducer
over ``reducer.TorchProcessGroup`` with the default settings and with
``gradient_as_bucket_view``; and torch's DDP with the same two settings (bucket cap 25 MiB,
first bucket 1 MiB, on both). A step is zero_grad (set_to_none=False), forward, loss and
backward, including the reducer's prepare_for_backward and the wait for every allreduce; the
ranks meet at an untimed barrier before each step. Each rank uses cores / 2 intra-op threads
(--threads), as torchrun's OMP_NUM_THREADS does, so the ranks do not fight over the cores.
Rank 0 reports medians, the ratio of each reducer variant's median to that of torch's DDP
with the same settings, and the median of the per-step ratios (paired steps, less noisy).

    python benchmarks/ddp_vs_torch.py [--steps 60] [--batch 32] [--bucket-cap-mb 25] [--threads N]
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, median_ms, table
from models import MODELS, batch

import reducer

WORLD_SIZE = 2
WARMUP = 5


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
    variants: dict[
        str, tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor], Callable[[], None]]
    ] = {}
    variants["plain (local)"] = (base, base, lambda: None)
    reducers = []
    for view in (False, True):
        model = copy_of()
        params = list(model.parameters())
        buckets = reducer.ddp_bucket_assignment(params, bucket_cap_mb=args.bucket_cap_mb)
        red = reducer.Reducer([params], buckets, pg, gradient_as_bucket_view=view)
        reducers.append(red)
        variants[f"reducer{' views' if view else ''}"] = (
            model,
            model,
            lambda r=red: r.prepare_for_backward([]),
        )
    for view in (False, True):
        model = copy_of()
        ddp = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=view
        )
        variants[f"torch DDP{' views' if view else ''}"] = (model, ddp, lambda: None)

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
    for red in reducers:
        red.close()

    med = {label: median_ms(s) for label, s in samples.items()}
    versus = {
        "reducer": "torch DDP",
        "reducer views": "torch DDP views",
    }
    rows: list[list[object]] = []
    for label in variants:
        ratio = paired = ""
        if label in versus:
            theirs = samples[versus[label]]
            ratio = f"{med[label] / med[versus[label]]:.2f}x"
            # Steps of the two variants ran back to back: the median of their per-step ratios
            # cancels drift that shifts both.
            per_step = [a / b for a, b in zip(samples[label], theirs, strict=True)]
            paired = f"{statistics.median(per_step):.2f}x"
        rows.append([name if not rows else "", label, med[label], ratio, paired])
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
            headers = [
                "model",
                "variant",
                "step ms",
                "vs torch DDP (same settings)",
                "median per-step ratio",
            ]
            print(table(headers, rows))
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
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
            raise SystemExit(f"ddp_vs_torch: the ranks did not finish within {args.timeout:g} s")


if __name__ == "__main__":
    main()
