"""How well the what-if predictor (reducer.tools.whatif) predicts real gloo step times here.

1. Fit the link: two gloo processes over loopback time allreduces of 4 KiB to 64 MiB; a
   least-squares line (relative errors) t = a + b * S gives the alpha-beta model of a 2-rank ring
   (t = 2 alpha + S / B, so alpha = a / 2 and B = 1 / b).
2. Predict: measure one rank's backward on the fake world (what ``python -m reducer simulate
   --sweep-bucket-cap`` does: one rank, every step verified), then replay it per bucket cap
   for 2 ranks on the fitted link.
3. Measure: the same model, batches and reducer.DistributedDataParallel over gloo, 2 processes,
   each cap, steps interleaved across caps so that drift affects all alike; median step
   (zero_grad, forward, loss, backward with its reduction, SGD step) of rank 0.

Each process computes with one intra-op thread, as each simulated rank does. Rank 0 prints
the fitted link and, per cap, predicted and measured median step times and their ratio.

    python benchmarks/whatif_vs_gloo.py [--model mlp] [--width 1024] [--caps 0.25,1,5,25]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _gloo
from _common import interleave, machine, table

import fakepg
import reducer
from reducer.tools import simulate
from reducer.tools.simulate import models
from reducer.tools.whatif import BackwardProfile, sweep

WORLD_SIZE = _gloo.WORLD_SIZE
WARMUP = 3
SIZES = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def fit_link(
    repeats: int, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float, list[tuple[int, float]]]:
    """On rank 0 and 1: median allreduce time per size (by ``clock``); least-squares
    (alpha, B)."""
    medians = []
    for nbytes in SIZES:
        t = torch.zeros(nbytes // 4)
        samples = []
        for i in range(repeats + WARMUP):
            dist.barrier()
            t0 = clock()
            dist.all_reduce(t)
            if i >= WARMUP:
                samples.append(clock() - t0)
        medians.append((nbytes, statistics.median(samples)))
    # Weighted least squares, weights 1 / t^2: relative errors count, so that the small
    # sizes (latency) weigh as much as the large ones (bandwidth).
    points = [(float(n), t, 1.0 / t**2) for n, t in medians]
    total = sum(w for _, _, w in points)
    sx = sum(w * x for x, _, w in points)
    sy = sum(w * y for _, y, w in points)
    sxx = sum(w * x * x for x, _, w in points)
    sxy = sum(w * x * y for x, y, w in points)
    slope = (total * sxy - sx * sy) / (total * sxx - sx * sx)
    intercept = max(0.0, (sy - slope * sx) / total)
    return intercept / 2, 1 / slope, medians


def measure_gloo(args: argparse.Namespace, rank: int) -> dict[float | None, float]:
    """Median step (s) per cap of reducer.DistributedDataParallel on the gloo group, and of
    the plain module (key None: the same step without any reduction)."""
    pg = reducer.TorchProcessGroup(dist.group.WORLD)  # type: ignore[arg-type]
    variants: dict[float | None, tuple[Any, Any, torch.optim.Optimizer]] = {}
    for cap in [None, *args.caps]:
        module = models.build_model(args.model, args.width, args.seed)
        ddp = (
            module
            if cap is None
            else reducer.DistributedDataParallel(module, pg, bucket_cap_mb=cap)
        )
        optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
        variants[cap] = (module, ddp, optimizer)

    def timed_step(step: int, variant: tuple[Any, Any, torch.optim.Optimizer]) -> float:
        module, ddp, optimizer = variant
        generator = models.batch_generator(args.seed, rank, step, 0)
        x, y = module.make_batch(generator, args.batch_size)
        dist.barrier()  # untimed: both ranks start the step together
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = module.loss(ddp(x), y)
        loss.backward()
        optimizer.step()
        return time.perf_counter() - t0

    samples = interleave(variants, args.steps, WARMUP, timed_step)
    for _, ddp, _ in variants.values():
        if isinstance(ddp, reducer.DistributedDataParallel):
            ddp.reducer.close()
    return {cap: statistics.median(s) for cap, s in samples.items()}


def rank_main(rank: int, args: argparse.Namespace, profile: BackwardProfile) -> None:
    alpha, bandwidth, points = fit_link(args.repeats)
    measured = measure_gloo(args, rank)
    if rank != 0:
        return
    link = fakepg.AlphaBeta(alpha, bandwidth, "ring", "gloo loopback (fitted)")
    print(f"# machine: {machine()}")
    print(f"# model {args.model}, width {args.width}, batch {args.batch_size}, 2 ranks")
    print(f"# link fitted from {len(points)} sizes: {link}")
    fit_rows = [
        [f"{n >> 10} KiB", s * 1e3, link.collective_time_s("allreduce", n, 2) * 1e3]
        for n, s in points
    ]
    print(table(["allreduce", "gloo ms", "fitted model ms"], fit_rows))
    print()
    rows: list[list[object]] = []
    no_comm = sweep(profile, args.caps, WORLD_SIZE, None)
    for p, alone in zip(sweep(profile, args.caps, WORLD_SIZE, link), no_comm, strict=True):
        real = measured[p.bucket_cap_mb] * 1e3
        rows.append(
            [
                f"{p.bucket_cap_mb:g}",
                len(p.bucket_nbytes),
                alone.step_ns / 1e6,
                p.step_ns / 1e6,
                real,
                f"{p.step_ns / 1e6 / real:.2f}",
            ]
        )
    headers = [
        "bucket cap MiB",
        "buckets",
        "predicted, no comm ms",
        "predicted ms",
        "gloo measured ms",
        "predicted / measured",
    ]
    print(table(headers, rows))
    print(
        f"\nthe same step without any reduction, measured on the gloo ranks: "
        f"{measured[None] * 1e3:.1f} ms (the profile's compute: "
        f"{(profile.optimizer_ns + profile.forward_ns + max(profile.ready_ns)) / 1e6:.1f} ms)"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(models.MODELS), default="mlp")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--caps", default="0.25,1,5,25")
    parser.add_argument("--steps", type=int, default=20, help="measured steps per cap")
    parser.add_argument("--repeats", type=int, default=20, help="allreduces per size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1200.0)
    args = parser.parse_args(argv)
    args.caps = [float(c) for c in args.caps.split(",")]

    sim_parser = argparse.ArgumentParser()
    simulate.add_arguments(sim_parser)
    sim_args = sim_parser.parse_args(
        ["--model", args.model, "--width", str(args.width), "--batch-size", str(args.batch_size),
         "--steps", str(args.steps + 2), "--seed", str(args.seed), "--no-progress"]
    )  # fmt: skip
    result, profile = simulate.measure_profile(sim_args)
    if profile is None:
        raise SystemExit(f"whatif_vs_gloo: the measuring run failed: {result.failure}")

    # One intra-op thread per process, as each simulated rank has.
    _gloo.run("whatif_vs_gloo", rank_main, (args, profile), threads=1, timeout=args.timeout)


if __name__ == "__main__":
    main()
