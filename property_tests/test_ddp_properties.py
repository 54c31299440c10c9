"""Property 5: reducer.DistributedDataParallel averages exactly, whatever its options.

Hypothesis draws a model (some branches under activation checkpointing, reentrant or not, a
layer used twice), a world size, the wrapper's options (``find_unused_parameters`` and/or
``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb`` from one parameter per bucket
to one bucket for all, a comm hook or none: see ``property_tests.hooks``), how the model
returns its outputs (any nesting of lists, tuples, dicts, namedtuples and dataclasses), how
the loop differentiates (plain, ``create_graph=True``, a gradient penalty) and a few
iterations, each a window of ``no_sync`` backward passes (or the ``require_backward_grad_sync``
toggle) and one synced one, with per-rank unused branches, and heads whose output is returned
but left out of the loss (their parameters count as unused, not as used with zeros). Beside
the ranks, one plain *mirror* model per rank runs the same passes; at each synced step its
gradients become the exact average of the mirrors' own gradients (the rank-order average with
torch's rounding, ``g * (1.0 / W)``, or ``g / W`` where torch divides: see ``_scalings``; or
what the comm hook computes). The ranks must hold exactly the mirrors' gradients, bit for bit,
after every pass: local ones inside a window, averaged ones after the synced pass, and
``.grad`` untouched for a parameter no rank used since the last synced pass.

Where the reducer must refuse (``harness.model_refusal``: reentrant checkpointing while
searching for unused parameters, a layer in two backward passes without ``static_graph``, or
a second backward through the same graph), every rank must raise the documented error at the
first synced pass instead. After ``close()`` no parameter may carry a hook of the reducer.

The buckets are rebuilt after the first iteration (unless searching for unused parameters), so
later iterations check the rebuilt layout too.

Not drawn, with the reason: a second backward with ``find_unused_parameters`` or
``static_graph`` (the wrapper's output sink counts the outputs the first backward does not
reach as unused, so the first backward ends the iteration and the second accumulates
locally, as after no_sync); a gradient penalty with ``static_graph`` (``torch.autograd.grad``
runs through the output sink, whose first-iteration reduction then ends before the real
backward starts); sparse gradients (comm hooks and higher-order backward take dense ones;
the Reducer properties cover sparse buckets).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import fakepg
import reducer
from reducer.testing.harness import (
    Refusal,
    active_branches,
    assert_refused,
    backward,
    hook_count,
    hooks_left,
    model_refusal,
    note_size,
    snapshot,
    sync_intra_op_threads,
)
from reducer.testing.hooks import AVERAGES, HOOK_NAMES, HOOKS, state_for
from reducer.testing.model import (
    LARGE_NUMEL,
    BranchSpec,
    GeneratedModel,
    ModelSpec,
    OutputLayout,
    branch_inputs,
    build_model,
    loss_of,
    unpack,
)
from reducer.testing.reference import Scaling, rank_order_average
from reducer.testing.strategies import (
    model_specs,
    odd_heavy_world_sizes,
    output_layouts,
    unused_patterns,
    world_sizes,
)

Pattern = tuple[frozenset[int], ...]  # per rank: the optional branches that run


@dataclass(frozen=True, slots=True)
class DDPScenario:
    """Iterations of local passes then one synced pass; ``windows[k][p]`` is pass ``p`` of
    iteration ``k`` (the last one synced), a per-rank pattern of the optional branches that
    run; ``dropped[k][p]`` per rank, those of them whose output the loss leaves out."""

    model: ModelSpec
    world_size: int
    find_unused: bool
    static_graph: bool
    as_view: bool
    bucket_cap_mb: float
    hook: str
    toggle_attribute: bool  # require_backward_grad_sync = ... instead of no_sync()
    zero_grad: tuple[str, ...]  # per iteration: "keep", "none" or "zero" before it
    windows: tuple[tuple[Pattern, ...], ...]
    dropped: tuple[tuple[Pattern, ...], ...]
    layout: OutputLayout | None = None  # how forward nests its outputs (None: a list)
    backward: str = "plain"  # see harness.BACKWARDS
    twice: bool = False  # a first backward of branch 0 before each synced one
    # skip_all_reduce_unused_params; drawn only with the synced passes' patterns the same on
    # every rank (the option's condition), the local passes' free.
    skip_unused: bool = False

    def kept(self, packed: object, active: frozenset[int], dropped: frozenset[int]) -> Tensor:
        """The loss over the outputs of ``active`` branches (in index order) not dropped."""
        outputs = self.outputs(packed, active)
        return loss_of([outputs[b] for b in sorted(active) if b not in dropped])

    def outputs(self, packed: object, active: frozenset[int]) -> dict[int, Tensor]:
        """Branch index -> output, from what forward returned."""
        if self.layout is None:
            assert isinstance(packed, list)
            return dict(zip(sorted(active), packed, strict=True))
        return unpack(self.layout, packed, active)

    @property
    def refusal(self) -> Refusal | None:
        """What the first synced pass must raise instead of averaging, if anything."""
        return model_refusal(
            self.model,
            find_unused=self.find_unused and not self.static_graph,  # the wrapper's search
            static_graph=self.static_graph,
            twice=self.twice,
        )

    def inputs(self, rank: int, iteration: int, micro: int) -> list[Tensor]:
        seed = (self.model.seed * 7919 + iteration * 104729 + micro * 1009 + rank) % (2**31)
        return branch_inputs(self.model, seed)


# The search for unused parameters twice as often: most of what the wrapper adds is there.
_WRAPPER_MODES = st.sampled_from(["plain", "find_unused", "static_graph", "both", "find_unused"])
_DDP_HOOKS = st.sampled_from(["none"] * len(HOOK_NAMES) + list(HOOK_NAMES))
_DDP_BACKWARDS = st.sampled_from(["plain", "plain", "create_graph", "penalty"])
_RARELY = st.sampled_from([False, False, False, True])
_MOSTLY = st.sampled_from([False, True, True, True])  # real models nest their outputs


@st.composite
def ddp_scenarios(
    draw: st.DrawFn,
    *,
    model: st.SearchStrategy[ModelSpec] | None = None,
    max_world_size: int = 4,
    mode: str | None = None,
    min_iterations: int = 2,
    as_view: bool | None = None,
    hook: str | None = None,
    nested: bool | None = None,
    skip_unused: bool | None = None,
) -> DDPScenario:
    """A DDP scenario. ``mode`` is "plain", "find_unused", "static_graph" or "both"; it and
    the other flags are drawn where None (a narrower search for a known bug fixes some).
    With ``skip_unused`` (half the time where drawn), ``skip_all_reduce_unused_params`` is
    on and each synced pass runs, and leaves out of the loss, the same branches on every
    rank; the ``no_sync`` passes before it still differ per rank (gradients accumulated in
    a part the synced pass leaves unused everywhere must not be lost)."""
    optional = draw(st.integers(0, 3)) > 0  # mostly models with branches that can go unused
    spec = draw(
        model
        if model is not None
        else model_specs(
            max_branches=3,
            max_params=6,
            allow_sparse=False,
            require_optional=optional,
            allow_checkpoint=True,
            allow_wide=True,  # a weight of 2**16 elements or more: the division fused in
        )
    )
    # Three ranks often: torch's rounding differs from a division only there.
    world_size = draw(
        odd_heavy_world_sizes(max_world_size)
        if max_world_size >= 3
        else world_sizes(max_world_size)
    )
    skip = draw(st.booleans()) if skip_unused is None else skip_unused
    mode = draw(_WRAPPER_MODES) if mode is None else mode
    static_graph = mode in ("static_graph", "both")
    find_unused = mode in ("find_unused", "both")
    iterations = draw(st.integers(min_iterations, max(3, min_iterations)))

    def drop(pattern: Pattern, allowed: bool) -> Pattern:
        """Per rank, active optional branches left out of the loss: none, each rank's own
        pick, or one branch left out wherever it runs (so possibly on every rank)."""
        mode = draw(st.sampled_from(["none", "some", "all"])) if allowed else "none"
        if mode == "none" or not spec.optional_branches:
            return tuple(frozenset() for _ in pattern)
        if mode == "all":
            branch = draw(st.sampled_from(spec.optional_branches))
            return tuple(frozenset({branch} & active) for active in pattern)
        return tuple(
            frozenset(b for b in sorted(active) if draw(st.booleans())) for active in pattern
        )

    if static_graph:
        # The same graph every pass: one pattern per rank, drawn once. The sink counts the
        # heads left out of the loss as unused with or without find_unused_parameters.
        fixed = draw(unused_patterns(spec, world_size, 1, synced_all_used=False))[0]
        fixed_drop = drop(fixed, True)
        if skip:  # every rank as rank 0
            fixed, fixed_drop = _uniform(fixed), _uniform(fixed_drop)
        lengths = [draw(st.integers(0, 2)) + 1 for _ in range(iterations)]
        windows = tuple(tuple(fixed for _ in range(n)) for n in lengths)
        dropped = tuple(tuple(fixed_drop for _ in range(n)) for n in lengths)
    else:
        windows = tuple(
            draw(
                unused_patterns(
                    spec,
                    world_size,
                    draw(st.integers(0, 2)) + 1,
                    synced_all_used=not find_unused,  # else the classic error, by design
                )
            )
            for _ in range(iterations)
        )
        dropped = tuple(
            tuple(drop(p, find_unused or n < len(w) - 1) for n, p in enumerate(w)) for w in windows
        )
        if skip:  # the synced pass of every window: every rank as rank 0
            windows = tuple((*w[:-1], _uniform(w[-1])) for w in windows)
            dropped = tuple((*d[:-1], _uniform(d[-1])) for d in dropped)
    # A second backward only where the first leaves the synced pass unfinished on every
    # rank: without the sink (see the module docstring), every branch runs in a synced pass
    # (synced_all_used), so some branch must own layers other than branch 0's.
    twice_possible = (
        mode == "plain"
        and not spec.has_reentrant
        and any(spec.owner(b) != 0 for b in range(len(spec.branches)))
    )
    modes = ["plain", "create_graph"] + (
        ["penalty"] if not static_graph and not spec.has_reentrant else []
    )
    chosen = draw(_DDP_BACKWARDS)
    return DDPScenario(
        model=spec,
        world_size=world_size,
        find_unused=find_unused,
        static_graph=static_graph,
        as_view=draw(st.booleans()) if as_view is None else as_view,
        bucket_cap_mb=draw(st.sampled_from([1e-5, 1e-4, 3e-4, 25.0])),
        hook=draw(_DDP_HOOKS) if hook is None else hook,
        toggle_attribute=draw(st.booleans()),
        zero_grad=tuple(draw(st.sampled_from(["keep", "none", "zero"])) for _ in windows),
        windows=windows,
        dropped=dropped,
        layout=(
            draw(output_layouts(len(spec.branches)))
            if (draw(_MOSTLY) if nested is None else nested)
            else None
        ),
        backward=chosen if chosen in modes else "plain",
        twice=twice_possible and draw(_RARELY),
        skip_unused=skip,
    )


def _uniform(pattern: Pattern) -> Pattern:
    """Rank 0's part of a per-rank pattern, for every rank."""
    return tuple(pattern[0] for _ in pattern)


