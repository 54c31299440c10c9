"""How fast each exploration finds the corpus's races, and what the scheduler costs.

Races: the five of ``tests/corpus/corpus_published_ddp.py`` (published-style classes whose
constructors broadcast every parameter), each checked on a fixed scenario at two ranks. Per
race and mode (random walk or PCT, early or late completion policy), each run draws
schedules as ``reducer.testing.schedules`` does (one seed per example; PCT's depth 1 to 3,
its horizon learned across the run's examples) until the check fails, up to ``--cap``
examples: the median examples to the first failure over ``--runs`` runs, the chance per
example that estimates (runs / examples drawn, failures included), the median seconds to
the first failure, and the seconds ``fewest_deviations`` takes to shrink the first run's
failing schedule, with the deviations left. Then each fix: failures over ``--runs`` x 20
drawn schedules (must be 0). PCT's bound for a bug of depth d is 1 / (n k^(d-1)): n actors
(each rank's thread and its callbacks, and the network: 5 at two ranks) and k choice
points (the column ``k``, of the natural order's run).

Throughput: ``benchmarks/schedule_throughput.py``'s workloads, without a schedule (the
anchor) and under drawn schedules, alternately.

    PYTHONPATH=$PWD python benchmarks/race_exploration.py [--runs 20] [--cap 100]
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
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests" / "corpus"))

import corpus_published_ddp as corpus  # noqa: E402
import schedule_throughput  # noqa: E402
from _common import machine, table  # noqa: E402

import fakepg  # noqa: E402
from fakepg._schedule import explore  # noqa: E402
from reducer.testing import (  # noqa: E402
    TrainingScenario,
    check_comm_hook,
    check_data_parallel,
    fewest_deviations,
)

Check = Callable[[fakepg.Schedule], None]
MODES = ("walk", "pct")


def _model() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3), nn.Linear(3, 2))


def _inputs(micro: int) -> tuple[tuple[tuple[object, ...], ...], ...]:
    g = torch.Generator().manual_seed(1)
    per_rank = []
    for _ in range(2):
        batches = tuple((torch.randn(3, 4, generator=g),) for _ in range(micro))
        per_rank.append(batches if micro > 1 else batches[0])
    return (tuple(per_rank),)


ONE = TrainingScenario(_model, _inputs(1))  # type: ignore[arg-type]
TWO = TrainingScenario(
    _model,
    _inputs(2),  # type: ignore[arg-type]
    micro_batches=(("require_backward_grad_sync", "sync"),),
)


def _finish(wrapper: nn.Module) -> None:
    wrapper.finish_gradient_synchronization()  # type: ignore[operator]


def _two_micro_batches(model: nn.Module, optimizer, batch, step) -> None:  # type: ignore[no-untyped-def]
    optimizer.zero_grad()
    for args in batch.micro_batches:
        batch.loss(model(*args)).backward()
    _finish(model)
    optimizer.step()


def _wrapper(cls: object) -> Check:
    return lambda s: check_data_parallel(cls, ONE, after_backward=_finish, schedule=s)  # type: ignore[arg-type]


def _micro(cls: object) -> Check:
    return lambda s: check_data_parallel(cls, TWO, train_step=_two_micro_batches, schedule=s)  # type: ignore[arg-type]


def _hook(hook: object) -> Check:
    return lambda s: check_comm_hook(hook, ONE, schedule=s)  # type: ignore[arg-type]


RACES: dict[str, tuple[Check, Check]] = {
    "divides before waiting": (
        _wrapper(corpus.DividesBeforeWaiting),
        _wrapper(corpus.IndividualParameters),
    ),
    "divides in the hook": (_wrapper(corpus.DividesInHook), _wrapper(corpus.DividesFirstInHook)),
    "copies back before waiting": (
        _wrapper(corpus.CopiesBackBeforeWaiting),
        _wrapper(corpus.CopiesBackAfterWaiting),
    ),
    "bucket refilled in flight": (
        _micro(corpus.BucketRewritten),
        _micro(corpus.WaitsBeforeRefilling),
    ),
    "comm hook divides in flight": (
        _hook(corpus.divide_in_flight_hook),
        _hook(corpus.divide_first_hook),
    ),
}


def _fails(check: Check, schedule: fakepg.Schedule) -> bool:
    try:
        check(schedule)
    except Exception:
        return True
    return False


def _schedule(
    rng: random.Random, mode: str, late: bool, horizon: explore.Horizon
) -> fakepg.Schedule:
    """What schedules(explore=mode, adversarial=late) draws for one example."""
    source = random.Random(rng.getrandbits(64)).randrange
    exploration: explore.Exploration
    if mode == "walk":
        exploration = explore.Walk(source)
    else:
        exploration = explore.Pct(source, depth=rng.randint(1, 3), horizon=horizon)
    return fakepg.Schedule(adversarial=late, explore=exploration)


def race_rows(runs: int, cap: int) -> list[list[object]]:
    rows: list[list[object]] = []
    for name, (buggy, fixed) in RACES.items():
        natural = fakepg.Schedule()
        _fails(buggy, natural)
        k = natural.used
        for mode in MODES:
            for late in (False, True):
                counts: list[int] = []
                hits = 0
                seconds: list[float] = []
                first: fakepg.Schedule | None = None
                for run in range(runs):
                    rng = random.Random(1000 * run + 7)
                    horizon = explore.Horizon()
                    t0 = time.perf_counter()
                    for n in range(1, cap + 1):
                        schedule = _schedule(rng, mode, late, horizon)
                        if _fails(buggy, schedule):
                            counts.append(n)
                            hits += 1
                            seconds.append(time.perf_counter() - t0)
                            first = first or schedule
                            break
                    else:
                        counts.append(cap)
                        seconds.append(time.perf_counter() - t0)
                shrink_s, left = float("nan"), "-"
                if first is not None:
                    t0 = time.perf_counter()
                    shrunk = fewest_deviations(first, lambda s, b=buggy: _fails(b, s))
                    shrink_s = time.perf_counter() - t0
                    left = f"{sum(1 for c in shrunk.choices if c)}"
                rows.append(
                    [
                        name,
                        f"{mode} {'late' if late else 'early'}",
                        k,
                        statistics.median(counts),
                        f"{hits / sum(counts):.2f}",
                        statistics.median(seconds),
                        shrink_s,
                        left,
                    ]
                )
        rng = random.Random(5)
        horizon = explore.Horizon()
        wrong = sum(
            _fails(fixed, _schedule(rng, rng.choice(MODES), rng.random() < 0.5, horizon))
            for _ in range(runs * 20)
        )
        rows.append(
            [f"{name}: the fix", "drawn", k, "-", f"{wrong}/{runs * 20} fail", "-", "-", "-"]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cap", type=int, default=100)
    parser.add_argument("--examples", type=int, default=20, help="throughput examples")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(machine())
    print()
    print(
        table(
            [
                "race",
                "mode",
                "k",
                "examples to 1st failure (median)",
                "chance per example",
                "find (s, median)",
                "shrink (s)",
                "deviations left",
            ],
            race_rows(args.runs, args.cap),
        )
    )
    print()
    print(
        table(
            schedule_throughput.HEADERS,
            schedule_throughput.throughput(args.examples),
        )
    )


if __name__ == "__main__":
    main()
