"""Checks for any data-parallel wrapper built from (module, process group), on the fake world.

:func:`check_data_parallel` trains a :class:`TrainingScenario` on a fake world of N ranks
(torch.distributed's default group initialized on the same world, so torch's own DDP and
FSDP2 run there too) with the wrapper ``make_wrapper(module, pg)`` returns, running each
rank's step as the caller's ``train_step`` does (or the default one: ``zero_grad``, forward,
loss and backward per micro-batch in its sync mode, ``after_backward``, ``optimizer.step``),
with the caller's ``optimizer``. After every step it compares, on every rank, what the
optimizer saw and what the rank holds after the step with what a
:class:`~reducer.testing.algorithms.Reference` says (default :func:`ddp_average`: every
rank's local gradient from plain autograd, averaged in rank order in any of torch's
roundings), and the buffers each rank holds, the parameters join leaves every rank with
(uneven inputs), each rank's random stream. A scenario with a ``refusal`` expects every
rank to raise an error matching it instead. It returns a :class:`CheckReport` saying which
rounding it saw.

:func:`check_comm_hook` does the same for a comm hook registered on a wrapper (torch's DDP
by default), without updating the parameters (so that a lossy hook's error does not carry
into later steps): bit for bit for an exact hook, within the bounds the caller states for
a lossy one (elementwise ``atol``/``rtol``; per bucket the hook was handed, relative to its
range or norm; the running sum over steps, which error feedback keeps bounded). A hook whose
future never completes fails after ``timeout``, naming rank, step and bucket.

A mismatch says where (rank, step, parameter name), by how much, and what the value looks
like (the shared diagnosis of :mod:`reducer._averages`, as ``launch``'s replica check
gives it): rank r's local gradient, W times the average, the average of some ranks, another
rounding (and the ``scaling=`` that passes), parameter values averaged instead of
gradients, another parameter's gradient. Models must be deterministic given each rank's
seed (``TrainingScenario.rank_seeds``): the reference replays them on the calling thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

import fakepg
import reducer
from reducer._averages import Rounding
from reducer.errors import InvalidArgumentType

from . import _arguments
from ._judge import Bounds, CheckReport, judge
from ._run import OptimizerFactory, RankTrace, TrainStep, WrapperFactory, play
from .algorithms import Average, Reference, ddp_average
from .scenario import Batch, TrainingScenario, sum_of_squares
from .schedule import reports_schedule

__all__ = [
    "Average",
    "Batch",
    "CheckReport",
    "TrainingScenario",
    "WrapperFactory",
    "check_comm_hook",
    "check_data_parallel",
    "fsdp2",
    "reducer_ddp",
    "sum_of_squares",
    "torch_ddp",
]

# torch.distributed's loggers, quiet while a check runs: their DEBUG and INFO records (one per
# collective and group with TORCH_DISTRIBUTED_DEBUG) would bury the user's own in a report.
_TORCH_LOGGERS = ("torch.distributed", "torch.nn.parallel.distributed")


# Where a failing check's own lines live: Hypothesis's explanation ("these lines were always
# and only run by failing examples") should point at the user's code, not at these.
_LIBRARY_LINES = ("/reducer/testing/*.py", "/reducer/_averages.py", "/fakepg/*.py", "/torch/**")


def _explain_user_lines_only() -> None:
    """Add the library's files to the locations Hypothesis leaves out of its explanations
    (once; a private list of Hypothesis, so quietly nothing where it is gone)."""
    try:
        from hypothesis.internal import scrutineer
    except ImportError:  # pragma: no cover - Hypothesis is optional for the checks
        return
    unhelpful = getattr(scrutineer, "UNHELPFUL_LOCATIONS", None)
    if isinstance(unhelpful, tuple) and _LIBRARY_LINES[0] not in unhelpful:
        scrutineer.UNHELPFUL_LOCATIONS = (*unhelpful, *_LIBRARY_LINES)


@contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    _explain_user_lines_only()
    loggers = [logging.getLogger(name) for name in _TORCH_LOGGERS]
    # Only those that would let DEBUG or INFO through: setLevel clears the cache of every
    # logger of the process (thousands, with torch's), a cost paid per example otherwise.
    louder = [(lg, lg.level) for lg in loggers if lg.getEffectiveLevel() < logging.WARNING]
    for lg, _ in louder:
        lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in louder:
            lg.setLevel(level)


# -------------------------------------------------------------------------------------------
# Wrapper factories.


def torch_ddp(**options: Any) -> WrapperFactory:
    """torch's ``DistributedDataParallel`` over torch's default group (on the fake world)."""
    _arguments.mixed_precision_option(options, "torch_ddp")

    def make(module: nn.Module, pg: reducer.ProcessGroup, **more: Any) -> nn.Module:
        return nn.parallel.DistributedDataParallel(module, **{**options, **more})

    return make


def reducer_ddp(**options: Any) -> WrapperFactory:
    """This project's ``reducer.DistributedDataParallel`` over the rank's fake group."""
    _arguments.mixed_precision_option(options, "reducer_ddp")

    def make(module: nn.Module, pg: reducer.ProcessGroup, **more: Any) -> nn.Module:
        return reducer.DistributedDataParallel(module, pg, **{**options, **more})

    return make


def fsdp2(**options: Any) -> WrapperFactory:
    """torch's FSDP2 ``fully_shard`` on a one-dimensional CPU mesh of every rank; its
    parameters and gradients are compared in full (``full_tensor()``)."""

    def make(module: nn.Module, pg: reducer.ProcessGroup, **more: Any) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (pg.size(),))
        fully_shard(module, mesh=mesh, **{**options, **more})
        return module

    return make


# -------------------------------------------------------------------------------------------
# The checks.


def _reference_for(
    reference: Reference | None, scaling: Rounding | None, average: Average | None
) -> Reference:
    if reference is not None:
        if average is not None or scaling is not None:
            raise ValueError(
                "give either reference= or scaling=/average= (a reference's own scaling)"
            )
        return reference
    return ddp_average(scaling=scaling, average=average)


def _preflight(
    owner: str,
    make_wrapper: object,
    scenario: object,
    reference: object,
    *,
    optimizer: object = None,
    train_step: object = None,
    after_backward: object = None,
) -> list[nn.Module]:
    """A check's arguments, before any rank starts (see :mod:`reducer.testing._arguments`):
    their kinds, the model factory's determinism, and the optimizer the reference will build
    on the calling thread. Returns the models it built and left untouched, for the
    reference's plain copies (so that a check builds the model W + 2 times, not W + 4)."""
    if not isinstance(scenario, TrainingScenario):
        drawn = hasattr(scenario, "example") and hasattr(scenario, "map")  # a strategy
        raise InvalidArgumentType(
            f"{owner}: scenario is {_arguments.describe(scenario)}; expected a "
            "TrainingScenario"
            + (": draw one with @given(training_scenarios(...)) and pass it" if drawn else "")
        )
    for maker in (torch_ddp, reducer_ddp, fsdp2):
        if make_wrapper is maker:
            raise InvalidArgumentType(
                f"{owner}: make_wrapper is the function {maker.__name__} itself; expected the "
                f"wrapper factory it returns: call it, {maker.__name__}() (with the wrapper's "
                f"options, e.g. {maker.__name__}(bucket_cap_mb=1))"
            )
    _arguments.factory(
        make_wrapper,
        owner,
        "make_wrapper",
        makes="the wrapper of a rank's module (make_wrapper(module, pg, **options))",
        example="torch_ddp() (or your own: lambda module, pg, **options: MyDDP(module, pg))",
        optional=False,
    )
    if not isinstance(reference, Reference):
        raise InvalidArgumentType(
            f"{owner}: reference= is {_arguments.describe(reference)}; expected a Reference, "
            "as the functions of reducer.testing.algorithms return them: call it, e.g. "
            "reference=ddp_average() or reference=zero_redundancy(lambda params: "
            "torch.optim.Adam(params, lr=0.01))"
        )
    _arguments.optimizer_factory(optimizer, owner, "optimizer")
    for name, value, signature in (
        ("train_step", train_step, "train_step(model, optimizer, batch, step)"),
        ("after_backward", after_backward, "after_backward(model)"),
    ):
        if value is not None and not callable(value):
            raise InvalidArgumentType(
                f"{owner}: {name}= is {_arguments.describe(value)}; expected a function {signature}"
            )
    _arguments.mixed_precision_option(scenario.options, f"{owner}: scenario.options")
    spare: list[nn.Module] = []  # the second build: see deterministic_model
    model = _arguments.deterministic_model(
        scenario.make_model, "TrainingScenario: make_model", spare=spare
    )
    plain: Any = reference.optimizer or optimizer
    if plain is not None:
        argument = (
            "the reference's optimizer factory (the one given to zero_redundancy, "
            "ddp_average or another reference)"
            if reference.optimizer is not None
            else f"{owner}: optimizer= (the reference, given no optimizer of its own, builds "
            "this one for its plain models too)"
        )
        _arguments.reference_optimizer(plain, list(model.parameters()), argument)
        return spare  # the first one's parameters went to an optimizer: not reused
    return [model, *spare]