def _zero(model: nn.Module, how: str) -> None:
    if how != "keep":
        model.zero_grad(set_to_none=how == "none")


Grads = list[Tensor | None]


@dataclass(frozen=True, slots=True)
class DDPRankRun:
    """One rank's gradients after every pass, the error it raised where the scenario must
    be refused, and the parameters that kept a hook of the reducer after ``close()``."""

    passes: list[Grads]
    error: str | None
    hooks_left: tuple[str, ...]


def run_ddp(s: DDPScenario) -> list[DDPRankRun]:
    """Per rank, the gradients after every pass, in order (up to the refused pass)."""
    refused = s.refusal is not None

    def rank_fn(pg: fakepg.FakeProcessGroup) -> DDPRankRun:
        sync_intra_op_threads()
        rank = pg.rank()
        model = build_model(s.model)
        params: list[Tensor] = list(model.parameters())
        before = [hook_count(p) for p in params]
        # reducer.DistributedDataParallel as it is now: see harness (a mutant may replace it).
        ddp = reducer.DistributedDataParallel(
            model,
            pg,
            bucket_cap_mb=s.bucket_cap_mb,
            find_unused_parameters=s.find_unused,
            gradient_as_bucket_view=s.as_view,
            static_graph=s.static_graph,
            skip_all_reduce_unused_params=s.skip_unused,
        )
        try:
            if s.hook != "none":
                ddp.register_comm_hook(state_for(s.hook, pg), HOOKS[s.hook])
            after, error = _passes(s, ddp, params, rank, refused)
        finally:
            ddp.reducer.close()
        return DDPRankRun(after, error, hooks_left(params, before))

    return fakepg.run(rank_fn, s.world_size, timeout=20.0)


