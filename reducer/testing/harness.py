"""Run a training scenario through a reducer on the fake world, and compute its exact reference.

A :class:`Scenario` is plain data: a model spec, a world size, replicas per rank, a bucket
assignment, and the steps (local accumulation steps, then one synced step) with each rank's
active branches, and how the training loop runs them (static graph, a comm hook, higher-order
backward, a second backward). :func:`play` runs it on ``fakepg`` with any reducer class (the
real one, or a deliberately broken one); :func:`reference` computes what every gradient must
be from plain local autograd, independently of any reducer; :func:`refusal` derives from the
scenario alone whether the reducer must refuse it instead (with which error).

The class under test is ``reducer.Reducer`` as looked up at call time, unless a caller passes
another: so a run that replaces ``reducer.Reducer`` (as the project's mutant catalogue does)
puts every property in front of the replacement.

Both build their models on the CPU, or on the device that the environment variable
``PROPERTY_TESTS_DEVICE`` names (``cuda``: every rank thread and the reference on one GPU),
so that the same properties run on a GPU::

    PROPERTY_TESTS_DEVICE=cuda pytest property_tests/test_exact_averaging.py
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from hypothesis import event
from torch import Tensor

import fakepg
import reducer

from .hooks import AVERAGES, HOOKS, state_for
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


# How the training loop differentiates: loss.backward(); loss.backward(create_graph=True);
# or a gradient penalty, grads = autograd.grad(loss, params, create_graph=True), then
# (loss + sum of each grad's squares).backward().
BACKWARDS = ("plain", "create_graph", "penalty")
# The documented words of the error every rank raises when a parameter's hook fires twice.
MARKED_TWICE = "Expected to mark a variable ready only once"


@dataclass(frozen=True, slots=True)
class Scenario:
    """One synced iteration, after ``len(steps) - 1`` local (no-sync) accumulation steps.

    ``steps[k][r]`` is the set of optional branches active on rank ``r`` in step ``k`` (the
    non-optional branches always run). ``find_unused`` passes the outputs to
    ``prepare_for_backward``. ``preset_grads`` starts every dense parameter with a ``.grad``
    of ``PRESET`` (so "untouched" is observable), else with None; ``preset_sparse`` does the
    same for sparse-gradient parameters (a sparse ``.grad`` with ``PRESET`` in row 0).
    ``as_view`` builds the reducer with ``gradient_as_bucket_view``, ``static_graph`` with
    ``static_graph``. ``hook`` names a comm hook of :data:`reducer.testing.hooks.HOOKS` (or
    "none"). ``backward`` is one of :data:`BACKWARDS`, for every step. ``twice`` runs a first
    backward of branch 0's outputs (``retain_graph=True``) before the synced one, so that the
    second goes through the same graph again. ``rebuild`` closes the reducer afterwards and
    builds a new one on the same models, for one more synced step. ``latency`` (seconds) is
    the simulated time of every collective, so that a reducer that reads a bucket before its
    allreduce lands reads the wrong values.
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
    static_graph: bool = False
    hook: str = "none"
    backward: str = "plain"
    twice: bool = False
    rebuild: bool = False
    latency: float = 0.0

    def active(self, step: int, rank: int) -> frozenset[int]:
        return active_branches(self.model, self.steps[step][rank])

    def input_seed(self, rank: int, replica: int, step: int) -> int:
        return (self.model.seed * 1_000_003 + rank * 1009 + replica * 101 + step) % (2**31)


def active_branches(spec: ModelSpec, optional: frozenset[int]) -> frozenset[int]:
    """The branches that run: every non-optional one, and the ``optional`` ones picked."""
    return frozenset({i for i, b in enumerate(spec.branches) if not b.optional} | optional)


# The size of the example a property checked last, as (parameters, ranks): Hypothesis runs
# the shrunk failing example last, so after a failure this is the reported example's size
# (read by the property suite's conftest.py for benchmarks/harness_power.py). Per process; the
# properties run one at a time in a process.
last_example_size: list[tuple[int, int | None]] = []


