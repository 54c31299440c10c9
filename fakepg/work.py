"""A collective shared by all ranks (:class:`Collective`), the channel whose sequence it
belongs to (:class:`Channel`), and each rank's handle (:class:`Work`).

# Guarantees: a Collective finishes exactly once, successfully or with an error, from whichever
# thread gets there first (the executor after the last kernel task, the rank that joined a
# small collective last, a rank whose wait timed out, the world's watchdog, an abort).
# ``finish`` is safe from any thread, never blocks and never runs a callback, so it may be
# called with the world's lock held: each rank's done-callbacks are posted to that rank's
# completion lane (see Note [Completion lanes] in fakepg.completion), in the order
# collectives finish. Work methods are safe from any thread.

# Note [Small collectives move on the last rank's thread]
# Handing a collective of a few kilobytes to a worker thread costs more than moving its data:
# a wake-up of the worker, and another of each waiting rank once the worker is done; on busy
# cores each is a scheduling delay. So the rank that joins a small collective last (no
# simulated network, no CUDA stream order, one task of at most INLINE_BYTES in all) moves its
# data itself, before its call returns, and finishes it: every other rank's work completes
# then (they issued it earlier, and their calls have long returned), and their
# done-callbacks go to their lanes as always. The last rank's own work is *held*: it is not
# complete when its call returns, as no work ever is. It completes once that rank waits for
# it (the wait returns at once: the data has landed), or once its lane runs the callbacks of
# the future it asked for, or, for a rank that only polls ``is_completed``, on the world's
# timer _RELEASE_AFTER_NS after its first poll (which sees it pending). A collective that
# fails as its data moves (a tensor changed in flight, a kernel that raises) is held alike:
# the error, too, comes when the rank looks. The bits are those a worker gives (the same
# tasks), and every lane receives the collectives in the same order.
# Under a controlled schedule, decisions move the data instead (see Note [Controlled
# scheduling] in fakepg.schedule).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from reducer import collectives as _args

from . import _intact
from .collectives import RULES, Fingerprint, Task
from .faults import FakePGError, TensorChanged

if TYPE_CHECKING:
    from .completion import Completions, Lane
    from .executor import Executor, Timer
    from .schedule import _Scheduler
    from .streams import StreamOrder

__all__ = ["Work"]

ErrorFactory = Callable[[int], BaseException]

# A held work (see Note [Small collectives move on the last rank's thread]) that its rank
# only polls completes this long after the first poll.
_RELEASE_AFTER_NS = 1_000_000
# At most this many bytes in all ranks' tensors together move on the last rank's thread.
INLINE_BYTES = 256 * 1024


class _Host(Protocol):
    """What a collective needs of its world (:class:`fakepg.World` is the one). A protocol,
    not an import: the world imports this module to create collectives."""

    @property
    def timeout(self) -> float: ...

    @property
    def executor(self) -> Executor: ...

    @property
    def timer(self) -> Timer: ...

    @property
    def completions(self) -> Completions: ...

    @property
    def scheduler(self) -> _Scheduler | None: ...

    def _wait_timed_out(self, collective: Collective, rank: int, timeout: float) -> None: ...


class Channel:
    """One sequence space (see Note [Matching by sequence number] in fakepg.world); fields
    guarded by the world's lock."""

    def __init__(self, key: Hashable, members: tuple[int, ...], label: str) -> None:
        self.key = key
        self.members = members  # world ranks, in group-rank order
        self.label = label  # how messages name it: "" for the world, " in group [0, 2]"
        # For the messages of one pair: (the group's key, source, destination, tag).
        self.pair: tuple[Hashable, int, int, int] | None = None
        self.next_seq = dict.fromkeys(members, 0)
        self.pending: dict[int, Collective] = {}  # issued by some members, not yet by all
        self.departed: dict[int, int] = {}  # rank -> how many it issued before it returned
        # See Note [Subgroups] in fakepg.world: per member, how many new_group calls it made
        # on this group; per call number, the first caller and the ranks it named.
        self.new_group_calls = dict.fromkeys(members, 0)
        self.new_groups: dict[int, tuple[int, tuple[int, ...]]] = {}

    @property
    def is_p2p(self) -> bool:
        return self.pair is not None


