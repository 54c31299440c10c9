"""fakepg as a torch.distributed backend: init from threads, torch's DDP on it, failures.

torch's DDP on the "fakepg" backend is compared with torch's DDP on gloo (run on threads of this
process, which the per-thread state of the backend makes possible) within rtol 1e-6 and atol
1e-7: gloo may add in another order. Against the rank-order reference of DESIGN.md, and across
ranks, the fakepg results must be bit-identical.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import pytest
import torch
import torch.distributed as dist
from helpers import seeded
from torch import nn

import fakepg
import reducer
from reducer.testing.reference import rank_order_average

T = TypeVar("T")

RTOL, ATOL = 1e-6, 1e-7  # fakepg vs gloo: the same sums, perhaps added in another order


pytestmark = pytest.mark.usefixtures("fakepg_torch_backend")


def model() -> nn.Module:
    return seeded(lambda: nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)), seed=3)


def batch(rank: int, step: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def ddp_grads(world_size: int) -> Callable[[int], list[list[torch.Tensor]]]:
    """Per step, the gradients torch's DDP gives on ``rank`` (two steps, small buckets)."""

    def fn(rank: int) -> list[list[torch.Tensor]]:
        net = model()
        ddp = nn.parallel.DistributedDataParallel(net, bucket_cap_mb=1e-4)
        steps = []
        for step in range(2):
            ddp.zero_grad(set_to_none=True)
            ddp(batch(rank, step)).pow(2).sum().backward()
            steps.append([p.grad.clone() for p in net.parameters() if p.grad is not None])
        return steps

    return fn


def run_gloo_threads(fn: Callable[[int], T], world_size: int, timeout: float = 30.0) -> list[T]:
    """``fn(rank)`` on one thread per rank, each with a gloo default group (one process)."""
    store = dist.HashStore()
    results: list[T | None] = [None] * world_size
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group(
                "gloo",
                rank=rank,
                world_size=world_size,
                store=store,
                timeout=timedelta(seconds=timeout),
            )
            try:
                results[rank] = fn(rank)
            finally:
                dist.destroy_process_group()
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world_size)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a gloo rank thread did not finish"
    if errors:
        raise errors[0]
    return [r for r in results if r is not None]


def test_init_process_group_from_each_rank_thread() -> None:
    with fakepg.World(3, timeout=20.0) as world:
        store = dist.HashStore()

        def fn(pg: fakepg.FakeProcessGroup) -> tuple[int, int, str, torch.Tensor]:
            dist.init_process_group(
                "fakepg", rank=pg.rank(), world_size=3, store=store, pg_options=world
            )
            try:
                t = torch.full((4,), float(pg.rank() + 1))
                dist.all_reduce(t)
                return dist.get_rank(), dist.get_world_size(), dist.get_backend(), t
            finally:
                dist.destroy_process_group()

        results = world.run(fn)
    for rank, (r, size, backend, t) in enumerate(results):
        assert (r, size, backend) == (rank, 3, "fakepg")
        assert torch.equal(t, torch.full((4,), 6.0))
    assert not dist.is_initialized()  # this thread's state was never touched


def test_init_without_the_world_says_how_to_pass_it() -> None:
    with pytest.raises(ValueError, match="pass pg_options=world"):
        dist.init_process_group("fakepg", rank=0, world_size=1, store=dist.HashStore())
    assert not dist.is_initialized()


