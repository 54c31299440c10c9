"""The properties catch every seeded bug, and Hypothesis shrinks each to a minimal example.

For each broken reducer of :mod:`property_tests.mutants`, Hypothesis searches the inputs of
the property meant to catch it for one that fails, and shrinks it. Each test asserts that one
is found, that the shrunk example is the smallest that can show the bug (two ranks to see a
wrong average, two replicas to see replica 1 left out, ...), and, where it is a scenario,
that the real reducer passes that very example.

- Properties 1-3 (one synced iteration) against the eight bugs of ``MUTANTS``;
- property 4 (the training state machine) against ``TRAINING_MUTANTS``;
- property 5 (bucket assignment equals torch's) against ``BUCKETING_MUTANTS``;
- property 6 (misuse raises the documented error) against ``MISUSE_MUTANTS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test

import fakepg
import reducer

from .harness import Scenario, check_against_reference, reference
from .model import ModelSpec
from .mutants import BUCKETING_MUTANTS, MISUSE_MUTANTS, MUTANTS, TRAINING_MUTANTS
from .strategies import bucketing_inputs, model_specs, scenarios
from .test_errors import (
    check_invalid_buckets,
    check_unfinished_iteration,
    check_used_outside_forward,
    corrupted,
    unfinished_iterations,
    used_outside_forward,
)
from .test_multi_iteration import TrainingMachine
from .test_torch_equivalence import check_bucket_assignment

with_optional: st.SearchStrategy[ModelSpec] = model_specs(require_optional=True)
# Generate, then shrink; no explain phase (it reruns variants of the shrunk example).
SEARCH = settings(
    max_examples=400,
    database=None,
    derandomize=True,
    deadline=None,
    phases=[Phase.generate, Phase.shrink],
    suppress_health_check=list(HealthCheck),
)


def _fails(check: Callable[[], None]) -> bool:
    """Does ``check`` fail? (``pytest.raises`` reports "did not raise" as pytest's own.)"""
    try:
        check()
    except (Exception, pytest.fail.Exception):
        return True
    return False


def _one_iteration(
    s: Scenario,
    *,
    world_size: int | None = None,
    replicas: int | None = None,
    contributions: int | None = None,
    branches: int = 1,
) -> bool:
    return (
        len(s.steps) == 1
        and len(s.model.branches) <= branches
        and (world_size is None or s.world_size == world_size)
        and (replicas is None or s.replicas == replicas)
        and (contributions is None or s.world_size * s.replicas == contributions)
    )


# name -> (scenarios that can expose it, network latency, is the shrunk scenario minimal?)
CASES: dict[str, tuple[st.SearchStrategy[Scenario], float, Callable[[Scenario], bool]]] = {
    # One branch, two ranks of one replica: the smallest world where the sum is not the average.
    "skip the divide": (
        scenarios(unused=False),
        0.0,
        lambda s: _one_iteration(s, world_size=2, replicas=1),
    ),
    # One rank is enough: the layout is wrong before any communication.
    "off-by-one bucket offset": (
        scenarios(unused=False),
        0.0,
        lambda s: (
            _one_iteration(s, world_size=1, replicas=1) and max(len(b) for b in s.buckets) >= 2
        ),
    ),
    # Two ranks whose buckets become ready in different orders: one needs an unused branch.
    "launch out of order": (
        scenarios(find_unused=True, model=with_optional, max_world_size=4),
        0.0,
        lambda s: _one_iteration(s, world_size=2, replicas=1, branches=2) and len(s.buckets) >= 2,
    ),
    # Two contributions (two ranks, or one rank with two replicas). The simulated network
    # takes 0.5 s, and the models are small enough that backward ends long before the data
    # lands (no used map: its wait would hold finalize back).
    "forget to wait": (
        scenarios(
            unused=False,
            find_unused=False,
            max_world_size=2,
            max_replicas=2,
            model=model_specs(max_branches=2, max_params=4, allow_unused=False),
        ),
        0.5,
        lambda s: _one_iteration(s, contributions=2),
    ),
    "drop the last bucket": (
        scenarios(unused=False),
        0.0,
        lambda s: _one_iteration(s, contributions=2),
    ),
    # One rank that skips an optional branch.
    "globally unused as zero": (
        scenarios(find_unused=True, model=with_optional),
        0.0,
        lambda s: (
            _one_iteration(s, world_size=1, replicas=1, branches=2)
            and any(e.untouched for e in reference(s))
        ),
    ),
    # One local step, then the synced one, and two contributions: with one, the lost
    # gradient is still in .grad, and the parameter, unused everywhere, keeps it.
    "lose accumulated gradients": (
        scenarios(find_unused=True, model=with_optional, min_local_steps=1, max_local_steps=2),
        0.0,
        lambda s: (
            len(s.steps) == 2 and s.world_size * s.replicas == 2 and len(s.model.branches) == 2
        ),
    ),
    # One rank with two replicas.
    "reduce only replica 0": (
        scenarios(unused=False),
        0.0,
        lambda s: _one_iteration(s, world_size=1, replicas=2),
    ),
}


def test_every_mutant_has_a_case() -> None:
    assert set(CASES) == set(MUTANTS)
    assert len(MUTANTS) >= 8


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_the_averaging_properties_catch_and_shrink(name: str) -> None:
    mutant = MUTANTS[name]
    strategy, latency, minimal = CASES[name]
    network = fakepg.FixedLatency(latency) if latency else None
    shrunk = find(
        strategy,
        lambda s: _fails(lambda: check_against_reference(s, mutant, network=network)),
        settings=SEARCH,
    )
    assert minimal(shrunk), f"{name}: not shrunk to the smallest case: {shrunk}"
    # The real reducer passes the very scenario that exposes the mutant.
    check_against_reference(shrunk, network=network)


@pytest.mark.parametrize("name", sorted(TRAINING_MUTANTS))
def test_the_training_property_catches_and_shrinks(name: str) -> None:
    # The same machine over a smaller space, where the bug shows (unused parameters are
    # searched for): every run replays a world and three sets of models, and shrinking
    # replays hundreds of runs.
    machine: Any = type(
        "BrokenTrainingMachine",
        (TrainingMachine,),
        {
            "make_reducer": TRAINING_MUTANTS[name],
            "last_run": [],
            "model_space": model_specs(max_branches=2, max_params=4, require_optional=True),
            "max_world_size": 2,
            "max_replicas": 1,
            "find_unused_choices": (True,),
        },
    )
    with pytest.raises(AssertionError):
        run_state_machine_as_test(
            machine, settings=settings(SEARCH, max_examples=1000, stateful_step_count=5)
        )
    # Shrunk to: set up one rank, a synced backward, an optimizer step, a synced backward.
    assert len(machine.last_run) <= 4, f"{name}: not shrunk: {machine.last_run}"
    assert machine.last_run[0] == "setup(world_size=1, replicas=1)", machine.last_run


@pytest.mark.parametrize("name", sorted(BUCKETING_MUTANTS))
def test_the_bucketing_property_catches_and_shrinks(name: str) -> None:
    assign = BUCKETING_MUTANTS[name]
    tensors, limits, sparse = find(
        bucketing_inputs(),
        lambda case: _fails(lambda: check_bucket_assignment(case[0], case[1], case[2], assign)),
        settings=SEARCH,
    )
    # Two tensors show each bug, but "the next limit" needs a third to follow a second limit.
    assert len(tensors) <= 3 and len(limits) <= 2, f"{name}: not shrunk: {len(tensors)} tensors"
    check_bucket_assignment(tensors, limits, sparse)


# (mutant, the property that must catch it): its inputs and its check.
MISUSE_CASES: list[tuple[str, st.SearchStrategy[Any], Callable[[Any, Any], None]]] = [
    ("vague errors", used_outside_forward(), check_used_outside_forward),
    ("vague errors", unfinished_iterations(), check_unfinished_iteration),
    ("accept invalid buckets", corrupted(), check_invalid_buckets),
]


def test_every_misuse_mutant_has_a_case() -> None:
    assert {name for name, _, _ in MISUSE_CASES} == set(MISUSE_MUTANTS)


@pytest.mark.parametrize(
    ("name", "strategy", "check"), MISUSE_CASES, ids=[c[2].__name__ for c in MISUSE_CASES]
)
def test_the_misuse_properties_catch_and_shrink(
    name: str, strategy: st.SearchStrategy[Any], check: Callable[[Any, Any], None]
) -> None:
    mutant = MISUSE_MUTANTS[name]
    shrunk = find(strategy, lambda case: _fails(lambda: check(case, mutant)), settings=SEARCH)
    scenario = shrunk if isinstance(shrunk, Scenario) else shrunk[0]
    if isinstance(scenario, Scenario):
        assert scenario.world_size == 1 and len(scenario.model.branches) == 2, (
            f"{name}: not shrunk: {scenario}"
        )
    else:  # a corrupted bucket assignment: of a one-branch model
        params = shrunk[0]
        assert len(params) <= 2, f"{name}: not shrunk: {len(params)} parameters"
    check(shrunk, reducer.Reducer)  # the real reducer passes the same example
