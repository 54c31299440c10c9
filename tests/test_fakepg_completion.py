"""Where and when futures complete: each rank's own completion threads, in completion order,
and every wait bounded, a wait inside a callback included. See Note [Completion lanes] in
fakepg.completion and Note [Every collective has a deadline] in fakepg.world."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch

import fakepg
import fakepg.completion
from fakepg import FakeProcessGroup, _threads

# Each would hang without the lanes and the watchdog: bound them well below the suite's.
pytestmark = pytest.mark.timeout(90)


def _thread_name() -> str:
    return threading.current_thread().name


def test_a_callback_may_wait_for_a_collective_its_peers_issue_from_their_callbacks(
    no_leaked_threads: None,
) -> None:
    """torch's PowerSGD pattern, without torch's DDP: the callback of collective #0 on ranks
    0..2 issues collective #1 and waits for it on a torch future (no deadline). Every rank's
    callback must run while the others' wait: had they shared one thread, the first would
    wait forever for peers queued behind it. Rank 3 issues #0 only once the others chained
    their callbacks (so none runs at once, on the rank's own thread), then #1 itself."""
    chained, inner_chained = threading.Barrier(4, timeout=20), threading.Barrier(4, timeout=20)

    def fn(pg: FakeProcessGroup) -> tuple[torch.Tensor, list[str]]:
        where: list[str] = []
        first = torch.full((3,), float(pg.rank() + 1))
        if pg.rank() == 3:
            chained.wait()
            pg.allreduce([first]).wait()
            second = first * 2
            inner_chained.wait()
            pg.allreduce([second]).wait()
            return second, where

        def then(_: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            where.append(_thread_name())
            second = first * 2  # 2 * (1 + 2 + 3 + 4) after the first sum
            inner = pg.allreduce([second]).get_future()
            recorded = inner.then(lambda _: where.append(_thread_name()))
            inner_chained.wait()  # rank 3 issues #1 once every inner callback is chained
            recorded.wait()
            return inner.wait()[0]

        future = pg.allreduce([first]).get_future().then(then)
        chained.wait()
        return future.wait(), where

    for rank, (got, where) in enumerate(fakepg.run(fn, 4, timeout=10.0)):
        assert torch.equal(got, torch.full((3,), 80.0))
        if rank < 3:
            # The outer callback on the rank's level-0 lane, the inner one a level deeper.
            assert where[0].endswith(f"-rank{rank}-completion0"), where
            assert where[1].endswith(f"-rank{rank}-completion1"), where


def test_closing_joins_a_lane_thread_still_ending(
    no_leaked_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lane thread that has seen the close and drained its queue clears its lane before
    its job ends (the kept thread's per-job resets run after that): close() must join it all
    the same. Here the closing thread is held up between closing and joining (a slow clock
    read) and the resets are slow, so the lanes have cleared themselves, their threads still
    running, by the time close() would look at them again."""
    closing = threading.Event()

    def slow_reset() -> None:
        if closing.is_set() and "-completion" in _thread_name():
            time.sleep(0.2)

    class SlowClock:
        """The completion module's ``time``, whose monotonic() is slow while closing."""

        def __getattr__(self, name: str) -> object:
            return getattr(time, name)

        def monotonic(self) -> float:
            if closing.is_set():
                time.sleep(0.05)
            return time.monotonic()

    monkeypatch.setattr(_threads, "_resets", [*_threads._resets, slow_reset])
    monkeypatch.setattr(fakepg.completion, "time", SlowClock())

    def fn(pg: FakeProcessGroup) -> float:
        doubled = pg.allreduce([torch.ones(1)]).get_future().then(lambda f: f.value()[0] * 2)
        return float(doubled.wait())

    with fakepg.World(2, timeout=10) as world:
        assert world.run(fn) == [4.0, 4.0]
        closing.set()  # the world closes as the with block ends


def test_a_ranks_callbacks_fire_in_the_order_its_collectives_complete() -> None:
    """Twelve collectives of different sizes, all in flight at once; ranks 0 and 1 chain a
    callback to each before rank 2 issues any (so none has completed yet). Each rank's
    callbacks fire in the order the collectives completed (by their completion times), on the
    rank's own completion thread, and that order is the same on both."""
    sizes = [1 << (14 + (i * 5) % 7) for i in range(12)]
    chained = threading.Barrier(3, timeout=20)

    def fn(pg: FakeProcessGroup) -> tuple[list[int], list[int], set[str]]:
        fired: list[int] = []
        threads: set[str] = set()
        if pg.rank() == 2:
            chained.wait()
            works = [pg.allreduce([torch.ones(n)]) for n in sizes]
            for work in works:
                work.wait()
            return fired, [], threads
        works = [pg.allreduce([torch.ones(n)]) for n in sizes]

        def recorder(i: int) -> Callable[[torch.futures.Future[list[torch.Tensor]]], None]:
            def record(_: torch.futures.Future[list[torch.Tensor]]) -> None:
                fired.append(i)
                threads.add(_thread_name())

            return record

        futures = [work.get_future().then(recorder(i)) for i, work in enumerate(works)]
        chained.wait()
        torch.futures.wait_all(futures)
        by_completion = sorted(range(len(works)), key=lambda i: works[i].completed_ns or 0)
        return fired, by_completion, threads

    results = fakepg.run(fn, 3, timeout=20.0)
    for rank, (fired, by_completion, threads) in enumerate(results[:2]):
        assert fired == by_completion, f"rank {rank}"
        assert len(threads) == 1 and threads.pop().endswith(f"-rank{rank}-completion0")
    assert results[0][0] == results[1][0]


def test_a_future_requested_after_completion_is_complete_at_once() -> None:
    with fakepg.World(2) as world:
        works = [world.group(r).allreduce([torch.ones(2)]) for r in (0, 1)]
        for work in works:
            work.wait(timeout=10)
        future = works[0].get_future()
        assert future.done() and torch.equal(future.value()[0], torch.full((2,), 2.0))
        ran_on: list[str] = []
        future.then(lambda _: ran_on.append(_thread_name()))
        assert ran_on == [_thread_name()]  # as torch's completed futures do


def test_a_collective_no_rank_waits_for_fails_after_the_timeout() -> None:
    """Rank 0 waits on a torch future, which has no deadline; rank 1 never issues the
    collective. The world's watchdog fails it after the timeout, naming the missing rank."""
    release = threading.Event()

    def fn(pg: FakeProcessGroup) -> str:
        if pg.rank() == 1:
            assert release.wait(30)
            return ""
        try:
            with pytest.raises(fakepg.CollectiveTimeout) as info:
                pg.allreduce([torch.ones(2)]).get_future().wait()
        finally:
            release.set()
        return str(info.value)

    with fakepg.World(2, timeout=0.5) as world:
        text = world.run(fn)[0]
        assert world.aborted  # the ranks ended the run out of step
    assert "allreduce #0 (op=SUM) timed out after 0.5 s" in text
    assert "the world's watchdog, since this rank issued it" in text
    assert "rank 1 never issued it (rank 0 did)" in text


def test_a_wait_in_a_callback_that_fails_ends_the_run_naming_the_rank_and_collective(
    no_leaked_threads: None,
) -> None:
    """Rank 0's callback of collective #0 waits (on a torch future: no deadline of its own)
    for collective #1, which rank 1 never issues. The wait fails at the timeout, the callback
    raises, rank 0's future fails and the run ends with that error."""
    chained, release = threading.Event(), threading.Event()

    def fn(pg: FakeProcessGroup) -> None:
        if pg.rank() == 1:
            assert chained.wait(30)
            pg.allreduce([torch.ones(1)]).wait()
            assert release.wait(30)  # alive, but never issues #1
            return

        def then(_: torch.futures.Future[list[torch.Tensor]]) -> None:
            pg.allreduce([torch.ones(2)]).get_future().wait()  # collective #1

        try:
            future = pg.allreduce([torch.ones(1)]).get_future().then(then)
            chained.set()  # rank 1 issues #0 now: the callback runs on rank 0's lane
            future.wait()
        finally:
            release.set()

    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        fakepg.run(fn, 2, timeout=0.5)
    assert time.monotonic() - start < 20  # a bound, nowhere near "forever"
    text = str(info.value)
    assert "allreduce #1 (op=SUM) timed out after 0.5 s" in text
    assert "rank 1 never issued it (rank 0 did)" in text
    assert info.value.__notes__[0] == "raised on rank 0 of 2 in fakepg.run"


def test_a_callback_stuck_in_python_ends_the_run_and_is_stopped(
    no_leaked_threads: None,
) -> None:
    """Rank 1's callback blocks (a Python loop, long past the timeout). Its lane declares it
    stuck: the run ends with an error naming rank 1 and the collective, the callback is
    stopped (it raises, failing its future, so rank 1 wakes) and no thread is left."""
    gave_up = threading.Event()

    def block(_: torch.futures.Future[list[torch.Tensor]]) -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.01)
        gave_up.set()

    chained = threading.Event()

    def fn(pg: FakeProcessGroup) -> None:
        if pg.rank() == 0:
            assert chained.wait(30)  # issue once rank 1's callback is chained
            pg.allreduce([torch.ones(1)]).wait()
            return
        future = pg.allreduce([torch.ones(1)]).get_future().then(block)
        chained.set()
        future.wait()

    start = time.monotonic()
    with pytest.raises(fakepg.CollectiveTimeout) as info:
        fakepg.run(fn, 2, timeout=0.5)
    assert time.monotonic() - start < 30
    text = str(info.value)
    assert "rank 1's done-callback of allreduce #0 (op=SUM) did not return within 0.5 s" in text
    assert "with no collective of its own in flight" in text
    assert info.value.__notes__[0] == "raised on rank 1 of 2 in fakepg.run"
    assert not gave_up.is_set()


def test_a_callback_stuck_in_a_c_call_still_ends_the_run() -> None:
    """A callback blocked in a C call cannot be interrupted: the run still ends within its
    bound, naming the rank and collective, and says which threads it left behind."""
    chained, release = threading.Event(), threading.Event()

    def fn(pg: FakeProcessGroup) -> None:
        if pg.rank() == 0:
            assert chained.wait(30)
            pg.allreduce([torch.ones(1)]).wait()
            return
        # No deadline: blocks "forever".
        future = pg.allreduce([torch.ones(1)]).get_future().then(lambda _: release.wait())
        chained.set()
        future.wait()

    start = time.monotonic()
    try:
        with pytest.raises(fakepg.CollectiveTimeout) as info:
            fakepg.run(fn, 2, timeout=0.5)
        assert time.monotonic() - start < 30
    finally:
        release.set()  # let the left-behind threads end
    assert "rank 1's done-callback of allreduce #0 (op=SUM) did not return" in str(info.value)
    assert any("rank 1 did not stop after the abort" in n for n in info.value.__notes__)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
        t.name.startswith("fakepg-") for t in threading.enumerate()
    ):
        time.sleep(0.01)
    assert not [t.name for t in threading.enumerate() if t.name.startswith("fakepg-")]


def test_a_callback_waiting_for_its_own_collectives_is_not_declared_stuck() -> None:
    """Callbacks of ranks 0 and 1 that run longer than the timeout in all, one collective of
    their own after another (rank 1 slow to join each, for less than the timeout), are not
    stuck: only time without a collective of its own in flight counts. Rank 2 issues the
    first collective once both chained their callbacks, then joins the rest."""
    steps = 5
    chained = threading.Barrier(3, timeout=20)

    def fn(pg: FakeProcessGroup) -> float:
        if pg.rank() == 2:
            chained.wait()
            pg.barrier().wait()
            for _step in range(steps):
                pg.allreduce([torch.ones(1)]).wait()
            return 3.0 * steps

        def then(_: torch.futures.Future[list[torch.Tensor]]) -> float:
            total = 0.0
            for _step in range(steps):
                if pg.rank() == 1:
                    time.sleep(0.5)  # 5 x 0.5 s in all, longer than the 2 s timeout
                t = torch.ones(1)
                total += float(pg.allreduce([t]).get_future().wait()[0][0])
            return total

        future = pg.barrier().get_future().then(then)
        chained.wait()
        return future.wait()

    assert fakepg.run(fn, 3, timeout=2.0) == [3.0 * steps] * 3
