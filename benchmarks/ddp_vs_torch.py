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

``--phases N`` then runs N more steps of the plain step, torch's DDP and this DDP (default
settings), interleaved, and prints the median CPU time of the rank's thread per step in each
phase: forward, backward, and within this DDP's backward the reducer's parts (copies into
the buckets, scaling, launching the allreduces, finalize: waits and the copy back into
``.grad``), each timed by a wrapper around the reducer's method on that instance; what is
left of the backward over the plain one is the per-parameter hooks (and the wrappers' own
few microseconds). For the Python stacks themselves, run it under py-spy:
``py-spy record --subprocesses -r 1000 -f raw -o ddp.txt -- python
benchmarks/ddp_vs_torch.py --steps 0 --phases 400``.

    python benchmarks/ddp_vs_torch.py [--steps 60] [--batch 32] [--bucket-cap-mb 25] [--threads N]
    python benchmarks/ddp_vs_torch.py --steps 0 --profile 100
    python benchmarks/ddp_vs_torch.py --steps 0 --phases 100
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
    if args.phases:
        _phases(name, variants, wrappers[0], x, args.phases, rank)
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


# The reducer's methods timed by --phases, and what each is reported as.
PHASES = {
    "_copy_replica": "copy into buckets (small gradients, per bucket)",
    "_settle_at_hook": "copy into buckets, scaled (large gradients, at their hooks)",
    "_scale_replica": "scale (runs of small gradients)",
    "_launch": "launch the allreduces",
    "_finalize_backward": "finalize (waits, copy back into .grad)",
}


def _phases(
    name: str,
    variants: dict[str, Variant],
    ddp: reducer.DistributedDataParallel,
    x: torch.Tensor,
    steps: int,
    rank: int,
) -> None:
    """``steps`` interleaved steps of the plain step, torch's DDP and ``ddp`` (this DDP,
    default settings); rank 0 prints the median CPU ms of each phase per step."""
    red = ddp.reducer
    spent: dict[str, float] = {}

    def timed(method: str) -> None:
        inner = getattr(red, method)

        def wrapper(*args: object) -> object:
            c0 = time.thread_time()
            try:
                return inner(*args)
            finally:
                spent[method] = spent.get(method, 0.0) + time.thread_time() - c0

        setattr(red, method, wrapper)  # on this instance only: self.<method> finds it first

    for method in PHASES:
        timed(method)
    chosen = {k: variants[k] for k in ("plain (local)", "torch DDP", "this DDP")}
    samples: dict[str, list[float]] = {}

    def step(index: int, variant: Variant) -> float:
        model, forward, prepare = variant
        label = next(k for k, v in chosen.items() if v is variant)
        model.zero_grad(set_to_none=False)
        dist.barrier()
        spent.clear()
        c0 = time.thread_time()
        loss = forward(x).sum()
        c1 = time.thread_time()
        prepare()
        loss.backward()
        c2 = time.thread_time()
        if index >= _gloo.WARMUP:
            for key, value in ((f"{label}|forward", c1 - c0), (f"{label}|backward", c2 - c1)):
                samples.setdefault(key, []).append(value)
            if label == "this DDP":
                for method in PHASES:
                    samples.setdefault(method, []).append(spent.get(method, 0.0))
        return c2 - c0

    _gloo.interleave(chosen, steps, _gloo.WARMUP, step)
    for method in PHASES:
        delattr(red, method)
    if rank != 0:
        return
    med = {key: statistics.median(v) * 1e3 for key, v in samples.items()}
    plain_bwd = med["plain (local)|backward"]
    print(f"## where this DDP's CPU time goes, {name}: {steps} steps, rank thread, median ms")
    print("| phase | plain | torch DDP | this DDP |\n|---|---|---|---|")
    for part in ("forward", "backward"):
        cells = [f"{med[f'{label}|{part}']:.2f}" for label in chosen]
        print(f"| {part} | {' | '.join(cells)} |")
    plain_step = med["plain (local)|forward"] + plain_bwd
    over = [med[f"{k}|forward"] + med[f"{k}|backward"] - plain_step for k in chosen]
    print(f"| step over plain | | {over[1]:.2f} | {over[2]:.2f} |")
    parts = 0.0
    for method, what in PHASES.items():
        parts += med[method]
        print(f"| this DDP backward: {what} | | | {med[method]:.2f} |")
    hooks = med["this DDP|backward"] - plain_bwd - parts
    print(f"| this DDP backward: the rest (per-parameter hooks) | | | {hooks:.2f} |\n", flush=True)


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
            ),
            (
                ("--phases",),
                {"type": int, "default": 0, "help": "steps to time phase by phase (0: none)"},
            ),
        ],
    )


if __name__ == "__main__":
    main()
