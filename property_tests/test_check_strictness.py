"""Property 8: ``reducer.testing``'s own check is exact, and its scenarios reach W = 3.

The properties of the wrappers stand on ``reducer.testing.checks.check_data_parallel`` and
on the scenarios ``reducer.testing.strategies`` draws. Two ways they could stop finding
bugs, whatever the wrappers do, are checked here against wrappers wrong on purpose:

- the comparison: a wrapper whose every gradient is the exact average moved by one unit in
  the last place (``torch.nextafter``) must fail the check, in every drawn scenario: a
  comparison with any tolerance lets it pass;
- the world sizes: a wrapper that divides by W where torch's DDP multiplies by ``1.0 / W``
  (the same bits at every power of two) must be found by the scenarios within the ``ci``
  profile's examples: scenarios that never draw three ranks never find it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, event, find, given, settings
from torch import Tensor

from reducer.testing import TrainingScenario, check_data_parallel, generated_training_scenarios
from reducer.testing.harness import note_size
from reducer.testing.profiles import CI_MAX_EXAMPLES
from reducer.testing.strategies import model_specs

from .test_wrappers import NaiveDataParallel


class _Reducing(NaiveDataParallel):
    """A user's wrapper (:class:`NaiveDataParallel`): each gradient, once accumulated, is
    ``scale``-d, allreduced (synchronously) and then ``adjust``-ed into the average."""

    def _reduce(self, p: Tensor) -> None:
        assert p.grad is not None
        self.scale(p.grad, self.pg.size())
        self.pg.allreduce([p.grad]).wait()
        self.adjust(p.grad)

    def scale(self, grad: Tensor, world_size: int) -> None:
        grad.mul_(1.0 / world_size)  # torch's DDP

    def adjust(self, grad: Tensor) -> None:
        pass


class OneUlpOff(_Reducing):
    """The exact average, then every element moved one unit in the last place up."""

    def adjust(self, grad: Tensor) -> None:
        grad.copy_(torch.nextafter(grad, torch.full_like(grad, float("inf"))))


class DividesByW(_Reducing):
    """``g / W`` where torch's DDP computes ``g * (1.0 / W)``: right at 1, 2 and 4 ranks."""

    def scale(self, grad: Tensor, world_size: int) -> None:
        grad.div_(world_size)


# Small dense models, every branch used: the check's strictness, not the wrappers', is at
# stake. Two steps at most.
def strictness_scenarios() -> Any:
    return generated_training_scenarios(
        model=model_specs(max_branches=2, max_params=3, allow_sparse=False, allow_unused=False),
        max_steps=2,
    )


def check_one_ulp_is_caught(s: TrainingScenario) -> None:
    """The property: the check refuses a wrapper one ulp away from the exact average."""
    with pytest.raises(AssertionError, match="not bitwise equal to the exact reference"):
        check_data_parallel(OneUlpOff, s, scaling="reciprocal")


@given(strictness_scenarios())
def test_a_wrapper_one_ulp_off_the_average_fails_the_check(s: TrainingScenario) -> None:
    note_size(len(list(s.make_model().parameters())), s.world_size)
    event(f"world size {s.world_size}")
    check_one_ulp_is_caught(s)


# The ci profile's example count, derandomized: what a CI run of a wrapper's property draws.
_CI_SEARCH = settings(
    max_examples=CI_MAX_EXAMPLES,
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.generate],
    suppress_health_check=list(HealthCheck),
)


def check_division_is_found() -> TrainingScenario:
    """The property: within the ci profile's examples, the scenarios find a wrapper that
    divides where torch multiplies; the example found."""

    def fails(s: TrainingScenario) -> bool:
        try:
            check_data_parallel(DividesByW, s, scaling="reciprocal")
        except AssertionError:
            return True
        return False

    found: TrainingScenario = find(strictness_scenarios(), fails, settings=_CI_SEARCH)
    return found


def test_the_scenarios_find_a_division_that_differs_only_at_three_ranks() -> None:
    found = check_division_is_found()
    assert found.world_size == 3, f"found at world size {found.world_size}"
