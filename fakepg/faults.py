"""What can go wrong in a fake world, as exceptions a user can act on.

Every error names the collective (kind, op, sequence number) and the ranks concerned, and says
what usually causes it. All derive from :class:`FakePGError`, a ``RuntimeError``; the timeout
also derives from ``TimeoutError`` so ``except TimeoutError`` works as with real backends.
"""

from __future__ import annotations

import ctypes

from ._threads import Runner

__all__ = [
    "CollectiveMismatch",
    "CollectiveTimeout",
    "FakePGError",
    "RankExited",
    "TensorChanged",
    "WorldAborted",
]


class FakePGError(RuntimeError):
    """Base of every error the fake world raises from a collective."""


class CollectiveTimeout(FakePGError, TimeoutError):
    """A ``Work.wait`` passed its timeout; the message names the ranks that never joined."""


class CollectiveMismatch(FakePGError):
    """Ranks issued different collectives under one sequence number (a desync)."""


class TensorChanged(FakePGError):
    """A rank resized, freed or replaced a tensor of a collective before its work completed
    (see Note [A tensor changed in flight] in fakepg._intact); raised on every rank."""


class WorldAborted(FakePGError):
    """The world was aborted, usually because a rank failed; the message names it."""


class RankExited(FakePGError):
    """A rank finished its function without issuing a collective its peers are waiting in."""


def format_ranks(ranks: list[int] | set[int] | range) -> str:
    """``[1, 3]`` -> ``"ranks 1, 3"``; ``[2]`` -> ``"rank 2"``."""
    ordered = sorted(ranks)
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    return "ranks " + ", ".join(str(r) for r in ordered)


def interrupt_thread(thread: Runner, exc_type: type[BaseException]) -> bool:
    """Ask ``thread`` to raise ``exc_type`` at its next Python bytecode; True if delivered.

    CPython's ``PyThreadState_SetAsyncExc`` is the only way to cancel a rank that is busy in
    Python code and never reaches a collective (where it would be woken by the abort). It does
    not interrupt a blocking C call; the caller must still bound its join.
    """
    ident = thread.ident
    if ident is None or not thread.is_alive():
        return False
    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    delivered = int(set_async_exc(ctypes.c_ulong(ident), ctypes.py_object(exc_type)))
    if delivered > 1:  # more than one thread state matched: undo, as the C API docs require
        set_async_exc(ctypes.c_ulong(ident), None)
        return False
    return delivered == 1
