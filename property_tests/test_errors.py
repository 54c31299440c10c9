"""Property 6: generated misuse raises the documented error, never a hang or a wrong gradient.

Four kinds of misuse, each generated over models, bucket assignments and world sizes:

- a parameter used outside forward (its branch was skipped, then its weights enter the loss):
  ``ReductionError`` "marked ready twice", naming the parameter by index and name;
- a second iteration before the first finished its reduction (a rank skipped a branch while
  every hook was expected): ``ReductionError`` from ``prepare_for_backward`` on that rank,
  naming exactly the parameters that never got a gradient;
- invalid bucket indices: ``BucketAssignmentError`` (a ``ValueError``) at construction,
  naming the parameter or bucket;
- ``prepare_for_backward`` on a reducer closed, or failed in an earlier iteration:
  ``ReductionError`` naming the call refused.

And the fake world's own failure: a rank that fails while the others wait in a collective
gives each of them ``WorldAborted`` naming the failed rank, the collective and the waiting rank;
and closing a world stops a done-callback stalled in Python code and delivers what is queued
behind it.

Each run has bounded waits (the fake world's collectives time out), so a hang fails the test
instead of blocking it. After the error the reducers are closed and new ones built on the very
same models: the next iteration's gradients must be exactly the reference's. Each check takes
the reducer class, so ``test_mutants.py`` can run it against broken ones.
"""

from __future__ import annotations

import re
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fakepg
import reducer
from fakepg.completion import CallbackStopped
from reducer.testing.harness import (
    ReducerFactory,
    Scenario,
    assert_matches_reference,
    hook_count,
    note_size,
    run_reducer,
)
from reducer.testing.model import GeneratedModel, branch_inputs, build_model, loss_of, sparse_flags
from reducer.testing.strategies import bucket_assignments, model_specs, scenarios

unshared_with_optional = model_specs(allow_shared=False, require_optional=True)
WAIT_S = 10.0  # every collective of these runs fails after this long instead of hanging


def _train(
    scenario: Scenario,
    models: list[GeneratedModel],
    make_reducer: ReducerFactory | None,
    *,
    iterations: int,
    use_skipped_outside_forward: bool = False,
) -> None:
    """Run ``iterations`` synced steps of ``scenario``'s first step pattern on ``models``
    (one per rank); optionally add a skipped branch's parameters to the loss."""
    s = scenario
    make = reducer.Reducer if make_reducer is None else make_reducer  # as it is now

    def rank_fn(pg: fakepg.FakeProcessGroup) -> None:
        model = models[pg.rank()]
        names = [name for name, _ in model.named_parameters()]
        red = make(
            [list(model.parameters())],
            [list(b) for b in s.buckets],
            pg,
            [sparse_flags(model)],
            param_names=names,
        )
        try:
            for step in range(iterations):
                active = s.active(0, pg.rank())
                outputs = model(branch_inputs(s.model, s.input_seed(pg.rank(), 0, step)), active)
                red.prepare_for_backward(outputs if s.find_unused else [])
                loss = loss_of(outputs)
                if use_skipped_outside_forward:
                    skipped = [b for b in s.model.optional_branches if b not in active]
                    for p in model.branches[s.model.owner(skipped[0])].parameters():
                        loss = loss + p.double().sum()  # a parameter used outside forward
                loss.backward()
        finally:
            red.close()

    fakepg.run(rank_fn, s.world_size, timeout=WAIT_S)


def _branch_parameters(scenario: Scenario, model: GeneratedModel, branch: int) -> dict[int, str]:
    """Index -> name of the parameters of ``branch`` (which shares no layers)."""
    mine = {id(p) for p in model.branches[branch].parameters()}
    return {i: name for i, (name, p) in enumerate(model.named_parameters()) if id(p) in mine}


def _described(index: int, name: str) -> str:
    return re.escape(f"parameter {index} ({name!r})")


def _check_recovers(
    scenario: Scenario, models: list[GeneratedModel], make_reducer: ReducerFactory | None
) -> None:
    """Close-and-rebuild works: the closed reducer left no hook on the models, and on the
    same models (gradients cleared), one clean synced iteration with every branch running
    gives exactly the reference's gradients."""
    s = scenario
    for rank, model in enumerate(models):
        left = [name for name, p in model.named_parameters() if hook_count(p)]
        assert not left, f"rank {rank}: after close(), hooks are left on {left}"
    clean = Scenario(
        s.model,
        s.world_size,
        1,
        s.buckets,
        ((frozenset(s.model.optional_branches),) * s.world_size,),
        find_unused=False,
    )
    for model in models:
        model.zero_grad(set_to_none=True)
    got = run_reducer(clean, make_reducer, models=[[m] for m in models])
    assert_matches_reference(got, clean)


