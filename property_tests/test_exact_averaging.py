"""Property 1: every dense gradient is the bit-exact rank-order average, on every rank."""

from __future__ import annotations

from hypothesis import given

from .harness import Scenario, check_against_reference
from .strategies import scenarios


@given(scenarios(unused=False))
def test_every_gradient_is_the_exact_average(scenario: Scenario) -> None:
    check_against_reference(scenario)
