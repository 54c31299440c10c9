"""The replica check: every rank thread meets the others at each optimizer step, and the
last to arrive audits them all (see :mod:`._audit`); the first error stops every rank.

# Guarantees: one check at a time per process (torch's global hooks and the wrappers'
# no_sync are process-wide); enter and exit on one thread, bind/unbind on each rank thread.
# ``_lock`` guards the findings, the counters and the stop state; the records belong to their
# ranks (see :mod:`._record`), the meeting to :class:`._rendezvous.Rendezvous`.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, TextIO

import torch
from torch import nn

from ._audit import Arrival, Audit, Finding, after_step, before_step
from ._record import RankRecord, patched_no_sync, patched_unscale, wrapper_types
from ._rendezvous import Rendezvous, RendezvousBroken

__all__ = ["DIVERGED_EXIT_CODE", "RanksDiverged", "ReplicaCheck"]

DIVERGED_EXIT_CODE = 3  # a launch whose ranks diverged (1: a rank failed; 2: bad arguments)

_ACTIVE = threading.Lock()  # held while a check is installed
_STALL_GRACE_S = 1.0  # how long a stall must persist before it is reported
_TORCH_DIR = os.path.join(os.path.dirname(torch.__file__), "")
_HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "")


class RanksDiverged(SystemExit):
    """Raised on every rank when the check stops a run whose ranks diverged.

    A SystemExit with code :data:`DIVERGED_EXIT_CODE`, so that a training loop's ``except
    Exception`` does not swallow it and a launch reports it as the exit of the ranks.
    """

    def __init__(self, message: str) -> None:
        super().__init__(DIVERGED_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ReplicaCheck:
    """Audit the data-parallel invariants of rank threads at every optimizer step.

    Use as a context manager around the run of ``world_size`` rank threads; each rank thread
    calls :meth:`bind` with its rank before training (``python -m reducer launch`` and
    :func:`run_checked` do) and :meth:`rank_ended` when it ends. ``world``: the fakepg world
    the ranks run on (its collectives are counted and a stuck rank is woken through it);
    ``stop``: raise :class:`RanksDiverged` on every rank at the first divergence (else report
    and go on); ``out``: where findings and the summary are written (default: the stderr of
    the moment the check is entered).
    """

    def __init__(
        self,
        world_size: int,
        *,
        world: Any = None,
        timeout: float = 60.0,
        stop: bool = True,
        out: TextIO | None = None,
    ) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"ReplicaCheck: world_size must be an int >= 1, got {world_size!r}")
        if world is not None and getattr(world, "world_size", None) != world_size:
            raise ValueError(
                f"ReplicaCheck: world has {getattr(world, 'world_size', '?')} ranks, not "
                f"{world_size}; pass the world the ranks run on"
            )
        self.world_size = world_size
        self.world = world
        self.stop = stop
        self._out = out
        self.records = [RankRecord(r) for r in range(world_size)]
        # A little longer than the world's own timeout: a rank stuck in a collective is
        # reported by the world (which names the collective) before the meeting gives up.
        wait = (world.timeout + 5.0) if world is not None else timeout
        aborted: Callable[[], bool] = (
            (lambda: bool(world.aborted)) if world is not None else (lambda: False)
        )
        self._meeting: Rendezvous[Arrival, Audit] = Rendezvous(
            world_size, timeout=wait, aborted=aborted
        )
        self._local = threading.local()
        self._lock = threading.Lock()
        self.findings: list[Finding] = []
        self.results: list[Any] | None = None  # the ranks' results (see run_checked)
        self._keys: set[tuple[str, str]] = set()
        self.steps = 0
        self.compared = 0
        self.sharded = 0
        self.ignored = 0  # parameters a wrapper was told to ignore (not compared)
        self.stopped = False  # the check ended the run (every rank got RanksDiverged)
        self._broken = False  # the ranks can no longer meet: nothing more is checked
        self._stall_since: float | None = None
        self._undo: list[Callable[[], None]] = []
        self._entered = False

    # ---------------------------------------------------------------------------------------
    # Installing.

    def __enter__(self) -> ReplicaCheck:
        if not _ACTIVE.acquire(blocking=False):
            raise RuntimeError("ReplicaCheck: another check is running in this process")
        try:
            self._install()
        except BaseException:
            _ACTIVE.release()
            raise
        self._entered = True
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            while self._undo:
                self._undo.pop()()
            for record in self.records:
                record.remove_hooks()
        finally:
            self._entered = False
            _ACTIVE.release()

    def _install(self) -> None:
        from torch.nn.modules import module as _module
        from torch.optim import optimizer as _optimizer

        if self._out is None:
            self._out = sys.stderr
        wrappers = wrapper_types()
        current = self._current

        def on_forward(module: nn.Module, args: Any) -> None:
            record = current()
            if record is not None:
                record.on_forward(module, wrappers)

        self._undo.append(_module.register_module_forward_pre_hook(on_forward).remove)
        self._undo.append(_optimizer.register_optimizer_step_pre_hook(self._before).remove)
        self._undo.append(_optimizer.register_optimizer_step_post_hook(self._after).remove)
        for patch in (patched_no_sync(wrappers, current), patched_unscale(current)):
            patch.__enter__()
            self._undo.append(_closer(patch))
        if self.world is not None:
            records = self.records

            def on_collective(
                rank: int, kind: str, members: tuple[int, ...], tensors: Any, nbytes: int
            ) -> None:
                records[rank].on_collective(kind, members, tensors, nbytes)

            self._undo.append(self.world.observe(on_collective))

    # ---------------------------------------------------------------------------------------
    # The rank threads.

    def bind(self, rank: int) -> None:
        """The calling thread is rank ``rank`` (until :meth:`unbind`)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"ReplicaCheck.bind: rank {rank} is not in [0, {self.world_size})")
        self._local.rank = rank

    def unbind(self) -> None:
        self._local.rank = None

    def rank_ended(self, rank: int) -> None:
        """Rank ``rank``'s thread ended: ranks waiting for it at a step stop waiting."""
        steps = self.records[rank].steps
        self._meeting.ended(rank, f"{steps} optimizer step{'s' if steps != 1 else ''}")

    def _current(self) -> RankRecord | None:
        rank = getattr(self._local, "rank", None)
        return None if rank is None else self.records[rank]

    def _before(
        self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any
    ) -> tuple[Any, Any] | None:
        record = self._current()
        if record is None or self._broken:
            return None
        if record.stepping is not None and record.stepping != id(optimizer):
            return None  # See Note [Optimizers inside optimizers].
        record.stepping = id(optimizer)
        step = record.steps
        record.steps += 1
        line = _caller_line()
        closure, args, kwargs = _closure_of(args, kwargs)
        if closure is None:
            self._meet(
                ("before", step), self._arrival(record, optimizer, step, line), self._judge_before
            )
            return None
        # See Note [Steps that take a closure].
        record.pending_before = (step, line)

        def judged_closure() -> Any:
            result = closure()
            self._judge_pending(record, optimizer)
            return result

        if len(args) > 1:
            return (args[0], judged_closure, *args[2:]), kwargs
        return args, {**kwargs, "closure": judged_closure}

    def _judge_pending(self, record: RankRecord, optimizer: torch.optim.Optimizer) -> None:
        """The "before" meeting of a step whose closure computed its gradients, once."""
        pending, record.pending_before = record.pending_before, None
        if pending is None or self._broken:
            return
        step, line = pending
        self._meet(
            ("before", step), self._arrival(record, optimizer, step, line), self._judge_before
        )

    # Note [Steps that take a closure]
    # optimizer.step(closure) runs the closure inside the step: LBFGS, and every Lightning
    # training step (its precision plugin passes training_step and backward as the closure).
    # There the step's pre-hook sees the gradients of before the closure (the previous step's,
    # or an unsynced micro-batch's under gradient accumulation), not the ones the step uses.
    # So the step's arguments get a closure that, on its first call, meets the other ranks
    # with the gradients the closure left; a step that never calls its closure meets in the
    # post-hook, before the "after" meeting. The line named is still the step's caller.

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        record = self._current()
        if record is None or self._broken or record.stepping != id(optimizer):
            return
        self._judge_pending(record, optimizer)
        record.stepping = None
        step = record.steps - 1
        arrival = self._arrival(record, optimizer, step)
        self._meet(("after", step), arrival, self._judge_after)
        record.reset()

    # Note [Optimizers inside optimizers]
    # A sharded optimizer (ZeroRedundancyOptimizer) steps an inner optimizer over this rank's
    # shard inside its own step, then broadcasts each shard from its owner: the inner
    # optimizers hold different parameters per rank (of the same shapes, for equal blocks), so
    # comparing them by position would report a divergence that is not one. The step that
    # counts is the outermost: an optimizer's step inside another's on the same rank is not
    # checked. The same optimizer stepping again is a new step (its last one raised).

    def _arrival(
        self,
        record: RankRecord,
        optimizer: torch.optim.Optimizer,
        step: int,
        line: str | None = None,
    ) -> Arrival:
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        params, ignored = record.compared(stepped)
        return Arrival(record.rank, step, line or _caller_line(), params, record, ignored)

    def _meet(
        self, key: tuple[str, int], arrival: Arrival, judge: Callable[[list[Arrival]], Audit]
    ) -> None:
        where = f"optimizer step {arrival.step} ({arrival.line})"
        try:
            audit = self._meeting.meet(key, arrival.rank, arrival, judge, self._stall, where)
        except RendezvousBroken as exc:
            self._broken_meeting(exc, arrival)
            return
        errors = [f for f in audit.findings if f.level == "error"]
        if errors and self.stop:
            self._broken = True
            raise RanksDiverged(errors[0].text)

    def _broken_meeting(self, exc: RendezvousBroken, arrival: Arrival) -> None:
        self._broken = True
        if exc.kind in ("ended", "stall") and self._joining():
            text = (
                f"ranks reached optimizer step {arrival.step} unevenly under a wrapper's "
                "join() (uneven inputs: the ranks that ran out shadow the others' "
                "reductions): they step a different number of times by design; not checked "
                "from this step on."
            )
            self._add([Finding("note", arrival.step, "uneven inputs", text, "join")])
            return
        if exc.kind in ("ended", "stall"):
            title = (
                "ranks stepped differently" if exc.kind == "ended" else "only some ranks reduced"
            )
            finding = Finding("error", arrival.step, title, str(exc), exc.kind)
            self._add([finding])
            if self.stop or exc.kind == "stall":
                with self._lock:
                    self.stopped = True
                if exc.kind == "stall" and self.world is not None:
                    # The missing ranks wait in a collective that only the arrived ones could
                    # complete: the world's abort wakes them.
                    self.world.abort(RanksDiverged(str(exc)))
                raise RanksDiverged(str(exc)) from None
            return
        if exc.kind == "aborted":
            import fakepg

            # What a rank blocked in a collective would get: the failure is elsewhere.
            raise fakepg.WorldAborted(
                f"the replica check stopped waiting at optimizer step {arrival.step} "
                f"({arrival.line}) on rank {arrival.rank}: {exc}. Look at the first failure; "
                "this one is a consequence."
            ) from None
        raise RuntimeError(f"replica check: {exc}") from None

    def _joining(self) -> bool:
        """Whether a wrapper ran its forward inside its ``join()`` context since the last
        step, on some rank (torch's DDP and this project's both keep ``_join_config``)."""
        return any(
            getattr(getattr(f.wrapper, "_join_config", None), "enable", False)
            for record in self.records
            for f in list(record.forwards)
        )

    # ---------------------------------------------------------------------------------------
    # The judge (on the last rank to arrive, while the others wait).

    def _judge_before(self, arrivals: list[Arrival]) -> Audit:
        audit = before_step(arrivals)
        with self._lock:
            self.steps += 1
            self.compared = max(self.compared, audit.compared)
            self.sharded = max(self.sharded, audit.sharded)
            self.ignored = max(self.ignored, audit.ignored)
        self._add(audit.findings)
        return audit

    def _judge_after(self, arrivals: list[Arrival]) -> Audit:
        audit = after_step(arrivals)
        self._add(audit.findings)
        return audit

    def _add(self, findings: list[Finding]) -> None:
        shown = []
        with self._lock:
            for finding in findings:
                key = (finding.level, f"{finding.title}:{finding.key}")
                if key in self._keys:
                    continue
                self._keys.add(key)
                self.findings.append(finding)
                shown.append(finding)
                if finding.level == "error" and self.stop:
                    self.stopped = True
        for finding in shown:
            self._print(f"{finding.level.upper()}: {finding.text}")

    def _stall(self, arrived: dict[int, Arrival]) -> str | None:
        """The ranks still missing wait in a collective of the whole world that the arrived
        ranks have not issued (they issued fewer since the last step): they would only issue
        it after the step, so nobody can move. Reported once it has lasted a moment (a rank
        may be about to wait on an asynchronous one and arrive)."""
        everyone = tuple(range(self.world_size))

        def issued(rank: int) -> int:
            return sum(1 for c in self.records[rank].collectives if c.members == everyone)

        counts = {r: issued(r) for r in range(self.world_size)}
        most = max(counts[r] for r in arrived)
        ahead = sorted(r for r in everyone if r not in arrived and counts[r] > most)
        now = time.monotonic()
        if not ahead:
            self._stall_since = None
            return None
        if self._stall_since is None:
            self._stall_since = now
        if now - self._stall_since < _STALL_GRACE_S:
            return None
        first = arrived[min(arrived)]
        lines = [
            f"only some ranks reduced before optimizer step {first.step} ({first.line}): ranks "
            f"{sorted(arrived)} reached the step after {most} collective(s) since the last "
            f"step; ranks {ahead} issued more and wait in one that the others would only "
            "issue after the step. What each rank's wrappers did since the last step:"
        ]
        for rank in everyone:
            forwards = self.records[rank].forwards
            synced = sum(1 for f in forwards if f.synced)
            why = sorted({f.why_not for f in forwards if f.why_not})
            rest = f", {len(forwards) - synced} not ({', '.join(why)})" if why else ""
            lines.append(
                f"    rank {rank}: {synced} synced forward(s){rest}, {counts[rank]} collective(s)"
            )
        lines.append("  Every rank must reduce on the same micro-steps.")
        return "\n".join(lines)

    # ---------------------------------------------------------------------------------------
    # Reporting.

    def _print(self, text: str) -> None:
        out = self._out or sys.stderr
        lines = text.split("\n")
        out.write("".join(f"[check] {line}\n" for line in lines))
        out.flush()

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def diverged(self) -> bool:
        """Whether the ranks diverged (or a reduction was wrong) anywhere."""
        return bool(self.errors)

    def exit_code(self, launch_code: int) -> int:
        """The launch's exit code with the check's verdict: :data:`DIVERGED_EXIT_CODE` when
        the ranks diverged, else ``launch_code``."""
        return DIVERGED_EXIT_CODE if self.diverged else launch_code

    def summary(self) -> str:
        """Steps and parameters checked, reductions per step, the verdict."""
        ranks = f"{self.world_size} rank{'s' if self.world_size != 1 else ''}"
        lines = [
            f"replica check: {self.steps} optimizer step(s) on {ranks}, "
            f"{self.compared} parameter(s) compared bitwise per step"
            + (f" ({self.sharded} sharded, not replicas)" if self.sharded else "")
            + (f" ({self.ignored} ignored by the wrapper, not compared)" if self.ignored else "")
        ]
        per_step = self.records[0].reductions
        if self.world is not None and per_step:
            counts = [c for c, _ in per_step]
            nbytes = sum(b for _, b in per_step) / len(per_step)
            span = (
                f"{min(counts)}"
                if min(counts) == max(counts)
                else f"{min(counts)} to {max(counts)}"
            )
            lines.append(
                f"reductions per optimizer step (rank 0): {span}, {_size(nbytes)} on average"
            )
        warnings = [f for f in self.findings if f.level == "warning"]
        notes = [f for f in self.findings if f.level == "note"]
        if warnings or notes:
            lines.append(f"{len(warnings)} warning(s), {len(notes)} note(s) (above)")
        errors = self.errors
        if errors:
            first = errors[0]
            lines.append(
                f"verdict: RANKS DIVERGED at optimizer step {first.step} ({first.title}); "
                f"exit code {DIVERGED_EXIT_CODE}"
            )
        elif self.steps == 0:
            lines.append("verdict: no optimizer step ran on the ranks: nothing was checked")
        else:
            lines.append("verdict: the ranks stayed in sync")
        return "\n".join(lines)

    def print_summary(self) -> None:
        self._print(self.summary())


def _closer(patch: AbstractContextManager[None]) -> Callable[[], None]:
    def close() -> None:
        patch.__exit__(None, None, None)

    return close


def _closure_of(args: Any, kwargs: Any) -> tuple[Callable[[], Any] | None, Any, Any]:
    """The closure given to ``optimizer.step``: its first argument after the optimizer
    (torch's step hooks see ``args`` with the optimizer first) or ``closure=``."""
    args, kwargs = tuple(args), dict(kwargs)
    if len(args) > 1 and callable(args[1]):
        return args[1], args, kwargs
    closure = kwargs.get("closure")
    return (closure if callable(closure) else None), args, kwargs


def _caller_line() -> str:
    """``file:line`` of the innermost frame outside torch and this package: the script's
    call of ``optimizer.step()``."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith((_TORCH_DIR, _HERE)) and not filename.endswith(
            os.path.join("", "contextlib.py")
        ):
            return f"{_short(filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@functools.lru_cache(maxsize=256)
def _short(filename: str) -> str:
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd()))
    except ValueError:
        return filename


def _size(nbytes: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000
    return f"{nbytes:.1f} GB"
