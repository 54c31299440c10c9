"""Every collective of the fake world, checked bit for bit against a rank-order reference."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import fakepg
from reducer import ReduceOp

_TORCH_OPS: dict[ReduceOp, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
}


def rank_order_reference(contributions: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    """((x0 op x1) op x2) ... in the given order, one torch op at a time."""
    acc = contributions[0].clone()
    for x in contributions[1:]:
        acc = _TORCH_OPS[op](acc, x)
    if op == ReduceOp.AVG:
        acc = acc / len(contributions)
    return acc


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * 3).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=gen, dtype=dtype)


def issue_in_order(
    world: fakepg.World,
    order: list[int],
    call: Callable[[fakepg.FakeProcessGroup], fakepg.Work],
) -> list[fakepg.Work]:
    """Issue one collective per rank in ``order`` (from this thread), return works by rank."""
    works: dict[int, fakepg.Work] = {}
    for rank in order:
        works[rank] = call(world.group(rank))
    for work in works.values():
        work.wait(timeout=30)
    return [works[r] for r in range(world.world_size)]


JOIN_ORDERS = ["ascending", "descending", "shuffled"]


def join_order(kind: str, world_size: int, seed: int = 0) -> list[int]:
    order = list(range(world_size))
    if kind == "descending":
        order.reverse()
    elif kind == "shuffled":
        random.Random(seed).shuffle(order)
    return order


@pytest.mark.parametrize("order", JOIN_ORDERS)
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 7, 8, 16])
def test_sum_is_bitwise_rank_order_whatever_the_join_order(world_size: int, order: str) -> None:
    gen = torch.Generator().manual_seed(world_size)
    inputs = [random_tensor((257,), torch.float32, gen) for _ in range(world_size)]
    expected = rank_order_reference(inputs, ReduceOp.SUM)
    tensors = [t.clone() for t in inputs]
    with fakepg.World(world_size) as world:
        works = issue_in_order(
            world, join_order(order, world_size), lambda pg: pg.allreduce([tensors[pg.rank()]])
        )
    for rank, t in enumerate(tensors):
        assert torch.equal(t, expected), f"rank {rank} differs from the rank-order sum"
        assert works[rank].result()[0] is t  # in place


@pytest.mark.parametrize(
    ("op", "dtype"),
    [
        (op, dtype)
        for op in ReduceOp
        for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64)
        if dtype.is_floating_point or op != ReduceOp.AVG  # see test_avg_of_integers_...
    ],
)
def test_every_op_and_dtype_matches_the_reference(op: ReduceOp, dtype: torch.dtype) -> None:
    world_size = 5
    gen = torch.Generator().manual_seed(7)
    inputs = [random_tensor((3, 41), dtype, gen) for _ in range(world_size)]
    expected = rank_order_reference(inputs, op)
    tensors = [t.clone() for t in inputs]
    fakepg.run(lambda pg: pg.allreduce([tensors[pg.rank()]], op).wait(), world_size)
    for t in tensors:
        assert t.dtype == dtype
        assert torch.equal(t, expected)


def test_avg_of_integers_is_rejected() -> None:
    with fakepg.World(2) as world, pytest.raises(ValueError, match="AVG needs a floating"):
        world.group(0).allreduce([torch.zeros(3, dtype=torch.int64)], ReduceOp.AVG)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 3])
def test_chunking_does_not_change_the_bits(dtype: torch.dtype, threads: int) -> None:
    """Large enough for several parts and several cache blocks, with a ragged tail."""
    world_size = 3
    numel = 300_001
    gen = torch.Generator().manual_seed(threads)
    inputs = [random_tensor((numel,), dtype, gen) for _ in range(world_size)]
    expected = rank_order_reference(inputs, ReduceOp.SUM)
    tensors = [t.clone() for t in inputs]
    with fakepg.World(world_size, threads=threads) as world:
        issue_in_order(world, [2, 0, 1], lambda pg: pg.allreduce([tensors[pg.rank()]]))
    for t in tensors:
        assert torch.equal(t, expected)


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_multi_tensor_allreduce_sums_rank_then_replica_order(replicas: int) -> None:
    world_size = 4
    gen = torch.Generator().manual_seed(replicas)
    inputs = [
        [random_tensor((33,), torch.float32, gen) for _ in range(replicas)]
        for _ in range(world_size)
    ]
    expected = rank_order_reference([t for per_rank in inputs for t in per_rank], ReduceOp.SUM)
    tensors = [[t.clone() for t in per_rank] for per_rank in inputs]
    fakepg.run(lambda pg: pg.allreduce(tensors[pg.rank()]).wait(), world_size)
    for per_rank in tensors:
        for t in per_rank:
            assert torch.equal(t, expected)


@given(
    world_size=st.integers(1, 8),
    numel=st.integers(0, 2000),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]),
    seed=st.integers(0, 2**16),
)
def test_sum_bitwise_property(world_size: int, numel: int, dtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    inputs = [random_tensor((numel,), dtype, gen) for _ in range(world_size)]
    expected = rank_order_reference(inputs, ReduceOp.SUM)
    tensors = [t.clone() for t in inputs]
    with fakepg.World(world_size) as world:
        issue_in_order(
            world,
            join_order("shuffled", world_size, seed),
            lambda pg: pg.allreduce([tensors[pg.rank()]]),
        )
    assert all(torch.equal(t, expected) for t in tensors)


def sparse(indices: list[int], values: list[float], size: int) -> torch.Tensor:
    return torch.sparse_coo_tensor(
        torch.tensor([indices], dtype=torch.int64), torch.tensor(values), (size,)
    )


def test_sparse_allreduce_is_the_coalesced_sum_on_every_rank() -> None:
    world_size = 3
    inputs = [
        sparse([0, 2, 2], [1.0, 2.0, 3.0], 6),  # duplicate index within a rank
        sparse([2, 5], [10.0, 20.0], 6),
        sparse([0, 5, 1], [100.0, 200.0, 300.0], 6),
    ]
    expected = sum(t.to_dense() for t in inputs)
    tensors = [t.clone() for t in inputs]
    works = fakepg.run(lambda pg: _wait(pg.allreduce([tensors[pg.rank()]])), world_size)
    results = [w.result()[0] for w in works]
    for rank, result in enumerate(results):
        assert result.is_sparse and result.is_coalesced()
        torch.testing.assert_close(result.to_dense(), expected, rtol=1e-6, atol=0)
        assert torch.equal(result.indices(), results[0].indices())
        assert torch.equal(result.values(), results[0].values()), f"rank {rank} got other bits"
    # Each rank owns its result: changing one leaves the others alone.
    results[0].values().mul_(0)
    assert results[1].values().abs().sum() > 0


def test_sparse_avg_divides_by_the_number_of_contributions() -> None:
    inputs = [sparse([1], [2.0], 3), sparse([1, 2], [4.0, 8.0], 3)]
    tensors = [t.clone() for t in inputs]
    fakepg.run(lambda pg: pg.allreduce([tensors[pg.rank()]], ReduceOp.AVG).wait(), 2)
    assert torch.equal(tensors[0].to_dense(), torch.tensor([0.0, 3.0, 4.0]))


def test_sparse_min_is_rejected_with_the_supported_ops() -> None:
    with fakepg.World(1) as world, pytest.raises(ValueError, match="SUM and AVG only"):
        world.group(0).allreduce([sparse([0], [1.0], 2)], ReduceOp.MIN)


@pytest.mark.parametrize("world_size", [1, 2, 5])
def test_allgather_puts_each_ranks_input_at_its_index(world_size: int) -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> list[list[torch.Tensor]]:
        inputs = [torch.full((2,), float(pg.rank())), torch.arange(3) + 10 * pg.rank()]
        outputs = [[torch.empty_like(t) for _ in range(world_size)] for t in inputs]
        pg.allgather(outputs, inputs).wait()
        return outputs

    for outputs in fakepg.run(fn, world_size):
        for src in range(world_size):
            assert torch.equal(outputs[0][src], torch.full((2,), float(src)))
            assert torch.equal(outputs[1][src], torch.arange(3) + 10 * src)


@pytest.mark.parametrize("root", [0, 2])
def test_broadcast_copies_the_roots_tensors(root: int) -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> list[torch.Tensor]:
        tensors = [torch.full((3,), float(pg.rank())), torch.full((2, 2), -float(pg.rank()))]
        pg.broadcast(tensors, root).wait()
        return tensors

    for tensors in fakepg.run(fn, 3):
        assert torch.equal(tensors[0], torch.full((3,), float(root)))
        assert torch.equal(tensors[1], torch.full((2, 2), -float(root)))


def test_barrier_completes_only_when_every_rank_issued_it() -> None:
    with fakepg.World(3) as world:
        first = world.group(0).barrier()
        second = world.group(1).barrier()
        assert not first.is_completed() and not second.is_completed()
        world.group(2).barrier().wait()
        first.wait(timeout=5)
        assert first.is_completed() and second.is_completed()


def test_collectives_return_before_peers_join_and_data_moves_off_the_callers_thread() -> None:
    with fakepg.World(2) as world:
        tensors = [torch.ones(1 << 16), torch.ones(1 << 16)]
        work0 = world.group(0).allreduce([tensors[0]])
        assert not work0.is_completed()  # returned at once, before rank 1 joined
        finisher: list[str] = []
        chained = work0.get_future().then(lambda _: finisher.append(_thread_name()))
        world.group(1).allreduce([tensors[1]]).wait(timeout=5)
        work0.wait(timeout=5)
        chained.wait()  # the callback may still be running when wait() returns
        assert torch.equal(tensors[0], torch.full((1 << 16,), 2.0))
        # The future's callback runs on rank 0's own completion thread (see Note [Completion
        # lanes]): not on the caller's thread, nor on the worker that moved the data.
        assert finisher and finisher[0].endswith("-rank0-completion0"), finisher
        assert work0.started_ns is not None and work0.completed_ns is not None
        assert work0.launched_ns <= work0.started_ns <= work0.completed_ns


def test_a_small_collective_moves_on_the_last_ranks_thread_its_work_pending_on_return() -> None:
    # See Note [Small collectives move on the last rank's thread] in fakepg.work.
    with fakepg.World(3) as world:
        tensors = [torch.full((3,), float(r + 1)) for r in range(3)]
        earlier = [world.group(r).allreduce([tensors[r]]) for r in (0, 1)]
        last = world.group(2).allreduce([tensors[2]])
        # The last rank moved the data in its call, with no worker thread: the earlier ranks'
        # works are complete, with the sum.
        assert world.executor._threads == []
        assert all(w.is_completed() for w in earlier)
        assert all(torch.equal(t, torch.full((3,), 6.0)) for t in tensors)
        # The last rank's own work was pending when its call returned; its wait returns at once.
        assert not last.is_completed()
        last.wait(timeout=5)
        assert last.is_completed() and last.is_success() and last.exception() is None


def test_a_held_work_that_its_rank_only_polls_completes() -> None:
    with fakepg.World(2) as world:
        tensors = [torch.ones(2), torch.ones(2)]
        world.group(0).allreduce([tensors[0]])
        last = world.group(1).allreduce([tensors[1]])
        polls = 1
        assert not last.is_completed()  # the first poll sees it pending
        deadline = time.monotonic() + 10.0
        while not last.is_completed():
            assert time.monotonic() < deadline, "a polled held work never completed"
            polls += 1
            time.sleep(0.001)
        assert polls > 1 and torch.equal(tensors[1], torch.full((2,), 2.0))


def test_a_held_works_future_completes_on_its_ranks_lane() -> None:
    with fakepg.World(2) as world:
        # Rank 1's lane is kept busy by a callback of an earlier collective until the gate
        # opens, so that what the held work's future does can be seen before it runs.
        gate = threading.Event()
        first = [torch.ones(2), torch.ones(2)]
        earlier = world.group(1).allreduce([first[1]])
        earlier.get_future().then(lambda _: gate.wait(10.0))
        world.group(0).allreduce([first[0]])
        tensors = [torch.ones(2), torch.ones(2)]
        world.group(0).allreduce([tensors[0]])
        last = world.group(1).allreduce([tensors[1]])
        future = last.get_future()
        assert not future.done() and not last.is_completed()  # not at once, on this thread
        finisher: list[str] = []
        chained = future.then(lambda f: finisher.append(_thread_name()) or f.value())
        gate.set()
        assert torch.equal(chained.wait()[0], torch.full((2,), 2.0))
        assert len(finisher) == 1 and finisher[0].endswith("-rank1-completion0"), finisher
        assert last.is_completed()


def test_get_future_carries_the_result() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> torch.Tensor:
        t = torch.ones(3)
        return pg.allreduce([t]).get_future().wait()[0]

    assert all(torch.equal(r, torch.full((3,), 4.0)) for r in fakepg.run(fn, 4))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda pg: pg.allreduce([]), "empty list"),
        (lambda pg: pg.allreduce(torch.zeros(2)), "list of tensors"),
        (lambda pg: pg.allreduce([torch.zeros(2), torch.zeros(3)]), "tensor 1 is float32"),
        (lambda pg: pg.allreduce([torch.zeros(4, 4).t()]), "not contiguous"),
        (lambda pg: pg.allreduce([torch.zeros(2)], "sum"), "reducer.ReduceOp"),
        (lambda pg: pg.broadcast([torch.zeros(2)], 5), "root must be a rank"),
        (lambda pg: pg.allgather([[torch.zeros(2)]], [torch.zeros(2)]), "one per rank"),
        (
            lambda pg: pg.allgather([[torch.zeros(2), torch.zeros(3)]], [torch.zeros(2)]),
            r"output 0\[1\] is float32\[3\]",
        ),
    ],
)
def test_invalid_arguments_raise_value_error_from_the_call(
    call: Callable[[fakepg.FakeProcessGroup], object], match: str
) -> None:
    with fakepg.World(2) as world, pytest.raises(ValueError, match=match):
        call(world.group(0))


def test_invalid_call_does_not_consume_a_sequence_number() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> torch.Tensor:
        if pg.rank() == 0:
            with pytest.raises(ValueError, match="empty list"):
                pg.allreduce([])
        t = torch.ones(2)
        pg.allreduce([t]).wait()
        return t

    assert all(torch.equal(t, torch.full((2,), 2.0)) for t in fakepg.run(fn, 2))


def _wait(work: fakepg.Work) -> fakepg.Work:
    work.wait()
    return work


def _thread_name() -> str:
    return threading.current_thread().name


# Larger than one 256 KiB block and one 64 Ki-element part: several of each.
_BIG = 3 * 64 * 1024 + 7


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.bfloat16])
def test_broadcast_of_large_tensors_copies_every_bit(dtype: torch.dtype) -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> list[torch.Tensor]:
        g = torch.Generator().manual_seed(pg.rank())
        big = (torch.randn(_BIG, generator=g) * 1e3).to(dtype)
        strided = torch.randn(40, 30, generator=g).to(dtype).t()  # not contiguous
        tensors = [big, strided, torch.randn(5, generator=g).to(dtype)]
        pg.broadcast(tensors, 1).wait()
        return tensors

    results = fakepg.run(fn, 4)
    for tensors in results:
        for mine, roots in zip(tensors, results[1], strict=True):
            assert mine.dtype == roots.dtype and mine.shape == roots.shape
            assert torch.equal(mine, roots)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_allgather_into_tensor_of_large_inputs_copies_every_bit(
    in_place: bool, dtype: torch.dtype
) -> None:
    world_size = 3

    def fn(pg: fakepg.FakeProcessGroup) -> torch.Tensor:
        g = torch.Generator().manual_seed(pg.rank())
        output = torch.zeros(world_size * _BIG, dtype=dtype)
        mine = torch.randn(_BIG, generator=g).to(dtype)
        if in_place:  # the input is this rank's chunk of the output (as FSDP2 gathers)
            chunk = output[pg.rank() * _BIG : (pg.rank() + 1) * _BIG]
            chunk.copy_(mine)
            mine = chunk
        pg.allgather_into_tensor(output, mine).wait()
        return output

    results = fakepg.run(fn, world_size)
    want = torch.cat(
        [torch.randn(_BIG, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(3)]
    )
    for output in results:
        assert torch.equal(output, want)


def test_a_large_broadcast_is_cut_into_parts_not_one_copy_per_rank() -> None:
    """See Note [Cache-blocked fan-out]: each block of the root's tensor is read once and
    written to every other rank, in ``max_parts`` parts, whatever the world size."""
    tensors = [[torch.zeros(_BIG)] for _ in range(6)]
    assert len(fakepg.collectives.broadcast_tasks(tensors, 0, max_parts=2)) == 2