def _passes(
    s: DDPScenario,
    ddp: reducer.DistributedDataParallel,
    params: list[Tensor],
    rank: int,
    refused: bool,
) -> tuple[list[Grads], str | None]:
    """Every pass of ``s`` on this rank; the gradients after each, up to a refused one."""
    after: list[Grads] = []
    for k, window in enumerate(s.windows):
        _zero(ddp, s.zero_grad[k])
        for micro, pattern in enumerate(window):
            synced = micro == len(window) - 1
            active = active_branches(s.model, pattern[rank])
            inputs = s.inputs(rank, k, micro)
            dropped = s.dropped[k][micro][rank]
            if s.toggle_attribute or synced:
                ddp.require_backward_grad_sync = synced
                error = _pass(s, ddp, params, inputs, active, dropped, synced, refused)
                if error is not None:
                    return after, error
            else:
                with ddp.no_sync():
                    _pass(s, ddp, params, inputs, active, dropped, False, False)
            after.append([snapshot(p.grad) for p in params])
    return after, None


def _pass(
    s: DDPScenario,
    module: nn.Module,
    params: list[Tensor],
    inputs: list[Tensor],
    active: frozenset[int],
    dropped: frozenset[int],
    synced: bool,
    refused: bool,
) -> str | None:
    """One forward and backward; the refusal's message, where one is expected."""
    packed = module(inputs, active, s.layout)
    try:
        if s.twice and synced:
            loss_of([s.outputs(packed, active)[0]]).backward(retain_graph=True)
        backward(s.backward, s.kept(packed, active, dropped), params)
    except reducer.ReductionError as exc:
        if not refused:
            raise
        return str(exc)
    return None


