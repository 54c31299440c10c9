"""DistributedDataParallel over a real gloo group: torch's construction, and join.

The ranks are threads of this process, each with its own torch.distributed state (fakepg's
registration makes that state per thread; see Note [Per-thread torch.distributed state] in
fakepg.torch_backend) and a gloo group over loopback. Data are dyadic (small multiples of
1/2), so sums and the division by W = 2 are exact whatever order gloo adds in, and results
are compared bit for bit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.algorithms.join import Join

import fakepg
import reducer

T = TypeVar("T")
WORLD_SIZE = 2
TIMEOUT_S = 20.0


def run_gloo(fn: Callable[[int], T], world_size: int = WORLD_SIZE) -> list[T]:
    """``fn(rank)`` on one thread per rank, each inside its own gloo default group."""
    fakepg.register_torch_backend()  # torch.distributed state per thread
    store = dist.HashStore()  # type: ignore[attr-defined]
    results: list[Any] = [None] * world_size
    errors: list[BaseException | None] = [None] * world_size

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group(
                "gloo",
                rank=rank,
                world_size=world_size,
                store=store,
                timeout=timedelta(seconds=TIMEOUT_S),
            )
            try:
                results[rank] = fn(rank)
            finally:
                dist.destroy_process_group()
        except BaseException as exc:  # reported below, in the test's thread
            errors[rank] = exc

    threads = [
        threading.Thread(target=rank_main, args=(r,), name=f"gloo-rank-{r}", daemon=True)
        for r in range(world_size)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT_S)
        assert not t.is_alive(), f"{t.name} did not finish"
    for rank, error in enumerate(errors):
        if error is not None:
            raise AssertionError(f"rank {rank} failed") from error
    return results


def dyadic(shape: tuple[int, ...], seed: int) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, shape, generator=gen).to(torch.float32) * 0.5


def model() -> nn.Module:
    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        for i, p in enumerate(net.parameters()):
            p.copy_(dyadic(tuple(p.shape), i))
    return net


def loss_of(net: nn.Module, rank: int, step: int) -> Tensor:
    out: Tensor = net(dyadic((3, 4), 100 * step + rank)).sum() * WORLD_SIZE
    return out


def grads_of(net: nn.Module) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in net.parameters()]


def expected(ranks: list[int], step: int) -> list[Tensor]:
    """The average over ``ranks`` (the others contribute zeros) of the local gradients at
    ``step`` from the initial parameters, divided by the world size: exact on dyadic data."""
    total: list[Tensor] = []
    for rank in ranks:
        local = model()
        loss_of(local, rank, step).backward()
        grads = [p.grad for p in local.parameters() if p.grad is not None]
        total = grads if not total else [a + b for a, b in zip(total, grads, strict=True)]
    return [g / WORLD_SIZE for g in total]


def test_constructed_as_torchs_ddp_over_the_default_gloo_group() -> None:
    """``DistributedDataParallel(model)``: the default group, through TorchProcessGroup; a
    raw torch group given works the same; both equal torch's DDP and the exact average."""

    def fn(rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, make in (
            ("default", lambda m: reducer.DistributedDataParallel(m)),
            ("raw", lambda m: reducer.DistributedDataParallel(m, dist.group.WORLD)),
            ("torch", lambda m: nn.parallel.DistributedDataParallel(m)),
        ):
            net = model()
            ddp = make(net)
            loss_of(ddp, rank, 0).backward()
            out[name] = grads_of(net)
            if name != "torch":
                group = ddp._group  # what it reduces over; process_group is torch's, as given
                out[f"{name}-group"] = (
                    ddp.process_group is dist.group.WORLD
                    and isinstance(group, reducer.TorchProcessGroup)
                    and group.torch_group is dist.group.WORLD
                    and group.backend == "gloo"
                )
        return out

    want = expected([0, 1], 0)
    for record in run_gloo(fn):
        assert record["default-group"] and record["raw-group"]
        for name in ("default", "raw", "torch"):
            for g, w in zip(record[name], want, strict=True):
                assert g is not None and torch.equal(g, w), name


def test_join_over_gloo_with_either_context_manager() -> None:
    """Rank 1 has one batch, rank 0 three; no optimizer, so every step starts from the same
    parameters: rank 0's later steps get its own gradient / 2 (rank 1 contributes zeros)."""
    batches = [3, 1]

    def fn(rank: int) -> dict[str, list[list[Tensor | None]]]:
        out = {}
        for name in ("ddp.join", "torch Join"):
            net = model()
            ddp = reducer.DistributedDataParallel(net, bucket_cap_mb=1e-5)
            grads = []
            with ddp.join() if name == "ddp.join" else Join([ddp]):
                for step in range(batches[rank]):
                    net.zero_grad(set_to_none=True)
                    loss_of(ddp, rank, step).backward()
                    grads.append(grads_of(net))
            out[name] = grads
        return out

    for rank, record in enumerate(run_gloo(fn)):
        for name, grads in record.items():
            assert len(grads) == batches[rank], name
            for step, got in enumerate(grads):
                want = expected([r for r in range(WORLD_SIZE) if batches[r] > step], step)
                for g, w in zip(got, want, strict=True):
                    assert g is not None and torch.equal(g, w), (name, rank, step)


def test_ranks_built_with_different_caps_agree_as_torchs_do() -> None:
    """Rank 0 built with bucket_cap_mb=1e-5, rank 1 with 25: torch 2.13 keeps one bucket in
    the first iteration, then takes rank 0's rebuilt bucket indices on both ranks, and
    averages; this wrapper does the same, bucket for bucket (as a comm hook sees them: index
    and size) and bit for bit."""
    caps = [1e-5, 25.0]  # about 10 bytes on rank 0: the rebuilt buckets split
    steps = 3

    def fn(rank: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, make in (
            ("ours", reducer.DistributedDataParallel),
            ("torch", nn.parallel.DistributedDataParallel),
        ):
            net = model()
            ddp = make(net, bucket_cap_mb=caps[rank])
            seen: list[tuple[int, int]] = []

            # Unannotated, as torch's check wants (an annotation here would be a string).
            def record(bucket: Any, seen: list[tuple[int, int]] = seen) -> Any:
                seen.append((bucket.index(), bucket.buffer().numel()))
                return bucket

            ddp.register_comm_hook(
                None,
                lambda state, bucket: allreduce_hook(state, record(bucket)),  # type: ignore[arg-type]
            )
            grads = []
            for step in range(steps):
                net.zero_grad(set_to_none=True)
                loss_of(ddp, rank, step).backward()
                grads.append(grads_of(net))
            out[name] = grads
            out[f"{name}-buckets"] = seen
        return out

    records = run_gloo(fn)
    torch_buckets = records[0]["torch-buckets"]
    assert torch_buckets[0] == (0, 30), "one bucket in the first iteration"
    assert len(torch_buckets) > 1 + 2, "rank 0's rebuilt buckets split the parameters"
    for rank, record in enumerate(records):
        assert record["ours-buckets"] == record["torch-buckets"] == torch_buckets, rank
        for step in range(steps):
            want = expected([0, 1], step)
            for name in ("ours", "torch"):
                for g, w in zip(record[name][step], want, strict=True):
                    assert g is not None and torch.equal(g, w), (name, rank, step)
