"""Predicted against measured: ResNet50 on two real gloo processes here, per bucket cap.

1. Measure the link: the two gloo processes time allreduces of 4 KiB to 64 MiB (median per
   size). The prediction costs an allreduce by interpolating these times (log-log, between
   the measured sizes; linear in size beyond the largest): a straight alpha-beta line
   through them (as benchmarks/whatif_vs_gloo.py fits) misses loopback gloo's regimes by up
   to 2x (too fast for the largest sizes, too slow in between); the line still costs the
   other kinds (the forward's buffer broadcasts).
2. Measure the compute on the gloo ranks themselves, in plain steps (no DDP) interleaved with
   the DDP steps, so that they run under the same load: per-parameter gradient-ready times,
   forward and optimizer time, medians over the steps (the profile ``--profile`` takes).
3. Measure the host's costs of the reducer, apart from the model: this project's DDP on the
   same gloo group over 64 parameters of 1 KiB, one bucket per parameter against one bucket
   for all against no DDP, steps interleaved. The median extra time per bucket, less the
   fitted link's time for a 1 KiB allreduce, is the host's cost of one collective call (the
   reducer's work to launch and finish a bucket); what one bucket for all costs beyond no
   DDP, less one call, per parameter, is the reducer's cost per gradient hook.
4. Measure the core's speed for the reducer's own operations (copying gradients into
   buckets and back, dividing them): the bandwidth of a 64 MiB copy and the cost of an
   operation on one element, as a roofline (``gpu.GpuSpec``) for this core; the prediction
   times the reducer's operations by it (the profile covers only the model's own compute).
   The host's costs above include one division per bucket and two copies per parameter,
   which the roofline charges too (about a microsecond each, counted twice).
5. Predict per cap with ``python -m reducer simulate --predict``'s engine: the real DDP on the
   virtual clock, the profile's compute, the fitted link, the host's cost per call. gloo on
   CPU tensors moves and sums the data on the cores that compute (each process has one), so
   collectives do not overlap backward and the host's cost per call is paid on those cores:
   the prediction says so (``shared_cores``); the overlapped prediction is shown too.
6. Measure: this project's DDP over gloo, 2 processes of one intra-op thread, the same model
   and batch, each cap, steps interleaved across caps; median step of rank 0. "Paired" is the
   median ratio of each DDP step to the plain step of the same round, times the plain
   steps' median: the load of other work, which moves from round to round, cancels.
7. The least-disturbed step, on both sides: on a machine shared with other work a step is
   only ever slowed by it, never sped up, so each side's fastest round is the one closest to
   the machine alone. The prediction takes the profile of the fastest plain round; the
   measured side is each cap's fastest DDP step (both from the same run, same rounds).
8. ``--clock cpu`` times everything (the link, the host's cost per call, the profile, the
   steps) in the process's CPU time (user and system, all its threads) instead of wall
   time: what the step costs the machine, blind to the share of the cores that other work
   takes, and blind to waiting for the other rank (which the fitted link then leaves out
   too). Both sides are timed by the same clock in the same run.

    python benchmarks/predicted_vs_gloo.py [--caps 0,1,5,25,100] [--batch-size 2] [--steps 6]
        [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
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
from reducer.tools.simulate import cluster, gpu, shapes

WARMUP = 2
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_now = time.perf_counter  # the clock every measurement reads: see --clock


class _Profiled:
    """The plain model (no DDP), its steps timed per phase and per gradient hook."""

    def __init__(self, module: Any) -> None:
        self.named = [(n, p) for n, p in module.named_parameters()]
        self.stamps: list[float] = [0.0] * len(self.named)
        self.steps: list[tuple[float, float, list[float]]] = []  # forward, optimizer, ready
        for i, (_, p) in enumerate(self.named):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self.stamps.__setitem__(i, _now()))

    def profile(self, model: str, batch: int, only: int | None = None) -> cluster.Profile:
        """Medians over the timed steps, or the timed step ``only`` alone."""
        steps = self.steps[WARMUP:] if only is None else [self.steps[WARMUP + only]]
        return cluster.Profile(
            model, "this machine's CPU, one gloo rank", batch,
            statistics.median(s[0] for s in steps), statistics.median(s[1] for s in steps),
            tuple(n for n, _ in self.named), tuple(tuple(p.shape) for _, p in self.named),
            tuple(statistics.median(s[2][i] for s in steps) for i in range(len(self.named))),
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Measured:
    """Seconds: the plain step's median; per cap, the DDP step's median, its paired
    estimate (median ratio to the plain step of the same round, times the plain median) and
    its fastest step."""

    plain: float
    median: dict[float, float]
    paired: dict[float, float]
    fastest: dict[float, float]


def measure_gloo(
    args: argparse.Namespace, rank: int
) -> tuple[Measured, cluster.Profile, cluster.Profile]:
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
        t0 = _now()
        optimizer.zero_grad(set_to_none=True)
        loss = module.loss(ddp(x), y)
        t1 = _now()
        loss.backward()
        t2 = _now()
        optimizer.step()
        t3 = _now()
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
    median, paired, fastest = {}, {}, {}
    for cap, steps in samples.items():
        assert cap is not None
        median[cap] = statistics.median(steps)
        fastest[cap] = min(steps)
        # Each DDP step against the plain step of the same round (see interleave): drift
        # and the load of other work, which change from round to round, cancel in the ratio.
        ratio = statistics.median(d / p for d, p in zip(steps, plain_steps, strict=True))
        paired[cap] = ratio * plain
    quickest = min(range(len(plain_steps)), key=plain_steps.__getitem__)
    return (
        Measured(plain, median, paired, fastest),
        profiled.profile(args.model, args.batch_size),
        profiled.profile(args.model, args.batch_size, only=quickest),
    )


class MeasuredLink:
    """A 2-rank allreduce costed from measured (bytes, seconds) medians, interpolated; the
    other kinds by the alpha-beta ``line`` (see the module's docstring, step 1)."""

    def __init__(self, points: list[tuple[int, float]], line: fakepg.AlphaBeta) -> None:
        self.points = sorted(points)
        self.line = line

    def collective_time_s(self, kind: str, nbytes: int, world_size: int) -> float:
        if kind != "allreduce" or world_size != 2:
            return self.line.collective_time_s(kind, nbytes, world_size)
        sizes = [n for n, _ in self.points]
        if nbytes <= sizes[0]:
            return self.points[0][1]
        for (n0, t0), (n1, t1) in itertools.pairwise(self.points):
            if nbytes <= n1:  # log-log between the measured neighbours
                w = math.log(nbytes / n0) / math.log(n1 / n0)
                return math.exp((1 - w) * math.log(t0) + w * math.log(t1))
        (n0, t0), (n1, t1) = self.points[-2:]
        return t1 + (nbytes - n1) * (t1 - t0) / (n1 - n0)

    def __str__(self) -> str:
        table = ", ".join(f"{n >> 10} KiB {t * 1e6:.0f} us" for n, t in self.points)
        return f"allreduce as measured ({table}), interpolated"


CALL_PARAMS, CALL_NUMEL = 64, 256  # 64 parameters of 1 KiB


class _Many(torch.nn.Module):
    """Many small parameters and a trivial backward: what it costs is the reducer's per
    parameter and per bucket work, not compute."""

    def __init__(self) -> None:
        super().__init__()
        self.params = torch.nn.ParameterList(
            torch.nn.Parameter(torch.ones(CALL_NUMEL)) for _ in range(CALL_PARAMS)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((p * x).sum() for p in self.params)  # type: ignore[return-value]


def measure_host_costs(steps: int, link: MeasuredLink) -> tuple[float, float]:
    """Seconds of the host's own work per collective call and per gradient hook (see the
    module's docstring)."""
    pg = reducer.TorchProcessGroup(dist.group.WORLD)  # type: ignore[arg-type]
    variants: dict[float | None, Any] = {None: _Many()}
    for cap in (0.0, 1024.0):
        module = _Many()
        variants[cap] = reducer.DistributedDataParallel(module, pg, bucket_cap_mb=cap)
    x = torch.ones(CALL_NUMEL)

    def timed_step(step: int, ddp: Any) -> float:
        dist.barrier()
        t0 = _now()
        ddp(x).backward()
        return _now() - t0

    samples = interleave(variants, steps, WARMUP, timed_step)
    for ddp in variants.values():
        if isinstance(ddp, reducer.DistributedDataParallel):
            ddp.reducer.close()
    rounds = list(zip(samples[0.0], samples[1024.0], samples[None], strict=True))
    transfer = link.collective_time_s("allreduce", CALL_NUMEL * 4, 2)
    call = max(0.0, statistics.median((m - o) / (CALL_PARAMS - 1) for m, o, _ in rounds) - transfer)
    hook = statistics.median((o - plain - call - transfer) / CALL_PARAMS for _, o, plain in rounds)
    return call, max(0.0, hook)


def measure_core(repeats: int = 20) -> gpu.GpuSpec:
    """This core as a roofline for the reducer's own operations: the bandwidth of a 64 MiB
    copy (bytes read and written), the time of an operation on one element (its fixed
    cost), and a matmul's FLOP rate (the reducer does no matmul; the roofline needs one)."""

    def median_s(op: Any) -> float:
        op()
        samples = []
        for _ in range(repeats):
            t0 = _now()
            op()
            samples.append(_now() - t0)
        return statistics.median(samples)

    src, dst = torch.randn(16 << 20), torch.empty(16 << 20)
    bandwidth = 2 * src.numel() * 4 / median_s(lambda: dst.copy_(src))
    one, out = torch.ones(1), torch.empty(1)
    fixed = median_s(lambda: [torch.add(one, one, out=out) for _ in range(1000)]) / 1000
    a = torch.randn(512, 512)
    flops = 2 * 512**3 / median_s(lambda: a @ a)
    return gpu.GpuSpec(
        "this CPU core (measured)", flops, flops, flops, bandwidth,
        compute_efficiency=1.0, memory_efficiency=1.0, kernel_s=fixed,
        source="measured in this run",
    )  # fmt: skip


def rank_main(rank: int, args: argparse.Namespace) -> None:
    global _now
    _now = CLOCKS[args.clock]
    alpha, bandwidth, points = fit_link(args.repeats, _now)
    line = fakepg.AlphaBeta(alpha, bandwidth, "ring", "gloo loopback (fitted)")
    link = MeasuredLink(points, line)
    call_s, hook_s = measure_host_costs(args.call_steps, link)
    core = measure_core()
    measured, profile, quickest = measure_gloo(args, rank)
    if rank != 0:
        return
    print(f"# machine: {machine()} (shared with other work: loaded)")
    print(f"# {args.model}, batch {args.batch_size} per rank, 2 gloo processes, 1 thread each")
    clock = "wall" if args.clock == "wall" else "CPU time of the process (user + system)"
    print(f"# every time below, measured and predicted from measurements, is {clock}")
    print(f"# link: {link}; other kinds: the line fitted through it, {line}")
    print(
        f"# this core: copies at {core.memory_Bps / 1e9:.2f} GB/s (read + write), "
        f"{core.kernel_s * 1e6:.2f} us per operation, {core.fp32_flops / 1e9:.1f} GFLOP/s"
    )
    print(
        f"# host's cost per collective call: {call_s * 1e6:.0f} us (DDP on {CALL_PARAMS} "
        f"parameters of 1 KiB, a bucket each against one, less the link's time for the call);"
        f" per gradient hook: {hook_s * 1e6:.0f} us"
    )
    print(
        f"# compute measured on rank 0's plain steps: forward {profile.forward_ms:.1f} ms, "
        f"backward {max(profile.ready_ms):.1f} ms, optimizer {profile.optimizer_ms:.1f} ms; "
        f"plain step {measured.plain * 1e3:.1f} ms (fastest round: forward "
        f"{quickest.forward_ms:.1f}, backward {max(quickest.ready_ms):.1f}, optimizer "
        f"{quickest.optimizer_ms:.1f} ms)\n"
    )
    rows: list[list[object]] = []
    for cap in args.caps:
        config = cluster.ClusterConfig(
            args.model, 2, link, bucket_cap_mb=cap, profile=profile, shared_cores=True,
            host_call_s=call_s, host_hook_s=hook_s, gpu=core,
        )  # fmt: skip
        shared = cluster.predict(config)
        overlapped = cluster.predict(
            cluster.ClusterConfig(args.model, 2, link, bucket_cap_mb=cap, profile=profile, gpu=core)
        )
        fast = cluster.predict(dataclasses.replace(config, profile=quickest))
        real, paired = measured.median[cap] * 1e3, measured.paired[cap] * 1e3
        predicted, fast_ms = shared.step_s * 1e3, fast.step_s * 1e3
        fastest = measured.fastest[cap] * 1e3
        rows.append(
            [f"{cap:g}", len(shared.bucket_nbytes), overlapped.step_s * 1e3, predicted, real,
             f"{predicted / real:.2f}", paired, f"{predicted / paired:.2f}", fast_ms, fastest,
             f"{fast_ms / fastest:.2f}"]
        )  # fmt: skip
    headers = ["bucket cap MiB", "buckets", "predicted, overlapped ms",
               "predicted, shared ms", "measured ms", "predicted / measured",
               "measured, paired ms", "predicted / paired", "predicted, fastest ms",
               "measured, fastest ms", "fastest: predicted / measured"]  # fmt: skip
    print(table(headers, rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=list(shapes.SHAPE_MODELS), default="resnet50")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--caps", default="0,1,5,25,100")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per cap")
    parser.add_argument("--repeats", type=int, default=10, help="allreduces per size")
    parser.add_argument(
        "--call-steps", type=int, default=40, help="steps per variant timing the host's cost"
    )
    parser.add_argument(
        "--clock", choices=tuple(CLOCKS), default="wall", help="what every time is measured in"
    )
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args(argv)
    args.caps = [float(c) for c in args.caps.split(",")]
    _gloo.run("predicted_vs_gloo", rank_main, (args,), threads=1, timeout=args.timeout)


if __name__ == "__main__":
    main()
