"""The test class benchmarks/torch_ddp_suite.py runs with ``--world fake``: torch's suite with
each test's ranks as threads of one fake world instead of spawned gloo processes.

Everything else is upstream's, as in benchmarks/_torch_suite_case.py (imported first: it
patches this process for ``DDP_SUITE_IMPL`` and ``DDP_SUITE_CPU``): the main thread runs the
test as ``MultiProcessTestCase`` does (setUp, then join the ranks and judge their exit codes
with torch's ``_check_return_codes``), and each rank runs torch's ``TestDistBackend._run``
(a test instance of its own, ``init_process_group``, the barrier, ``run_test``, its
``sys.exit``). Only two things change:

- the "processes" ``MultiProcessTestCase._start_processes`` starts are the ranks of one
  :class:`fakepg.World`, run by ``reducer.tools.launch.run_function`` (per-rank os.environ,
  a copy of the process's as a spawned process inherits it; ``init_process_group`` of any
  backend joining the world; ``sys.exit`` ending one rank);
- ``_DistTestBase._barrier``, upstream a file per process id polled every 0.1 s, is a
  barrier of the test's world with the same rule (each rank counts its calls; it waits until
  ``wait_for`` ranks have made as many, or raises "barrier timeout" after ``timeout`` s).

A test that hangs is stopped after its timeout (``get_timeout``: the runner's ``--timeout``):
the world is aborted, which wakes every rank waiting in a collective or the barrier; a rank
still running after the abort's grace is left behind and counts as timed out, as a process
that did not exit does upstream.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import _torch_suite_case  # noqa: F401  (patches this process: see its docstring)
import torch
from torch.testing._internal.common_distributed import get_timeout
from torch.testing._internal.distributed.distributed_test import (
    CUSTOM_PG_TIMEOUT,
    DistributedTest,
    TestDistBackend,
    default_pg_timeout,
)

import fakepg
from reducer.tools.launch import run_function

# After the world's abort, how long the ranks get to end before the test is judged: the
# launch's stop (two graces of 1 s) and some slack.
_STOP_S = 10.0

# The run of the calling rank thread (set on each rank's thread by _FakeWorldRun._rank).
_current = threading.local()


def _no_variables(rank: int, world_size: int) -> dict[str, str]:
    return {}


class _WorldBarrier:
    """``_DistTestBase._barrier`` for the ranks of one world: upstream's file barrier, in
    memory. Rank r's k-th call returns once ``wait_for`` ranks have made at least k calls."""

    def __init__(self, world: fakepg.World) -> None:
        self._world = world
        self._cond = threading.Condition()
        self._calls: dict[int, int] = {}  # rank -> how many barriers it has entered

    def sync(self, rank: int, wait_for: int, timeout: float) -> None:
        with self._cond:
            mine = self._calls[rank] = self._calls.get(rank, 0) + 1
            self._cond.notify_all()
            deadline = time.monotonic() + timeout
            while sum(1 for n in self._calls.values() if n >= mine) != wait_for:
                if self._world.aborted or self._world.closed:
                    # Upstream would wait out its timeout for a process that has gone.
                    raise RuntimeError("barrier: the test's world was aborted (a rank failed)")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError("barrier timeout")
                # Woken by each arrival; the abort is polled.
                self._cond.wait(min(left, 0.1))