@reports_schedule
def check_data_parallel(
    make_wrapper: WrapperFactory,
    scenario: TrainingScenario,
    *,
    train_step: TrainStep | None = None,
    optimizer: OptimizerFactory | None = None,
    after_backward: Callable[[nn.Module], object] | None = None,
    reference: Reference | None = None,
    scaling: Rounding | None = None,
    average: Average | None = None,
    check_strides: bool = True,
    broadcast_buffers: bool = True,
    timeout: float = 60.0,
    schedule: fakepg.Schedule | None = None,
) -> CheckReport:
    """Train ``scenario`` with ``make_wrapper(module, pg, **scenario.options)`` on every rank
    of a fake world; after every step, what each rank's optimizer saw and what each rank
    holds must equal the reference bit for bit (or every rank must raise the
    ``scenario.refusal`` error). Returns what it saw (:class:`CheckReport`).

    The step: ``train_step(model, optimizer, batch, step)`` (``batch``: a
    :class:`~reducer.testing.scenario.Batch`; it must run ``batch.loss(model(*args))
    .backward()`` for each micro-batch in its sync mode and call ``optimizer.step()`` once),
    or by default ``optimizer.zero_grad(set_to_none=scenario.set_to_none)``, each
    micro-batch's forward and backward in its sync mode, ``after_backward(model)`` after each
    synced backward (a wrapper's ``finish_gradient_synchronization``), ``optimizer.step()``.
    ``optimizer(params)`` builds each rank's optimizer from the module's parameters (default:
    SGD with ``scenario.lr``); the reference steps a plain one of its own (the reference's
    ``optimizer``, else this factory on the plain model's parameters).

    ``reference``: what each rank must hold (:mod:`reducer.testing.algorithms`; default
    :func:`~reducer.testing.algorithms.ddp_average`: the rank-order average in any of torch's
    roundings; ``scaling`` pins one, ``average`` gives your own). ``check_strides`` also
    requires each ``.grad`` to have the strides plain autograd gives it (channels_last stays
    channels_last). The module's buffers after every step must be those of a forward that
    started from rank 0's buffers (``broadcast_buffers``, DDP's default, each buffer found by
    name, so one that forward reassigns too) or from the rank's own. ``schedule``: run the
    ranks under it, one thread at a time in the order it decides (see
    :mod:`reducer.testing.schedule`); a failure then shows its timeline.
    """
    s = scenario
    ref = _reference_for(reference, scaling, average)
    built = _preflight(
        "check_data_parallel",
        make_wrapper,
        s,
        ref,
        optimizer=optimizer,
        train_step=train_step,
        after_backward=after_backward,
    )
    if s.reload_after is not None and (optimizer is not None or train_step is not None):
        raise ValueError(
            "check_data_parallel: reload_after re-creates the default optimizer after the "
            "reload; draw the scenario without reload_after to check your own optimizer or step"
        )
    with _quiet_torch_logs():
        runs = play(
            make_wrapper,
            s,
            setup=None,
            train_step=train_step,
            optimizer=optimizer,
            after_backward=after_backward,
            timeout=timeout,
            schedule=schedule,
            shards=ref.sharded,
        )
    if s.refusal is not None:
        if runs:
            raise AssertionError(
                f"expected every rank to refuse with an error matching {s.refusal!r}; every "
                f"step ran through"
            )
        return CheckReport(0, 0)
    return judge(
        s,
        runs,
        ref,
        optimizer=optimizer,
        broadcast_buffers=broadcast_buffers,
        check_strides=check_strides,
        bounds=Bounds(),
        built=built,
    )


