"""Examples per second of the exact-averaging property (property 1), on this machine.

Each example builds a random model on every rank of a fake world, runs one synced backward
through the reducer, computes the exact reference from plain local autograd and compares.
The count includes Hypothesis' own generation time; shrinking is not involved (the reducer is
correct). The anchor, in the same run, is the same examples without the fake world and the
reducer (generation and the reference only; for a scenario the reducer must refuse, such as
a second backward through one graph, generation alone): the rest of the time is the world and
the reducer. The target is 30 examples/s on 2 cores for worlds of up to 4 ranks and models of up
to 8 parameters (the first row).

Tiny tensors on many threads: by default torch gets one intra-op thread (``--threads``), as
the test suite does (see conftest.py); more only oversubscribe the cores the ranks share.

    python benchmarks/property_throughput.py [--examples 300] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, table

from reducer.testing.harness import Scenario, check_against_reference, reference, refusal
from reducer.testing.strategies import model_specs, scenarios

CONFIGS: dict[str, st.SearchStrategy[Scenario]] = {
    "<= 4 ranks, 1 replica, <= 8 params, all used": scenarios(
        max_world_size=4,
        max_replicas=1,
        unused=False,
        model=model_specs(max_params=8, allow_unused=False),
    ),
    "<= 4 ranks, <= 3 replicas, <= 8 params, unused": scenarios(
        max_world_size=4, max_replicas=3, model=model_specs(max_params=8)
    ),
    "property 1 as tested (<= 8 ranks, wide layers)": scenarios(
        unused=False, model=model_specs(allow_unused=False, allow_wide=True, allow_checkpoint=True)
    ),
}


def _rate(strategy: st.SearchStrategy[Scenario], examples: int, full: bool) -> tuple[int, float]:
    count = 0

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        derandomize=True,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def prop(scenario: Scenario) -> None:
        nonlocal count
        count += 1
        if full:
            check_against_reference(scenario)
        elif refusal(scenario) is None:  # a refused scenario has no reference: generation only
            reference(scenario)

    start = time.perf_counter()
    prop()
    return count, count / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"# property 1 throughput\n# machine: {machine()}\n")
    rows = []
    for name, strategy in CONFIGS.items():
        count, rate = _rate(strategy, args.examples, full=True)
        _, anchor = _rate(strategy, args.examples, full=False)
        rows.append([name, count, rate, anchor, f"{1 - rate / anchor:.0%}"])
    headers = [
        "scenarios",
        "examples",
        "examples/s",
        "anchor: no world, no reducer (examples/s)",
        "time in world + reducer",
    ]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
