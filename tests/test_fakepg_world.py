"""The world itself: run, isolation between worlds, threads, the network hook."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import fakepg
from fakepg import FakeProcessGroup
from reducer import ProcessGroup, ReduceOp, Work


def rank_sum(pg: FakeProcessGroup) -> torch.Tensor:
    t = torch.full((5,), float(pg.rank() + 1))
    pg.allreduce([t]).wait()
    return t


@pytest.mark.parametrize("world_size", range(1, 17))
def test_run_returns_results_in_rank_order(world_size: int, no_leaked_threads: None) -> None:
    results = fakepg.run(lambda pg: (pg.rank(), pg.size(), rank_sum(pg)), world_size)
    total = world_size * (world_size + 1) / 2
    for rank, (got_rank, size, t) in enumerate(results):
        assert (got_rank, size) == (rank, world_size)
        assert torch.equal(t, torch.full((5,), total))


# A convolution's weight gradient on the main thread and on every rank thread, after
# torch.set_num_threads(1) in a process whose OpenMP default is 3 threads.
_THREAD_COUNT_SCRIPT = textwrap.dedent(
    """
    import torch
    import fakepg

    torch.set_num_threads(1)
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(4, 3, 2)
    x = torch.randn(8, 4, 16)

    def grad(_pg=None):
        # autograd.grad, not .grad: the ranks share the module, and would accumulate into
        # one another's .grad.
        return torch.autograd.grad(conv(x).square().sum(), conv.weight)[0]

    main = grad()
    ranks = fakepg.run(grad, 2)
    print([bool(torch.equal(main, g)) for g in ranks])
    """
)


def test_rank_threads_compute_with_the_thread_count_torch_set() -> None:
    # Without it, a rank thread's oneDNN convolution ran with OpenMP's default count and its
    # gradient differed in the last bits from the main thread's: the checks' reference.
    env = {**os.environ, "OMP_NUM_THREADS": "3"}
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _THREAD_COUNT_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip() == "[True, True]", out.stderr


def test_groups_implement_the_protocols() -> None:
    with fakepg.World(2) as world:
        pg = world.group(1)
        assert isinstance(pg, ProcessGroup)
        work = pg.barrier()
        assert isinstance(work, Work)
        world.group(0).barrier().wait()


def test_two_worlds_run_at_once_without_interfering(no_leaked_threads: None) -> None:
    results: dict[int, list[torch.Tensor]] = {}

    def one_world(size: int) -> None:
        results[size] = fakepg.run(
            lambda pg: [rank_sum(pg) for _ in range(20)][-1], size, timeout=30
        )

    threads = [threading.Thread(target=one_world, args=(n,)) for n in (3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert torch.equal(results[3][0], torch.full((5,), 6.0))
    assert torch.equal(results[4][0], torch.full((5,), 10.0))


def test_worlds_nest(no_leaked_threads: None) -> None:
    """A rank of one world can run a world of its own (no global state is shared)."""

    def outer(pg: FakeProcessGroup) -> float:
        inner = fakepg.run(rank_sum, 2)  # 1 + 2 on each inner rank
        t = inner[0].clone()
        pg.allreduce([t]).wait()
        return float(t[0])

    assert fakepg.run(outer, 3) == [9.0, 9.0, 9.0]


def test_no_threads_are_left_after_a_failure(no_leaked_threads: None) -> None:
    def fn(pg: FakeProcessGroup) -> None:
        rank_sum(pg)
        if pg.rank() == 0:
            raise RuntimeError("fail after one step")
        rank_sum(pg)

    with pytest.raises(RuntimeError, match="fail after one step"):
        fakepg.run(fn, 4)


def test_world_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        fakepg.World(0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        fakepg.World(2, timeout=0)
    with (
        fakepg.World(2) as world,
        pytest.raises(ValueError, match=r"rank must be an int in \[0, 2\)"),
    ):
        world.group(2)


def test_fixed_latency_delays_the_data_and_the_completion() -> None:
    with fakepg.World(2, network=fakepg.FixedLatency(0.3)) as world:
        tensors = [torch.ones(3), torch.ones(3)]
        start = time.monotonic()
        works = [world.group(r).allreduce([tensors[r]], ReduceOp.SUM) for r in (0, 1)]
        assert not works[0].is_completed()
        assert torch.equal(tensors[0], torch.ones(3))  # still in flight: the old values
        for w in works:
            w.wait(timeout=10)
        assert time.monotonic() - start >= 0.3
        assert torch.equal(tensors[0], torch.full((3,), 2.0))


def test_a_wait_shorter_than_the_network_time_says_so() -> None:
    with fakepg.World(1, network=fakepg.FixedLatency(5.0)) as world:
        work = world.group(0).barrier()
        with pytest.raises(fakepg.CollectiveTimeout, match="every rank issued it"):
            work.wait(timeout=0.05)


def test_fixed_latency_rejects_negative_time() -> None:
    with pytest.raises(ValueError, match="seconds must be >= 0"):
        fakepg.FixedLatency(-1.0)


def test_the_api_is_exactly_what_init_exports() -> None:
    # Identifiers only: where the package is installed with its pytest plugin, pytest rewrites
    # its modules' asserts and leaves "@py_builtins" and "@pytest_ar" in their namespaces.
    public = {name for name in dir(fakepg) if not name.startswith("_") and name.isidentifier()}
    modules = {
        "clusterfile", "clusternet", "collectives", "completion", "executor", "faults", "group",
        "netmodel", "rng", "schedule", "streams",
        "torch_backend", "work", "world", "annotations",
    }  # fmt: skip
    assert set(fakepg.__all__) == public - modules


def test_every_worlds_timer_runs_on_one_process_wide_thread() -> None:
    """A world starts no timer thread of its own (see fakepg.executor.Timer)."""
    ran: list[threading.Thread] = []
    both = threading.Event()

    def record() -> None:
        ran.append(threading.current_thread())
        if len(ran) == 2:
            both.set()

    with fakepg.World(2) as first, fakepg.World(2) as second:
        for world in (first, second):
            world.timer.call_at(time.perf_counter_ns(), record)
        assert both.wait(10.0)
    assert ran[0] is ran[1] and ran[0] is not threading.current_thread()


def test_a_closed_timer_drops_what_is_not_due_and_refuses_more() -> None:
    world = fakepg.World(2)
    ran: list[int] = []
    world.timer.call_at(time.perf_counter_ns() + 3_600 * 10**9, lambda: ran.append(1))
    assert world.timer.pending() == 1
    world.close()
    assert world.timer.pending() == 0 and ran == []
    with pytest.raises(RuntimeError, match="the world is closed"):
        world.timer.call_at(time.perf_counter_ns(), lambda: ran.append(2))


def test_the_watchdog_holds_only_the_collectives_in_flight() -> None:
    """Every collective has a deadline (the world's timeout), but once every rank has issued
    it, the watchdog forgets it: over a 3,000-iteration soak at torch's 30-minute default
    (each iteration an allreduce with a future and its callback, a send/recv and a barrier),
    neither the timer's entries nor the objects the garbage collector tracks grow. (Before,
    each collective and each callback left a timer entry, with its closure, for 30 minutes:
    tens of thousands of tracked objects per 1,000 iterations here.)"""
    import gc

    def soak(pg: FakeProcessGroup) -> None:
        t = torch.zeros(2)
        for _ in range(1000):
            pg.allreduce([t]).get_future().then(lambda f: f.value()).wait()
            if pg.rank() == 0:
                pg.send([t], 1).wait()
            else:
                pg.recv([t], 0).wait()
            pg.barrier().wait()

    def tracked() -> int:
        gc.collect()
        return len(gc.get_objects())

    with fakepg.World(2, timeout=1800.0) as world:
        counts = []
        for _ in range(3):
            world.run(soak)
            # One watchdog entry at most, and one stall check per completion lane (2 ranks).
            assert world.timer.pending() <= 3
            assert not world._deadlines  # nothing in flight between runs
            counts.append(tracked())
    # Flat: the last 2,000 iterations added at most 100 tracked objects (noise from the
    # interpreter itself), where they used to add tens of thousands.
    assert counts[2] - counts[0] <= 100, counts


def test_an_abort_without_a_message_names_its_type_alone() -> None:
    """Ctrl-C aborts with a bare KeyboardInterrupt: the errors read "aborted because
    KeyboardInterrupt; ...", not "KeyboardInterrupt: ;"."""
    with fakepg.World(2) as world:
        pending = world.group(0).allreduce([torch.zeros(1)])
        world.abort(KeyboardInterrupt())
        with pytest.raises(fakepg.WorldAborted) as exc:
            pending.wait()
    assert "the world was aborted because KeyboardInterrupt; allreduce #0" in str(exc.value)


