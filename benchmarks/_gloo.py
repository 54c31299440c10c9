"""Benchmarks on two gloo ranks on this machine (processes over loopback, like torchrun).

:func:`run` spawns the ranks, sets up and tears down their default torch.distributed group,
and bounds the whole run with a deadline; :func:`time_training_steps` times interleaved
training steps of several variants, the ranks starting each step together, and
:func:`compare_training_steps` is the whole main of a script that prints a table of them per
model. A script keeps only what it measures.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _common import Variant, interleave, machine, table
from models import MODELS

WORLD_SIZE = 2
WARMUP = 5  # untimed steps per variant before the timed ones


def run(
    name: str,
    rank_main: Callable[..., None],
    args: tuple[object, ...],
    *,
    threads: int,
    timeout: float,
) -> None:
    """Call ``rank_main(rank, *args)`` in each of :data:`WORLD_SIZE` new processes, inside a
    gloo default group, with ``threads`` intra-op threads each.

    ``rank_main`` must be a module-level function (the processes are spawned, not forked).
    A rank's failure is re-raised here; a run still going after ``timeout`` seconds is
    stopped, and the script (``name``) exits saying so.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    context = mp.spawn(
        _rank_entry, args=(rank_main, args, port, threads), nprocs=WORLD_SIZE, join=False
    )
    deadline = time.monotonic() + timeout
    # join() re-raises a rank's failure here; the deadline keeps a hung rank from hanging us.
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
                process.join(5.0)
            raise SystemExit(f"{name}: the ranks did not finish within {timeout:g} s")


def _rank_entry(
    rank: int,
    rank_main: Callable[..., None],
    args: tuple[object, ...],
    port: int,
    threads: int,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group(
        "gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=300)
    )
    try:
        rank_main(rank, *args)
    finally:
        dist.destroy_process_group()


Measure = Callable[[str, argparse.Namespace, int], list[list[object]]]


def compare_training_steps(
    name: str,
    description: str,
    measure: Measure,
    headers: list[str],
    *,
    steps: int,
    argv: list[str] | None = None,
    extra: Sequence[tuple[tuple[str, ...], dict[str, Any]]] = (),
) -> None:
    """The main of a training-step comparison: parse the options (see :func:`_add_arguments`;
    ``steps`` is the default of ``--steps``), then on both ranks ``measure(model, args, rank)``
    for every model of ``models.MODELS``, and print rank 0's rows as one table.

    ``measure`` must be a module-level function (it travels to the spawned ranks). ``extra``:
    more options, as (names, keyword arguments) of ``add_argument``.
    """
    parser = argparse.ArgumentParser(description=description)
    _add_arguments(parser, steps=steps)
    for names, options in extra:
        parser.add_argument(*names, **options)
    args = parser.parse_args(argv)
    run(
        name, _table_of_models, (args, measure, headers), threads=args.threads, timeout=args.timeout
    )


def _table_of_models(
    rank: int, args: argparse.Namespace, measure: Measure, headers: list[str]
) -> None:
    rows = [row for model in MODELS for row in measure(model, args, rank)]
    if rank == 0 and rows:
        print(
            f"# step time (forward + backward + reduction), {WORLD_SIZE} gloo ranks on "
            f"loopback, batch {args.batch}, bucket cap {args.bucket_cap_mb:g} MiB, "
            f"median of {args.steps} steps"
        )
        print(f"# machine: {machine()}\n")
        print(table(headers, rows))


def _add_arguments(parser: argparse.ArgumentParser, *, steps: int) -> None:
    """The options of a training-step comparison: steps, timeout, batch, bucket cap, threads."""
    parser.add_argument("--steps", type=int, default=steps)
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


def time_training_steps(
    variants: dict[str, Variant],
    x: torch.Tensor,
    steps: int,
    *,
    cpu: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Per variant, the seconds of each of ``steps`` steps after :data:`WARMUP`, interleaved.

    A step is zero_grad (set_to_none=False, so autograd accumulates in place), forward, loss,
    the variant's hook and backward, with the wait for every allreduce; the ranks meet at an
    untimed barrier before each step. With ``cpu``, each variant's list there gets the CPU
    seconds the rank's own thread spent in each step (forward, backward, hooks, copies; not
    the backend's threads, nor time spent waiting): unlike the step's wall time, it hardly
    moves when other processes load the machine.
    """
    labels = {id(variant): label for label, variant in variants.items()}
    if cpu is not None:
        cpu.update({label: [] for label in variants})

    def step(index: int, variant: Variant) -> float:
        model, forward, prepare = variant
        model.zero_grad(set_to_none=False)
        dist.barrier()  # untimed: both ranks start the step together
        c0 = time.thread_time()
        t0 = time.perf_counter()
        loss = forward(x).sum()
        prepare()
        loss.backward()
        elapsed = time.perf_counter() - t0
        if cpu is not None and index >= WARMUP:
            cpu[labels[id(variant)]].append(time.thread_time() - c0)
        return elapsed

    return interleave(variants, steps, WARMUP, step)
