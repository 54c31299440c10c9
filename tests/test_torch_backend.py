"""reducer.TorchProcessGroup on gloo (two real processes on loopback) and NCCL (two GPUs).

The two ranks of a backend run every scenario once (this file is also their script: see
``_worker``), save what they observed, and the tests compare it with exact expectations. On
gloo the last scenarios time a wait out and then have rank 1 exit abruptly, so that rank 0's
wait must raise a TorchCollectiveError. The NCCL runs skip on machines without two GPUs.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fakepg
import reducer
from reducer import TorchCollectiveError, TorchCollectiveTimeout

T = TypeVar("T")

WORLD_SIZE = 2
RUN_TIMEOUT_S = 60.0


# -------------------------------------------------------------------------------------------
# Data both sides compute: dyadic, so sums are exact whatever order gloo adds in.


def dyadic(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, shape, generator=gen).to(torch.float32) * 0.5


def dyadic_model() -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(dyadic(tuple(p.shape), i))
    return model


def dyadic_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    """W times a dyadic loss: each gradient is W * (dyadic), so g / W is exact."""
    x = dyadic((4, 8), 100 * step + rank).to(next(model.parameters()).device)
    out: torch.Tensor = model(x).sum() * WORLD_SIZE
    return out


# -------------------------------------------------------------------------------------------
# The ranks' side.


class Branchy(nn.Module):
    """``local`` is used on rank 0 only, ``dead`` on no rank: the reducer's used map."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.local, self.dead = nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 4)
        with torch.no_grad():
            for i, p in enumerate(self.parameters()):
                p.copy_(dyadic(tuple(p.shape), 50 + i))

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        out: torch.Tensor = self.trunk(x)
        return out + self.local(x) if rank == 0 else out


def branchy_loss(model: nn.Module, rank: int) -> torch.Tensor:
    x = dyadic((4, 8), 300 + rank).to(next(model.parameters()).device)
    out: torch.Tensor = model(x, rank).sum() * WORLD_SIZE
    return out


