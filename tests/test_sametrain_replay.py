"""reducer.testing.check_same_training: a training step under test against its replay as one
process on the global batch, with the findings of a launch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reducer.testing import Verdict, check_same_training


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 3))


def batch(n: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def mean_loss(model: nn.Module, b: Any) -> Tensor:
    return F.cross_entropy(model(b[0]), b[1])


def two_ranks(n: int = 5) -> list[list[tuple[Tensor, Tensor]]]:
    return [[batch(n, 1)], [batch(n, 2)]]


def causes(verdict: Verdict) -> set[str]:
    return {f.cause for f in verdict.findings}


def test_a_correct_step_is_the_same_training_and_the_replay_agrees() -> None:
    verdict = check_same_training(mlp(), mean_loss, two_ranks())
    assert verdict.same and not verdict.findings
    assert any("replay: the averaged gradient equals one process's" in n for n in verdict.notes)
    three = [[batch(4, s), batch(4, s + 10)] for s in range(3)]  # 3 ranks, 2 micro-steps

    def accumulated(model: nn.Module, b: Any) -> Tensor:
        return mean_loss(model, b) / 2

    assert check_same_training(mlp(), accumulated, three).same


@pytest.mark.parametrize(
    ("cause", "loss_fn", "batches"),
    [
        (
            "summed-loss",
            lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="sum"),
            two_ranks(),
        ),
        ("accumulation-scale", mean_loss, [[batch(4, 1), batch(4, 2)], [batch(4, 3), batch(4, 4)]]),
        ("uneven-batches", mean_loss, [[batch(6, 1)], [batch(2, 2)]]),
        ("same-batches", mean_loss, [[batch(5, 1)], [batch(5, 1)]]),
        # A hand-written sum: no torch loss function to read, the replay finds the factor.
        (
            "loss-scale",
            lambda m, b: (m(b[0]).logsumexp(1) - m(b[0]).gather(1, b[1][:, None])[:, 0]).sum(),
            two_ranks(),
        ),
    ],
)
def test_each_mistake_is_named(cause: str, loss_fn: Any, batches: Any) -> None:
    with pytest.raises(AssertionError, match=rf"FINDING \({cause}\)"):
        check_same_training(mlp(), loss_fn, batches)
    verdict = check_same_training(mlp(), loss_fn, batches, raise_on_finding=False)
    assert causes(verdict) == {cause}, verdict.report()


def test_per_rank_batchnorm_is_named_and_the_replay_differs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3))
    verdict = check_same_training(model, mean_loss, two_ranks(), raise_on_finding=False)
    assert causes(verdict) == {"per-rank-batchnorm"}
    assert any("differs from one process's" in n for n in verdict.notes)


def test_a_declared_choice_is_not_a_finding() -> None:
    def summed(m: nn.Module, b: Any) -> Tensor:
        return F.cross_entropy(m(b[0]), b[1], reduction="sum")

    verdict = check_same_training(mlp(), summed, two_ranks(), deliberate=["summed-loss"])
    assert verdict.same and [f.cause for f in verdict.silenced] == ["summed-loss"]
    assert "declared deliberate, not reported: summed-loss" in verdict.report()


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="as many for every rank"):
        check_same_training(mlp(), mean_loss, [[batch(2, 1)], []])
    with pytest.raises(ValueError, match="one list of micro-batches per rank"):
        check_same_training(mlp(), mean_loss, [])
    with pytest.raises(ValueError, match="scalar loss tensor"):
        check_same_training(mlp(), lambda m, b: m(b[0]), two_ranks())
    with pytest.raises(ValueError, match="unknown cause 'sum'"):
        check_same_training(mlp(), mean_loss, two_ranks(), deliberate=["sum"])
    with pytest.raises(TypeError, match=r"nn\.Module"):
        check_same_training(lambda x: x, mean_loss, two_ranks())  # type: ignore[arg-type]


def test_kwargs_and_mappings_are_fingerprinted() -> None:
    """A model called with keyword arguments (HF-shaped): its inputs count, so different
    batches are not taken for the same ones, and equal ones are."""

    class Kwargs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, *, input: Tensor, labels: Tensor) -> Tensor:
            return F.cross_entropy(self.net(input), labels)

    def loss_fn(model: nn.Module, b: Any) -> Tensor:
        return model(**b)  # type: ignore[no-any-return]

    def as_dict(b: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
        return {"input": b[0], "labels": b[1]}

    different = [[as_dict(batch(4, 1))], [as_dict(batch(4, 2))]]
    assert check_same_training(Kwargs(), loss_fn, different).same
    same = [[as_dict(batch(4, 1))], [as_dict(batch(4, 1))]]
    verdict = check_same_training(Kwargs(), loss_fn, same, raise_on_finding=False)
    assert causes(verdict) == {"same-batches"}


def test_inputs_the_evidence_cannot_read_do_not_stop_the_step() -> None:
    """A sparse input cannot be fingerprinted: the step runs, and no batches are matched."""

    class Sparse(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, x: Tensor) -> Tensor:
            return self.net(x.to_dense())  # type: ignore[no-any-return]

    def loss_fn(model: nn.Module, b: Any) -> Tensor:
        return F.cross_entropy(model(b[0].to_sparse()), b[1])

    same = [[batch(4, 1)], [batch(4, 1)]]
    verdict = check_same_training(Sparse(), loss_fn, same, raise_on_finding=False)
    assert "same-batches" not in causes(verdict)