def note_size(parameters: int, ranks: int | None) -> None:
    """Record the size of the example about to be checked (see ``last_example_size``)."""
    last_example_size[:] = [(parameters, ranks)]


def note_coverage(scenario: Scenario) -> None:
    """Record what ``scenario`` covers as Hypothesis events, for
    ``pytest property_tests --hypothesis-show-statistics``, and its size (``note_size``)."""
    s = scenario
    note_size(s.model.parameter_count, s.world_size)
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
        ("static graph", s.static_graph),
        ("non-reentrant checkpointing", any(b.checkpoint == "nonreentrant" for b in branches)),
        ("reentrant checkpointing", any(b.checkpoint == "reentrant" for b in branches)),
        ("a second backward", s.twice),
        ("a new reducer after close()", s.rebuild),
        ("simulated latency", s.latency > 0),
    ):
        event(f"{'with' if present else 'without'} {what}")
    event(f"comm hook: {s.hook}; backward: {s.backward}")
    why = refusal(s)
    event(f"refused: {why.why}" if why is not None else "averaged")


# -------------------------------------------------------------------------------------------
# What the reducer must refuse.


@dataclass(frozen=True, slots=True)
class Refusal:
    """The synced step must fail on every rank with a ``ReductionError`` that starts with
    ``MARKED_TWICE`` and names one of ``parameters`` (by index and name): ``why`` says what
    in the scenario makes it so."""

    why: str
    parameters: frozenset[int]


def refusal(scenario: Scenario) -> Refusal | None:
    """Whether the reducer must refuse ``scenario``'s synced step, from the scenario alone
    (see :func:`model_refusal`)."""
    s = scenario
    return model_refusal(
        s.model, find_unused=s.find_unused, static_graph=s.static_graph, twice=s.twice
    )


def model_refusal(
    spec: ModelSpec, *, find_unused: bool, static_graph: bool, twice: bool
) -> Refusal | None:
    """Whether the reducer must refuse a synced step of ``spec``, run with every branch that
    uses a reentrant checkpoint's layers, unused parameters searched for (``find_unused``) or
    not, ``static_graph`` or not, and a second backward (``twice``) or not.

    Without ``static_graph`` (which counts each parameter's hook calls in the first iteration
    and expects as many later, so it supports all of these):

    - a second backward through the same graph while the reduction is unfinished: the
      parameters of branch 0 are marked ready twice. The strategies draw ``twice`` only where
      the first backward leaves some parameter without its gradient on every rank (else the
      first backward ends the iteration, and the second accumulates locally, as no_sync does);
    - reentrant checkpointing while searching for unused parameters: the checkpoint hides its
      parameters from the search (its forward ran without grad), so they are found unused, and
      then get a gradient;
    - a layer whose gradients come from two backward passes (two reentrant checkpoints, or one
      and a use outside it): each reentrant checkpoint runs a backward pass of its own, so its
      parameters' hooks fire once per pass.

    Every branch that runs the layers of a reentrant-checkpointed branch is never optional
    (the strategies make it so), so each case holds on every rank alike.
    """
    if static_graph:
        return None
    owners = spec.parameter_owners()

    def parameters_of(branches: set[int]) -> frozenset[int]:
        return frozenset(i for i, owner in enumerate(owners) if owner in branches)

    if twice:
        return Refusal("a second backward through the same graph", parameters_of({0}))
    reentrant = {
        spec.owner(b) for b, br in enumerate(spec.branches) if br.checkpoint == "reentrant"
    }
    for owner in reentrant:
        optional = [b for b in spec.users(owner) if spec.branches[b].optional]
        if optional:
            raise ValueError(
                f"branches {optional} run the layers of a reentrant-checkpointed branch and are "
                "optional: whether the reducer refuses would differ between ranks; make them "
                "non-optional"
            )
    if find_unused and reentrant:
        return Refusal(
            "reentrant checkpointing hides parameters from the search", parameters_of(reentrant)
        )
    split = {o for o in reentrant if _backward_passes(spec, o) > 1}
    if split:
        return Refusal("a layer's gradients come from two backward passes", parameters_of(split))
    return None


