"""Checks for any data-parallel wrapper built from (module, process group), on the fake world.

:func:`check_data_parallel` trains a :class:`TrainingScenario` on a fake world of N ranks
(torch.distributed's default group initialized on the same world, so torch's own DDP and
FSDP2 run there too) with the wrapper ``make_wrapper(module, pg)`` returns, and after every
step compares each rank's gradients and parameters with the exact reference: every rank's
local gradient from plain autograd, combined in ascending rank order (the fake world's
order), then the same SGD update; and the buffers each rank holds, the parameters join
leaves every rank with (uneven inputs), each rank's random stream. A scenario with a
``refusal`` expects every rank to raise an error matching it instead.

:func:`check_comm_hook` does the same for a comm hook registered on a wrapper (torch's DDP
by default), without updating the parameters (so that a lossy hook's error does not carry
into later steps): bit for bit for an exact hook, within the ``atol``/``rtol`` the caller
states for a lossy one (fp16, PowerSGD), and, with ``cumulative_atol``, the running sum of
what the hook applied against the running sum of the exact averages: the bound that error
feedback keeps, and a hook that drops its residual breaks.

Both compare as ``torch.testing.assert_close`` reports: where (rank, step, parameter name),
by how much, against which bound. Models must be deterministic given each rank's seed
(``TrainingScenario.rank_seeds``): the reference replays them on the calling thread.

Wrapper factories for the usual wrappers: :func:`torch_ddp`, :func:`reducer_ddp`,
:func:`fsdp2` (its parameters compared in full).
"""

from __future__ import annotations

import contextlib
import io
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor, nn

import fakepg
import reducer

from .reference import Scaling, rank_order_average
from .schedule import reports_schedule

__all__ = [
    "Average",
    "TrainingScenario",
    "WrapperFactory",
    "check_comm_hook",
    "check_data_parallel",
    "fsdp2",
    "reducer_ddp",
    "sum_of_squares",
    "torch_ddp",
]

# make_wrapper(module, pg, **scenario.options) -> the module to call forward on.
WrapperFactory = Callable[..., nn.Module]
# One parameter's contributions in rank order (None: no gradient there) -> the average.
Average = Callable[[Sequence[Tensor | None], int], Tensor | None]
Grads = list[Tensor | None]


def sum_of_squares(output: Any) -> Tensor:
    """The default loss: the sum of squares of every tensor in ``output`` (nested lists,
    tuples and dicts searched), in float64."""
    total = torch.zeros((), dtype=torch.float64)
    for t in _tensors(output):
        total = total + t.double().pow(2).sum()
    return total


def _tensors(obj: Any) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