# -- a parameter used outside forward ---------------------------------------------------------


@st.composite
def used_outside_forward(draw: st.DrawFn) -> Scenario:
    """A scenario whose ranks all skip one optional branch (no shared layers), so that the
    training loop can then use that branch's parameters outside forward."""
    spec = draw(unshared_with_optional)
    skipped = draw(st.sampled_from(spec.optional_branches))
    world_size = draw(st.integers(1, 4))
    others = [b for b in spec.optional_branches if b != skipped]
    active = frozenset(b for b in others if draw(st.booleans()))
    model = build_model(spec)
    buckets = draw(bucket_assignments(list(model.parameters()), sparse_flags(model)))
    steps = ((active,) * world_size,)
    return Scenario(spec, world_size, 1, tuple(map(tuple, buckets)), steps, find_unused=True)


def check_used_outside_forward(
    scenario: Scenario, make_reducer: ReducerFactory | None = None
) -> None:
    models = [build_model(scenario.model) for _ in range(scenario.world_size)]
    skipped = next(b for b in scenario.model.optional_branches if b not in scenario.steps[0][0])
    named = _branch_parameters(scenario, models[0], skipped)
    which = "|".join(_described(i, name) for i, name in named.items())
    with pytest.raises(reducer.ReductionError, match=f"({which}) was marked ready twice"):
        _train(scenario, models, make_reducer, iterations=1, use_skipped_outside_forward=True)
    _check_recovers(scenario, models, make_reducer)


@given(used_outside_forward())
def test_a_parameter_used_outside_forward_is_reported(scenario: Scenario) -> None:
    note_size(scenario.model.parameter_count, scenario.world_size)
    check_used_outside_forward(scenario)


# -- a second iteration before the reduction finished ---------------------------------------


@st.composite
def unfinished_iterations(draw: st.DrawFn) -> tuple[Scenario, int]:
    """Every hook expected (no outputs given), but one rank skips a branch of its own: that
    rank's next ``prepare_for_backward`` must fail. Returns the scenario and the rank."""
    base = draw(
        scenarios(model=unshared_with_optional, find_unused=False, max_replicas=1, max_world_size=4)
    )
    spec = base.model
    rank = draw(st.integers(0, base.world_size - 1))
    skipped = draw(st.sampled_from(spec.optional_branches))
    pattern = tuple(
        frozenset(spec.optional_branches) - ({skipped} if r == rank else set())
        for r in range(base.world_size)
    )
    return Scenario(spec, base.world_size, 1, base.buckets, (pattern,), find_unused=False), rank


def check_unfinished_iteration(
    case: tuple[Scenario, int], make_reducer: ReducerFactory | None = None
) -> None:
    scenario, rank = case
    models = [build_model(scenario.model) for _ in range(scenario.world_size)]
    skipped = next(b for b in scenario.model.optional_branches if b not in scenario.steps[0][rank])
    named = _branch_parameters(scenario, models[0], skipped)
    with pytest.raises(
        reducer.ReductionError, match=f"on rank {rank}, these parameters never got a gradient"
    ) as info:
        _train(scenario, models, make_reducer, iterations=2)
    # Exactly the skipped branch's parameters are named, each by index and name.
    message = str(info.value)
    listed = message.split("never got a gradient:", 1)[1].split(". ", 1)[0]
    assert set(map(int, re.findall(r"parameter (\d+)", listed))) == set(named), message
    for i, name in named.items():
        assert re.search(_described(i, name), listed), f"parameter {i} not named: {message}"
    _check_recovers(scenario, models, make_reducer)


@given(unfinished_iterations())
def test_a_second_iteration_before_the_reduction_finished_is_reported(
    case: tuple[Scenario, int],
) -> None:
    note_size(case[0].model.parameter_count, case[0].world_size)
    check_unfinished_iteration(case)


# -- invalid bucket indices -------------------------------------------------------------------

BucketCase = tuple[list[torch.Tensor], list[bool], list[list[int]], str]


