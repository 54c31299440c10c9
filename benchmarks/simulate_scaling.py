"""How ``python -m reducer simulate`` scales with the number of ranks in one process.

For W = 8, 16, 32, 64 ranks (threads of one process on the fake world) it runs the default
simulation (the built-in mlp, no simulated network, every step verified) and reports the
median wall time of a training step over all ranks, that time per rank, the time of the whole
run per step (the step plus the untimed reference gradients and the exact check), and the
most threads alive at once (W rank threads, the world's data-moving workers, this process's
own). Each rank computes with one intra-op thread, as the simulation sets. The anchor is
W = 8: "vs linear" is the step time divided by (W / 8) times W = 8's, so 1.00 means exactly
linear growth.

    python benchmarks/simulate_scaling.py [--steps 20] [--model mlp] [--ranks 8,16,32,64]

With --predict it times ``simulate --predict`` instead (one rank of a model by shape through
the real DDP, the others modelled; no thread per rank) for W = 8 to 4096 on the
nccl-dgx1-v100 preset: the wall time of each prediction, and the predicted step.

    python benchmarks/simulate_scaling.py --predict [--model resnet50]
        [--ranks 8,64,256,1024,4096]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, table

import fakepg
from reducer.tools import simulate
from reducer.tools.simulate import gpu
from reducer.tools.simulate.cluster import ClusterConfig, predict


class PeakThreads:
    """Samples ``threading.active_count()`` every few ms while active."""

    def __init__(self) -> None:
        self.peak = threading.active_count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, threading.active_count())

    def __enter__(self) -> PeakThreads:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5.0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--ranks", default=None, help="default 8,16,32,64; 8 to 4096 --predict")
    parser.add_argument("--predict", action="store_true", help="time simulate --predict")
    args = parser.parse_args(argv)
    if args.predict:
        predict_scaling(args)
        return
    args.ranks = args.ranks or "8,16,32,64"
    sim_parser = argparse.ArgumentParser()
    simulate.add_arguments(sim_parser)

    # Warm-up (imports, first-call costs), not measured.
    simulate.simulate(sim_parser.parse_args(["--world-size", "2", "--steps", "2"]))
    rows: list[list[object]] = []
    anchor = None
    for w in [int(r) for r in args.ranks.split(",")]:
        sim_args = sim_parser.parse_args(
            ["--world-size", str(w), "--steps", str(args.steps), "--model", args.model]
        )
        start = time.perf_counter()
        with PeakThreads() as threads:
            result = simulate.simulate(sim_args)
        total = time.perf_counter() - start
        if not result.ok:
            raise SystemExit(f"simulate_scaling: W={w} failed: {result.failure or result.mismatch}")
        step_ms = statistics.median(result.step_wall_ns[1:] or result.step_wall_ns) / 1e6
        if anchor is None:
            anchor = (w, step_ms)
        linear = anchor[1] * w / anchor[0]
        rows.append(
            [w, step_ms, step_ms / w, f"{step_ms / linear:.2f}", total / args.steps * 1e3,
             threads.peak]
        )  # fmt: skip
        print(f"W={w}: done", file=sys.stderr)
    print(
        f"# python -m reducer simulate --model {args.model} --steps {args.steps}: median step "
        f"over steps 2.., every step verified"
    )
    print(f"# machine: {machine()}\n")
    headers = [
        "ranks",
        "step ms",
        "step ms per rank",
        "vs linear",
        "run ms per step (with check)",
        "peak threads",
    ]
    print(table(headers, rows))


def predict_scaling(args: argparse.Namespace) -> None:
    model = "resnet50" if args.model == "mlp" else args.model
    network = fakepg.parse_network("nccl-dgx1-v100")
    rows: list[list[object]] = []
    for w in [int(r) for r in (args.ranks or "8,64,256,1024,4096").split(",")]:
        start = time.perf_counter()
        step = predict(ClusterConfig(model, w, network, gpu=gpu.GPUS["v100"]))
        rows.append([w, f"{time.perf_counter() - start:.2f}", step.step_s * 1e3])
    print(f"# simulate --predict --model {model} --network nccl-dgx1-v100 --gpu v100")
    print(f"# machine: {machine()}\n")
    print(table(["ranks", "prediction wall s", "predicted step ms"], rows))


if __name__ == "__main__":
    main()
