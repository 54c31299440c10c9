"""Property 2: globally unused parameters keep .grad untouched; locally unused count as zero.

Every scenario has an optional branch. Each step, either every rank runs everything, or each
rank picks, or one branch is skipped by every rank (its parameters are then globally unused,
unless a shared branch still uses them). Existing gradients (dense and sparse) make
"untouched" observable.
"""

from __future__ import annotations

import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from reducer.testing.harness import (
    Scenario,
    check_against_reference,
    note_coverage,
    reference,
    refusal,
)
from reducer.testing.model import BranchSpec, ModelSpec
from reducer.testing.strategies import model_specs, scenarios

# A linear branch, then an optional sparse embedding (parameter 2) and an optional conv1d (3, 4).
_OPTIONAL = ModelSpec(
    (
        BranchSpec("linear"),
        BranchSpec("embedding", sparse=True, optional=True),
        BranchSpec("conv1d", optional=True),
    )
)


# Eight times the profile's examples (ci: 200): unused patterns x sparse tables x bucket views
# is the widest space among the core properties.
@pytest.mark.slow
@settings(max_examples=8 * settings().max_examples)
@given(
    scenarios(
        find_unused=True,
        # Half the models have an optional sparse table: rare when drawn freely.
        model=st.one_of(
            model_specs(require_optional=True, allow_wide=True, allow_checkpoint=True),
            model_specs(
                require_optional=True, allow_wide=True, allow_checkpoint=True, sparse_optional=True
            ),
        ),
    )
)
@example(  # the embedding unused on both ranks keeps its sparse .grad; conv1d used on rank 1 only
    Scenario(
        _OPTIONAL,
        2,
        2,
        ((2,), (4, 0), (1, 3)),
        ((frozenset(), frozenset({2})),),
        True,
        preset_grads=True,
        preset_sparse=True,
    )
)
@example(  # the embedding used on rank 2 only, conv1d on ranks 1 and 2
    Scenario(
        _OPTIONAL,
        3,
        1,
        ((0, 1, 3, 4), (2,)),
        ((frozenset(), frozenset({2}), frozenset({1, 2})),),
        True,
        preset_sparse=True,
    )
)
def test_unused_parameters_are_zero_locally_and_untouched_globally(scenario: Scenario) -> None:
    if refusal(scenario) is None:
        untouched = sum(e.untouched for e in reference(scenario))
        event(f"globally unused parameters: {min(untouched, 3)}{'+' if untouched > 3 else ''}")
    note_coverage(scenario)
    check_against_reference(scenario)