@dataclass(frozen=True)
class TrainingScenario:
    """A few steps of data-parallel training, as plain data.

    ``make_model()`` must build the same parameters on every call. ``inputs[step][rank]`` is
    the tuple of positional arguments of that rank's forward in that step; ``loss`` maps the
    forward's output to a scalar. ``options`` are keyword arguments of the wrapper factory
    (``bucket_cap_mb``, ``find_unused_parameters``, ...). ``refusal``: a regular expression
    that the error every rank raises in the first step must match, where the wrapper must
    refuse the scenario. ``lr``: the SGD step after each step (0: gradients only).
    ``ignored``: names of parameters and buffers the wrapper is told to leave alone (torch's
    ``_set_params_and_buffers_to_ignore_for_model``, before wrapping): each rank keeps its
    own gradient of an ignored parameter, and its own ignored buffers. ``rank_seeds``: each
    rank calls ``torch.manual_seed(rank_seeds[rank])`` on its thread before the first step,
    and draws its random numbers (dropout) from that stream, its own (the fake world gives
    every rank thread a generator of its own); the reference replays each rank's stream.
    Uneven inputs: ``inputs[step][rank]`` is None once that rank has run out of batches (from
    some step on); every rank then trains inside the wrapper's ``join()``, and a rank that has
    run out contributes zeros to the others' steps (``divide_by_initial_world_size``: the
    average over every rank); after the last step every rank holds the parameters of the
    highest rank that trained last. ``reload_after``: after that step (not the last; not
    with uneven inputs), every rank pickles its wrapper with ``torch.save`` into memory and
    trains on from the ``torch.load``-ed copy and its module (the wrapper must be over
    torch's default group, as a pickled DDP reloads onto it); the expectation is unchanged.
    """

    make_model: Callable[[], nn.Module]
    inputs: tuple[tuple[tuple[Any, ...] | None, ...], ...]
    loss: Callable[[Any], Tensor] = sum_of_squares
    options: Mapping[str, Any] = field(default_factory=dict)
    refusal: str | None = None
    lr: float = 0.1
    ignored: frozenset[str] = frozenset()
    rank_seeds: tuple[int, ...] | None = None
    reload_after: int | None = None

    def __post_init__(self) -> None:
        if not self.inputs or not self.inputs[0]:
            raise ValueError("TrainingScenario: inputs must hold at least one step of one rank")
        sizes = {len(step) for step in self.inputs}
        if len(sizes) != 1:
            raise ValueError(
                f"TrainingScenario: every step needs inputs for every rank; got steps of "
                f"{[len(step) for step in self.inputs]} ranks"
            )
        for rank in range(len(self.inputs[0])):
            ran = [self.inputs[k][rank] is not None for k in range(len(self.inputs))]
            if ran != sorted(ran, reverse=True) or not ran[0]:
                raise ValueError(
                    f"TrainingScenario: rank {rank} must train from the first step until its "
                    f"inputs run out (None from then on), got {ran}"
                )
        if self.rank_seeds is not None and len(self.rank_seeds) != len(self.inputs[0]):
            raise ValueError(
                f"TrainingScenario: rank_seeds needs one seed per rank ({len(self.inputs[0])}), "
                f"got {len(self.rank_seeds)}"
            )
        if self.reload_after is not None and (
            not 0 <= self.reload_after < len(self.inputs) - 1 or self.uneven
        ):
            raise ValueError(
                f"TrainingScenario: reload_after must name a step before the last "
                f"(0 .. {len(self.inputs) - 2}), without uneven inputs; got {self.reload_after}"
            )

    @property
    def world_size(self) -> int:
        return len(self.inputs[0])

    @property
    def uneven(self) -> bool:
        """Does some rank run out of inputs before the others (a run under ``join()``)?"""
        return any(args is None for step in self.inputs for args in step)

    def trains(self, step: int, rank: int) -> bool:
        return self.inputs[step][rank] is not None

    def args(self, step: int, rank: int) -> tuple[Any, ...]:
        """The forward's arguments of ``rank`` in ``step`` (it must train then)."""
        args = self.inputs[step][rank]
        if args is None:
            raise ValueError(f"rank {rank} has no inputs in step {step}: it ran out before")
        return args

    @property
    def steps(self) -> int:
        return len(self.inputs)


# -------------------------------------------------------------------------------------------
# Wrapper factories.


def torch_ddp(**options: Any) -> WrapperFactory:
    """torch's ``DistributedDataParallel`` over torch's default group (on the fake world)."""

    def make(module: nn.Module, pg: reducer.ProcessGroup, **more: Any) -> nn.Module:
        return nn.parallel.DistributedDataParallel(module, **{**options, **more})

    return make


def reducer_ddp(**options: Any) -> WrapperFactory:
    """This project's ``reducer.DistributedDataParallel`` over the rank's fake group."""

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
# Running.


@dataclass(frozen=True, slots=True)
class _RankTrace:
    grads: list[Grads]  # per step the rank trained
    params: list[list[Tensor]]  # per step the rank trained, after the update
    names: list[str]
    buffers: list[dict[str, Tensor]]  # per step the rank trained, after it: by name
    final: list[Tensor]  # the parameters at the end (after join's final sync)
    rng: list[Tensor]  # with rank_seeds: the rank's generator state at the end


