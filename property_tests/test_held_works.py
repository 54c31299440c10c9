"""Property: no work of the fake world is complete when its call returns, whichever thread
moves the data, and each completes on the way its rank asks for it.

A small collective moves its data on the thread of the rank that joins it last, before that
rank's call returns, and finishes it there (see Note [Small collectives move on the last
rank's thread] in fakepg.work). That rank's own work is *held*: still pending when its call
returns, so that code which forgets to wait shows its race as it would on a real backend.
It completes once the rank waits for it, once its lane runs the callbacks of the future it
asked for, or shortly after a first poll that saw it pending. A larger collective moves on
the world's workers.

Drawn: one to four ranks, one to three collectives in a row, each an allreduce of a size on
either side of the inline limit (at four ranks, 16384 float32 elements per rank are the
limit itself), and how each rank completes each collective: ``wait()``, a poll of
``is_completed()`` until true, its torch future's ``wait()``, or a ``then()`` callback; or,
for every rank at once, a callback that issues one more allreduce from the rank's lane and
waits for it there (its last rank moves that one on its lane, one level down). The
ranks issue in rank order (each after the one before has returned and looked), so the last
rank is the one that moves a small collective. Every rank's first look after its call, at a
small collective, says pending; every way completes with the exact sum; a ``then()``
callback of a rank that issued before the last one runs on the rank's own completion lane
(level 0: its own thread issued the collective), never on the caller's thread nor another
rank's (the future was pending when it was attached). The last rank's
future, asked for, completes on its lane at once, so its ``then()`` may come after and run
where torch runs a callback on a completed future: on the caller's thread. Completed any
way, a work says so at once, and its timings are in order (issued, started, completed).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fakepg
from fakepg.work import INLINE_BYTES

from .test_changed_in_flight import CHANGES, how_changed

WAYS = ("wait", "poll", "future", "then")
# Each rank's tensor: its own, or a view into a larger flat buffer (as a bucket's gradients
# are) at an offset (fakepg's kernels take contiguous tensors only). How a rank changes one
# in flight: CHANGES, shared with the property of tensors changed in flight.
VIEWS = ("own", "offset")


def _tensor(size: int, value: float, view: str) -> torch.Tensor:
    if view == "own":
        return torch.full((size,), value)
    return torch.full((size + 5,), value)[3 : 3 + size]


class Case(NamedTuple):
    world_size: int
    sizes: list[int]  # each collective's elements per rank
    view: str  # how each rank's tensors lie in memory (VIEWS)
    ways: list[list[str]]  # each rank's way to complete each collective
    change: str | None  # how the last collective's tensor is changed in flight, if it is
    changer: int | None  # by which rank


@st.composite
def held_cases(draw: st.DrawFn) -> Case:
    """World size, each collective's elements per rank, each rank's way per collective, and
    whether a rank changes its tensor of the last collective before the last rank joins, and
    how the tensors lie in memory."""
    world_size = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.sampled_from([1, 17, 16384, 16385, 70000]), min_size=1, max_size=3))
    n = len(sizes)
    each = st.lists(st.sampled_from(WAYS), min_size=n, max_size=n)
    ways = [draw(each) for _ in range(world_size)]
    # A collective whose callbacks, on every rank, issue one more and wait for it there.
    nested = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    ways = [["nest" if nest else way for way, nest in zip(w, nested, strict=True)] for w in ways]
    # The last collective changed in flight by a rank that is not the last to join it.
    change = draw(st.none() | st.sampled_from(sorted(CHANGES))) if world_size > 1 else None
    changer = draw(st.integers(0, world_size - 2)) if change is not None else None
    return Case(world_size, sizes, draw(st.sampled_from(VIEWS)), ways, change, changer)


Seen = list[object]  # where each then() callback ran, or what a nested allreduce gave
Errors = list[BaseException | None]  # what each way saw: the error, or None


def _completion(
    work: fakepg.Work, way: str, pg: fakepg.FakeProcessGroup, seen: Seen, errors: Errors
) -> Callable[[], None]:
    """What completes ``work`` the way drawn; a ``then()`` callback is attached now (before
    the next rank issues: the future is pending), and ``seen`` gets where it ran: the (rank,
    level) of the completion lane, or None on any other thread. ``errors`` gets the error the
    way saw (None if it saw none)."""
    if way == "wait":

        def wait() -> None:
            try:
                work.wait()
            except fakepg.FakePGError as exc:
                errors.append(exc)
            else:
                errors.append(None)

        return wait
    if way == "nest":
        return _nested(work, pg, seen, errors)
    if way == "poll":

        def poll() -> None:
            deadline = time.monotonic() + 30
            while not work.is_completed():
                assert time.monotonic() < deadline, "a polled work never completed"
                time.sleep(0.0001)
            errors.append(work.exception())

        return poll
    future = work.get_future()
    if way == "future":

        def wait_future() -> None:
            errors.append(_error_of(future))

        return wait_future
    done = threading.Event()

    def callback(completed: torch.futures.Future[list[torch.Tensor]]) -> None:
        lane = pg.world.completions.current_lane()  # type: ignore[attr-defined]
        seen.append(None if lane is None else (lane.rank, lane.level))
        errors.append(_error_of(completed))
        done.set()

    future.then(callback)

    def wait_callback() -> None:
        assert done.wait(30), "a then() callback never ran"

    return wait_callback


def _error_of(future: torch.futures.Future[list[torch.Tensor]]) -> BaseException | None:
    try:
        future.wait()
    except fakepg.FakePGError as exc:
        return exc
    return None


def _nested(
    work: fakepg.Work, pg: fakepg.FakeProcessGroup, seen: Seen, errors: Errors
) -> Callable[[], None]:
    """A ``then()`` callback that issues a small allreduce from the rank's lane and waits for
    it through its future, there: one level down (a callback's collectives complete on the
    next lane), the last rank to join it moves its data on its lane and is held. ``seen`` gets
    the nested allreduce's result."""
    done = threading.Event()
    rank = pg.rank()

    def callback(completed: torch.futures.Future[list[torch.Tensor]]) -> None:
        errors.append(_error_of(completed))
        u = torch.full((3,), float(rank + 10))
        pg.allreduce([u]).get_future().wait()
        seen.append(u[0].item())
        done.set()

    work.get_future().then(callback)

    def wait_nested() -> None:
        assert done.wait(30), "a callback's own collective never completed"

    return wait_nested


