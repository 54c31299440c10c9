"""The collectives beyond reducer.ProcessGroup's four, subgroups and point-to-point messages.

Reductions are checked bit for bit against a rank-order reference, whatever order the ranks
join in; data movement exactly; and every failure mode (bad arguments on one rank, ranks whose
arguments do not fit together, a missing peer) by the words of its error.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from test_fakepg_collectives import (
    JOIN_ORDERS,
    issue_in_order,
    join_order,
    random_tensor,
    rank_order_reference,
)

import fakepg
from fakepg import FakeProcessGroup
from reducer import ReduceOp

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64]


def ops_for(dtype: torch.dtype) -> list[ReduceOp]:
    return [op for op in ReduceOp if dtype.is_floating_point or op != ReduceOp.AVG]


# -------------------------------------------------------------------------------------------
# reduce


@pytest.mark.parametrize("order", JOIN_ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_writes_the_rank_order_reduction_into_the_root_only(
    dtype: torch.dtype, order: str
) -> None:
    world_size, root = 5, 3
    gen = torch.Generator().manual_seed(11)
    for op in ops_for(dtype):
        inputs = [[random_tensor((2, 37), dtype, gen) for _ in range(2)] for _ in range(5)]
        expected = rank_order_reference([t for ts in inputs for t in ts], op)
        tensors = [[t.clone() for t in ts] for ts in inputs]

        def call(
            pg: FakeProcessGroup, t: list[list[torch.Tensor]] = tensors, o: ReduceOp = op
        ) -> fakepg.Work:
            return pg.reduce(t[pg.rank()], root, o)

        with fakepg.World(world_size) as world:
            issue_in_order(world, join_order(order, world_size, seed=3), call)
        for rank in range(world_size):
            for t, original in zip(tensors[rank], inputs[rank], strict=True):
                want = expected if rank == root else original
                assert torch.equal(t, want), f"{op.name} rank {rank}"


# -------------------------------------------------------------------------------------------
# reduce_scatter


@pytest.mark.parametrize("order", JOIN_ORDERS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_gives_rank_r_the_reduction_of_every_ranks_part_r(
    dtype: torch.dtype, order: str
) -> None:
    world_size = 4
    gen = torch.Generator().manual_seed(5)
    for op in ops_for(dtype):
        parts = [[random_tensor((3, 5), dtype, gen) for _ in range(4)] for _ in range(4)]
        outputs = [torch.empty(3, 5, dtype=dtype) for _ in range(world_size)]

        def call(
            pg: FakeProcessGroup,
            out: list[torch.Tensor] = outputs,
            ins: list[list[torch.Tensor]] = parts,
            o: ReduceOp = op,
        ) -> fakepg.Work:
            return pg.reduce_scatter(out[pg.rank()], ins[pg.rank()], o)

        with fakepg.World(world_size) as world:
            issue_in_order(world, join_order(order, world_size, seed=1), call)
        for dst in range(world_size):
            want = rank_order_reference([parts[src][dst] for src in range(world_size)], op)
            assert torch.equal(outputs[dst], want), f"{op.name} rank {dst}"


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
def test_reduce_scatter_tensor_chunks_the_flat_input_in_rank_order(world_size: int) -> None:
    gen = torch.Generator().manual_seed(world_size)
    inputs = [random_tensor((world_size * 6, 7), torch.float32, gen) for _ in range(world_size)]

    def fn(pg: FakeProcessGroup) -> torch.Tensor:
        out = torch.empty(6, 7)
        pg.reduce_scatter_tensor(out, inputs[pg.rank()], ReduceOp.AVG).wait()
        return out

    results = fakepg.run(fn, world_size)
    for dst, got in enumerate(results):
        chunks = [t.reshape(-1).chunk(world_size)[dst].view(6, 7) for t in inputs]
        assert torch.equal(got, rank_order_reference(chunks, ReduceOp.AVG))


def test_reduce_scatter_tensor_is_bitwise_however_many_workers_split_it() -> None:
    """Chunks large enough for several parts and cache blocks, with a ragged tail."""
    world_size, numel = 3, 200_003
    gen = torch.Generator().manual_seed(0)
    inputs = [random_tensor((world_size * numel,), torch.float32, gen) for _ in range(3)]
    results = []
    for threads in (1, 3):
        outputs = [torch.empty(numel) for _ in range(world_size)]

        def call(pg: FakeProcessGroup, out: list[torch.Tensor] = outputs) -> fakepg.Work:
            return pg.reduce_scatter_tensor(out[pg.rank()], inputs[pg.rank()])

        with fakepg.World(world_size, threads=threads) as world:
            issue_in_order(world, [2, 0, 1], call)
        results.append(outputs)
    for dst in range(world_size):
        want = rank_order_reference([t.chunk(world_size)[dst] for t in inputs], ReduceOp.SUM)
        assert torch.equal(results[0][dst], want) and torch.equal(results[1][dst], want)


@pytest.mark.parametrize("threads", [1, 3])
def test_reduce_scatter_into_its_own_input_is_bitwise(threads: int) -> None:
    """An output that is the rank's own chunk of its input (as FSDP's in-place form passes it)
    is written only after every block it holds has been read: the kernel accumulates in the
    output only when the output overlaps no input. Large enough for several cache blocks."""
    world_size, numel = 3, 200_003
    gen = torch.Generator().manual_seed(1)
    originals = [random_tensor((world_size * numel,), torch.float32, gen) for _ in range(3)]
    inputs = [t.clone() for t in originals]
    lists = [list(t.clone().chunk(world_size)) for t in originals]

    def call(pg: FakeProcessGroup) -> fakepg.Work:
        r = pg.rank()
        return pg.reduce_scatter_tensor(inputs[r].chunk(world_size)[r], inputs[r])

    def call_list(pg: FakeProcessGroup) -> fakepg.Work:
        r = pg.rank()
        return pg.reduce_scatter(lists[r][r], lists[r])

    with fakepg.World(world_size, threads=threads) as world:
        issue_in_order(world, [1, 2, 0], call)
        issue_in_order(world, [2, 0, 1], call_list)
    for dst in range(world_size):
        want = rank_order_reference([t.chunk(world_size)[dst] for t in originals], ReduceOp.SUM)
        assert torch.equal(inputs[dst].chunk(world_size)[dst], want), f"tensor form, rank {dst}"
        assert torch.equal(lists[dst][dst], want), f"list form, rank {dst}"


def test_coalesced_forms_are_one_collective_each() -> None:
    def fn(pg: FakeProcessGroup) -> tuple[int, list[torch.Tensor], int]:
        r = pg.rank()
        rs_out = [torch.empty(1), torch.empty(2, dtype=torch.float64)]
        rs_in = [torch.tensor([1.0, 2.0]) * (r + 1), torch.arange(4, dtype=torch.float64) + r]
        first = pg.reduce_scatter_tensor_coalesced(rs_out, rs_in)
        ag_out = [torch.empty(2, 3), torch.empty(4)]
        second = pg.allgather_into_tensor_coalesced(
            ag_out, [torch.full((3,), float(r)), torch.full((2,), -float(r))]
        )
        third = pg.barrier()
        for work in (first, second, third):
            work.wait()
        return first.seq, [*rs_out, *ag_out], third.seq

    for rank, (seq0, tensors, seq2) in enumerate(fakepg.run(fn, 2)):
        assert (seq0, seq2) == (0, 2)
        assert torch.equal(tensors[0], torch.tensor([[1.0 + 2.0], [2.0 + 4.0]][rank]))
        assert torch.equal(tensors[1], torch.tensor([[1.0, 3.0], [5.0, 7.0]][rank]).double())
        assert torch.equal(tensors[2], torch.tensor([[0.0] * 3, [1.0] * 3]))
        assert torch.equal(tensors[3], torch.tensor([0.0, 0.0, -1.0, -1.0]))


# -------------------------------------------------------------------------------------------
# all_to_all, gather, scatter


def test_all_to_all_moves_part_r_of_rank_s_to_part_s_of_rank_r_whatever_the_shapes() -> None:
    world_size = 3

    def fn(pg: FakeProcessGroup) -> list[torch.Tensor]:
        r = pg.rank()
        # Rank s sends s + d + 1 elements to rank d.
        inputs = [torch.full((r + d + 1,), float(10 * r + d)) for d in range(world_size)]
        outputs = [torch.empty(s + r + 1) for s in range(world_size)]
        pg.all_to_all(outputs, inputs).wait()
        return outputs

    for dst, outputs in enumerate(fakepg.run(fn, world_size)):
        for src, got in enumerate(outputs):
            assert torch.equal(got, torch.full((src + dst + 1,), float(10 * src + dst)))


def test_all_to_all_shapes_that_do_not_fit_fail_on_every_rank_naming_both() -> None:
    def fn(pg: FakeProcessGroup) -> str:
        outputs = [torch.empty(2), torch.empty(3 if pg.rank() == 1 else 2)]
        with pytest.raises(fakepg.CollectiveMismatch) as info:
            pg.all_to_all(outputs, [torch.ones(2), torch.ones(2)]).wait()
        return str(info.value)

    for text in fakepg.run(fn, 2):
        assert "all_to_all #0" in text
        assert "rank 1 sends float32[2] to rank 1, but rank 1 expects float32[3]" in text


@pytest.mark.parametrize("splits", [None, "uneven"])
def test_all_to_all_single_moves_rows_by_split_sizes(splits: str | None) -> None:
    world_size = 3

    def sent(src: int, dst: int) -> int:
        return 2 if splits is None else src + 2 * dst  # rows from src to dst (some zero)

    def fn(pg: FakeProcessGroup) -> torch.Tensor:
        r = pg.rank()
        in_splits = [sent(r, d) for d in range(world_size)]
        out_splits = [sent(s, r) for s in range(world_size)]
        rows = [torch.full((n, 2), float(10 * r + d)) for d, n in enumerate(in_splits)]
        out = torch.empty(sum(out_splits), 2)
        if splits is None:
            pg.all_to_all_single(out, torch.cat(rows)).wait()
        else:
            pg.all_to_all_single(out, torch.cat(rows), out_splits, in_splits).wait()
        return out

    for dst, got in enumerate(fakepg.run(fn, world_size)):
        want = torch.cat(
            [torch.full((sent(s, dst), 2), float(10 * s + dst)) for s in range(world_size)]
        )
        assert torch.equal(got, want)


def test_all_to_all_single_split_sizes_that_disagree_name_both_ranks() -> None:
    def fn(pg: FakeProcessGroup) -> str:
        # Rank 0 sends 1 row to rank 1; rank 1 expects 2 rows from rank 0.
        in_splits, out_splits = ([3, 1], [3, 1]) if pg.rank() == 0 else ([2, 2], [2, 2])
        with pytest.raises(fakepg.CollectiveMismatch) as info:
            pg.all_to_all_single(torch.empty(4), torch.ones(4), out_splits, in_splits).wait()
        return str(info.value)

    for text in fakepg.run(fn, 2):
        assert "all_to_all_single #0" in text
        assert "rank 1 sends 2 row(s) to rank 0 (its input_split_sizes [2, 2])" in text
        assert "rank 0 expects 1 from rank 1 (its output_split_sizes [3, 1])" in text


@pytest.mark.parametrize("root", [0, 2])
def test_gather_and_scatter(root: int) -> None:
    world_size = 3

    def fn(pg: FakeProcessGroup) -> tuple[list[torch.Tensor] | None, torch.Tensor]:
        r = pg.rank()
        gathered = [torch.empty(2, 2) for _ in range(world_size)] if r == root else None
        pg.gather(torch.full((2, 2), float(r)), gathered, root).wait()
        parts = [torch.full((3,), 5.0 * d) for d in range(world_size)] if r == root else None
        mine = torch.empty(3)
        pg.scatter(mine, parts, root).wait()
        return gathered, mine

    for rank, (gathered, mine) in enumerate(fakepg.run(fn, world_size)):
        if rank == root:
            assert gathered is not None
            assert [g[0, 0].item() for g in gathered] == [0.0, 1.0, 2.0]
        else:
            assert gathered is None
        assert torch.equal(mine, torch.full((3,), 5.0 * rank))


def test_allgather_into_tensor_fills_the_ranks_chunks_of_any_output_shape() -> None:
    def fn(pg: FakeProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
        r = pg.rank()
        stacked, flat = torch.empty(3, 2, 2), torch.empty(12)
        pg.allgather_into_tensor(stacked, torch.full((2, 2), float(r))).wait()
        pg.allgather_into_tensor(flat, torch.full((2, 2), float(r)).t()).wait()  # strided in
        return stacked, flat

    for stacked, flat in fakepg.run(fn, 3):
        assert torch.equal(stacked, torch.arange(3.0).repeat_interleave(4).view(3, 2, 2))
        assert torch.equal(flat, torch.arange(3.0).repeat_interleave(4))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda pg: pg.reduce([torch.ones(2)], 2), r"reduce: root must be a rank in \[0, 2\)"),
        (lambda pg: pg.reduce([torch.eye(2).to_sparse()], 0), "dense tensors only"),
        (
            lambda pg: pg.reduce_scatter(torch.empty(2), [torch.ones(2)]),
            r"reduce_scatter: got 1 input tensor\(s\); pass one per rank \(2\)",
        ),
        (
            lambda pg: pg.reduce_scatter(torch.empty(2), [torch.ones(2), torch.ones(3)]),
            r"reduce_scatter: input 1 is float32\[3\] but the output is float32\[2\]",
        ),
        (
            lambda pg: pg.reduce_scatter_tensor(torch.empty(2), torch.ones(5)),
            r"the input has 5 elements but needs size\(\) x the output's = 2 x 2 = 4",
        ),
        (
            lambda pg: pg.reduce_scatter_tensor(torch.empty(2), torch.ones(4, 4).t()),
            "not contiguous",
        ),
        (
            lambda pg: pg.reduce_scatter_tensor(
                torch.empty(2, dtype=torch.int64), torch.ones(4, dtype=torch.int64), ReduceOp.AVG
            ),
            "AVG needs a floating dtype",
        ),
        (
            lambda pg: pg.allgather_into_tensor(torch.empty(3), torch.ones(2)),
            r"the output has 3 elements but needs size\(\) x the input's = 2 x 2 = 4",
        ),
        (
            lambda pg: pg.allgather_into_tensor(torch.empty(4, dtype=torch.int32), torch.ones(2)),
            "they differ in dtype",
        ),
        (
            lambda pg: pg.all_to_all([torch.ones(1)], [torch.ones(1), torch.ones(1)]),
            r"all_to_all: got 1 outputs; pass one per rank \(2\)",
        ),
        (
            lambda pg: pg.all_to_all_single(torch.empty(3), torch.ones(3)),
            r"dim 0 \(3\) is split into size\(\) = 2 equal parts, but 3 is not a multiple",
        ),
        (
            lambda pg: pg.all_to_all_single(torch.empty(4), torch.ones(4), None, [1, 2]),
            r"input_split_sizes \[1, 2\] add up to 3, but dim 0 has 4 rows",
        ),
        (
            lambda pg: pg.all_to_all_single(torch.empty(4, 2), torch.ones(4, 3)),
            "every dimension but the first",
        ),
        (
            lambda pg: pg.gather(torch.ones(2), None, 0),
            r"gather: the root \(rank 0\) must pass gather_list, one tensor per rank \(2\)",
        ),
        (
            lambda pg: pg.gather(torch.ones(2), [torch.ones(2), torch.ones(3)], 0),
            r"gather: gather_list\[1\] is float32\[3\] but the tensor is float32\[2\]",
        ),
        (
            lambda pg: pg.scatter(torch.ones(2), [torch.ones(2)] * 2, 1),
            r"scatter: scatter_list is given on rank 0, but only the root \(rank 1\) passes one",
        ),
        (lambda pg: pg.send([torch.ones(1)], 0), "dst=0 is this rank itself"),
        (lambda pg: pg.recv([torch.ones(1)], 2), r"recv: src must be a rank in \[0, 2\)"),
        (lambda pg: pg.send([torch.ones(1)], 1, tag="a"), "send: tag must be an int"),
        (lambda pg: pg.monitored_barrier(timeout=-1.0), "timeout must be a finite number"),
        (lambda pg: pg.new_group([0, 0]), r"ranks \[0, 0\] name a rank twice"),
        (lambda pg: pg.new_group([]), "ranks must be a non-empty list"),
    ],
)
def test_invalid_arguments_raise_value_error_on_the_calling_rank(
    call: Callable[[FakeProcessGroup], object], match: str
) -> None:
    with fakepg.World(2) as world:
        with pytest.raises(ValueError, match=match):
            call(world.group(0))
        # Nothing was issued: both ranks still agree on collective #0.
        works = [world.group(r).barrier() for r in (0, 1)]
        for work in works:
            work.wait(timeout=10)
        assert works[0].seq == 0


# -------------------------------------------------------------------------------------------
# send and recv. See Note [Point-to-point matching].


def test_send_and_recv_match_per_pair_and_tag_in_order() -> None:
    def fn(pg: FakeProcessGroup) -> list[torch.Tensor]:
        if pg.rank() == 0:
            works = [
                pg.send([torch.tensor([1.0])], 1, tag=7),
                pg.send([torch.tensor([2.0])], 1, tag=7),
                pg.send([torch.tensor([3.0])], 1, tag=9),
            ]
            for work in works:
                work.wait()
            return []
        first9, first7, second7 = torch.empty(1), torch.empty(1), torch.empty(1)
        works = [pg.recv([first9], 0, tag=9), pg.recv([first7], 0, tag=7)]
        works.append(pg.recv([second7], 0, tag=7))
        for work in works:
            work.wait()
        return [first9, first7, second7]

    assert fakepg.run(fn, 2)[1] == [torch.tensor([3.0]), torch.tensor([1.0]), torch.tensor([2.0])]


def test_messages_do_not_take_the_groups_sequence_numbers() -> None:
    """A ring of isend/irecv between two collectives: the collectives are #0 and #1."""
    world_size = 4

    def fn(pg: FakeProcessGroup) -> tuple[list[int], torch.Tensor]:
        r = pg.rank()
        first = pg.barrier()
        got = torch.empty(2)
        works = [
            pg.send([torch.full((2,), float(r))], (r + 1) % world_size),
            pg.recv([got], (r - 1) % world_size),
        ]
        last = pg.barrier()
        for work in [first, *works, last]:
            work.wait()
        return [first.seq, last.seq], got

    for rank, (seqs, got) in enumerate(fakepg.run(fn, world_size)):
        assert seqs == [0, 1]
        assert torch.equal(got, torch.full((2,), float((rank - 1) % world_size)))


