"""Property 8: ``reducer.testing``'s own check is exact, and its scenarios reach W = 3.

The properties of the wrappers stand on ``reducer.testing.checks.check_data_parallel`` and
on the scenarios ``reducer.testing.strategies`` draws. Two ways they could stop finding
bugs, whatever the wrappers do, are checked here against wrappers wrong on purpose:

- the comparison: a wrapper whose every gradient is the exact average moved by one unit in
  the last place (``torch.nextafter``) must fail the check, in every drawn scenario: a
  comparison with any tolerance lets it pass;
- the world sizes: a wrapper that divides by W where torch's DDP multiplies by ``1.0 / W``
  (the same bits at every power of two) must be found by the scenarios within the ``ci``
  profile's examples: scenarios that never draw three ranks never find it;
- the roundings: with the default (any of torch's roundings accepted), a wrapper that gives
  exactly one rounding (drawn) passes and the report names it, and a wrapper one ulp away
  (up or down, drawn) from every rounding, element by element, fails: an acceptance of
  near values, where several roundings are candidates, lets it pass;
- the zeros: a wrapper whose exact average has zeros of the other sign (-0.0 for 0.0, as a
  reduction in another order gives) passes, with any rounding pinned or none: a comparison
  of bits alone fails it;
- what is there and what is not: on a model with a head no rank uses and a buffer, a
  wrapper that leaves the head without a gradient passes; one that drops a used
  parameter's gradient, gives the unused head a gradient of zeros, keeps the buffer or a
  gradient in another dtype, or a gradient in another memory layout (the same values)
  fails, each with its own message;
- the bounds of a lossy comm hook (``check_comm_hook``'s ``atol``, ``rtol``, ``range_rtol``,
  ``norm_rtol``): a hook that moves one element of the exact average by half the error the
  stated bounds allow passes, and by twice that error, or to infinity, fails, naming the
  parameter (elementwise bounds) or its bucket and bound (per-bucket ones), and the overflow
  where the value is infinite; an atol beside a per-bucket bound belongs to it (half the
  error allowed is more than the atol): a check that takes it for an elementwise bound too,
  skips a bound, or takes one kind for another gives another verdict.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, assume, event, find, given, settings
from hypothesis import strategies as st
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from reducer.testing import (
    CheckReport,
    TrainingScenario,
    check_comm_hook,
    check_data_parallel,
    generated_training_scenarios,
)
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


# -- the roundings and their one-ulp neighbours ------------------------------------------------


def _rank_order_sum(terms: list[Tensor]) -> Tensor:
    total = terms[0].clone()
    for term in terms[1:]:
        total = total + term
    return total


def roundings_of(column: list[Tensor]) -> dict[str, Tensor]:
    """torch's three roundings of the average of ``column`` (rank order), written out here
    rather than taken from the code under test."""
    world = len(column)
    return {
        "reciprocal": _rank_order_sum([g * (1.0 / world) for g in column]),
        "divide": _rank_order_sum([g / world for g in column]),
        "sum_then_divide": _rank_order_sum(column) / world,
    }


class _Rounded(NaiveDataParallel):
    """Every gradient, once accumulated, is gathered from every rank and replaced by the
    average with ``rounding``, moved ``ulps`` (-1, 0, +1) units in the last place; an
    element moved onto another rounding moves on, so that a moved gradient equals no
    rounding anywhere."""

    rounding: ClassVar[str] = "reciprocal"
    ulps: ClassVar[int] = 0
    flip_zeros: ClassVar[bool] = False  # 0.0 <-> -0.0 (the same value, other bits)

    def _reduce(self, p: Tensor) -> None:
        assert p.grad is not None
        world = self.pg.size()
        gathered = [torch.empty_like(p.grad) for _ in range(world)]
        self.pg.allgather([gathered], [p.grad.detach().clone()]).wait()
        every = roundings_of(gathered)
        value = every[self.rounding]
        if self.ulps:
            toward = torch.full_like(value, float("inf") if self.ulps > 0 else float("-inf"))
            value = torch.nextafter(value, toward)
            for _ in range(len(every)):  # past any rounding it landed on
                on_one = torch.zeros_like(value, dtype=torch.bool)
                for other in every.values():
                    on_one |= value == other
                value = torch.where(on_one, torch.nextafter(value, toward), value)
        if self.flip_zeros:
            value = torch.where(value == 0, -value, value)
        p.grad.copy_(value)


def rounded(rounding: str, ulps: int, flip_zeros: bool = False) -> type[NaiveDataParallel]:
    """The wrapper that gives ``rounding`` moved by ``ulps``: see :class:`_Rounded`."""
    attributes = {"rounding": rounding, "ulps": ulps, "flip_zeros": flip_zeros}
    return type(f"Rounded_{rounding}_{ulps}", (_Rounded,), attributes)


RoundingCase = tuple[TrainingScenario, str, int]


@st.composite
def rounding_cases(draw: st.DrawFn) -> RoundingCase:
    """(scenario, a rounding, its neighbour: 0 for itself, -1 or +1 ulp); a neighbour two
    times in three."""
    s = draw(strictness_scenarios())
    rounding = draw(st.sampled_from(["reciprocal", "divide", "sum_then_divide"]))
    return s, rounding, draw(st.sampled_from([1, -1, 0]))


def check_roundings_and_neighbours(case: RoundingCase) -> None:
    """The property: with the default (any rounding), a rounding passes and is reported; a
    value one ulp away from every rounding fails, as not bitwise equal."""
    s, rounding, ulps = case
    wrapper = rounded(rounding, ulps)
    if ulps == 0:
        report = check_data_parallel(wrapper, s)
        assert rounding in report.roundings, (rounding, report.roundings)
        return
    with pytest.raises(AssertionError, match="not bitwise equal to the exact reference"):
        check_data_parallel(wrapper, s)


@given(rounding_cases())
def test_the_default_check_takes_every_rounding_and_no_neighbour(case: RoundingCase) -> None:
    s, rounding, ulps = case
    note_size(len(list(s.make_model().parameters())), s.world_size)
    event(f"{rounding}, moved {ulps} ulp, world size {s.world_size}")
    check_roundings_and_neighbours(case)


class _ZeroColumn(torch.nn.Module):
    """One Linear layer, no bias, whose input's last column is zero: the last column of
    its weight's gradient is zero on every rank, exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 2, bias=False)
        with torch.no_grad():
            self.layer.weight.copy_(torch.arange(6.0).reshape(2, 3) / 7)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.layer(x)
        return out


