"""An in-memory world of N ranks on threads: matching collectives, failures, running ranks.

A :class:`World` matches the k-th collective of every rank of a group (see Note [Matching by
sequence number]), checks that the ranks agree on it, and hands it to its executor once the
last rank has joined. :func:`run` starts one thread per rank and makes sure that a failure
anywhere wakes everyone. What each rank calls lives in :mod:`fakepg.group`.

# Guarantees: each FakeProcessGroup is meant for its rank's threads (the rank's own thread,
# autograd's, and its completion threads, where its futures' callbacks run), but every method
# of World, FakeProcessGroup and Work is thread-safe. A world holds no global state; any
# number of worlds run at once in one process, nested or not. Threads a world starts (the
# data workers, the ranks' completion threads) are joined by its close(); its timer's
# callbacks run on one process-wide thread (fakepg.executor.Timer), and none runs after
# close() has returned. Under a
# schedule (see Note [Controlled scheduling] in fakepg.schedule) one controlled thread runs at
# a time, and a collective's data moves on the thread that decides its completion.

# Note [Matching by sequence number]
# A *channel* is one sequence space: the collectives of one group (the whole world, or a
# subgroup), or the messages from one rank to another with one tag. Each member numbers what it
# issues on a channel 0, 1, 2, ... The first member to issue number k creates the Collective
# for k; the others join it, and their fingerprints (kind, op, root, dtypes, shapes) must equal
# the first one's, else the collective fails on every member with a message that shows both
# sides. A rank that finished its function (see ``run``) can never join a later number, so
# collectives that wait for it fail at once instead of timing out.

# Note [Every collective has a deadline]
# A rank may wait for a collective without a deadline of its own: on a torch future
# (``fut.wait()`` is C++ and waits forever), in torch's C++ reducer, or in a future's callback
# (torch's PowerSGD hook waits there). So a Work.wait timeout alone would not end a hang: the
# world itself watches every collective. ``timeout`` seconds after the first rank issued it,
# a collective that some rank has still not issued fails on every rank, with the error a
# timed-out wait gives (it names the ranks that never issued it), unless some rank is inside
# Work.wait, whose own deadline then decides. One watchdog per world keeps the deadlines of the
# collectives that some rank has issued and some has not (each leaves it when its last rank
# joins), in deadline order, and one timer entry for the earliest: its memory is the number of
# collectives in flight, not the number issued within the last `timeout` seconds, as NCCL's
# watchdog scans its work queue. A failed collective fails its futures too: the
# callbacks waiting on them raise, their futures fail, and the rank's error ends the run.
# (Once every rank has issued it, a collective's data moves and it finishes by itself.) A
# callback that blocks on anything else is caught by its lane: see Note [Completion lanes]
# in fakepg.completion.

# Note [Subgroups]
# A subgroup is a channel over some of the world's ranks, with its own sequence numbers, as a
# torch.distributed group is a communicator of its own: its collectives are matched among its
# members only, and ranks may interleave collectives of different groups in any order. Every
# rank of the parent group calls ``new_group`` with the same ranks in the same order (members
# and non-members, as torch requires); the k-th call of each rank names the same group, and a
# rank whose k-th call names other ranks is refused, showing both. Ranks of a subgroup are
# numbered 0.. in ascending world rank, so its reductions add in ascending world rank order.
# Errors name world ranks, and the group by its members.

# Note [Point-to-point matching]
# Sends and receives are matched per (group, source, destination, tag): the k-th send from s
# to d with tag t meets the k-th receive at d from s with tag t, as gloo matches them, whatever
# the collectives or the other pairs do in between (they are separate channels). The receiver's
# shapes and dtypes must equal the sender's. The data moves when both sides have posted, and
# both works complete then, so a send waits for its receive (as NCCL's does): two ranks that
# both send before they receive deadlock, and the timeout says who waits for whom. A receive
# from any source is refused: which send it would match depends on thread timing.

# Note [Each rank runs its own backward]
# autograd runs the backward of CUDA tensors on one engine thread per device, shared by every
# thread of the process, and runs a backward's end-of-backward callbacks on the thread that
# finished it. A process per rank has that thread to itself; rank threads on one GPU would
# share it, and a rank whose callback waits for a collective (the reducer's finalize, torch's
# DDP) would block the backward of the peers it waits for: a deadlock. So each rank thread
# runs with autograd's multithreading off (thread-local): its backward, hooks and callbacks
# run on the rank thread itself, whatever the device. On the CPU nothing changes (CPU work
# already runs on the thread that called backward).

# Note [Each rank computes with the process's thread count]
# torch.set_num_threads applies to a thread lazily, at its first parallel op; until then
# oneDNN kernels (convolutions) on a new thread use OpenMP's process default (the core count,
# or OMP_NUM_THREADS), and a different count splits their reductions differently. A rank
# thread's convolution gradient would then differ in the last bits from the same computation
# on the main thread (a reference, a check) after torch.set_num_threads(1). A process per rank
# starts with the count its launcher gave it; so each rank thread asks for the process's count
# first (get_num_threads runs the lazy initialization: torch has no other way to request it).
# A rank thread may be a cached one (see fakepg._threads) that initialized its count under an
# earlier torch.set_num_threads; it then takes the count of the thread that runs the world.

# Note [One link per world]
# With a network model, the world is one simulated link that carries one collective at a time,
# in the order collectives start (the last rank joins), as a real backend runs them on one
# stream or thread. A collective's transfer begins when it has started and the link is free,
# and takes the model's time; the data lands, and the collective completes, when it ends. So
# buckets launched back to back queue behind each other, and the exposed communication after
# backward is what a real link would show. Without a model the link is not simulated.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch
from torch import Tensor

from . import _homes, _intact, _threads
from . import collectives as _c
from . import rng as _rng
from . import streams as _streams
from .completion import Completions
from .executor import Executor, Timer, default_thread_count
from .faults import (
    CollectiveMismatch,
    CollectiveTimeout,
    FakePGError,
    RankExited,
    WorldAborted,
    format_ranks,
    interrupt_thread,
)
from .group import FakeProcessGroup
from .netmodel import NetworkModel
from .schedule import Schedule, _Scheduler, install_future_wait
from .work import INLINE_BYTES, Channel, Collective, ErrorFactory, Work

__all__ = ["FakeProcessGroup", "World", "run"]  # FakeProcessGroup: re-exported

T = TypeVar("T")

# rank, kind, members, tensors, nbytes: see World.observe.
CollectiveObserver = Callable[[int, str, tuple[int, ...], list[Tensor], int], None]

_WORLD_KEY = "world"


class World:
    """``world_size`` ranks that run collectives in memory, truly asynchronously.

    ``timeout`` is the default for ``Work.wait`` (a finite number of seconds: every wait has a
    deadline). ``threads`` is the number of workers that move data (default: one per core, at
    most 8). ``network`` adds simulated network time to each collective (see
    :mod:`fakepg.netmodel`). ``schedule`` runs :meth:`run`'s ranks under a controlled
    scheduler, one thread at a time, in the order its choices decide (see
    :mod:`fakepg.schedule`); not with ``network``. Use as a context manager, or call
    :meth:`close`, so that the worker threads are joined.
    """

    def __init__(
        self,
        world_size: int,
        *,
        timeout: float = 30.0,
        threads: int | None = None,
        network: NetworkModel | None = None,
        schedule: Schedule | None = None,
    ) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"World: world_size must be an int >= 1, got {world_size!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise TypeError(f"World: timeout must be a number of seconds, got {timeout!r}")
        if not (timeout > 0 and math.isfinite(timeout)):
            raise ValueError(
                f"World: timeout must be > 0 seconds and finite, got {timeout!r}: every wait "
                "has a deadline; pass a large number (e.g. 3600) to wait long"
            )
        if schedule is not None and not isinstance(schedule, Schedule):
            raise ValueError(f"World: schedule must be a fakepg.Schedule, got {schedule!r}")
        if schedule is not None and network is not None:
            raise ValueError(
                "World: a schedule decides when collectives complete, a network model times "
                "them; pass one or the other"
            )
        self.world_size = world_size
        self.timeout = float(timeout)
        self.network = network
        name = f"fakepg-{id(self):x}"
        self.timer = Timer(name=name)
        # See Note [Controlled scheduling] in fakepg.schedule.
        self.scheduler: _Scheduler | None = None
        if schedule is not None:
            install_future_wait()
            on_deadlock = weakref.WeakMethod(self._deadlocked)
            self.scheduler = _Scheduler(
                schedule,
                world_size,
                timeout=self.timeout,
                on_deadlock=lambda *args: _call_if_alive(on_deadlock, *args),
                call_at=self.timer.call_at,
            )
        self.executor = Executor(threads or default_thread_count(), name=name)
        # CUDA only, at first use: see Note [Stream order of a collective] in fakepg.streams.
        self.side_streams = _streams.SideStreams()
        # Each rank's done-callbacks run on threads of its own; the handler holds the world
        # weakly (a finalizer's arguments must not keep the world alive).
        on_failure = weakref.WeakMethod(self._callback_failed)
        self.completions = Completions(
            name,
            timeout=self.timeout,
            timer=self.timer,
            on_failure=lambda *args: _call_if_alive(on_failure, *args),
            scheduler=self.scheduler,
        )
        # If a world is dropped without close(), still stop its daemon threads: on the reaper's
        # thread, not in the finalizer (see Note [Closing a dropped world]).
        _start_reaper()
        weakref.finalize(
            self, _REAPED.put, (self.executor, self.timer, self.completions, self.timeout)
        )
        # _lock guards every field below, every Channel's fields and the membership fields of
        # each Collective; it is never held while running a callback or waiting. Lock order:
        # World._lock, then a Collective's own lock, then the completions' lock, then the
        # timer's (the watchdog is armed under World._lock; the timer never calls out holding
        # its own).
        self._lock = threading.Lock()
        self._channels: dict[Hashable, Channel] = {}
        self._active: set[Collective] = set()  # not yet finished (pending or moving data)
        # See Note [Every collective has a deadline]: the collectives some rank has not issued
        # yet -> when the watchdog checks them (perf_counter_ns), in that order (insertion
        # order: a deadline is the check time plus the timeout, and time only grows); and
        # whether the timer holds the watchdog's one entry.
        self._deadlines: dict[Collective, int] = {}
        self._watchdog_armed = False
        self._timeout_ns = math.ceil(self.timeout * 1e9)
        self._gone: set[int] = set()  # ranks that returned from the current run's function
        self._views: dict[tuple[Hashable, int], FakeProcessGroup] = {}
        self._abort: BaseException | None = None
        self._abort_rank: int | None = None
        # A failure the world itself detected (a stuck completion callback), which run()
        # re-raises first: every rank's error is a consequence of it.
        self._own_failure: tuple[int, BaseException] | None = None
        self._closed = False
        # Called as each collective is issued (see observe); replaced, never mutated, so that
        # _issue reads it without the lock.
        self._observers: tuple[CollectiveObserver, ...] = ()
        # See Note [One link per world]: when (perf_counter_ns) the simulated link finishes its
        # last transfer.
        self._link_free_ns = 0
        with self._lock:
            self._world_channel = self._channel_locked(_WORLD_KEY, tuple(range(world_size)), "")
        self._groups = [self._view(self._world_channel, r) for r in range(world_size)]

    def group(self, rank: int) -> FakeProcessGroup:
        """The process group of ``rank``, to be used from that rank's thread."""
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(
                f"World.group: rank must be an int in [0, {self.world_size}), got {rank!r}"
            )
        return self._groups[rank]

    # ---------------------------------------------------------------------------------------
    # Channels: groups and point-to-point pairs.

    def _channel_locked(self, key: Hashable, members: tuple[int, ...], label: str) -> Channel:
        channel = self._channels.get(key)
        if channel is None:
            channel = self._channels[key] = Channel(key, members, label)
            # A rank that already returned from this run issues nothing on a new channel.
            for rank in self._gone.intersection(members):
                channel.departed[rank] = 0
        return channel

    def _view(self, channel: Channel, rank: int) -> FakeProcessGroup:
        """The one FakeProcessGroup of ``rank`` on ``channel`` (the same object every time)."""
        key = (channel.key, rank)
        with self._lock:
            view = self._views.get(key)
            if view is None:
                view = self._views[key] = FakeProcessGroup(self, channel, rank)
        return view

    def _new_group(
        self, parent: Channel, rank: int, ranks: tuple[int, ...]
    ) -> FakeProcessGroup | None:
        """``rank``'s next new_group call on ``parent``, naming world ranks ``ranks`` (sorted).
        See Note [Subgroups]."""
        with self._lock:
            k = parent.new_group_calls[rank]
            first = parent.new_groups.setdefault(k, (rank, ranks))
            if first[1] != ranks:
                raise ValueError(
                    f"new_group: rank {rank}'s call #{k}{parent.label} names ranks "
                    f"{list(ranks)}, but rank {first[0]}'s call #{k} named {list(first[1])}; "
                    "every rank of the group calls new_group with the same ranks, in the same "
                    "order (members and non-members alike)"
                )
            parent.new_group_calls[rank] = k + 1
            if rank not in ranks:
                return None
            label = f" in group {list(ranks)}"
            channel = self._channel_locked(("new_group", parent.key, k), ranks, label)
        return self._view(channel, rank)

    def _named_group(self, name: str, ranks: tuple[int, ...], rank: int) -> FakeProcessGroup:
        """``rank``'s view of the group torch.distributed named ``name`` over world ranks
        ``ranks`` (torch names groups alike on every rank: see Note [Subgroups])."""
        with self._lock:
            label = f" in group '{name}' {list(ranks)}"
            channel = self._channel_locked(("named", name, ranks), ranks, label)
        return self._view(channel, rank)

    def _p2p_channel(self, group: Channel, src: int, dst: int, tag: int) -> Channel:
        """The channel of messages from world rank ``src`` to ``dst`` with ``tag`` in ``group``.
        See Note [Point-to-point matching]."""
        with self._lock:
            label = f" from rank {src} to rank {dst} (tag {tag}){group.label}"
            channel = self._channel_locked(("p2p", group.key, src, dst, tag), (src, dst), label)
            channel.pair = (group.key, src, dst, tag)
            return channel

    def observe(self, fn: CollectiveObserver) -> Callable[[], None]:
        """Call ``fn(rank, kind, members, tensors, nbytes)`` on the issuing thread as each rank
        issues each collective (``kind`` as in desync reports: "allreduce", "broadcast", ...;
        ``members`` the world ranks of its group; ``tensors`` the tensors it writes). For
        tools that audit what a run reduced. Returns a function that stops the calls.
        """
        if not callable(fn):
            raise ValueError(f"World.observe: fn must be callable, got {fn!r}")
        with self._lock:
            self._observers = (*self._observers, fn)

        def remove() -> None:
            with self._lock:
                self._observers = tuple(o for o in self._observers if o is not fn)

        return remove

    # ---------------------------------------------------------------------------------------
    # Issuing and matching. See Note [Matching by sequence number].

    def _issue(
        self,
        channel: Channel,
        rank: int,
        fingerprint: _c.Fingerprint,
        payload: Any,
        outputs: list[Tensor],
        plan: Callable[[list[Any]], list[_c.Task]],
        nbytes: int,
        net_kind: str,
    ) -> Work:
        """``rank`` (a world rank) issues its next collective on ``channel``."""
        scheduler = self.scheduler
        if scheduler is not None:
            scheduler.check_thread(lambda: _describe(fingerprint, channel.next_seq[rank], channel))
        for observer in self._observers:
            observer(rank, fingerprint.kind, channel.members, outputs, nbytes)
        # CUDA tensors only: see Note [Stream order of a collective] in fakepg.streams.
        ready = _streams.record_ready(fingerprint.specs)
        now = time.perf_counter_ns()
        # Issued from a callback on a completion lane? See Note [Completion lanes].
        lane = self.completions.current_lane()
        issued = _intact.snapshot(payload)  # see Note [A tensor changed in flight]
        with self._lock:
            if self._abort is not None or self._closed:
                what = _describe(fingerprint, channel.next_seq[rank], channel)
                raise self._aborted_error(rank, what)
            seq = channel.next_seq[rank]
            channel.next_seq[rank] = seq + 1
            collective = channel.pending.get(seq)
            if collective is None:
                collective = self._create_locked(channel, seq, fingerprint)
            elif fingerprint != collective.fingerprint and not collective.failed:
                collective.finish(_mismatch(collective, rank, fingerprint))
            collective.fingerprints[rank] = fingerprint
            collective.payloads[rank] = payload
            collective.issued[rank] = issued
            collective.launched_ns[rank] = now
            collective.levels[rank] = 0 if lane is None else lane.level + 1
            if ready:
                collective.ready.extend(ready)
            if lane is not None:
                with self.completions.lock:
                    if not collective.done.is_set():
                        collective.issuer_lanes.append(lane)
                        self.completions.count_issue_locked(lane)
            full = len(collective.fingerprints) == len(channel.members)
            lands_at_ns = None
            if full:
                del channel.pending[seq]
                self._deadlines.pop(collective, None)  # its data moves; it ends by itself
                if not collective.failed:
                    collective.started_ns = time.perf_counter_ns()
                    lands_at_ns = self._reserve_link(collective, nbytes, net_kind)
        complete: Callable[[], None] | None = None
        if full and not collective.failed:
            payloads = [collective.payloads[r] for r in channel.members]
            try:
                tasks = plan(payloads)
            except _c.Disagreement as exc:
                # A tensor changed in flight is the cause, if one did.
                changed = collective.changed_error()
                collective.finish(changed or _disagree(collective, str(exc)))
            else:
                if collective.ready:  # CUDA tensors: the parts run on the side streams
                    order = _streams.StreamOrder(self.side_streams, collective.ready)
                    collective.stream_order = order
                    tasks = [order.wrap(task) for task in tasks]
                if scheduler is not None:
                    complete = functools.partial(collective.run_inline, tasks)
                elif (
                    lands_at_ns is None
                    and collective.stream_order is None
                    and len(tasks) <= 1
                    and nbytes * len(channel.members) <= INLINE_BYTES
                ):
                    # See Note [Small collectives move on the last rank's thread] in fakepg.work.
                    collective.move_here(tasks, rank)
                else:
                    collective.start(tasks, lands_at_ns)
        if scheduler is not None:
            # A point: who runs next, and when this collective completes, is decided there.
            # As this rank issued it (its peers' may differ: a desync).
            fp = fingerprint
            extra = f" (op={fp.op.name})" if fp.op is not None else ""
            extra = f" (root={fp.root})" if fp.root is not None else extra
            what = f"{_describe(fp, collective.seq, channel)}{extra}"
            scheduler.issued(what, fp.specs, complete)  # written out when read
        return Work(collective, rank, outputs)

    def _reserve_link(self, collective: Collective, nbytes: int, kind: str) -> int | None:
        """When (perf_counter_ns) the collective's data has crossed the simulated link, or
        None without a network model.

        Called with ``_lock`` held, when the last rank joins. See Note [One link per world].
        """
        if self.network is None or collective.started_ns is None:
            return None
        size = len(collective.channel.members)
        # Whole nanoseconds, rounded up: never earlier than the model says.
        cost_ns = math.ceil(self.network.collective_time_s(kind, nbytes, size) * 1e9)
        begin = max(collective.started_ns, self._link_free_ns)
        self._link_free_ns = begin + cost_ns
        return self._link_free_ns

    def _create_locked(self, channel: Channel, seq: int, fingerprint: _c.Fingerprint) -> Collective:
        collective = Collective(self, channel, seq, fingerprint)
        channel.pending[seq] = collective
        self._active = {c for c in self._active if not c.done.is_set()}
        self._active.add(collective)
        gone = {r: n for r, n in channel.departed.items() if n <= seq}
        if gone:
            collective.finish(_exited(collective, gone))
        else:
            self._deadlines[collective] = collective.created_ns + self._timeout_ns
            self._arm_watchdog_locked()
        return collective

    def _arm_watchdog_locked(self) -> None:
        """Give the timer the watchdog's one entry, at the earliest deadline, unless it has
        one (which is due no later). See Note [Every collective has a deadline]."""
        if self._watchdog_armed or not self._deadlines:
            return
        deadline = next(iter(self._deadlines.values()))
        # Weakly: the timer must not keep the world (and its tensors) alive.
        method = weakref.WeakMethod(self._watchdog)
        with contextlib.suppress(RuntimeError):  # closing: close() fails what is unfinished
            self.timer.call_at(deadline, lambda: _call_if_alive(method))
            self._watchdog_armed = True

    def _watchdog(self) -> None:
        """On the timer thread: fail each collective past its deadline that some rank has not
        issued yet and that no rank waits for with a deadline of its own; re-arm."""
        with self._lock:
            self._watchdog_armed = False
            now = time.perf_counter_ns()
            while self._deadlines:
                collective, deadline = next(iter(self._deadlines.items()))
                if deadline > now:
                    break
                del self._deadlines[collective]
                if collective.done.is_set():
                    continue  # failed while pending (abort, mismatch, a rank gone)
                if collective.waiters > 0:
                    # A waiter's own timeout will end it; look again a timeout from now (the
                    # latest deadline there is: it goes last).
                    self._deadlines[collective] = now + self._timeout_ns
                    continue
                joined = set(collective.fingerprints)
                channel = collective.channel
                elsewhere = self._p2p_elsewhere_locked(collective) if channel.is_p2p else ""
                first = min(joined, key=lambda r: collective.launched_ns[r])
                error = _timed_out(collective, None, self.timeout, joined, elsewhere, first)
                collective.finish(error)
            self._arm_watchdog_locked()

    def _wait_timed_out(self, collective: Collective, rank: int, timeout: float) -> None:
        """Fail ``collective`` for every rank because ``rank``'s wait passed ``timeout``."""
        with self._lock:
            joined = set(collective.fingerprints)
            elsewhere = self._p2p_elsewhere_locked(collective) if collective.channel.is_p2p else ""
            collective.finish(_timed_out(collective, rank, timeout, joined, elsewhere))

    def _p2p_elsewhere_locked(self, collective: Collective) -> str:
        """For a timed-out send/recv: what the same pair waits for under other tags."""
        assert collective.channel.pair is not None
        group_key, src, dst, tag = collective.channel.pair
        found = []
        for channel in self._channels.values():
            if channel.pair is None or channel.pair[:3] != (group_key, src, dst):
                continue
            if channel.pair[3] == tag:
                continue
            for other in channel.pending.values():
                for r, fp in other.fingerprints.items():
                    found.append(f"rank {r} has a {fp.role} pending with tag {channel.pair[3]}")
        if not found:
            return ""
        return f" Meanwhile {'; '.join(found)}: a send and its recv must use the same tag."

    def _depart(self, rank: int) -> None:
        """``rank`` returned from its function: collectives waiting for it can never finish."""
        with self._lock:
            self._gone.add(rank)
            for channel in self._channels.values():
                if rank not in channel.next_seq:
                    continue
                issued = channel.next_seq[rank]
                channel.departed[rank] = issued
                for collective in channel.pending.values():
                    if rank not in collective.fingerprints:
                        collective.finish(_exited(collective, {rank: issued}))

    def _callback_failed(self, rank: int, what: str, error: BaseException | None) -> None:
        """A completion lane's report: rank ``rank``'s done-callback of ``what`` raised
        ``error``, or (None) is stuck. Either aborts the world, naming both. See Note
        [Completion lanes] in fakepg.completion."""
        failure: BaseException
        if error is None:
            failure = CollectiveTimeout(
                f"fakepg: rank {rank}'s done-callback of {what} did not return within "
                f"{self.timeout:g} s (the world's timeout), with no collective of its own in "
                f"flight. It blocks rank {rank}'s completion thread, so the rank's later "
                "futures could never complete. A callback must not wait for anything but the "
                "collectives it issues itself (not a lock, an event, or a collective its rank "
                "issued before and that completes after it); wait for those on the rank's own "
                "thread."
            )
        else:
            failure = FakePGError(
                f"fakepg: rank {rank}'s done-callback of {what} raised "
                f"{type(error).__name__}: {error}; a done-callback must not raise"
            )
            failure.__cause__ = error
        with self._lock:
            if self._own_failure is None and self._abort is None:
                self._own_failure = (rank, failure)
        self.abort(failure, rank=rank)

    def _deadlocked(self, rank: int, error: BaseException) -> None:
        """The scheduler's report: under its schedule nothing can move (see Note [Controlled
        scheduling] in fakepg.schedule). Aborts the world; run() re-raises it first."""
        with self._lock:
            if self._own_failure is None and self._abort is None:
                self._own_failure = (rank, error)
        self.abort(error, rank=rank)

    # ---------------------------------------------------------------------------------------
    # Running one thread per rank.

    def run(
        self,
        fn: Callable[[FakeProcessGroup], T],
        *,
        per_rank_rng: bool = True,
        stop_grace: float | None = None,
    ) -> list[T]:
        """Call ``fn(pg)`` on one thread per rank of this world; results in rank order.

        The semantics of :func:`fakepg.run`, on a world that lives on between calls (models and
        reducers built on its groups keep working). A rank that returns early counts as gone
        only until every rank of this call has returned. If the ranks end the call having
        issued different numbers of collectives, they are out of step for good: the world is
        aborted, and the next call says so. ``per_rank_rng``: see :mod:`fakepg.rng`.
        ``stop_grace``: after an abort, the seconds a rank computing outside any collective
        gets to reach one before it is stopped, and again to stop (default ``min(timeout,
        5)``); a rank still running after that (blocked in a C call) is left behind.
        """
        if not callable(fn):
            raise ValueError(f"World.run: fn must be callable, got {fn!r}")
        grace_s = min(self.timeout, 5.0) if stop_grace is None else stop_grace
        if isinstance(grace_s, bool) or not (
            isinstance(grace_s, int | float) and 0 <= grace_s < math.inf
        ):
            raise ValueError(
                f"World.run: stop_grace must be a finite number of seconds >= 0, got {stop_grace!r}"
            )
        if self._abort is not None or self._closed:
            raise self._aborted_error(0, "World.run")
        results: list[Any] = [None] * self.world_size
        # lock guards failures and returned: the first failure recorded is the one re-raised.
        lock = threading.Lock()
        failures: list[tuple[int, BaseException]] = []
        returned: set[int] = set()  # ranks whose result is in results
        ended = [0]  # rank functions that have ended, guarded by lock too
        # Set once every rank's function has ended, or one ended with the world aborted or
        # closed: the caller wakes then, not at each rank's end (under the GIL a wake-up
        # takes the interpreter from the ranks still computing).
        changed = threading.Event()
        streams = _rng.RankStreams(self.world_size) if per_rank_rng else None

        def fail(rank: int, exc: BaseException) -> None:
            with lock:
                failures.append((rank, exc))
            self.abort(exc, rank=rank)

        scheduler = self.scheduler
        threads_here = torch.get_num_threads()

        def rank_main(rank: int) -> None:
            try:
                if scheduler is not None:
                    scheduler.enter(rank)
                try:
                    # See Note [Each rank computes with the process's thread count].
                    if torch.get_num_threads() != threads_here:
                        torch.set_num_threads(threads_here)
                    # See Note [Each rank runs its own backward].
                    with (
                        torch.autograd.set_multithreading_enabled(False),
                        _rng.rank_stream(streams, rank),
                    ):
                        # See Note [Callbacks run in their rank] in fakepg._homes.
                        self.completions.homes[rank] = _homes.home()
                        result = fn(self.group(rank))
                except _Stop:
                    fail(rank, self._stopped_error(rank))
                except BaseException as exc:
                    fail(rank, exc)
                else:
                    results[rank] = result
                    with lock:
                        returned.add(rank)
                    self._depart(rank)
            except _Stop:
                pass  # delivered after fn had ended: there is nothing left to stop
            finally:
                if scheduler is not None:
                    scheduler.leave()
                with lock:
                    ended[0] += 1
                    everyone = ended[0] == self.world_size
                if everyone or self._abort is not None or self._closed:
                    changed.set()

        threads = [
            _threads.Job(target=rank_main, args=(r,), name=f"fakepg-rank-{r}")
            for r in range(self.world_size)
        ]
        if scheduler is not None:
            scheduler.begin()
        for thread in threads:
            thread.start()
        stuck = _join_ranks(
            self, threads, changed, lambda: ended[0] == self.world_size, grace_s=float(grace_s)
        )
        if scheduler is not None:
            scheduler.end()
        with lock:
            own = self._own_failure
            if own is not None and all(exc is not own[1] for _, exc in failures):
                failures.insert(0, own)  # the world found it first; ranks failed after it
            if not failures and len(returned) < self.world_size:
                # Closed while a rank had not returned (stuck in a C call, or stopped between
                # its return and recording it): no partial results.
                missing = min(set(range(self.world_size)) - returned)
                failures.append((missing, self._stopped_error(missing)))
        self._end_run()
        if streams is not None:
            streams.check_global_untouched()
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

    def _stopped_error(self, rank: int) -> WorldAborted:
        if self._abort is None:
            cause = "the world was closed"
        elif self._abort_rank is not None:
            cause = f"rank {self._abort_rank} failed ({_exception_text(self._abort)})"
        else:
            cause = f"the world was aborted ({_exception_text(self._abort)})"
        return WorldAborted(
            f"fakepg: rank {rank} was stopped while it computed outside any collective, because "
            f"{cause}"
        )

    def _end_run(self) -> None:
        with self._lock:
            self._gone.clear()
            uneven = []
            for channel in self._channels.values():
                channel.departed.clear()
                counts = [channel.next_seq[r] for r in channel.members]
                if len(set(counts)) > 1:
                    uneven.append(_uneven(channel, counts))
        if uneven and self._abort is None:
            self.abort(RankExited(f"fakepg: {uneven[0]}; their sequence numbers no longer match"))

    # ---------------------------------------------------------------------------------------
    # Abort and close: every failure wakes every rank.

    def abort(self, reason: BaseException, *, rank: int | None = None) -> None:
        """Fail every unfinished collective and refuse new ones; the first abort wins.

        ``rank`` names the rank whose failure caused it; the errors every other rank sees
        name it and ``reason``. Ranks of :meth:`run` that are computing outside collectives
        are stopped too (see ``run``).
        """
        with self._lock:
            if self._abort is not None or self._closed:
                return
            self._abort, self._abort_rank = reason, rank
            unfinished = list(self._active)
        if self.scheduler is not None:
            self.scheduler.abort()  # every thread runs free: each wakes with the abort
        self._fail_all(unfinished, lambda what: lambda r: self._aborted_error(r, what))

    @property
    def aborted(self) -> bool:
        return self._abort is not None

    @property
    def closed(self) -> bool:
        return self._closed

    def _aborted_error(self, rank: int, what: str) -> WorldAborted:
        if self._abort is None:
            return WorldAborted(
                f"fakepg: the world was closed; {what} cannot complete on rank {rank}. Issue "
                "collectives only inside `with World(...)` or before World.close()."
            )
        cause = _exception_text(self._abort)
        if self._abort_rank is not None:
            cause = f"rank {self._abort_rank} failed ({cause})"
        return WorldAborted(
            f"fakepg: the world was aborted because {cause}; {what} cannot complete on rank "
            f"{rank}. Look at the first failure; this one is a consequence."
        )

    def _fail_all(
        self, collectives: list[Collective], factory: Callable[[str], ErrorFactory]
    ) -> None:
        for collective in collectives:
            collective.finish(factory(collective.describe()))

    def close(self) -> None:
        """Fail what is unfinished, stop and join the worker threads. Idempotent.

        Ranks of a :meth:`run` in progress wake if they wait in a collective, and are stopped
        within a bound if they are computing (see ``run``): ``run`` then raises WorldAborted.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            unfinished = list(self._active)
        if self.scheduler is not None:
            self.scheduler.close()
        self._fail_all(unfinished, lambda what: lambda r: self._aborted_error(r, what))
        _close_threads(self.executor, self.timer, self.completions, self.timeout)

    def __enter__(self) -> World:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.abort(exc)
        self.close()

    def __repr__(self) -> str:
        state = "aborted" if self._abort is not None else "closed" if self._closed else "open"
        return f"<fakepg.World size={self.world_size} timeout={self.timeout}s {state}>"


def _close_threads(
    executor: Executor, timer: Timer, completions: Completions, timeout: float
) -> None:
    # The timer first (no more landings or watchdog checks), then the workers (the data of
    # what has started finishes moving), then the lanes (they deliver every callback posted).
    timer.close()
    executor.close()
    completions.close(grace=min(timeout, 5.0))


# Note [Closing a dropped world]
# A world dropped without close() still has its threads stopped, by a weakref finalizer. A
# finalizer runs wherever the garbage collector runs: on any thread, at any allocation,
# possibly while that thread holds a lock that closing needs (the process-wide timer's, while
# another world closes its timer; the thread cache's). Closing there could deadlock the
# thread on itself. So the finalizer only puts the world's parts on a queue (SimpleQueue.put
# is safe from finalizers: it takes no lock a Python caller can hold), and one daemon thread,
# started by the first world, closes them, holding no lock of its own while it does.
_REAPED: queue.SimpleQueue[tuple[Executor, Timer, Completions, float]] = queue.SimpleQueue()
_reaper_lock = threading.Lock()  # guards _reaper
_reaper: threading.Thread | None = None


def _start_reaper() -> None:
    """Start the thread that closes dropped worlds, once per process (from a world's
    constructor, never from a finalizer)."""
    global _reaper
    with _reaper_lock:
        if _reaper is None:
            _reaper = threading.Thread(
                target=_reap, name="fakepg: closes dropped worlds", daemon=True
            )
            _reaper.start()
            # At exit, weakref.finalize calls the finalizers of the worlds still alive (they put
            # their parts on the queue) in an atexit hook registered at the first finalizer,
            # after this one: atexit runs the latest first, so this drains the queue after
            # them, as the finalizers closed those worlds before the reaper existed.
            atexit.register(_reap_now)


def _reap() -> None:
    while True:
        _close_reaped(_REAPED.get())


def _reap_now() -> None:
    while True:
        try:
            parts = _REAPED.get_nowait()
        except queue.Empty:
            return
        _close_reaped(parts)


def _close_reaped(parts: tuple[Executor, Timer, Completions, float]) -> None:
    try:
        _close_threads(*parts)
    except Exception as exc:  # reported as a thread's uncaught exception; the reaper goes on
        threading.excepthook(
            threading.ExceptHookArgs(
                (type(exc), exc, exc.__traceback__, threading.current_thread())
            )
        )


def _call_if_alive(method: weakref.WeakMethod[Callable[..., None]], *args: Any) -> None:
    bound = method()
    if bound is not None:
        bound(*args)


# -------------------------------------------------------------------------------------------
# Error messages: what happened, which ranks, the likely cause, the fix.


def _exception_text(exc: BaseException) -> str:
    """``CollectiveTimeout: ...``, or the bare type name for an exception without a message
    (``KeyboardInterrupt``)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _describe(fingerprint: _c.Fingerprint, seq: int, channel: Channel) -> str:
    kind = "send/recv" if channel.is_p2p else fingerprint.kind
    return f"{kind} #{seq}{channel.label}"


