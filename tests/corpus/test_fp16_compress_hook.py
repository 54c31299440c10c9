"""The corpus: torch's fp16 compression hook before its overflow fix fails, the fix passes."""

import pytest
import torch
from corpus_fp16_hook import fp16_compress_hook_before_fix, fp16_compress_hook_fixed
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from reducer.testing import check_comm_hook, training_scenarios
from reducer.testing.strategies import gradient_scales


def model() -> nn.Module:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 2))


def batch(generator: torch.Generator, skip: frozenset[int]) -> tuple[torch.Tensor]:
    return (torch.rand(3, 8, generator=generator) * 2 - 1,)  # gradients of at most 3


def within_fp16_rounding(hook: object) -> object:
    @settings(max_examples=30, derandomize=True, database=None, deadline=None)
    @given(
        training_scenarios(
            model,
            batch,
            world_sizes=st.just(2),
            loss=lambda out: out.sum(),
            loss_scales=gradient_scales(),
            lr=0.0,
        )
    )
    def test(scenario: object) -> None:
        check_comm_hook(hook, scenario, norm_rtol=1e-2, atol=1e-6)  # type: ignore[arg-type]

    return test


def test_the_fixed_hook_passes() -> None:
    within_fp16_rounding(fp16_compress_hook_fixed)()  # type: ignore[operator]


@pytest.mark.slow
def test_the_hook_before_the_fix_overflows() -> None:
    with pytest.raises(
        AssertionError, match=r"Diagnosis: .* inf where the exact average is finite"
    ):
        within_fp16_rounding(fp16_compress_hook_before_fix)()  # type: ignore[operator]