class Collective:
    """The k-th collective of a channel (a group, or a pair's messages): who joined with what,
    and how it ended."""

    def __init__(self, world: _Host, channel: Channel, seq: int, fingerprint: Fingerprint) -> None:
        self.world = world
        self.channel = channel
        self.seq = seq
        self.fingerprint = fingerprint
        # Membership fields below are guarded by the world's lock (World._lock).
        self.fingerprints: dict[int, Fingerprint] = {}
        self.payloads: dict[int, Any] = {}
        # Per rank, its tensors as issued: compared again as the data moves (see Note [A
        # tensor changed in flight] in fakepg._intact).
        self.issued: dict[int, tuple[_intact.Issued, ...]] = {}
        self.launched_ns: dict[int, int] = {}
        # Per rank, the nesting level of the thread that issued it (see Note [Completion
        # lanes]); and the lanes whose callbacks issued it, told when it finishes.
        self.levels: dict[int, int] = {}
        self.issuer_lanes: list[Lane] = []
        self.created_ns = time.perf_counter_ns()
        # Timings, written before `done` is set, so readers after `done` see them.
        self.started_ns: int | None = None
        self.completed_ns: int | None = None
        self.done = threading.Event()
        # _lock guards _error_for, _parts_left, _callbacks and waiters: the first finish wins.
        self._lock = threading.Lock()
        self._error_for: ErrorFactory | None = None
        self._parts_left = 0
        # Per rank, callbacks not yet delivered: added while pending, or after finish but
        # before the rank's lane ran them (those join the delivery).
        self._callbacks: dict[int, list[Callable[[], None]]] = {}
        # Ranks inside Work.wait: they have deadlines of their own, so the world's watchdog
        # leaves the collective to them (see Note [Every collective has a deadline]).
        self.waiters = 0
        # CUDA tensors only (see Note [Stream order of a collective] in fakepg.streams): each
        # rank's (device, ready event), guarded by the world's lock; and the order its parts
        # run in, set before they start.
        self.ready: list[tuple[torch.device, Any]] = []
        self.stream_order: StreamOrder | None = None
        # See Note [Small collectives move on the last rank's thread]: the rank whose work
        # completes after ``done`` (set before ``done``, never changed after), and when.
        self._held: int | None = None
        self._released = threading.Event()
        self._release_armed = False

    def describe(self) -> str:
        """``allreduce #3 (op=SUM)``, ``broadcast #0 (root=1) in group [0, 2]``, ``send/recv
        #2 from rank 0 to rank 1 (tag 0)``: how errors name this collective."""
        fp = self.fingerprint
        extra = f" (op={fp.op.name})" if fp.op is not None else ""
        if fp.root is not None:
            extra = f" (root={fp.root})"
        kind = "send/recv" if self.channel.is_p2p else fp.kind
        return f"{kind} #{self.seq}{extra}{self.channel.label}"

    @property
    def failed(self) -> bool:
        return self._error_for is not None

    def error_for(self, rank: int) -> BaseException | None:
        """A fresh exception for ``rank`` (threads must not share one object), or None."""
        factory = self._error_for
        return None if factory is None else factory(rank)

    def start(self, tasks: list[Task], lands_at_ns: int | None = None) -> None:
        """Move the data (``tasks``, on the executor), then finish.

        With a simulated network, the data lands when the transfer ends: the tasks are
        submitted at ``lands_at_ns`` (perf_counter_ns), so a rank that reads its tensors
        before ``wait`` returns sees the old values, as it would on a real network.
        ``started_ns`` was set by the world when the last rank joined.
        """
        if self.started_ns is None:
            self.started_ns = time.perf_counter_ns()
        if lands_at_ns is not None and lands_at_ns > time.perf_counter_ns():
            self.world.timer.call_at(lands_at_ns, lambda: self._submit(tasks))
        else:
            self._submit(tasks)

    def move_here(self, tasks: list[Task], rank: int) -> None:
        """Move the data now, on the calling thread (rank ``rank``'s, which joined last), then
        finish, with an error if a tensor changed in flight or a kernel raised, and with
        ``rank``'s completion held back until its call has returned. See Note [Small
        collectives move on the last rank's thread]. ``started_ns`` was set as the last rank
        joined."""
        try:
            self.check_intact()
            for task in tasks:
                task()
        except BaseException as exc:
            # Failed or not, the rank's work is not complete when its call returns.
            self.finish(_internal_error(self, exc), held=rank)
            return
        self.finish(None, held=rank)

    def run_inline(self, tasks: list[Task]) -> None:
        """Move the data now, on this thread, then finish: how a controlled schedule completes
        a collective (see Note [Controlled scheduling] in fakepg.schedule)."""
        self.started_ns = time.perf_counter_ns()
        changed = self.changed_error()
        if changed is not None:
            self.finish(changed)
            return
        for task in tasks:
            if self.failed:  # aborted meanwhile: stop moving data
                break
            try:
                task()
            except BaseException as exc:
                self.finish(_internal_error(self, exc))
        self._finish_ok()

    def _submit(self, tasks: list[Task]) -> None:
        changed = self.changed_error()
        if changed is not None:
            self.finish(changed)
            return
        if not tasks:
            self._finish_ok()
            return
        with self._lock:
            self._parts_left = len(tasks)
        for task in tasks:
            self.world.executor.submit(self._wrap(task))

    def _wrap(self, task: Task) -> Task:
        def run() -> None:
            if self.failed:  # an abort or timeout already ended it: stop moving data
                self._part_finished()
                return
            try:
                task()
            except BaseException as exc:
                self.finish(_internal_error(self, exc))
            self._part_finished()

        return run

    def check_intact(self) -> None:
        """Raise :class:`TensorChanged` if a rank changed one of its tensors since it issued
        the collective (see Note [A tensor changed in flight] in fakepg._intact)."""
        change = _intact.first_change(self.issued)
        if change is not None:
            raise TensorChanged(change)

    def changed_error(self) -> ErrorFactory | None:
        """The error for every rank if a rank changed one of its tensors since it issued the
        collective, else None."""
        try:
            self.check_intact()
        except TensorChanged as exc:
            return _internal_error(self, exc)
        return None

    def _part_finished(self) -> None:
        with self._lock:
            self._parts_left -= 1
            last = self._parts_left == 0
        if last:
            self._finish_ok()

    def _finish_ok(self) -> None:
        """Finish once every part has run (their kernels queued, on CUDA)."""
        order = self.stream_order
        if order is not None and not self.failed:
            try:
                order.record_done()
            except BaseException as exc:
                self.finish(_internal_error(self, exc))
                return
        self.finish(None)

    def finish(self, error_for: ErrorFactory | None, *, held: int | None = None) -> bool:
        """End the collective (with an error if ``error_for``); False if it had already ended.

        Each rank's callbacks go to its completion lane; none runs here. ``held``: the rank
        whose work completes later, once its call has returned (see Note [Small collectives
        move on the last rank's thread]); every other rank's completes now.
        """
        completions = self.world.completions
        with self._lock:
            if self.done.is_set():
                return False
            self._error_for = error_for
            if held is not None:
                self._held = held
            # One lock for every lane: collectives reach the lanes in the order they finish.
            with completions.lock:
                now = time.perf_counter_ns()
                self.completed_ns = now
                self.done.set()
                what = self.describe() if self._callbacks else ""
                for rank in self._callbacks:
                    deliver = functools.partial(self._deliver, rank)
                    completions.post_locked(rank, self.levels.get(rank, 0), deliver, what)
                for lane in self.issuer_lanes:
                    completions.collective_finished_locked(lane, now)
        return True

    def completed_for(self, rank: int) -> threading.Event:
        """Set once ``rank``'s work is complete: ``done``, or for a held rank its own."""
        return self._released if rank == self._held else self.done

    def is_complete_for(self, rank: int) -> bool:
        """Whether ``rank``'s work is complete. A held one that is polled completes
        _RELEASE_AFTER_NS after the first poll, on the world's timer (never at once: the
        rank sees it pending at least once)."""
        if rank != self._held or self._released.is_set():
            return self.done.is_set()
        if not self._release_armed:  # a second arming (two threads polling) is harmless
            self._release_armed = True
            try:
                self.world.timer.call_at(time.perf_counter_ns() + _RELEASE_AFTER_NS, self.release)
            except RuntimeError:  # the world is closed: no timer, nothing left to overlap
                self.release()
        return False

    def release(self) -> None:
        """Complete the held rank's work (any thread; idempotent)."""
        self._released.set()

    def add_done_callback(self, rank: int, callback: Callable[[], None]) -> None:
        """Run ``callback`` on rank ``rank``'s completion lane once finished; at once, on this
        thread, if the rank's work is complete and its earlier callbacks were delivered."""
        with self._lock:
            if not self.done.is_set() or rank in self._callbacks:
                self._callbacks.setdefault(rank, []).append(callback)
                return
            if not self.completed_for(rank).is_set():
                # Held: the rank's lane completes it, then runs the callback.
                self._callbacks[rank] = [callback]
                with self.world.completions.lock:
                    deliver = functools.partial(self._deliver, rank)
                    level = self.levels[rank]  # the held rank joined: it has a level
                    self.world.completions.post_locked(rank, level, deliver, self.describe())
                return
        callback()

    def _deliver(self, rank: int) -> None:
        """On rank ``rank``'s lane: complete its work if held, then run its callbacks, those
        added meanwhile included."""
        if rank == self._held:
            self.release()
        with self._lock:
            # Filed before this delivery was posted, and taken by it alone: one delivery is
            # posted per rank whose callbacks are filed (finish, or a held rank's first ask).
            callbacks = self._callbacks.pop(rank)
        for callback in callbacks:
            callback()


