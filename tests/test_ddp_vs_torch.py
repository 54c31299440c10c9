"""Differential: reducer.DistributedDataParallel against torch.nn.parallel.DistributedDataParallel.

Both wrappers run in the same rank threads on one fake world (registered as the "fakepg"
torch.distributed backend), on copies of the same model, fed the same data, each with its own
SGD optimizer, over several iterations, with and without unused parameters.

Everything is bitwise: both sum the per-rank contributions in rank order (the fake world's
SUM), and both scale each gradient as torch does, multiplying by ``1.0 / W`` (see Note
[Gradient scaling] in reducer.bucket_views), so gradients and parameters must be
bit-identical at every step, at W = 3 too. (tests/test_ddp_bitwise_any_world.py covers the
other world sizes and every scaling path.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import rank_input, seeded
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import fakepg
import reducer

STEPS = 3


pytestmark = pytest.mark.usefixtures("fakepg_torch_backend")


class Heads(nn.Module):
    """A trunk and heads: head 0 always used, head 1 on some ranks and steps, and with
    ``dead``, a third that is never used."""

    def __init__(self, dead: bool) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8))
        self.heads = nn.ModuleList([nn.Linear(8, 3), nn.Linear(8, 3)])
        self.dead = nn.Linear(8, 3) if dead else None

    def forward(self, x: Tensor, use_head1: bool) -> Tensor:
        h = torch.tanh(self.trunk(x))
        out: Tensor = self.heads[0](h)
        if use_head1:
            out = out + self.heads[1](h)
        return out


def build(dead: bool = False) -> Heads:
    return seeded(lambda: Heads(dead), seed=7)


def uses_head1(rank: int, step: int, unused: bool) -> bool:
    return not unused or (rank + step) % 2 == 0


Trace = list[tuple[list[Tensor | None], list[Tensor]]]  # per step: grads, then parameters


def run_both(
    world_size: int,
    *,
    unused: bool,
    as_view: bool,
    static_graph: bool = False,
    adapter: bool = False,
    hook: bool = False,
    group: str = "fake",
) -> list[tuple[Trace, Trace]]:
    """Per rank, both wrappers' traces. With ``adapter``, this wrapper reduces through
    reducer.TorchProcessGroup over the torch group (the path gloo and NCCL take); with
    ``hook``, both use their allreduce comm hook. ``group`` is what this wrapper is given:
    the rank's fake group (second, where it always went), nothing (``"default"``: torch's
    default group, as torch's wrapper here), or the torch group itself (``"torch"``)."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[Trace, Trace]:
        # Parameters unused on every rank need the search or the static graph.
        dead = unused or static_graph
        ours_model, theirs_model = build(dead), build(dead)
        given: tuple[object, ...] = {
            "fake": (pg,),
            "default": (),
            "torch": (dist.group.WORLD,),
        }[group]
        if adapter:
            given = (reducer.TorchProcessGroup(dist.group.WORLD),)  # type: ignore[arg-type]
        ours = reducer.DistributedDataParallel(
            ours_model,
            *given,  # type: ignore[arg-type]
            bucket_cap_mb=1e-4,
            find_unused_parameters=unused,
            gradient_as_bucket_view=as_view,
            static_graph=static_graph,
        )
        theirs = nn.parallel.DistributedDataParallel(
            theirs_model,
            bucket_cap_mb=1e-4,
            find_unused_parameters=unused,
            gradient_as_bucket_view=as_view,
            static_graph=static_graph,
        )
        if hook:
            ours.register_comm_hook(None, reducer.allreduce_hook)
            theirs.register_comm_hook(None, default_hooks.allreduce_hook)
        traces: tuple[Trace, Trace] = ([], [])
        pairs: tuple[tuple[nn.Module, nn.Module], ...] = (
            (ours, ours_model),
            (theirs, theirs_model),
        )
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for _, m in pairs]
        for step in range(STEPS):
            x = rank_input(pg.rank(), (4, 6), step)
            use = uses_head1(pg.rank(), step, unused)
            for (ddp, model), opt, trace in zip(pairs, optimizers, traces, strict=True):
                opt.zero_grad(set_to_none=True)
                ddp(x, use).pow(2).sum().backward()
                grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
                opt.step()
                trace.append((grads, [p.detach().clone() for p in model.parameters()]))
        return traces

    return fakepg.run_torch(fn, world_size, timeout=30.0)


