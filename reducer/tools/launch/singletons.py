"""Process-wide state that rank threads would share: made per rank, or refused with what to do.

Some libraries keep one state per process by design. Accelerate's ``PartialState``,
``AcceleratorState`` and ``GradientState`` (behind ``Accelerator``) share their fields across
every instance (a class-level dict, ``_shared_state``): on rank threads, every rank would see
the first rank's process index, device and group. While a launch runs, the classes listed in
``PER_RANK`` get a dict per rank in that attribute instead (a descriptor, as Accelerate's own
``ThreadLocalSharedDict`` for XLA's threads, keyed by rank), so each rank has its own state.
What cannot work on threads (``KNOWN``: engines that own a process each) is refused by name:
their constructors raise :class:`SharedStateError` on rank threads, saying why and what to do.
Classes are changed as soon as their module is imported (by the script, or by a library on its
behalf), and put back when the launch ends.

# Guarantees: install() and the restore it returns run on the launching thread. The import
# hook, the wrapped constructors and the per-rank dicts are safe from any thread; _lock
# guards the changes.
"""

from __future__ import annotations

import builtins
import functools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import children

__all__: list[str] = []


class SharedStateError(RuntimeError):
    """A rank thread constructed an object whose state is one per process."""


@dataclass(frozen=True, slots=True)
class Singleton:
    """Classes of ``module`` whose instances share one state per process."""

    module: str
    classes: tuple[str, ...]
    what: str  # how the message names it
    instead: str  # what to do


KNOWN = (
    Singleton(
        "accelerate.utils.dataclasses",
        ("DeepSpeedPlugin", "MegatronLMPlugin"),
        "Accelerate's DeepSpeed and Megatron-LM plugins (their engines)",
        "Run this script with `accelerate launch` or torchrun (a process per rank), or drop "
        "the plugin for the launch: Accelerate's own data parallelism (DDP) and FSDP2 work on "
        "rank threads.",
    ),
)


@dataclass(frozen=True, slots=True)
class PerRank:
    """Classes of ``module`` whose class-level dict ``attribute`` is every instance's state:
    one per rank thread while a launch runs."""

    module: str
    classes: tuple[str, ...]
    attribute: str = "_shared_state"


PER_RANK = (PerRank("accelerate.state", ("PartialState", "AcceleratorState", "GradientState")),)


class PerRankState:
    """A class attribute that is a dict of each rank's own (a data descriptor: the class's and
    its instances' reads give the calling rank's dict; an instance's assignment replaces it).

    Keyed by the rank of the calling thread, not by the thread: a rank's thread is one kept
    between jobs (fakepg._threads), so a rank that ends before the next one starts hands its
    thread on, and a thread-local dict would hand on its state with it (the next rank found
    itself set up, with the first rank's index). A thread that is no rank's (the launching
    thread, a thread the fake world runs) has a dict of its own."""

    def __init__(self, rank_of_thread: Callable[[], int | None]) -> None:
        self._rank_of_thread = rank_of_thread
        self._by_rank: dict[int, dict[str, Any]] = {}  # a dict's item operations are atomic
        self._elsewhere = threading.local()

    def _storage(self) -> dict[str, Any]:
        rank = self._rank_of_thread()
        if rank is None:
            storage: dict[str, Any] | None = getattr(self._elsewhere, "storage", None)
            if storage is None:
                storage = self._elsewhere.storage = {}
            return storage
        # setdefault: one dict per rank even if two threads of a rank read at once.
        return self._by_rank.setdefault(rank, {})

    def __get__(self, obj: object, objtype: type | None = None) -> dict[str, Any]:
        return self._storage()

    def __set__(self, obj: object, value: dict[str, Any]) -> None:
        rank = self._rank_of_thread()
        if rank is None:
            self._elsewhere.storage = value
        else:
            self._by_rank[rank] = value


