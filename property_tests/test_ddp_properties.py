"""Property 5: reducer.DistributedDataParallel averages exactly, whatever its options.

Hypothesis draws a model, a world size, the wrapper's options (``find_unused_parameters``,
``static_graph``, ``gradient_as_bucket_view``, ``bucket_cap_mb`` from one parameter per
bucket to one bucket for all, a comm hook or none) and a few iterations, each a window of
``no_sync`` backward passes (or the ``require_backward_grad_sync`` toggle) and one synced one,
with per-rank unused branches, and branches whose output is returned but left out of the loss
(their parameters count as unused, not as used with zeros). Beside the ranks, one plain
*mirror* model per rank runs the same passes; at each synced step its gradients become the
exact rank-order average of the mirrors' own gradients (DESIGN.md). The ranks must hold
exactly the mirrors' gradients, bit for bit, after every pass: local ones inside a window,
averaged ones after the synced pass, and ``.grad`` untouched for a parameter no rank used
since the last synced pass.

The buckets are rebuilt after the first iteration (unless searching for unused parameters), so
later iterations check the rebuilt layout too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import event, example, given
from hypothesis import strategies as st
from torch import Tensor, nn

import fakepg
import reducer

from .harness import active_branches, snapshot
from .model import BranchSpec, ModelSpec, branch_inputs, build_model, loss_of
from .reference import rank_order_average
from .strategies import model_specs, unused_patterns, world_sizes

HOOKS: dict[str, reducer.CommHook | None] = {"none": None, "allreduce": reducer.allreduce_hook}
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

    def kept(
        self, outputs: list[Tensor], active: frozenset[int], dropped: frozenset[int]
    ) -> Tensor:
        """The loss over the outputs of ``active`` branches (in index order) not dropped."""
        return loss_of(
            [o for b, o in zip(sorted(active), outputs, strict=True) if b not in dropped]
        )

    def inputs(self, rank: int, iteration: int, micro: int) -> list[Tensor]:
        seed = (self.model.seed * 7919 + iteration * 104729 + micro * 1009 + rank) % (2**31)
        return branch_inputs(self.model, seed)


@st.composite
def ddp_scenarios(draw: st.DrawFn) -> DDPScenario:
    optional = draw(st.integers(0, 3)) > 0  # mostly models with branches that can go unused
    spec = draw(
        model_specs(max_branches=3, max_params=6, allow_sparse=False, require_optional=optional)
    )
    world_size = draw(world_sizes(4))
    mode = draw(st.sampled_from(["plain", "find_unused", "static_graph"]))
    static_graph, find_unused = mode == "static_graph", mode == "find_unused"
    iterations = draw(st.integers(1, 3))

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
        # The same graph every pass: one pattern per rank, drawn once.
        fixed = draw(unused_patterns(spec, world_size, 1, synced_all_used=False))[0]
        fixed_drop = drop(fixed, True)
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
    return DDPScenario(
        model=spec,
        world_size=world_size,
        find_unused=find_unused,
        static_graph=static_graph,
        as_view=draw(st.booleans()),
        bucket_cap_mb=draw(st.sampled_from([1e-5, 1e-4, 3e-4, 25.0])),
        hook=draw(st.sampled_from(sorted(HOOKS))),
        toggle_attribute=draw(st.booleans()),
        zero_grad=tuple(draw(st.sampled_from(["keep", "none", "zero"])) for _ in windows),
        windows=windows,
        dropped=dropped,
    )


def _zero(model: nn.Module, how: str) -> None:
    if how != "keep":
        model.zero_grad(set_to_none=how == "none")


Grads = list[Tensor | None]


def run_ddp(s: DDPScenario) -> list[list[Grads]]:
    """Per rank, the gradients after every pass, in order."""

    def rank_fn(pg: fakepg.FakeProcessGroup) -> list[Grads]:
        rank = pg.rank()
        model = build_model(s.model)
        ddp = reducer.DistributedDataParallel(
            model,
            pg,
            bucket_cap_mb=s.bucket_cap_mb,
            find_unused_parameters=s.find_unused,
            gradient_as_bucket_view=s.as_view,
            static_graph=s.static_graph,
        )
        hook = HOOKS[s.hook]
        if hook is not None:
            ddp.register_comm_hook(None, hook)
        after: list[Grads] = []
        try:
            for k, window in enumerate(s.windows):
                _zero(ddp, s.zero_grad[k])
                for micro, pattern in enumerate(window):
                    synced = micro == len(window) - 1
                    active = active_branches(s.model, pattern[rank])
                    inputs = s.inputs(rank, k, micro)
                    dropped = s.dropped[k][micro][rank]
                    if s.toggle_attribute or synced:
                        ddp.require_backward_grad_sync = synced
                        s.kept(ddp(inputs, active), active, dropped).backward()
                    else:
                        with ddp.no_sync():
                            s.kept(ddp(inputs, active), active, dropped).backward()
                    after.append([snapshot(p.grad) for p in model.parameters()])
            return after
        finally:
            ddp.reducer.close()

    return fakepg.run(rank_fn, s.world_size, timeout=20.0)


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
    for k, window in enumerate(s.windows):
        for mirror in mirrors:
            _zero(mirror, s.zero_grad[k])
        for micro, pattern in enumerate(window):
            for r, mirror in enumerate(mirrors):
                active = active_branches(s.model, pattern[r])
                dropped = s.dropped[k][micro][r]
                s.kept(mirror(s.inputs(r, k, micro), active), active, dropped).backward()
            if micro == len(window) - 1:
                _average(mirrors, used, s.world_size)
                used = [[False] * count for _ in mirrors]
            for r, mirror in enumerate(mirrors):
                after[r].append([snapshot(p.grad) for p in mirror.parameters()])
    return after


def _average(mirrors: list[nn.Module], used: list[list[bool]], world_size: int) -> None:
    params = [list(m.parameters()) for m in mirrors]
    for i in range(len(params[0])):
        column = [snapshot(params[r][i].grad) if used[r][i] else None for r in range(world_size)]
        average = rank_order_average(column, world_size)
        if average is None:
            continue  # no rank used it since the last synced pass: .grad stays as it is
        for r in range(world_size):
            params[r][i].grad = average.clone()


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


@example(_STATIC_STALE)
@given(ddp_scenarios())
def test_ddp_gradients_equal_the_mirrors_after_every_pass(s: DDPScenario) -> None:
    event(f"hook={s.hook}, static={s.static_graph}, find_unused={s.find_unused}")
    event(f"outputs left out of the loss: {any(d for w in s.dropped for p in w for d in p)}")
    got, want = run_ddp(s), run_mirrors(s)
    for rank in range(s.world_size):
        for n, (grads, expected) in enumerate(zip(got[rank], want[rank], strict=True)):
            for i, (g, w) in enumerate(zip(grads, expected, strict=True)):
                where = f"rank {rank}, pass {n}, parameter {i}"
                assert (g is None) == (w is None), f"{where}: {g} vs {w}"
                if g is not None and w is not None:
                    assert torch.equal(g, w), f"{where}: differs from the exact reference"