def test_run_stops_a_computing_rank_after_stop_grace() -> None:
    """After an abort, a rank computing in Python is stopped within ``stop_grace`` (here 0 s:
    at once) and run raises the first failure; a bad stop_grace is refused."""
    released = threading.Event()

    def fn(pg: FakeProcessGroup) -> None:
        if pg.rank() == 0:
            raise RuntimeError("rank 0 fails")
        while not released.is_set():  # computes, never reaching a collective
            time.sleep(0.001)

    with fakepg.World(2, timeout=60.0) as world:
        with pytest.raises(RuntimeError, match="rank 0 fails"):
            world.run(fn, stop_grace=0)
        released.set()
    for bad in (-1, float("inf"), True):
        with fakepg.World(1) as world, pytest.raises(ValueError, match="stop_grace must be"):
            world.run(lambda pg: None, stop_grace=bad)


def test_a_world_dropped_while_its_thread_holds_the_timers_lock_is_closed_without_a_deadlock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The garbage collector runs a dropped world's finalizer wherever it runs: here while the
    # dropping thread holds the process-wide timer's lock, as it does while closing another
    # world's timer. Closing the dropped world there must not wait for that lock.
    import gc

    from fakepg import executor
    from fakepg import world as world_module

    closed = threading.Event()
    close_threads = world_module._close_threads

    def recording(*parts: object) -> None:
        close_threads(*parts)  # type: ignore[arg-type]
        closed.set()

    monkeypatch.setattr(world_module, "_close_threads", recording)

    def drop_under_the_lock() -> None:
        world = fakepg.World(2)  # nothing run: nothing else keeps it alive
        with executor._CLOCK.lock:
            del world
            gc.collect()

    thread = threading.Thread(target=drop_under_the_lock, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "the finalizer waited for a lock its own thread holds"
    assert closed.wait(30)  # the dropped world's threads are stopped, off the dropping thread
