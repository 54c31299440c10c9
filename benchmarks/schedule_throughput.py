"""The controlled scheduler's cost and power: examples/s with it on and off, and the time
Hypothesis takes to find and shrink each race of ``tests/test_races.py``.

Throughput: the same examples (a check on a fixed scenario) run alternately without a
schedule (the anchor: threads run freely) and under a random schedule (choices drawn from a
seeded generator, as Hypothesis draws them), for: the fake world alone (``fakepg.run``, four
allreduces per rank), a hand-written per-parameter DDP (every wait a scheduling point),
torch's DDP with a comm hook and torch's DDP alone (ranks wait in torch's C++ reducer, which
the scheduler sees by sampling: see Note [Blocked outside the scheduler] in
fakepg.schedule). The goal: on >= 0.7x off. "median example" is the ratio of the median
examples' times (off / on), which one example stalled by the machine's other work moves less;
"median CPU" the same for the process's CPU time (every thread's), which the time an example
waits for a core on a loaded machine does not move at all.

Races: for each buggy version, how often it fails in 20 runs without a schedule (threads
free), then the seconds ``hypothesis.find`` takes to find a failing schedule and shrink it,
the shrunk schedule, and whether it fails on all of 20 replays.

    PYTHONPATH=$PWD python benchmarks/schedule_throughput.py [--examples 40] [--races]
        [--without-monitor]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from hypothesis import find, settings

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))

import test_races as races  # noqa: E402
from _common import machine, table  # noqa: E402

import fakepg  # noqa: E402
from fakepg._schedule.monitor import Monitor  # noqa: E402
from reducer.testing import (  # noqa: E402
    check_comm_hook,
    check_data_parallel,
    schedules,
    torch_ddp,
)

Check = Callable[[fakepg.Schedule | None], None]


def _world(schedule: fakepg.Schedule | None) -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> None:
        ts = [torch.ones(64) * pg.rank() for _ in range(4)]
        works = [pg.allreduce([t]) for t in ts]
        for w in works:
            w.wait()

    fakepg.run(fn, 2, schedule=schedule)


def _per_parameter(schedule: fakepg.Schedule | None) -> None:
    def make(module: torch.nn.Module, pg: object) -> torch.nn.Module:
        return races.PerParameterDDP(module, pg)

    check_data_parallel(make, races.SCENARIO, average=races.sum_then_divide, schedule=schedule)


def _hook(schedule: fakepg.Schedule | None) -> None:
    check_comm_hook(races.divide_first_hook, races.SCENARIO, schedule=schedule)


def _torch_ddp(schedule: fakepg.Schedule | None) -> None:
    check_data_parallel(torch_ddp(), races.SCENARIO, schedule=schedule)


WORKLOADS: dict[str, Check] = {
    "fake world alone (fakepg.run)": _world,
    "hand-written per-parameter DDP": _per_parameter,
    "torch DDP + comm hook": _hook,
    "torch DDP": _torch_ddp,
}


def _without_monitor(check: Check) -> Check:
    """``check`` with the scheduler's monitor never started: what the monitor costs a workload
    that never blocks outside the scheduler (every wait a point). A diagnostic only: a rank
    blocked in C++ (torch's DDP) would hold the turn until the world's timeout without it."""

    def run(schedule: fakepg.Schedule | None) -> None:
        start, handed = Monitor.start_locked, Monitor.handed_locked
        Monitor.start_locked = lambda self, run: None  # type: ignore[method-assign]
        Monitor.handed_locked = lambda self: None  # type: ignore[method-assign]
        try:
            check(schedule)
        finally:
            Monitor.start_locked, Monitor.handed_locked = start, handed  # type: ignore[method-assign]

    return run


# The columns of throughput()'s rows.
HEADERS = [
    *("workload", "examples", "off (ex/s)", "on (ex/s)", "on / off"),
    *("median example", "median CPU"),
]


def throughput(examples: int, *, without_monitor: bool = False) -> list[list[object]]:
    rng = random.Random(0)
    rows: list[list[object]] = []
    workloads = dict(WORKLOADS)
    if without_monitor:
        workloads["fake world alone, no monitor (diagnostic)"] = _without_monitor(_world)
    for name, check in workloads.items():
        check(None)  # warm up (imports, first torch calls)
        off: list[float] = []
        on: list[float] = []
        off_cpu: list[float] = []
        on_cpu: list[float] = []
        for _ in range(examples):
            c0, t0 = time.process_time(), time.perf_counter()
            check(None)
            off.append(time.perf_counter() - t0)
            off_cpu.append(time.process_time() - c0)
            choices = [rng.randrange(8) for _ in range(rng.randrange(65))]
            adversarial = rng.random() < 0.5
            c0, t0 = time.process_time(), time.perf_counter()
            check(fakepg.Schedule(choices, adversarial=adversarial))
            on.append(time.perf_counter() - t0)
            on_cpu.append(time.process_time() - c0)
        # The median example too: one example that the machine's other work stalls for
        # half a second moves the totals of a loaded machine more than the scheduler does.
        median = statistics.median(off) / statistics.median(on)
        cpu = statistics.median(off_cpu) / statistics.median(on_cpu)
        totals = [examples / sum(off), examples / sum(on), sum(off) / sum(on)]
        rows.append([name, examples, *totals, median, cpu])
    return rows


RACES: dict[str, tuple[Check, Check]] = {
    "(a) divide while the all_reduce is in flight (comm hook, torch DDP)": (
        lambda s: check_comm_hook(races.divide_in_flight_hook, races.SCENARIO, schedule=s),
        lambda s: check_comm_hook(races.divide_first_hook, races.SCENARIO, schedule=s),
    ),
    "(b) a forgotten wait (hand-written per-parameter DDP)": (
        lambda s: races._check_per_parameter(False, s),  # type: ignore[arg-type]
        lambda s: races._check_per_parameter(True, s),  # type: ignore[arg-type]
    ),
    "(c) collectives issued from callbacks (comm hook, torch DDP)": (
        lambda s: check_comm_hook(races.reduce_in_callback_hook, races.TWO_BUCKETS, schedule=s),
        lambda s: check_comm_hook(races.reduce_in_hook_hook, races.TWO_BUCKETS, schedule=s),
    ),
}


def _fails(check: Check, schedule: fakepg.Schedule | None) -> bool:
    try:
        check(schedule)
    except Exception:
        return True
    return False


def race_rows() -> list[list[object]]:
    rows: list[list[object]] = []
    for name, (buggy, _fixed) in RACES.items():
        free = sum(_fails(buggy, None) for _ in range(20))
        t0 = time.perf_counter()
        found = find(
            schedules(),
            lambda s, buggy=buggy: _fails(buggy, s),
            settings=settings(max_examples=300, database=None, deadline=None),
        )
        shrink_s = time.perf_counter() - t0
        replays = sum(
            _fails(buggy, fakepg.Schedule(found.choices, adversarial=found.adversarial))
            for _ in range(20)
        )
        rows.append([name, f"{free}/20", shrink_s, repr(found), f"{replays}/20"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=40)
    parser.add_argument("--races", action="store_true", help="also time finding each race")
    parser.add_argument(
        "--without-monitor",
        action="store_true",
        help="also the fake world alone with the scheduler's monitor never started (what the "
        "monitor costs a workload that never blocks outside the scheduler)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine())
    print()
    print(
        table(
            HEADERS,
            throughput(args.examples, without_monitor=args.without_monitor),
        )
    )
    if args.races:
        print()
        print(
            table(
                ["race", "fails free", "find + shrink (s)", "shrunk to", "fails replayed"],
                race_rows(),
            )
        )


if __name__ == "__main__":
    main()
