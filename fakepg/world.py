"""An in-memory world of N ranks on threads, and the process group each rank sees.

A :class:`World` matches the k-th collective of every rank (see Note [Matching by sequence
number]), checks that the ranks agree on it, and hands it to its executor once the last rank
has joined. :func:`run` starts one thread per rank and makes sure that a failure anywhere
wakes everyone.

# Guarantees: each FakeProcessGroup is meant for its rank's threads (the rank's own thread and
# autograd's), but every method of World, FakeProcessGroup and Work is thread-safe. A world
# holds no global state; any number of worlds run at once in one process, nested or not.

# Note [Matching by sequence number]
# Each rank numbers its collectives 0, 1, 2, ... The first rank to issue number k creates the
# Collective for k; the others join it, and their fingerprints (kind, op, root, dtypes,
# shapes) must equal the first one's, else the collective fails on every rank with a message
# that shows both sides. A rank that finished its function (see ``run``) can never join a
# later number, so collectives that wait for it fail at once instead of timing out.

# Note [Each rank runs its own backward]
# autograd runs the backward of CUDA tensors on one engine thread per device, shared by every
# thread of the process, and runs a backward's end-of-backward callbacks on the thread that
# finished it. A process per rank has that thread to itself; rank threads on one GPU would
# share it, and a rank whose callback waits for a collective (the reducer's finalize, torch's
# DDP) would block the backward of the peers it waits for: a deadlock. So each rank thread
# runs with autograd's multithreading off (thread-local): its backward, hooks and callbacks
# run on the rank thread itself, whatever the device. On the CPU nothing changes (CPU work
# already runs on the thread that called backward).

# Note [One link per world]
# With a network model, the world is one simulated link that carries one collective at a time,
# in the order collectives start (the last rank joins), as a real backend runs them on one
# stream or thread. A collective's transfer begins when it has started and the link is free,
# and takes the model's time; the data lands, and the collective completes, when it ends. So
# buckets launched back to back queue behind each other, and the exposed communication after
# backward is what a real link would show. Without a model the link is not simulated.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from reducer import _collective_args as _args
from reducer.process_group import ReduceOp

from . import collectives as _c
from .executor import Executor, Timer, default_thread_count
from .faults import (
    CollectiveMismatch,
    CollectiveTimeout,
    RankExited,
    WorldAborted,
    format_ranks,
    interrupt_thread,
)
from .netmodel import NetworkModel
from .work import Collective, ErrorFactory, Work

__all__ = ["FakeProcessGroup", "World", "run"]

T = TypeVar("T")


class World:
    """``world_size`` ranks that run collectives in memory, truly asynchronously.

    ``timeout`` is the default for ``Work.wait``. ``threads`` is the number of workers that
    move data (default: one per core, at most 8). ``network`` adds simulated network time to
    each collective (see :mod:`fakepg.netmodel`). Use as a context manager, or call
    :meth:`close`, so that the worker threads are joined.
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 30.0,
        threads: int | None = None,
        network: NetworkModel | None = None,
    ) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"World: world_size must be an int >= 1, got {world_size!r}")
        if not timeout > 0:
            raise ValueError(f"World: timeout must be > 0 seconds, got {timeout!r}")
        self.world_size = world_size
        self.timeout = float(timeout)
        self.network = network
        name = f"fakepg-{id(self):x}"
        self.executor = Executor(threads or default_thread_count(), name=name)
        self.timer = Timer(name=name)
        # If a world is dropped without close(), still stop its daemon workers.
        weakref.finalize(self, _close_threads, self.executor, self.timer)
        # _lock guards every field below and the membership fields of each Collective; it is
        # never held while running a callback or waiting. Lock order: World._lock, then a
        # Collective's own lock.
        self._lock = threading.Lock()
        self._next_seq = [0] * world_size
        self._pending: dict[int, Collective] = {}  # issued by some ranks, not yet by all
        self._active: dict[int, Collective] = {}  # not yet finished (pending or moving data)
        self._departed: dict[int, int] = {}  # rank -> how many collectives it issued
        self._abort: BaseException | None = None
        self._abort_rank: int | None = None
        self._closed = False
        # See Note [One link per world]: when (perf_counter_ns) the simulated link finishes its
        # last transfer.
        self._link_free_ns = 0
        self._groups = [FakeProcessGroup(self, r) for r in range(world_size)]

    def group(self, rank: int) -> FakeProcessGroup:
        """The process group of ``rank``, to be used from that rank's thread."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"World.group: rank must be an int in [0, {self.world_size}), got {rank!r}"
            )
        return self._groups[rank]

    # ---------------------------------------------------------------------------------------
    # Issuing and matching. See Note [Matching by sequence number].

    def _issue(
        self,
        rank: int,
        fingerprint: _c.Fingerprint,
        payload: Any,
        outputs: list[Tensor],
        plan: Callable[[list[Any]], list[_c.Task]],
        nbytes: int,
    ) -> Work:
        now = time.perf_counter_ns()
        deferred: list[Callable[[], None]] = []
        with self._lock:
            if self._abort is not None or self._closed:
                raise self._aborted_error(rank, f"{fingerprint.kind} #{self._next_seq[rank]}")
            seq = self._next_seq[rank]
            self._next_seq[rank] = seq + 1
            collective = self._pending.get(seq)
            if collective is None:
                collective = self._create_locked(seq, fingerprint, deferred)
            elif fingerprint != collective.fingerprint and not collective.failed:
                collective.finish(
                    _mismatch(collective, rank, fingerprint, self.world_size), defer=deferred
                )
            collective.fingerprints[rank] = fingerprint
            collective.payloads[rank] = payload
            collective.launched_ns[rank] = now
            full = len(collective.fingerprints) == self.world_size
            lands_at_ns = None
            if full:
                del self._pending[seq]
                if not collective.failed:
                    collective.started_ns = time.perf_counter_ns()
                    lands_at_ns = self._reserve_link(collective, nbytes)
        for callback in deferred:
            callback()
        if full and not collective.failed:
            payloads = [collective.payloads[r] for r in range(self.world_size)]
            collective.start(plan(payloads), lands_at_ns)
        return Work(collective, rank, outputs)

    def _reserve_link(self, collective: Collective, nbytes: int) -> int | None:
        """When (perf_counter_ns) the collective's data has crossed the simulated link, or
        None without a network model.

        Called with ``_lock`` held, when the last rank joins. See Note [One link per world].
        """
        if self.network is None or collective.started_ns is None:
            return None
        fingerprint = collective.fingerprint
        kind = fingerprint.kind
        if kind == "allreduce" and fingerprint.specs[0].layout != torch.strided:
            kind = "sparse_allreduce"
        # Whole nanoseconds, rounded up: never earlier than the model says.
        cost_ns = math.ceil(self.network.collective_time_s(kind, nbytes, self.world_size) * 1e9)
        begin = max(collective.started_ns, self._link_free_ns)
        self._link_free_ns = begin + cost_ns
        return self._link_free_ns

    def _create_locked(
        self, seq: int, fingerprint: _c.Fingerprint, deferred: list[Callable[[], None]]
    ) -> Collective:
        collective = Collective(self, seq, fingerprint)
        self._pending[seq] = collective
        for key in [k for k, c in self._active.items() if c.done.is_set()]:
            del self._active[key]
        self._active[seq] = collective
        gone = {r: n for r, n in self._departed.items() if n <= seq}
        if gone:
            collective.finish(_exited(collective, gone), defer=deferred)
        return collective

    def _wait_timed_out(self, collective: Collective, rank: int, timeout: float) -> None:
        """Fail ``collective`` for every rank because ``rank``'s wait passed ``timeout``."""
        deferred: list[Callable[[], None]] = []
        with self._lock:
            joined = set(collective.fingerprints)
            collective.finish(
                _timed_out(collective, rank, timeout, joined, self.world_size), defer=deferred
            )
        for callback in deferred:
            callback()

    def _depart(self, rank: int) -> None:
        """``rank`` returned from its function: collectives waiting for it can never finish."""
        deferred: list[Callable[[], None]] = []
        with self._lock:
            issued = self._next_seq[rank]
            self._departed[rank] = issued
            for collective in self._pending.values():
                if rank not in collective.fingerprints:
                    collective.finish(_exited(collective, {rank: issued}), defer=deferred)
        for callback in deferred:
            callback()

    # ---------------------------------------------------------------------------------------
    # Running one thread per rank.

    def run(self, fn: Callable[[FakeProcessGroup], T]) -> list[T]:
        """Call ``fn(pg)`` on one thread per rank of this world; results in rank order.

        The semantics of :func:`fakepg.run`, on a world that lives on between calls (models and
        reducers built on its groups keep working). A rank that returns early counts as gone
        only until every rank of this call has returned. If the ranks end the call having
        issued different numbers of collectives, they are out of step for good: the world is
        aborted, and the next call says so.
        """
        if not callable(fn):
            raise ValueError(f"World.run: fn must be callable, got {fn!r}")
        if self._abort is not None or self._closed:
            raise self._aborted_error(0, "World.run")
        results: list[Any] = [None] * self.world_size
        # lock guards failures: the first failure recorded is the one re-raised.
        lock = threading.Lock()
        failures: list[tuple[int, BaseException]] = []
        changed = threading.Event()  # set whenever a rank ends or fails

        def rank_main(rank: int) -> None:
            try:
                # See Note [Each rank runs its own backward].
                with torch.autograd.set_multithreading_enabled(False):
                    results[rank] = fn(self.group(rank))
            except BaseException as exc:
                with lock:
                    failures.append((rank, exc))
                self.abort(exc, rank=rank)
            else:
                self._depart(rank)
            finally:
                changed.set()

        threads = [
            threading.Thread(target=rank_main, args=(r,), name=f"fakepg-rank-{r}", daemon=True)
            for r in range(self.world_size)
        ]
        for thread in threads:
            thread.start()
        stuck = _join_ranks(self, threads, changed, grace_s=min(self.timeout, 5.0))
        self._end_run()
        if failures:
            rank, exc = failures[0]
            _add_note(exc, f"raised on rank {rank} of {self.world_size} in fakepg.run")
            others = sorted({r for r, _ in failures[1:]})
            if others:
                _add_note(exc, f"{format_ranks(others)} failed after it (see the world's abort)")
            if stuck:
                _add_note(
                    exc,
                    f"{format_ranks(stuck)} did not stop after the abort (blocked outside any "
                    "collective, in a C call or a lock of its own); left behind as daemon threads",
                )
            raise exc
        return results

    def _end_run(self) -> None:
        with self._lock:
            self._departed.clear()
            counts = list(self._next_seq)
        if len(set(counts)) > 1 and self._abort is None:
            per_rank = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
            self.abort(
                RankExited(
                    f"fakepg: the ranks ended a run having issued different numbers of "
                    f"collectives ({per_rank}); their sequence numbers no longer match"
                )
            )

    # ---------------------------------------------------------------------------------------
    # Abort and close: every failure wakes every rank.

    def abort(self, reason: BaseException, *, rank: int | None = None) -> None:
        """Fail every unfinished collective and refuse new ones; the first abort wins.

        ``rank`` names the rank whose failure caused it; the errors every other rank sees
        name it and ``reason``.
        """
        with self._lock:
            if self._abort is not None or self._closed:
                return
            self._abort, self._abort_rank = reason, rank
            unfinished = list(self._active.values())
        self._fail_all(unfinished, lambda what: lambda r: self._aborted_error(r, what))

    @property
    def aborted(self) -> bool:
        return self._abort is not None

    def _aborted_error(self, rank: int, what: str) -> WorldAborted:
        if self._abort is None:
            return WorldAborted(
                f"fakepg: the world was closed; {what} cannot complete on rank {rank}. Issue "
                "collectives only inside `with World(...)` or before World.close()."
            )
        cause = f"{type(self._abort).__name__}: {self._abort}"
        if self._abort_rank is not None:
            cause = f"rank {self._abort_rank} failed ({cause})"
        return WorldAborted(
            f"fakepg: the world was aborted because {cause}; {what} cannot complete on rank "
            f"{rank}. Look at the first failure; this one is a consequence."
        )

    def _fail_all(
        self, collectives: list[Collective], factory: Callable[[str], ErrorFactory]
    ) -> None:
        # Outside the lock: finishing runs done-callbacks, which may issue collectives.
        for collective in collectives:
            collective.finish(factory(collective.describe()))

    def close(self) -> None:
        """Fail what is unfinished, stop and join the worker threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            unfinished = list(self._active.values())
        self._fail_all(unfinished, lambda what: lambda r: self._aborted_error(r, what))
        _close_threads(self.executor, self.timer)

    def __enter__(self) -> World:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.abort(exc)
        self.close()

    def __repr__(self) -> str:
        state = "aborted" if self._abort is not None else "closed" if self._closed else "open"
        return f"<fakepg.World size={self.world_size} timeout={self.timeout}s {state}>"


def _close_threads(executor: Executor, timer: Timer) -> None:
    timer.close()
    executor.close()


# -------------------------------------------------------------------------------------------
# Error messages: what happened, which ranks, the likely cause, the fix.


def _mismatch(
    collective: Collective, rank: int, theirs: _c.Fingerprint, world_size: int
) -> ErrorFactory:
    first_rank = min(collective.fingerprints)
    ours = collective.fingerprint
    fields = ", ".join(ours.differences(theirs))
    text = (
        f"fakepg: ranks disagree on collective #{collective.seq}: rank {first_rank} issued "
        f"{ours} but rank {rank} issued {theirs} (they differ in {fields}). Every rank must "
        "issue the same collectives, in the same order, with matching tensors; a rank that "
        "took another branch or skipped a collective before this one causes this."
    )
    return lambda _rank: CollectiveMismatch(text)


def _exited(collective: Collective, gone: dict[int, int]) -> ErrorFactory:
    what = collective.describe()
    ranks = format_ranks(set(gone))
    counts = ", ".join(f"rank {r} issued {n}" for r, n in sorted(gone.items()))
    text = (
        f"fakepg: {what} can never complete: {ranks} returned from the rank function without "
        f"issuing it ({counts} collective(s) in all). Every rank must issue the same "
        "collectives; look for an early return or a branch taken on some ranks only."
    )
    return lambda _rank: RankExited(text)


def _timed_out(
    collective: Collective, waiter: int, timeout: float, joined: set[int], world_size: int
) -> ErrorFactory:
    what = collective.describe()
    missing = set(range(world_size)) - joined
    if missing:
        detail = (
            f"{format_ranks(missing)} never issued it ({format_ranks(joined)} did). Those "
            "ranks skipped it, issued a different number of collectives before it, or are "
            "stuck computing; compare their stacks"
        )
    else:
        detail = (
            "every rank issued it but its data did not finish moving in time (a slow "
            "simulated network or a very large tensor); raise the timeout"
        )

    def make(rank: int) -> CollectiveTimeout:
        whose = "this rank's" if rank == waiter else f"rank {waiter}'s"
        return CollectiveTimeout(
            f"fakepg: {what} timed out after {timeout:g} s ({whose} wait): {detail}."
        )

    return make


# -------------------------------------------------------------------------------------------
# The process group one rank sees.


class FakeProcessGroup:
    """Rank ``rank``'s view of a :class:`World`; implements ``reducer.ProcessGroup``."""

    def __init__(self, world: World, rank: int) -> None:
        self._world = world
        self._rank = rank

    @property
    def world(self) -> World:
        return self._world

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._world.world_size

    def allreduce(self, tensors: list[Tensor], op: ReduceOp = ReduceOp.SUM) -> Work:
        """Reduce in place; see Note [Deterministic reduction order] in fakepg.collectives."""
        tensors = _args.check_allreduce(tensors, op, _c.RULES)
        fingerprint = _c.Fingerprint(
            "allreduce", op, None, tuple(map(_args.TensorSpec.of, tensors))
        )
        sparse = tensors[0].is_sparse
        max_parts = self._world.executor.num_threads

        def plan(per_rank: list[list[Tensor]]) -> list[_c.Task]:
            contributions = [t for ts in per_rank for t in ts]
            if sparse:
                return _c.sparse_allreduce_tasks(contributions, op)
            return _c.dense_allreduce_tasks(contributions, op, max_parts)

        return self._world._issue(self._rank, fingerprint, tensors, tensors, plan, _nbytes(tensors))

    def allgather(self, output_lists: list[list[Tensor]], inputs: list[Tensor]) -> Work:
        outputs, inputs = _args.check_allgather(
            output_lists, inputs, self._world.world_size, _c.RULES
        )
        fingerprint = _c.Fingerprint(
            "allgather", None, None, tuple(map(_args.TensorSpec.of, inputs))
        )

        def plan(per_rank: list[tuple[list[list[Tensor]], list[Tensor]]]) -> list[_c.Task]:
            return _c.allgather_tasks([o for o, _ in per_rank], [i for _, i in per_rank])

        flat_outputs = [t for out in outputs for t in out]
        return self._world._issue(
            self._rank, fingerprint, (outputs, inputs), flat_outputs, plan, _nbytes(inputs)
        )

    def broadcast(self, tensors: list[Tensor], root: int) -> Work:
        tensors = _args.check_tensor_list(tensors, "broadcast", _c.RULES)
        if not isinstance(root, int) or not 0 <= root < self._world.world_size:
            raise ValueError(
                f"broadcast: root must be a rank in [0, {self._world.world_size}), got {root!r}"
            )
        fingerprint = _c.Fingerprint(
            "broadcast", None, root, tuple(map(_args.TensorSpec.of, tensors))
        )

        def plan(per_rank: list[list[Tensor]]) -> list[_c.Task]:
            return _c.broadcast_tasks(per_rank, root)

        return self._world._issue(self._rank, fingerprint, tensors, tensors, plan, _nbytes(tensors))

    def barrier(self) -> Work:
        return self._world._issue(self._rank, _c.Fingerprint("barrier"), None, [], lambda _: [], 0)

    def __repr__(self) -> str:
        return f"<fakepg.FakeProcessGroup rank={self._rank} size={self.size()}>"


