"""The Hypothesis profiles, and the example database that saves and replays failures.

``HYPOTHESIS_PROFILE`` picks ``ci`` (derandomized, no database: the same examples on every
run, a failure printed with its reproduction blob), ``dev`` (the default) or ``thorough``
(random, failures saved in ``.hypothesis/examples`` and tried first on the next run).
"""

from __future__ import annotations

import pytest
from hypothesis import Phase, given, settings
from hypothesis.database import InMemoryExampleDatabase

from reducer.testing.harness import Scenario, check_against_reference
from reducer.testing.strategies import model_specs, scenarios

from .mutants import SkipDivide


def test_the_profiles_bound_ci_and_keep_failures_elsewhere() -> None:
    ci, dev, thorough = (settings.get_profile(name) for name in ("ci", "dev", "thorough"))
    assert ci.derandomize and ci.database is None and ci.print_blob
    for profile in (dev, thorough):
        assert not profile.derandomize and profile.database is not None
    assert ci.max_examples < dev.max_examples < thorough.max_examples
    assert ci.deadline is None and dev.deadline is None and thorough.deadline is None


def test_a_failing_example_is_saved_and_replayed_first() -> None:
    database = InMemoryExampleDatabase()
    seen: list[Scenario] = []

    @settings(
        settings.get_profile("dev"),
        database=database,
        max_examples=200,
        phases=[Phase.reuse, Phase.generate, Phase.shrink],
        # One failure, always the dense one the test expects: with sparse parameters, random
        # generation can also find the sparse failure and report both as an ExceptionGroup.
        report_multiple_bugs=False,
    )
    @given(scenarios(unused=False, model=model_specs(allow_sparse=False)))
    def averaging_with_a_bug(scenario: Scenario) -> None:
        seen.append(scenario)
        check_against_reference(scenario, SkipDivide)

    with pytest.raises(AssertionError, match="rank-order average"):
        averaging_with_a_bug()
    shrunk = seen[-1]  # the minimal failing example is run last, to report it
    assert database.data, "the failing example was not saved"
    seen.clear()
    with pytest.raises(AssertionError, match="rank-order average"):
        averaging_with_a_bug()
    # Replayed first, and the strategies rebuild exactly the same scenario from it.
    assert seen[0] == shrunk
