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
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _gloo
from _common import median_ms, paired_ratio, reducer_and_torch_ddp
from models import MODELS, batch, with_copies

import reducer

# Each reducer variant's row compares it with torch's DDP with the same settings.
VERSUS = {"reducer": "torch DDP", "reducer views": "torch DDP views"}


def measure(name: str, args: argparse.Namespace, rank: int) -> list[list[object]]:
    build, width = MODELS[name]
    base, copy_of = with_copies(build)
    x = batch(width, args.batch, seed=rank)
    pg = reducer.TorchProcessGroup(dist.group.WORLD)  # type: ignore[arg-type]
    variants, reducers = reducer_and_torch_ddp(
        base, copy_of, pg, args.bucket_cap_mb, plain="plain (local)"
    )
    samples = _gloo.time_training_steps(variants, x, args.steps)
    for red in reducers:
        red.close()

    med = {label: median_ms(s) for label, s in samples.items()}
    rows: list[list[object]] = []
    for label in variants:
        ratio = paired = ""
        if label in VERSUS:
            ratio = f"{med[label] / med[VERSUS[label]]:.2f}x"
            paired = paired_ratio(samples[label], samples[VERSUS[label]])
        rows.append([name if not rows else "", label, med[label], ratio, paired])
    return rows


def main(argv: list[str] | None = None) -> None:
    headers = [
        "model",
        "variant",
        "step ms",
        "vs torch DDP (same settings)",
        "median per-step ratio",
    ]
    description = __doc__.split("\n\n")[0]
    _gloo.compare_training_steps("ddp_vs_torch", description, measure, headers, steps=60, argv=argv)


if __name__ == "__main__":
    main()