@st.composite
def corrupted(draw: st.DrawFn) -> BucketCase:
    """A model's parameters, their sparse flags, a bucket assignment broken in one way, and
    the words the error must contain."""
    spec = draw(model_specs())
    model = build_model(spec)
    params: list[torch.Tensor] = list(model.parameters())
    sparse = sparse_flags(model)
    buckets = draw(bucket_assignments(params, sparse))
    kinds = ["drop", "duplicate", "out of range", "empty"]
    if len({p.dtype for i, p in enumerate(params) if not sparse[i]}) > 1:
        kinds.append("mix dtypes")
    if any(sparse) and len(params) > 1:
        kinds.append("sparse with others")
    kind = draw(st.sampled_from(kinds))
    b = draw(st.integers(0, len(buckets) - 1))
    if kind == "drop":
        victim = draw(st.sampled_from(buckets[b]))
        buckets[b].remove(victim)
        buckets = [x for x in buckets if x]
        match = f"parameter {victim}.* in no bucket"
    elif kind == "duplicate":
        victim = draw(st.integers(0, len(params) - 1))
        buckets[b].append(victim)
        match = f"parameter {victim}.* (twice in|in bucket)"
    elif kind == "out of range":
        buckets[b].append(len(params) + draw(st.integers(0, 3)))
        match = "out of range"
    elif kind == "empty":
        buckets.insert(b, [])
        match = "is empty"
    elif kind == "mix dtypes":
        dense = [i for i in range(len(params)) if not sparse[i]]
        i = next(i for i in dense if params[i].dtype != params[dense[0]].dtype)
        buckets = [
            [dense[0], i],
            *([x for x in bucket if x not in (dense[0], i)] for bucket in buckets),
        ]
        buckets = [x for x in buckets if x]
        match = "mixes dtypes"
    else:
        s = sparse.index(True)
        other = next(i for i in range(len(params)) if i != s)
        buckets = [[s, other], *([x for x in bucket if x not in (s, other)] for bucket in buckets)]
        buckets = [x for x in buckets if x]
        match = "needs a bucket of its own"
    return params, sparse, buckets, match


def check_invalid_buckets(case: BucketCase, make_reducer: ReducerFactory | None = None) -> None:
    params, sparse, buckets, match = case
    make = reducer.Reducer if make_reducer is None else make_reducer  # as it is now
    with fakepg.World(1) as world, pytest.raises(reducer.BucketAssignmentError, match=match):
        make([params], buckets, world.group(0), [sparse])


@given(corrupted())
def test_invalid_bucket_indices_raise_value_error(case: BucketCase) -> None:
    note_size(len(case[0]), 1)
    check_invalid_buckets(case)


# -- a call on a closed or failed reducer -------------------------------------------------------


@st.composite
def refused_reducers(draw: st.DrawFn) -> tuple[Scenario, str]:
    """A scenario whose ranks all skip the same optional branch with every hook expected, and
    how its reducers are made unusable: ``"closed"`` (``close()``) or ``"failed"`` (the second
    ``prepare_for_backward`` finds the first iteration unfinished, on every rank)."""
    base = draw(
        scenarios(model=unshared_with_optional, find_unused=False, max_replicas=1, max_world_size=3)
    )
    skipped = draw(st.sampled_from(base.model.optional_branches))
    active = frozenset(base.model.optional_branches) - {skipped}
    steps = ((active,) * base.world_size,)
    scenario = Scenario(base.model, base.world_size, 1, base.buckets, steps, find_unused=False)
    return scenario, draw(st.sampled_from(["closed", "failed"]))


def check_refused_call_is_named(
    case: tuple[Scenario, str], make_reducer: ReducerFactory | None = None
) -> None:
    """``prepare_for_backward`` on a closed reducer, or on one whose earlier iteration failed,
    raises ReductionError naming ``prepare_for_backward`` (the call refused) on every rank."""
    scenario, how = case
    s = scenario
    make = reducer.Reducer if make_reducer is None else make_reducer  # as it is now
    messages: dict[int, str] = {}

    def rank_fn(pg: fakepg.FakeProcessGroup) -> None:
        model = build_model(s.model)
        red = make(
            [list(model.parameters())],
            [list(b) for b in s.buckets],
            pg,
            [sparse_flags(model)],
            param_names=[name for name, _ in model.named_parameters()],
        )
        try:
            if how == "closed":
                red.close()
            else:
                red.prepare_for_backward([])
                inputs = branch_inputs(s.model, s.input_seed(pg.rank(), 0, 0))
                loss_of(model(inputs, s.active(0, pg.rank()))).backward()
                with pytest.raises(reducer.ReductionError, match="never got a gradient"):
                    red.prepare_for_backward([])
            with pytest.raises(reducer.ReductionError) as info:
                red.prepare_for_backward([])
            messages[pg.rank()] = str(info.value)
        finally:
            red.close()

    fakepg.run(rank_fn, s.world_size, timeout=WAIT_S)
    for rank in range(s.world_size):
        message = messages[rank]
        if how == "closed":
            assert message == "prepare_for_backward on a closed Reducer; build a new Reducer"
        else:
            expected = "prepare_for_backward: this Reducer failed in an earlier iteration ("
            assert message.startswith(expected), f"rank {rank}: {message}"