def _backward_passes(spec: ModelSpec, owner: int) -> int:
    """How many backward passes give ``owner``'s layers a gradient, every branch running:
    one per reentrant checkpoint of them, and the outer pass for any other use."""
    modes = [spec.branches[b].checkpoint for b in spec.users(owner)]
    return modes.count("reentrant") + any(m != "reentrant" for m in modes)


def twice_refused_everywhere(
    spec: ModelSpec, steps: tuple[tuple[frozenset[int], ...], ...]
) -> bool:
    """Does a first backward of branch 0's outputs leave the synced step unfinished on every
    rank? It does where some running branch owns layers other than branch 0's (they get no
    gradient from it). See :func:`refusal`."""
    return all(
        any(spec.owner(b) != 0 for b in active_branches(spec, optional)) for optional in steps[-1]
    )


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


def hook_count(param: Tensor) -> int:
    """How many post-accumulate-grad hooks ``param`` carries.

    torch has no public API that lists a tensor's hooks; ``register_post_accumulate_grad_hook``
    keeps them in the tensor's ``_post_accumulate_grad_hooks`` dict (None before the first),
    so that private attribute is read here, and only here.
    """
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    return 0 if hooks is None else len(hooks)


def backward(mode: str, loss: Tensor, params: Sequence[Tensor]) -> None:
    """Differentiate ``loss`` as :data:`BACKWARDS` ``mode`` says."""
    if mode == "plain":
        loss.backward()  # type: ignore[no-untyped-call]
    elif mode == "create_graph":
        loss.backward(create_graph=True)  # type: ignore[no-untyped-call]
    elif mode == "penalty":
        grads = torch.autograd.grad(loss, list(params), create_graph=True, allow_unused=True)
        penalty = torch.zeros((), dtype=torch.float64)
        for g in grads:
            if g is not None:
                penalty = penalty + g.pow(2).sum()
        (loss + penalty).backward()  # type: ignore[no-untyped-call]
    else:
        raise ValueError(f"unknown backward mode {mode!r}; expected one of {BACKWARDS}")


@dataclass(frozen=True, slots=True)
class RankRun:
    """What one rank ends with: its gradients, the ``ReductionError`` message it raised
    (only where :func:`refusal` expects one), and the parameters that still carried a hook
    of the reducer after ``close()``."""

    grads: GradLists
    error: str | None
    hooks_left: tuple[str, ...]


