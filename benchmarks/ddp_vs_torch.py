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
Two more variants wrap the model in ``reducer.DistributedDataParallel`` (``this DDP``, with
and without ``gradient_as_bucket_view``), the wrapper a user replaces torch's with. The
variants' order rotates from step to step. Rank 0 reports medians, the ratio of each variant's
median to that of torch's DDP with the same settings, and the median of the per-step ratios
(paired steps, less noisy), and the CPU time the rank's own thread spent in a step
(forward, backward with the reducer's hooks and copies, finalize; not gloo's threads, nor
time spent waiting), which other processes on the machine hardly move.

``--profile N`` then runs N more steps of ``this DDP`` (default settings) under cProfile on
both ranks and prints rank 0's functions by own time, and where its steps went (medians of
the reducer's iteration stats: the last gradient ready, each bucket's launch and completion,
finalize), all from the reducer's prepare_for_backward.

    python benchmarks/ddp_vs_torch.py [--steps 60] [--batch 32] [--bucket-cap-mb 25] [--threads N]
    python benchmarks/ddp_vs_torch.py --steps 0 --profile 100
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _gloo
from _common import Variant, median_ms, paired_ratio, reducer_and_torch_ddp
from models import MODELS, batch, with_copies

import reducer

# Each variant's row compares it with torch's DDP with the same settings.
VERSUS = {
    "reducer": "torch DDP",
    "reducer views": "torch DDP views",
    "this DDP": "torch DDP",
    "this DDP views": "torch DDP views",
}


def measure(name: str, args: argparse.Namespace, rank: int) -> list[list[object]]:
    build, width = MODELS[name]
    base, copy_of = with_copies(build)
    x = batch(width, args.batch, seed=rank)
    pg = reducer.TorchProcessGroup(dist.group.WORLD)  # type: ignore[arg-type]
    variants, reducers = reducer_and_torch_ddp(
        base, copy_of, pg, args.bucket_cap_mb, plain="plain (local)"
    )
    wrappers = []
    for view in (False, True):
        model = copy_of()
        ddp = reducer.DistributedDataParallel(
            model, pg, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=view
        )
        wrappers.append(ddp)
        variants[f"this DDP{' views' if view else ''}"] = (model, ddp, lambda: None)
    cpu: dict[str, list[float]] = {}
    if args.steps <= 0:
        samples: dict[str, list[float]] = {}
    else:
        samples = _gloo.time_training_steps(variants, x, args.steps, cpu=cpu)
    for red in reducers:
        red.close()
    if args.profile:
        _profile(name, variants["this DDP"], wrappers[0], x, args.profile, rank)
    for ddp in wrappers:
        ddp.close()
    if not samples:
        return []

    med = {label: median_ms(s) for label, s in samples.items()}
    cpu_med = {label: median_ms(s) for label, s in cpu.items()}
    rows: list[list[object]] = []
    for label in variants:
        ratio = paired = cpu_ratio = ""
        if label in VERSUS:
            ratio = f"{med[label] / med[VERSUS[label]]:.2f}x"
            paired = paired_ratio(samples[label], samples[VERSUS[label]])
            cpu_ratio = f"{cpu_med[label] / cpu_med[VERSUS[label]]:.2f}x"
        rows.append(
            [name if not rows else "", label, med[label], ratio, paired, cpu_med[label], cpu_ratio]
        )
    return rows


def _profile(
    name: str,
    variant: Variant,
    ddp: reducer.DistributedDataParallel,
    x: torch.Tensor,
    steps: int,
    rank: int,
) -> None:
    """``steps`` steps of ``variant`` under cProfile; rank 0 prints the top functions by own
    time and the medians of the reducer's iteration stats."""
    model, forward, prepare = variant
    stats: list[reducer.IterationStats] = []
    profiler = cProfile.Profile()

    def step(index: int, _variant: Variant) -> float:
        timed = index >= _gloo.WARMUP  # the warmup includes the rebuild of the buckets
        model.zero_grad(set_to_none=False)
        dist.barrier()
        t0 = time.perf_counter()
        if timed:
            profiler.enable()
        loss = forward(x).sum()
        prepare()
        loss.backward()
        if timed:
            profiler.disable()
        elapsed = time.perf_counter() - t0
        last = ddp.reducer.last_iteration
        assert last is not None  # a synced step just finished
        if timed:
            stats.append(last)
        return elapsed

    times = _gloo.interleave({"this DDP": variant}, steps, _gloo.WARMUP, step)["this DDP"]
    if rank != 0:
        return

    def ms(values: Iterable[int]) -> str:
        return f"{statistics.median(values) / 1e6:.2f}"

    buckets = range(len(stats[0].launch_ns))
    print(f"## profile of this DDP, {name}: {steps} steps, median {median_ms(times):.2f} ms")
    print(
        f"# from prepare_for_backward (ms): last gradient ready {ms(s.backward_ns for s in stats)};"
        f" bucket launches {[ms(s.launch_ns[b] for s in stats) for b in buckets]};"
        f" completions {[ms(s.done_ns[b] for s in stats) for b in buckets]};"
        f" finalize {ms(s.finalize_start_ns for s in stats)} to "
        f"{ms(s.finalize_end_ns for s in stats)}; bucket bytes {list(stats[0].bucket_nbytes)}"
    )
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(15)
    lines = [line for line in out.getvalue().splitlines() if line.strip()]
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls"))
    print("\n".join(lines[start:]) + "\n", flush=True)


def main(argv: list[str] | None = None) -> None:
    headers = [
        "model",
        "variant",
        "step ms",
        "vs torch DDP (same settings)",
        "median per-step ratio",
        "rank thread CPU ms",
        "CPU vs torch DDP",
    ]
    description = __doc__.split("\n\n")[0]
    _gloo.compare_training_steps(
        "ddp_vs_torch",
        description,
        measure,
        headers,
        steps=60,
        argv=argv,
        extra=[
            (
                ("--profile",),
                {"type": int, "default": 0, "help": "steps of this DDP to profile (0: none)"},
            )
        ],
    )


if __name__ == "__main__":
    main()