def _nbytes(tensors: Sequence[Tensor]) -> int:
    total = 0
    for t in tensors:
        if t.is_sparse:
            # int64 indices per entry, and each entry's values (a row, for a hybrid tensor
            # such as an embedding's gradient).
            total += t._nnz() * t.sparse_dim() * 8 + t._values().numel() * t.element_size()
        else:
            total += t.numel() * t.element_size()
    return total


# -------------------------------------------------------------------------------------------
# run: one thread per rank, structured.


class _Stop(BaseException):
    """Delivered to a rank thread that is still running after the world was aborted."""


def run(
    fn: Callable[[FakeProcessGroup], T],
    world_size: int,
    *,
    timeout: float = 60.0,
    network: NetworkModel | None = None,
) -> list[T]:
    """Call ``fn(pg)`` on one thread per rank of a new world; return the results in rank order.

    If any rank raises (any ``BaseException``), the world is aborted: every rank blocked in a
    collective wakes at once with an error naming the failed rank, and ``run`` re-raises the
    first failure with a note naming its rank. ``timeout`` is each collective's default wait;
    ``network`` simulates transfer time (see :mod:`fakepg.netmodel`). A rank that returns while
    its peers wait for it makes their collectives fail at once. Every thread started here has
    ended when ``run`` returns or raises (see ``World.run``).
    """
    with World(world_size, timeout=timeout, network=network) as world:
        return world.run(fn)


