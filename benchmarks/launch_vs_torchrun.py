"""``python -m reducer launch`` (rank threads on the fake world) against torchrun (one process
per rank, gloo) on the nanoGPT-style script (tests/scripts/nanogpt_train.py, torch's DDP,
``--backend gloo``), at N ranks: the wall time of the whole command, and the steady-state
time per optimizer step (the median over the steps after the first ``WARMUP``, as rank 0's
clock reads them), each the median of ``--repeats`` interleaved runs. The launch is timed
with its replica check (the default) and without (``--no-check``). Every N runs the same
training (``--grad-accum 8``: 8 micro-batches per step across the ranks). The floor row,
``threads, no DDP (GIL floor)``, runs the same training on N plain threads of one process
(``_threads_floor.py``: no process group, no DDP, no launch): what no launcher of rank threads
can beat on an interpreter with a GIL. ``threads + DDP, no launch`` adds torch's DDP on the
fake world to those threads (``_threads_floor.py --ddp``): the launch's own cost is its time
over that row's, printed last ("launch's own cost").

Where the steady-state time goes, per rank thread (or process), from the script's per-step
clocks (``--timing``): on a CPU (its CPU time), runnable but waiting for a CPU (Linux's
schedstat: the machine's cores are busy), and the rest, blocked: a rank thread blocked is
waiting for the GIL or for its peers in a collective (a torchrun process, for its peers only).

    python benchmarks/launch_vs_torchrun.py                 # N = 2, 4
    python benchmarks/launch_vs_torchrun.py --nprocs 2 --repeats 3 --steps 22

``--base DIR`` adds ``launch --no-check`` run with another checkout's code (``PYTHONPATH=DIR``,
e.g. ``git worktree add /tmp/base main``), interleaved with the rest: a before and after in
one run. ``--skip-check`` leaves out the launch with the check. ``--switch-intervals 0.005``
adds ``launch --no-check --switch-interval 0.005`` (Python's own interval), interleaved too.
"""

from __future__ import annotations

import argparse
import itertools
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import mean, median

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, table

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "nanogpt_train.py"
WARMUP = 2  # steps left out of the steady state


