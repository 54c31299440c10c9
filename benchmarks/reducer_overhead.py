"""Backward time with the reducer on a one-rank fake world, against plain backward.

Per model, five variants run interleaved step by step (so that drift affects all alike):
plain backward; this reducer copying gradients in and out of buckets (the default) and with
``gradient_as_bucket_view``; and, as the anchor, torch's ``DistributedDataParallel`` on a
one-rank gloo group with the same two settings. Every variant keeps its gradients
(``zero_grad(set_to_none=False)``), so autograd accumulates in place everywhere. The reducer
time includes ``prepare_for_backward`` and the finalize (copies, allreduce, write-back).

    python benchmarks/reducer_overhead.py [--steps 200] [--batch 32] [--bucket-cap-mb 25]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Variant, interleave, machine, median_ms, reducer_and_torch_ddp, table
from models import MODELS, batch, with_copies

import fakepg

WARMUP = 10


def measure(name: str, steps: int, batch_size: int, cap_mb: float) -> list[list[object]]:
    build, width = MODELS[name]
    base, copy_of = with_copies(build)
    x = batch(width, batch_size)
    world = fakepg.World(1)
    variants, reducers = reducer_and_torch_ddp(base, copy_of, world.group(0), cap_mb, plain="plain")

    def backward(_step: int, variant: Variant) -> float:
        model, forward, prepare = variant
        loss = forward(x).sum()
        t0 = time.perf_counter()
        prepare()
        loss.backward()
        elapsed = time.perf_counter() - t0
        model.zero_grad(set_to_none=False)
        return elapsed

    samples = interleave(variants, steps, WARMUP, backward)
    for red in reducers:
        red.close()
    world.close()
    plain = median_ms(samples["plain"])
    return [
        [
            name if label == "plain" else "",
            label,
            median_ms(s),
            100 * (median_ms(s) - plain) / plain,
        ]
        for label, s in samples.items()
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    print(f"# reducer overhead, backward only, batch {args.batch}, one rank")
    print(f"# machine: {machine()}\n")
    rows = [
        row for name in MODELS for row in measure(name, args.steps, args.batch, args.bucket_cap_mb)
    ]
    print(table(["model", "variant", "backward ms", "overhead %"], rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
