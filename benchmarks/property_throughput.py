"""Examples per second of the exact-averaging property (property 1), on this machine.

Each example builds a random model on every rank of a fake world, runs one synced backward
through the reducer, computes the exact reference from plain local autograd and compares.
The count includes Hypothesis' own generation time; shrinking is not involved (the reducer is
correct).

    python benchmarks/property_throughput.py [--examples 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, table

from property_tests.harness import Scenario, check_against_reference
from property_tests.strategies import model_specs, scenarios

CONFIGS = {
    "worlds <= 4, 1 replica, <= 8 params": scenarios(
        max_world_size=4, max_replicas=1, unused=False, model=model_specs(max_params=8)
    ),
    "worlds <= 4, <= 3 replicas, unused": scenarios(max_world_size=4, max_replicas=3),
    "worlds <= 8, <= 3 replicas, unused": scenarios(max_world_size=8, max_replicas=3),
}


def measure(name: str, examples: int) -> list[object]:
    count = 0

    @settings(
        max_examples=examples,
        database=None,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(CONFIGS[name])
    def prop(scenario: Scenario) -> None:
        nonlocal count
        count += 1
        check_against_reference(scenario)

    start = time.perf_counter()
    prop()
    elapsed = time.perf_counter() - start
    return [name, count, elapsed, count / elapsed]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=200)
    args = parser.parse_args(argv)
    print(f"# property 1 throughput\n# machine: {machine()}\n")
    rows = [measure(name, args.examples) for name in CONFIGS]
    print(table(["scenarios", "examples", "seconds", "examples/s"], rows))


if __name__ == "__main__":
    main()