def ddp_reference(contributions: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """What torch's DDP computes on a rank-order SUM: each bucket scaled by 1/W (a multiply by
    the reciprocal, which differs from a division by W in the last bit for W=3), then summed
    in rank order."""
    acc = contributions[0] * (1 / world_size)
    for g in contributions[1:]:
        acc = acc + g * (1 / world_size)
    return acc


def test_ddp_on_fakepg_is_bit_identical_across_ranks_and_matches_the_reference() -> None:
    world_size = 3
    per_rank = fakepg.run_torch(
        lambda pg: ddp_grads(world_size)(pg.rank()), world_size, timeout=20.0
    )
    for step in range(2):
        local = []
        for rank in range(world_size):
            net = model()  # no optimizer step in ddp_grads: the same parameters every step
            net(batch(rank, step)).pow(2).sum().backward()
            local.append([p.grad for p in net.parameters() if p.grad is not None])
        for i in range(len(local[0])):
            want = ddp_reference([local[r][i] for r in range(world_size)], world_size)
            for rank in range(world_size):
                got = per_rank[rank][step][i]
                assert torch.equal(got, per_rank[0][step][i]), f"rank {rank} differs from rank 0"
                assert torch.equal(got, want), f"parameter {i}, step {step}"


def test_ddp_on_fakepg_matches_ddp_on_gloo() -> None:
    world_size = 3
    fake = fakepg.run_torch(lambda pg: ddp_grads(world_size)(pg.rank()), world_size)
    gloo = run_gloo_threads(ddp_grads(world_size), world_size)
    for rank in range(world_size):
        for step in range(2):
            for got, want in zip(fake[rank][step], gloo[rank][step], strict=True):
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_collectives_are_asynchronous() -> None:
    rank1_may_issue = threading.Event()

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[bool, torch.Tensor]:
        t = torch.full((3,), float(pg.rank() + 1))
        if pg.rank() == 1:
            assert rank1_may_issue.wait(10.0)
            dist.all_reduce(t)
            return True, t
        work = dist.all_reduce(t, async_op=True)
        assert work is not None
        future = work.get_future()
        # Returned before rank 1 even issued its part: nothing has moved yet.
        pending = not work.is_completed() and not future.done() and torch.equal(t, torch.ones(3))
        rank1_may_issue.set()
        work.wait()
        assert work.is_completed() and future.done()
        assert future.value()[0] is t  # the future completes with the output tensors
        return pending, t

    results = fakepg.run_torch(fn, 2, timeout=20.0)
    assert results[0][0], "rank 0's all_reduce completed before rank 1 issued it"
    for _, t in results:
        assert torch.equal(t, torch.full((3,), 3.0))


def test_wait_with_a_timeout_names_the_missing_rank() -> None:
    timed_out = threading.Event()

    def fn(pg: fakepg.FakeProcessGroup) -> str:
        if pg.rank() == 1:
            assert timed_out.wait(10.0)
            with pytest.raises(fakepg.CollectiveTimeout):  # it failed for every rank
                dist.all_reduce(torch.ones(2))
            return ""
        work = dist.all_reduce(torch.ones(2), async_op=True)
        assert work is not None
        with pytest.raises(fakepg.CollectiveTimeout) as info:
            work.wait(timedelta(seconds=0.2))
        timed_out.set()
        return str(info.value)

    message = fakepg.run_torch(fn, 2, timeout=20.0)[0]
    assert "allreduce #0" in message and "timed out after 0.2 s" in message
    assert "rank 1" in message


def test_two_worlds_at_once() -> None:
    both_initialized = threading.Barrier(4, timeout=20.0)  # 2 worlds x 2 ranks

    def in_world(offset: float) -> Callable[[fakepg.FakeProcessGroup], torch.Tensor]:
        def fn(pg: fakepg.FakeProcessGroup) -> torch.Tensor:
            both_initialized.wait()  # every rank of both worlds holds a default group "0" now
            t = torch.full((2,), offset + pg.rank())
            dist.all_reduce(t)
            both_initialized.wait()
            return t

        return fn

    results: dict[float, list[torch.Tensor]] = {}

    def run_world(offset: float) -> None:
        results[offset] = fakepg.run_torch(in_world(offset), 2, timeout=20.0)

    threads = [threading.Thread(target=run_world, args=(o,)) for o in (10.0, 100.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30.0)
    assert not any(t.is_alive() for t in threads)
    assert [t.tolist() for t in results[10.0]] == [[21.0, 21.0]] * 2
    assert [t.tolist() for t in results[100.0]] == [[201.0, 201.0]] * 2


@pytest.mark.parametrize("where", ["all_reduce", "ddp_backward"])
def test_a_failing_rank_wakes_the_others(where: str) -> None:
    woke: list[str] = []

    def fn(pg: fakepg.FakeProcessGroup) -> None:
        net = model()
        ddp = nn.parallel.DistributedDataParallel(net)
        if pg.rank() == 1:
            time.sleep(0.2)  # let the others block first
            raise KeyError("rank 1 fails on purpose")
        try:
            if where == "all_reduce":
                dist.all_reduce(torch.ones(2))
            else:
                ddp(batch(pg.rank(), 0)).sum().backward()
        except Exception as exc:
            woke.append(str(exc))
            raise

    start = time.monotonic()
    with pytest.raises(KeyError, match="fails on purpose") as info:
        fakepg.run_torch(fn, 3, timeout=30.0)
    assert time.monotonic() - start < 15.0  # woken by the abort, not by the 30 s timeout
    assert "raised on rank 1 of 3 in fakepg.run" in info.value.__notes__
    assert len(woke) == 2 and all("rank 1 failed" in m for m in woke)


@pytest.mark.filterwarnings("ignore:.*reduce_scatter_tensor.* is deprecated:FutureWarning")
def test_what_the_fake_world_refuses_says_what_to_do() -> None:
    """A receive from any source (its match would depend on thread timing) and reduce ops the
    fake world lacks are refused on the calling rank, saying what to pass instead."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[str]:
        messages = []
        with pytest.raises(RuntimeError, match="recv from any source") as info:
            dist.irecv(torch.empty(2))
        messages.append(str(info.value))
        with pytest.raises(ValueError, match=r"reduce op .* is not supported") as err:
            dist.reduce_scatter_tensor(torch.empty(1), torch.ones(2), op=dist.ReduceOp.BAND)
        messages.append(str(err.value))
        dist.barrier()  # nothing above consumed a sequence number
        return messages

    for messages in fakepg.run_torch(fn, 2, timeout=20.0):
        assert "pass src" in messages[0]
        assert "use SUM, AVG, PRODUCT, MIN or MAX" in messages[1]


# all_gather_into_tensor is in every supported torch; 2.13 renamed it all_gather_single and
# keeps the old name, deprecated, as an alias to the same backend call.
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_torch_collectives_and_objects_on_fakepg() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> tuple[object, ...]:
        r = pg.rank()
        avg = torch.full((2,), float(r))
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        top = torch.tensor([float(r)])
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        flat = torch.empty(6)
        dist.all_gather_into_tensor(flat, torch.full((2,), float(r)))
        b = torch.full((2,), float(r))
        dist.broadcast(b, src=2)
        objects: list[object] = [None] * 3
        dist.all_gather_object(objects, {"rank": r})
        dist.barrier()
        return avg.tolist(), top.item(), flat.tolist(), b.tolist(), objects

    for avg, top, flat, b, objects in fakepg.run_torch(fn, 3, timeout=20.0):
        assert avg == [1.0, 1.0] and top == 2.0 and b == [2.0, 2.0]
        assert flat == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0]
        assert objects == [{"rank": 0}, {"rank": 1}, {"rank": 2}]


def test_reducer_through_torch_process_group_on_the_fakepg_backend() -> None:
    """The adapter works on any registered backend: the reducer over TorchProcessGroup over
    the fakepg torch backend still gives the bit-exact rank-order average."""
    world_size = 3

    def fn(pg: fakepg.FakeProcessGroup) -> list[torch.Tensor]:
        net = model()
        params = list(net.parameters())
        tpg = reducer.TorchProcessGroup(dist.group.WORLD)  # type: ignore[arg-type]
        buckets = reducer.ddp_bucket_assignment(params, bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
        with reducer.Reducer([params], buckets, tpg) as red:
            red.prepare_for_backward([])
            net(batch(pg.rank(), 0)).pow(2).sum().backward()
        return [p.grad.clone() for p in params if p.grad is not None]

    per_rank = fakepg.run_torch(fn, world_size, timeout=20.0)
    local = []
    for rank in range(world_size):
        net = model()
        net(batch(rank, 0)).pow(2).sum().backward()
        local.append([p.grad for p in net.parameters()])
    for i in range(len(local[0])):
        want = rank_order_average([local[r][i] for r in range(world_size)], world_size)
        for rank in range(world_size):
            assert want is not None and torch.equal(per_rank[rank][i], want)


@pytest.mark.slow
def test_importing_fakepg_registers_nothing() -> None:
    code = (
        "import fakepg, torch.distributed as dist\n"
        "before = hasattr(dist.Backend, 'FAKEPG')\n"
        "fakepg.register_torch_backend(); fakepg.register_torch_backend()\n"
        "print(before, hasattr(dist.Backend, 'FAKEPG'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["False", "True"]


def test_run_torch_leaves_excepthook_and_survives_the_init_barrier(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With TORCH_DIST_INIT_BARRIER=1 every init waits for the others' inits: none may hold a
    lock the others need. And the excepthook torch installs per init is put back."""
    monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", "1")
    hook = sys.excepthook
    start = time.monotonic()
    results = fakepg.run_torch(lambda pg: dist.get_rank(), 3, timeout=10.0)
    assert results == [0, 1, 2]
    assert time.monotonic() - start < 8.0  # not released by a timeout
    assert sys.excepthook is hook


# -------------------------------------------------------------------------------------------
# Every torch.distributed collective, subgroups and DeviceMesh.


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_every_torch_collective_on_fakepg() -> None:
    world_size = 3

    def fn(pg: fakepg.FakeProcessGroup) -> dict[str, object]:
        r = pg.rank()
        out: dict[str, object] = {}
        t = torch.full((2,), float(r + 1))
        dist.reduce(t, dst=2)
        out["reduce"] = t.tolist()
        rs = torch.empty(2)
        dist.reduce_scatter(rs, [torch.full((2,), 10.0 * d + r) for d in range(world_size)])
        out["reduce_scatter"] = rs.tolist()
        rst = torch.empty(2)
        dist.reduce_scatter_tensor(rst, torch.arange(6.0) * (r + 1), op=dist.ReduceOp.AVG)
        out["reduce_scatter_tensor"] = rst.tolist()
        a2a = [torch.empty(s + 1) for s in range(world_size)]
        dist.all_to_all(a2a, [torch.full((r + 1,), float(10 * r + d)) for d in range(world_size)])
        out["all_to_all"] = [x.tolist() for x in a2a]
        in_splits = [d + 1 for d in range(world_size)]  # rank r sends d + 1 rows to rank d
        single = torch.empty((r + 1) * world_size)
        dist.all_to_all_single(
            single,
            torch.cat([torch.full((n,), float(10 * r + d)) for d, n in enumerate(in_splits)]),
            output_split_sizes=[r + 1] * world_size,
            input_split_sizes=in_splits,
        )
        out["all_to_all_single"] = single.tolist()
        gathered = [torch.empty(1) for _ in range(world_size)] if r == 1 else None
        dist.gather(torch.tensor([float(r)]), gathered, dst=1)
        out["gather"] = None if gathered is None else [g.item() for g in gathered]
        mine = torch.empty(1)
        dist.scatter(mine, [torch.tensor([7.0 * d]) for d in range(world_size)] if r == 0 else None)
        out["scatter"] = mine.item()
        got = torch.empty(1)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, torch.tensor([float(r)]), (r + 1) % world_size),
                dist.P2POp(dist.irecv, got, (r - 1) % world_size),
            ]
        )
        for work in works:
            work.wait()
        out["ring"] = got.item()
        if r == 0:
            dist.send(torch.tensor([5.0, 6.0]), dst=2, tag=3)
        elif r == 2:
            x = torch.empty(2)
            out["recv_from"] = dist.recv(x, src=0, tag=3)
            out["recv"] = x.tolist()
        coalesced = [torch.empty(world_size), torch.empty(2 * world_size)]
        with dist._coalescing_manager(async_ops=True) as manager:
            dist.all_gather_into_tensor(coalesced[0], torch.tensor([float(r)]))
            dist.all_gather_into_tensor(coalesced[1], torch.tensor([1.0, 2.0]) * r)
        manager.wait()
        out["all_gather_coalesced"] = [c.tolist() for c in coalesced]
        dist.monitored_barrier(timeout=timedelta(seconds=10))
        return out

    results = fakepg.run_torch(fn, world_size, timeout=20.0)
    for r, out in enumerate(results):
        assert out["reduce"] == ([6.0, 6.0] if r == 2 else [float(r + 1)] * 2)
        assert out["reduce_scatter"] == [30.0 * r + 3] * 2
        assert out["reduce_scatter_tensor"] == [2.0 * (2 * r), 2.0 * (2 * r + 1)]
        assert out["all_to_all"] == [[float(10 * s + r)] * (s + 1) for s in range(world_size)]
        assert out["all_to_all_single"] == [
            float(10 * s + r) for s in range(world_size) for _ in range(r + 1)
        ]
        assert out["gather"] == ([0.0, 1.0, 2.0] if r == 1 else None)
        assert out["scatter"] == 7.0 * r
        assert out["ring"] == float((r - 1) % world_size)
        assert out["all_gather_coalesced"] == [[0.0, 1.0, 2.0], [0.0, 0.0, 1.0, 2.0, 2.0, 4.0]]
    assert results[2]["recv_from"] == 0 and results[2]["recv"] == [5.0, 6.0]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_torch_ranks_that_call_different_collectives_see_both_sides() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> str:
        def issue() -> None:
            if pg.rank() == 0:
                dist.reduce_scatter_tensor(torch.empty(2), torch.ones(4))
            else:
                dist.all_gather_into_tensor(torch.empty(4), torch.ones(2))

        with pytest.raises(fakepg.CollectiveMismatch) as info:
            issue()
        return str(info.value)

    for text in fakepg.run_torch(fn, 2, timeout=20.0):
        assert "collective #0" in text
        assert "rank 0 issued reduce_scatter_tensor(op=SUM" in text
        assert "rank 1 issued allgather_into_tensor([float32[2]])" in text