Looked = tuple[list[float] | None, bool, Seen, Errors, int]


def check_no_work_is_complete_when_returned(case: Case) -> None:
    world_size, sizes, view, ways, change, changer = case
    turns = [threading.Event() for _ in range(world_size + 1)]
    turns[0].set()
    last = len(sizes) - 1

    def fn(pg: fakepg.FakeProcessGroup) -> list[Looked]:
        rank = pg.rank()
        out: list[Looked] = []
        for i, size in enumerate(sizes):
            t = _tensor(size, float(rank + 1 + i), view)
            assert turns[rank].wait(30)
            work = pg.allreduce([t])
            pending = not work.is_completed()  # the first look, right after the call
            changed = change is not None and i == last and rank == changer
            if changed:
                CHANGES[change](t)  # before the next rank issues: the data has not moved
            seen: Seen = []
            errors: Errors = []
            complete = _completion(work, ways[rank][i], pg, seen, errors)
            turns[rank].clear()
            turns[rank + 1].set()
            if rank == world_size - 1:
                turns[0].set()  # the next collective starts with rank 0 again
            complete()
            # Completed any way, the work says so at once (a future completed on its lane
            # released the held work first).
            assert work.is_completed(), f"rank {rank}: {ways[rank][i]} returned, work pending"
            times = (work.launched_ns, work.started_ns, work.completed_ns)
            assert None not in times and sorted(times) == list(times), (rank, i, times)  # type: ignore[type-var]
            # A changed tensor is not read again: a freed one has no memory.
            values = None if changed else [t[0].item(), t[-1].item()]
            out.append((values, pending, seen, errors, work.seq))
        return out

    results = fakepg.run(fn, world_size, timeout=30)
    for i, size in enumerate(sizes):
        total = float(sum(r + 1 + i for r in range(world_size)))
        small = size * 4 * world_size <= INLINE_BYTES
        failed = change is not None and i == last
        for rank in range(world_size):
            values, pending, seen, errors, seq = results[rank][i]
            if small:
                assert pending, f"rank {rank}'s work of collective {i} was complete at return"
            # Each way saw the collective's outcome once: on every rank, the change in flight
            # as a TensorChanged naming the rank and its tensor, or no error at all.
            assert len(errors) == 1, (rank, i, errors)
            if failed:
                error = errors[0]
                assert isinstance(error, fakepg.TensorChanged), (rank, i, error)
                assert f"allreduce #{seq} " in str(error), str(error)
                how = how_changed(change, _tensor(size, 0.0, view))
                whose = f"rank {changer}'s tensor 0 (torch.float32, issued with shape [{size}])"
                assert f"{whose} {how} while" in str(error), str(error)
            else:
                assert errors == [None], (rank, i, errors)
                assert values == [total, total], (rank, i, values)
            if ways[rank][i] == "nest":
                assert seen == [float(sum(r + 10 for r in range(world_size)))], (rank, i, seen)
                continue
            # On the rank's own lane for what its own thread issued (level 0), or, for the
            # last rank alone, on its thread (see the module's docstring).
            allowed = [(rank, 0)] + ([None] if rank == world_size - 1 else [])
            assert all(where in allowed for where in seen), (rank, i, seen)


