"""The autograd-graph search that finds unused parameters."""

from __future__ import annotations

import torch
from torch import nn

from reducer.graph import gradient_accumulator, reached_accumulators


def accumulators(module: nn.Module) -> dict[object, str]:
    return {gradient_accumulator(p): name for name, p in module.named_parameters()}


def test_finds_the_parameters_a_branch_did_not_use() -> None:
    model = nn.ModuleDict({"used": nn.Linear(3, 3), "unused": nn.Linear(3, 3)})
    acc = accumulators(model)
    out = model["used"](torch.randn(2, 3))
    assert reached_accumulators([out], acc) == {"used.weight", "used.bias"}


def test_a_parameter_returned_as_is_counts_as_used() -> None:
    model = nn.Linear(2, 2)
    acc = accumulators(model)
    assert reached_accumulators([model.bias], acc) == {"bias"}


def test_outputs_without_a_graph_reach_nothing() -> None:
    model = nn.Linear(2, 2)
    acc = accumulators(model)
    with torch.no_grad():
        out = model(torch.randn(1, 2))
    assert reached_accumulators([out, torch.ones(1)], acc) == set()


def test_shared_parameters_and_several_outputs() -> None:
    shared = nn.Linear(2, 2)
    other = nn.Linear(2, 2)
    model = nn.ModuleDict({"shared": shared, "other": other})
    acc = accumulators(model)
    x = torch.randn(1, 2)
    outs = [shared(shared(x)), other.weight.sum() * 0]
    assert reached_accumulators(outs, acc) == {"shared.weight", "shared.bias", "other.weight"}


def test_the_accumulator_is_stable_while_held() -> None:
    param = nn.Parameter(torch.zeros(2))
    node = gradient_accumulator(param)
    (param * 2).sum().backward()
    assert gradient_accumulator(param) is node