def _mismatch(collective: Collective, rank: int, theirs: _c.Fingerprint) -> ErrorFactory:
    first_rank = min(collective.fingerprints)
    ours = collective.fingerprint
    fields = ", ".join(ours.differences(theirs))
    channel = collective.channel
    if channel.is_p2p:
        src, dst = channel.members
        sent, received = (ours, theirs) if first_rank == src else (theirs, ours)
        text = (
            f"fakepg: {collective.describe()}: rank {src} sends {sent} but rank {dst}'s "
            f"matching recv is {received} (they differ in {fields}). A recv must name the "
            "sender, tag, dtype and shape the send has; a recv or send skipped before this one "
            "shifts the pairing."
        )
    else:
        text = (
            f"fakepg: ranks disagree on collective #{collective.seq}{channel.label}: rank "
            f"{first_rank} issued {ours} but rank {rank} issued {theirs} (they differ in "
            f"{fields}). Every rank must issue the same collectives, in the same order, with "
            "matching tensors; a rank that took another branch or skipped a collective before "
            "this one causes this."
        )
    return lambda _rank: CollectiveMismatch(text)


def _disagree(collective: Collective, detail: str) -> ErrorFactory:
    text = (
        f"fakepg: ranks disagree on {collective.describe()}: {detail}. Every rank must pass "
        "arguments that fit the others'."
    )
    return lambda _rank: CollectiveMismatch(text)


