"""A meeting point of the rank threads at each optimizer step, where one thread sees them all.

Every rank arrives at round ``key`` with its data; the last to arrive calls ``judge`` on all the
ranks' data (in rank order) while the others wait, and every rank gets the verdict. A rank that
waits is woken, with an error that says why, when the wait passes its deadline, when the
world is aborted (another rank failed), when a rank that has not arrived ended, or when
``stall`` finds that the ranks still missing can never arrive (they wait in a collective that
only the arrived ranks could complete, after the step).

# Guarantees: safe from any thread. ``_cond`` guards every field; judge and stall run without
# it (judge on the last arriver's thread while the others wait for its verdict).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

__all__: list[str] = []

D = TypeVar("D")
R = TypeVar("R")

_POLL_S = 0.05  # how often a waiting rank looks at the world (abort, ended ranks, stalls)


class RendezvousBroken(RuntimeError):
    """The ranks cannot all meet at this round (see the message); raised on every waiter.

    ``kind``: "aborted" (the world failed), "ended" (a rank ended first), "timeout", "stall"
    (see :meth:`Rendezvous.meet`) or "judge" (the judge raised).
    """

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(slots=True)
class _Round(Generic[D, R]):
    arrived: dict[int, D] = field(default_factory=dict)
    judging: bool = False
    done: bool = False
    verdict: Any = None
    error: BaseException | None = None


class Rendezvous(Generic[D, R]):
    """See the module's docstring. ``aborted`` says whether the world has failed."""

    def __init__(
        self, world_size: int, *, timeout: float, aborted: Callable[[], bool] = lambda: False
    ) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self._aborted = aborted
        self._cond = threading.Condition()
        self._rounds: dict[Hashable, _Round[D, R]] = {}
        self._ended: dict[int, str] = {}  # rank -> what it had done when it ended

    def ended(self, rank: int, what: str) -> None:
        """``rank`` will arrive nowhere any more (its thread ended); ``what`` it had done."""
        with self._cond:
            self._ended[rank] = what
            self._cond.notify_all()

    def meet(
        self,
        key: Hashable,
        rank: int,
        data: D,
        judge: Callable[[list[D]], R],
        stall: Callable[[dict[int, D]], str | None],
        describe: str,
    ) -> R:
        """Arrive at round ``key``; the verdict of ``judge`` on every rank's data."""
        with self._cond:
            rnd = self._rounds.setdefault(key, _Round())
            rnd.arrived[rank] = data
            last = len(rnd.arrived) == self.world_size and not rnd.done
            if last:
                rnd.judging = True
        if last:
            try:
                verdict = judge([rnd.arrived[r] for r in range(self.world_size)])
            except BaseException as exc:
                self._finish(key, rnd, error=RendezvousBroken(f"the check failed: {exc}", "judge"))
                raise
            self._finish(key, rnd, verdict=verdict)
            return verdict
        return self._wait(key, rnd, rank, stall, describe)

    def _finish(
        self,
        key: Hashable,
        rnd: _Round[D, R],
        *,
        verdict: Any = None,
        error: BaseException | None = None,
    ) -> None:
        with self._cond:
            if rnd.done:
                return
            rnd.done, rnd.verdict, rnd.error = True, verdict, error
            self._rounds.pop(key, None)
            self._cond.notify_all()

    def _wait(
        self,
        key: Hashable,
        rnd: _Round[D, R],
        rank: int,
        stall: Callable[[dict[int, D]], str | None],
        describe: str,
    ) -> R:
        deadline = time.monotonic() + self.timeout
        while True:
            with self._cond:
                if not rnd.done:
                    self._cond.wait(_POLL_S)
                if rnd.done:
                    if rnd.error is not None:
                        raise rnd.error
                    return rnd.verdict  # type: ignore[no-any-return]
                judging = rnd.judging
                arrived = dict(rnd.arrived)
                gone = {r: w for r, w in self._ended.items() if r not in arrived}
            if judging:
                continue  # the last arriver is judging: its verdict comes soon
            missing = sorted(set(range(self.world_size)) - set(arrived))
            reason, kind = None, ""
            if self._aborted():
                reason, kind = "the world was aborted (a rank failed)", "aborted"
            elif gone:
                parts = [f"rank {r} ended after {w}" for r, w in sorted(gone.items())]
                reason = f"{'; '.join(parts)}, while ranks {sorted(arrived)} reached {describe}"
                kind = "ended"
            elif time.monotonic() > deadline:
                reason = (
                    f"rank {rank} waited {self.timeout:g} s at {describe} for ranks {missing}, "
                    "which never reached it"
                )
                kind = "timeout"
            else:
                reason, kind = stall(arrived), "stall"
            if reason is not None:
                self._finish(key, rnd, error=RendezvousBroken(reason, kind))
