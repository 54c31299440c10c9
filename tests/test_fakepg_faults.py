"""Every way a fake world can fail ends quickly, on every rank, with an error naming the cause."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import fakepg
from fakepg import FakeProcessGroup
from reducer import ReduceOp


def test_wait_timeout_names_the_missing_ranks_and_the_collective() -> None:
    release = threading.Event()

    def fn(pg: FakeProcessGroup) -> None:
        pg.barrier().wait()  # collective #0 completes on every rank
        if pg.rank() in (1, 3):
            release.wait(10)  # stuck: never issues collective #1 in time
            return
        try:
            with pytest.raises(fakepg.CollectiveTimeout) as info:
                pg.allreduce([torch.ones(2)], ReduceOp.MAX).wait(timeout=0.2)
        finally:
            release.set()
        text = str(info.value)
        assert "allreduce #1 (op=MAX)" in text
        assert "ranks 1, 3 never issued it" in text
        assert "ranks 0, 2 did" in text
        assert isinstance(info.value, TimeoutError)

    fakepg.run(fn, 4)


def test_a_timed_out_collective_fails_for_every_rank_that_joined() -> None:
    with fakepg.World(3) as world:
        work0 = world.group(0).allreduce([torch.ones(1)])
        work1 = world.group(1).allreduce([torch.ones(1)])
        with pytest.raises(fakepg.CollectiveTimeout, match="rank 2 never issued it"):
            work0.wait(timeout=0.05)
        # Rank 1 does not wait out its own timeout: the collective already failed.
        start = time.monotonic()
        with pytest.raises(fakepg.CollectiveTimeout, match="rank 0's wait"):
            work1.wait(timeout=30)
        assert time.monotonic() - start < 5
        # A latecomer joins a failed collective and sees the same error.
        with pytest.raises(fakepg.CollectiveTimeout, match="rank 2 never issued it"):
            world.group(2).allreduce([torch.ones(1)]).wait(timeout=30)


def test_default_timeout_is_the_worlds() -> None:
    with fakepg.World(2, timeout=0.1) as world:
        work = world.group(0).barrier()
        with pytest.raises(fakepg.CollectiveTimeout, match=r"barrier #0 timed out after 0\.1 s"):
            work.wait()


def test_a_failing_rank_wakes_every_blocked_rank_at_once() -> None:
    woke_after: dict[int, float] = {}
    failed_at: list[float] = []

    def fn(pg: FakeProcessGroup) -> None:
        if pg.rank() == 2:
            time.sleep(0.1)
            failed_at.append(time.monotonic())
            raise ValueError("boom on purpose")
        with pytest.raises(fakepg.WorldAborted) as info:
            pg.allreduce([torch.ones(4)]).wait(timeout=60)
        woke_after[pg.rank()] = time.monotonic()
        assert "rank 2 failed (ValueError: boom on purpose)" in str(info.value)
        assert "allreduce #0 (op=SUM) cannot complete" in str(info.value)
        raise info.value

    start = time.monotonic()
    with pytest.raises(ValueError, match="boom on purpose") as info:
        fakepg.run(fn, 4, timeout=60)
    assert time.monotonic() - start < 10  # nowhere near the 60 s timeout
    assert "raised on rank 2 of 4" in info.value.__notes__[0]
    assert sorted(woke_after) == [0, 1, 3]
    assert all(t >= failed_at[0] for t in woke_after.values())


def test_run_reraises_the_first_failure_naming_its_rank() -> None:
    def fn(pg: FakeProcessGroup) -> None:
        if pg.rank() == 1:
            raise KeyError("the original")
        pg.barrier().wait()

    with pytest.raises(KeyError, match="the original") as info:
        fakepg.run(fn, 3)
    notes = info.value.__notes__
    assert notes[0] == "raised on rank 1 of 3 in fakepg.run"
    assert "ranks 0, 2 failed after it" in notes[1]


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit, GeneratorExit])
def test_any_base_exception_counts_as_a_failure(exc_type: type[BaseException]) -> None:
    def fn(pg: FakeProcessGroup) -> None:
        if pg.rank() == 0:
            raise exc_type()
        pg.barrier().wait()

    with pytest.raises(exc_type):
        fakepg.run(fn, 2)


def test_collectives_after_an_abort_raise_at_once() -> None:
    with fakepg.World(2) as world:
        world.abort(RuntimeError("gone"), rank=1)
        with pytest.raises(fakepg.WorldAborted, match=r"rank 1 failed \(RuntimeError: gone\)"):
            world.group(0).allreduce([torch.ones(1)])


def test_close_fails_unfinished_collectives_and_refuses_new_ones() -> None:
    world = fakepg.World(2)
    work = world.group(0).barrier()
    world.close()
    with pytest.raises(fakepg.WorldAborted, match="world was closed"):
        work.wait(timeout=1)
    with pytest.raises(fakepg.WorldAborted, match="world was closed"):
        world.group(1).barrier()


@pytest.mark.parametrize(
    ("call0", "call1", "differs", "shown"),
    [
        (
            lambda pg: pg.allreduce([torch.ones(2)], ReduceOp.SUM),
            lambda pg: pg.allreduce([torch.ones(2)], ReduceOp.MAX),
            "op",
            ("allreduce(op=SUM, [float32[2]])", "allreduce(op=MAX, [float32[2]])"),
        ),
        (
            lambda pg: pg.allreduce([torch.ones(2)]),
            lambda pg: pg.allreduce([torch.ones(2), torch.ones(2)]),
            "tensor count",
            ("[float32[2]]", "[float32[2], float32[2]]"),
        ),
        (
            lambda pg: pg.allreduce([torch.ones(2)]),
            lambda pg: pg.allreduce([torch.ones(2, dtype=torch.float64)]),
            "dtype",
            ("[float32[2]]", "[float64[2]]"),
        ),
        (
            lambda pg: pg.allreduce([torch.ones(2, 3)]),
            lambda pg: pg.allreduce([torch.ones(3, 2)]),
            "shape",
            ("float32[2, 3]", "float32[3, 2]"),
        ),
        (
            lambda pg: pg.broadcast([torch.ones(2)], 0),
            lambda pg: pg.broadcast([torch.ones(2)], 1),
            "root",
            ("broadcast(root=0", "broadcast(root=1"),
        ),
        (
            lambda pg: pg.allreduce([torch.ones(2)]),
            lambda pg: pg.barrier(),
            "kind",
            ("allreduce(op=SUM", "barrier()"),
        ),
    ],
)
def test_mismatched_collectives_fail_on_every_rank_showing_both_sides(
    call0: object, call1: object, differs: str, shown: tuple[str, str]
) -> None:
    calls = [call0, call1, call0]
    messages: dict[int, str] = {}
    # Ranks issue in rank order, so rank 0 creates the collective and rank 1 is the first to
    # disagree: the message then names exactly those two sides.
    issued = [threading.Event() for _ in calls]

    def fn(pg: FakeProcessGroup) -> None:
        rank = pg.rank()
        if rank > 0:
            assert issued[rank - 1].wait(timeout=30)
        work = calls[rank](pg)  # type: ignore[operator]
        issued[rank].set()
        with pytest.raises(fakepg.CollectiveMismatch) as info:
            work.wait(timeout=30)
        messages[rank] = str(info.value)

    fakepg.run(fn, 3)
    assert sorted(messages) == [0, 1, 2]
    for text in messages.values():
        assert "collective #0" in text
        assert f"differ in {differs}" in text
        assert shown[0] in text and shown[1] in text
        assert "rank 0 issued" in text and "rank 1 issued" in text


def test_a_rank_that_returns_early_fails_its_peers_at_once() -> None:
    def fn(pg: FakeProcessGroup) -> None:
        pg.barrier().wait()
        if pg.rank() == 1:
            return  # skips the allreduce everyone else waits in
        pg.allreduce([torch.ones(1)]).wait(timeout=60)

    start = time.monotonic()
    with pytest.raises(fakepg.RankExited) as info:
        fakepg.run(fn, 3, timeout=60)
    assert time.monotonic() - start < 10
    text = str(info.value)
    assert "allreduce #1 (op=SUM) can never complete" in text
    assert "rank 1 returned from the rank function without issuing it" in text
    assert "rank 1 issued 1 collective(s)" in text


def test_nothing_hangs_when_a_rank_never_calls_the_collective() -> None:
    """Rank 1 computes forever; rank 0 times out, and run still ends, with no threads left."""

    def fn(pg: FakeProcessGroup) -> None:
        if pg.rank() == 1:
            while True:
                time.sleep(0.01)
        pg.allreduce([torch.ones(1)]).wait()

    start = time.monotonic()
    with pytest.raises(fakepg.CollectiveTimeout, match="rank 1 never issued it"):
        fakepg.run(fn, 2, timeout=0.5)
    assert time.monotonic() - start < 0.5 + 2 * 0.5 + 3
    time.sleep(0.1)
    assert not [t for t in threading.enumerate() if t.name.startswith("fakepg-")]


def test_an_internal_kernel_error_fails_the_collective_instead_of_hanging(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fakepg import collectives

    def broken(*args: object) -> list[collectives.Task]:
        def task() -> None:
            raise MemoryError("simulated")

        return [task]

    monkeypatch.setattr(collectives, "dense_allreduce_tasks", broken)
    with pytest.raises(fakepg.FakePGError, match="MemoryError: simulated"):
        fakepg.run(lambda pg: pg.allreduce([torch.ones(2)]).wait(), 2)


@pytest.mark.parametrize("timeout", [float("inf"), float("nan"), -1.0, 0.0])
def test_a_world_timeout_must_be_finite_and_positive(timeout: float) -> None:
    """Every wait has a deadline: an infinite default would make every wait raise
    OverflowError later, so it is refused here, naming the argument."""
    with pytest.raises(ValueError, match="World: timeout must be > 0 seconds and finite"):
        fakepg.World(2, timeout=timeout)


@pytest.mark.parametrize(
    ("timeout", "error", "match"),
    [
        (-1.0, ValueError, "Work.wait: timeout must be a finite number of seconds > 0, got -1.0"),
        (float("inf"), ValueError, "timeout must be a finite number of seconds > 0, got inf"),
        (0, ValueError, "timeout must be a finite number of seconds > 0, got 0"),
        ("5", TypeError, "Work.wait: timeout must be a number of seconds or None, got str"),
    ],
)
def test_a_bad_wait_timeout_is_refused_on_the_calling_rank_only(
    timeout: object, error: type[Exception], match: str
) -> None:
    with fakepg.World(2) as world:
        work0 = world.group(0).allreduce([torch.ones(2)])
        with pytest.raises(error, match=match):
            work0.wait(timeout)  # type: ignore[arg-type]
        # The collective goes on: rank 1 joins and both complete.
        t1 = torch.ones(2)
        world.group(1).allreduce([t1]).wait(timeout=10)
        work0.wait(timeout=10)
        assert work0.is_success() and torch.equal(t1, torch.full((2,), 2.0))


def test_close_during_run_stops_ranks_that_compute_outside_collectives(
    no_leaked_threads: None,
) -> None:
    """A rank looping in Python never reaches a collective; close() from another thread still
    ends the run within the bound (two grace periods of min(timeout, 5) s)."""
    world = fakepg.World(3, timeout=0.5)
    looping = threading.Barrier(3)

    def fn(pg: FakeProcessGroup) -> None:
        if pg.rank() == 0:
            pg.barrier().wait(timeout=60)  # blocked in a collective: woken by close
            return
        looping.wait(10)
        spins = 0
        while True:  # computing forever, outside any collective
            spins += 1

    def close_soon() -> None:
        looping.wait(10)
        world.close()

    closer = threading.Thread(target=close_soon)
    closer.start()
    start = time.monotonic()
    with pytest.raises(fakepg.WorldAborted) as info:
        world.run(fn)
    closer.join(10)
    assert time.monotonic() - start < 2 * 0.5 + 5
    assert "world was closed" in str(info.value)
    stopped = [t for t in threading.enumerate() if t.name.startswith("fakepg-rank")]
    assert not stopped


def test_a_rank_stopped_while_computing_says_why() -> None:
    world = fakepg.World(2, timeout=0.2)
    started = threading.Event()

    def fn(pg: FakeProcessGroup) -> None:
        started.set()
        while True:
            pass

    threading.Thread(target=lambda: (started.wait(10), world.close())).start()
    with pytest.raises(fakepg.WorldAborted) as info:
        world.run(fn)
    assert "was stopped while it computed outside any collective, because the world was closed" in (
        str(info.value)
    )


def test_closing_while_a_rank_is_stuck_in_a_c_call_raises_instead_of_partial_results() -> None:
    """time.sleep cannot be interrupted from Python: the rank is left behind, and run says so
    rather than returning a result list with a hole in it."""
    world = fakepg.World(2, timeout=0.1)
    sleeping = threading.Event()

    def fn(pg: FakeProcessGroup) -> int:
        if pg.rank() == 1:
            sleeping.set()
            time.sleep(1.0)  # one C call, longer than both grace periods (2 x 0.1 s)
        return pg.rank()

    closer = threading.Thread(target=lambda: (sleeping.wait(10), world.close()))
    closer.start()
    with pytest.raises(fakepg.WorldAborted, match="rank 1 was stopped") as info:
        world.run(fn)
    closer.join(10)
    assert any("rank 1 did not stop after the abort" in note for note in info.value.__notes__)
    for thread in threading.enumerate():  # let the sleeper end, so no other test sees it
        if thread.name == "fakepg-rank-1":
            thread.join(5)
