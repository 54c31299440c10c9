"""Property 2: globally unused parameters keep .grad untouched; locally unused count as zero."""

from __future__ import annotations

from hypothesis import event, given

from .harness import Scenario, check_against_reference, reference
from .strategies import model_specs, scenarios


@given(
    scenarios(
        find_unused=True,
        model=model_specs(require_optional=True),
    )
)
def test_unused_parameters_are_zero_locally_and_untouched_globally(scenario: Scenario) -> None:
    untouched = sum(e.untouched for e in reference(scenario))
    event(f"globally unused parameters: {min(untouched, 3)}{'+' if untouched > 3 else ''}")
    check_against_reference(scenario)