def compare(ours: Tensor | None, theirs: Tensor | None, where: str) -> None:
    if theirs is None:
        assert ours is None, f"{where}: torch left no gradient, this wrapper set one"
        return
    assert ours is not None, f"{where}: torch set a gradient, this wrapper did not"
    assert torch.equal(ours, theirs), f"{where}: not bit-identical"


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("unused", [False, True], ids=["all-used", "unused"])
def test_same_gradients_and_parameters_as_torch_ddp(world_size: int, unused: bool) -> None:
    results = run_both(world_size, unused=unused, as_view=False)
    names = [n for n, _ in build(unused).named_parameters()]
    for rank, (ours, theirs) in enumerate(results):
        for step in range(STEPS):
            for kind, mine, torchs in (
                ("grad", ours[step][0], theirs[step][0]),
                ("param", ours[step][1], theirs[step][1]),
            ):
                for name, a, b in zip(names, mine, torchs, strict=True):
                    compare(a, b, f"{kind} of {name}, rank {rank}, step {step}")
        if unused:
            # head 1 is used somewhere at every step; `dead` never: .grad stays None in both.
            assert ours[0][0][names.index("dead.weight")] is None
            assert ours[0][0][names.index("heads.1.weight")] is not None


@pytest.mark.parametrize(
    "options",
    [
        {"as_view": True},
        {"static_graph": True},
        {"adapter": True, "unused": True},
        {"hook": True, "unused": True, "world_size": 3},
        {"group": "default", "unused": True},
        {"group": "torch", "as_view": True},
    ],
    ids=[
        "bucket-view",
        "static",
        "torch-process-group",
        "allreduce-hook",
        "default-group",
        "raw-torch-group",
    ],
)
def test_same_as_torch_ddp_with_other_options(options: dict[str, Any]) -> None:
    """Bit-identical. With the allreduce hook even for W = 3: torch's allreduce_hook divides
    the bucket by W (no reciprocal), as reducer.allreduce_hook does. Without a group this
    wrapper, like torch's, reduces over torch.distributed's default group (here the fake
    world's: its FakeProcessGroup, directly); given a torch group, over that."""
    kwargs = {"unused": False, "as_view": False, **options}
    world_size = int(kwargs.pop("world_size", 2))
    results = run_both(world_size, **kwargs)
    for rank, (ours, theirs) in enumerate(results):
        for step in range(STEPS):
            for i, (a, b) in enumerate(zip(ours[step][0], theirs[step][0], strict=True)):
                compare(a, b, f"grad {i}, rank {rank}, step {step}")
            for i, (a, b) in enumerate(zip(ours[step][1], theirs[step][1], strict=True)):
                compare(a, b, f"param {i}, rank {rank}, step {step}")


# -------------------------------------------------------------------------------------------
# Higher-order and nested backward, as torch's own DDP tests run them.


class _Square(nn.Module):
    """torch's test_ddp_create_graph model: one scalar parameter, ``p ** 2``."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.tensor(1.0))
        self.rank = rank

    def forward(self) -> Tensor:
        return self.p.pow(2) * (self.rank + 1)


def test_backward_with_create_graph_matches_torch_ddp() -> None:
    """Three steps of ``backward(create_graph=True)`` without zeroing: the same bits as
    torch's DDP, gradients that still require grad, and the expected value."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[tuple[float, float, bool]]:
        ours_model, theirs_model = _Square(pg.rank()), _Square(pg.rank())
        ours = reducer.DistributedDataParallel(ours_model, pg)
        theirs = nn.parallel.DistributedDataParallel(theirs_model)
        out = []
        for _ in range(3):
            ours().backward(create_graph=True)
            theirs().backward(create_graph=True)
            a, b = ours_model.p.grad, theirs_model.p.grad
            assert a is not None and b is not None
            out.append((a.item(), b.item(), a.requires_grad and b.requires_grad))
        return out

    # Local d/dp (r + 1) p**2 at p = 1 is 2 (r + 1): 2 and 4, averaged 3; each later step adds
    # the local gradient to the averaged .grad and averages again.
    for per_step in fakepg.run_torch(fn, 2, timeout=30.0):
        assert per_step == [(3.0, 3.0, True), (6.0, 6.0, True), (9.0, 9.0, True)]