def play(
    scenario: Scenario,
    make_reducer: ReducerFactory | None = None,
    *,
    network: fakepg.NetworkModel | None = None,
    models: Sequence[Sequence[GeneratedModel]] | None = None,
) -> list[RankRun]:
    """Play ``scenario`` on a fake world with ``make_reducer`` (``reducer.Reducer`` as it is
    now, by default); one :class:`RankRun` per rank.

    ``models[rank][replica]``, if given, are used instead of fresh ones (their ``.grad`` as
    they are, then preset as the scenario says), e.g. to train again after an error.
    ``network`` overrides the scenario's latency.
    """
    s = scenario
    make = reducer.Reducer if make_reducer is None else make_reducer
    last = len(s.steps) - 1
    refused = refusal(s) is not None
    if models is not None and [len(m) for m in models] != [s.replicas] * s.world_size:
        raise ValueError(
            f"play: models must hold {s.replicas} replica(s) for each of "
            f"{s.world_size} ranks, got {[len(m) for m in models]}"
        )
    if network is None and s.latency > 0:
        network = fakepg.FixedLatency(s.latency)

    device = harness_device()

    def rank_fn(pg: fakepg.FakeProcessGroup) -> RankRun:
        sync_intra_op_threads()
        rank = pg.rank()
        # Models handed in are moved too (in place: the parameters stay the same objects).
        replicas = (
            [m.to(device) for m in models[rank]]
            if models is not None
            else [build_model(s.model).to(device) for _ in range(s.replicas)]
        )
        params: list[list[Tensor]] = [list(m.parameters()) for m in replicas]
        flat = [p for replica in params for p in replica]
        sparse = sparse_flags(replicas[0])
        preset(s, params, sparse)
        before = [hook_count(p) for p in flat]
        red = make(
            params,
            [list(b) for b in s.buckets],
            pg,
            [sparse] * s.replicas,
            param_names=[name for name, _ in replicas[0].named_parameters()],
            gradient_as_bucket_view=s.as_view,
            static_graph=s.static_graph,
        )
        error = None
        try:
            if s.hook != "none":
                red.register_comm_hook(state_for(s.hook, pg), HOOKS[s.hook])
            for step in range(len(s.steps)):
                outputs: list[Tensor] = []
                firsts: list[Tensor] = []  # branch 0's output of each replica
                for d, model in enumerate(replicas):
                    inputs = branch_inputs(s.model, s.input_seed(rank, d, step))
                    mine = model([x.to(device) for x in inputs], s.active(step, rank))
                    firsts.append(mine[0])
                    outputs += mine
                if step < last:
                    backward(s.backward, loss_of(outputs), flat)
                    continue
                red.prepare_for_backward(outputs if s.find_unused else [])
                try:
                    if s.twice:
                        loss_of(firsts).backward(retain_graph=True)  # type: ignore[no-untyped-call]
                    backward(s.backward, loss_of(outputs), flat)
                except reducer.ReductionError as exc:
                    if not refused:
                        raise
                    error = str(exc)
            grads = [[snapshot(p.grad) for p in replica] for replica in params]
        finally:
            red.close()
        return RankRun(grads, error, hooks_left(flat, before))

    return fakepg.run(rank_fn, s.world_size, timeout=20.0, network=network)


def run_reducer(
    scenario: Scenario,
    make_reducer: ReducerFactory | None = None,
    *,
    network: fakepg.NetworkModel | None = None,
    models: Sequence[Sequence[GeneratedModel]] | None = None,
) -> list[GradLists]:
    """:func:`play` for a scenario the reducer does not refuse; per rank, the gradients
    every replica ends with."""
    runs = play(scenario, make_reducer, network=network, models=models)
    _assert_no_hooks_left(runs)
    return [run.grads for run in runs]


@dataclass(frozen=True, slots=True)
class Expected:
    """What one parameter's ``.grad`` must be after the synced step, on every rank and replica.

    ``value`` is the exact dense average (``sparse`` False), the dense image of the sparse
    average (``sparse`` True, compared with a tolerance), or, when ``untouched``, the ``.grad``
    the parameter started with (None or the preset), because no rank used it. ``hook``
    names the comm hook whose result ``value`` is ("none": the reducer's own average).
    """

    value: Tensor | None
    sparse: bool
    untouched: bool
    hook: str = "none"


def reference(scenario: Scenario) -> list[Expected]:
    """Per parameter, the expectation from plain local autograd (no reducer, no threads)."""
    s = scenario
    if refusal(s) is not None:
        raise ValueError(f"reference: the reducer must refuse this scenario ({refusal(s)})")
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
                p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                    lambda _p, i=i, used=used: used.__setitem__(i, True)
                )
                for i, p in enumerate(params)
            ]
            for step in range(len(s.steps)):
                inputs = branch_inputs(s.model, s.input_seed(rank, d, step))
                backward(
                    s.backward,
                    loss_of(model([x.to(device) for x in inputs], s.active(step, rank))),
                    params,
                )
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
            average = AVERAGES[s.hook] if s.hook != "none" else rank_order_average
            expected.append(Expected(average(column, s.world_size), False, False, s.hook))
    return expected


