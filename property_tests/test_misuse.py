"""The testing library refuses misuse at its entry points, over every drawn argument: exactly
the invalid ones, each with an error naming the argument and what was given.

- loss scales: ``gradient_scales`` of any floats (inf and NaN among them) is refused exactly
  when one is not finite, naming the first such index;
- ``hierarchical_averaging``'s periods: any mapping (or a list) of integers is taken exactly
  when it is a non-empty mapping of periods and group sizes of 1 or more;
- ``training_scenarios`` drawing a world size or a number of steps below 1 names the
  argument and the value drawn;
- a scenario's inputs: any arrangement of argument tuples and bare tensors is refused
  exactly when some rank's entry is a tensor, naming the first one by step and rank;
- a model factory: one that reseeds builds the same weights every call and is checked; one
  that does not is refused before any rank starts ("not deterministic"), never reported as
  a gradient mismatch;
- a reference's optimizer: torch's ZeroRedundancyOptimizer, bare or inside any nesting of
  ``functools.partial``, is refused by every reference that takes an optimizer, naming the
  reference; a plain optimizer nested the same way is taken.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from reducer.testing import (
    TrainingScenario,
    check_data_parallel,
    ddp_average,
    fsdp2_shards,
    hierarchical_averaging,
    periodic_averaging,
    torch_ddp,
    training_scenarios,
    zero_redundancy,
)
from reducer.testing.strategies import gradient_scales

ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True, width=64)


def check_loss_scales(case: dict[str, Any]) -> None:
    """``gradient_scales(scales)`` is refused exactly when a scale is not finite."""
    scales = case["scales"]
    bad = [i for i, v in enumerate(scales) if not math.isfinite(v)]
    if not bad:
        gradient_scales(scales)
        return
    with pytest.raises(ValueError, match=rf"gradient_scales: scales\[{bad[0]}\] is .*finite"):
        gradient_scales(scales)


@given(st.fixed_dictionaries({"scales": st.lists(ANY_FLOAT, min_size=1, max_size=4)}))
def test_loss_scales_are_refused_exactly_when_not_finite(case: dict[str, Any]) -> None:
    check_loss_scales(case)


def check_period_group_sizes(sizes: Any) -> None:
    valid = (
        isinstance(sizes, dict) and bool(sizes) and all(k >= 1 and v >= 1 for k, v in sizes.items())
    )
    if valid:
        hierarchical_averaging(sizes)
        return
    with pytest.raises(ValueError, match=r"hierarchical_averaging: period_group_sizes"):
        hierarchical_averaging(sizes)


@given(
    st.dictionaries(st.integers(-2, 6), st.integers(-2, 6), max_size=3)
    | st.lists(st.integers(1, 6), max_size=3)
)
def test_periods_are_taken_exactly_when_a_mapping_of_counts(sizes: Any) -> None:
    check_period_group_sizes(sizes)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _inputs(generator: torch.Generator, skip: frozenset[int]) -> tuple[Any, ...]:
    return (torch.randn(2, 3, generator=generator),)


@given(st.data(), st.sampled_from(["world_sizes", "steps"]), st.integers(-3, 0))
def test_drawing_fewer_than_one_rank_or_step_names_the_argument(
    data: st.DataObject, argument: str, value: int
) -> None:
    strategy = training_scenarios(_mlp, _inputs, **{argument: st.just(value)})
    with pytest.raises(ValueError, match=rf"training_scenarios: {argument} drew {value}; "):
        data.draw(strategy)


def check_input_kinds(case: dict[str, Any]) -> None:
    """``TrainingScenario`` is refused exactly when some ``inputs[step][rank]`` is a bare
    tensor, naming the first."""
    x = torch.zeros(2, 3)
    layout: list[list[bool]] = case["tensor_at"]  # per step and rank: a bare tensor there?
    inputs = tuple(tuple(x if bare else (x,) for bare in step) for step in layout)
    first = next(
        ((k, r) for k, step in enumerate(layout) for r, bare in enumerate(step) if bare), None
    )
    if first is None:
        TrainingScenario(_mlp, inputs)
        return
    k, r = first
    with pytest.raises(TypeError, match=rf"inputs\[{k}\]\[{r}\] is a Tensor of shape \(2, 3\)"):
        TrainingScenario(_mlp, inputs)


@st.composite
def input_layouts(draw: st.DrawFn) -> dict[str, Any]:
    ranks = draw(st.integers(1, 3))
    steps = draw(st.integers(1, 2))
    rows = st.lists(st.booleans(), min_size=ranks, max_size=ranks)
    return {"tensor_at": draw(st.lists(rows, min_size=steps, max_size=steps))}


@given(input_layouts())
def test_a_bare_tensor_among_the_inputs_is_named(case: dict[str, Any]) -> None:
    check_input_kinds(case)


def check_model_factory(case: dict[str, Any]) -> None:
    """A factory that reseeds is checked to the end; one that does not is refused as not
    deterministic, before any rank starts."""

    def make() -> nn.Module:
        if case["seeded"]:
            torch.manual_seed(case["seed"])
        return nn.Linear(3, 2)

    x = torch.ones(2, 3)
    one_step = tuple((x * (r + 1),) for r in range(case["ranks"]))
    scenario = TrainingScenario(make, (one_step,))
    if case["seeded"]:
        check_data_parallel(torch_ddp(), scenario)
        return
    with pytest.raises(ValueError, match=r"make_model is not deterministic"):
        check_data_parallel(torch_ddp(), scenario)


def model_factories() -> st.SearchStrategy[dict[str, Any]]:
    """A factory that reseeds (with a drawn seed) or not, for one or two ranks."""
    return st.fixed_dictionaries(
        {"seeded": st.booleans(), "seed": st.integers(0, 2**16), "ranks": st.integers(1, 2)}
    )


@given(model_factories())
def test_a_model_factory_that_is_not_deterministic_is_named(case: dict[str, Any]) -> None:
    check_model_factory(case)


# Each reference that takes an optimizer factory, by the name its errors give it.
_REFERENCES: dict[str, Callable[[Any], object]] = {
    "ddp_average": lambda opt: ddp_average(optimizer=opt),
    "fsdp2_shards": lambda opt: fsdp2_shards(optimizer=opt),
    "zero_redundancy": zero_redundancy,
    "periodic_averaging": lambda opt: periodic_averaging(2, optimizer=opt),
    "hierarchical_averaging": lambda opt: hierarchical_averaging({2: 1}, optimizer=opt),
}


@st.composite
def reference_optimizers(draw: st.DrawFn) -> dict[str, Any]:
    """A reference, and an optimizer factory for it: ZeroRedundancyOptimizer or SGD, bare or
    wrapped in up to 3 ``functools.partial`` (each binding some of its keyword arguments)."""
    zero = draw(st.booleans())
    factory: Any = ZeroRedundancyOptimizer if zero else torch.optim.SGD
    options = (
        [("optimizer_class", torch.optim.SGD), ("lr", 0.1)]
        if zero
        else [("lr", 0.1), ("momentum", 0.9)]
    )
    for name, value in options[: draw(st.integers(0, 2))]:
        factory = functools.partial(factory, **{name: value})
    for _ in range(draw(st.integers(0, 1))):  # a partial binding nothing
        factory = functools.partial(factory)
    return {
        "reference": draw(st.sampled_from(sorted(_REFERENCES))),
        "factory": factory,
        "zero": zero,
    }


def check_zero_redundancy_refused(case: dict[str, Any]) -> None:
    """A reference is refused exactly when its optimizer is ZeroRedundancyOptimizer, however
    deep inside partials, with an error naming the reference."""
    name, factory = case["reference"], case["factory"]
    make = _REFERENCES[name]
    if not case["zero"]:
        make(factory)
        return
    expected = (
        f"{name}: optimizer= is torch's ZeroRedundancyOptimizer, which needs a process group, "
        "while the reference steps plain models outside any."
    )
    with pytest.raises(ValueError, match=re.escape(expected)):
        make(factory)


@given(reference_optimizers())
def test_zero_redundancy_is_refused_as_a_references_optimizer_through_partials(
    case: dict[str, Any],
) -> None:
    check_zero_redundancy_refused(case)


# What a wrapper factory may return by mistake, and how the refusal describes it.
_NOT_MODULES: dict[str, tuple[Callable[[nn.Module, Any], object], str]] = {
    "nothing": (lambda module, pg: None, "None: "),
    "a number": (lambda module, pg: 3, "an int 3; "),
    "a tuple": (lambda module, pg: (module,), "a tuple (Linear("),
    "the group": (lambda module, pg: pg, "a FakeProcessGroup instance; "),
}


def check_wrapper_result(case: dict[str, Any]) -> None:
    """A wrapper factory that returns anything but a module is refused on its first call,
    naming the factory and what it returned; one that returned nothing is told to end with
    ``return module`` (as a factory that wraps in place, like fully_shard, must)."""
    make_wrapper, shown = _NOT_MODULES[case["returns"]]
    x = torch.ones(2, 3)
    scenario = TrainingScenario(_mlp, (tuple((x * (r + 1),) for r in range(case["ranks"])),))
    with pytest.raises(ValueError, match=r"^make_wrapper \(") as refused:
        check_data_parallel(make_wrapper, scenario)
    message = str(refused.value)
    assert message.startswith(f"make_wrapper (<lambda>) returned {shown}"), message
    hint = "must still return it, ending with `return module`"
    assert (hint in message) == (case["returns"] == "nothing"), message
    assert "expected the nn.Module each rank trains and calls forward on" in message, message


@given(
    st.fixed_dictionaries(
        {"returns": st.sampled_from(sorted(_NOT_MODULES)), "ranks": st.integers(1, 2)}
    )
)
def test_a_wrapper_factory_that_returns_no_module_is_named(case: dict[str, Any]) -> None:
    check_wrapper_result(case)


# periodic_averaging's integer arguments, and the least each may be.
_PERIODIC_COUNTS = {"period": 1, "warmup_steps": 0, "group_size": 1, "gradient_group_size": 1}


@given(
    argument=st.sampled_from(sorted(_PERIODIC_COUNTS)),
    value=st.integers(-3, 3) | st.sampled_from([2.0, True, "2", None]),
)
def test_periodic_averagings_counts_are_refused_by_name(argument: str, value: object) -> None:
    """Property: each integer argument of ``periodic_averaging`` is taken exactly when it is
    an int (not a bool) of at least its minimum; else refused naming the function, the
    argument and the value (``group_size=None``: every rank, its default)."""
    minimum = _PERIODIC_COUNTS[argument]
    kwargs: dict[str, Any] = {"period": 2, argument: value}
    valid = (type(value) is int and value >= minimum) or (
        argument == "group_size" and value is None
    )
    if valid:
        periodic_averaging(**kwargs)
        return
    expected = (
        f"periodic_averaging: {argument} is {value!r}; expected an integer of {minimum} or more"
    )
    with pytest.raises(ValueError, match="^" + re.escape(expected) + "$"):
        periodic_averaging(**kwargs)
