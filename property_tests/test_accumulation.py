"""Property 3: k local backward passes, then a synced one, reduce the accumulated sums."""

from __future__ import annotations

from hypothesis import given, settings

from .harness import Scenario, check_against_reference
from .strategies import model_specs, scenarios


# The core properties get four times the profile's examples (ci: 100).
@settings(max_examples=4 * settings().max_examples)
@given(scenarios(min_local_steps=1, max_local_steps=3, model=model_specs(allow_wide=True)))
def test_accumulated_gradients_are_averaged_and_nothing_is_lost(scenario: Scenario) -> None:
    # The reference accumulates the same local backward passes and counts a parameter as
    # used if any of them (not just the synced one) gave it a gradient.
    check_against_reference(scenario)
