"""Differential: reducer.DistributedDataParallel against torch.nn.parallel.DistributedDataParallel.

Both wrappers run in the same rank threads on one fake world (registered as the "fakepg"
torch.distributed backend), on copies of the same model, fed the same data, each with its own
SGD optimizer, over several iterations, with and without unused parameters.

What is bitwise and what is not: both sum the per-rank contributions in rank order (the fake
world's SUM), but torch scales each gradient by multiplying with the reciprocal ``1 / W``
while this reducer divides by ``W``. For W a power of two the two are the same operation,
exact, so gradients and parameters must be bit-identical at every step. For W = 3, ``x * (1/3)``
and ``x / 3`` can differ in the last bit; the optimizer steps carry such differences into the
parameters, and the next forward and backward amplify them a little (tens of float32 ulps
after three steps were seen). There the comparison uses rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from helpers import rank_input, seeded
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import fakepg
import reducer

STEPS = 3
RTOL, ATOL = 1e-5, 1e-6  # W not a power of two only: see the module docstring


@pytest.fixture(autouse=True)
def _registered() -> Iterator[None]:
    fakepg.register_torch_backend()
    hook = sys.excepthook  # init_process_group chains sys.excepthook
    yield
    sys.excepthook = hook


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
) -> list[tuple[Trace, Trace]]:
    """Per rank, both wrappers' traces. With ``adapter``, this wrapper reduces through
    reducer.TorchProcessGroup over the torch group (the path gloo and NCCL take); with
    ``hook``, both use their allreduce comm hook."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[Trace, Trace]:
        # Parameters unused on every rank need the search or the static graph.
        dead = unused or static_graph
        ours_model, theirs_model = build(dead), build(dead)
        group: reducer.ProcessGroup = pg
        if adapter:
            group = reducer.TorchProcessGroup(dist.group.WORLD)  # type: ignore[arg-type]
        ours = reducer.DistributedDataParallel(
            ours_model,
            group,
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


def compare(ours: Tensor | None, theirs: Tensor | None, exact: bool, where: str) -> None:
    if theirs is None:
        assert ours is None, f"{where}: torch left no gradient, this wrapper set one"
        return
    assert ours is not None, f"{where}: torch set a gradient, this wrapper did not"
    if exact:
        assert torch.equal(ours, theirs), f"{where}: not bit-identical"
    else:
        torch.testing.assert_close(
            ours, theirs, rtol=RTOL, atol=ATOL, msg=lambda m: f"{where}: {m}"
        )


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("unused", [False, True], ids=["all-used", "unused"])
def test_same_gradients_and_parameters_as_torch_ddp(world_size: int, unused: bool) -> None:
    exact = world_size & (world_size - 1) == 0  # a power of two: 1/W is exact
    results = run_both(world_size, unused=unused, as_view=False)
    names = [n for n, _ in build(unused).named_parameters()]
    for rank, (ours, theirs) in enumerate(results):
        for step in range(STEPS):
            for kind, mine, torchs in (
                ("grad", ours[step][0], theirs[step][0]),
                ("param", ours[step][1], theirs[step][1]),
            ):
                for name, a, b in zip(names, mine, torchs, strict=True):
                    compare(a, b, exact, f"{kind} of {name}, rank {rank}, step {step}")
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
    ],
    ids=["bucket-view", "static", "torch-process-group", "allreduce-hook"],
)
def test_same_as_torch_ddp_with_other_options(options: dict[str, bool]) -> None:
    """Bit-identical. With the allreduce hook even for W = 3: torch's allreduce_hook divides
    the bucket by W (no reciprocal), as reducer.allreduce_hook does."""
    kwargs = {"unused": False, "as_view": False, **options}
    world_size = int(kwargs.pop("world_size", 2))
    results = run_both(world_size, **kwargs)
    for rank, (ours, theirs) in enumerate(results):
        for step in range(STEPS):
            for i, (a, b) in enumerate(zip(ours[step][0], theirs[step][0], strict=True)):
                compare(a, b, True, f"grad {i}, rank {rank}, step {step}")
            for i, (a, b) in enumerate(zip(ours[step][1], theirs[step][1], strict=True)):
                compare(a, b, True, f"param {i}, rank {rank}, step {step}")


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
                    compare(a, b, True, f"{what} {i}, rank {rank}, step {step}")