class _Checkpointed(nn.Module):
    """An MLP whose blocks run under reentrant activation checkpointing."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(6, 2)

    def forward(self, x: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True, preserve_rng_state=False)  # type: ignore[assignment]
        out: Tensor = self.head(x)
        return out


@pytest.mark.parametrize("static_graph", [False, True])
def test_reentrant_checkpointing_matches_torch_ddp(static_graph: bool) -> None:
    """Each block's gradients arrive in a backward of its own, nested in the outer one."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[Trace, Trace]:
        models = [seeded(_Checkpointed, seed=3), seeded(_Checkpointed, seed=3)]
        ours = reducer.DistributedDataParallel(
            models[0], pg, bucket_cap_mb=1e-4, static_graph=static_graph
        )
        theirs = nn.parallel.DistributedDataParallel(
            models[1], bucket_cap_mb=1e-4, static_graph=static_graph
        )
        traces: tuple[Trace, Trace] = ([], [])
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        for step in range(STEPS):
            x = rank_input(pg.rank(), (4, 6), step).requires_grad_()
            for ddp, model, opt, trace in zip(
                (ours, theirs), models, optimizers, traces, strict=True
            ):
                opt.zero_grad(set_to_none=True)
                ddp(x).pow(2).sum().backward()
                grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
                opt.step()
                trace.append((grads, [p.detach().clone() for p in model.parameters()]))
        return traces

    for rank, (ours, theirs) in enumerate(fakepg.run_torch(fn, 2, timeout=30.0)):
        for step in range(STEPS):
            for kind, what in enumerate(("grad", "param")):
                for i, (a, b) in enumerate(zip(ours[step][kind], theirs[step][kind], strict=True)):
                    compare(a, b, f"{what} {i}, rank {rank}, step {step}")


# -------------------------------------------------------------------------------------------
# Uneven inputs: join, against torch's.


def run_join_both(batches: list[int]) -> list[tuple[Trace, Trace]]:
    """Rank r trains ``batches[r]`` steps inside ``join``; per rank, both wrappers' traces
    (one entry per step trained, then the final parameters with no gradients)."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[Trace, Trace]:
        ours_model, theirs_model = build(False), build(False)
        ours = reducer.DistributedDataParallel(ours_model, bucket_cap_mb=1e-4)
        theirs = nn.parallel.DistributedDataParallel(theirs_model, bucket_cap_mb=1e-4)
        traces: tuple[Trace, Trace] = ([], [])
        pairs: tuple[tuple[Any, nn.Module], ...] = ((ours, ours_model), (theirs, theirs_model))
        for (ddp, model), trace in zip(pairs, traces, strict=True):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with ddp.join():
                for step in range(batches[pg.rank()]):
                    opt.zero_grad(set_to_none=True)
                    x = rank_input(pg.rank(), (4, 6), step)
                    ddp(x, True).pow(2).sum().backward()
                    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
                    opt.step()
                    trace.append((grads, [p.detach().clone() for p in model.parameters()]))
            trace.append(([], [p.detach().clone() for p in model.parameters()]))
        return traces

    return fakepg.run_torch(fn, len(batches), timeout=30.0)


@pytest.mark.parametrize("batches", [[1, 2, 3, 4], [3, 1, 4, 2]])
def test_join_matches_torchs_join(batches: list[int]) -> None:
    """Bit-identical on four ranks (test_ddp_bitwise_any_world covers three, five and six,
    and the divisor of divide_by_initial_world_size=False). (test_ddp_join checks
    torch's own join with find_unused_parameters and with divide_by_initial_world_size=False
    against the exact reference.)"""
    for rank, (ours, theirs) in enumerate(run_join_both(batches)):
        assert len(ours) == len(theirs) == batches[rank] + 1
        for step, (mine, torchs) in enumerate(zip(ours, theirs, strict=True)):
            for kind, a_list, b_list in (
                ("grad", mine[0], torchs[0]),
                ("param", mine[1], torchs[1]),
            ):
                for i, (a, b) in enumerate(zip(a_list, b_list, strict=True)):
                    compare(a, b, f"{kind} {i}, rank {rank}, step {step}")


# -------------------------------------------------------------------------------------------
# Ignored parameters and buffers.


class WithPrivate(nn.Module):
    """A shared layer and a per-rank layer and buffer that DDP must leave alone."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 3)
        self.private = nn.Linear(4, 3)
        self.register_buffer("stat", torch.full((3,), float(rank)))
        self.register_buffer("moving", torch.full((3,), float(rank)))
        with torch.no_grad():
            self.private.weight.fill_(rank + 1)

    def forward(self, x: Tensor) -> Tensor:
        self.moving += 1
        out: Tensor = self.shared(x) * self.private(x) + self.stat.sum()
        return out


IGNORED = ["private.weight", "private.bias", "stat"]


