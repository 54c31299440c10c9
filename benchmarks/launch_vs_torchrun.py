"""``python -m reducer launch`` (rank threads on the fake world) against torchrun (one process
per rank, gloo) on the nanoGPT-style script (tests/scripts/nanogpt_train.py, torch's DDP,
``--backend gloo``): the wall time of the whole command, median of ``--repeats`` interleaved
runs, at N ranks. The launch is timed with its replica check (the default) and without
(``--no-check``). Every N runs the same training (``--grad-accum 8``: 8 micro-batches per
step across the ranks).

    python benchmarks/launch_vs_torchrun.py                 # N = 2, 4, 8
    python benchmarks/launch_vs_torchrun.py --nprocs 2 --repeats 3
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, table

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "nanogpt_train.py"
SCRIPT_ARGS = ["--backend", "gloo", "--grad-accum", "8", "--steps", "3"]


def commands(nproc: int) -> dict[str, list[str]]:
    launch = [sys.executable, "-m", "reducer", "launch", "--nproc", str(nproc)]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return {
        "torchrun": [*torchrun, "--nproc-per-node", str(nproc), str(SCRIPT), *SCRIPT_ARGS],
        "launch --no-check": [*launch, "--no-check", str(SCRIPT), *SCRIPT_ARGS],
        "launch": [*launch, str(SCRIPT), *SCRIPT_ARGS],
    }


def seconds(command: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{command} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", default="2,4,8")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {machine()}")
    rows = []
    for nproc in (int(n) for n in args.nprocs.split(",")):
        variants = commands(nproc)
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.repeats):
            for name, command in variants.items():  # interleaved: drift hits all alike
                times[name].append(seconds(command))
        anchor = median(times["torchrun"])
        for name in variants:
            rows.append([nproc, name, median(times[name]), median(times[name]) / anchor])
    print(table(["N", "command", "wall s", "vs torchrun"], rows))


if __name__ == "__main__":
    main()