def commands(
    nproc: int,
    steps: int,
    *,
    base: str | None = None,
    check: bool = True,
    intervals: tuple[str, ...] = (),
) -> dict[str, list[str]]:
    script = [str(SCRIPT), "--backend", "gloo", "--grad-accum", "8", "--steps", str(steps)]
    script.append("--timing")
    launch = [sys.executable, "-m", "reducer", "launch", "--nproc", str(nproc)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    found = {
        "torchrun": [*torchrun, "--nproc-per-node", str(nproc), *script],
        "launch --no-check": [*launch, "--no-check", *script],
    }
    if base is not None:
        found["launch --no-check (base)"] = ["env", f"PYTHONPATH={base}", *launch, "--no-check"]
        found["launch --no-check (base)"] += script
    for interval in intervals:
        name = f"launch --no-check --switch-interval {interval}"
        found[name] = [*launch, "--no-check", "--switch-interval", interval, *script]
    if check:
        found["launch"] = [*launch, *script]
    # The floor of any rank-per-thread launcher: the same training on N plain threads, with no
    # process group, DDP or launch (see _threads_floor.py).
    floor = [sys.executable, str(Path(__file__).resolve().parent / "_threads_floor.py")]
    found["threads, no DDP (GIL floor)"] = [*floor, "--nproc", str(nproc), "--steps", str(steps)]
    # The floor of the launch's own cost: the same threads with torch's DDP on the fake world.
    found["threads + DDP, no launch"] = [*found["threads, no DDP (GIL floor)"], "--ddp"]
    return found


@dataclass(frozen=True, slots=True)
class Run:
    wall: float  # the whole command
    per_step: float  # rank 0's median steady-state step
    on_cpu: float  # shares of the steady state, averaged over the ranks
    runqueue: float
    blocked: float


def run(command: list[str], attempts: int = 3) -> Run:
    # torchrun's gloo workers abort now and then on a loaded machine ("terminate called
    # without an active exception"): a failed run is run again, and said so.
    for attempt in range(1, attempts + 1):
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if done.returncode == 0:
            break
        if attempt == attempts:
            raise SystemExit(f"{command} exited with {done.returncode}:\n{done.stderr[-3000:]}")
        print(f"(run again: {' '.join(command[-12:])} exited with {done.returncode})")
    clocks: dict[int, dict[int, tuple[float, float, float]]] = {}
    for line in done.stdout.splitlines():
        fields = line.split("timing ", 1)[-1].split() if "timing " in line else []
        if len(fields) == 5 and fields[0].isdigit() and fields[1].isdigit():
            rank, step = int(fields[0]), int(fields[1])
            clocks.setdefault(rank, {})[step] = (
                float(fields[2]),
                float(fields[3]),
                float(fields[4]),
            )
    # torchrun's workers share one stdout: a line two of them wrote at once is dropped above,
    # so each rank's steady state is over the steps it has, and a step's time is taken only
    # between consecutive steps.
    steps = sorted(s for s in clocks.get(0, {}) if s >= WARMUP)
    pairs = [(a, b) for a, b in itertools.pairwise(steps) if b == a + 1]
    if not pairs:
        raise SystemExit(f"{command}: no per-step clocks in its output")
    per_step = median(clocks[0][b][0] - clocks[0][a][0] for a, b in pairs)
    shares = []
    for per_rank in clocks.values():
        own = sorted(s for s in per_rank if s >= WARMUP)
        if len(own) < 2:
            continue
        first, last = per_rank[own[0]], per_rank[own[-1]]
        span = last[0] - first[0]
        cpu, queued = (last[1] - first[1]) / span, (last[2] - first[2]) / span
        shares.append((cpu, queued, max(0.0, 1.0 - cpu - queued)))
    return Run(wall, per_step, *(mean(s[k] for s in shares) for k in range(3)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", default="2,4")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=22, help="optimizer steps per run")
    parser.add_argument("--base", default=None, help="another checkout to run launch from too")
    parser.add_argument("--skip-check", action="store_true", help="leave out launch's check")
    parser.add_argument(
        "--switch-intervals",
        default="",
        help="comma-separated seconds: launch --no-check at each --switch-interval too",
    )
    args = parser.parse_args()
    print(f"machine: {machine()}")
    rows = []
    costs = []
    for nproc in (int(n) for n in args.nprocs.split(",")):
        intervals = tuple(i for i in args.switch_intervals.split(",") if i)
        variants = commands(
            nproc, args.steps, base=args.base, check=not args.skip_check, intervals=intervals
        )
        runs: dict[str, list[Run]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, command in variants.items():  # interleaved: drift hits all alike
                runs[name].append(run(command))
        anchor = runs["torchrun"]
        wall0, step0 = median(r.wall for r in anchor), median(r.per_step for r in anchor)
        for name, got in runs.items():
            wall, step = median(r.wall for r in got), median(r.per_step for r in got)
            rows.append(
                [
                    nproc,
                    name,
                    wall,
                    wall / wall0,
                    step * 1000,
                    step / step0,
                    f"{median(r.on_cpu for r in got):.0%}",
                    f"{median(r.runqueue for r in got):.0%}",
                    f"{median(r.blocked for r in got):.0%}",
                ]
            )
        own = median(r.per_step for r in runs["launch --no-check"])
        floor = median(r.per_step for r in runs["threads + DDP, no launch"])
        gil = median(r.per_step for r in runs["threads, no DDP (GIL floor)"])
        costs.append([nproc, own * 1000, floor * 1000, own / floor, gil * 1000, own / gil])
    header = ["N", "command", "wall s", "vs torchrun", "ms/step", "vs torchrun"]
    print(table([*header, "on CPU", "waiting for a CPU", "blocked (GIL, peers)"], rows))
    print("launch's own cost: launch --no-check per step over the same threads with DDP")
    header = ["N", "launch ms/step", "threads+DDP ms/step", "launch / threads+DDP"]
    print(table([*header, "GIL floor ms/step", "launch / GIL floor"], costs))


if __name__ == "__main__":
    main()
