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

import torch
from hypothesis import given
from hypothesis import strategies as st

import fakepg
from fakepg.work import INLINE_BYTES

WAYS = ("wait", "poll", "future", "then")


@st.composite
def held_cases(draw: st.DrawFn) -> tuple[int, list[int], list[list[str]]]:
    """World size, each collective's elements per rank, and each rank's way per collective."""
    world_size = draw(st.integers(1, 4))
    sizes = draw(st.lists(st.sampled_from([1, 17, 16384, 16385, 70000]), min_size=1, max_size=3))
    n = len(sizes)
    each = st.lists(st.sampled_from(WAYS), min_size=n, max_size=n)
    ways = [draw(each) for _ in range(world_size)]
    # A collective whose callbacks, on every rank, issue one more and wait for it there.
    nested = draw(st.lists(st.booleans(), min_size=n, max_size=n))
    ways = [["nest" if nest else way for way, nest in zip(w, nested, strict=True)] for w in ways]
    return world_size, sizes, ways


def _completion(
    work: fakepg.Work, way: str, pg: fakepg.FakeProcessGroup, seen: list[object]
) -> Callable[[], None]:
    """What completes ``work`` the way drawn; a ``then()`` callback is attached now (before
    the next rank issues: the future is pending), and ``seen`` gets where it ran: the (rank,
    level) of the completion lane, or None on any other thread."""
    if way == "wait":
        return work.wait
    if way == "nest":
        return _nested(work, pg, seen)
    if way == "poll":

        def poll() -> None:
            deadline = time.monotonic() + 30
            while not work.is_completed():
                assert time.monotonic() < deadline, "a polled work never completed"
                time.sleep(0.0001)

        return poll
    future = work.get_future()
    if way == "future":

        def wait_future() -> None:
            future.wait()

        return wait_future
    done = threading.Event()

    def callback(_future: object) -> None:
        lane = pg.world.completions.current_lane()  # type: ignore[attr-defined]
        seen.append(None if lane is None else (lane.rank, lane.level))
        done.set()

    future.then(callback)

    def wait_callback() -> None:
        assert done.wait(30), "a then() callback never ran"

    return wait_callback


def _nested(
    work: fakepg.Work, pg: fakepg.FakeProcessGroup, seen: list[object]
) -> Callable[[], None]:
    """A ``then()`` callback that issues a small allreduce from the rank's lane and waits for
    it through its future, there: one level down (a callback's collectives complete on the
    next lane), the last rank to join it moves its data on its lane and is held. ``seen`` gets
    the nested allreduce's result."""
    done = threading.Event()
    rank = pg.rank()

    def callback(_future: object) -> None:
        u = torch.full((3,), float(rank + 10))
        pg.allreduce([u]).get_future().wait()
        seen.append(u[0].item())
        done.set()

    work.get_future().then(callback)

    def wait_nested() -> None:
        assert done.wait(30), "a callback's own collective never completed"

    return wait_nested


def check_no_work_is_complete_when_returned(case: tuple[int, list[int], list[list[str]]]) -> None:
    world_size, sizes, ways = case
    turns = [threading.Event() for _ in range(world_size + 1)]
    turns[0].set()

    def fn(pg: fakepg.FakeProcessGroup) -> list[tuple[list[float], bool, bool]]:
        rank = pg.rank()
        out = []
        for i, size in enumerate(sizes):
            t = torch.full((size,), float(rank + 1 + i))
            assert turns[rank].wait(30)
            work = pg.allreduce([t])
            pending = not work.is_completed()  # the first look, right after the call
            seen: list[object] = []
            complete = _completion(work, ways[rank][i], pg, seen)
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
            out.append(([t[0].item(), t[-1].item()], pending, seen))
        return out

    results = fakepg.run(fn, world_size, timeout=30)
    for i, size in enumerate(sizes):
        total = float(sum(r + 1 + i for r in range(world_size)))
        small = size * 4 * world_size <= INLINE_BYTES
        for rank in range(world_size):
            values, pending, seen = results[rank][i]
            assert values == [total, total], (rank, i, values)
            if small:
                assert pending, f"rank {rank}'s work of collective {i} was complete at return"
            if ways[rank][i] == "nest":
                assert seen == [float(sum(r + 10 for r in range(world_size)))], (rank, i, seen)
                continue
            # On the rank's own lane for what its own thread issued (level 0), or, for the
            # last rank alone, on its thread (see the module's docstring).
            allowed = [(rank, 0)] + ([None] if rank == world_size - 1 else [])
            assert all(where in allowed for where in seen), (rank, i, seen)


@given(held_cases())
def test_no_work_is_complete_when_its_call_returns(
    case: tuple[int, list[int], list[list[str]]],
) -> None:
    check_no_work_is_complete_when_returned(case)