def test_monitored_barrier_through_torch_names_the_ranks_that_did_not_arrive() -> None:
    release = threading.Event()

    def fn(pg: fakepg.FakeProcessGroup) -> str:
        if pg.rank() == 2:
            assert release.wait(10)
            return ""
        try:
            with pytest.raises(fakepg.CollectiveTimeout) as info:
                dist.monitored_barrier(timeout=timedelta(seconds=0.2), wait_all_ranks=True)
        finally:
            release.set()
        return str(info.value)

    with fakepg.World(3, timeout=20.0) as world:
        store = dist.HashStore()

        def rank_main(pg: fakepg.FakeProcessGroup) -> str:
            dist.init_process_group(
                "fakepg", rank=pg.rank(), world_size=3, store=store, pg_options=world
            )
            try:
                return fn(pg)
            finally:
                dist.destroy_process_group()

        texts = world.run(rank_main)
    for text in texts[:2]:
        assert "monitored_barrier #0 timed out after 0.2 s" in text
        assert "rank 2 did not arrive (ranks 0, 1 did)" in text


def test_a_recv_whose_sender_never_sends_names_it() -> None:
    sent_elsewhere = threading.Event()

    def fn(pg: fakepg.FakeProcessGroup) -> str:
        if pg.rank() == 0:
            assert sent_elsewhere.wait(10)  # busy elsewhere; never sends
            return ""
        work = dist.irecv(torch.empty(1), src=0)
        assert work is not None
        try:
            with pytest.raises(fakepg.CollectiveTimeout) as info:
                work.wait(timedelta(seconds=0.2))
        finally:
            sent_elsewhere.set()
        return str(info.value)

    text = fakepg.run_torch(fn, 2, timeout=20.0)[1]
    assert "send/recv #0 from rank 0 to rank 1 (tag 0) timed out after 0.2 s" in text
    assert "rank 0 never sent it (rank 1 posted the recv)" in text