class _RankThread:
    """One rank, as ``MultiProcessTestCase`` sees a spawned process: ``start``, ``pid`` (a
    made-up one, unique in the test), ``exitcode`` (None until the world's run ended, or for
    a rank that never ended) and ``terminate``."""

    def __init__(
        self,
        run: _FakeWorldRun,
        rank: int,
        target: Callable[..., object],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        self._run = run
        self.rank = rank
        self.pid = -(rank + 1)
        self.target, self.args, self.kwargs = target, args, kwargs

    def start(self) -> None:
        self._run.started()

    @property
    def exitcode(self) -> int | None:
        codes = self._run.codes
        return None if codes is None else codes[self.rank]

    def terminate(self) -> None:
        self._run.terminate()

    def is_alive(self) -> bool:
        return self._run.codes is None


class _FakeWorldRun:
    """The ranks of one test on one fake world. Called as ``MultiProcessTestCase`` calls a
    Process class (once per rank, in rank order); the world starts, on a thread of its own,
    once every rank has been started."""

    def __init__(self, world_size: int, timeout: float, name: str) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.name = name
        self.ranks: list[_RankThread] = []
        self.codes: list[int | None] | None = None
        self.world: fakepg.World | None = None
        self.barrier: _WorldBarrier | None = None
        self._done = threading.Event()
        self._lock = threading.Lock()  # guards world (terminate() may come from any thread)
        self._terminated = False
        self._started = 0  # ranks started (on the test's thread)

    def __call__(
        self,
        target: Callable[..., object],
        name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> _RankThread:
        rank = _RankThread(self, len(self.ranks), target, args, kwargs)
        self.ranks.append(rank)
        return rank

    def started(self) -> None:
        self._started += 1
        if self._started == self.world_size:
            threading.Thread(target=self._main, name=f"world of {self.name}", daemon=True).start()

    def _main(self) -> None:
        codes: list[int | None] = [None] * self.world_size
        try:
            with fakepg.World(self.world_size, timeout=self.timeout) as world:
                with self._lock:
                    self.world = world
                    self.barrier = _WorldBarrier(world)
                    if self._terminated:
                        world.abort(RuntimeError("the test timed out"))
                # A spawned rank inherits its parent's environment and nothing else: no
                # launcher's variables (C code, which reads the real one, agrees then).
                codes = run_function(self._rank, world, name=self.name, environ=_no_variables)
        except BaseException:
            traceback.print_exc()  # the ranks count as never ended: the test fails
        finally:
            self.codes = codes
            self._done.set()

    def _rank(self, rank: int) -> None:
        _current.run = self
        try:
            handle = self.ranks[rank]
            handle.target(*handle.args, **handle.kwargs)
        finally:
            _current.run = None

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def terminate(self) -> None:
        with self._lock:
            self._terminated = True
            if self.world is not None:
                self.world.abort(RuntimeError("the test timed out: its ranks were stopped"))


class TestDistBackendOnFakeWorld(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
    """Upstream's test/distributed/test_distributed_spawn.py class, its ranks on a fake world."""

    _fake_run: _FakeWorldRun

    def setUp(self) -> None:
        super().setUp()
        name = self._current_test_name()
        self._fake_run = _FakeWorldRun(
            int(self.world_size), float(CUSTOM_PG_TIMEOUT.get(name, default_pg_timeout)), name
        )
        self._start_processes(self._fake_run)
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()

    def _barrier(self, wait_for: int | None = None, timeout: float = 10) -> None:
        run: _FakeWorldRun | None = getattr(_current, "run", None)
        if run is None or run.barrier is None:
            raise RuntimeError("_barrier: called outside a rank of a fake world")
        count = run.world_size if wait_for is None else wait_for
        run.barrier.sync(self.rank, count, timeout)

    def _join_processes(self, fn: Any) -> None:
        """torch's, waiting on the world instead of polling processes every 0.1 s: once the
        ranks have ended (or were stopped after the timeout), torch's own check judges them."""
        timeout = get_timeout(self.id())
        start = time.time()
        try:
            if not self._fake_run.wait(timeout):
                print(f"Timing out after {timeout} seconds and stopping the rank threads.")
                for rank in self.processes:
                    rank.terminate()
                self._fake_run.wait(_STOP_S)
            self._check_return_codes(fn, time.time() - start)
        finally:
            for pipe in self.pid_to_pipe.values():
                pipe.close()


__all__ = ["TestDistBackendOnFakeWorld"]