def run_mirrors(s: DDPScenario) -> list[list[Grads]]:
    """The same passes on plain models, averaged exactly at each synced pass."""
    mirrors = [build_model(s.model) for _ in range(s.world_size)]
    count = len(list(mirrors[0].parameters()))
    used = [[False] * count for _ in mirrors]
    for r, mirror in enumerate(mirrors):
        for i, p in enumerate(mirror.parameters()):
            p.register_post_accumulate_grad_hook(
                lambda q, r=r, i=i: used[r].__setitem__(i, used[r][i] or q.grad is not None)
            )
    after: list[list[Grads]] = [[] for _ in mirrors]
    # Per parameter: is its .grad the bucket view (gradient_as_bucket_view) as the window
    # starts, so that autograd accumulates into it in place? See _scalings.
    in_view = [False] * count
    for k, window in enumerate(s.windows):
        for mirror in mirrors:
            _zero(mirror, s.zero_grad[k])
        if s.zero_grad[k] == "none":
            in_view = [False] * count
        for micro, pattern in enumerate(window):
            for r, mirror in enumerate(mirrors):
                active = active_branches(s.model, pattern[r])
                dropped = s.dropped[k][micro][r]
                packed = mirror(s.inputs(r, k, micro), active, s.layout)
                backward(s.backward, s.kept(packed, active, dropped), list(mirror.parameters()))
            if micro == len(window) - 1:
                unreached = [_unreached(s.model, pattern[r]) for r in range(s.world_size)]
                views = [s.as_view and v for v in in_view]
                averaged = _average(
                    mirrors, used, unreached, s.world_size, s.hook, _scalings(s, in_view), views
                )
                in_view = [was or now for was, now in zip(in_view, averaged, strict=True)]
                used = [[False] * count for _ in mirrors]
            for r, mirror in enumerate(mirrors):
                after[r].append([snapshot(p.grad) for p in mirror.parameters()])
    return after