def test_a_send_completes_only_when_its_recv_is_posted() -> None:
    with fakepg.World(2) as world:
        sent = world.group(0).send([torch.ones(3)], 1)
        assert not sent.is_completed()
        got = torch.zeros(3)
        world.group(1).recv([got], 0).wait(timeout=10)
        sent.wait(timeout=10)
        assert torch.equal(got, torch.ones(3))


def test_a_recv_of_another_shape_fails_both_sides_showing_both() -> None:
    def fn(pg: FakeProcessGroup) -> str:
        if pg.rank() == 0:
            work = pg.send([torch.ones(3)], 1)
        else:
            work = pg.recv([torch.empty(4, dtype=torch.float64)], 0)
        with pytest.raises(fakepg.CollectiveMismatch) as info:
            work.wait()
        return str(info.value)

    for text in fakepg.run(fn, 2):
        assert "send/recv #0 from rank 0 to rank 1 (tag 0)" in text
        assert "rank 0 sends send([float32[3]])" in text
        assert "rank 1's matching recv is recv([float64[4]])" in text
        assert "differ in dtype, shape" in text


def test_a_recv_that_no_send_matches_times_out_naming_the_sender_and_other_tags() -> None:
    sent, timed_out = threading.Event(), threading.Event()

    def fn(pg: FakeProcessGroup) -> str:
        if pg.rank() == 0:
            pg.send([torch.ones(1)], 1, tag=3)  # never received: another tag
            sent.set()
            assert timed_out.wait(10)  # stay: a rank that returned fails the recv at once
            return ""
        work = pg.recv([torch.empty(1)], 0, tag=4)
        assert sent.wait(10)
        try:
            with pytest.raises(fakepg.CollectiveTimeout) as info:
                work.wait(timeout=0.2)
        finally:
            timed_out.set()
        return str(info.value)

    with fakepg.World(2, timeout=10) as world:
        text = world.run(fn)[1]
        assert world.aborted  # both pairs ended the run uneven
    assert "send/recv #0 from rank 0 to rank 1 (tag 4) timed out after 0.2 s" in text
    assert "rank 0 never sent it (rank 1 posted the recv)" in text
    assert "rank 0 has a send pending with tag 3" in text
    assert "a send and its recv must use the same tag" in text


