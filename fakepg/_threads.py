"""Threads kept between worlds: a job runs on an idle cached thread, or on a new one.

A property test plays hundreds of small worlds, each with a thread per rank, data movers, a
timer and completion lanes. Starting and joining seven threads costs an example of a
two-rank world more than its collectives do (on two busy cores, milliseconds each), so every
thread the fake world starts is a :class:`Job` on a process-wide cache of threads, as trio's
``start_thread_soon`` does: a thread that finishes a job waits for the next one, and exits
after :data:`IDLE_S` seconds without one.

A :class:`Job` has the part of ``threading.Thread``'s interface the world uses (``start``,
``join`` with a timeout, ``is_alive``, ``ident``, ``name``), so an owner joins its jobs as it
joined its threads. :func:`current` is the job the calling thread runs (the thread itself
elsewhere), for code that compares "the thread that owns this" with the caller.

# Guarantees: ``Job.start`` and ``current`` are safe from any thread; a job runs exactly once,
# on one thread, and ``join`` returns once it has returned (or the timeout passed). A cached
# thread runs one job at a time; after each, the functions given to :func:`after_each_job`
# run on it (resetting per-thread state a job may leave behind), and the thread's name is put
# back. ``_lock`` guards ``_idle``: a thread is either in it (waiting on its own semaphore,
# which only a ``start`` that pops it releases) or running a job, never both.

# Note [Thread-local state of cached threads]
# A job's thread may have run another job before, of this world or of another one, so
# thread-local state outlives the job unless it is reset. Each owner of such state either sets
# and clears it around its own use (the rank streams of fakepg.rng, the completion lane,
# launch's rank of the thread) or registers a reset with ``after_each_job`` (torch.distributed's
# per-thread group state, see fakepg.torch_backend).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__: list[str] = []

# A thread with no job for this long exits (a process that stops playing worlds keeps none).
IDLE_S = 10.0
# The name of a cached thread between jobs (a job's thread carries the job's name).
IDLE_NAME = "idle thread of the fake world"

_lock = threading.Lock()
_idle: list[_Worker] = []
_resets: list[Callable[[], None]] = []
_local = threading.local()  # .job: the Job this thread runs now


class Job:
    """``target(*args)`` on a cached thread, with ``threading.Thread``'s join protocol."""

    def __init__(self, *, target: Callable[..., object], args: tuple[Any, ...] = (), name: str):
        self.name = name
        self._target = target
        self._args = args
        self._done = threading.Event()
        self._started = False
        self.ident: int | None = None  # the thread's, once it runs

    def start(self) -> None:
        if self._started:
            raise RuntimeError(f"{self.name}: a job starts once")
        self._started = True
        with _lock:
            worker = _idle.pop() if _idle else None
        if worker is None:
            _Worker(self)
        else:
            worker.hand(self)

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def is_alive(self) -> bool:
        return self._started and not self._done.is_set()

    def _run(self, thread: threading.Thread) -> None:
        thread.name = self.name
        self.ident = thread.ident
        _local.job = self
        try:
            self._target(*self._args)
        finally:
            _local.job = None
            try:
                # Before the job counts as done: whoever joins it finds the thread reset.
                for reset in list(_resets):
                    reset()
            finally:
                thread.name = IDLE_NAME
                self._done.set()

    def __repr__(self) -> str:
        state = "done" if self._done.is_set() else "running" if self._started else "new"
        return f"<fakepg job {self.name} {state}>"


# What runs code: a job, or a thread the fake world did not start.
Runner = Job | threading.Thread


def current() -> Runner:
    """The job the calling thread runs, else the thread itself."""
    job: Job | None = getattr(_local, "job", None)
    return job if job is not None else threading.current_thread()


def after_each_job(reset: Callable[[], None]) -> None:
    """Run ``reset()`` on a cached thread after each job it runs (once per function)."""
    with _lock:
        if reset not in _resets:
            _resets.append(reset)


class _Worker:
    """One cached thread: runs the job it was started with, then each one handed to it."""

    def __init__(self, job: Job) -> None:
        self._job: Job | None = job
        self._wake = threading.Semaphore(0)  # released by hand(), once per job
        self._thread = threading.Thread(target=self._loop, name=job.name, daemon=True)
        self._thread.start()

    def hand(self, job: Job) -> None:
        self._job = job
        self._wake.release()

    def _loop(self) -> None:
        thread = threading.current_thread()
        while True:
            job = self._job
            if job is None:
                return
            self._job = None
            try:
                job._run(thread)
            except BaseException as exc:
                # Reported as an uncaught exception of a thread is (the job is done, and this
                # thread still takes the next one).
                threading.excepthook(
                    threading.ExceptHookArgs((type(exc), exc, exc.__traceback__, thread))
                )
            with _lock:
                _idle.append(self)
            if not self._wake.acquire(timeout=IDLE_S):
                with _lock:
                    if self in _idle:
                        _idle.remove(self)
                        return
                # Popped by a start() between the timeout and the lock: its job is coming.
                self._wake.acquire()