def _worker(out_dir: Path, backend: str) -> None:
    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        torch.set_float32_matmul_precision("highest")  # no TF32: the dyadic data stays exact
    dist.init_process_group(
        backend, timeout=timedelta(seconds=30), device_id=dev if dev.type == "cuda" else None
    )
    pg = reducer.TorchProcessGroup(dist.group.WORLD, timeout=20.0)  # type: ignore[arg-type]
    seen: dict[str, Any] = {"rank": pg.rank(), "size": pg.size(), "backend": pg.backend}

    def on(t: torch.Tensor) -> torch.Tensor:
        return t.to(dev)

    def done(work: reducer.Work) -> bool:
        if dev.type == "cuda":
            torch.cuda.synchronize()  # wait() orders the stream; is_completed asks the GPU
        return work.is_completed()

    ops = {}
    for op in reducer.ReduceOp:
        t = on(torch.tensor([rank + 1.0, -(rank + 2.0), 0.5 * rank]))
        work = pg.allreduce([t], op)
        work.wait()
        ops[op.name] = (t.cpu(), done(work), work.result()[0] is t)
    ints = on(torch.tensor([rank + 1, 10 * (rank + 1)], dtype=torch.int64))
    pg.allreduce([ints]).wait()
    ops["SUM int64"] = (ints.cpu(), True, True)
    seen["ops"] = ops

    lists = {}
    for op in (reducer.ReduceOp.SUM, reducer.ReduceOp.AVG, reducer.ReduceOp.MAX):
        ts = [on(torch.full((3,), float(rank + 1))), on(torch.full((3,), 10.0 * (rank + 1)))]
        pg.allreduce(ts, op).wait()
        lists[op.name] = [t.cpu() for t in ts]
    seen["lists"] = lists

    indices = torch.tensor([[rank, 2, 2]])
    values = torch.tensor([1.0, 2.0, 0.5]) * (rank + 1)
    sparse = torch.sparse_coo_tensor(indices, values, (4,))
    if backend == "gloo":
        work = pg.allreduce([sparse])
        work.wait()
        result = work.result()[0]
        seen["sparse"] = (result.is_sparse, result.to_dense(), sparse.to_dense())
        sparse_avg = torch.sparse_coo_tensor(indices, values, (4,))
        work = pg.allreduce([sparse_avg], reducer.ReduceOp.AVG)
        work.wait()
        seen["sparse avg"] = work.result()[0].to_dense()

    outputs = [[on(torch.empty(n)) for _ in range(WORLD_SIZE)] for n in (2, 3)]
    inputs = [on(torch.full((2,), float(rank))), on(torch.full((3,), rank + 0.5))]
    pg.allgather(outputs, inputs).wait()
    seen["allgather"] = [[t.cpu() for t in out] for out in outputs]
    tensors = [on(torch.full((2,), float(rank))), on(torch.full((1,), 10.0 + rank))]
    pg.broadcast(tensors, root=1).wait()
    seen["broadcast"] = [t.cpu() for t in tensors]
    barrier = pg.barrier()
    barrier.wait()
    seen["barrier"] = done(barrier)
    seen["future"] = [t.cpu() for t in pg.allreduce([on(torch.ones(2))]).get_future().wait()]

    # CPU tensors: on NCCL they are staged through the GPU and copied back in wait.
    cpu_sum = torch.tensor([rank + 1.0, 4.0])
    cpu_work = pg.allreduce([cpu_sum])
    cpu_work.wait()
    cpu_out = [[torch.empty(1) for _ in range(WORLD_SIZE)]]
    pg.allgather(cpu_out, [torch.tensor([rank * 2.0])]).wait()
    cpu_root = [torch.tensor([float(rank)])]
    pg.broadcast(cpu_root, root=0).wait()
    seen["cpu"] = (cpu_sum, cpu_work.result()[0] is cpu_sum, cpu_out[0], cpu_root[0])

    errors = {}
    for name, call in {
        "not a list": lambda: pg.allreduce(torch.ones(2)),  # type: ignore[arg-type]
        "non-contiguous": lambda: pg.allreduce([torch.ones(4, 4).t()]),
        "mismatched list": lambda: pg.allreduce([torch.ones(2), torch.ones(3)]),
        "bad op": lambda: pg.allreduce([torch.ones(2)], "sum"),  # type: ignore[arg-type]
        "int AVG": lambda: pg.allreduce([torch.ones(2, dtype=torch.int32)], reducer.ReduceOp.AVG),
        "sparse MAX": lambda: pg.allreduce([sparse], reducer.ReduceOp.MAX),
        "bad root": lambda: pg.broadcast([torch.ones(2)], root=2),
        "allgather count": lambda: pg.allgather([[torch.ones(2)]], [torch.ones(2)]),
        **({"sparse on nccl": lambda: pg.allreduce([sparse])} if backend == "nccl" else {}),
    }.items():
        try:
            call()
        except ValueError as exc:  # InvalidArgument is a ValueError
            errors[name] = (type(exc).__name__, str(exc))
    seen["errors"] = errors

    # The reducer: exact averages on dyadic data, several buckets, two iterations.
    model = dyadic_model().to(dev)
    params = list(model.parameters())
    buckets = reducer.ddp_bucket_assignment(params, bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
    grads = []
    with reducer.Reducer([params], buckets, pg) as red:
        for step in range(2):
            model.zero_grad(set_to_none=True)
            red.prepare_for_backward([])
            dyadic_loss(model, rank, step).backward()
            grads.append([p.grad.cpu() for p in params if p.grad is not None])
    seen["reducer"] = (len(buckets), grads)

    # Unused parameters: the reducer allreduces its (CPU) used map as well.
    branchy = Branchy().to(dev)
    params = list(branchy.parameters())
    buckets = reducer.ddp_bucket_assignment(params, bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
    with reducer.Reducer([params], buckets, pg) as red:
        loss = branchy_loss(branchy, rank)
        red.prepare_for_backward([loss])
        loss.backward()
    seen["unused"] = [None if p.grad is None else p.grad.cpu() for p in params]

    if backend != "gloo":  # NCCL completes works once queued: the scenarios below are gloo's
        pg.barrier().wait()
        torch.save(seen, out_dir / f"rank{rank}.pt")
        dist.destroy_process_group()
        return

    # A wait shorter than the peer's delay times out, naming rank and collective; the work
    # itself completes once the peer issues it.
    if rank == 0:
        late = torch.ones(2)
        work = pg.allreduce([late])
        try:
            work.wait(timeout=0.3)
        except TorchCollectiveTimeout as exc:
            seen["timeout"] = (type(exc).__name__, str(exc), work.is_completed())
        work.wait()
        seen["after timeout"] = late
    else:
        time.sleep(1.5)
        pg.allreduce([torch.ones(2)]).wait()

    # A peer that dies: rank 1 saves and exits abruptly; rank 0's next collective must fail.
    pg.barrier().wait()
    if rank == 1:
        torch.save(seen, out_dir / f"rank{rank}.pt")
        os._exit(0)
    work = pg.allreduce([torch.ones(2)])
    start = time.monotonic()
    try:
        work.wait(timeout=20.0)
    except TorchCollectiveError as exc:
        seen["peer died"] = (type(exc).__name__, str(exc), time.monotonic() - start)
    torch.save(seen, out_dir / f"rank{rank}.pt")
    os._exit(0)  # the group is broken; tearing it down could wait on the dead peer


# -------------------------------------------------------------------------------------------
# The tests' side.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_ranks(backend: str, out_dir: Path) -> list[dict[str, Any]]:
    """Run the two ranks of ``backend`` once; what each of them saw."""
    port = _free_port()
    procs = []
    logs = [out_dir / f"rank{rank}.log" for rank in range(WORLD_SIZE)]
    for rank in range(WORLD_SIZE):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank))
        cmd = [sys.executable, __file__, str(out_dir), backend]
        with open(logs[rank], "w") as log:  # a file, not a pipe: nothing can fill and block
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(5.0)
    for rank, p in enumerate(procs):
        assert p.returncode == 0, (
            f"rank {rank} exited with {p.returncode}:\n{logs[rank].read_text()}"
        )
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