def test_a_rank_that_returns_without_its_recv_fails_the_send_at_once() -> None:
    def fn(pg: FakeProcessGroup) -> None:
        if pg.rank() == 0:
            pg.send([torch.ones(1)], 1).wait(timeout=60)

    start = time.monotonic()
    with pytest.raises(fakepg.RankExited) as info:
        fakepg.run(fn, 2, timeout=60)
    assert time.monotonic() - start < 10
    assert (
        "send/recv #0 from rank 0 to rank 1 (tag 0) can never complete: rank 1 returned from "
        "the rank function without posting the matching recv" in str(info.value)
    )


def test_sends_that_no_recv_took_leave_the_world_out_of_step() -> None:
    with fakepg.World(2) as world:
        world.group(0).send([torch.ones(1)], 1)  # never waited for, never received
        world.run(lambda pg: None)  # the run ends with the pair uneven
        assert world.aborted
        with pytest.raises(fakepg.WorldAborted, match="rank 0 sent 1 message"):
            world.group(0).barrier()


# -------------------------------------------------------------------------------------------
# monitored_barrier


def test_monitored_barrier_names_every_rank_that_did_not_arrive() -> None:
    release = threading.Event()

    def fn(pg: FakeProcessGroup) -> str:
        if pg.rank() in (1, 3):
            release.wait(10)
            return ""
        try:
            with pytest.raises(fakepg.CollectiveTimeout) as info:
                pg.monitored_barrier(timeout=0.2)
        finally:
            release.set()
        return str(info.value)

    with fakepg.World(4, timeout=10) as world:
        results = world.run(fn)
    for rank in (0, 2):
        assert "monitored_barrier #0 timed out after 0.2 s" in results[rank]
        assert "ranks 1, 3 did not arrive (ranks 0, 2 did)" in results[rank]