def _exited(collective: Collective, gone: dict[int, int]) -> ErrorFactory:
    what = collective.describe()
    ranks = format_ranks(set(gone))
    if collective.channel.is_p2p:
        dst = collective.channel.members[1]
        missing = "posting the matching recv" if dst in gone else "sending it"
        text = (
            f"fakepg: {what} can never complete: {ranks} returned from the rank function "
            f"without {missing}. Look for a send or recv on one side only."
        )
        return lambda _rank: RankExited(text)
    counts = ", ".join(f"rank {r} issued {n}" for r, n in sorted(gone.items()))
    text = (
        f"fakepg: {what} can never complete: {ranks} returned from the rank function without "
        f"issuing it ({counts} collective(s) in all). Every rank must issue the same "
        "collectives; look for an early return or a branch taken on some ranks only."
    )
    return lambda _rank: RankExited(text)


def _timed_out(
    collective: Collective,
    waiter: int | None,
    timeout: float,
    joined: set[int],
    elsewhere: str,
    first: int | None = None,
) -> ErrorFactory:
    """``waiter``: the rank whose wait passed ``timeout``; None for the watchdog, counting
    from when rank ``first`` issued it."""
    what = collective.describe()
    channel = collective.channel
    missing = set(channel.members) - joined
    if missing and channel.is_p2p:
        src, dst = channel.members
        if dst in missing:
            detail = f"rank {dst} never posted the matching recv (rank {src} sent it)"
        else:
            detail = f"rank {src} never sent it (rank {dst} posted the recv)"
        detail += "; compare their stacks." + elsewhere
    elif missing:
        verb = (
            "did not arrive"
            if collective.fingerprint.kind == "monitored_barrier"
            else ("never issued it")
        )
        detail = (
            f"{format_ranks(missing)} {verb} ({format_ranks(joined)} did). Those ranks "
            "skipped it, issued a different number of collectives before it, or are stuck "
            "computing; compare their stacks."
        )
    else:
        detail = (
            "every rank issued it but its data did not finish moving in time (a slow "
            "simulated network or a very large tensor); raise the timeout."
        )

    def make(rank: int) -> CollectiveTimeout:
        if waiter is None:
            issued = "this rank" if rank == first else f"rank {first}"
            whose = (
                f"the world's watchdog, since {issued} issued it; no rank waited with a deadline"
            )
        else:
            whose = ("this rank's" if rank == waiter else f"rank {waiter}'s") + " wait"
        return CollectiveTimeout(
            f"fakepg: {what} timed out after {timeout:g} s ({whose}): {detail}"
        )

    return make