def _join_ranks(
    world: World, threads: list[threading.Thread], changed: threading.Event, grace_s: float
) -> list[int]:
    """Wait for every rank thread; once the world is aborted, stop the stragglers.

    A rank blocked in a collective wakes with the abort. A rank busy elsewhere gets ``grace_s``
    to reach a collective, then an asynchronous ``_Stop``, then ``grace_s`` more; a thread
    still alive after that (stuck in a C call) is returned instead of waited for forever.
    """
    try:
        while any(t.is_alive() for t in threads) and not world.aborted:
            changed.wait(0.1)  # a timeout too, so that Ctrl-C in the caller is seen
            changed.clear()
        for attempt in range(2):
            deadline = time.monotonic() + grace_s
            for thread in threads:
                thread.join(max(0.0, deadline - time.monotonic()))
            if attempt == 0:
                for thread in threads:
                    if thread.is_alive():
                        interrupt_thread(thread, _Stop)
    except BaseException as exc:  # KeyboardInterrupt in the caller: wake every rank, re-raise
        world.abort(exc)
        raise
    return [rank for rank, t in enumerate(threads) if t.is_alive()]


def _add_note(exc: BaseException, note: str) -> None:
    """PEP 678 note; on Python 3.10 the ``__notes__`` list that pytest and 3.11+ read."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        notes = getattr(exc, "__notes__", None)
        if not isinstance(notes, list):
            notes = []
            exc.__notes__ = notes  # type: ignore[attr-defined]
        notes.append(note)
