"""Threads kept between worlds (fakepg._threads): reused, reset, and gone when idle."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

import fakepg
from fakepg import FakeProcessGroup, _threads


def test_a_second_world_runs_its_ranks_on_the_first_worlds_threads() -> None:
    marks = threading.local()

    def mark(pg: FakeProcessGroup) -> None:
        marks.seen = True
        pg.barrier().wait()

    def seen(pg: FakeProcessGroup) -> bool:
        pg.barrier().wait()
        return bool(getattr(marks, "seen", False))

    fakepg.run(mark, 2)
    assert any(fakepg.run(seen, 2)), "every rank of the second world ran on a new thread"


def test_a_rank_thread_is_named_after_its_rank_while_it_runs() -> None:
    names = fakepg.run(lambda pg: threading.current_thread().name, 3)
    assert names == ["fakepg-rank-0", "fakepg-rank-1", "fakepg-rank-2"]


@pytest.mark.usefixtures("fakepg_torch_backend")
def test_a_default_group_left_behind_does_not_reach_the_next_world() -> None:
    def leave_it(pg: FakeProcessGroup) -> None:
        fakepg.init_torch_group(world, pg.rank())  # never destroyed

    with fakepg.World(2) as world:
        world.run(leave_it)

    def subgroup(pg: FakeProcessGroup) -> float:
        group = dist.new_group([0, 1])  # named by the thread's group count: alike on each
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        return float(t)

    assert fakepg.run_torch(subgroup, 2) == [2.0, 2.0]


def test_an_idle_thread_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_threads, "IDLE_S", 0.05)
    with _threads._lock:
        _threads._idle.clear()  # threads cached before: they go on waiting their own time
    done = threading.Event()
    job = _threads.Job(target=done.set, name="fakepg-test-job")
    job.start()
    job.join(5.0)
    assert done.is_set() and not job.is_alive()
    deadline = time.monotonic() + 5.0
    while _threads._idle and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _threads._idle, "the idle thread is still cached after its idle time"


def test_a_reused_rank_thread_takes_the_launching_threads_count() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert fakepg.run(lambda pg: torch.get_num_threads(), 2) == [2, 2]
        torch.set_num_threads(1)  # the same threads, initialized under 2
        assert fakepg.run(lambda pg: torch.get_num_threads(), 2) == [1, 1]
    finally:
        torch.set_num_threads(before)
