"""The scheduler's looks at a thread (fakepg._schedule.probe): a thread asleep in a wait is
stalled; one that runs, or that ran during a look, is not."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

import pytest
import torch

import fakepg
from fakepg import _threads
from fakepg._schedule.probe import HAS_PROC, Sample, ThreadProbe, blocking_site, stalled

pytestmark = pytest.mark.skipif(not HAS_PROC, reason="the looks need Linux's /proc")


def _looks(probe: ThreadProbe, count: int) -> list[Sample]:
    samples: list[Sample] = []
    for _ in range(count):
        time.sleep(0.002)
        samples.append(probe.look(samples[-1] if samples else None))
    return samples


@pytest.fixture
def thread_waiting() -> Iterator[tuple[threading.Thread, threading.Event, threading.Lock]]:
    """A thread that waits for an event (a blocking site), then for a lock the test holds
    (not one: its innermost frame is its own)."""
    go, lock = threading.Event(), threading.Lock()

    def body() -> None:
        go.wait(30)
        with lock:
            pass

    lock.acquire()
    thread = threading.Thread(target=body, name="probed", daemon=True)
    thread.start()
    yield thread, go, lock
    go.set()
    if lock.locked():
        lock.release()
    thread.join(30)


def _asleep_in_its_wait(probe: ThreadProbe) -> Sample:
    """A look once the thread sleeps in the event's wait (it may still be on its way)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        sample = probe.look()
        if sample[0] is not None and sample[1] == "S":
            return sample
        time.sleep(0.001)
    raise AssertionError(f"the thread never slept in its wait: {sample}")


def _innermost(thread: threading.Thread) -> str:
    frame = sys._current_frames().get(thread.ident or 0)
    return "" if frame is None else frame.f_code.co_name


def test_a_thread_asleep_in_a_wait_is_stalled_and_a_running_one_is_not(
    thread_waiting: tuple[threading.Thread, threading.Event, threading.Lock],
) -> None:
    thread, _, _ = thread_waiting
    _asleep_in_its_wait(ThreadProbe(thread))
    assert stalled(_looks(ThreadProbe(thread), 3), 3)
    assert not stalled(_looks(ThreadProbe(threading.current_thread()), 3), 2)


def test_a_thread_that_runs_during_a_look_is_not_taken_for_still_waiting(
    thread_waiting: tuple[threading.Thread, threading.Event, threading.Lock],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A look reads the thread's state from a file, which releases the GIL: a thread woken
    # just before may run then, and block elsewhere. Its CPU time read before the file and its
    # state read after it would look like its old wait (the frame is not read again when the
    # CPU time says it did not run).
    thread, go, _ = thread_waiting
    probe = ThreadProbe(thread)
    first = _asleep_in_its_wait(probe)
    read = ThreadProbe._state

    def the_thread_runs_meanwhile(stat: str) -> str:
        go.set()
        while _innermost(thread) != "body":  # now asleep on the lock, in its own frame
            time.sleep(0.001)
        time.sleep(0.01)
        return read(stat)

    monkeypatch.setattr(ThreadProbe, "_state", staticmethod(the_thread_runs_meanwhile))
    second = probe.look(first)
    assert not stalled([first, second], 2), (first, second)


def _frame_of(thread_name: str) -> FrameType:
    """The innermost frame of the (one) live thread named ``thread_name``, once it sleeps."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        idents = [t.ident for t in threading.enumerate() if t.name == thread_name]
        frame = sys._current_frames().get(idents[0]) if idents else None
        if frame is not None and frame.f_code.co_name in ("wait", "acquire"):
            return frame
        time.sleep(0.001)
    raise AssertionError(f"no thread {thread_name!r} asleep in a wait")


def test_the_fake_worlds_own_idle_waits_are_not_blocking_sites() -> None:
    # A completion lane between callbacks and a kept thread between jobs wait for work, not for
    # the world. A lane handed its next callback may still sleep in its idle wait (waiting for
    # the GIL) when the monitor looks; taken for blocked outside there, it could never be
    # seen blocked again, and every decision would wait for it to settle.
    with fakepg.World(1) as world:
        done = threading.Event()

        def fn(pg: fakepg.FakeProcessGroup) -> None:
            pg.allreduce([torch.ones(1)]).get_future().then(lambda _: done.set()).wait()

        world.run(fn)
        assert done.wait(10)
        lane = _frame_of(f"fakepg-{id(world):x}-rank0-completion0")
        assert not blocking_site(lane), "a lane's idle wait"
    kept = _threads.Job(target=lambda: None, name="a job")
    kept.start()
    kept.join(10)
    assert not blocking_site(_frame_of(_threads.IDLE_NAME)), "a kept thread's wait for a job"
    # Against: a user's own wait is one.
    go = threading.Event()
    user = threading.Thread(target=go.wait, args=(30,), name="a user's wait", daemon=True)
    user.start()
    try:
        assert blocking_site(_frame_of("a user's wait"))
    finally:
        go.set()
        user.join(10)