@given(refused_reducers())
def test_a_call_on_a_closed_or_failed_reducer_is_named(case: tuple[Scenario, str]) -> None:
    note_size(case[0].model.parameter_count, case[0].world_size)
    check_refused_call_is_named(case)


# -- the fake world's own errors ----------------------------------------------------------------

COLLECTIVES = ("allreduce", "broadcast", "allgather")


@st.composite
def world_failures(draw: st.DrawFn) -> tuple[int, int, str, int]:
    """A world size (2 to 4), the rank that fails, the collective the others wait in, and how
    many completed collectives come before it (its sequence number)."""
    world_size = draw(st.integers(2, 4))
    return (
        world_size,
        draw(st.integers(0, world_size - 1)),
        draw(st.sampled_from(COLLECTIVES)),
        draw(st.integers(0, 2)),
    )


def _issue(pg: fakepg.FakeProcessGroup, kind: str) -> fakepg.Work:
    t = torch.ones(2)
    if kind == "allreduce":
        return pg.allreduce([t])
    if kind == "broadcast":
        return pg.broadcast([t], 0)
    return pg.allgather([[torch.zeros(2) for _ in range(pg.size())]], [t])


def check_a_failure_names_the_collective_and_the_waiting_rank(
    case: tuple[int, int, str, int],
) -> None:
    """Property: when a rank fails while the others wait in a collective it never joined,
    each of the others gets WorldAborted naming the failed rank, that collective (kind and
    sequence number) and the waiting rank itself. The failing rank raises only once every
    other rank has issued the collective, so it is unfinished when the world aborts."""
    world_size, failing, kind, before = case
    issued = threading.Barrier(world_size, timeout=WAIT_S)
    seen: dict[int, str] = {}

    def rank_fn(pg: fakepg.FakeProcessGroup) -> None:
        for _ in range(before):
            pg.allreduce([torch.ones(1)]).wait()
        if pg.rank() == failing:
            issued.wait()
            raise ValueError("this rank fails")
        work = _issue(pg, kind)
        issued.wait()
        try:
            work.wait()
        except fakepg.WorldAborted as error:
            seen[pg.rank()] = str(error)

    with pytest.raises(ValueError, match="this rank fails"):
        fakepg.run(rank_fn, world_size, timeout=WAIT_S)
    assert sorted(seen) == [r for r in range(world_size) if r != failing], seen
    for rank, message in seen.items():
        assert f"rank {failing} failed" in message, message
        # The collective's sequence number counts per kind of channel: every earlier
        # collective was an allreduce on the world's channel, as this one.
        assert f"; {kind} #{before}" in message and f"on rank {rank}." in message, message


@given(world_failures())
def test_a_failure_names_the_collective_and_the_waiting_rank(
    case: tuple[int, int, str, int],
) -> None:
    check_a_failure_names_the_collective_and_the_waiting_rank(case)


@st.composite
def stalled_lanes(draw: st.DrawFn) -> tuple[int, int, int]:
    """A world size (2 or 3), the rank whose first callback stalls, and how many callbacks
    each rank queues behind it (1 to 3).

    Not one rank: its collective completes during its own call (there is no peer to hold it
    open), its lane may set the future's result before ``then()`` is called, and then torch's
    ``then()`` runs the callback at once on the caller's thread, where there is no lane to stop.
    """
    world_size = draw(st.integers(2, 3))
    return world_size, draw(st.integers(0, world_size - 1)), draw(st.integers(1, 3))


# The world's timeout. close() waits min(timeout, 5 s) for a busy lane before stopping it; the
# stall's own watchdog fires only at the timeout, so that close(), not the watchdog, stops the
# callback however slowly a loaded machine gets there.
CLOSE_S = 30.0


