"""Run a training scenario through a reducer on the fake world, and compute its exact reference.

A :class:`Scenario` is plain data: a model spec, a world size, replicas per rank, a bucket
assignment, and the steps (local accumulation steps, then one synced step) with each rank's
active branches. :func:`run_reducer` plays it on ``fakepg`` with any reducer class (the real
one, or a deliberately broken one); :func:`reference` computes what every gradient must be from
plain local autograd, independently of any reducer.

Both build their models on the CPU, or on the device that the environment variable
``PROPERTY_TESTS_DEVICE`` names (``cuda``: every rank thread and the reference on one GPU),
so that the same properties run on a GPU::

    PROPERTY_TESTS_DEVICE=cuda pytest property_tests/test_exact_averaging.py
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from hypothesis import event
from torch import Tensor

import fakepg
import reducer

from .model import GeneratedModel, ModelSpec, branch_inputs, build_model, loss_of, sparse_flags
from .reference import rank_order_average, sparse_average

ReducerFactory = Callable[..., reducer.Reducer]
PRESET = 0.25  # the value pre-set into .grad when a scenario asks for existing gradients
DEVICE_VARIABLE = "PROPERTY_TESTS_DEVICE"


def harness_device() -> torch.device:
    """Where :func:`run_reducer` and :func:`reference` build models: ``$PROPERTY_TESTS_DEVICE``,
    default the CPU. Read on every call, so a test may set the variable."""
    return _device(os.environ.get(DEVICE_VARIABLE, "cpu"))


@functools.cache
def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"{DEVICE_VARIABLE}={text!r} is not a torch device; use cpu or cuda"
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{DEVICE_VARIABLE}={text!r}: the harness runs on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"{DEVICE_VARIABLE}={text!r} but torch sees no CUDA device here; unset it to "
                "run on the CPU"
            )
        # The reference recomputes every gradient and must get the rank's bits: cuDNN's
        # atomic-add convolution algorithms would sum in a run-dependent order.
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    return device


@dataclass(frozen=True, slots=True)
class Scenario:
    """One synced iteration, after ``len(steps) - 1`` local (no-sync) accumulation steps.

    ``steps[k][r]`` is the set of optional branches active on rank ``r`` in step ``k`` (the
    non-optional branches always run). ``find_unused`` passes the outputs to
    ``prepare_for_backward``. ``preset_grads`` starts every dense parameter with a ``.grad``
    of ``PRESET`` (so "untouched" is observable), else with None; ``preset_sparse`` does the
    same for sparse-gradient parameters (a sparse ``.grad`` with ``PRESET`` in row 0).
    ``as_view`` builds the reducer with ``gradient_as_bucket_view``.
    """

    model: ModelSpec
    world_size: int
    replicas: int
    buckets: tuple[tuple[int, ...], ...]
    steps: tuple[tuple[frozenset[int], ...], ...]
    find_unused: bool
    preset_grads: bool = False
    as_view: bool = False
    preset_sparse: bool = False

    def active(self, step: int, rank: int) -> frozenset[int]:
        return active_branches(self.model, self.steps[step][rank])

    def input_seed(self, rank: int, replica: int, step: int) -> int:
        return (self.model.seed * 1_000_003 + rank * 1009 + replica * 101 + step) % (2**31)


def active_branches(spec: ModelSpec, optional: frozenset[int]) -> frozenset[int]:
    """The branches that run: every non-optional one, and the ``optional`` ones picked."""
    return frozenset({i for i, b in enumerate(spec.branches) if not b.optional} | optional)


def note_coverage(scenario: Scenario) -> None:
    """Record what ``scenario`` covers as Hypothesis events, for
    ``pytest property_tests --hypothesis-show-statistics``."""
    s = scenario
    event(f"world size {s.world_size}, {s.replicas} replica(s)")
    event(f"{len(s.buckets)} bucket(s), {len(s.steps) - 1} local step(s)")
    branches = s.model.branches
    for what, present in (
        ("a wide layer", any(b.width > 4 for b in branches)),
        ("a sparse gradient", any(b.sparse for b in branches)),
        ("shared layers", any(b.shared_with is not None for b in branches)),
        ("float32 and float64", len({b.dtype for b in branches}) > 1),
        ("gradients as bucket views", s.as_view),
        ("outputs given to prepare_for_backward", s.find_unused),
    ):
        event(f"{'with' if present else 'without'} {what}")


def sync_intra_op_threads() -> None:
    """Give the calling thread the intra-op thread count that torch.set_num_threads set.

    Call it first thing on every thread that computes gradients to be compared bit for bit
    with another thread's. torch applies the count to a thread lazily, at its first parallel
    op; until then oneDNN kernels (convolutions) on a new thread use OpenMP's process default,
    and a different count splits their reductions differently: a rank thread's conv gradient
    then differs in the last bits from the main thread's after ``torch.set_num_threads``.
    ``get_num_threads`` runs that lazy initialization (torch offers no other way to request
    it).
    """
    torch.get_num_threads()


def snapshot(grad: Tensor | None) -> Tensor | None:
    """A copy of ``grad`` that later steps cannot change (sparse: coalesced)."""
    if grad is None:
        return None
    # coalesce() returns the tensor itself when already coalesced: clone in both cases.
    return grad.coalesce().clone() if grad.is_sparse else grad.detach().clone()


GradLists = list[list[Tensor | None]]  # [replica][parameter]


def run_reducer(
    scenario: Scenario,
    make_reducer: ReducerFactory = reducer.Reducer,
    *,
    network: fakepg.NetworkModel | None = None,
    models: Sequence[Sequence[GeneratedModel]] | None = None,
) -> list[GradLists]:
    """Play ``scenario`` on a fake world; per rank, the gradients every replica ends with.

    ``models[rank][replica]``, if given, are used instead of fresh ones (their ``.grad`` as
    they are, then preset as the scenario says), e.g. to train again after an error.
    """
    s = scenario
    last = len(s.steps) - 1
    if models is not None and [len(m) for m in models] != [s.replicas] * s.world_size:
        raise ValueError(
            f"run_reducer: models must hold {s.replicas} replica(s) for each of "
            f"{s.world_size} ranks, got {[len(m) for m in models]}"
        )

    device = harness_device()

    def rank_fn(pg: fakepg.FakeProcessGroup) -> GradLists:
        sync_intra_op_threads()
        rank = pg.rank()
        replicas = (
            list(models[rank])
            if models is not None
            else [build_model(s.model).to(device) for _ in range(s.replicas)]
        )
        params = [list(m.parameters()) for m in replicas]
        sparse = sparse_flags(replicas[0])
        preset(s, params, sparse)
        red = make_reducer(
            params,
            [list(b) for b in s.buckets],
            pg,
            [sparse] * s.replicas,
            gradient_as_bucket_view=s.as_view,
        )
        try:
            for step in range(len(s.steps)):
                outputs: list[Tensor] = []
                for d, model in enumerate(replicas):
                    inputs = branch_inputs(s.model, s.input_seed(rank, d, step))
                    outputs += model([x.to(device) for x in inputs], s.active(step, rank))
                if step == last:
                    red.prepare_for_backward(outputs if s.find_unused else [])
                loss_of(outputs).backward()
            return [[snapshot(p.grad) for p in replica] for replica in params]
        finally:
            red.close()

    return fakepg.run(rank_fn, s.world_size, timeout=20.0, network=network)


@dataclass(frozen=True, slots=True)
class Expected:
    """What one parameter's ``.grad`` must be after the synced step, on every rank and replica.

    ``value`` is the exact dense average (``sparse`` False), the dense image of the sparse
    average (``sparse`` True, compared with a tolerance), or, when ``untouched``, the ``.grad``
    the parameter started with (None or the preset), because no rank used it.
    """

    value: Tensor | None
    sparse: bool
    untouched: bool


def reference(scenario: Scenario) -> list[Expected]:
    """Per parameter, the expectation from plain local autograd (no reducer, no threads)."""
    s = scenario
    sync_intra_op_threads()
    device = harness_device()
    contributions: list[list[Tensor | None]] = []  # [contribution][parameter]
    sparse: list[bool] = []
    starts: list[Tensor | None] = []
    for rank in range(s.world_size):
        for d in range(s.replicas):
            model = build_model(s.model).to(device)
            params = list(model.parameters())
            sparse = sparse_flags(model)
            preset(s, [params], sparse)
            starts = [snapshot(p.grad) for p in params]
            used = [False] * len(params)
            handles = [
                p.register_post_accumulate_grad_hook(
                    lambda _p, i=i, used=used: used.__setitem__(i, True)
                )
                for i, p in enumerate(params)
            ]
            for step in range(len(s.steps)):
                inputs = branch_inputs(s.model, s.input_seed(rank, d, step))
                loss_of(model([x.to(device) for x in inputs], s.active(step, rank))).backward()
            for handle in handles:
                handle.remove()
            # A parameter this contribution did not use since the last sync adds zeros, even
            # if it holds an older .grad (the preset).
            contributions.append(
                [snapshot(p.grad) if used[i] else None for i, p in enumerate(params)]
            )
    expected = []
    for i, is_sparse in enumerate(sparse):
        column = [c[i] for c in contributions]
        if all(g is None for g in column):
            start = starts[i]
            value = None if start is None else start.to_dense() if start.is_sparse else start
            expected.append(Expected(value, is_sparse, untouched=True))
        elif is_sparse:
            expected.append(Expected(sparse_average(column, s.world_size), True, False))
        else:
            expected.append(Expected(rank_order_average(column, s.world_size), False, False))
    return expected


def check_against_reference(
    scenario: Scenario,
    make_reducer: ReducerFactory = reducer.Reducer,
    *,
    network: fakepg.NetworkModel | None = None,
) -> None:
    """The core property: every gradient on every rank and replica equals the reference.

    Dense gradients bit for bit (``torch.equal``); sparse ones within 1e-6 relative (the
    coalescing order is not fixed); untouched ones exactly as they started; and every rank
    and replica holds the same bits.
    """
    assert_matches_reference(run_reducer(scenario, make_reducer, network=network), scenario)


def assert_matches_reference(got: list[GradLists], scenario: Scenario) -> None:
    """Check gradients ``run_reducer`` returned against :func:`reference` (see
    :func:`check_against_reference` for what is compared and how)."""
    want = reference(scenario)
    first = got[0][0]
    for rank, per_replica in enumerate(got):
        for d, grads in enumerate(per_replica):
            for i, (grad, exp) in enumerate(zip(grads, want, strict=True)):
                where = f"parameter {i}, rank {rank}, replica {d}"
                _check_one(grad, exp, where)
                _check_same(grad, first[i], where)


def _check_one(grad: Tensor | None, exp: Expected, where: str) -> None:
    if exp.value is None:
        assert grad is None, f"{where}: unused on every rank, .grad must stay None; got {grad}"
        return
    assert grad is not None, f"{where}: expected a gradient, got None"
    if exp.sparse and exp.untouched:
        assert grad.is_sparse, f"{where}: unused on every rank, its sparse .grad must stay"
        assert torch.equal(grad.to_dense(), exp.value), f"{where}: must stay exactly as it was"
        return
    if exp.sparse:
        assert grad.is_sparse, f"{where}: expected a sparse gradient"
        dense = grad.to_dense()
        scale = float(exp.value.abs().max()) if exp.value.numel() else 0.0
        torch.testing.assert_close(
            dense, exp.value, rtol=1e-6, atol=1e-6 * scale, msg=lambda m: f"{where}: {m}"
        )
        return
    assert not grad.is_sparse, f"{where}: expected a dense gradient"
    what = "must stay exactly as it was" if exp.untouched else "must equal the rank-order average"
    assert torch.equal(grad, exp.value), (
        f"{where}: {what}; max abs difference "
        f"{(grad.double() - exp.value.double()).abs().max().item():.3g}"
    )


def _check_same(grad: Tensor | None, first: Tensor | None, where: str) -> None:
    if grad is None or first is None:
        assert grad is None and first is None, f"{where}: ranks disagree on having a gradient"
        return
    a = grad.to_dense() if grad.is_sparse else grad
    b = first.to_dense() if first.is_sparse else first
    assert torch.equal(a, b), f"{where}: differs from rank 0 replica 0 (ranks must agree bitwise)"


def preset(scenario: Scenario, params: Sequence[Sequence[Tensor]], sparse: Sequence[bool]) -> None:
    """Give every replica's parameters the starting ``.grad`` that ``scenario`` asks for."""
    for replica in params:
        for p, is_sparse in zip(replica, sparse, strict=True):
            if is_sparse and scenario.preset_sparse:
                p.grad = _sparse_preset(p)
            elif not is_sparse and scenario.preset_grads:
                p.grad = torch.full_like(p, PRESET).detach()


def _sparse_preset(param: Tensor) -> Tensor:
    """A sparse gradient laid out as nn.Embedding's: ``PRESET`` in row 0."""
    values = torch.full((1, *param.shape[1:]), PRESET, dtype=param.dtype, device=param.device)
    indices = torch.zeros((1, 1), dtype=torch.int64, device=param.device)
    return torch.sparse_coo_tensor(indices, values, param.shape)
