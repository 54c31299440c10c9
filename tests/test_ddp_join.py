"""DistributedDataParallel.join() (and torch's Join) with ranks that get different numbers of
batches, on the fake world.

Expectations are exact. A rank that has run out contributes zeros, so at each step the ranks
still training hold ``sum over ranks r in rank order of (g_r / D)`` with ``g_r`` = 0 for the
ranks that ran out, and ``D`` the world size (``divide_by_initial_world_size=True``) or the
number of ranks still training. The reference replays the training locally: one model whose
parameters every training rank shares, updated with the same SGD step from the expected
gradients; when every rank has run out, every rank holds the parameters of the last one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import rank_input, run_ranks, seeded
from torch import Tensor, nn
from torch.distributed.algorithms.join import Join

import fakepg
import reducer
from reducer.testing.reference import Scaling, rank_order_average

DDP = reducer.DistributedDataParallel
TINY_MB = 1e-5  # every parameter in a bucket of its own
LR = 0.25


class Net(nn.Module):
    """A trunk and an optional head; ``count`` is a buffer that forward reads, then bumps by
    ``rank + 1`` (so whose buffer every rank starts from is visible)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)
        self.extra = nn.Linear(3, 2)
        self.register_buffer("count", torch.zeros(()))
        self.seen: list[float] = []

    def forward(self, x: Tensor, rank: int, use_extra: bool) -> Tensor:
        self.seen.append(float(self.count))
        self.count += rank + 1
        h = torch.tanh(self.trunk(x))
        out: Tensor = self.head(h)
        return out + self.extra(h) if use_extra else out


def net() -> Net:
    return seeded(Net, seed=5)


def uses_extra(rank: int, step: int) -> bool:
    return (rank + step) % 2 == 0


def x_of(rank: int, step: int) -> Tensor:
    return rank_input(rank, (3, 4), step)


def loss_of(model: nn.Module, rank: int, step: int, search: bool) -> Tensor:
    out: Tensor = model(x_of(rank, step), rank, uses_extra(rank, step) or not search)
    return out.pow(2).sum()


def grads_of(model: nn.Module) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


Record = dict[str, Any]


def train(
    pg: reducer.ProcessGroup,
    batches: Sequence[int],
    *,
    divide: bool = True,
    search: bool = False,
    torch_join: bool = False,
    hook: reducer.CommHook | None = None,
    **options: Any,
) -> Record:
    """Rank ``pg.rank()``'s training under join: its batches, then shadowing the others."""
    rank = pg.rank()
    model = net()
    with torch.no_grad():  # a rank-specific start: construction must broadcast rank 0's
        model.head.bias.add_(rank)
    group = None if torch_join else pg  # torch's Join: the default group's wrapper
    ddp = DDP(model, group, bucket_cap_mb=TINY_MB, find_unused_parameters=search, **options)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    context = (
        Join([ddp], divide_by_initial_world_size=divide)
        if torch_join
        else ddp.join(divide_by_initial_world_size=divide)
    )
    with context:
        for step in range(batches[rank]):
            optimizer.zero_grad(set_to_none=True)
            loss_of(ddp, rank, step, search).backward()
            grads.append(grads_of(model))
            optimizer.step()
    return {
        "grads": grads,
        "params": [p.detach().clone() for p in model.parameters()],
        "count": float(model.count),
        "seen": list(model.seen),
    }


def expected(
    world_size: int,
    batches: Sequence[int],
    *,
    divide: bool,
    search: bool,
    scaling: Scaling = "reciprocal",
) -> tuple[list[list[Tensor | None]], list[Tensor]]:
    """Per step, the gradients the ranks still training hold; and everyone's final
    parameters (those of the last rank to run out)."""
    reference = net()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR)
    per_step = []
    for step in range(max(batches)):
        training = [r for r in range(world_size) if batches[r] > step]
        divisor = world_size if divide else len(training)
        contributions = []
        for r in range(world_size):
            if r not in training:
                contributions.append([None] * len(list(reference.parameters())))
                continue
            local = net()
            local.load_state_dict(reference.state_dict())
            loss_of(local, r, step, search).backward()
            contributions.append(grads_of(local))
        want = [
            rank_order_average([c[i] for c in contributions], divisor, scaling=scaling)
            for i in range(len(contributions[0]))
        ]
        per_step.append(want)
        optimizer.zero_grad(set_to_none=True)
        for p, g in zip(reference.parameters(), want, strict=True):
            p.grad = g
        optimizer.step()
    return per_step, [p.detach().clone() for p in reference.parameters()]