@given(held_cases())
def test_no_work_is_complete_when_its_call_returns(case: Case) -> None:
    check_no_work_is_complete_when_returned(case)


STALL_TIMEOUT_S = 0.5


@st.composite
def stalled_cases(draw: st.DrawFn) -> tuple[int, int, int]:
    """World size, the rank whose ``then()`` callback stalls, and the elements per rank."""
    world_size = draw(st.integers(2, 3))
    stalled = draw(st.integers(0, world_size - 1))
    # The last rank chains after its call returned: a large collective may be complete by
    # then (its workers raced the call), and torch runs a then() callback of a complete
    # future at once, on the caller's thread, where no lane can see it stall.
    sizes = [1] if stalled == world_size - 1 else [1, 70000]
    return world_size, stalled, draw(st.sampled_from(sizes))


@given(stalled_cases())
@settings(max_examples=8)
def test_a_stalled_callback_is_named_by_its_collective(case: tuple[int, int, int]) -> None:
    """A ``then()`` callback that never returns is reported by its rank and its collective,
    whichever way the callback reached the lane: the last rank's future of a small collective
    (held: its delivery posted when the future is asked for), an earlier rank's (posted as
    the collective finished), of a small collective or a large one (finished on a worker).

    The ranks issue the collective in rank order, each after the one before has chained its
    callback. Before it, the stalling rank keeps its lane busy with a callback of an earlier
    collective until its own ``then()`` is chained: a held future's delivery, posted at once,
    would otherwise race the ``then()`` (torch runs a callback chained to a completed future
    on the caller's thread, where no lane sees it stall)."""
    world_size, stalled, size = case
    turns = [threading.Event() for _ in range(world_size + 1)]
    opened, chained = threading.Event(), threading.Event()
    release = threading.Event()

    def busy(_future: object) -> None:
        assert chained.wait(30)

    def stall(_future: object) -> None:
        deadline = time.monotonic() + 30  # a broken lane check fails, not hangs, the property
        while not release.is_set() and time.monotonic() < deadline:  # the lane can stop it
            time.sleep(0.01)

    def fn(pg: fakepg.FakeProcessGroup) -> None:
        rank = pg.rank()
        # The earlier collective: the stalling rank issues it first, its callback pending.
        if rank == stalled:
            opener = pg.allreduce([torch.ones(1)])
            opener.get_future().then(busy)
            opened.set()
            turns[0].set()
        else:
            assert opened.wait(30)
            opener = pg.allreduce([torch.ones(1)])
        assert turns[rank].wait(30)
        work = pg.allreduce([torch.ones(size)])
        if rank == stalled:
            future = work.get_future().then(stall)
            chained.set()
        turns[rank + 1].set()
        opener.wait()
        if rank == stalled:
            future.wait()  # fails once the lane stops the callback
        else:
            work.wait()

    try:
        with pytest.raises(fakepg.CollectiveTimeout) as info:
            fakepg.run(fn, world_size, timeout=STALL_TIMEOUT_S)
    finally:
        release.set()
        chained.set()
    expected = (
        f"rank {stalled}'s done-callback of allreduce #1 (op=SUM) did not return within "
        f"{STALL_TIMEOUT_S:g} s"
    )
    assert expected in str(info.value), str(info.value)