def _uneven(channel: Channel, counts: list[int]) -> str:
    if channel.is_p2p:
        src, dst = channel.members
        where = channel.label.replace(f" from rank {src}", "")
        return f"rank {src} sent {counts[0]} message(s){where} but rank {dst} received {counts[1]}"
    per_rank = ", ".join(f"rank {r}: {n}" for r, n in zip(channel.members, counts, strict=True))
    return (
        f"the ranks ended a run having issued different numbers of collectives{channel.label} "
        f"({per_rank})"
    )


# -------------------------------------------------------------------------------------------
# run: one thread per rank, structured.


class _Stop(BaseException):
    """Delivered to a rank thread that is still running after the world was aborted or
    closed."""

    def __str__(self) -> str:
        return (
            "fakepg: this rank was stopped while it computed outside any collective, because "
            "the world was aborted or closed"
        )


def run(
    fn: Callable[[FakeProcessGroup], T],
    world_size: int,
    *,
    timeout: float = 60.0,
    network: NetworkModel | None = None,
    per_rank_rng: bool = True,
    schedule: Schedule | None = None,
) -> list[T]:
    """Call ``fn(pg)`` on one thread per rank of a new world; return the results in rank order.

    If any rank raises (any ``BaseException``), the world is aborted: every rank blocked in a
    collective wakes at once with an error naming the failed rank, and ``run`` re-raises the
    first failure with a note naming its rank. ``timeout`` is each collective's default wait;
    ``network`` simulates transfer time (see :mod:`fakepg.netmodel`). A rank that returns while
    its peers wait for it makes their collectives fail at once. Every thread started here has
    ended when ``run`` returns or raises (see ``World.run``). With ``per_rank_rng`` (the
    default) each rank draws from a generator of its own (see :mod:`fakepg.rng`). With a
    ``schedule``, one thread runs at a time, in the order it decides (see
    :mod:`fakepg.schedule`); its ``timeline`` then shows what happened.
    """
    with World(world_size, timeout=timeout, network=network, schedule=schedule) as world:
        return world.run(fn, per_rank_rng=per_rank_rng)


def _join_ranks(
    world: World,
    threads: list[_threads.Job],
    changed: threading.Event,
    all_ended: Callable[[], bool],
    grace_s: float,
) -> list[int]:
    """Wait for every rank thread; once the world is aborted or closed, stop the stragglers.
    ``changed`` is set when ``all_ended()`` becomes true or a rank ends in an aborted world;
    the threads themselves are then joined (a job is done a little after its function ended:
    its thread resets its state first).

    A rank blocked in a collective wakes with the abort. A rank busy elsewhere gets ``grace_s``
    to reach a collective, then an asynchronous ``_Stop``, then ``grace_s`` more; a thread
    still alive after that (stuck in a C call) is returned instead of waited for forever.
    """
    try:
        while not all_ended() and not (world.aborted or world.closed):
            changed.wait(0.1)  # a timeout too, so that Ctrl-C and close() are seen
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