ZeroCase = tuple[int, str | None, int]


@st.composite
def signed_zero_cases(draw: st.DrawFn) -> ZeroCase:
    """(world size, the rounding pinned or None for any, input seed)."""
    world = draw(st.sampled_from([1, 2, 3]))
    pinned = draw(st.sampled_from([None, "reciprocal", "divide", "sum_then_divide"]))
    return world, pinned, draw(st.integers(0, 2**16))


def check_signed_zeros_pass(case: ZeroCase) -> None:
    """The property: the exact rounding with its zeros of the other sign passes."""
    world, pinned, seed = case
    generator = torch.Generator().manual_seed(seed)

    def batch() -> Tensor:
        x = torch.randn(2, 3, generator=generator)
        x[:, -1] = 0.0
        return x

    inputs = tuple(tuple((batch(),) for _ in range(world)) for _ in range(1))
    s = TrainingScenario(_ZeroColumn, inputs)
    wrapper = rounded(pinned or "reciprocal", 0, flip_zeros=True)
    check_data_parallel(wrapper, s, scaling=pinned)  # type: ignore[arg-type]


@given(signed_zero_cases())
def test_zeros_of_the_other_sign_are_the_same_average(case: ZeroCase) -> None:
    note_size(1, case[0])
    event(f"world size {case[0]}, pinned {case[1]}")
    check_signed_zeros_pass(case)


class _HeadAndBuffer(torch.nn.Module):
    """A layer, a head no rank ever uses, and a buffer forward reads."""

    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.layer = torch.nn.Linear(3, 2, bias=False)
        self.unused = torch.nn.Linear(3, 2, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator))
        self.register_buffer("shift", torch.full((2,), 0.5))

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.layer(x) + self.shift
        return out


MISTAKES = ("none", "drop", "fill_unused", "buffer_dtype", "grad_dtype", "grad_strides")
_MESSAGES = {
    "drop": "expected a gradient, got None",
    "fill_unused": "expected no gradient (unused on every rank), got a gradient",
    "buffer_dtype": "buffer 'shift': not bitwise equal to the reference",
    "grad_dtype": "gradient: expected (2, 3) torch.float32, got (2, 3) torch.float64",
    "grad_strides": "gradient: strides (1, 2) where plain autograd gives (3, 1) (the wrapper "
    "must keep the gradient's memory layout)",
}


