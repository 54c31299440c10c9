"""Examples per second of the exact-averaging property (property 1), on this machine.

Each example builds a random model on every rank of a fake world, runs one synced backward
through the reducer, computes the exact reference from plain local autograd and compares.
The count includes Hypothesis' own generation time; shrinking is not involved (the reducer is
correct). The anchor, in the same run, is the same examples without the fake world and the
reducer (generation and the reference only; for a scenario the reducer must refuse, such as
a second backward through one graph, generation alone): the rest of the time is the world and
the reducer. The target is 30 examples/s on 2 cores for worlds of up to 4 ranks and models of up
to 8 parameters (the first row).

A second table measures the wrapper checks of ``reducer.testing.checks`` (property 6,
``property_tests/test_wrappers.py``): examples per second of ``check_data_parallel`` with
torch's DDP, this project's DDP and FSDP2 on the scenarios the property draws (models of up
to 6 parameters, 1 to 4 ranks, 1 to 3 SGD steps, buffers, ignored parameters, layouts,
dropout); the anchor is the check's reference alone on the same examples (plain models, no
world, no wrapper; generation included).

Tiny tensors on many threads: by default torch gets one intra-op thread (``--threads``), as
the test suite does (see conftest.py); more only oversubscribe the cores the ranks share.

    python benchmarks/property_throughput.py [--examples 300] [--wrapper-examples N]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from typing import Any

from _common import machine, table

from reducer.testing import (
    TrainingScenario,
    bucket_caps_mb,
    check_data_parallel,
    fsdp2,
    generated_training_scenarios,
    reducer_ddp,
    sum_then_divide,
    torch_ddp,
)
from reducer.testing._judge import reference_alone
from reducer.testing.algorithms import ddp_average
from reducer.testing.harness import Scenario, check_against_reference, reference, refusal
from reducer.testing.model import ModelSpec
from reducer.testing.reference import rank_order_average
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
    def run(scenario: Scenario) -> None:
        if full:
            check_against_reference(scenario)
        elif refusal(scenario) is None:  # a refused scenario has no reference: generation only
            reference(scenario)

    return _check_rate(strategy, examples, run)


_WRAPPER_SCENARIOS = generated_training_scenarios(
    model=model_specs(max_branches=3, max_params=6, allow_sparse=False),
    bucket_caps=bucket_caps_mb(),
    options={"find_unused_parameters": True},
    buffers=None,
    layouts=None,
    dropout=None,
    ignore=True,
)


def _float32(spec: ModelSpec) -> ModelSpec:
    # A parameter group of fully_shard has one dtype.
    return ModelSpec(tuple(replace(b, dtype=torch.float32) for b in spec.branches), spec.seed)


_FSDP2_SCENARIOS = generated_training_scenarios(
    model=model_specs(max_branches=2, max_params=4, allow_sparse=False, allow_unused=False).map(
        _float32
    ),
    max_steps=2,
)


def _check_rate(strategy: st.SearchStrategy[Any], examples: int, check: Any) -> tuple[int, float]:
    """Examples drawn and checked (``check(example)``), and examples per second."""
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
    def prop(scenario: Any) -> None:
        nonlocal count
        count += 1
        check(scenario)

    start = time.perf_counter()
    prop()
    return count, count / (time.perf_counter() - start)


def _reference_only(average: Any) -> Any:
    """The anchor: the check's reference alone (plain models, no world, no wrapper)."""

    def run(s: TrainingScenario) -> None:
        # A private function of the checks: the benchmark measures what it costs.
        reference_alone(s, ddp_average(average=average))

    return run


def _rank_order(scaling: Any) -> Any:
    return lambda column, w: rank_order_average(column, w, scaling=scaling)


WRAPPERS: dict[str, tuple[st.SearchStrategy[TrainingScenario], Any, Any]] = {
    "torch's DDP (property 6)": (
        _WRAPPER_SCENARIOS,
        lambda s: check_data_parallel(torch_ddp(), s),
        _reference_only(_rank_order("reciprocal")),
    ),
    "this project's DDP (property 6)": (
        _WRAPPER_SCENARIOS,
        lambda s: check_data_parallel(reducer_ddp(), s, scaling="reciprocal"),
        _reference_only(_rank_order("reciprocal")),
    ),
    "FSDP2 fully_shard (property 6)": (
        _FSDP2_SCENARIOS,
        lambda s: check_data_parallel(fsdp2(), s, average=sum_then_divide, check_strides=False),
        _reference_only(sum_then_divide),
    ),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=300)
    parser.add_argument("--wrapper-examples", type=int, default=None, help="default: --examples")
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
    print("\n# the wrapper checks (check_data_parallel)\n")
    rows = []
    wrapper_examples = args.wrapper_examples or args.examples
    for name, (strategy, check, anchor_check) in WRAPPERS.items():
        count, rate = _check_rate(strategy, wrapper_examples, check)
        _, anchor = _check_rate(strategy, wrapper_examples, anchor_check)
        rows.append([name, count, rate, anchor, f"{1 - rate / anchor:.0%}"])
    headers = [
        "wrapper",
        "examples",
        "examples/s",
        "anchor: the reference alone (examples/s)",
        "time in world + wrapper",
    ]
    print(table(headers, rows))


if __name__ == "__main__":
    main()