def test_ignored_parameters_and_buffers_match_torch() -> None:
    """Neither reduced nor broadcast, in either wrapper: the private layer keeps each rank's
    values and local gradient, ``stat`` each rank's value; the rest is averaged as usual and
    ``moving`` broadcast from rank 0. Either wrapper's static method marks the module."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[dict[str, Tensor | None]]:
        out = []
        for i, wrapper in enumerate(
            (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel)
        ):
            model = seeded(lambda: WithPrivate(pg.rank()), seed=3)
            # Each marks the module with the other's static method: the same contract.
            other = (
                nn.parallel.DistributedDataParallel if i == 0 else reducer.DistributedDataParallel
            )
            other._set_params_and_buffers_to_ignore_for_model(model, IGNORED)
            ddp = wrapper(model)  # type: ignore[operator]
            ddp(rank_input(pg.rank(), (2, 4))).pow(2).sum().backward()
            record: dict[str, Tensor | None] = {
                f"{n}.grad": None if p.grad is None else p.grad.clone()
                for n, p in model.named_parameters()
            }
            record.update({n: t.detach().clone() for n, t in model.state_dict().items()})
            out.append(record)
        return out

    results = fakepg.run_torch(fn, 2, timeout=30.0)
    for rank, (ours, theirs) in enumerate(results):
        assert ours.keys() == theirs.keys()
        for key in ours:
            compare(ours[key], theirs[key], f"{key}, rank {rank}")
        stat = ours["stat"]
        assert stat is not None and torch.equal(stat, torch.full((3,), float(rank)))
        moving = ours["moving"]
        assert moving is not None and torch.equal(moving, torch.full((3,), 1.0))  # rank 0's + 1
        weight = ours["private.weight"]
        assert weight is not None and torch.equal(weight, torch.full((3, 4), rank + 1.0))
    local_grads = [ours["private.weight.grad"] for ours, _ in results]
    assert local_grads[0] is not None and local_grads[1] is not None
    assert not torch.equal(local_grads[0], local_grads[1]), "a private gradient was averaged"


# -------------------------------------------------------------------------------------------
# Memory formats: strides checked across ranks, bucket views that follow them.


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.conv(x).mean((2, 3)))
        return out


def conv(channels_last: bool) -> Conv:
    model = seeded(Conv, seed=11)
    if channels_last:
        model.conv.to(memory_format=torch.channels_last)
    return model


def test_channels_last_bucket_views_match_torch() -> None:
    """gradient_as_bucket_view with a channels_last conv weight: in both wrappers .grad has
    the weight's strides (its bucket view follows them), and the same bits."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[tuple[list[Tensor], list[tuple[int, ...]]]]:
        out = []
        for wrapper in (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel):
            model = conv(channels_last=True)
            ddp = wrapper(model, gradient_as_bucket_view=True, bucket_cap_mb=1e-4)  # type: ignore[operator]
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(STEPS):
                opt.zero_grad()
                x = rank_input(pg.rank(), (2, 3, 5, 5), step)
                ddp(x.to(memory_format=torch.channels_last)).sum().backward()
                opt.step()
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            strides = [p.grad.stride() for p in model.parameters() if p.grad is not None]
            out.append((grads, strides))
        return out

    weight = conv(channels_last=True).conv.weight
    assert weight.stride() != weight.contiguous().stride()  # the case under test
    for rank, ((ours, our_strides), (theirs, their_strides)) in enumerate(
        fakepg.run_torch(fn, 2, timeout=30.0)
    ):
        assert our_strides == their_strides
        assert our_strides[0] == weight.stride()
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            compare(a, b, f"grad {i}, rank {rank}")