def _scalings(s: DDPScenario, in_view: list[bool]) -> list[Scaling]:
    """Per parameter, how DDP scales its gradient without a comm hook: as torch's, by
    ``1.0 / W``, except a gradient that autograd accumulated into its bucket view in place
    (gradient_as_bucket_view, .grad already the view, not set to None since), which torch
    divides by W. ``create_graph`` accumulates out of place: never in the view. See Note
    [Gradient scaling] in reducer.bucket_views."""
    in_place = s.as_view and s.backward != "create_graph"
    return ["divide" if in_place and v else "reciprocal" for v in in_view]


def _unreached(spec: ModelSpec, pattern: frozenset[int]) -> list[bool]:
    """Per parameter: does the synced pass's forward leave it out of the graph on a rank
    that runs the optional branches ``pattern`` (what the search finds unused)?"""
    active = active_branches(spec, pattern)
    return [not any(b in active for b in spec.users(owner)) for owner in spec.parameter_owners()]


def _average(
    mirrors: list[GeneratedModel],
    used: list[list[bool]],
    unreached: list[list[bool]],
    world_size: int,
    hook: str,
    scalings: list[Scaling],
    views: list[bool],
) -> list[bool]:
    """Set every used parameter's .grad to its exact average; which were averaged.

    As torch's DDP: a rank that used the parameter since the last synced pass contributes
    its .grad; so does one whose forward left it out of the graph (found unused) and that
    holds a .grad (kept without zero_grad), untouched by this pass: divided by W where that
    .grad is its bucket view (``views``), else multiplied by 1 / W; any other rank
    contributes zeros. Where no rank used it, .grad stays as it is, except a bucket view
    that contributed: that is reduced in place (see Note [Unused parameters] in
    reducer.reducer)."""
    params = [list(m.parameters()) for m in mirrors]
    averaged = []
    for i in range(len(params[0])):
        held = [
            not used[r][i] and unreached[r][i] and params[r][i].grad is not None
            for r in range(world_size)
        ]
        column = [
            snapshot(params[r][i].grad) if used[r][i] or held[r] else None
            for r in range(world_size)
        ]
        anywhere = any(used[r][i] for r in range(world_size))
        if hook != "none":
            average = AVERAGES[hook](column, world_size)
        else:
            held_scaling: Scaling = "divide" if views[i] else "reciprocal"
            per_rank = [held_scaling if held[r] else scalings[i] for r in range(world_size)]
            average = _rank_order_average(column, world_size, per_rank)
        averaged.append(average is not None and anywhere)
        if average is None:
            continue
        for r in range(world_size):
            # Where no rank used it, only a bucket view that contributed is written.
            if anywhere or (held[r] and views[i]):
                params[r][i].grad = average.clone()
    return averaged


def _rank_order_average(
    column: list[Tensor | None], world_size: int, scalings: list[Scaling]
) -> Tensor | None:
    """:func:`rank_order_average` with each rank's term scaled its own way."""
    if all(g is None for g in column):
        return None
    like = next(g for g in column if g is not None)
    total: Tensor | None = None
    for g, scaling in zip(column, scalings, strict=True):
        term = rank_order_average([torch.zeros_like(like) if g is None else g], world_size)
        if g is not None:
            term = rank_order_average([g], world_size, scaling=scaling)
        assert term is not None
        total = term if total is None else total + term
    return total


