"""A rank's thread-local state, lent to the threads that run code on its behalf.

A rank of the fake world is a thread, and much of what makes it that rank lives in
thread-locals: torch.distributed's default group and group state (see Note [Per-thread
torch.distributed state] in fakepg.torch_backend), the rank's random generator (see Note
[Per-rank generators] in fakepg.rng). Its done-callbacks run on other threads, its
completion lanes (see Note [Completion lanes] in fakepg.completion). See Note [Callbacks run
in their rank].

# Guarantees: ``register`` is called at import of the modules that own such state; ``home``
# on a rank's own thread; a Home's ``lent`` on any thread, for the duration of one callback.

# Note [Callbacks run in their rank]
# In a gloo process, a future's callback (a comm hook's then(), a work's done-callback) runs
# on a thread of that process, where dist.get_rank(), get_world_size(), the default group,
# dist.* collectives and torch's default generator are the process's. Here the lane's
# thread would see none of the rank's state: "Default process group has not been
# initialized", or another stream of random numbers. So each rank's thread takes a Home when
# its run starts (the state objects themselves, which init_process_group later fills in),
# and a lane runs each callback with its rank's home lent to it, then puts its own back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager

__all__: list[str] = []

# Lender: called on a rank's thread; returns what lends that thread's state to another
# thread (a context manager factory), or None where it has nothing to lend.
Lender = Callable[[], Callable[[], AbstractContextManager[None]] | None]

_lock = threading.Lock()  # guards _lenders (appended at import, read at each home)
_lenders: list[Lender] = []


def register(lender: Lender) -> None:
    """A kind of per-rank thread-local state, lent to callbacks from now on."""
    with _lock:
        if lender not in _lenders:
            _lenders.append(lender)


class Home:
    """What a rank's thread lends to the threads that run its callbacks."""

    def __init__(self, lends: list[Callable[[], AbstractContextManager[None]]]) -> None:
        self._lends = lends

    @contextmanager
    def lent(self) -> Iterator[None]:
        """The calling thread runs as the rank, until the block ends."""
        with ExitStack() as stack:
            for lend in self._lends:
                stack.enter_context(lend())
            yield


def home() -> Home:
    """On a rank's thread: its state, to lend."""
    with _lock:
        lenders = list(_lenders)
    lends = [lend for lend in (lender() for lender in lenders) if lend is not None]
    return Home(lends)
