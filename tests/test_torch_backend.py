"""reducer.TorchProcessGroup on gloo: two real processes on loopback.

The two ranks run every scenario once (this file is also their script: see ``_worker``), save
what they observed, and the tests compare it with exact expectations. The last scenario has
rank 1 exit abruptly, so that rank 0's wait must raise a TorchCollectiveError.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import reducer
from reducer.torch_backend import TorchCollectiveError, TorchCollectiveTimeout

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
    return model(dyadic((4, 8), 100 * step + rank)).sum() * WORLD_SIZE


# -------------------------------------------------------------------------------------------
# The ranks' side.


def _worker(out_dir: Path) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    pg = reducer.TorchProcessGroup(dist.group.WORLD, timeout=20.0)  # type: ignore[arg-type]
    seen: dict[str, Any] = {"rank": pg.rank(), "size": pg.size(), "backend": pg.backend}

    ops = {}
    for op in reducer.ReduceOp:
        t = torch.tensor([rank + 1.0, -(rank + 2.0), 0.5 * rank])
        work = pg.allreduce([t], op)
        work.wait()
        ops[op.name] = (t.clone(), work.is_completed(), work.result()[0] is t)
    ints = torch.tensor([rank + 1, 10 * (rank + 1)], dtype=torch.int64)
    pg.allreduce([ints]).wait()
    ops["SUM int64"] = (ints, True, True)
    seen["ops"] = ops

    lists = {}
    for op in (reducer.ReduceOp.SUM, reducer.ReduceOp.AVG, reducer.ReduceOp.MAX):
        ts = [torch.full((3,), float(rank + 1)), torch.full((3,), 10.0 * (rank + 1))]
        pg.allreduce(ts, op).wait()
        lists[op.name] = [t.clone() for t in ts]
    seen["lists"] = lists

    indices = torch.tensor([[rank, 2, 2]])
    values = torch.tensor([1.0, 2.0, 0.5]) * (rank + 1)
    sparse = torch.sparse_coo_tensor(indices, values, (4,))
    work = pg.allreduce([sparse])
    work.wait()
    seen["sparse"] = (work.result()[0].is_sparse, work.result()[0].to_dense(), sparse.to_dense())
    sparse_avg = torch.sparse_coo_tensor(indices, values, (4,))
    work = pg.allreduce([sparse_avg], reducer.ReduceOp.AVG)
    work.wait()
    seen["sparse avg"] = work.result()[0].to_dense()

    outputs = [[torch.empty(2) for _ in range(WORLD_SIZE)], [torch.empty(3) for _ in range(2)]]
    pg.allgather(outputs, [torch.full((2,), float(rank)), torch.full((3,), rank + 0.5)]).wait()
    seen["allgather"] = outputs
    tensors = [torch.full((2,), float(rank)), torch.full((1,), 10.0 + rank)]
    pg.broadcast(tensors, root=1).wait()
    seen["broadcast"] = tensors
    barrier = pg.barrier()
    barrier.wait()
    seen["barrier"] = barrier.is_completed()
    seen["future"] = pg.allreduce([torch.ones(2)]).get_future().wait()

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
    }.items():
        try:
            call()
        except ValueError as exc:  # InvalidArgument is a ValueError
            errors[name] = (type(exc).__name__, str(exc))
    seen["errors"] = errors

    # The reducer on gloo: exact averages on dyadic data, several buckets, two iterations.
    model = dyadic_model()
    params = list(model.parameters())
    buckets = reducer.ddp_bucket_assignment(params, bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
    grads = []
    with reducer.Reducer([params], buckets, pg) as red:
        for step in range(2):
            model.zero_grad(set_to_none=True)
            red.prepare_for_backward([])
            dyadic_loss(model, rank, step).backward()
            grads.append([p.grad.clone() for p in params if p.grad is not None])
    seen["reducer"] = (len(buckets), grads)

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


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Run the two gloo ranks once for the whole module; what each of them saw."""
    out_dir = tmp_path_factory.mktemp("gloo")
    port = _free_port()
    procs = []
    logs = [out_dir / f"rank{rank}.log" for rank in range(WORLD_SIZE)]
    for rank in range(WORLD_SIZE):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.update(RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
        cmd = [sys.executable, __file__, str(out_dir)]
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


def test_the_group_is_what_torch_says(ranks: list[dict[str, Any]]) -> None:
    for r, seen in enumerate(ranks):
        assert (seen["rank"], seen["size"], seen["backend"]) == (r, 2, "gloo")


def test_allreduce_ops(ranks: list[dict[str, Any]]) -> None:
    want = {
        "SUM": [3.0, -5.0, 0.5],
        "AVG": [1.5, -2.5, 0.25],  # gloo has no AVG: SUM, then divided by 2
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


def test_sparse_allreduce_returns_the_sum_through_result(ranks: list[dict[str, Any]]) -> None:
    # rank 0: {0: 1, 2: 2 + 0.5}; rank 1: {1: 2, 2: 4 + 1}
    for seen in ranks:
        is_sparse, result, inplace = seen["sparse"]
        assert is_sparse
        assert result.tolist() == [1.0, 2.0, 7.5, 0.0]
        assert inplace.tolist() == [1.0, 2.0, 7.5, 0.0]  # copied into the input too
        assert seen["sparse avg"].tolist() == [0.5, 1.0, 3.75, 0.0]


def test_allgather_broadcast_barrier_future(ranks: list[dict[str, Any]]) -> None:
    for seen in ranks:
        first, second = seen["allgather"]
        assert [t.tolist() for t in first] == [[0.0, 0.0], [1.0, 1.0]]
        assert [t.tolist() for t in second] == [[0.5] * 3, [1.5] * 3]
        assert [t.tolist() for t in seen["broadcast"]] == [[1.0, 1.0], [11.0]]
        assert seen["barrier"] is True
        assert [t.tolist() for t in seen["future"]] == [[2.0, 2.0]]


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
    assert set(errors) == set(expected)
    for name, words in expected.items():
        kind, message = errors[name]
        assert kind == "InvalidArgument" and words in message, (name, message)


def test_the_reducer_on_gloo_gives_exact_averages(ranks: list[dict[str, Any]]) -> None:
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


def test_a_wait_past_its_timeout_names_rank_and_collective(ranks: list[dict[str, Any]]) -> None:
    kind, message, completed = ranks[0]["timeout"]
    assert kind == "TorchCollectiveTimeout" and not completed
    assert "rank 0 of 2 (gloo)" in message and "allreduce #" in message
    assert "within 0.3 s" in message
    assert ranks[0]["after timeout"].tolist() == [2.0, 2.0]  # it completed later all the same


def test_a_dead_peer_surfaces_in_wait(ranks: list[dict[str, Any]]) -> None:
    kind, message, elapsed = ranks[0]["peer died"]
    assert kind == "TorchCollectiveError"
    assert "rank 0 of 2 (gloo)" in message and "failed" in message and "allreduce #" in message
    assert elapsed < 15.0


def test_torch_process_group_rejects_what_is_not_a_group() -> None:
    with pytest.raises(reducer.InvalidArgument, match=r"takes a torch\.distributed\.ProcessGroup"):
        reducer.TorchProcessGroup(object())  # type: ignore[arg-type]


if __name__ == "__main__":
    _worker(Path(sys.argv[1]))