@reports_schedule
def check_comm_hook(
    hook: Callable[[Any, Any], torch.futures.Future[Tensor]],
    scenario: TrainingScenario,
    *,
    state: Callable[[reducer.ProcessGroup], object] | None = None,
    make_wrapper: WrapperFactory | None = None,
    scaling: Rounding | None = None,
    average: Average | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    range_rtol: float | None = None,
    norm_rtol: float | None = None,
    cumulative_atol: float | None = None,
    timeout: float = 60.0,
    schedule: fakepg.Schedule | None = None,
) -> CheckReport:
    """Register ``hook`` (with ``state(pg)`` as its state, None if not given) on the wrapper
    (torch's DDP by default), run every step of ``scenario`` without updating the parameters,
    and compare each step's gradients with the average of the ranks' local gradients (any of
    torch's roundings by default, ``scaling`` pins one; ``average`` gives your own, e.g.
    ``hooks.AVERAGES["fp16"]``, the exact fp16 prediction).

    Exact where every bound is 0/None (bit for bit); otherwise within the bounds:
    ``atol + rtol * |want|`` elementwise; ``range_rtol``: per bucket the hook was handed, the
    largest error at most ``range_rtol`` times the range (max - min) of the bucket's exact
    values, plus ``atol`` (an 8-bit quantizer's error follows it); ``norm_rtol``: the error's
    norm at most ``norm_rtol`` times the exact bucket's norm, plus ``atol`` (compression to a
    half type, low-rank hooks; robust to cancellation, which elementwise bounds are not). With
    a per-bucket bound, ``atol`` alone adds no elementwise check. ``cumulative_atol``: also,
    at every step, the running sums over steps of the hook's gradients and of the exact ones
    are within it: a hook with error feedback keeps them so (what it drops now, it adds
    later); one that loses its residual drifts steadily. A future that does not complete
    within ``timeout`` seconds fails, naming the rank, step and bucket. ``schedule``: as in
    :func:`check_data_parallel`.
    """
    _arguments.hook(hook, state)
    wrapper = make_wrapper if make_wrapper is not None else torch_ddp()
    reference = _reference_for(None, scaling, average)
    built = _preflight("check_comm_hook", wrapper, scenario, reference)
    if scenario.reload_after is not None:
        raise ValueError(
            "check_comm_hook: a reloaded wrapper has no comm hook (torch's pickling drops the "
            "reducer that holds it); draw the scenario without reload_after"
        )
    s = replace(scenario, lr=0.0)

    def setup(module: nn.Module, pg: reducer.ProcessGroup, trace: RankTrace) -> None:
        # Watched by play: its future fails after the timeout, its buckets are recorded.
        module.register_comm_hook(None if state is None else state(pg), hook)  # type: ignore[operator]

    with _quiet_torch_logs():
        runs = play(
            wrapper,
            s,
            setup=setup,
            train_step=None,
            optimizer=None,
            after_backward=None,
            timeout=timeout,
            schedule=schedule,
        )
    bounds = Bounds(atol, rtol, cumulative_atol, range_rtol, norm_rtol)
    return judge(
        s,
        runs,
        reference,
        optimizer=None,
        broadcast_buffers=True,
        check_strides=False,
        bounds=bounds,
        built=built,
    )