def _full(t: Tensor | None) -> Tensor | None:
    """A copy of ``t``, gathered in full if it is a DTensor (a collective: every rank calls
    it in the same order)."""
    if t is None:
        return None
    gather = getattr(t, "full_tensor", None)
    whole = gather() if gather is not None else t
    return whole.detach().clone(memory_format=torch.preserve_format)


def _sgd(params: Sequence[Tensor], lr: float) -> None:
    # p.add_(g, alpha=-lr), one parameter at a time: torch.optim.SGD's update without
    # momentum (foreach=False), the same bits on a whole tensor and on a shard of it.
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)


def _play(
    make_wrapper: WrapperFactory,
    s: TrainingScenario,
    *,
    setup: Callable[[nn.Module, reducer.ProcessGroup], None] | None,
    timeout: float,
    schedule: fakepg.Schedule | None = None,
) -> list[_RankTrace]:
    errors: dict[int, BaseException] = {}
    lock = threading.Lock()  # guards errors: each rank thread records its own failure

    def rank_fn(pg: fakepg.FakeProcessGroup) -> _RankTrace:
        rank = pg.rank()
        model = s.make_model()
        try:
            if s.ignored:
                _ignore(model, s.ignored)
            wrapper = make_wrapper(model, pg, **s.options)
            if setup is not None:
                setup(wrapper, pg)
            params = list(model.parameters())
            names = [name for name, _ in model.named_parameters()]
            trace = _RankTrace([], [], names, [], [], [])
            if s.rank_seeds is not None:
                torch.manual_seed(s.rank_seeds[rank])  # this rank thread's own generator
            joined = wrapper.join() if s.uneven else contextlib.nullcontext()  # type: ignore[operator]
            with joined:
                for step in range(s.steps):
                    if not s.trains(step, rank):
                        break
                    for p in params:
                        p.grad = None
                    output = wrapper(*s.args(step, rank))
                    s.loss(output).backward()  # type: ignore[no-untyped-call]
                    trace.grads.append([_full(p.grad) for p in params])
                    if s.lr:
                        _sgd(params, s.lr)
                    trace.params.append([_full(p) for p in params])  # type: ignore[misc]
                    trace.buffers.append(_buffers(model))
                    if step == s.reload_after:
                        wrapper = _reloaded(wrapper)
                        model = wrapper.module  # type: ignore[assignment]
                        params = list(model.parameters())
            trace.final.extend(_full(p) for p in params)  # type: ignore[misc]
            if s.rank_seeds is not None:
                trace.rng.append(torch.get_rng_state())  # this rank thread's generator
        except Exception as exc:
            if not isinstance(exc, fakepg.FakePGError):
                with lock:
                    errors[rank] = exc
            raise
        return trace

    try:
        return fakepg.run_torch(rank_fn, s.world_size, timeout=timeout, schedule=schedule)
    except Exception as exc:
        if s.refusal is None:
            raise
        _assert_refused(errors, exc, s.refusal)
        return []


def _reloaded(wrapper: nn.Module) -> nn.Module:
    """``wrapper`` pickled with ``torch.save`` into memory and loaded back, as torch's own
    DDP tests do (a new wrapper, module and parameters; the same default group)."""
    buffer = io.BytesIO()
    torch.save(wrapper, buffer)
    buffer.seek(0)
    loaded: nn.Module = torch.load(buffer, weights_only=False)
    return loaded


def _ignore(model: nn.Module, names: frozenset[str]) -> None:
    """Tell any DDP wrapper to leave ``names`` alone, as torch's static method does (it marks
    the module and the tensors; this project's DDP reads the same marks)."""
    ddp = nn.parallel.DistributedDataParallel
    ddp._set_params_and_buffers_to_ignore_for_model(model, sorted(names))  # type: ignore[no-untyped-call]


def _assert_refused(
    errors: Mapping[int, BaseException], first: BaseException, pattern: str
) -> None:
    """Every rank that failed by itself raised an error matching ``pattern``."""
    if not errors:
        raise AssertionError(
            f"expected every rank to refuse with an error matching {pattern!r}; the world "
            f"failed with {type(first).__name__}: {first}"
        ) from first
    for rank, error in sorted(errors.items()):
        if not re.search(pattern, str(error)):
            raise AssertionError(
                f"rank {rank}: expected an error matching {pattern!r}, got "
                f"{type(error).__name__}: {error}"
            ) from error