# Static graph, a head whose output rank 0 leaves out of the loss while rank 1 uses it, and
# .grad kept between iterations: in the second iteration rank 0 holds the first average as a
# stale .grad, and must still contribute zeros (the sink must run after the first iteration).
_STATIC_STALE = DDPScenario(
    model=ModelSpec((BranchSpec("linear"), BranchSpec("linear", optional=True)), seed=1),
    world_size=2,
    find_unused=False,
    static_graph=True,
    as_view=False,
    bucket_cap_mb=25.0,
    hook="none",
    toggle_attribute=False,
    zero_grad=("keep", "keep"),
    windows=(((frozenset({1}), frozenset({1})),),) * 2,
    dropped=(((frozenset({1}), frozenset()),),) * 2,
)


# A core property, with the largest space (options x iterations x nested outputs) and cheap
# examples (tens of ms): eight times the profile's examples (ci: 200). Bugs of the wrapper
# that need two ranks, a static graph and a second iteration together are found there.
@pytest.mark.slow
@settings(max_examples=8 * settings().max_examples)
@example(_STATIC_STALE)
@given(ddp_scenarios())
def test_ddp_gradients_equal_the_mirrors_after_every_pass(s: DDPScenario) -> None:
    note_size(s.model.parameter_count, s.world_size)
    event(f"hook={s.hook}, static={s.static_graph}, find_unused={s.find_unused}")
    event(f"outputs left out of the loss: {any(d for w in s.dropped for p in w for d in p)}")
    event(f"outputs nested: {s.layout is not None}; backward: {s.backward}; twice: {s.twice}")
    event(f"checkpoints: {sorted({b.checkpoint for b in s.model.branches})}")
    if any(b.width * b.out >= LARGE_NUMEL for b in s.model.branches):
        event(f"a weight of 2**16 elements or more (a fused copy), world size {s.world_size}")
    if s.skip_unused:
        event(f"skip_all_reduce_unused_params, world size {s.world_size}")
        if _accumulated_where_synced_pass_leaves_unused(s):
            event(
                "skip_all_reduce_unused_params: no_sync gradients in a part the synced pass skips"
            )
    why = s.refusal
    event(f"refused: {why.why}" if why is not None else "averaged")
    check_ddp(s)


def check_ddp(s: DDPScenario) -> None:
    """The property: the ranks hold the mirrors' gradients after every pass, or raise the
    documented error on every rank where the wrapper must refuse; no hook left after close."""
    runs = run_ddp(s)
    for rank, run in enumerate(runs):
        assert not run.hooks_left, (
            f"rank {rank}: after close(), hooks of the reducer are left on "
            f"{'; '.join(run.hooks_left)}"
        )
    why = s.refusal
    if why is not None:
        assert_refused([run.error for run in runs], why)
        return
    got, want = [run.passes for run in runs], run_mirrors(s)
    for rank in range(s.world_size):
        for n, (grads, expected) in enumerate(zip(got[rank], want[rank], strict=True)):
            for i, (g, w) in enumerate(zip(grads, expected, strict=True)):
                where = f"rank {rank}, pass {n}, parameter {i}"
                assert (g is None) == (w is None), f"{where}: {g} vs {w}"
                if g is not None and w is not None:
                    assert torch.equal(g, w), f"{where}: differs from the exact reference"


def _accumulated_where_synced_pass_leaves_unused(s: DDPScenario) -> bool:
    """Does some rank run, in a no_sync pass, a branch that the window's synced pass leaves
    unused on every rank? (The corner of ``skip_all_reduce_unused_params``.)"""
    for window in s.windows:
        synced = window[-1]
        run = set.union(*(set(p) for p in synced))
        for local in window[:-1]:
            if any(set(p) - run for p in local):
                return True
    return False
