"""Hypothesis strategies for data-parallel training scenarios, one per concept.

Each strategy is usable alone and shrinks toward the simplest case (one branch, one rank, one
bucket, everything used), so a failing property reports a minimal counterexample:

- :func:`branch_specs`, :func:`model_specs`: random models (Linear, MLP, LayerNorm, Conv1d,
  Conv2d, Embedding dense or sparse; float32 and float64 mixed; shared layers; optional
  branches, the source of unused parameters), small enough to run in milliseconds.
- :func:`bucket_assignments`: valid bucket partitions of a model's parameters, either from
  ``compute_bucket_assignment_by_size`` with random limits or arbitrary groupings that respect
  dtype, device and sparse-alone, in arbitrary bucket order.
- :func:`world_sizes`, :func:`unused_patterns`: ranks and which branches each rank skips per
  step (none, some ranks, every rank).
- :func:`scenarios`: all of it together, as a :class:`~property_tests.harness.Scenario`.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from torch import Tensor

import reducer

from .harness import Scenario
from .model import BranchSpec, ModelSpec, build_model, sparse_flags

__all__ = [
    "branch_specs",
    "bucket_assignments",
    "model_specs",
    "scenarios",
    "unused_patterns",
    "world_sizes",
]

# Parameters each kind of branch owns (embedding: one table; conv2d has no bias).
_PARAMS = {"linear": 2, "mlp": 3, "layernorm": 4, "conv1d": 2, "conv2d": 1, "embedding": 1}
DTYPES = (torch.float32, torch.float64)


@st.composite
def branch_specs(
    draw: st.DrawFn,
    *,
    kinds: tuple[str, ...] = tuple(_PARAMS),
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    allow_sparse: bool = True,
    optional: bool | None = None,
) -> BranchSpec:
    """One branch. ``optional=None`` draws whether it can be switched off."""
    kind = draw(st.sampled_from(kinds))
    return BranchSpec(
        kind=kind,
        dtype=draw(st.sampled_from(dtypes)),
        width=draw(st.integers(1, 4)),
        out=draw(st.integers(1, 4)),
        sparse=kind == "embedding" and allow_sparse and draw(st.booleans()),
        optional=draw(st.booleans()) if optional is None else optional,
    )


@st.composite
def model_specs(
    draw: st.DrawFn,
    *,
    max_branches: int = 4,
    max_params: int = 8,
    allow_sparse: bool = True,
    allow_unused: bool = True,
    allow_shared: bool = True,
    require_optional: bool = False,
) -> ModelSpec:
    """A model of 1 to ``max_branches`` branches with at most ``max_params`` parameters.

    Branch 0 always runs, so every rank computes some gradient in every step. With
    ``allow_shared``, a later branch may reuse an earlier branch's layers. With
    ``require_optional``, at least one branch can be switched off (one more branch is added
    if needed, even beyond ``max_params``).
    """
    branches = [draw(branch_specs(allow_sparse=allow_sparse, optional=False))]
    params = _PARAMS[branches[0].kind]
    for _ in range(draw(st.integers(0, max_branches - 1))):
        optional = allow_unused and draw(st.booleans())
        owners = [i for i, b in enumerate(branches) if b.shared_with is None]
        if allow_shared and draw(st.integers(0, 3)) == 0:
            owner = draw(st.sampled_from(owners))
            o = branches[owner]
            branches.append(
                BranchSpec(o.kind, o.dtype, o.width, o.out, o.sparse, optional, shared_with=owner)
            )
            continue
        branch = draw(branch_specs(allow_sparse=allow_sparse, optional=optional))
        if params + _PARAMS[branch.kind] > max_params:
            break
        params += _PARAMS[branch.kind]
        branches.append(branch)
    if require_optional and not any(b.optional for b in branches):
        branches.append(draw(branch_specs(allow_sparse=allow_sparse, optional=True)))
    return ModelSpec(tuple(branches), seed=draw(st.integers(0, 2**16)))


@st.composite
def bucket_assignments(
    draw: st.DrawFn, params: list[Tensor], sparse: list[bool]
) -> list[list[int]]:
    """A valid bucket partition of ``params``, in arbitrary bucket and intra-bucket order."""
    if draw(st.booleans()):
        total = sum(p.numel() * p.element_size() for p in params)
        limits = draw(st.lists(st.integers(0, 2 * total + 1), min_size=1, max_size=3))
        buckets = reducer.compute_bucket_assignment_by_size(params, limits, sparse)
    else:
        groups: dict[object, list[int]] = {}
        for i, p in enumerate(params):
            key = ("sparse", i) if sparse[i] else (p.dtype, p.device)
            groups.setdefault(key, []).append(i)
        buckets = []
        for members in groups.values():
            labels = [draw(st.integers(0, len(members) - 1)) for _ in members]
            by_label: dict[int, list[int]] = {}
            for member, label in zip(members, labels, strict=True):
                by_label.setdefault(label, []).append(member)
            buckets += list(by_label.values())
    if draw(st.booleans()):
        buckets = [draw(st.permutations(b)) for b in draw(st.permutations(buckets))]
    return [list(b) for b in buckets]


def world_sizes(max_size: int = 8) -> st.SearchStrategy[int]:
    """1 to ``max_size`` ranks, powers of two and not; shrinks toward 1."""
    return st.integers(1, max_size)


@st.composite
def unused_patterns(
    draw: st.DrawFn, spec: ModelSpec, world_size: int, steps: int, *, synced_all_used: bool
) -> tuple[tuple[frozenset[int], ...], ...]:
    """Per step and rank, the optional branches that run.

    Per step the mode is "none" unused (all run), "some" (each rank picks), or "all" (one
    branch skipped by every rank, the rest picked per rank). ``synced_all_used`` makes the
    last (synced) step run everything, for scenarios that do not search for unused ones.
    """
    optional = spec.optional_branches
    result = []
    for step in range(steps):
        if not optional or (synced_all_used and step == steps - 1):
            result.append(tuple(frozenset(optional) for _ in range(world_size)))
            continue
        mode = draw(st.sampled_from(["none", "some", "all"]))
        if mode == "none":
            result.append(tuple(frozenset(optional) for _ in range(world_size)))
            continue
        skipped_everywhere = draw(st.sampled_from(optional)) if mode == "all" else None
        per_rank = []
        for _ in range(world_size):
            active = {b for b in optional if b != skipped_everywhere and draw(st.booleans())}
            per_rank.append(frozenset(active))
        result.append(tuple(per_rank))
    return tuple(result)


@st.composite
def scenarios(
    draw: st.DrawFn,
    *,
    max_world_size: int = 8,
    max_replicas: int = 3,
    max_local_steps: int = 0,
    min_local_steps: int = 0,
    unused: bool = True,
    find_unused: bool | None = None,
    preset_grads: bool | None = None,
    as_view: bool | None = None,
    model: st.SearchStrategy[ModelSpec] | None = None,
) -> Scenario:
    """A whole scenario. ``None`` for a flag means "draw it"."""
    spec = draw(model if model is not None else model_specs(allow_unused=unused))
    built = build_model(spec)
    params, sparse = list(built.parameters()), sparse_flags(built)
    world_size = draw(world_sizes(max_world_size))
    local_steps = draw(st.integers(min_local_steps, max_local_steps))
    search = draw(st.booleans()) if find_unused is None else find_unused
    steps = draw(
        unused_patterns(spec, world_size, local_steps + 1, synced_all_used=not search)
        if unused
        else st.just(
            tuple(
                tuple(frozenset(spec.optional_branches) for _ in range(world_size))
                for _ in range(local_steps + 1)
            )
        )
    )
    return Scenario(
        model=spec,
        world_size=world_size,
        replicas=draw(st.integers(1, max_replicas)),
        buckets=tuple(tuple(b) for b in draw(bucket_assignments(params, sparse))),
        steps=steps,
        find_unused=search,
        preset_grads=draw(st.booleans()) if preset_grads is None else preset_grads,
        as_view=draw(st.booleans()) if as_view is None else as_view,
    )