def _buffers(model: nn.Module) -> dict[str, Tensor]:
    """Copies of ``model``'s buffers by name, as they are now (a reassigned one included)."""
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _load_buffers(model: nn.Module, buffers: Mapping[str, Tensor]) -> None:
    for name, value in buffers.items():
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, value.clone())


@dataclass(frozen=True, slots=True)
class _Reference:
    grads: list[list[Grads]]  # per step, per rank
    params: list[list[list[Tensor]]]  # per step, per rank, after the update
    buffers: list[list[dict[str, Tensor]]]  # per step, per rank, after it
    final: list[Tensor]  # the parameters every rank ends with (uneven inputs: the last joiner's)
    rng: list[Tensor]  # with rank_seeds: per rank, where its own draws leave its stream


class _RankStreams:
    """Each rank's random stream, replayed on the calling thread: torch's default generator
    holds rank r's state while rank r's step runs (and its own state again afterwards)."""

    def __init__(self, seeds: Sequence[int] | None) -> None:
        self._states: list[Tensor] | None = None
        if seeds is not None:
            with torch.random.fork_rng(devices=[]):
                self._states = []
                for seed in seeds:
                    torch.manual_seed(seed)
                    self._states.append(torch.get_rng_state())

    def states(self) -> list[Tensor]:
        return [] if self._states is None else list(self._states)

    @contextlib.contextmanager
    def of(self, rank: int) -> Iterator[None]:
        if self._states is None:
            yield
            return
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._states[rank])
            yield
            self._states[rank] = torch.get_rng_state()


def _reference(s: TrainingScenario, average: Average, *, broadcast_buffers: bool) -> _Reference:
    """Per step and rank, the exact gradients, the parameters after the update, and the
    buffers. One plain model per rank: each rank's local gradient from plain autograd; every
    parameter's averaged across ranks, except an ignored one's, which each rank keeps. Every
    rank's forward starts from rank 0's buffers (``broadcast_buffers``, DDP's default: synced
    by name before each forward; ignored ones excepted) or from its own."""
    models = [s.make_model() for _ in range(s.world_size)]
    names = [name for name, _ in models[0].named_parameters()]
    params = [list(m.parameters()) for m in models]
    ref = _Reference([], [], [], [], [])
    streams = _RankStreams(s.rank_seeds)
    for step in range(s.steps):
        if broadcast_buffers:
            synced = {n: b for n, b in _buffers(models[0]).items() if n not in s.ignored}
            for model in models[1:]:
                _load_buffers(model, synced)
        local: list[Grads] = []
        for rank, model in enumerate(models):
            for p in params[rank]:
                p.grad = None
            if not s.trains(step, rank):  # run out: contributes zeros (join)
                local.append([None] * len(names))
                continue
            with streams.of(rank):
                s.loss(model(*s.args(step, rank))).backward()  # type: ignore[no-untyped-call]
            local.append([_full(p.grad) for p in params[rank]])
        for i, name in enumerate(names):
            if name in s.ignored:
                continue  # each rank keeps its own
            averaged = average([g[i] for g in local], s.world_size)
            for rank in range(s.world_size):
                params[rank][i].grad = None if averaged is None else averaged.clone()
        ref.grads.append([[_full(p.grad) for p in ps] for ps in params])
        if s.lr:
            for rank, ps in enumerate(params):
                if s.trains(step, rank):
                    _sgd(ps, s.lr)
        ref.params.append([[p.detach().clone() for p in ps] for ps in params])
        ref.buffers.append([_buffers(m) for m in models])
    # The highest rank of those that trained longest: join's final sync takes its model.
    last = max(range(s.world_size), key=lambda r: (sum(s.trains(k, r) for k in range(s.steps)), r))
    ref.final.extend(p.detach().clone() for p in params[last])
    ref.rng.extend(streams.states())
    return ref


