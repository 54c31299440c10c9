"""The properties catch every seeded bug, and Hypothesis shrinks each to a minimal scenario.

For each broken reducer of :mod:`property_tests.mutants`, ``hypothesis.find`` searches the
scenarios of the property meant to catch it for one that fails, and shrinks it. The test
asserts that one is found and that the shrunk scenario is the smallest that can show the bug
(two ranks to see a wrong average, two replicas to see replica 1 left out, ...).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, find, settings
from hypothesis import strategies as st

import fakepg

from .harness import Scenario, check_against_reference, reference
from .model import ModelSpec
from .mutants import MUTANTS
from .strategies import model_specs, scenarios

with_optional: st.SearchStrategy[ModelSpec] = model_specs(require_optional=True)

# name -> (scenarios that can expose it, network, what the shrunk scenario must look like)
CASES: dict[str, tuple[st.SearchStrategy[Scenario], float, Callable[[Scenario], bool]]] = {
    "skip the divide": (scenarios(unused=False), 0.0, lambda s: s.world_size == 2),
    "off-by-one bucket offset": (
        scenarios(unused=False),
        0.0,
        lambda s: s.world_size == 1 and max(len(b) for b in s.buckets) >= 2,
    ),
    "launch out of order": (
        scenarios(find_unused=True, model=with_optional, max_world_size=4),
        0.0,
        lambda s: s.world_size == 2 and len(s.buckets) >= 2,
    ),
    # Two contributions: two ranks, or one rank with two replicas.
    "forget to wait": (scenarios(unused=False), 0.05, lambda s: s.world_size * s.replicas == 2),
    "drop the last bucket": (
        scenarios(unused=False),
        0.0,
        lambda s: s.world_size * s.replicas == 2,
    ),
    "globally unused as zero": (
        scenarios(find_unused=True, model=with_optional),
        0.0,
        lambda s: s.world_size == 1 and any(e.untouched for e in reference(s)),
    ),
    "lose accumulated gradients": (
        scenarios(find_unused=True, model=with_optional, min_local_steps=1, max_local_steps=2),
        0.0,
        lambda s: len(s.steps) == 2,
    ),
    "reduce only replica 0": (
        scenarios(unused=False),
        0.0,
        lambda s: s.replicas == 2 and s.world_size == 1,
    ),
}


def test_every_mutant_has_a_case() -> None:
    assert set(CASES) == set(MUTANTS)
    assert len(MUTANTS) >= 8


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_the_properties_catch_and_shrink(name: str) -> None:
    mutant = MUTANTS[name]
    strategy, latency, minimal = CASES[name]
    network = fakepg.FixedLatency(latency) if latency else None

    def fails(scenario: Scenario) -> bool:
        try:
            check_against_reference(scenario, mutant, network=network)
        except Exception:
            return True
        return False

    shrunk = find(
        strategy,
        fails,
        settings=settings(
            max_examples=400,
            database=None,
            derandomize=True,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert minimal(shrunk), f"{name}: not shrunk to the smallest case: {shrunk}"
    # The real reducer passes the very scenario that exposes the mutant.
    check_against_reference(shrunk, network=network)