def test_new_group_and_device_meshes_on_fakepg() -> None:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    def fn(pg: fakepg.FakeProcessGroup) -> dict[str, object]:
        r = pg.rank()
        out: dict[str, object] = {"world_name": dist.group.WORLD.group_name}  # type: ignore[union-attr]
        flat = init_device_mesh("cpu", (4,))
        out["flat"] = flat.get_group().group_name
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        for dim in ("replicate", "shard"):
            t = torch.tensor([float(r)])
            dist.all_reduce(t, group=mesh.get_group(dim))
            out[dim] = t.item()
        sub = dist.new_group([1, 3])
        if r in (1, 3):
            from_group = DeviceMesh.from_group(sub, "cpu")
            t = torch.tensor([float(r)])
            dist.all_reduce(t, group=from_group.get_group())
            out["sub"] = (t.item(), dist.get_rank(sub), dist.get_world_size(sub))
        return out

    results = fakepg.run_torch(fn, 4, timeout=20.0)
    for r, out in enumerate(results):
        assert out["world_name"] == out["flat"]  # a 1-D mesh over the world is the default group
        assert out["replicate"] == float(r % 2 + r % 2 + 2)  # ranks r % 2 and r % 2 + 2
        assert out["shard"] == float(2 * (r // 2) * 2 + 1)  # ranks 2 (r // 2) and + 1
        if r in (1, 3):
            assert out["sub"] == (4.0, [1, 3].index(r), 2)


# -------------------------------------------------------------------------------------------
# The bindings' argument forms. See Note [The bindings' argument forms] in
# fakepg.torch_backend.


def convenience_forms(rank: int) -> dict[str, list[torch.Tensor]]:
    """Each collective of the default group called in the C++ bindings' convenience forms
    (one tensor, plain arguments), as Python code that holds a group may call it."""
    group = dist.distributed_c10d._get_default_group()
    ten = timedelta(seconds=10)
    out: dict[str, list[torch.Tensor]] = {}

    def mine() -> torch.Tensor:
        return torch.full((2,), float(rank + 1))

    def run(name: str, tensors: list[torch.Tensor], work: dist.Work) -> None:
        work.wait()
        out[name] = tensors

    x = mine()
    run("allreduce(t)", [x], group.allreduce(x))
    x = mine()
    run("allreduce(t, op)", [x], group.allreduce(x, dist.ReduceOp.MAX))
    x = mine()
    run("allreduce([t], op)", [x], group.allreduce([x], dist.ReduceOp.MIN))
    x = mine()
    run(
        "allreduce(t, op=, timeout=)",
        [x],
        group.allreduce(x, op=dist.ReduceOp.PRODUCT, timeout=ten),
    )
    x = mine()
    run("broadcast(t, root)", [x], group.broadcast(x, 1))
    x = mine()
    run("reduce(t, root, op)", [x], group.reduce(x, 0, dist.ReduceOp.SUM))
    outs = [torch.zeros(2), torch.zeros(2)]
    run("allgather(outputs, t)", outs, group.allgather(outs, mine()))
    outs = [torch.zeros(2), torch.zeros(2)] if rank == 0 else []
    run("gather(outputs, t, root)", outs, group.gather(outs, mine(), 0))
    x = torch.zeros(2)
    inputs = [torch.full((2,), 10.0), torch.full((2,), 20.0)] if rank == 0 else []
    run("scatter(t, inputs, root)", [x], group.scatter(x, inputs, 0))
    x = torch.zeros(2)
    run(
        "reduce_scatter(t, inputs, op)",
        [x],
        group.reduce_scatter(x, [mine(), mine() * 3], dist.ReduceOp.SUM),
    )
    run("barrier(timeout=)", [], group.barrier(timeout=ten))
    return out


def test_the_bindings_convenience_forms_do_what_they_do_on_gloo() -> None:
    """A bare tensor was iterated as if it were a list (each row a replica), so torch's DDP,
    whose joined ranks call ``allreduce(local_used_map)``, got a collective no other rank
    issued. Every form gives exactly gloo's results (dyadic values)."""
    gloo = run_gloo_threads(convenience_forms, 2)
    ours = fakepg.run_torch(lambda pg: convenience_forms(pg.rank()), 2, timeout=20.0)
    for rank in range(2):
        assert list(ours[rank]) == list(gloo[rank])
        for name, want in gloo[rank].items():
            got = ours[rank][name]
            assert len(got) == len(want), f"rank {rank}: {name}"
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), (
                f"rank {rank}: {name}: {got} != {want}"
            )


def test_a_convenience_timeout_bounds_the_work_and_bad_arguments_are_named() -> None:
    release = threading.Event()

    def fn(pg: fakepg.FakeProcessGroup) -> list[str]:
        if pg.rank() == 1:
            assert release.wait(20)
            return []
        group = dist.distributed_c10d._get_default_group()
        t = torch.ones(2)
        texts = []
        for bad, error in (
            (lambda: group.allreduce("t"), TypeError),
            (lambda: group.send(t, 1, 0), TypeError),
            (lambda: group.broadcast(t, "1"), TypeError),
            (lambda: group.allreduce(t, timeout=5), TypeError),
            (lambda: group.allreduce(t, dist.ReduceOp.BAND), ValueError),
        ):
            with pytest.raises(error) as info:
                bad()
            texts.append(str(info.value))
        try:
            work = group.allreduce(t, dist.ReduceOp.SUM, timedelta(seconds=0.2))  # rank 1 never
            with pytest.raises(fakepg.CollectiveTimeout) as timed_out:
                work.wait()
            texts.append(str(timed_out.value))
        finally:
            release.set()
        return texts

    texts = fakepg.run_torch(fn, 2, timeout=20.0)[0]
    assert (
        "allreduce on the 'fakepg' backend: tensors must be a tensor or a list of tensors, got str"
        in texts[0]
    )
    assert "send on the 'fakepg' backend: tensors must be a list of tensors, got Tensor" in texts[1]
    assert "broadcast on the 'fakepg' backend: the root must be a rank (an int)" in texts[2]
    assert (
        "allreduce on the 'fakepg' backend: timeout must be a datetime.timedelta, got int"
        in texts[3]
    )
    assert "reduce op RedOpType.BAND is not supported" in texts[4]
    assert "allreduce #0 (op=SUM) timed out after 0.2 s (this rank's wait)" in texts[5]


# -------------------------------------------------------------------------------------------
# Callbacks that issue and wait for collectives: each rank's run on its own threads.


@pytest.mark.timeout(120)
def test_torchs_powersgd_hook_runs_in_torchs_ddp() -> None:
    """torch's PowerSGD hook waits, inside future callbacks, for allreduces that it issues
    there; with every rank's callbacks on one shared thread, rank 1's waited for what rank
    0's, queued behind it, had not issued yet. Before and after warm-up (iteration 2), the
    ranks hold the same bits."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[list[list[torch.Tensor]], int]:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
        ddp = nn.parallel.DistributedDataParallel(net)
        state = powersgd.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        steps = []
        for _ in range(4):
            ddp.zero_grad(set_to_none=True)
            ddp(torch.randn(3, 16)).sum().backward()
            steps.append([p.grad.clone() for p in net.parameters() if p.grad is not None])
        return steps, state.iter

    results = fakepg.run_torch(fn, 2, timeout=10.0)
    for steps, iterations in results:
        assert iterations == 4 and len(steps) == 4 and all(len(s) == 4 for s in steps)
    for step in range(4):
        for a, b in zip(results[0][0][step], results[1][0][step], strict=True):
            assert torch.equal(a, b), f"step {step}"