def _run_once_per_session(
    backend: str, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """The ranks' observations, run once even when pytest-xdist spreads this module's tests
    over several workers (they share the parent of their temporary directories)."""
    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent
    out_dir = root / f"torch-backend-{backend}"
    with open(root / f"torch-backend-{backend}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (out_dir / "done").exists():
            out_dir.mkdir(exist_ok=True)
            seen = _run_ranks(backend, out_dir)
            (out_dir / "done").touch()
            return seen
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def gloo(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run_once_per_session("gloo", tmp_path_factory)


@pytest.fixture(scope="module")
def nccl(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    gpus = torch.cuda.device_count()
    if gpus < WORLD_SIZE or not dist.is_nccl_available():
        pytest.skip(f"NCCL needs {WORLD_SIZE} GPUs and a torch built with NCCL ({gpus} GPUs here)")
    return _run_once_per_session("nccl", tmp_path_factory)


@pytest.fixture(params=["gloo", "nccl"])
def ranks(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """What the ranks of each backend saw (NCCL: skipped without two GPUs)."""
    seen: list[dict[str, Any]] = request.getfixturevalue(request.param)
    return seen


@pytest.mark.slow
def test_the_group_is_what_torch_says(ranks: list[dict[str, Any]]) -> None:
    backend = ranks[0]["backend"]
    assert backend in ("gloo", "nccl")
    for r, seen in enumerate(ranks):
        assert (seen["rank"], seen["size"], seen["backend"]) == (r, 2, backend)


def test_allreduce_ops(ranks: list[dict[str, Any]]) -> None:
    want = {
        "SUM": [3.0, -5.0, 0.5],
        "AVG": [1.5, -2.5, 0.25],  # gloo has no AVG: SUM, then divided by 2; NCCL's own
        "PRODUCT": [2.0, 6.0, 0.0],
        "MIN": [1.0, -3.0, 0.0],
        "MAX": [2.0, -2.0, 0.5],
    }
    for seen in ranks:
        for name, values in want.items():
            t, completed, in_place = seen["ops"][name]
            assert t.tolist() == values, name
            assert completed and in_place, name
        ints, _, _ = seen["ops"]["SUM int64"]
        assert ints.dtype == torch.int64 and ints.tolist() == [3, 30]


def test_tensor_lists_are_combined_locally_then_across_ranks(ranks: list[dict[str, Any]]) -> None:
    # rank r contributes r+1 and 10(r+1): 4 contributions in all.
    for seen in ranks:
        assert [t.tolist() for t in seen["lists"]["SUM"]] == [[33.0] * 3] * 2
        assert [t.tolist() for t in seen["lists"]["AVG"]] == [[8.25] * 3] * 2
        assert [t.tolist() for t in seen["lists"]["MAX"]] == [[20.0] * 3] * 2


def test_sparse_allreduce_returns_the_sum_through_result(gloo: list[dict[str, Any]]) -> None:
    # rank 0: {0: 1, 2: 2 + 0.5}; rank 1: {1: 2, 2: 4 + 1}
    for seen in gloo:
        is_sparse, result, inplace = seen["sparse"]
        assert is_sparse
        assert result.tolist() == [1.0, 2.0, 7.5, 0.0]
        assert inplace.tolist() == [1.0, 2.0, 7.5, 0.0]  # copied into the input too
        assert seen["sparse avg"].tolist() == [0.5, 1.0, 3.75, 0.0]


def test_sparse_on_nccl_is_refused_with_what_to_do(nccl: list[dict[str, Any]]) -> None:
    kind, message = nccl[0]["errors"]["sparse on nccl"]
    assert kind == "InvalidArgument" and "has no sparse allreduce" in message
    assert "gloo" in message


def test_allgather_broadcast_barrier_future(ranks: list[dict[str, Any]]) -> None:
    for seen in ranks:
        first, second = seen["allgather"]
        assert [t.tolist() for t in first] == [[0.0, 0.0], [1.0, 1.0]]
        assert [t.tolist() for t in second] == [[0.5] * 3, [1.5] * 3]
        assert [t.tolist() for t in seen["broadcast"]] == [[1.0, 1.0], [11.0]]
        assert seen["barrier"] is True
        assert [t.tolist() for t in seen["future"]] == [[2.0, 2.0]]


def test_cpu_tensors_are_reduced_in_place_on_every_backend(ranks: list[dict[str, Any]]) -> None:
    """On NCCL through a staging copy on the GPU (the reducer's used map is on the CPU)."""
    for seen in ranks:
        total, in_place, gathered, root = seen["cpu"]
        assert total.device.type == "cpu" and total.tolist() == [3.0, 8.0] and in_place
        assert [t.tolist() for t in gathered] == [[0.0], [2.0]]
        assert root.tolist() == [0.0]


def test_invalid_arguments_raise_value_errors_that_say_what_to_do(
    ranks: list[dict[str, Any]],
) -> None:
    errors = ranks[0]["errors"]
    expected = {
        "not a list": "takes a list of tensors",
        "non-contiguous": "not contiguous",
        "mismatched list": "must match",
        "bad op": "must be a reducer.ReduceOp",
        "int AVG": "AVG needs a floating dtype",
        "sparse MAX": "SUM and AVG only",
        "bad root": "root must be a rank in [0, 2)",
        "allgather count": "needs one per rank (2)",
    }
    if ranks[0]["backend"] == "nccl":
        expected["sparse on nccl"] = "has no sparse allreduce"
    assert set(errors) == set(expected)
    for name, words in expected.items():
        kind, message = errors[name]
        assert kind == "InvalidArgument" and words in message, (name, message)


def test_the_reducer_gives_exact_averages(ranks: list[dict[str, Any]]) -> None:
    for step in range(2):
        local = []
        for rank in range(WORLD_SIZE):
            model = dyadic_model()
            dyadic_loss(model, rank, step).backward()
            local.append([p.grad for p in model.parameters()])
        want = [
            sum((local[r][i].double() for r in range(WORLD_SIZE)), torch.zeros(1)) / WORLD_SIZE
            for i in range(len(local[0]))
        ]
        for seen in ranks:
            buckets, grads = seen["reducer"]
            assert buckets >= 3
            for got, w in zip(grads[step], want, strict=True):
                assert torch.equal(w.float().double(), w)  # the data really is exact
                assert torch.equal(got.double(), w)


def test_the_reducer_handles_unused_parameters(ranks: list[dict[str, Any]]) -> None:
    """trunk: both ranks; local: rank 0 only (rank 1 adds zeros); dead: no rank (None)."""
    local = []
    for rank in range(WORLD_SIZE):
        model = Branchy()
        branchy_loss(model, rank).backward()
        local.append([p.grad for p in model.parameters()])
    for seen in ranks:
        got = seen["unused"]
        assert got[4] is None and got[5] is None  # dead.weight, dead.bias: untouched
        for i in range(4):
            terms = [local[r][i] for r in range(WORLD_SIZE) if local[r][i] is not None]
            want = sum((g.double() for g in terms), torch.zeros(1)) / WORLD_SIZE
            assert torch.equal(want.float().double(), want)
            assert torch.equal(got[i].double(), want), i


def test_a_wait_past_its_timeout_names_rank_and_collective(gloo: list[dict[str, Any]]) -> None:
    kind, message, completed = gloo[0]["timeout"]
    assert kind == "TorchCollectiveTimeout" and not completed
    assert "rank 0 of 2 (gloo)" in message and "allreduce #" in message
    assert "within 0.3 s" in message
    assert gloo[0]["after timeout"].tolist() == [2.0, 2.0]  # it completed later all the same


def test_a_dead_peer_surfaces_in_wait(gloo: list[dict[str, Any]]) -> None:
    kind, message, elapsed = gloo[0]["peer died"]
    assert kind == "TorchCollectiveError"
    assert "rank 0 of 2 (gloo)" in message and "failed" in message and "allreduce #" in message
    assert elapsed < 15.0


def test_a_dead_peer_is_named_by_its_rank(gloo: list[dict[str, Any]]) -> None:
    """gloo names the peer by address only; in a group of two it is the other rank."""
    _, message, _ = gloo[0]["peer died"]
    assert re.search(r"The peer at [^ ]+:\d+ is rank 1, the only other rank", message), message


def test_a_peer_address_in_a_larger_group_lists_the_ranks_it_can_be() -> None:
    from reducer.torch_backend import _peer_hint

    error = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.7]:41234."
    assert _peer_hint(error, 2, 4) == (
        " The peer at 10.0.0.7:41234 is one of ranks 0, 1, 3 (the backend names peers by "
        "address only, and ranks on one host share it): the rank whose log shows the first "
        "error is the one that stopped."
    )
    assert _peer_hint(error, 0, 2).startswith(" The peer at 10.0.0.7:41234 is rank 1,")
    assert _peer_hint("Connection reset by peer", 0, 2) == ""  # no address: nothing to add


# -------------------------------------------------------------------------------------------
# On the fakepg torch backend: threads of this process, so failures can be staged precisely.


def on_fakepg(fn: Callable[[reducer.TorchProcessGroup], T], world_size: int = 2) -> list[T]:
    """``fn`` on each rank's TorchProcessGroup over the "fakepg" torch backend."""
    fakepg.register_torch_backend()

    def rank_main(_pg: fakepg.FakeProcessGroup) -> T:
        return fn(reducer.TorchProcessGroup(dist.group.WORLD, timeout=10.0))  # type: ignore[arg-type]

    return fakepg.run_torch(rank_main, world_size, timeout=20.0)


def test_a_wait_times_out_and_the_collective_completes_later() -> None:
    timed_out = threading.Event()

    def fn(pg: reducer.TorchProcessGroup) -> tuple[str, bool, list[float]]:
        t = torch.full((2,), pg.rank() + 1.0)
        if pg.rank() == 1:
            assert timed_out.wait(10.0)
            pg.allreduce([t]).wait()
            return "", True, t.tolist()
        work = pg.allreduce([t])
        with pytest.raises(TorchCollectiveTimeout) as info:
            work.wait(timeout=0.2)
        pending = not work.is_completed()
        timed_out.set()
        work.wait()
        return str(info.value), pending, t.tolist()

    (message, pending, total), (_, _, other) = on_fakepg(fn)
    assert pending and total == other == [3.0, 3.0]
    assert "rank 0 of 2 (fakepg): allreduce #0 (op=SUM, float32[2])" in message
    assert "did not complete within 0.2 s" in message


def test_a_failed_peer_and_a_refused_collective_both_surface_in_wait() -> None:
    seen: list[tuple[str, str, bool]] = []

    def fn(pg: reducer.TorchProcessGroup) -> None:
        if pg.rank() == 1:
            time.sleep(0.2)  # rank 0 is waiting by then
            raise KeyError("rank 1 fails on purpose")
        work = pg.allreduce([torch.ones(2)])
        with pytest.raises(TorchCollectiveError) as first:
            work.wait(timeout=10.0)
        # The aborted world refuses the next collective in the call itself; the adapter
        # returns it as a failed work (see Note [Failures when issuing]).
        later = pg.allreduce([torch.ones(2)])
        with pytest.raises(TorchCollectiveError) as second:
            later.wait(timeout=10.0)
        seen.append((str(first.value), str(second.value), later.is_completed()))

    with pytest.raises(KeyError, match="fails on purpose"):
        on_fakepg(fn)
    ((first, second, completed),) = seen
    assert "rank 0 of 2 (fakepg): allreduce #0" in first and "rank 1 failed" in first
    assert "rank 0 of 2 (fakepg): allreduce #1" in second and "WorldAborted" in second
    assert completed


def test_lists_with_a_native_avg_divide_by_every_contribution() -> None:
    def fn(pg: reducer.TorchProcessGroup) -> list[list[float]]:
        r = pg.rank()
        avg = [torch.full((2,), 1.0 + r), torch.full((2,), 10.0 * (r + 1))]
        pg.allreduce(avg, reducer.ReduceOp.AVG).wait()
        low = [torch.tensor([5.0 - r]), torch.tensor([2.0 + r])]
        pg.allreduce(low, reducer.ReduceOp.MIN).wait()
        return [t.tolist() for t in avg + low]

    for values in on_fakepg(fn):  # (1 + 10 + 2 + 20) / 4; min(5, 2, 4, 3)
        assert values == [[8.25, 8.25], [8.25, 8.25], [2.0], [2.0]]


def test_sparse_allreduce_on_a_backend_that_reduces_in_place() -> None:
    def fn(pg: reducer.TorchProcessGroup) -> list[list[float]]:
        r = pg.rank()
        one = torch.sparse_coo_tensor(torch.tensor([[r, 3]]), torch.tensor([1.0, 2.0]), (4,))
        pg.allreduce([one]).wait()
        pair = [
            torch.sparse_coo_tensor(torch.tensor([[r]]), torch.tensor([4.0]), (4,)),
            torch.sparse_coo_tensor(torch.tensor([[3]]), torch.tensor([2.0]), (4,)),
        ]
        work = pg.allreduce(pair, reducer.ReduceOp.AVG)
        work.wait()
        assert all(t.is_sparse for t in work.result())
        return [one.to_dense().tolist(), *(t.to_dense().tolist() for t in pair)]

    for one, *pair in on_fakepg(fn):
        assert one == [1.0, 1.0, 0.0, 4.0]
        assert pair == [[1.0, 1.0, 0.0, 1.0]] * 2  # (4 + 2 + 4 + 2) spread / 4


def test_staged_tensors_are_copied_back_in_wait() -> None:
    """The mechanics of Note [CPU tensors on a GPU-only backend], with a CPU "stage": the
    reduction happens in the staging copy, the tensors the caller passed change in wait."""

    def fn(pg: reducer.TorchProcessGroup) -> tuple[list[float], ...]:
        pg._stage_device = lambda _t, _what: torch.device("cpu")  # type: ignore[method-assign]
        r = pg.rank()
        pair = [torch.full((2,), 1.0 + r), torch.full((2,), 10.0)]
        work = pg.allreduce(pair, reducer.ReduceOp.AVG)
        deadline = time.monotonic() + 10.0
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.001)
        before = pair[1].tolist()  # completed, but not yet copied back
        work.wait()
        outputs = [[torch.empty(1) for _ in range(2)]]
        pg.allgather(outputs, [torch.tensor([r * 3.0])]).wait()
        root = [torch.tensor([float(r)])]
        pg.broadcast(root, 1).wait()
        future = pg.allreduce([torch.tensor([r + 1.0])]).get_future().wait()
        return (
            before,
            *(t.tolist() for t in pair),
            [t.item() for t in outputs[0]],
            root[0].tolist(),
            future[0].tolist(),
        )

    for before, *after, gathered, root, future in on_fakepg(fn):
        assert before == [10.0, 10.0]
        assert after == [[5.75, 5.75]] * 2  # (1 + 10 + 2 + 10) / 4
        assert gathered == [0.0, 3.0] and root == [1.0] and future == [3.0]


@pytest.mark.parametrize(
    ("timeout", "kind", "words"),
    [
        (float("inf"), ValueError, "timeout must be a finite number of seconds"),
        (float("nan"), ValueError, "timeout must be > 0 seconds, got nan"),
        (-1.0, ValueError, "timeout must be > 0 seconds, got -1.0"),
        ("60", TypeError, "timeout must be a number of seconds"),
    ],
)
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused(
    timeout: object, kind: type, words: str
) -> None:
    """Refused at construction, when set later, and for one wait: before, infinity was
    accepted, and every wait then raised OverflowError."""

    def fn(pg: reducer.TorchProcessGroup) -> None:
        with pytest.raises(kind, match=re.escape(f"TorchProcessGroup: {words}")):
            reducer.TorchProcessGroup(pg.torch_group, timeout=timeout)  # type: ignore[arg-type]
        with pytest.raises(kind, match=re.escape(words)):
            pg.timeout = timeout  # type: ignore[assignment]
        assert pg.timeout == 10.0
        work = pg.allreduce([torch.ones(1)])
        with pytest.raises(kind, match=re.escape(f"TorchWork.wait: {words}")):
            work.wait(timeout=timeout)  # type: ignore[arg-type]
        work.wait()

    on_fakepg(fn)


def test_a_timedelta_timeout_and_a_zero_wait_are_accepted() -> None:
    def fn(pg: reducer.TorchProcessGroup) -> float:
        group = reducer.TorchProcessGroup(pg.torch_group, timeout=timedelta(minutes=1))
        work = pg.allreduce([torch.ones(1)])
        work.wait()
        work.wait(timeout=0)  # a poll of a completed work
        return group.timeout

    assert on_fakepg(fn) == [60.0, 60.0]


def test_torch_process_group_rejects_what_is_not_a_group() -> None:
    with pytest.raises(reducer.InvalidArgument, match=r"takes a torch\.distributed\.ProcessGroup"):
        reducer.TorchProcessGroup(object())  # type: ignore[arg-type]


def test_errors_name_a_collective_by_kind_number_op_and_tensors() -> None:
    from reducer.torch_backend import _describe

    pair = [torch.zeros(1024), torch.zeros(1024)]
    assert _describe("allreduce", 3, reducer.ReduceOp.SUM, pair) == (
        "allreduce #3 (op=SUM, 2 x float32[1024])"
    )
    sparse = [torch.eye(2).to_sparse()]
    assert _describe("allreduce", 0, reducer.ReduceOp.AVG, sparse) == (
        "allreduce #0 (op=AVG, float32[2, 2] sparse_coo)"
    )
    assert _describe("broadcast", 1, None, [torch.zeros(2, 3)], "root=1") == (
        "broadcast #1 (root=1, float32[2, 3])"
    )
    assert _describe("barrier", 2, None, []) == "barrier #2"


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), sys.argv[2])