def _initializing(module: object) -> bool:
    """Whether ``module`` is still running its body (its classes may not exist yet)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def message(singleton: Singleton, name: str, rank: int, nproc: int) -> str:
    return (
        f"{singleton.module}.{name} on rank {rank}: {singleton.what} keeps one state per "
        f"process, shared by every instance, and the {nproc} ranks of `python -m reducer "
        "launch` are threads of one process: every rank would share the first rank's process "
        f"index, device and process group. It does not work on rank threads. {singleton.instead}"
    )


def install(
    rank_of_thread: Callable[[], int | None],
    nproc: int,
    known: tuple[Singleton, ...] = KNOWN,
    per_rank: tuple[PerRank, ...] = PER_RANK,
) -> Callable[[], None]:
    """Refuse ``known`` on rank threads (``rank_of_thread()`` is not None), and give the
    classes of ``per_rank`` a state per rank, until the returned function is called."""
    lock = threading.Lock()  # guards wrapped and pending: each class is changed once
    wrapped: list[tuple[type, Any]] = []  # (class, its own __init__ or None) to put back
    states: list[tuple[type, str, Any]] = []  # (class, attribute, its dict) to put back
    # The classes not changed yet. A module being imported is in sys.modules before its
    # classes exist (an import inside it runs the check too): each class is changed when seen.
    pending: set[tuple[Singleton | PerRank, str]] = set()
    kinds: list[Singleton | PerRank] = [*known, *per_rank]
    for kind in kinds:
        pending.update((kind, name) for name in kind.classes)
    # The modules of the pending classes, and of those the module object found complete
    # without them (another version, a stand-in): an import statement checks again only where
    # one of these modules is in sys.modules as another object (a few dict lookups; every
    # import statement on the training path pays them).
    awaited: set[str] = {kind.module for kind, _ in pending}
    checked: dict[str, int] = {}

    def wrap(singleton: Singleton, name: str, cls: type) -> None:
        original = cls.__dict__.get("__init__", object.__init__)

        @functools.wraps(original)
        def refusing(self: Any, *args: Any, **kwargs: Any) -> None:
            rank = rank_of_thread()
            if rank is not None:
                raise SharedStateError(message(singleton, name, rank, nproc))
            original(self, *args, **kwargs)

        wrapped.append((cls, cls.__dict__.get("__init__")))
        cls.__init__ = refusing  # type: ignore[misc]

    def per_thread(kind: PerRank, cls: type) -> None:
        original = cls.__dict__.get(kind.attribute)
        if not isinstance(original, dict):
            return  # not the pattern (or already per thread, as on XLA): left as it is
        states.append((cls, kind.attribute, original))
        setattr(cls, kind.attribute, PerRankState(rank_of_thread))

    def check() -> None:
        with lock:
            for singleton, name in list(pending):
                module = sys.modules.get(singleton.module)
                cls = getattr(module, name, None) if module is not None else None
                if isinstance(cls, type):
                    pending.discard((singleton, name))
                    if isinstance(singleton, PerRank):
                        per_thread(singleton, cls)
                    else:
                        wrap(singleton, name, cls)
                elif module is not None and not _initializing(module):
                    checked[singleton.module] = id(module)  # complete without it
            awaited.intersection_update(kind.module for kind, _ in pending)

    def changed() -> bool:
        for name in awaited:
            module = sys.modules.get(name)
            if module is not None and id(module) != checked.get(name):
                return True
        return False

    real_import = builtins.__import__

    # A module may be imported at any time, by any statement (a library's own imports too):
    # every import statement checks, after it, whether a known module has appeared.
    def import_and_check(*args: Any, **kwargs: Any) -> Any:
        module = real_import(*args, **kwargs)
        if awaited and changed():
            check()
        return module

    check()
    builtins.__import__ = import_and_check

    def in_child() -> None:
        # A forked child is a process of its own: the import hook goes (its lock may have been
        # held by a thread the child lacks); the forking rank's state stays its state.
        builtins.__import__ = real_import

    remove_hook = children.in_forked_child(in_child)

    def restore() -> None:
        remove_hook()
        builtins.__import__ = real_import
        with lock:
            for cls, init in reversed(wrapped):
                if init is None:
                    del cls.__init__
                else:
                    cls.__init__ = init
            wrapped.clear()
            for cls, attribute, original in reversed(states):
                setattr(cls, attribute, original)
            states.clear()

    return restore
