"""The worker threads that run collective kernels off the ranks' threads.

# Guarantees: ``submit`` is safe from any thread, including a worker. ``close`` is called by the
# owner (the world) once; it lets queued tasks finish, then joins every worker with a deadline.
# A task must not raise: the collective wraps its kernels and turns errors into a failed work.
"""

from __future__ import annotations

import heapq
import os
import queue
import threading
import time
from collections.abc import Callable

from . import _threads

__all__: list[str] = []


def default_thread_count() -> int:
    """One worker per core this process may use, at most 8 (more only contends for memory)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores))


class Executor:
    """A fixed pool of daemon worker threads fed from one FIFO queue, started on first use."""

    def __init__(self, num_threads: int, *, name: str) -> None:
        if num_threads < 1:
            raise ValueError(f"the executor needs at least one thread, got {num_threads}")
        self.num_threads = num_threads
        self._name = name
        self._queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        # _lock guards _threads and _closed: workers are started at most once, never after
        # close, and close sees every started worker.
        self._lock = threading.Lock()
        self._threads: list[_threads.Job] = []
        self._closed = False

    def submit(self, task: Callable[[], None]) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self._name}: the world is closed; no collective can run")
            if not self._threads:
                self._start_locked()
        self._queue.put(task)

    def _start_locked(self) -> None:
        for i in range(self.num_threads):
            thread = _threads.Job(target=self._work, name=f"{self._name}-worker-{i}")
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        while True:
            task = self._queue.get()
            if task is None:
                return
            task()

    def close(self, timeout: float = 10.0) -> list[_threads.Job]:
        """Stop the workers after the queued tasks; return those still alive after ``timeout``."""
        with self._lock:
            if self._closed:
                return []
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)
        for thread in threads:
            if thread is not _threads.current():
                thread.join(timeout)
        return [t for t in threads if t.is_alive()]


class Timer:
    """A world's callbacks at given times: simulated network time, the watchdog, stall checks.

    # Guarantees: ``call_at`` is safe from any thread. Callbacks run on the timer thread in
    # deadline order, never before their deadline, and must not raise or block (they may
    # call ``call_at``). ``close`` drops callbacks not yet due (the world fails their
    # collectives first) and returns once none of this timer's callbacks is running (unless
    # it is called from one). Deadlines are on the ``time.perf_counter_ns`` clock, the one
    # collectives' timings use, so "completed no earlier than the deadline" holds exactly.

    Every world's timer runs on one process-wide thread (see :class:`_Clock`): a world of a
    property test lives for milliseconds, and a thread started and joined for each would
    cost it two hand-offs between threads, on busy cores each a scheduling delay.
    """

    def __init__(self, *, name: str) -> None:
        self._name = name
        # Guarded by the clock's lock.
        self._closed = False
        self._pending = 0  # entries of this timer in the clock's heap

    def call_at(self, deadline_ns: int, callback: Callable[[], None]) -> None:
        _CLOCK.call_at(self, deadline_ns, callback)

    def pending(self) -> int:
        """How many callbacks are waiting for their time."""
        with _CLOCK.lock:
            return self._pending

    def close(self, timeout: float = 10.0) -> list[_threads.Job]:
        """Drop what is not due yet; wait (up to ``timeout``) for a callback of this timer
        that is running. Returns no threads (the clock's is process-wide)."""
        _CLOCK.close(self, timeout)
        return []


class _Clock:
    """The one daemon thread that runs every timer's callbacks at their deadlines: started on
    first use, it exits after ``_threads.IDLE_S`` seconds with nothing to wait for.

    # Guarantees: ``lock`` guards every field here and every Timer's; the thread never holds
    # it while running a callback, so a callback may take any lock a world holds while it
    # calls ``call_at`` (the timer's lock comes last in every world's lock order). A callback
    # that raises is reported as an uncaught exception of a thread is, and the clock goes on.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._wake = threading.Condition(self.lock)  # the thread sleeps on it
        self._idle = threading.Condition(self.lock)  # a closing timer waits on it
        self._heap: list[tuple[int, int, Timer, Callable[[], None]]] = []
        self._count = 0  # tie-breaker: equal deadlines run in submission order
        self._thread: threading.Thread | None = None
        self._running: Timer | None = None  # whose callback runs now

    def call_at(self, timer: Timer, deadline_ns: int, callback: Callable[[], None]) -> None:
        with self.lock:
            if timer._closed:
                raise RuntimeError(f"{timer._name}: the world is closed; no collective can run")
            entry = (deadline_ns, self._count, timer, callback)
            heapq.heappush(self._heap, entry)
            self._count += 1
            timer._pending += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="timer of the fake worlds", daemon=True
                )
                self._thread.start()
            elif self._heap[0] is entry:  # a new earliest deadline: the thread sleeps too long
                self._wake.notify()

    def close(self, timer: Timer, timeout: float) -> None:
        with self.lock:
            timer._closed = True
            if timer._pending:
                self._heap = [e for e in self._heap if e[2] is not timer]
                heapq.heapify(self._heap)
                timer._pending = 0
            deadline = time.monotonic() + timeout
            while self._running is timer and threading.current_thread() is not self._thread:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._idle.wait(left)

    def _run(self) -> None:
        me = threading.current_thread()
        with self.lock:
            while True:
                if not self._heap:
                    if not self._wake.wait(_threads.IDLE_S) and not self._heap:
                        self._thread = None
                        return
                    continue
                due, _, timer, callback = self._heap[0]
                now = time.perf_counter_ns()
                if due > now:
                    self._wake.wait((due - now) / 1e9)
                    continue
                heapq.heappop(self._heap)
                timer._pending -= 1
                self._running = timer
                self.lock.release()
                try:
                    callback()
                except BaseException as exc:
                    threading.excepthook(
                        threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, me))
                    )
                finally:
                    self.lock.acquire()
                    self._running = None
                    self._idle.notify_all()


_CLOCK = _Clock()
