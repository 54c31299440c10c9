"""``reducer._averages``: the three exact roundings, and what each kind of wrong average is
recognised as (the diagnosis launch's replica check and the testing checks share)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from reducer._averages import ROUNDINGS, average, averages, explain

W = 3


def _grads() -> list[Tensor | None]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(64, generator=generator) for _ in range(W)]


def test_the_roundings_differ_at_three_ranks_and_each_is_accepted() -> None:
    grads = _grads()
    every = averages(grads, W)
    assert len({tuple(t.tolist()) for t in every.values() if t is not None}) == 3
    for rounding in ROUNDINGS:
        assert explain(every[rounding], grads, W) is None  # type: ignore[arg-type]


def test_a_pinned_rounding_names_the_scaling_that_accepts_the_other() -> None:
    grads = _grads()
    got = average(grads, W, "divide")
    assert got is not None
    cause = explain(got, grads, W, accepted=("reciprocal",))
    assert cause is not None and "scaling='divide' accepts it" in cause


def _sum(ts: list[Tensor]) -> Tensor:
    total = ts[0].clone()
    for t in ts[1:]:
        total += t
    return total


@pytest.mark.parametrize(
    ("wrong", "words"),
    [
        (lambda g: g[1].clone(), "rank 1's local gradient: nothing was reduced"),
        (lambda g: _sum(g), "W times the average"),
        (lambda g: _sum(g) / W / W, f"divided by {W} twice"),
        (lambda g: (g[0] + g[2]) / 2, r"average of ranks [0, 2] only, divided by their number"),
        (lambda g: (g[0] + g[1]) / W, "average of ranks [0, 1] only, divided by the world size"),
        (lambda g: torch.nextafter(_sum(g) / W, torch.tensor(9.0)), "within 1 ulp"),
        (lambda g: _sum(g) / W + 1.0, "differs from the average sum of g_r * (1/W) by up to 1"),
    ],
)
def test_each_wrong_average_is_recognised(wrong: object, words: str) -> None:
    grads = _grads()
    got = wrong([g for g in grads if g is not None])  # type: ignore[operator]
    cause = explain(got, grads, W)
    assert cause is not None and words in cause, cause


def test_a_missing_contribution_counts_as_zeros() -> None:
    grads = _grads()
    grads[1] = None
    assert explain(average(grads, W, "reciprocal"), grads, W) is None  # type: ignore[arg-type]
    assert average([None, None], 2, "divide") is None
