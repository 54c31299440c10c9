"""Property 1: every dense gradient is the bit-exact rank-order average, on every rank.

Every branch runs on every rank (no unused parameters: property 2), over 1 to 8 ranks with 1
to 3 replicas each, any valid bucket assignment, with or without existing gradients and
bucket views, and now and then a wide layer whose weight takes the reducer's paths for large
parameters. The explicit examples pin the cases a small ``ci`` run must not miss.
"""

from __future__ import annotations

import torch
from hypothesis import example, given, settings

from reducer.testing.harness import Scenario, check_against_reference, note_coverage
from reducer.testing.model import BranchSpec, ModelSpec, wide_width
from reducer.testing.strategies import model_specs, scenarios

_WIDE = ModelSpec((BranchSpec("linear", width=wide_width(2), out=2),), seed=1)
# conv2d + head (float32, parameters 0-2), sparse embedding (3), LayerNorm stack in float64
# (4-7), and a branch that reuses the conv2d stack on an input of its own.
_MIXED = ModelSpec(
    (
        BranchSpec("conv2d", head=True),
        BranchSpec("embedding", sparse=True),
        BranchSpec("layernorm", dtype=torch.float64),
        BranchSpec("conv2d", head=True, shared_with=0),
    ),
    seed=2,
)


# The core properties get four times the profile's examples (ci: 100).
@settings(max_examples=4 * settings().max_examples)
@given(
    scenarios(
        unused=False, model=model_specs(allow_unused=False, allow_wide=True, allow_checkpoint=True)
    )
)
@example(  # a weight of 2**16 elements, 3 ranks (the division by 3 is inexact), 2 replicas
    Scenario(_WIDE, 3, 2, ((0, 1),), ((frozenset(),) * 3,), False, preset_grads=True)
)
@example(  # the same as bucket views, the last parameter's bucket first
    Scenario(_WIDE, 3, 2, ((1,), (0,)), ((frozenset(),) * 3,), True, as_view=True)
)
@example(  # everything mixed, 5 ranks of 3 replicas, buckets out of order, existing gradients
    Scenario(
        _MIXED,
        5,
        3,
        ((6, 4), (3,), (2, 0, 1), (7, 5)),
        ((frozenset(),) * 5,),
        True,
        preset_grads=True,
        preset_sparse=True,
    )
)
def test_every_gradient_is_the_exact_average(scenario: Scenario) -> None:
    note_coverage(scenario)
    check_against_reference(scenario)
