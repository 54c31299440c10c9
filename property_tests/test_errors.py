"""Property 6: generated misuse raises the documented error, never a hang or a wrong gradient."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fakepg
import reducer

from .harness import Scenario
from .model import branch_inputs, build_model, loss_of, sparse_flags
from .strategies import bucket_assignments, model_specs, scenarios

unshared_with_optional = model_specs(allow_shared=False, require_optional=True)


def _train(scenario: Scenario, rank_fn_extra_loss: bool, iterations: int) -> None:
    """Run ``iterations`` synced steps; optionally use an unused branch outside forward."""
    s = scenario

    def rank_fn(pg: fakepg.FakeProcessGroup) -> None:
        model = build_model(s.model)
        params = list(model.parameters())
        red = reducer.Reducer([params], [list(b) for b in s.buckets], pg, [sparse_flags(model)])
        try:
            for step in range(iterations):
                active = s.active(0, pg.rank())
                outputs = model(branch_inputs(s.model, s.input_seed(pg.rank(), 0, step)), active)
                red.prepare_for_backward(outputs if s.find_unused else [])
                loss = loss_of(outputs)
                if rank_fn_extra_loss:
                    skipped = [b for b in s.model.optional_branches if b not in active]
                    for p in model.branches[s.model.owner(skipped[0])].parameters():
                        loss = loss + p.double().sum()  # a parameter used outside forward
                loss.backward()
        finally:
            red.close()

    fakepg.run(rank_fn, s.world_size, timeout=20.0)


@st.composite
def used_outside_forward(draw: st.DrawFn) -> Scenario:
    """A scenario whose ranks all skip one optional branch (no shared layers), so that the
    training loop can then use that branch's parameters outside forward."""
    spec = draw(model_specs(allow_shared=False, require_optional=True))
    skipped = draw(st.sampled_from(spec.optional_branches))
    world_size = draw(st.integers(1, 4))
    others = [b for b in spec.optional_branches if b != skipped]
    active = frozenset(b for b in others if draw(st.booleans()))
    params = list(build_model(spec).parameters())
    buckets = draw(bucket_assignments(params, sparse_flags(build_model(spec))))
    steps = ((active,) * world_size,)
    return Scenario(spec, world_size, 1, tuple(map(tuple, buckets)), steps, find_unused=True)


@given(used_outside_forward())
def test_a_parameter_used_outside_forward_is_reported(scenario: Scenario) -> None:
    with pytest.raises(reducer.ReductionError, match="marked ready twice"):
        _train(scenario, rank_fn_extra_loss=True, iterations=1)


@given(
    scenarios(model=unshared_with_optional, find_unused=False, max_replicas=1, max_world_size=4),
    st.data(),
)
def test_a_second_iteration_before_the_reduction_finished_is_reported(
    scenario: Scenario, data: st.DataObject
) -> None:
    # Every hook expected (no outputs given), but some rank skips a branch of its own.
    spec = scenario.model
    rank = data.draw(st.integers(0, scenario.world_size - 1))
    skipped = data.draw(st.sampled_from(spec.optional_branches))
    steps = tuple(
        tuple(
            frozenset(spec.optional_branches) - ({skipped} if r == rank else set())
            for r in range(scenario.world_size)
        )
        for _ in scenario.steps
    )
    broken = Scenario(
        scenario.model, scenario.world_size, 1, scenario.buckets, steps, find_unused=False
    )
    with pytest.raises(reducer.ReductionError, match=f"on rank {rank}, these parameters never"):
        _train(broken, rank_fn_extra_loss=False, iterations=2)


@st.composite
def corrupted(draw: st.DrawFn) -> tuple[list[torch.Tensor], list[bool], list[list[int]], str]:
    spec = draw(model_specs())
    model = build_model(spec)
    params = list(model.parameters())
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


@given(corrupted())
def test_invalid_bucket_indices_raise_value_error(
    case: tuple[list[torch.Tensor], list[bool], list[list[int]], str],
) -> None:
    params, sparse, buckets, match = case
    with fakepg.World(1) as world, pytest.raises(reducer.BucketAssignmentError, match=match):
        reducer.Reducer([params], buckets, world.group(0), [sparse])