def test_parameters_whose_strides_differ_across_ranks_are_refused_as_by_torch() -> None:
    """Rank 1's conv weight is channels_last: its bucket layout would not match rank 0's.
    Both wrappers refuse it at construction with a RuntimeError, on every rank."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[BaseException]:
        errors = []
        for wrapper in (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel):
            with pytest.raises(RuntimeError) as info:
                wrapper(conv(channels_last=pg.rank() == 1))  # type: ignore[operator]
            errors.append(info.value)
        return errors

    for rank, (ours, theirs) in enumerate(fakepg.run_torch(fn, 2, timeout=30.0)):
        assert isinstance(ours, reducer.InvalidModel) and isinstance(theirs, RuntimeError)
        message = str(ours)
        assert "parameter 0 ('conv.weight') differs between ranks" in message, rank
        assert "rank 0 has float32 (4, 3, 3, 3) with strides (27, 9, 3, 1)" in message
        assert "rank 1 has float32 (4, 3, 3, 3) with strides (27, 1, 9, 3)" in message


# -------------------------------------------------------------------------------------------
# Error types and the phrases users search for.


def test_error_types_and_phrases_match_torch() -> None:
    """A module with nothing to train: RuntimeError from both. A new iteration before the
    last reduction finished: RuntimeError from both, with torch's phrase; this wrapper's
    names the parameters and DDP's own flag, not the reducer's calls."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[BaseException]:
        errors: list[BaseException] = []
        for wrapper in (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel):
            with pytest.raises(RuntimeError) as info:
                wrapper(nn.Linear(2, 2).requires_grad_(False))  # type: ignore[operator]
            errors.append(info.value)
        for wrapper in (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel):
            ddp = wrapper(build(dead=False))  # type: ignore[operator]
            ddp(torch.ones(2, 6), False).sum().backward()  # head 1 unused, no search
            with pytest.raises(RuntimeError) as info:
                ddp(torch.ones(2, 6), False)
            errors.append(info.value)
        return errors

    for ours_frozen, theirs_frozen, ours, theirs in fakepg.run_torch(fn, 2, timeout=30.0):
        assert isinstance(ours_frozen, reducer.InvalidModel)
        assert "doesn't have any parameter that requires a gradient" in str(theirs_frozen)
        assert "doesn't have any parameter that requires a gradient" in str(ours_frozen)
        phrase = "Expected to have finished reduction in the prior iteration"
        assert phrase in str(theirs) and phrase in str(ours)
        assert "'heads.1.weight'" in str(ours) and "find_unused_parameters=True" in str(ours)
        assert "prepare_for_backward" not in str(ours)


# -------------------------------------------------------------------------------------------
# _set_static_graph after construction.


@pytest.mark.parametrize("late", [False, True], ids=["constructor", "set-after"])
def test_set_static_graph_after_construction_matches_torch(late: bool) -> None:
    """Reentrant checkpointing needs the static graph; ``_set_static_graph()`` right after
    construction (as torch allows) gives it, the same as ``static_graph=True``."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[Trace, Trace]:
        models = [seeded(_Checkpointed, seed=3), seeded(_Checkpointed, seed=3)]
        wrappers = (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel)
        traces: tuple[Trace, Trace] = ([], [])
        for wrapper, model, trace in zip(wrappers, models, traces, strict=True):
            ddp = wrapper(model, bucket_cap_mb=1e-4, static_graph=not late)  # type: ignore[operator]
            if late:
                ddp._set_static_graph()
            for step in range(STEPS):
                model.zero_grad(set_to_none=True)
                ddp(rank_input(pg.rank(), (4, 6), step).requires_grad_()).pow(2).sum().backward()
                grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
                trace.append((grads, []))
        return traces

    for rank, (ours, theirs) in enumerate(fakepg.run_torch(fn, 2, timeout=30.0)):
        for step in range(STEPS):
            for i, (a, b) in enumerate(zip(ours[step][0], theirs[step][0], strict=True)):
                compare(a, b, f"grad {i}, rank {rank}, step {step}")


@pytest.mark.parametrize("replaced", ["halved", "after set_to_none"])
def test_a_bucket_view_grad_replaced_by_another_tensor_is_reduced_as_torch_does(
    replaced: str,
) -> None:
    """With gradient_as_bucket_view, a .grad the user replaced by a tensor of their own
    (scaled out of place, or accumulated by hand after ``zero_grad(set_to_none=True)``) is
    copied into its bucket view, scaled, at its next hook and reduced, as torch's DDP does
    (the bare Reducer refuses it: tests/test_reducer.py)."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[Tensor | None]]:
        out = []
        for make in (
            lambda m: reducer.DistributedDataParallel(m, pg, gradient_as_bucket_view=True),
            lambda m: nn.parallel.DistributedDataParallel(m, gradient_as_bucket_view=True),
        ):
            model = build()
            ddp = make(model)
            ddp(rank_input(pg.rank(), (4, 6), 0), True).pow(2).sum().backward()
            head = model.heads[1]
            if replaced == "halved":
                head.weight.grad = head.weight.grad * 0.5  # a new tensor, not the view
            else:
                model.zero_grad(set_to_none=True)
                head.weight.grad = torch.ones_like(head.weight) * (pg.rank() + 1)
            ddp(rank_input(pg.rank(), (4, 6), 1), True).pow(2).sum().backward()
            out.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        return out

    for rank, (ours, theirs) in enumerate(fakepg.run_torch(fn, 3, timeout=30.0)):
        for i, (o, t) in enumerate(zip(ours, theirs, strict=True)):
            compare(o, t, f"rank {rank}, parameter {i}")