def _internal_error(collective: Collective, exc: BaseException) -> ErrorFactory:
    what = collective.describe()

    def make(rank: int) -> BaseException:
        if isinstance(exc, TensorChanged):  # the user's race, not the kernel's failure
            changed = TensorChanged(f"fakepg: {what}: {exc}")
            changed.__cause__ = exc
            return changed
        error = FakePGError(
            f"fakepg: {what} failed while moving data on rank {rank}'s behalf: "
            f"{type(exc).__name__}: {exc}"
        )
        error.__cause__ = exc
        return error

    return make


class Work:
    """One rank's handle on a collective: wait for it, test it, read its result."""

    def __init__(self, collective: Collective, rank: int, outputs: list[Tensor]) -> None:
        self._collective = collective
        self._rank = rank
        self._outputs = outputs

    def wait(self, timeout: float | None = None) -> None:
        """Block until done; raise the collective's error, or a timeout naming missing ranks.

        ``timeout``: seconds (finite, > 0), or None for the world's default. A bad value is
        refused on this rank alone (ValueError, TypeError); the collective goes on.
        """
        c = self._collective
        checked = _args.check_timeout(timeout, "Work.wait", RULES)
        limit = c.world.timeout if checked is None else checked
        if c._held == self._rank and c.done.is_set():
            c.release()  # its data has landed, and its call has returned: complete now
        with c._lock:
            c.waiters += 1
        try:
            scheduler = c.world.scheduler
            if scheduler is not None and not c.done.is_set():
                # A point: wait until a decision completes it (or the schedule lets go).
                scheduler.block(c.done.is_set, "wait", c.describe())
            if not c.completed_for(self._rank).wait(limit):
                c.world._wait_timed_out(c, self._rank, limit)
        finally:
            with c._lock:
                c.waiters -= 1
        error = c.error_for(self._rank)
        if error is not None:
            raise error
        if c.stream_order is not None:  # CUDA: this thread's stream waits, not the host
            c.stream_order.wait_done()

    def is_completed(self) -> bool:
        return self._collective.is_complete_for(self._rank)

    def is_success(self) -> bool:
        """True once completed without error."""
        return self.is_completed() and not self._collective.failed

    def exception(self) -> BaseException | None:
        """The error this rank's ``wait`` raises, or None (also while not yet completed)."""
        return self._collective.error_for(self._rank) if self.is_completed() else None

    def result(self) -> list[Tensor]:
        return list(self._outputs)

    def get_future(self) -> torch.futures.Future[list[Tensor]]:
        """A torch Future that completes with :meth:`result` (or the error) when done, on this
        rank's completion thread (see Note [Completion lanes] in fakepg.completion): its
        ``then`` callbacks run there, in the order the rank's collectives complete."""
        future: torch.futures.Future[list[Tensor]] = torch.futures.Future()

        def complete() -> None:
            error = self._collective.error_for(self._rank)
            if error is not None:
                # torch's stub types the argument as the result type; it takes an exception.
                future.set_exception(error)  # type: ignore[arg-type]
            else:
                if self._collective.stream_order is not None:  # CUDA, as in wait()
                    self._collective.stream_order.wait_done()
                future.set_result(self.result())

        self._collective.add_done_callback(self._rank, complete)
        return future

    # Timings on the perf_counter_ns clock, for overlap checks and traces.

    @property
    def launched_ns(self) -> int:
        """When this rank issued the collective."""
        return self._collective.launched_ns[self._rank]

    @property
    def started_ns(self) -> int | None:
        """When the last rank joined and the collective started (None before that); with a
        network model its transfer may then queue behind earlier collectives."""
        return self._collective.started_ns

    @property
    def completed_ns(self) -> int | None:
        """When the collective finished (None before that)."""
        return self._collective.completed_ns

    @property
    def seq(self) -> int:
        """The collective's sequence number in its group (the k-th collective of each rank);
        for a send or recv, the k-th message of its (source, destination, tag)."""
        return self._collective.seq

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<fakepg.Work {self._collective.describe()} rank={self._rank} {state}>"
