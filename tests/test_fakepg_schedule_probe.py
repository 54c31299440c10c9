"""The scheduler's looks at a thread (fakepg._schedule.probe): a thread asleep in a wait is
stalled; one that runs, or that ran during a look, is not."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest

from fakepg._schedule.probe import HAS_PROC, Sample, ThreadProbe, stalled

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