def _average_for(scaling: Scaling, average: Average | None) -> Average:
    if average is not None:
        return average

    def by_scaling(column: Sequence[Tensor | None], world_size: int) -> Tensor | None:
        return rank_order_average(column, world_size, scaling=scaling)

    return by_scaling


def _compare(
    got: Tensor | None,
    want: Tensor | None,
    where: str,
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    strides: bool = False,
) -> None:
    if want is None or got is None:
        if want is None and got is None:
            return
        expected = "no gradient (unused on every rank)" if want is None else "a gradient"
        raise AssertionError(
            f"{where}: expected {expected}, got {'None' if got is None else 'a gradient'}"
        )
    if got.shape != want.shape or got.dtype != want.dtype:
        raise AssertionError(
            f"{where}: expected {tuple(want.shape)} {want.dtype}, "
            f"got {tuple(got.shape)} {got.dtype}"
        )
    if strides and got.stride() != want.stride():
        raise AssertionError(
            f"{where}: strides {got.stride()} where plain autograd gives {want.stride()} "
            "(the wrapper must keep the gradient's memory layout)"
        )
    if atol == 0.0 and rtol == 0.0:
        if not torch.equal(got, want):
            diff = (got.double() - want.double()).abs()
            index = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0])
            raise AssertionError(
                f"{where}: not bitwise equal to the exact reference; "
                f"{int((got != want).sum())} of {got.numel()} elements differ, the most at "
                f"index {index}: {got[index].item()!r} vs {want[index].item()!r} "
                f"(abs difference {diff.max().item():.3g})"
            )
        return
    torch.testing.assert_close(
        got, want, atol=atol, rtol=rtol, msg=lambda m: f"{where}: beyond the stated bound: {m}"
    )


@reports_schedule
def check_data_parallel(
    make_wrapper: WrapperFactory,
    scenario: TrainingScenario,
    *,
    scaling: Scaling = "reciprocal",
    average: Average | None = None,
    check_strides: bool = True,
    broadcast_buffers: bool = True,
    timeout: float = 60.0,
    schedule: fakepg.Schedule | None = None,
) -> None:
    """Train ``scenario`` with ``make_wrapper(module, pg, **scenario.options)`` on every rank
    of a fake world; after every step, each rank's gradients and parameters must equal the
    exact reference bit for bit (or every rank must raise the ``scenario.refusal`` error).

    The reference combines the ranks' local gradients with ``average`` (default: the
    rank-order average with ``scaling``: "reciprocal" for torch's DDP and this project's,
    "divide" for the bare reducer); a parameter no rank used in a step keeps no gradient.
    ``check_strides`` also requires each ``.grad`` to have the strides plain autograd gives
    it (channels_last stays channels_last). The module's buffers after every step must be
    those of a forward that started from rank 0's buffers (``broadcast_buffers``, DDP's
    default, each buffer found by name, so one that forward reassigns too) or from the rank's
    own. ``schedule``: run the ranks under it, one thread at a time in the order it decides
    (see :mod:`reducer.testing.schedule`); a failure then shows its timeline.
    """
    s = scenario
    runs = _play(make_wrapper, s, setup=None, timeout=timeout, schedule=schedule)
    if s.refusal is not None:
        if runs:
            raise AssertionError(
                f"expected every rank to refuse with an error matching {s.refusal!r}; every "
                f"step ran through"
            )
        return
    want = _reference(s, _average_for(scaling, average), broadcast_buffers=broadcast_buffers)
    for rank, run in enumerate(runs):
        # A stream shared with another rank ends elsewhere, whatever order the draws took
        # (each step has a collective, so the other rank has seeded before this one ends).
        if s.rank_seeds is not None and not torch.equal(run.rng[0], want.rng[rank]):
            raise AssertionError(
                f"rank {rank}: its random stream is not its own: after training, its generator "
                "is not where its own draws from its own seed leave it"
            )
        for step in range(len(run.grads)):
            for i, name in enumerate(run.names):
                where = f"rank {rank}, step {step}, parameter {i} ({name!r})"
                _compare(
                    run.grads[step][i],
                    want.grads[step][rank][i],
                    f"{where}, gradient",
                    strides=check_strides,
                )
                _compare(
                    run.params[step][i], want.params[step][rank][i], f"{where}, after the update"
                )
            expected = want.buffers[step][rank]
            got = run.buffers[step]
            if set(got) != set(expected):
                raise AssertionError(
                    f"rank {rank}, step {step}: buffers {sorted(got)}, expected {sorted(expected)}"
                )
            for name, value in expected.items():
                _compare(got[name], value, f"rank {rank}, step {step}, buffer {name!r}")
        steps_run = sum(s.trains(k, rank) for k in range(s.steps))
        if len(run.grads) != steps_run:
            raise AssertionError(f"rank {rank}: ran {len(run.grads)} steps, expected {steps_run}")
        if s.uneven:
            for i, name in enumerate(run.names):
                where = f"rank {rank}, parameter {i} ({name!r}), after join"
                _compare(run.final[i], want.final[i], f"{where} (the last joiner's)")


