"""Property 3: k local backward passes, then a synced one, reduce the accumulated sums.

One to three local (no-sync) backward passes, each with its own per-rank unused pattern, then
the synced one. The reference accumulates the same passes and counts a parameter as used on a
rank if any of them (not just the synced one) gave it a gradient there: what a rank computed
in a local pass is contributed even if the synced pass does not use the parameter.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings

from reducer.testing.harness import Scenario, check_against_reference, note_coverage
from reducer.testing.model import BranchSpec, ModelSpec
from reducer.testing.strategies import model_specs, scenarios

# A linear branch (parameters 0, 1), an optional sparse embedding (2), an optional MLP (3-5).
_OPTIONAL = ModelSpec(
    (
        BranchSpec("linear"),
        BranchSpec("embedding", sparse=True, optional=True),
        BranchSpec("mlp", optional=True),
    ),
    seed=3,
)


# The core properties get four times the profile's examples (ci: 100).
@pytest.mark.slow
@settings(max_examples=4 * settings().max_examples)
@given(
    scenarios(
        min_local_steps=1,
        max_local_steps=3,
        model=model_specs(allow_wide=True, allow_checkpoint=True),
    )
)
@example(  # only rank 0's local passes use the embedding and the MLP; the synced one does not
    Scenario(
        _OPTIONAL,
        3,
        1,
        ((2,), (0, 1, 3, 4, 5)),
        (
            (frozenset({1, 2}), frozenset(), frozenset()),
            (frozenset({1}), frozenset(), frozenset()),
            (frozenset(), frozenset(), frozenset()),
        ),
        True,
        preset_grads=True,
        preset_sparse=True,
    )
)
@example(  # the same as bucket views, two replicas, each rank using the MLP in turn
    Scenario(
        _OPTIONAL,
        2,
        2,
        ((5, 4, 3), (2,), (1, 0)),
        ((frozenset({2}), frozenset()), (frozenset(), frozenset({2})), (frozenset(), frozenset())),
        True,
        as_view=True,
    )
)
def test_accumulated_gradients_are_averaged_and_nothing_is_lost(scenario: Scenario) -> None:
    note_coverage(scenario)
    check_against_reference(scenario)