def check_closing_stops_a_stalled_callback(case: tuple[int, int, int]) -> None:
    """Property: closing a world whose rank is stalled in a done-callback (looping in Python
    code for an event nobody sets) stops that callback (CallbackStopped is raised
    into it) and delivers every callback queued behind it, on every rank, before close()
    returns: a closed world leaves no completion lane busy. The world is closed as soon as
    the callback has started, well within its timeout, so that close() rather than the
    stall's watchdog has to stop it."""
    world_size, stalled, behind = case
    started, release = threading.Event(), threading.Event()
    stopped: list[int] = []
    delivered: list[tuple[int, int]] = []

    def stall(_future: object) -> None:
        started.set()
        try:
            # Short waits: an exception raised into a thread lands between bytecodes, never
            # inside one long blocking wait.
            for _ in range(int(10 * WAIT_S / 0.01)):
                if release.wait(0.01):
                    break
        except CallbackStopped:
            stopped.append(stalled)
            raise

    # The stalled rank attaches its callback before any other rank issues the collective: it
    # cannot be complete then, so the callback runs on the rank's lane (then() on a complete
    # future runs it at once, on the caller's thread, where close() has nothing to stop).
    attached = threading.Event()

    def issue(world: fakepg.World, rank: int) -> None:
        pg = world.group(rank)
        if rank != stalled:
            assert attached.wait(WAIT_S)
        for i in range(1 + behind):
            future = pg.allreduce([torch.ones(1)]).get_future()
            if rank == stalled and i == 0:
                future.then(stall)
                attached.set()
            elif i > 0:

                def deliver(_future: object, i: int = i) -> None:
                    delivered.append((rank, i))

                future.then(deliver)

    try:
        with fakepg.World(world_size, timeout=CLOSE_S) as world:
            ranks = [threading.Thread(target=issue, args=(world, r)) for r in range(world_size)]
            for thread in ranks:
                thread.start()
            for thread in ranks:
                thread.join()
            assert started.wait(WAIT_S)
        assert stopped == [stalled]
        expected = {(r, i) for r in range(world_size) for i in range(1, 1 + behind)}
        assert sorted(delivered) == sorted(expected), delivered
    finally:
        release.set()  # a lane left stalled (a broken close) ends once the property failed


@given(stalled_lanes())
@settings(max_examples=5, deadline=None)
def test_closing_a_world_stops_a_stalled_callback(case: tuple[int, int, int]) -> None:
    check_closing_stops_a_stalled_callback(case)


def exception_in_the_world_aborts_it(world_size: int, waiting: list[int], text: str) -> None:
    """Property: an exception raised inside ``with World(...)`` aborts the world with it as
    the cause: every rank waiting in a collective that cannot complete (not every rank
    issued it) wakes with WorldAborted naming that exception, whether it issued before the
    exception or after."""
    errors: dict[int, BaseException] = {}
    started = threading.Barrier(len(waiting) + 1, timeout=20)

    def rank_main(world: fakepg.World, rank: int) -> None:
        started.wait()
        try:
            world.group(rank).allreduce([torch.ones(1)]).wait()
        except fakepg.FakePGError as error:
            errors[rank] = error

    def user_code(world: fakepg.World) -> None:
        for thread in threads:
            thread.start()
        started.wait()
        raise KeyError(text)

    world = fakepg.World(world_size, timeout=30)
    threads = [threading.Thread(target=rank_main, args=(world, r)) for r in waiting]
    with pytest.raises(KeyError, match=re.escape(text)), world:
        user_code(world)
    for thread in threads:
        thread.join(20)
    for rank in waiting:
        error = errors.get(rank)
        assert isinstance(error, fakepg.WorldAborted), (rank, error)
        assert "the world was aborted because" in str(error) and text in str(error), error


@st.composite
def worlds_left_by_an_exception(draw: st.DrawFn) -> tuple[int, list[int], str]:
    world_size = draw(st.integers(2, 4))
    waiting = draw(st.lists(st.integers(0, world_size - 1), min_size=1, unique=True))
    waiting = waiting[: world_size - 1]  # not every rank: the collective cannot complete
    text = draw(st.sampled_from(["a user's bug", "step 3 diverged", "out of data"]))
    return world_size, sorted(waiting), text


@given(worlds_left_by_an_exception())
@settings(max_examples=20, deadline=None)
def test_an_exception_inside_the_world_aborts_it_with_that_cause(
    case: tuple[int, list[int], str],
) -> None:
    exception_in_the_world_aborts_it(*case)
