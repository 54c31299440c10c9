"""What the replica check costs: ``python -m reducer launch`` with and without ``--no-check``
on the nanoGPT-style script (tests/scripts/nanogpt_train.py, torch's DDP, gradient
accumulation), at N ranks.

Two measures, interleaved (every repeat runs both variants in turn, so drift and other load
hit both alike): the wall time of a whole launch process (what a user waits for: interpreter,
torch import, the run; ``--process-repeats``), and the time of the launch itself inside one
warm process (``cli.main``, the run alone: where the check's per-step work shows;
``--repeats``). Each as the median and the minimum (the least disturbed run, on a shared
machine). The anchor is the same launch with ``--no-check``, in the same run.

    python benchmarks/launch_check.py                       # N = 2, 4; 3 and 20 steps
    python benchmarks/launch_check.py --nprocs 2 --steps 3 --repeats 3 --process-repeats 1
"""

from __future__ import annotations

import argparse
import contextlib
import io
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, table

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "nanogpt_train.py"


def launch_args(nproc: int, steps: int, check: bool) -> list[str]:
    flag = [] if check else ["--no-check"]
    return ["launch", "--nproc", str(nproc), *flag, str(SCRIPT), "--steps", str(steps)]


def process_seconds(args: list[str]) -> float:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "reducer", *args], cwd=ROOT, capture_output=True, text=True
    )
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{args} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return elapsed


def in_process_seconds(args: list[str]) -> float:
    from reducer.tools import cli

    sink = io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        start = time.perf_counter()
        code = cli.main(args)
        elapsed = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{args} exited with {code}:\n{sink.getvalue()[-3000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", default="2,4")
    parser.add_argument("--steps", default="3,20")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--process-repeats", type=int, default=3)
    args = parser.parse_args()
    nprocs = [int(n) for n in args.nprocs.split(",")]
    steps_list = [int(s) for s in args.steps.split(",")]
    print(f"machine: {machine()}")
    rows = []
    for nproc in nprocs:
        for steps in steps_list:
            times: dict[tuple[str, bool], list[float]] = {}
            in_process_seconds(launch_args(nproc, steps, True))  # warm-up
            for repeat in range(max(args.repeats, args.process_repeats)):
                for check in (False, True):  # interleaved: drift hits both alike
                    a = launch_args(nproc, steps, check)
                    if repeat < args.process_repeats:
                        times.setdefault(("process", check), []).append(process_seconds(a))
                    if repeat < args.repeats:
                        times.setdefault(("in-process", check), []).append(in_process_seconds(a))
            for where in ("process", "in-process"):
                plain, checked = times[(where, False)], times[(where, True)]
                rows.append(
                    [
                        nproc,
                        steps,
                        where,
                        median(plain),
                        median(checked),
                        median(checked) / median(plain),
                        min(plain),
                        min(checked),
                        min(checked) / min(plain),
                    ]
                )
    headers = [
        "N",
        "steps",
        "measured",
        "plain s",
        "checked s",
        "ratio",
        "min plain",
        "min checked",
        "min ratio",
    ]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
