"""The harness itself: the reference sums in the documented order, and a comparison does not
depend on which thread computed what."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from reducer.testing.harness import Scenario, check_against_reference
from reducer.testing.model import BranchSpec, ModelSpec
from reducer.testing.reference import rank_order_average


def test_rank_order_average_adds_left_to_right_after_dividing() -> None:
    # In float32, 2**24 + 1 rounds back to 2**24: the order of the additions shows.
    big, one = torch.tensor([2.0**25]), torch.tensor([2.0])
    big_first = rank_order_average([big, one, one], 2)
    big_last = rank_order_average([one, one, big], 2)
    assert big_first is not None and big_first.item() == 2.0**24
    assert big_last is not None and big_last.item() == 2.0**24 + 2
    # A contribution of None adds zeros, and every term is divided before the sum.
    third = rank_order_average([torch.tensor([1.0]), None, torch.tensor([1.0])], 3)
    assert third is not None and third.item() == (torch.tensor([1.0]) / 3).item() * 2
    assert rank_order_average([None, None], 2) is None


@pytest.fixture
def other_thread_count() -> Iterator[int]:
    """The process runs with a different intra-op thread count than usual, then is restored."""
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1
    torch.set_num_threads(other)
    yield other
    torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["conv1d", "conv2d"])
def test_the_comparison_holds_under_any_intra_op_thread_count(
    other_thread_count: int, kind: str
) -> None:
    # Convolution gradients depend on how many threads split their reduction. The reference
    # is computed on this thread, the ranks on new ones: both must use the same count.
    assert torch.get_num_threads() == other_thread_count
    spec = ModelSpec((BranchSpec("linear", width=1, out=1), BranchSpec(kind, width=1, out=1)))
    for world_size in (1, 3):
        scenario = Scenario(
            spec,
            world_size,
            1,
            tuple((i,) for i in range(spec.parameter_count)),
            ((frozenset(),) * world_size,),
            find_unused=False,
        )
        check_against_reference(scenario)