def check_against_reference(
    scenario: Scenario,
    make_reducer: ReducerFactory | None = None,
    *,
    network: fakepg.NetworkModel | None = None,
) -> None:
    """The core property: every gradient on every rank and replica equals the reference, or
    every rank raises the documented error where the reducer must refuse (:func:`refusal`).

    Dense gradients bit for bit (``torch.equal``); sparse ones within 1e-6 relative (the
    coalescing order is not fixed); untouched ones exactly as they started; and every rank
    and replica holds the same bits. After ``close()`` no parameter carries a hook of the
    reducer; with ``rebuild``, a new reducer on the same models then averages one more synced
    step exactly.
    """
    s = scenario
    models = (
        [[build_model(s.model) for _ in range(s.replicas)] for _ in range(s.world_size)]
        if s.rebuild
        else None
    )
    assert_outcome(play(s, make_reducer, network=network, models=models), s)
    if models is not None:
        again = rebuilt(s)
        for model in (m for per_rank in models for m in per_rank):
            model.zero_grad(set_to_none=True)
        assert_outcome(play(again, make_reducer, network=network, models=models), again)


def rebuilt(scenario: Scenario) -> Scenario:
    """The step a new reducer runs on the same models after ``close()``: every branch, no
    search, no hook, plain backward; with ``static_graph`` where the model needs it (a layer
    in two backward passes)."""
    s = scenario
    everything = (frozenset(s.model.optional_branches),) * s.world_size
    clean = Scenario(s.model, s.world_size, s.replicas, s.buckets, (everything,), False)
    return replace(clean, static_graph=True) if refusal(clean) is not None else clean


def assert_outcome(runs: Sequence[RankRun], scenario: Scenario) -> None:
    """Check what :func:`play` returned: no hook left after ``close()``, then the refusal
    :func:`refusal` expects on every rank, or the reference's gradients."""
    _assert_no_hooks_left(runs)
    why = refusal(scenario)
    if why is None:
        assert_matches_reference([run.grads for run in runs], scenario)
    else:
        assert_refused([run.error for run in runs], why)


def assert_refused(errors: Sequence[str | None], why: Refusal) -> None:
    """Every rank raised the documented error, naming a parameter ``why`` allows."""
    for rank, error in enumerate(errors):
        where = f"rank {rank}"
        assert error is not None, (
            f"{where}: expected the {MARKED_TWICE!r} error ({why.why}); the step ran through"
        )
        assert error.startswith(MARKED_TWICE), f"{where}: unexpected message: {error}"
        named = re.match(rf"{MARKED_TWICE}: parameter (\d+) \('[^']+'\)", error)
        assert named is not None, f"{where}: the message names no parameter: {error}"
        assert int(named.group(1)) in why.parameters, (
            f"{where}: names parameter {named.group(1)}, expected one of "
            f"{sorted(why.parameters)} ({why.why}): {error}"
        )


def hooks_left(params: Sequence[Tensor], before: Sequence[int]) -> tuple[str, ...]:
    """The parameters (described) whose hook count differs from ``before``."""
    return tuple(
        f"parameter {i}: {hook_count(p) - n:+d} hook(s)"
        for i, (p, n) in enumerate(zip(params, before, strict=True))
        if hook_count(p) != n
    )


def _assert_no_hooks_left(runs: Sequence[RankRun]) -> None:
    for rank, run in enumerate(runs):
        assert not run.hooks_left, (
            f"rank {rank}: after close(), hooks of the reducer are left on "
            f"{'; '.join(run.hooks_left)}"
        )


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
    if exp.hook != "none" and not exp.untouched:
        what += f" of the {exp.hook!r} comm hook"
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