class _Mistaken(_Rounded):
    """The exact average (reciprocal), with one mistake (see :data:`MISTAKES`)."""

    mistake: ClassVar[str] = "none"

    def _reduce(self, p: Tensor) -> None:
        super()._reduce(p)
        module = self.module
        assert isinstance(module, _HeadAndBuffer)
        if self.mistake == "drop":
            p.grad = None
        elif self.mistake == "fill_unused":
            module.unused.weight.grad = torch.zeros_like(module.unused.weight)
        elif self.mistake == "grad_dtype":  # as a cast left in place: the same values
            assert p.grad is not None
            p.grad.data = p.grad.double()
        elif self.mistake == "grad_strides":  # the same values, column-major
            assert p.grad is not None
            p.grad = p.grad.t().contiguous().t()

    def forward(self, *args: Any) -> Any:
        out = super().forward(*args)
        module = self.module
        assert isinstance(module, _HeadAndBuffer)
        if self.mistake == "buffer_dtype":
            module.shift = module.shift.double()  # the same values, another dtype
        return out


MistakeCase = tuple[int, str, int]


@st.composite
def mistake_cases(draw: st.DrawFn) -> MistakeCase:
    """(world size, the mistake, input seed)."""
    world = draw(st.sampled_from([1, 2, 3]))
    return world, draw(st.sampled_from(MISTAKES)), draw(st.integers(0, 2**16))


def check_mistakes(case: MistakeCase) -> None:
    """The property: no mistake passes; each mistake fails with its message."""
    world, mistake, seed = case
    generator = torch.Generator().manual_seed(seed)
    inputs = tuple(
        tuple((torch.randn(2, 3, generator=generator),) for _ in range(world)) for _ in range(1)
    )
    s = TrainingScenario(_HeadAndBuffer, inputs)
    wrapper = type(f"Mistaken_{mistake}", (_Mistaken,), {"mistake": mistake})
    if mistake == "none":
        check_data_parallel(wrapper, s)
        return
    with pytest.raises(AssertionError, match=re.escape(_MESSAGES[mistake])):
        check_data_parallel(wrapper, s)


@given(mistake_cases())
def test_missing_extra_and_retyped_values_fail_with_their_message(case: MistakeCase) -> None:
    note_size(2, case[0])
    event(f"mistake: {case[1]}")
    check_mistakes(case)


# -- the bounds of a lossy comm hook -------------------------------------------------------------


class _Weighted(torch.nn.Module):
    """``(weight * c).sum()``: the gradient of ``weight`` is the input ``c``, exactly."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(size))

    def forward(self, c: Tensor) -> Tensor:
        return (self.weight * c).sum()


def _the_output(out: Tensor) -> Tensor:
    return out


# Which bounds a case states: elementwise ones (atol, rtol, both: torch.testing.assert_close's
# |got - want| <= atol + rtol |want|) or one per bucket (range_rtol, norm_rtol), each with an
# atol that adds to the bucket's bound and is no elementwise bound of its own.
BOUND_KINDS = ("atol", "rtol", "atol+rtol", "range_rtol", "norm_rtol")
_ELEMENTWISE = "rank 0, step 0, parameter 0 ('weight'), gradient: beyond the stated bound: "
_BEYOND = {
    "atol": _ELEMENTWISE,
    "rtol": _ELEMENTWISE,
    "atol+rtol": _ELEMENTWISE,
    "range_rtol": "rank 0, step 0, bucket 0 (parameters 'weight'): error up to ",
    "norm_rtol": "rank 0, step 0, bucket 0 (parameters 'weight'): error of norm ",
}
_OVERFLOW = "Diagnosis: 1 element(s) are inf where the exact average is finite"


@dataclass(frozen=True)
class BoundCase:
    """Each rank's gradient (``columns[rank]``: one parameter, one bucket), the bounds
    stated, the element ``index`` the hook moves, and how far beyond the bounds it moves it
    in the failing half of the property: 2 times the error they allow, or to infinity."""

    kind: str
    columns: tuple[tuple[float, ...], ...]
    atol: float
    rtol: float
    per_bucket: float | None  # range_rtol or norm_rtol, by kind
    index: int
    beyond: float  # 2.0 or inf

    def exact(self) -> Tensor:
        """The average the allreduce hook gives (each gradient divided, then summed in rank
        order: the "divide" rounding), written out here."""
        column = [torch.tensor(c, dtype=torch.float32) for c in self.columns]
        return roundings_of(column)["divide"]

    def allowed(self) -> float:
        """The error the bounds allow at ``index`` (for a per-bucket kind, the bucket's bound:
        with one element moved, the error's largest element and its norm are that element's)."""
        w = self.exact().double()
        if self.kind == "range_rtol":
            assert self.per_bucket is not None
            return self.per_bucket * float(w.max() - w.min()) + self.atol
        if self.kind == "norm_rtol":
            assert self.per_bucket is not None
            return self.per_bucket * float(w.norm()) + self.atol
        return self.atol + self.rtol * abs(float(w[self.index]))

    def moved(self, factor: float) -> float:
        """The element at ``index`` moved ``factor`` times the error allowed, in float32."""
        w = float(self.exact()[self.index])
        return float(torch.tensor(w + factor * self.allowed(), dtype=torch.float32))


@st.composite
def bound_cases(draw: st.DrawFn, kind: str) -> BoundCase:
    """1 to 3 ranks; gradients of 1 to 3 elements, quarters in [-16, 16], with an average
    not all zero (and, for range_rtol, not all equal); bounds from 1/1000 to 1, and beside a
    per-bucket bound an atol of 0 or a tenth or a quarter of it; beyond: twice or inf."""
    world = draw(st.integers(1, 3))
    size = draw(st.integers(2 if kind == "range_rtol" else 1, 3))
    quarter = st.integers(-64, 64).map(lambda q: q / 4)
    columns = tuple(
        tuple(draw(st.lists(quarter, min_size=size, max_size=size))) for _ in range(world)
    )
    w = BoundCase(kind, columns, 0.0, 0.0, None, 0, 2.0).exact().double()
    assume(float(w.max() - w.min()) > 0 if kind == "range_rtol" else bool((w != 0).any()))
    bound = st.floats(1e-3, 1.0)
    atol = draw(bound) if kind in ("atol", "atol+rtol") else 0.0
    rtol = draw(bound) if kind in ("rtol", "atol+rtol") else 0.0
    per_bucket = None
    if kind in ("range_rtol", "norm_rtol"):
        per_bucket = draw(bound)
        spread = float(w.max() - w.min()) if kind == "range_rtol" else float(w.norm())
        atol = draw(st.sampled_from([0.25, 0.0, 0.1])) * per_bucket * spread
    index = int(w.abs().argmax())  # nonzero: a relative bound above 0 there
    beyond = draw(st.sampled_from([2.0, float("inf")]))
    return BoundCase(kind, columns, atol, rtol, per_bucket, index, beyond)


def _moving_hook(state: tuple[int, float], bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """torch's allreduce hook, then one element of the average set to a value."""
    index, value = state

    def move(fut: torch.futures.Future[Tensor]) -> Tensor:
        average = fut.value()
        average[index] = value
        return average

    return default_hooks.allreduce_hook(None, bucket).then(move)  # type: ignore[arg-type]