def check(
    records: list[Record],
    batches: Sequence[int],
    *,
    divide: bool,
    search: bool,
    scaling: Scaling = "reciprocal",
) -> None:
    """``scaling``: DDP multiplies by the reciprocal of the divisor, as torch's; the built-in
    comm hooks divide."""
    world_size = len(batches)
    per_step, final = expected(world_size, batches, divide=divide, search=search, scaling=scaling)
    for rank, record in enumerate(records):
        assert len(record["grads"]) == batches[rank]
        for step, got in enumerate(record["grads"]):
            for i, (g, w) in enumerate(zip(got, per_step[step], strict=True)):
                where = f"rank {rank}, step {step}, parameter {i}"
                if w is None:
                    assert g is None, f"{where}: no training rank used it; .grad must stay None"
                else:
                    assert g is not None and torch.equal(g, w), where
        for i, (p, w) in enumerate(zip(record["params"], final, strict=True)):
            assert torch.equal(p, w), f"rank {rank}, final parameter {i}"


# -------------------------------------------------------------------------------------------
# Exact gradients while ranks run out, and the final model.


@pytest.mark.parametrize("divide", [True, False], ids=["by-world-size", "by-training-ranks"])
def test_ranks_still_training_get_the_exact_average(divide: bool, no_leaked_threads: None) -> None:
    """Rank 2 runs out after one batch, rank 0 after two, rank 1 trains four."""
    batches = [2, 4, 1]
    records = run_ranks(lambda pg: train(pg, batches, divide=divide), len(batches))
    check(records, batches, divide=divide, search=False)


@pytest.mark.parametrize(
    "options",
    [
        {"search": True},
        {"static_graph": True},
        {"gradient_as_bucket_view": True, "search": True},
        {"broadcast_buffers": False, "divide": False},
    ],
    ids=["find-unused", "static-graph", "bucket-view", "no-buffers"],
)
def test_join_with_other_options(options: dict[str, Any]) -> None:
    """Rank 0 gets no batch at all (it shadows from the start: the first iteration, the
    rebuild of the buckets from its order, the static graph's recording); with the search,
    ``extra`` is unused on some ranks and steps, and on every training rank at some step."""
    batches = [0, 3, 2, 1]
    divide = options.pop("divide", True)
    search = options.get("search", False)
    records = run_ranks(lambda pg: train(pg, batches, divide=divide, **options), len(batches))
    check(records, batches, divide=divide, search=search)


def test_with_a_comm_hook_the_joined_ranks_run_it_on_zeros() -> None:
    batches = [1, 3, 2]
    # Per rank, per iteration: the sum of |buffer| of each bucket the hook saw.
    seen: dict[int, list[list[float]]] = {r: [[]] for r in range(3)}

    def hook(state: object, bucket: reducer.GradBucket) -> torch.futures.Future[Tensor]:
        iterations = seen[bucket._process_group.rank()]
        iterations[-1].append(float(bucket.buffer().abs().sum()))
        if bucket.is_last():
            iterations.append([])
        return reducer.allreduce_hook(state, bucket)

    records = run_ranks(lambda pg: train(pg, batches, hook=hook), 3)
    check(records, batches, divide=True, search=False, scaling="divide")
    for rank in range(3):
        iterations = seen[rank][:-1]
        # The hook ran for every iteration, on the bucket's zeros once the rank ran out.
        assert len(iterations) == max(batches)
        assert all(s > 0.0 for it in iterations[: batches[rank]] for s in it)
        assert all(s == 0.0 for it in iterations[batches[rank] :] for s in it)
        assert [len(it) for it in iterations] == [len(it) for it in seen[0][:-1]]


def test_buffers_come_from_the_highest_rank_still_training() -> None:
    """Each forward starts from the buffer of the highest rank still training, which bumped
    it by its ``rank + 1`` in the step before; the final buffer is the last rank's."""
    batches = [3, 1, 2]
    records = run_ranks(lambda pg: train(pg, batches), 3)
    value, want_seen = 0.0, []
    for step in range(max(batches)):
        root = max(r for r in range(3) if batches[r] > step)
        if step:
            value += root + 1  # root's own bump in the step before
        want_seen.append(value)
    for rank, record in enumerate(records):
        assert record["seen"] == want_seen[: batches[rank]]
        assert record["count"] == want_seen[-1] + 1  # rank 0 trained last: its final bump


# -------------------------------------------------------------------------------------------
# throw_on_early_termination, enable=False, no_sync inside join.


def local_grads(rank: int, step: int) -> list[Tensor | None]:
    model = net()
    loss_of(model, rank, step, False).backward()
    return grads_of(model)


def average(world_size: int, step: int) -> list[Tensor | None]:
    """Every rank trains ``step`` from the initial parameters: the plain DDP average."""
    per_rank = [local_grads(r, step) for r in range(world_size)]
    return [
        rank_order_average([g[i] for g in per_rank], world_size, scaling="reciprocal")
        for i in range(6)
    ]


