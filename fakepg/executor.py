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
    """One daemon thread that runs callbacks at given times, for simulated network time.

    # Guarantees: ``call_at`` is safe from any thread. Callbacks run on the timer thread in
    # deadline order, never before their deadline, and must not raise or block (they may
    # call ``call_at``). ``close``
    # drops callbacks not yet due (the world fails their collectives first) and joins the
    # thread. Deadlines are on the ``time.perf_counter_ns`` clock, the one collectives'
    # timings use, so "completed no earlier than the deadline" holds exactly.
    """

    def __init__(self, *, name: str) -> None:
        self._name = name
        # _cond guards _heap, _thread and _closed; the timer thread sleeps on it until the
        # earliest deadline or a new, earlier entry.
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[int, int, Callable[[], None]]] = []
        self._count = 0  # tie-breaker: equal deadlines run in submission order
        self._thread: _threads.Job | None = None
        self._closed = False

    def call_at(self, deadline_ns: int, callback: Callable[[], None]) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError(f"{self._name}: the world is closed; no collective can run")
            entry = (deadline_ns, self._count, callback)
            heapq.heappush(self._heap, entry)
            self._count += 1
            if self._thread is None:
                self._thread = _threads.Job(target=self._run, name=f"{self._name}-timer")
                self._thread.start()
            if self._heap[0] is entry:  # a new earliest deadline: the thread sleeps too long
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (
                    not self._heap or self._heap[0][0] > time.perf_counter_ns()
                ):
                    wait = (self._heap[0][0] - time.perf_counter_ns()) / 1e9 if self._heap else None
                    self._cond.wait(wait)
                if self._closed:
                    return
                _, _, callback = heapq.heappop(self._heap)
            callback()

    def close(self, timeout: float = 10.0) -> list[_threads.Job]:
        with self._cond:
            self._closed = True
            self._heap.clear()
            thread = self._thread
            self._cond.notify()
        if thread is None or thread is _threads.current():
            return []
        thread.join(timeout)
        return [thread] if thread.is_alive() else []