# torch's DDP reads a hook's annotations, which this module's ``annotations`` import turns into
# strings: give it the objects.
_moving_hook.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _check_moved(case: BoundCase, value: float) -> CheckReport:
    """check_comm_hook with the case's bounds on the hook that sets ``value`` at its index."""
    inputs = ((tuple((torch.tensor(c, dtype=torch.float32),) for c in case.columns)),)
    s = TrainingScenario(
        functools.partial(_Weighted, len(case.columns[0])), inputs, loss=_the_output, lr=0.0
    )
    bounds: dict[str, Any] = {"atol": case.atol, "rtol": case.rtol}
    if case.per_bucket is not None:
        bounds[case.kind] = case.per_bucket
    return check_comm_hook(
        _moving_hook, s, state=lambda pg: (case.index, value), scaling="divide", **bounds
    )


def check_bounds(case: BoundCase) -> None:
    """The property: the check passes the value moved by half the error the stated bounds
    allow, and fails it moved by twice that error (or to infinity), naming the parameter
    (elementwise bounds) or its bucket and the bound (per-bucket bounds), and diagnosing
    the overflow where the value is infinite. An atol beside a per-bucket bound is that
    bound's, not one per element: half the error allowed is more than the atol."""
    report = _check_moved(case, case.moved(0.5))
    assert (report.exact, report.compared, report.roundings) == (False, len(case.columns), ())
    with pytest.raises(AssertionError) as failed:
        _check_moved(case, case.moved(case.beyond))
    message = str(failed.value)
    assert _BEYOND[case.kind] in message, message
    if case.per_bucket is not None:
        assert f"beyond {case.kind} x the bucket's" in message, message
    assert (_OVERFLOW in message) == math.isinf(case.beyond), message


@pytest.mark.parametrize("kind", BOUND_KINDS)
@given(data=st.data())
def test_the_check_holds_a_lossy_hook_to_its_bounds_exactly(kind: str, data: st.DataObject) -> None:
    case = data.draw(bound_cases(kind))
    note_size(1, len(case.columns))
    event(f"beyond: {case.beyond}x")
    if case.per_bucket is not None:
        event(f"an atol beside the per-bucket bound: {case.atol > 0}")
    check_bounds(case)