def check_exact(got: Sequence[Tensor | None], want: Sequence[Tensor | None], what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert (g is None) == (w is None), f"{what}: parameter {i}"
        assert g is None or (w is not None and torch.equal(g, w)), f"{what}: parameter {i}"


def test_throw_on_early_termination_raises_on_every_rank_and_training_goes_on() -> None:
    """Rank 1 runs out after one batch: it raises on leaving the block, the others in the
    forward of their second batch. Then every rank is in step: one more iteration without
    join reduces over all of them (no optimizer: the parameters are the initial ones)."""
    batches = [3, 1, 2]

    def fn(pg: fakepg.FakeProcessGroup) -> Record:
        rank = pg.rank()
        model = net()
        ddp = DDP(model, pg)
        steps = []

        def run_out() -> None:
            with ddp.join(throw_on_early_termination=True):
                for step in range(batches[rank]):
                    ddp.zero_grad(set_to_none=True)
                    loss_of(ddp, rank, step, False).backward()
                    steps.append(step)

        with pytest.raises(RuntimeError) as info:
            run_out()
        ddp.zero_grad(set_to_none=True)
        loss_of(ddp, rank, 5, False).backward()
        return {"error": info.value, "steps": steps, "grads": grads_of(model)}

    want = average(3, 5)
    for rank, record in enumerate(run_ranks(fn, 3)):
        error = record["error"]
        assert isinstance(error, reducer.ReductionError)
        if rank == 1:
            assert "Rank 1 exhausted all inputs" in str(error)
        else:
            assert "Detected at least one rank that exhausted inputs" in str(error)
        assert "throw_on_early_termination" in str(error)
        assert record["steps"] == [0]  # every rank stopped at its second batch, or before
        check_exact(record["grads"], want, f"rank {rank} after the error")


def test_join_disabled_is_plain_training() -> None:
    """enable=False: nothing is shadowed; with even inputs that is plain DDP."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[Tensor | None]:
        model = net()
        ddp = DDP(model, pg)
        with ddp.join(enable=False):
            loss_of(ddp, pg.rank(), 0, False).backward()
        return grads_of(model)

    want = average(2, 0)
    for rank, got in enumerate(run_ranks(fn, 2)):
        check_exact(got, want, f"rank {rank}")


def test_no_sync_inside_join_is_not_shadowed() -> None:
    """Rank 1 has no batch; rank 0 accumulates one micro-batch under no_sync, then syncs:
    rank 1 shadows the synced iteration only, and rank 0 gets its accumulated sum / 2."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[Tensor | None]:
        model = net()
        ddp = DDP(model, pg)
        with ddp.join():
            if pg.rank() == 0:
                with ddp.no_sync():
                    loss_of(ddp, 0, 0, False).backward()
                loss_of(ddp, 0, 1, False).backward()
        return grads_of(model)

    local = net()
    loss_of(local, 0, 0, False).backward()
    loss_of(local, 0, 1, False).backward()
    want = [rank_order_average([g, None], 2, scaling="reciprocal") for g in grads_of(local)]
    check_exact(run_ranks(fn, 2)[0], want, "rank 0")


# -------------------------------------------------------------------------------------------
# torch's Join context manager, and what it needs.


@pytest.mark.parametrize("divide", [True, False])
def test_torchs_join_context_manager_runs_this_wrapper(divide: bool) -> None:
    """``Join([ddp])`` from torch.distributed.algorithms.join, over the fake world's torch
    backend: torch's context manager, this wrapper's hooks; the same exact results."""
    batches = [2, 1, 3]
    records = fakepg.run_torch(
        lambda pg: train(pg, batches, divide=divide, torch_join=True), 3, timeout=20.0
    )
    check(records, batches, divide=divide, search=False)


def test_torchs_join_needs_a_torch_group() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> str:
        ddp = DDP(net(), pg)
        with pytest.raises(reducer.InvalidArgument) as info:
            Join([ddp])
        return str(info.value)

    for message in run_ranks(fn, 2):
        assert "torch's Join" in message and "ddp.join()" in message


def test_the_wrapper_is_a_torch_joinable() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> tuple[bool, torch.device, bool]:
        ddp = DDP(net(), pg)  # the fake group itself: the default group forwards to it
        joinable = isinstance(ddp, torch.distributed.algorithms.join.Joinable)
        return joinable, ddp.join_device, ddp.join_process_group is dist.group.WORLD

    for joinable, device, group in fakepg.run_torch(fn, 2, timeout=20.0):
        assert joinable and device == torch.device("cpu") and group


# -------------------------------------------------------------------------------------------
# torch's own DistributedDataParallel under its join, on the fake world's torch backend.


def train_torch(
    pg: fakepg.FakeProcessGroup, batches: Sequence[int], *, divide: bool, search: bool
) -> Record:
    """``train``, with torch's DistributedDataParallel and its ``join()``."""
    rank = pg.rank()
    model = net()
    with torch.no_grad():
        model.head.bias.add_(rank)
    ddp = nn.parallel.DistributedDataParallel(
        model, bucket_cap_mb=TINY_MB, find_unused_parameters=search
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    grads = []
    with ddp.join(divide_by_initial_world_size=divide):
        for step in range(batches[rank]):
            optimizer.zero_grad(set_to_none=True)
            loss_of(ddp, rank, step, search).backward()
            grads.append(grads_of(model))
            optimizer.step()
    return {
        "grads": grads,
        "params": [p.detach().clone() for p in model.parameters()],
        "count": float(model.count),
        "seen": list(model.seen),
    }


def run_both(batches: Sequence[int], *, divide: bool, search: bool) -> list[tuple[Record, Record]]:
    """Per rank: torch's DDP under its join, then this wrapper under torch's Join, in the
    same rank threads."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[Record, Record]:
        theirs = train_torch(pg, batches, divide=divide, search=search)
        ours = train(pg, batches, divide=divide, search=search, torch_join=True)
        return theirs, ours

    return fakepg.run_torch(fn, len(batches), timeout=20.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("divide", "search"),
    [(True, True), (False, False), (False, True)],
    ids=["find-unused", "by-training-ranks", "by-training-ranks-find-unused"],
)
def test_torchs_ddp_under_its_join_gets_the_exact_average(divide: bool, search: bool) -> None:
    """torch's own join, with find_unused_parameters or divide_by_initial_world_size=False.
    Four ranks running out after 1, 1, 3 and 2 batches: every divisor (4, or the 4, 2, 1
    ranks still training) is a power of two, where torch's multiplication by the reciprocal
    is the reference's division, so torch's gradients and parameters must be exact. (A joined
    rank shadows the used-map allreduce with a bare tensor, and torch's C++ reducer keeps
    Join's work to read the divisor: see Note [The bindings' argument forms] and Note [Works
    that C++ keeps] in fakepg.torch_backend.) The buffers are this wrapper's, exactly."""
    batches = [1, 1, 3, 2]
    records = run_both(batches, divide=divide, search=search)
    check([theirs for theirs, _ in records], batches, divide=divide, search=search)
    for rank, (theirs, ours) in enumerate(records):
        assert theirs["seen"] == ours["seen"], f"rank {rank}"
        assert theirs["count"] == ours["count"], f"rank {rank}"


@pytest.mark.timeout(120)
def test_torchs_joined_ranks_replay_their_last_used_map() -> None:
    """Where torch's join differs from this wrapper's, exactly. With find_unused_parameters, a
    rank that has joined shadows the used-map allreduce with the map it holds, which is the
    allreduced map of the last iteration it took part in, not zeros. So once a rank has joined,
    a parameter used in one iteration counts as used in every later one: where no rank still
    training used it, torch writes a zero gradient where this wrapper (and the reference)
    leave None. Everything else is exact (the divisor is 4)."""
    batches = [0, 3, 2, 1]
    world_size = len(batches)
    per_step, final = expected(world_size, batches, divide=True, search=True)
    n_params = len(per_step[0])
    # What torch counts as used, per step and parameter: used by a rank still training, or
    # counted as used in the step before while some rank has joined.
    used_before = [False] * n_params
    torch_used = []
    for step in range(max(batches)):
        joined = any(b <= step for b in batches)
        now = [
            w is not None or (joined and before)
            for w, before in zip(per_step[step], used_before, strict=True)
        ]
        torch_used.append(now)
        used_before = now
    records = run_both(batches, divide=True, search=True)
    replayed = 0
    for rank, (theirs, _) in enumerate(records):
        assert len(theirs["grads"]) == batches[rank]
        for step, got in enumerate(theirs["grads"]):
            for i, (g, w) in enumerate(zip(got, per_step[step], strict=True)):
                where = f"rank {rank}, step {step}, parameter {i}"
                if w is not None:
                    assert g is not None and torch.equal(g, w), where
                elif torch_used[step][i]:
                    assert g is not None and not g.any(), f"{where}: torch writes zeros"
                    replayed += 1
                else:
                    assert g is None, where
        for i, (p, w) in enumerate(zip(theirs["params"], final, strict=True)):
            assert torch.equal(p, w), f"rank {rank}, final parameter {i}"
    assert replayed > 0  # the case this test is about occurs
