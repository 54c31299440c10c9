"""Hypothesis strategies for data-parallel training scenarios, one per concept.

Each strategy is usable alone and shrinks toward the simplest case (one branch, one rank, one
bucket, everything used), so a failing property reports a minimal counterexample:

- :func:`branch_specs`, :func:`model_specs`: random models (Linear with and without bias,
  MLP, LayerNorm, Conv1d, Conv2d, Embedding dense or sparse, a Linear head stacked on conv
  and embedding layers;
  float32 and float64 mixed; shared layers; optional branches, the source of unused
  parameters; activation checkpointing of branches, reentrant or not, including a layer used
  twice), small enough to run in milliseconds, optionally with a wide layer whose weight
  exceeds the reducer's size thresholds.
- :func:`output_layouts`: outputs nested in lists, tuples, dicts, namedtuples and dataclasses.
- :func:`bucket_assignments`: valid bucket partitions of a model's parameters, either from
  ``compute_bucket_assignment_by_size`` with random limits or arbitrary groupings that respect
  dtype, device and sparse-alone, in arbitrary bucket order.
- :func:`bucketing_inputs`: tensors of any dtype on two devices (CPU and meta), sparse flags
  and size limits, for comparing bucket assignment with torch's.
- :func:`world_sizes`, :func:`unused_patterns`: ranks and which branches each rank skips per
  step (none, some ranks, every rank). :func:`scenarios` draws the ranks as a list instead,
  so that shrinking can drop a rank with everything it ran.
- :func:`scenarios`: all of it together, as a :class:`~reducer.testing.harness.Scenario`: also
  replicas per rank, per-rank inputs (seeded by rank, replica and step), local accumulation
  steps before the synced one, ``prepare_for_backward`` with or without outputs, existing
  gradients, gradients as bucket views, and what training loops do: a static graph, a comm
  hook (in place, returning a new tensor, dividing itself, fp16/bf16 compression), higher-order
  backward (``create_graph=True``, a gradient penalty), a second backward through the same
  graph, a new reducer on the same models after ``close()``, a slow network.

For the wrapper checks (:mod:`reducer.testing.checks`), :func:`training_scenarios` draws a
:class:`~reducer.testing.checks.TrainingScenario` of a user's own model factory and inputs
(world size, steps, unused parts per rank and step, bucket caps and other wrapper options,
ignored parameters, per-rank random streams, uneven inputs), and
:func:`generated_training_scenarios` does it for the random models above (optionally with
buffers, one of them reassigned by forward; non-contiguous parameters; dropout).

The number of synced iterations is drawn by the multi-iteration state machine
(the project's ``property_tests/test_multi_iteration.py``), whose rules are the iterations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from hypothesis import strategies as st
from torch import Tensor, nn

import reducer
from reducer.errors import InvalidArgument, InvalidArgumentType

from . import _arguments
from .checks import TrainingScenario, sum_of_squares
from .harness import BACKWARDS, Scenario, active_branches, twice_refused_everywhere
from .hooks import HOOK_NAMES
from .model import (
    CONTAINERS,
    HEAD_KINDS,
    KINDS,
    BranchSpec,
    ModelSpec,
    OutputLayout,
    branch_inputs,
    build_model,
    loss_of,
    sparse_flags,
    wide_width,
)
from .scenario import SYNC_MODES

__all__ = [
    "GeneratedTraining",
    "WithBuffers",
    "WithDropout",
    "branch_specs",
    "bucket_caps_mb",
    "bucket_assignments",
    "bucketing_inputs",
    "gradient_scales",
    "generated_training_scenarios",
    "model_specs",
    "odd_heavy_world_sizes",
    "output_layouts",
    "scenarios",
    "size_limits",
    "training_scenarios",
    "unused_patterns",
    "world_sizes",
]

DTYPES = (torch.float32, torch.float64)
# Kinds whose first layer reads ``width`` features, so that a wide input makes a large weight.
_WIDE_KINDS = ("proj", "linear", "mlp", "layernorm")
# One wide branch in 16, drawn as a choice that shrinks to "not wide".
_WIDE = st.sampled_from([False] * 15 + [True])
# Strategies built once: building one (and validating it) costs more than drawing from it.
_BOOLEANS = st.booleans()
_FEATURES = st.integers(1, 4)
_SEEDS = st.integers(0, 2**16)
_SHARE = st.integers(0, 3)  # 0: the new branch reuses an earlier branch's layers
_MODES = st.sampled_from(["none", "some", "all"])
# Two branches in three plain; shrinks to "none". Reentrant checkpointing only one in six:
# with the search for unused parameters it is refused, and such a step checks nothing else.
_CHECKPOINTS = st.sampled_from(["none"] * 4 + ["nonreentrant", "reentrant"])
_CHECKPOINTS_NOT_REENTRANT = st.sampled_from(["none"] * 4 + ["nonreentrant"])
# What training loops do, each drawn now and then, each shrinking to the plain choice.
_RARELY = st.sampled_from([False, False, False, True])
_HOOKS = st.sampled_from(["none"] * len(HOOK_NAMES) + list(HOOK_NAMES))
_BACKWARDS = st.sampled_from(["plain", "plain", "create_graph", "penalty"])
_LATENCY_S = 0.01  # longer than the small models' backward: finalize must wait for the data
_LATENCIES = st.sampled_from([0.0] * 7 + [_LATENCY_S])
# Dicts twice as often as each other container: most models that nest return them.
_CONTAINER_CHOICES = (*CONTAINERS, "dict")
_CONTAINERS = st.sampled_from(_CONTAINER_CHOICES)
# At the top, a dict three times in seven: models that nest their outputs mostly return a
# dict-like object (transformers' ModelOutput) at the top. Shrinks to a list.
_TOP_CONTAINERS = st.sampled_from(
    ("list", "dict", "tuple", "dict", "namedtuple", "dataclass", "dict")
)


@st.composite
def branch_specs(
    draw: st.DrawFn,
    *,
    kinds: tuple[str, ...] = KINDS,
    dtypes: tuple[torch.dtype, ...] = DTYPES,
    allow_sparse: bool = True,
    optional: bool | None = None,
    allow_head: bool = True,
    allow_wide: bool = False,
    allow_checkpoint: bool = False,
) -> BranchSpec:
    """One branch. ``optional=None`` draws whether it can be switched off.

    ``allow_head`` may stack a Linear on a conv or embedding layer. ``allow_wide`` rarely makes
    the first layer of a linear, MLP or LayerNorm branch so wide (``model.wide_width``) that
    its weight is large enough for the reducer's size-dependent paths. ``allow_checkpoint``
    runs some branches under activation checkpointing; a reentrant one is never optional
    (whether the reducer must refuse a step then depends on the model alone, not on the rank:
    see ``harness.refusal``) and never an embedding (whose input cannot require grad).
    """
    kind = draw(_sampled(kinds))
    dtype = draw(_sampled(dtypes))
    out = draw(_FEATURES)
    wide = allow_wide and kind in _WIDE_KINDS and draw(_WIDE)
    sparse = kind == "embedding" and allow_sparse and draw(_BOOLEANS)
    is_optional = draw(_BOOLEANS) if optional is None else optional
    mode = "none"
    if allow_checkpoint:
        reentrant_ok = kind != "embedding" and optional is not True
        mode = draw(_CHECKPOINTS if reentrant_ok else _CHECKPOINTS_NOT_REENTRANT)
    return BranchSpec(
        kind=kind,
        dtype=dtype,
        width=wide_width(out) if wide else draw(_FEATURES),
        out=out,
        sparse=sparse,
        optional=is_optional and mode != "reentrant",
        head=allow_head and kind in HEAD_KINDS and draw(_BOOLEANS),
        checkpoint=mode,
    )


@functools.lru_cache(maxsize=64)
def _sampled(values: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    return st.sampled_from(values)


@functools.lru_cache(maxsize=64)
def _branches(
    allow_sparse: bool, optional: bool, allow_head: bool, allow_wide: bool, allow_checkpoint: bool
) -> st.SearchStrategy[BranchSpec]:
    return branch_specs(
        allow_sparse=allow_sparse,
        optional=optional,
        allow_head=allow_head,
        allow_wide=allow_wide,
        allow_checkpoint=allow_checkpoint,
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
    allow_head: bool = True,
    allow_wide: bool = False,
    allow_checkpoint: bool = False,
    sparse_optional: bool = False,
) -> ModelSpec:
    """A model of 1 to ``max_branches`` branches with at most ``max_params`` parameters.

    Branch 0 always runs, so every rank computes some gradient in every step. With
    ``allow_shared``, a later branch may reuse an earlier branch's layers (a layer used twice,
    under a checkpoint of its own with ``allow_checkpoint``). With ``require_optional``, at
    least one branch can be switched off (one more branch is added if needed, even beyond
    ``max_params``). ``allow_head``, ``allow_wide`` and ``allow_checkpoint``: see
    :func:`branch_specs`; the branches that run a reentrant-checkpointed branch's layers are
    all non-optional. With ``sparse_optional`` (and ``allow_sparse``), some optional branch is
    a sparse embedding of its own (one is added if needed): a model whose sparse tables go
    unused in some batches, where a sparse bucket meets the used map. Drawn freely, that
    takes an embedding, sparse, optional and unshared at once, about one model in fifty.
    """

    def branch(optional: bool) -> st.SearchStrategy[BranchSpec]:
        return _branches(allow_sparse, optional, allow_head, allow_wide, allow_checkpoint)

    branches = [draw(branch(False))]
    params = branches[0].parameter_count
    for _ in range(draw(st.integers(0, max_branches - 1))):
        optional = allow_unused and draw(_BOOLEANS)
        owners = [i for i, b in enumerate(branches) if b.shared_with is None]
        if allow_shared and draw(_SHARE) == 0:
            owner = draw(_sampled(tuple(owners)))
            mode = branches[owner].checkpoint
            if allow_checkpoint:
                reentrant_ok = branches[owner].kind != "embedding"
                mode = draw(_CHECKPOINTS if reentrant_ok else _CHECKPOINTS_NOT_REENTRANT)
            shared = replace(branches[owner], optional=optional, shared_with=owner, checkpoint=mode)
            branches.append(shared)
            continue
        new = draw(branch(optional))
        if params + new.parameter_count > max_params:
            break
        params += new.parameter_count
        branches.append(new)
    branches = _reentrant_groups_always_run(branches)
    if require_optional and not any(b.optional for b in branches):
        branches.append(draw(_branches(allow_sparse, True, allow_head, allow_wide, False)))
    shared = {b.shared_with for b in branches}
    if (
        sparse_optional
        and allow_sparse
        and not any(
            b.sparse and b.optional and b.shared_with is None and i not in shared
            for i, b in enumerate(branches)
        )
    ):
        table = draw(branch_specs(kinds=("embedding",), optional=True, allow_head=allow_head))
        branches.append(replace(table, sparse=True))
    return ModelSpec(tuple(branches), seed=draw(_SEEDS))


def _reentrant_groups_always_run(branches: list[BranchSpec]) -> list[BranchSpec]:
    """Make every branch that runs the layers of a reentrant-checkpointed branch non-optional."""

    def owner(b: int) -> int:
        shared = branches[b].shared_with
        return b if shared is None else shared

    reentrant = {owner(b) for b, br in enumerate(branches) if br.checkpoint == "reentrant"}
    return [
        replace(br, optional=False) if br.optional and owner(b) in reentrant else br
        for b, br in enumerate(branches)
    ]


@st.composite
def output_layouts(draw: st.DrawFn, branches: int, *, max_depth: int = 2) -> OutputLayout:
    """How a model returns the outputs of ``branches`` branches: a container (list, tuple,
    dict, namedtuple or dataclass) of branch indices and nested containers, up to
    ``max_depth`` levels below the top, in any order. A nested container is of another kind
    than the one holding it (a dict in a tuple, a list in a dataclass), so that some outputs
    sit in one kind and some in another. Shrinks to a flat list in branch order (a model that
    returns ``[out0, out1, ...]``)."""
    leaves = list(range(branches))
    if draw(_BOOLEANS):
        leaves = draw(st.permutations(leaves))
    return _layout(draw, tuple(leaves), max_depth, draw(_TOP_CONTAINERS))


def _layout(draw: st.DrawFn, leaves: tuple[int, ...], depth: int, kind: str) -> OutputLayout:
    children: list[int | OutputLayout] = []
    rest = list(leaves)
    while rest:
        if depth > 0 and draw(_BOOLEANS):  # a nested container of the next few outputs
            count = draw(st.integers(1, len(rest)))
            inner = draw(_sampled(tuple(k for k in _CONTAINER_CHOICES if k != kind)))
            children.append(_layout(draw, tuple(rest[:count]), depth - 1, inner))
            rest = rest[count:]
        else:
            children.append(rest.pop(0))
    return (kind, tuple(children))


@st.composite
def bucket_assignments(
    draw: st.DrawFn, params: Sequence[Tensor], sparse: Sequence[bool]
) -> list[list[int]]:
    """A valid bucket partition of ``params``, in arbitrary bucket and intra-bucket order.

    Either ``compute_bucket_assignment_by_size`` with random limits (some of them exactly
    where a bucket closes), or any grouping that respects dtype, device and sparse-alone. One
    bucket per dtype and device, in index order, takes the fewest choices, so that failing
    examples shrink toward it.
    """
    if draw(_BOOLEANS):
        limits = draw(size_limits([p.numel() * p.element_size() for p in params]))
        buckets = reducer.compute_bucket_assignment_by_size(params, limits, sparse)
    else:
        groups: dict[object, list[int]] = {}
        for i, p in enumerate(params):
            key = ("sparse", i) if sparse[i] else (p.dtype, p.device)
            groups.setdefault(key, []).append(i)
        buckets = []
        for members in groups.values():
            count = draw(st.integers(1, len(members)))
            if count == 1:
                buckets.append(members)
                continue
            by_label: dict[int, list[int]] = {}
            for member in members:
                by_label.setdefault(draw(st.integers(0, count - 1)), []).append(member)
            buckets += list(by_label.values())
    if draw(_BOOLEANS):
        buckets = [draw(st.permutations(b)) for b in draw(st.permutations(buckets))]
    return [list(b) for b in buckets]


def size_limits(
    sizes: Sequence[int], *, keys: Sequence[object] | None = None
) -> st.SearchStrategy[list[int]]:
    """1 to 4 bucket size limits in bytes for tensors of ``sizes`` bytes: from 0 to about
    twice their total, or exactly a running total of them (where a bucket closes only if the
    comparison is ``>=``, as it must be); with ``keys`` (each tensor's bucket key), also the
    running totals of each key's tensors."""
    total = sum(sizes)
    running = {sum(sizes[: i + 1]) for i in range(len(sizes))} | set(sizes)
    if keys is not None:
        for key in set(keys):
            mine = [size for size, k in zip(sizes, keys, strict=True) if k == key]
            running |= {sum(mine[: i + 1]) for i in range(len(mine))}
    limit = st.integers(0, 2 * total + 1) | st.sampled_from(sorted(running))
    return st.lists(limit, min_size=1, max_size=4)


_BUCKETING_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


_BUCKETING_KEYS = tuple(
    (dtype, device) for dtype in _BUCKETING_DTYPES for device in ("cpu", "meta")
)


@st.composite
def _bucketing_tensor(draw: st.DrawFn, keys: tuple[tuple[torch.dtype, str], ...]) -> Tensor:
    numel = draw(st.integers(1, 2048))
    rows = draw(st.sampled_from([1, *(r for r in (2, 3, 4) if numel % r == 0)]))
    shape = (numel,) if rows == 1 else (rows, numel // rows)
    dtype, device = draw(_sampled(keys))
    return torch.empty(shape, dtype=dtype, device=device)


@st.composite
def bucketing_inputs(
    draw: st.DrawFn, *, max_tensors: int = 12
) -> tuple[list[Tensor], list[int], list[bool] | None]:
    """Inputs of ``compute_bucket_assignment_by_size``: tensors, limits, sparse flags.

    Tensors of 1 to 2048 elements in four dtypes, on the CPU or the meta device (so that the
    (dtype, device) keys of buckets vary; meta tensors cost nothing), shaped flat or 2-D. The
    tensors share 1 to 3 keys, drawn first, so that buckets of several keys fill up side by
    side (each key moves on to the next limit by itself). The limits include each key's
    running totals, where its buckets close exactly. The sparse flags are absent (None) or one
    per tensor, drawn with it (so that shrinking drops a tensor with its flag).
    """
    keys = tuple(draw(st.permutations(_BUCKETING_KEYS))[: draw(st.integers(1, 3))])
    flagged = draw(st.booleans())
    entry = st.tuples(_bucketing_tensor(keys), st.booleans() if flagged else st.just(False))
    entries = draw(st.lists(entry, min_size=1, max_size=max_tensors))
    tensors = [t for t, _ in entries]
    sizes = [t.numel() * t.element_size() for t in tensors]
    limits = draw(size_limits(sizes, keys=[(t.dtype, t.device) for t in tensors]))
    return tensors, limits, [f for _, f in entries] if flagged else None


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
        mode = draw(_MODES)
        if mode == "none":
            result.append(tuple(frozenset(optional) for _ in range(world_size)))
            continue
        skipped_everywhere = draw(_sampled(tuple(optional))) if mode == "all" else None
        per_rank = []
        for _ in range(world_size):
            active = {b for b in optional if b != skipped_everywhere and draw(_BOOLEANS)}
            per_rank.append(frozenset(active))
        result.append(tuple(per_rank))
    return tuple(result)


@st.composite
def _rank_patterns(
    draw: st.DrawFn,
    spec: ModelSpec,
    steps: int,
    *,
    synced_all_used: bool,
    unused: bool,
    max_world_size: int,
) -> tuple[tuple[frozenset[int], ...], ...]:
    """Like :func:`unused_patterns`, but the number of ranks (1 to ``max_world_size``) is
    drawn here, as a list of ranks: shrinking then deletes a rank together with what it ran,
    which a world size drawn first cannot do."""
    optional = spec.optional_branches
    # Per step: None (every branch runs), or the branch every rank skips, or -1 (none is).
    plans: list[int | None] = []
    for step in range(steps):
        if not unused or not optional or (synced_all_used and step == steps - 1):
            plans.append(None)
            continue
        mode = draw(_MODES)
        if mode == "none":
            plans.append(None)
        else:
            plans.append(draw(_sampled(tuple(optional))) if mode == "all" else -1)

    per_rank = _one_rank(tuple(optional), tuple(plans))
    ranks = draw(st.lists(per_rank, min_size=1, max_size=max_world_size))
    return tuple(tuple(rank[step] for rank in ranks) for step in range(steps))


@st.composite
def _one_rank(
    draw: st.DrawFn, optional: tuple[int, ...], plans: tuple[int | None, ...]
) -> tuple[frozenset[int], ...]:
    """One rank's optional branches per step, under each step's plan (see _rank_patterns)."""
    return tuple(
        frozenset(optional)
        if plan is None
        else frozenset(b for b in optional if b != plan and draw(_BOOLEANS))
        for plan in plans
    )


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
    preset_sparse: bool | None = None,
    static_graph: bool | None = None,
    hook: str | None = None,
    backward: str | None = None,
    twice: bool | None = None,
    rebuild: bool | None = None,
    latency: float | None = None,
) -> Scenario:
    """A whole scenario. ``None`` for a flag means "draw it".

    ``unused=False`` runs every branch in every step; ``find_unused`` passes the outputs to
    ``prepare_for_backward``; ``min_local_steps``/``max_local_steps`` bound the local
    (no-sync) backward passes before the synced one. The default model strategy checkpoints
    some branches.

    What the training loop does is drawn now and then where the scenario allows it, each
    shrinking to the plain choice: ``static_graph``; a comm ``hook`` (one replica, dense
    gradients only: hooks take one replica per process); the ``backward`` mode (see
    ``harness.BACKWARDS``; dense gradients only, and the gradient penalty not through a
    reentrant checkpoint, which does not support ``torch.autograd.grad``); ``twice`` (not with
    ``static_graph``, whose first iteration takes every gradient at the end of the first
    backward, nor with reentrant checkpoints; only where the first backward leaves the step
    unfinished on every rank: see ``harness.refusal``); ``rebuild``; ``latency`` (seconds). A
    value given where the scenario does not allow it raises ValueError.
    """
    spec = draw(
        model if model is not None else model_specs(allow_unused=unused, allow_checkpoint=True)
    )
    params, sparse = _parameters_of(spec)
    local_steps = draw(st.integers(min_local_steps, max_local_steps))
    search = draw(_BOOLEANS) if find_unused is None else find_unused
    steps = draw(
        _rank_patterns(
            spec,
            local_steps + 1,
            synced_all_used=not search,
            unused=unused,
            max_world_size=max_world_size,
        )
    )
    world_size = len(steps[0])
    replicas = draw(st.integers(1, max_replicas))
    static = _allowed(draw, "static_graph", static_graph, _RARELY, False)
    dense = not spec.has_sparse
    modes = [m for m in BACKWARDS if m == "plain" or dense]
    if spec.has_reentrant and "penalty" in modes:
        modes.remove("penalty")
    return Scenario(
        model=spec,
        world_size=world_size,
        replicas=replicas,
        buckets=tuple(tuple(b) for b in draw(bucket_assignments(params, sparse))),
        steps=steps,
        find_unused=search,
        preset_grads=draw(_BOOLEANS) if preset_grads is None else preset_grads,
        as_view=draw(_BOOLEANS) if as_view is None else as_view,
        preset_sparse=draw(_BOOLEANS) if preset_sparse is None else preset_sparse,
        static_graph=static,
        hook=_allowed(draw, "hook", hook, _HOOKS, "none", replicas == 1 and dense),
        backward=_allowed(draw, "backward", backward, _BACKWARDS, "plain", values=modes),
        twice=_allowed(
            draw,
            "twice",
            twice,
            _RARELY,
            False,
            not static and not spec.has_reentrant and twice_refused_everywhere(spec, steps),
        ),
        rebuild=draw(_RARELY) if rebuild is None else rebuild,
        latency=draw(_LATENCIES) if latency is None else latency,
    )


def _allowed(
    draw: st.DrawFn,
    name: str,
    given: Any,
    strategy: st.SearchStrategy[Any],
    plain: Any,
    allowed: bool = True,
    *,
    values: Sequence[Any] | None = None,
) -> Any:
    """``given`` if not None (ValueError if the scenario does not allow it), else drawn from
    ``strategy`` where allowed (a drawn value outside ``values`` becomes ``plain``), else
    ``plain``."""

    def permitted(value: Any) -> bool:
        return bool(value == plain or (allowed and (values is None or value in values)))

    if given is not None:
        if not permitted(given):
            raise ValueError(f"scenarios: {name}={given!r} is not possible for this scenario")
        return given
    if not allowed:
        return plain
    value = draw(strategy)
    return value if permitted(value) else plain


def _parameters_of(spec: ModelSpec) -> tuple[list[Tensor], list[bool]]:
    """The parameters of the model ``spec`` describes and their sparse flags."""
    params, sparse = _cached_parameters(spec)
    return list(params), list(sparse)


# Generation only reads the parameters' sizes and dtypes, and Hypothesis redraws the same spec
# often while it shrinks: build each model once. A few entries, since wide models are large.
@functools.lru_cache(maxsize=16)
def _cached_parameters(spec: ModelSpec) -> tuple[tuple[Tensor, ...], tuple[bool, ...]]:
    model = build_model(spec)
    return tuple(model.parameters()), tuple(sparse_flags(model))


# -------------------------------------------------------------------------------------------
# Training scenarios for any wrapper (reducer.testing.checks).

InputsFactory = Callable[[torch.Generator, frozenset[int]], tuple[Any, ...]]


@st.composite
def training_scenarios(
    draw: st.DrawFn,
    make_model: Callable[[], nn.Module],
    make_inputs: InputsFactory,
    *,
    world_sizes: st.SearchStrategy[int] | None = None,
    steps: st.SearchStrategy[int] | None = None,
    optional_parts: int = 0,
    bucket_caps: st.SearchStrategy[float] | None = None,
    options: Mapping[str, Any] | None = None,
    drawn_options: Mapping[str, st.SearchStrategy[Any]] | None = None,
    loss: Callable[[Any], Tensor] | None = None,
    lr: float = 0.1,
    ignore: bool = False,
    rank_seeds: bool = False,
    uneven: bool = False,
    reload: bool = False,
    uniform_skip: bool = False,
    micro_batches: int = 1,
    sync_modes: Sequence[str] = ("no_sync", "require_backward_grad_sync"),
    sync_last_only: bool = False,
    loss_scales: st.SearchStrategy[float] | None = None,
    set_to_none: bool | None = True,
) -> TrainingScenario:
    """A :class:`~reducer.testing.checks.TrainingScenario` of a user's model.

    ``make_model()`` builds the model (the same parameters every call).
    ``make_inputs(generator, skip)`` returns one rank's forward arguments for one step, drawn
    from ``generator`` (seeded by Hypothesis, and by rank and step); ``skip`` is the set of the
    model's optional parts (``0 .. optional_parts - 1``) that this rank leaves out in this
    step, each part with probability 1/2, for the model's forward to act on (an
    unused-parameter pattern: none, some ranks, every rank). ``world_sizes`` (default 1 to 4
    ranks, three half the time: :func:`odd_heavy_world_sizes`) and ``steps`` (default 1 to
    3) are drawn; ``bucket_caps``, if given, draws the
    wrapper's ``bucket_cap_mb``; ``options`` are the wrapper's other keyword arguments, and
    ``drawn_options`` draws more of them (e.g. ``{"gradient_as_bucket_view": st.booleans()}``).
    With ``ignore``, some of the model's parameters and buffers (by name) are drawn for the
    wrapper to ignore. With
    ``rank_seeds``, each rank seeds its own random stream (for dropout) with a seed drawn
    here. With ``uneven``, each rank runs out of inputs after its own number of steps (the
    wrapper's ``join()``). With ``reload`` (not with ``uneven``), a step before the last may be
    drawn after which every rank pickles and reloads its wrapper (``reload_after``). With
    ``uniform_skip``, the optional parts left out are drawn once: the same on every rank at
    every step (what ``skip_all_reduce_unused_params`` requires).
    With ``micro_batches`` > 1, each step runs 1 to that many micro-batches (gradient
    accumulation), each synced or not (one of ``sync_modes``: how the step tells the wrapper,
    or "by_hand": see ``scenario.SYNC_MODES``), each with its own inputs and optional parts
    left out: any pattern (several synced micro-batches in a step, a step ending unsynced),
    or with ``sync_last_only`` the usual accumulation (only the last micro-batch synced).
    One corner is never drawn (see :func:`_carried_parts`): with ``set_to_none``, a rank
    that used a part in a step's trailing ``no_sync``/``require_backward_grad_sync``
    micro-batches always uses it again before the next synced one. ``loss_scales`` draws,
    per rank and step, a factor of that rank's loss (e.g. :func:`gradient_scales`:
    magnitudes, zeros, denormals, sums past float16's range). ``set_to_none``: how
    ``zero_grad`` clears the gradients (None: drawn).
    Shrinks toward one rank, one step, one synced micro-batch, scale 1, nothing skipped,
    nothing ignored, no reload.
    """
    _check_training_arguments(
        make_model, make_inputs, world_sizes, steps, optional_parts, bucket_caps, loss_scales,
        micro_batches, sync_modes,
    )  # fmt: skip
    world_size = _arguments.drawn_count(
        draw(world_sizes if world_sizes is not None else _ranks(4)),
        "training_scenarios: world_sizes",
        what="a number of ranks",
        example="st.integers(1, 4)",
    )
    count = _arguments.drawn_count(
        draw(steps if steps is not None else st.integers(1, 3)),
        "training_scenarios: steps",
        what="a number of steps",
        example="st.integers(1, 3)",
    )
    parts = tuple(range(optional_parts))
    lengths = [draw(st.integers(1, count)) if uneven else count for _ in range(world_size)]
    count = max(lengths)
    inputs: list[tuple[tuple[Any, ...] | None, ...]] = []
    uniform = frozenset(p for p in parts if draw(_BOOLEANS)) if uniform_skip else None
    modes: list[tuple[str, ...]] = []
    unsynced = _sampled(("sync", *sync_modes))
    clear_to_none = draw(_BOOLEANS) if set_to_none is None else set_to_none
    # Per rank, the parts used in hooked unsynced micro-batches since the last synced one.
    carried: list[frozenset[int]] = [frozenset()] * world_size
    for step in range(count):
        micro = draw(st.integers(1, micro_batches)) if micro_batches > 1 else 1
        if micro_batches == 1:
            modes.append(())
        elif sync_last_only:  # accumulate, then sync: every micro-batch but the last unsynced
            modes.append((*(draw(_sampled(tuple(sync_modes))) for _ in range(micro - 1)), "sync"))
        else:
            modes.append(tuple(draw(unsynced) for _ in range(micro)))
        per_rank: list[tuple[Any, ...] | None] = []
        for rank in range(world_size):
            if step >= lengths[rank]:
                per_rank.append(None)  # this rank has run out
                continue
            batches = []
            skips: list[frozenset[int]] = []
            for m in range(micro):
                # Seeded by rank, step and micro-batch too: ranks see different data even
                # where every drawn seed shrinks to 0 (identical inputs would hide a wrong
                # average).
                seed = (draw(_SEEDS) * 1_000_003 + rank * 1009 + step * 31 + m) % (2**63)
                if uniform is not None:
                    skip = uniform
                else:
                    skip = frozenset(p for p in parts if draw(_BOOLEANS)) if parts else frozenset()
                    if clear_to_none and modes[-1] and m == _first_sync(modes[-1]):
                        skip -= _carried_parts(carried[rank], skips, parts)
                skips.append(skip)
                made = make_inputs(torch.Generator().manual_seed(seed), skip)
                _arguments.forward_arguments(made, "training_scenarios: what make_inputs returned")
                batches.append(tuple(made))
            if modes[-1]:
                carried[rank] = _after_step(carried[rank], modes[-1], skips, parts)
            per_rank.append(tuple(batches) if micro_batches > 1 else batches[0])
        inputs.append(tuple(per_rank))
    scales = None
    if loss_scales is not None:
        drawn = "training_scenarios: a scale drawn from loss_scales"
        scales = tuple(
            tuple(_arguments.finite_scale(draw(loss_scales), drawn) for _ in range(world_size))
            for _ in range(count)
        )
    chosen = dict(options or {})
    if bucket_caps is not None:
        chosen["bucket_cap_mb"] = draw(bucket_caps)
    for name, values in (drawn_options or {}).items():
        chosen[name] = draw(values)
    ignored: frozenset[str] = frozenset()
    if ignore:
        model = make_model()
        params = [n for n, _ in model.named_parameters()]
        names = params + [n for n, _ in model.named_buffers()]
        # Never every parameter: a wrapper with nothing to reduce is refused (torch's too).
        ignored = frozenset(n for n in names if draw(_RARELY)) - {params[0]}
    seeds = None
    if rank_seeds:
        # Distinct per rank even where the drawn seed shrinks to 0.
        base = draw(_SEEDS)
        seeds = tuple(base * 7919 + 1000 + rank for rank in range(world_size))
    reload_after = None
    if reload and not uneven and count >= 2:
        reload_after = draw(st.none() | st.integers(0, count - 2))
    return TrainingScenario(
        make_model,
        tuple(inputs),
        loss=loss if loss is not None else sum_of_squares,
        options=chosen,
        lr=lr,
        ignored=ignored,
        rank_seeds=seeds,
        reload_after=reload_after,
        micro_batches=tuple(modes) if micro_batches > 1 else None,
        loss_scales=scales,
        set_to_none=clear_to_none,
    )


def _check_training_arguments(
    make_model: object,
    make_inputs: object,
    world_sizes: object,
    steps: object,
    optional_parts: object,
    bucket_caps: object,
    loss_scales: object,
    micro_batches: object,
    sync_modes: Sequence[str],
) -> None:
    """:func:`training_scenarios`' arguments, at its first draw (before any rank starts)."""
    owner = "training_scenarios"
    for name, value, signature in (
        ("make_model", make_model, "make_model() -> nn.Module"),
        ("make_inputs", make_inputs, "make_inputs(generator, skip) -> tuple of forward arguments"),
    ):
        if not callable(value) or isinstance(value, nn.Module):
            raise InvalidArgumentType(
                f"{owner}: {name} is {_arguments.describe(value)}; expected a function {signature}"
            )
    for name, value, example in (
        ("world_sizes", world_sizes, "st.integers(1, 4)"),
        ("steps", steps, "st.integers(1, 3)"),
        ("bucket_caps", bucket_caps, "bucket_caps_mb()"),
        ("loss_scales", loss_scales, "gradient_scales()"),
    ):
        _arguments.strategy(value, owner, name, example)
    _arguments.count(optional_parts, f"{owner}: optional_parts", minimum=0)
    _arguments.count(micro_batches, f"{owner}: micro_batches", minimum=1)
    allowed = SYNC_MODES[1:]
    if isinstance(sync_modes, str) or any(m not in allowed for m in sync_modes):
        raise InvalidArgument(
            f"{owner}: sync_modes is {sync_modes!r}; expected a sequence of the ways an "
            f"unsynced micro-batch is told not to reduce: {', '.join(allowed)}"
        )


# Micro-batch modes that run backward through the wrapper's hooks without a reduction: DDP
# marks what they use as locally used until the next synced backward.
_HOOKED_UNSYNCED = ("no_sync", "require_backward_grad_sync")


def _first_sync(modes: tuple[str, ...]) -> int:
    return modes.index("sync") if "sync" in modes else -1


def _carried_parts(
    carried: frozenset[int], skips: Sequence[frozenset[int]], parts: tuple[int, ...]
) -> frozenset[int]:
    """The parts a rank must use in a step's first synced micro-batch: those it used in
    hooked unsynced micro-batches of earlier steps since the last sync (``carried``) and not
    yet in this step (``skips``: what it left out of this step's micro-batches so far).

    The corner left out: after ``zero_grad(set_to_none=True)``, a parameter used only in an
    earlier step's trailing unsynced micro-batches has no ``.grad`` on that rank, yet DDP's
    used map still holds it: torch's DDP fails an internal check, and this project's reduces
    zeros where the reference keeps no gradient (both pinned in
    ``property_tests/test_training_steps.py``)."""
    used_now = frozenset(p for p in parts if any(p not in skip for skip in skips))
    return carried - used_now


def _after_step(
    carried: frozenset[int],
    modes: tuple[str, ...],
    skips: Sequence[frozenset[int]],
    parts: tuple[int, ...],
) -> frozenset[int]:
    """``carried`` after a step: the parts used in its hooked unsynced micro-batches after
    its last synced one (added to the old ones where it has none)."""
    last = len(modes) - 1 - modes[::-1].index("sync") if "sync" in modes else -1
    tail = [
        skip
        for k, (mode, skip) in enumerate(zip(modes, skips, strict=True))
        if k > last and mode in _HOOKED_UNSYNCED
    ]
    used = frozenset(p for p in parts for skip in tail if p not in skip)
    return used if last >= 0 else carried | used


def odd_heavy_world_sizes(max_size: int = 4) -> st.SearchStrategy[int]:
    """1 to ``max_size`` ranks (at least 3), three ranks half the time: ``g / 3`` and
    ``g * (1 / 3)`` round differently, as do a division before and after a cast, where any
    power of two divides exactly (most of the time). Shrinks toward 1, then 2, then 3
    ranks. The training scenarios' default: with 1 to 4 ranks drawn evenly, the ci profile's
    25 examples (which start from the simplest) could miss three ranks altogether."""
    if max_size < 3:
        raise ValueError(f"odd_heavy_world_sizes: max_size must be at least 3, got {max_size}")
    return st.sampled_from([1, 2, *[3] * 4, *range(4, max_size + 1)])


def _ranks(max_size: int) -> st.SearchStrategy[int]:
    """The training scenarios' world sizes: three ranks often, where there can be three."""
    return odd_heavy_world_sizes(max_size) if max_size >= 3 else st.integers(1, max_size)


# Powers of two, so that each scales a rank's gradients exactly (until they leave the
# dtype's range): 1 most often (shrinks to it), 0 (a rank contributing zeros), 2^-130 (float32
# gradients of order 1 become denormals), 2^14 (float16 sums of two ranks' gradients of a few
# units pass 65504, while each share stays within it).
_GRADIENT_SCALES = (1.0, 1.0, 1.0, 0.0, 2.0**-130, 2.0**14)


def gradient_scales(
    scales: Sequence[float] = _GRADIENT_SCALES,
) -> st.SearchStrategy[float]:
    """Factors of a rank's loss in a step (``training_scenarios(loss_scales=...)``): the
    gradients' magnitudes and special values, per rank and step. The default mixes 1, 0,
    2^-130 (denormals) and 2^14 (float16 sums that overflow); give your own to suit your
    model's gradients and the dtype your hook compresses to."""
    return st.sampled_from(_arguments.scales(scales, "gradient_scales: scales"))


def bucket_caps_mb() -> st.SearchStrategy[float]:
    """``bucket_cap_mb`` values from one parameter per bucket to one bucket for all."""
    return st.sampled_from([25.0, 1e-5, 1e-4, 3e-4])


class WithBuffers(nn.Module):
    """A model's outputs scaled by a buffer that forward then *reassigns* (a new tensor under
    the same name, from this rank's data), beside a buffer it updates in place (a step
    count): the gradients depend on the buffers each rank starts its forward with."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("scale", torch.ones((), dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.int64))

    def forward(self, *args: Any) -> Any:
        outputs = self.inner(*args)
        scale = self.get_buffer("scale")
        scaled = [out * scale.to(out.dtype) for out in outputs]
        drift = torch.stack([out.detach().double().mean() for out in outputs]).sum()
        self.scale = 0.5 * scale + 0.25 * drift
        self.get_buffer("count").add_(1)
        return scaled


def _non_contiguous(model: nn.Module) -> None:
    """Lay out every 4-d parameter channels_last and every matrix column-major (a transposed
    weight): non-contiguous, yet dense, as real models have them."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 4:
                p.data = p.data.contiguous(memory_format=torch.channels_last)
            elif p.dim() == 2:
                p.data = p.data.t().contiguous().t()


class WithDropout(nn.Module):
    """A model's outputs through dropout (p = 1/2): random numbers drawn on the rank thread,
    from the rank's own stream."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        return [torch.nn.functional.dropout(out, 0.5, training=True) for out in self.inner(*args)]


@dataclass(frozen=True)
class GeneratedTraining:
    """A :class:`ModelSpec` model as a user's model: ``make_model()`` builds it (with
    ``layouts``, its matrices column-major and 4-d weights channels_last; its outputs through
    :class:`WithDropout` with ``dropout``; inside :class:`WithBuffers` with ``buffers``), and
    forward takes ``(inputs, active)`` (see ``model.GeneratedModel``)."""

    spec: ModelSpec
    buffers: bool = False
    layouts: bool = False
    dropout: bool = False

    def make_model(self) -> nn.Module:
        model: nn.Module = build_model(self.spec)
        if self.layouts:
            _non_contiguous(model)
        if self.dropout:
            model = WithDropout(model)
        return WithBuffers(model) if self.buffers else model

    def make_inputs(self, generator: torch.Generator, skip: frozenset[int]) -> tuple[Any, ...]:
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=generator))
        optional = self.spec.optional_branches
        active = active_branches(
            self.spec, frozenset(b for k, b in enumerate(optional) if k not in skip)
        )
        return (branch_inputs(self.spec, seed), active)


@st.composite
def generated_training_scenarios(
    draw: st.DrawFn,
    *,
    model: st.SearchStrategy[ModelSpec] | None = None,
    max_world_size: int = 4,
    world_sizes: st.SearchStrategy[int] | None = None,
    min_steps: int = 1,
    max_steps: int = 3,
    bucket_caps: st.SearchStrategy[float] | None = None,
    options: Mapping[str, Any] | None = None,
    drawn_options: Mapping[str, st.SearchStrategy[Any]] | None = None,
    lr: float = 0.1,
    buffers: bool | None = False,
    layouts: bool | None = False,
    ignore: bool = False,
    dropout: bool | None = False,
    uneven: bool = False,
    reload: bool = False,
    uniform_skip: bool = False,
    micro_batches: int = 1,
    sync_modes: Sequence[str] = ("no_sync", "require_backward_grad_sync"),
    sync_last_only: bool = False,
    loss_scales: st.SearchStrategy[float] | None = None,
    set_to_none: bool | None = True,
) -> TrainingScenario:
    """:func:`training_scenarios` of random models (:func:`model_specs`, dense, no
    reentrant checkpoints by default), their optional branches the optional parts; with
    ``buffers`` inside :class:`WithBuffers`, with ``layouts`` non-contiguous (see
    :class:`GeneratedTraining`; None: each drawn); ``ignore``: see
    :func:`training_scenarios`; ``dropout`` (None: drawn): through :class:`WithDropout`, each
    rank seeding its own stream; ``uneven``, ``reload``, ``uniform_skip``, ``micro_batches``,
    ``sync_modes``, ``sync_last_only``, ``loss_scales``, ``set_to_none``: see
    :func:`training_scenarios`. ``world_sizes`` draws the number of ranks (default: 1 to
    ``max_world_size``, three half the time: :func:`odd_heavy_world_sizes`)."""
    _arguments.strategy(model, "generated_training_scenarios", "model", "model_specs()")
    _arguments.count(max_world_size, "generated_training_scenarios: max_world_size", minimum=1)
    _arguments.count(min_steps, "generated_training_scenarios: min_steps", minimum=1)
    _arguments.count(max_steps, "generated_training_scenarios: max_steps", minimum=min_steps)
    spec = draw(model if model is not None else model_specs(allow_sparse=False))
    generated = GeneratedTraining(
        spec,
        draw(_BOOLEANS) if buffers is None else buffers,
        draw(_BOOLEANS) if layouts is None else layouts,
        draw(_BOOLEANS) if dropout is None else dropout,
    )
    return draw(
        training_scenarios(
            generated.make_model,
            generated.make_inputs,
            world_sizes=world_sizes if world_sizes is not None else _ranks(max_world_size),
            steps=st.integers(min_steps, max_steps),
            optional_parts=len(spec.optional_branches),
            bucket_caps=bucket_caps,
            options=options,
            drawn_options=drawn_options,
            loss=loss_of,
            lr=lr,
            ignore=ignore,
            rank_seeds=generated.dropout,
            uneven=uneven,
            reload=reload,
            uniform_skip=uniform_skip,
            micro_batches=micro_batches,
            sync_modes=sync_modes,
            sync_last_only=sync_last_only,
            loss_scales=loss_scales,
            set_to_none=set_to_none,
        )
    )