def test_monitored_barrier_returns_once_every_rank_arrived() -> None:
    assert fakepg.run(lambda pg: pg.monitored_barrier(timeout=10), 3) == [None] * 3


# -------------------------------------------------------------------------------------------
# Subgroups. See Note [Subgroups].


def test_subgroups_number_their_collectives_apart_and_reduce_in_rank_order() -> None:
    world_size = 4
    gen = torch.Generator().manual_seed(2)
    inputs = [random_tensor((33,), torch.float32, gen) for _ in range(world_size)]

    def fn(pg: FakeProcessGroup) -> tuple[object, ...]:
        r = pg.rank()
        evens = pg.new_group([2, 0])  # order does not matter: ranks are sorted
        odds = pg.new_group([1, 3])
        mine = evens if r % 2 == 0 else odds
        assert mine is not None and (evens is None) != (odds is None)
        t = inputs[r].clone()
        # Odd ranks issue a world barrier first, even ranks last: the groups are separate.
        if r % 2:
            pg.barrier().wait()
        work = mine.allreduce([t])
        if not r % 2:
            pg.barrier().wait()
        work.wait()
        return mine.rank(), mine.size(), mine.global_rank, work.seq, t

    for r, (group_rank, size, global_rank, seq, t) in enumerate(fakepg.run(fn, world_size)):
        assert (group_rank, size, global_rank, seq) == (r // 2, 2, r, 0)
        members = [r % 2, r % 2 + 2]
        want = rank_order_reference([inputs[m] for m in members], ReduceOp.SUM)
        assert torch.equal(t, want)


def test_roots_and_peers_are_ranks_of_the_subgroup() -> None:
    def fn(pg: FakeProcessGroup) -> torch.Tensor | None:
        sub = pg.new_group([1, 2])
        if sub is None:
            return None
        t = torch.full((2,), float(pg.rank()))
        sub.broadcast([t], root=1).wait()  # group rank 1 = world rank 2
        if sub.rank() == 0:
            sub.send([t * 10], 1).wait()
        else:
            sub.recv([t], 0).wait()
        return t

    assert [None if t is None else t.tolist() for t in fakepg.run(fn, 3)] == [
        None,
        [2.0, 2.0],
        [20.0, 20.0],
    ]


def test_new_group_calls_that_name_different_ranks_are_refused_showing_both() -> None:
    with fakepg.World(3) as world:
        world.group(0).new_group([0, 1])
        with pytest.raises(
            ValueError,
            match=r"rank 2's call #0 names ranks \[1, 2\], but rank 0's call #0 named \[0, 1\]",
        ):
            world.group(2).new_group([1, 2])
        assert world.group(2).new_group([0, 1]) is None  # the same call, retried correctly


def test_a_subgroup_timeout_names_the_missing_member_by_world_rank() -> None:
    with fakepg.World(4) as world:
        sub = world.group(1).new_group([1, 3])
        assert sub is not None
        for r in (0, 2, 3):
            world.group(r).new_group([1, 3])
        with pytest.raises(fakepg.CollectiveTimeout) as info:
            sub.allreduce([torch.ones(1)]).wait(timeout=0.1)
    assert "allreduce #0 (op=SUM) in group [1, 3] timed out" in str(info.value)
    assert "rank 3 never issued it (rank 1 did)" in str(info.value)


def test_a_rank_that_returns_fails_its_subgroups_at_once() -> None:
    def fn(pg: FakeProcessGroup) -> None:
        sub = pg.new_group([0, 1])
        if pg.rank() == 1 or sub is None:
            return
        sub.barrier().wait(timeout=60)

    with pytest.raises(fakepg.RankExited, match=r"barrier #0 in group \[0, 1\] can never complete"):
        fakepg.run(fn, 3, timeout=60)


def test_ranks_out_of_step_in_a_subgroup_abort_the_world_at_the_end_of_the_run() -> None:
    with fakepg.World(2) as world:

        def fn(pg: FakeProcessGroup) -> None:
            sub = pg.new_group([0, 1])
            assert sub is not None
            if pg.rank() == 0:
                sub.barrier()  # never matched

        world.run(fn)
        assert world.aborted
        with pytest.raises(fakepg.WorldAborted, match=r"in group \[0, 1\] \(rank 0: 1, rank 1: 0"):
            world.group(0).barrier()