@reports_schedule
def check_comm_hook(
    hook: Callable[[Any, Any], torch.futures.Future[Tensor]],
    scenario: TrainingScenario,
    *,
    state: Callable[[reducer.ProcessGroup], object] | None = None,
    make_wrapper: WrapperFactory | None = None,
    average: Average | None = None,
    atol: float = 0.0,
    rtol: float = 0.0,
    cumulative_atol: float | None = None,
    timeout: float = 60.0,
    schedule: fakepg.Schedule | None = None,
) -> None:
    """Register ``hook`` (with ``state(pg)`` as its state, None if not given) on the wrapper
    (torch's DDP by default), run every step of ``scenario`` without updating the parameters,
    and compare each step's gradients with ``average`` of the ranks' local gradients
    (default: torch's ``allreduce_hook``, the rank-order average with "divide" scaling).

    Exact (``atol = rtol = 0``) compares bit for bit; otherwise within ``atol + rtol * |want|``
    elementwise. ``cumulative_atol``: also, at every step, the running sums over steps of the
    hook's gradients and of the exact ones are within it: a hook with error feedback keeps
    them so (what it drops now, it adds later); one that loses its residual drifts steadily.
    ``schedule``: as in :func:`check_data_parallel`.
    """
    if scenario.reload_after is not None:
        raise ValueError(
            "check_comm_hook: a reloaded wrapper has no comm hook (torch's pickling drops the "
            "reducer that holds it); draw the scenario without reload_after"
        )
    s = replace(scenario, lr=0.0)
    wrapper = make_wrapper if make_wrapper is not None else torch_ddp()

    def setup(module: nn.Module, pg: reducer.ProcessGroup) -> None:
        module.register_comm_hook(None if state is None else state(pg), hook)  # type: ignore[operator]

    runs = _play(wrapper, s, setup=setup, timeout=timeout, schedule=schedule)
    want = _reference(s, _average_for("divide", average), broadcast_buffers=True).grads
    for rank, run in enumerate(runs):
        sums: list[Tensor | None] = [None] * len(run.names)
        exact: list[Tensor | None] = [None] * len(run.names)
        for step in range(len(run.grads)):
            for i, name in enumerate(run.names):
                where = f"rank {rank}, step {step}, parameter {i} ({name!r})"
                got, w = run.grads[step][i], want[step][rank][i]
                _compare(got, w, f"{where}, gradient", atol=atol, rtol=rtol)
                if cumulative_atol is None or got is None or w is None:
                    continue
                sums[i] = got.double() if sums[i] is None else sums[i] + got.double()  # type: ignore[operator]
                exact[i] = w.double() if exact[i] is None else exact[i] + w.double()  # type: ignore[operator]
                _compare(
                    sums[i],
                    exact[i],
                    f"{where}, running sum over steps 0..{step} (error feedback)",
                    atol=cumulative_atol,
                )
