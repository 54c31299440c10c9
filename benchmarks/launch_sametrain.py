"""What the same-training evidence costs per step: ``python -m reducer launch`` on the
nanoGPT-style script (tests/scripts/nanogpt_train.py: torch's DDP, gradient accumulation,
dropout, AdamW) and on the corpus' MLP (tests/scripts/sametrain/ok_mlp.py: a DataLoader with
a DistributedSampler, accumulation), at N ranks.

A step's cost is the CPU time of the whole launch inside one warm process (every rank thread's,
``time.process_time``: on two cores shared with other jobs, wall times move by tens of percent
from run to run, CPU time much less), divided by its optimizer steps; the wall time per step
is shown too. Variants, interleaved in every
repeat (drift and other load hit all alike): the anchor ``--no-check`` (neither check),
``--no-check --same-training`` (the evidence alone), and the default (the replica check and the
evidence), with ``--no-same-training`` (the replica check alone) for reference.

On two shared cores the launch's step times move by tens of percent from run to run, more than
the evidence costs; so the evidence's own work is also timed alone, on one thread: the
nanoGPT-style model's step (two micro-steps, AdamW, one intra-op thread) with the recorder
installed (this thread as rank 0, the model taken as the wrapper) against the same step
without, alternating step by step; medians over every step of the thread's CPU time (what
other processes on the shared cores do is left out).

    python benchmarks/launch_sametrain.py                  # N = 2, 4
    python benchmarks/launch_sametrain.py --nprocs 2 --repeats 3 --steps 10
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, table

ROOT = Path(__file__).resolve().parent.parent
NANOGPT = ROOT / "tests" / "scripts" / "nanogpt_train.py"
MLP = ROOT / "tests" / "scripts" / "sametrain" / "ok_mlp.py"
VARIANTS = {
    "--no-check (anchor)": ["--no-check"],
    "evidence only": ["--no-check", "--same-training"],
    "replica check only": ["--no-same-training"],
    "check + evidence (default)": [],
}


def run(args: list[str]) -> tuple[float, float]:
    """CPU and wall seconds of one launch in this process."""
    from reducer.tools import cli

    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        cpu, wall = time.process_time(), time.perf_counter()
        code = cli.main(args)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    if code != 0:
        raise SystemExit(f"{args} exited with {code}:\n{sink.getvalue()[-3000:]}")
    return cpu, wall


def step_ms(script: str, nproc: int, flags: list[str], steps: int) -> tuple[float, float]:
    """CPU and wall milliseconds per optimizer step of one launch."""
    if script == "nanogpt_train.py":
        cpu, wall = run(
            ["launch", "--nproc", str(nproc), *flags, str(NANOGPT), "--steps", str(steps)]
        )
    else:
        cpu, wall = run(["launch", "--nproc", str(nproc), *flags, str(MLP)])
        steps = 48 // (4 * nproc)  # 2 epochs of 48 samples, batch 4 per rank, 2 micro-steps
    return cpu / steps * 1e3, wall / steps * 1e3


def recorder_cost(steps: int, rounds: int) -> tuple[float, float]:
    """Median ms per step of the nanoGPT-style model on this thread, without and with the
    recorder (see the module's docstring)."""
    import torch

    sys.path.insert(0, str(NANOGPT.parent))
    import nanogpt_train as gpt

    from reducer.testing.sametrain._evidence import Recorder

    torch.manual_seed(0)
    model = gpt.GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

    def one_step() -> float:
        start = time.thread_time()  # this thread's CPU time: other processes' load left out
        for _ in range(2):
            x, y = gpt.get_batch(4)
            (model(x, y) / 2).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return (time.thread_time() - start) * 1e3

    torch.set_num_threads(1)
    plain, recorded = [], []
    for _ in range(rounds * steps):  # step by step, alternating: load hits both alike
        plain.append(one_step())
        recorder = Recorder(1, lambda: 0)
        with recorder:
            recorder.watch(model)
            recorded.append(one_step())
    return median(plain), median(recorded)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", default="2,4")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    rows = []
    for nproc in [int(n) for n in args.nprocs.split(",")]:
        for script in ("nanogpt_train.py", "sametrain/ok_mlp.py"):
            cpu: dict[str, list[float]] = {name: [] for name in VARIANTS}
            wall: dict[str, list[float]] = {name: [] for name in VARIANTS}
            for repeat in range(args.repeats + 1):
                for name, flags in VARIANTS.items():  # interleaved
                    c, w = step_ms(script, nproc, flags, args.steps)
                    if repeat:  # the first round warms up
                        cpu[name].append(c)
                        wall[name].append(w)
            anchor = median(cpu["--no-check (anchor)"])
            for name in VARIANTS:
                ms = median(cpu[name])
                rows.append(
                    [nproc, script, name, ms, min(cpu[name]), ms / anchor, median(wall[name])]
                )
    headers = ["N", "script", "variant", "CPU ms/step", "min", "vs anchor", "wall ms/step"]
    print(table(headers, rows))
    plain, recorded = recorder_cost(steps=50, rounds=args.repeats)
    print()
    print(
        table(
            ["one thread, nanoGPT-style step", "plain ms", "recorded ms", "evidence us", "ratio"],
            [["median of steps", plain, recorded, (recorded - plain) * 1e3, recorded / plain]],
        )
    )


if __name__ == "__main__":
    main()
