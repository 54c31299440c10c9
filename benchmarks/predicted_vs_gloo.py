"""Predicted against measured: ResNet50 on two real gloo processes here, per bucket cap.

1. Fit the link: the two gloo processes time allreduces of 4 KiB to 64 MiB; a least-squares
   line gives the alpha-beta model of a 2-rank ring (as benchmarks/whatif_vs_gloo.py does).
2. Measure the compute on the gloo ranks themselves, in plain steps (no DDP) interleaved with
   the DDP steps, so that they run under the same load: per-parameter gradient-ready times,
   forward and optimizer time, medians over the steps (the profile ``--profile`` takes).
3. Predict per cap with ``python -m reducer simulate --predict``'s engine: the real DDP on the
   virtual clock, the profile's compute, the fitted link. gloo on CPU tensors moves and sums
   the data on the cores that compute (each process has one), so collectives do not overlap
   backward: the prediction says so (``shared_cores``); the overlapped prediction is shown
   too.
4. Measure: this project's DDP over gloo, 2 processes of one intra-op thread, the same model
   and batch, each cap, steps interleaved across caps; median step of rank 0. "Paired" is the
   median ratio of each DDP step to the plain step of the same round, times the plain
   steps' median: the load of other work, which moves from round to round, cancels.

    python benchmarks/predicted_vs_gloo.py [--caps 0,1,5,25,100] [--batch-size 2] [--steps 6]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _gloo
from _common import interleave, machine, table
from whatif_vs_gloo import fit_link

import fakepg
import reducer
from reducer.tools.simulate import cluster, shapes

WARMUP = 2


class _Profiled:
    """The plain model (no DDP), its steps timed per phase and per gradient hook."""

    def __init__(self, module: Any) -> None:
        self.named = [(n, p) for n, p in module.named_parameters()]
        self.stamps: list[float] = [0.0] * len(self.named)
        self.steps: list[tuple[float, float, list[float]]] = []  # forward, optimizer, ready
        for i, (_, p) in enumerate(self.named):
            p.register_post_accumulate_grad_hook(
                lambda _p, i=i: self.stamps.__setitem__(i, time.perf_counter())
            )

    def profile(self, model: str, batch: int) -> cluster.Profile:
        steps = self.steps[WARMUP:]
        return cluster.Profile(
            model, "this machine's CPU, one gloo rank", batch,
            statistics.median(s[0] for s in steps), statistics.median(s[1] for s in steps),
            tuple(n for n, _ in self.named), tuple(tuple(p.shape) for _, p in self.named),
            tuple(statistics.median(s[2][i] for s in steps) for i in range(len(self.named))),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Measured:
    """Seconds: the plain step's median; per cap, the DDP step's median and its paired
    estimate (median ratio to the plain step of the same round, times the plain median)."""

    plain: float
    median: dict[float, float]
    paired: dict[float, float]


def measure_gloo(args: argparse.Namespace, rank: int) -> tuple[Measured, cluster.Profile]:
    """The steps of this project's DDP on the gloo group per cap, and the profile of the
    plain steps in between."""
    pg = reducer.TorchProcessGroup(dist.group.WORLD)  # type: ignore[arg-type]
    variants: dict[float | None, tuple[Any, Any, torch.optim.Optimizer]] = {}
    torch.manual_seed(0)
    plain = shapes.build(args.model, "cpu")
    profiled = _Profiled(plain)
    variants[None] = (plain, plain, torch.optim.SGD(plain.parameters(), lr=1e-4, momentum=0.9))
    for cap in args.caps:
        torch.manual_seed(0)
        module = shapes.build(args.model, "cpu")
        ddp = reducer.DistributedDataParallel(module, pg, bucket_cap_mb=cap)
        optimizer = torch.optim.SGD(module.parameters(), lr=1e-4, momentum=0.9)
        variants[cap] = (module, ddp, optimizer)
    shape = shapes.build(args.model, "meta")
    x, y = shape.make_batch(args.batch_size, torch.device("cpu"))  # type: ignore[operator]
    x = torch.randn_like(x) if x.is_floating_point() else x

    def timed_step(step: int, variant: tuple[Any, Any, torch.optim.Optimizer]) -> float:
        module, ddp, optimizer = variant
        dist.barrier()  # untimed: both ranks start the step together
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = module.loss(ddp(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        if module is plain:
            ready = [(s - t1) * 1e3 for s in profiled.stamps]
            profiled.steps.append(((t1 - t0) * 1e3, (t3 - t2) * 1e3, ready))
        return t3 - t0

    samples = interleave(variants, args.steps, WARMUP, timed_step)
    for _, ddp, _ in variants.values():
        if isinstance(ddp, reducer.DistributedDataParallel):
            ddp.reducer.close()
    plain_steps = samples.pop(None)
    plain = statistics.median(plain_steps)
    median, paired = {}, {}
    for cap, steps in samples.items():
        assert cap is not None
        median[cap] = statistics.median(steps)
        # Each DDP step against the plain step of the same round (see interleave): drift
        # and the load of other work, which change from round to round, cancel in the ratio.
        ratio = statistics.median(d / p for d, p in zip(steps, plain_steps, strict=True))
        paired[cap] = ratio * plain
    return Measured(plain, median, paired), profiled.profile(args.model, args.batch_size)


def rank_main(rank: int, args: argparse.Namespace) -> None:
    alpha, bandwidth, points = fit_link(args.repeats)
    measured, profile = measure_gloo(args, rank)
    if rank != 0:
        return
    link = fakepg.AlphaBeta(alpha, bandwidth, "ring", "gloo loopback (fitted)")
    print(f"# machine: {machine()} (shared with other work: loaded)")
    print(f"# {args.model}, batch {args.batch_size} per rank, 2 gloo processes, 1 thread each")
    print(f"# link fitted from {len(points)} sizes: {link}")
    print(
        f"# compute measured on rank 0's plain steps: forward {profile.forward_ms:.1f} ms, "
        f"backward {max(profile.ready_ms):.1f} ms, optimizer {profile.optimizer_ms:.1f} ms; "
        f"plain step {measured.plain * 1e3:.1f} ms\n"
    )
    rows: list[list[object]] = []
    for cap in args.caps:
        config = cluster.ClusterConfig(
            args.model, 2, link, bucket_cap_mb=cap, profile=profile, shared_cores=True
        )
        shared = cluster.predict(config)
        overlapped = cluster.predict(
            cluster.ClusterConfig(args.model, 2, link, bucket_cap_mb=cap, profile=profile)
        )
        real, paired = measured.median[cap] * 1e3, measured.paired[cap] * 1e3
        predicted = shared.step_s * 1e3
        rows.append(
            [f"{cap:g}", len(shared.bucket_nbytes), overlapped.step_s * 1e3, predicted, real,
             f"{predicted / real:.2f}", paired, f"{predicted / paired:.2f}"]
        )  # fmt: skip
    headers = ["bucket cap MiB", "buckets", "predicted, overlapped ms",
               "predicted, shared ms", "measured ms", "predicted / measured",
               "measured, paired ms", "predicted / paired"]  # fmt: skip
    print(table(headers, rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(shapes.SHAPE_MODELS), default="resnet50")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--caps", default="0,1,5,25,100")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per cap")
    parser.add_argument("--repeats", type=int, default=10, help="allreduces per size")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    args.caps = [float(c) for c in args.caps.split(",")]
    _gloo.run("predicted_vs_gloo", rank_main, (args,), threads=1, timeout=args.timeout)


if __name__ == "__main__":
    main()
