"""``reducer.testing``: each misuse a user made is refused with an error that names the
argument, what was given, what is expected and the fix, before any rank starts (or, for what
only a rank builds, before its first step)."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import mlp, rank_input
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel.distributed import _MixedPrecision

import fakepg
import reducer
from reducer.testing import (
    TrainingScenario,
    check_comm_hook,
    check_data_parallel,
    ddp_average,
    fsdp2_shards,
    hierarchical_averaging,
    periodic_averaging,
    reducer_ddp,
    torch_ddp,
    training_scenarios,
    zero_redundancy,
)
from reducer.testing.strategies import gradient_scales


def _mlp() -> nn.Module:
    return mlp(widths=(4, 3, 2))


def _x(rank: int) -> torch.Tensor:
    return rank_input(rank, (3, 4))


SCENARIO = TrainingScenario(_mlp, ((( _x(0),), (_x(1),)),))  # fmt: skip


def _inputs(generator: torch.Generator, skip: frozenset[int]) -> tuple[Any, ...]:
    return (torch.randn(3, 4, generator=generator),)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


@pytest.fixture
def no_rank_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a check starts a fake world: the misuse must be refused before."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a rank started: the misuse was not refused at the entry point")

    monkeypatch.setattr(fakepg, "run_torch", refuse)


def _stepless(model: nn.Module, optimizer: Any, batch: Any, step: int) -> None:
    raise AssertionError("a step ran: the misuse was not refused before the first step")


# -------------------------------------------------------------------------------------------
# Optimizers.


@pytest.mark.usefixtures("no_rank_starts")
def test_an_optimizer_instance_where_a_factory_is_expected() -> None:
    built = torch.optim.SGD(_mlp().parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"optimizer= is an SGD instance; expected a factory") as e:
        check_data_parallel(torch_ddp(), SCENARIO, optimizer=built)
    assert "each needs its own" in str(e.value)
    assert "optimizer=lambda params: torch.optim.SGD(params, ...)" in str(e.value)


@pytest.mark.usefixtures("no_rank_starts")
@pytest.mark.parametrize(
    "make",
    [
        functools.partial(ddp_average),
        functools.partial(fsdp2_shards),
        functools.partial(periodic_averaging, 2),
        functools.partial(hierarchical_averaging, {1: 1}),
    ],
)
def test_a_reference_refuses_an_optimizer_instance(make: Any) -> None:
    built = torch.optim.Adam(_mlp().parameters())
    with pytest.raises(TypeError, match=r": optimizer= is an Adam instance; expected a factory"):
        make(optimizer=built)


@pytest.mark.usefixtures("no_rank_starts")
def test_a_factory_returning_none_is_named_before_any_rank_starts() -> None:
    def make(params: list[nn.Parameter]) -> None:
        torch.optim.SGD(params, lr=0.1)  # the return statement forgotten

    with pytest.raises(ValueError, match=r"optimizer= .* returned None: .*return statement"):
        check_data_parallel(torch_ddp(), SCENARIO, optimizer=make)
    with pytest.raises(ValueError, match=r"reference's optimizer factory .* returned None"):
        check_data_parallel(torch_ddp(), SCENARIO, reference=ddp_average(optimizer=make))


def test_a_rank_optimizer_factory_returning_none_is_refused_before_the_first_step() -> None:
    def make(params: list[nn.Parameter]) -> None:
        return None

    # The reference has an optimizer of its own, so only the ranks build this one.
    with pytest.raises(ValueError, match=r"optimizer= factory returned None: .*return"):
        check_data_parallel(
            torch_ddp(),
            SCENARIO,
            optimizer=make,
            reference=ddp_average(optimizer=_sgd),
            train_step=_stepless,
        )


# -------------------------------------------------------------------------------------------
# References.


@pytest.mark.usefixtures("no_rank_starts")
def test_hierarchical_averaging_given_a_list() -> None:
    with pytest.raises(TypeError, match=r"period_group_sizes is a list \[2, 4\]") as e:
        hierarchical_averaging([2, 4])  # type: ignore[arg-type]
    text = str(e.value)
    assert "expected a mapping from each period to the size of the groups" in text
    assert "{2: 2, 4: 4}" in text and "HierarchicalModelAverager" in text


@pytest.mark.parametrize("sizes", [{}, {0: 2}, {2: 0}, {2.0: 2}, {2: True}])
def test_hierarchical_averaging_given_bad_periods_or_sizes(sizes: dict[Any, Any]) -> None:
    with pytest.raises(ValueError, match=r"hierarchical_averaging: period_group_sizes"):
        hierarchical_averaging(sizes)


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda: periodic_averaging(0), "period"),
        (lambda: periodic_averaging(2, group_size=0), "group_size"),
        (lambda: periodic_averaging(2, warmup_steps=-1), "warmup_steps"),
        (lambda: periodic_averaging(2, gradient_group_size=0), "gradient_group_size"),
    ],
)
def test_periodic_averaging_names_a_bad_count(call: Any, argument: str) -> None:
    with pytest.raises(ValueError, match=rf"periodic_averaging: {argument} is -?\d+; expected"):
        call()


@pytest.mark.usefixtures("no_rank_starts")
def test_zero_redundancy_given_torchs_zero_redundancy_optimizer() -> None:
    def zero(params: list[nn.Parameter]) -> Any:
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=0.1)

    with pytest.raises(ValueError, match=r"builds torch's ZeroRedundancyOptimizer") as e:
        check_data_parallel(torch_ddp(), SCENARIO, optimizer=zero, reference=zero_redundancy(zero))
    text = str(e.value)
    assert "needs a process group" in text
    assert "reference=zero_redundancy(lambda params: torch.optim.Adam" in text
    assert "goes to the check's optimizer=" in text
    # The class itself (or a partial of it) is refused where zero_redundancy is called.
    partial = functools.partial(ZeroRedundancyOptimizer, optimizer_class=torch.optim.SGD)
    for given_ in (ZeroRedundancyOptimizer, partial):
        with pytest.raises(ValueError, match=r"zero_redundancy: optimizer= is torch's Zero"):
            zero_redundancy(given_)


@pytest.mark.usefixtures("no_rank_starts")
def test_the_checks_zero_redundancy_factory_without_a_reference_optimizer() -> None:
    def zero(params: list[nn.Parameter]) -> Any:
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.SGD, lr=0.1)

    with pytest.raises(ValueError, match=r"check_data_parallel: optimizer= .*builds torch's Zero"):
        check_data_parallel(torch_ddp(), SCENARIO, optimizer=zero)


def test_fsdp2_shards_with_a_wrapper_that_does_not_shard() -> None:
    with pytest.raises(ValueError, match=r"fsdp2_shards\(\) compares each rank's shard") as e:
        check_data_parallel(torch_ddp(), SCENARIO, reference=fsdp2_shards(), train_step=_stepless)
    text = str(e.value)
    assert "(DistributedDataParallel) left the module's parameters whole" in text
    assert "it does not shard" in text and "ddp_average()" in text and "fsdp2()" in text


@pytest.mark.usefixtures("no_rank_starts")
def test_a_reference_function_not_called() -> None:
    with pytest.raises(TypeError, match=r"reference= is the function ddp_average; .*call it"):
        check_data_parallel(torch_ddp(), SCENARIO, reference=ddp_average)  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------
# Wrappers and models.


def test_a_wrapper_factory_that_wraps_in_place_and_returns_none() -> None:
    def wrap(module: nn.Module, pg: reducer.ProcessGroup, **options: Any) -> None:
        reducer.DistributedDataParallel(module, pg)  # kept by nothing: the return forgotten

    with pytest.raises(ValueError, match=r"make_wrapper \(.*wrap\) returned None") as e:
        check_data_parallel(wrap, SCENARIO, train_step=_stepless)  # type: ignore[arg-type]
    assert "`return module`" in str(e.value)


@pytest.mark.usefixtures("no_rank_starts")
def test_a_wrapper_maker_passed_without_calling_it() -> None:
    with pytest.raises(TypeError, match=r"make_wrapper is the function torch_ddp itself"):
        check_data_parallel(torch_ddp, SCENARIO)
    with pytest.raises(TypeError, match=r"make_wrapper= is a DistributedDataParallel instance"):
        check_data_parallel(nn.parallel.DistributedDataParallel.__new__(
            nn.parallel.DistributedDataParallel), SCENARIO)  # fmt: skip


@pytest.mark.usefixtures("no_rank_starts")
def test_a_model_factory_that_is_not_deterministic() -> None:
    scenario = TrainingScenario(lambda: nn.Linear(4, 2), SCENARIO.inputs)
    with pytest.raises(ValueError, match=r"make_model is not deterministic") as e:
        check_data_parallel(torch_ddp(), scenario)
    text = str(e.value)
    assert "parameter 0 ('weight')" in text and "Seed inside the factory" in text
    with pytest.raises(ValueError, match=r"make_model is not deterministic"):
        check_comm_hook(reducer.allreduce_hook, scenario)


@pytest.mark.usefixtures("no_rank_starts")
def test_inputs_given_as_a_tensor_where_a_tuple_is_expected() -> None:
    x = _x(0)
    with pytest.raises(TypeError, match=r"inputs\[0\]\[1\] is a Tensor of shape \(3, 4\)") as e:
        TrainingScenario(_mlp, (((x,), x),))
    assert "tuple of the forward's positional arguments" in str(e.value)
    assert "write (x,)" in str(e.value)
    with pytest.raises(TypeError, match=r"TrainingScenario: inputs\[0\] is a Tensor"):
        TrainingScenario(_mlp, (x,))
    with pytest.raises(TypeError, match=r"TrainingScenario: inputs is a Tensor"):
        TrainingScenario(_mlp, x)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"inputs\[0\]\[0\]\[1\] is a Tensor"):
        TrainingScenario(_mlp, ((((x,), x),),), micro_batches=(("no_sync", "sync"),))


# -------------------------------------------------------------------------------------------
# Comm hooks.


@pytest.mark.usefixtures("no_rank_starts")
def test_state_given_the_hooks_state_object() -> None:
    state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=1)
    with pytest.raises(TypeError, match=r"state= is a PowerSGDState instance; expected a fac") as e:
        check_comm_hook(powersgd.powerSGD_hook, SCENARIO, state=state)
    assert "state=lambda pg: PowerSGDState(...)" in str(e.value)
    assert "cannot share one" in str(e.value)


@pytest.mark.usefixtures("no_rank_starts")
def test_a_hook_that_is_not_callable() -> None:
    with pytest.raises(TypeError, match=r"check_comm_hook: hook is None; expected a comm hook"):
        check_comm_hook(None, SCENARIO)  # type: ignore[arg-type]


def _returns_a_tensor(state: object, bucket: dist.GradBucket) -> Any:
    return bucket.buffer()


# torch's register_comm_hook reads the annotations as objects (not the strings this module's
# annotations are).
_returns_a_tensor.__annotations__ = {"state": object, "bucket": dist.GradBucket}


def test_a_comm_hook_returning_a_tensor_surfaces_torchs_own_message() -> None:
    with pytest.raises(RuntimeError, match=r"must return a torch.futures.Future") as e:
        check_comm_hook(_returns_a_tensor, SCENARIO)
    assert "add_done_callback" not in str(e.value)
    # This project's DDP names the hook and what it must return.
    with pytest.raises(RuntimeError, match=r"comm hook '_returns_a_tensor' returned a Tensor"):
        check_comm_hook(_returns_a_tensor, SCENARIO, make_wrapper=reducer_ddp())


# -------------------------------------------------------------------------------------------
# Mixed precision.


@pytest.mark.usefixtures("no_rank_starts")
@pytest.mark.parametrize("maker", [torch_ddp, reducer_ddp])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_reduce_dtype_float8_is_refused_where_the_wrapper_is_named(
    maker: Any, dtype: torch.dtype
) -> None:
    config = _MixedPrecision(param_dtype=torch.float32, reduce_dtype=dtype)
    with pytest.raises(ValueError, match=rf"{maker.__name__}: mixed_precision\.reduce_dtype") as e:
        maker(mixed_precision=config)
    text = str(e.value)
    assert str(dtype) in text and "no addition or division" in text
    assert "allreduce_and_upcast" not in text and "hook" not in text
    assert "reduce_dtype=torch.bfloat16" in text
    # The same option given through the scenario is refused before any rank starts too.
    scenario = TrainingScenario(_mlp, SCENARIO.inputs, options={"mixed_precision": config})
    with pytest.raises(ValueError, match=r"scenario.options: mixed_precision\.reduce_dtype"):
        check_data_parallel(maker(), scenario)


def test_this_projects_ddp_refuses_a_float8_reduce_dtype_at_construction() -> None:
    config = _MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float8_e4m3fn)

    def build(pg: reducer.ProcessGroup) -> None:
        reducer.DistributedDataParallel(_mlp(), pg, mixed_precision=config)

    with pytest.raises(ValueError, match=r"mixed_precision\.reduce_dtype is torch\.float8_e4m3fn"):
        fakepg.run(build, 2)


# -------------------------------------------------------------------------------------------
# Strategies.


def _draw(strategy: st.SearchStrategy[Any]) -> None:
    @settings(max_examples=1, database=None)
    @given(strategy)
    def draw_one(value: Any) -> None:
        pass

    draw_one()


@pytest.mark.parametrize(("argument", "given_"), [("world_sizes", 0), ("steps", 0)])
def test_training_scenarios_drawing_zero(argument: str, given_: int) -> None:
    strategy = training_scenarios(_mlp, _inputs, **{argument: st.just(given_)})
    with pytest.raises(ValueError, match=rf"training_scenarios: {argument} drew 0; expected") as e:
        _draw(strategy)
    assert "an integer of 1 or more: draw from st.integers(1, " in str(e.value)


def test_training_scenarios_given_a_number_where_a_strategy_is_expected() -> None:
    with pytest.raises(TypeError, match=r"world_sizes= is an int 4; expected a Hypothesis strat"):
        _draw(training_scenarios(_mlp, _inputs, world_sizes=4))  # type: ignore[arg-type]


def test_make_inputs_returning_a_tensor() -> None:
    def make_inputs(generator: torch.Generator, skip: frozenset[int]) -> Any:
        return torch.randn(3, 4, generator=generator)

    with pytest.raises(TypeError, match=r"what make_inputs returned is a Tensor of shape"):
        _draw(training_scenarios(_mlp, make_inputs))


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_gradient_scales_with_inf_or_nan(bad: float) -> None:
    with pytest.raises(ValueError, match=rf"gradient_scales: scales\[1\] is {bad}; expected a fin"):
        gradient_scales([1.0, bad])
    with pytest.raises(
        ValueError, match=r"a scale drawn from loss_scales is (-?inf|nan); expected a fin"
    ):
        _draw(training_scenarios(_mlp, _inputs, loss_scales=st.just(bad)))
    with pytest.raises(ValueError, match=r"TrainingScenario: loss_scales\[0\]\[1\] is"):
        TrainingScenario(_mlp, SCENARIO.inputs, loss_scales=((1.0, bad),))


def test_gradient_scales_given_nothing() -> None:
    with pytest.raises(TypeError, match=r"gradient_scales: scales is a tuple \(\); expected a non"):
        gradient_scales(())


def test_sync_modes_outside_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"sync_modes is \('sync',\); expected .*no_sync"):
        _draw(training_scenarios(_mlp, _inputs, micro_batches=2, sync_modes=("sync",)))
