"""Process-wide state that rank threads would share: refused on them, with what to do instead.

Some libraries keep one state per process by design. Accelerate's ``PartialState`` and
``AcceleratorState`` (behind ``Accelerator``) share their fields across every instance (a
class-level dict): on rank threads, every rank would see the first rank's process index,
device and group, and the script fails far from the cause (an AttributeError), or trains
wrong. While a launch runs, the constructors of the classes listed in ``KNOWN`` raise
:class:`SharedStateError` on rank threads, saying so; they are wrapped as soon as their module
is imported (by the script, or by a library on its behalf), and put back when the launch ends.

# Guarantees: install() and the restore it returns run on the launching thread. The import
# hook and the wrapped constructors are safe from any thread; _lock guards the wrapping.
"""

from __future__ import annotations

import builtins
import functools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
        "accelerate.state",
        ("PartialState", "AcceleratorState"),
        "Accelerate (Accelerator, and the AcceleratorState / PartialState behind it)",
        "Run this script with `accelerate launch` or torchrun (a process per rank). On rank "
        "threads, use torch.distributed directly (torch's DistributedDataParallel, FSDP2, "
        "reducer.DistributedDataParallel) or Lightning's Trainer, which work unmodified.",
    ),
)


def message(singleton: Singleton, name: str, rank: int, nproc: int) -> str:
    return (
        f"{singleton.module}.{name} on rank {rank}: {singleton.what} keeps one state per "
        f"process, shared by every instance, and the {nproc} ranks of `python -m reducer "
        "launch` are threads of one process: every rank would share the first rank's process "
        f"index, device and process group. It does not work on rank threads. {singleton.instead}"
    )


def install(
    rank_of_thread: Callable[[], int | None], nproc: int, known: tuple[Singleton, ...] = KNOWN
) -> Callable[[], None]:
    """Refuse ``known`` on rank threads (``rank_of_thread()`` is not None) until the returned
    function is called."""
    lock = threading.Lock()  # guards wrapped and pending: each class is wrapped once
    wrapped: list[tuple[type, Any]] = []  # (class, its own __init__ or None) to put back
    # The classes not wrapped yet. A module being imported is in sys.modules before its
    # classes exist (an import inside it runs the check too): each class is wrapped when seen.
    pending = {(singleton, name) for singleton in known for name in singleton.classes}

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

    def check() -> None:
        with lock:
            for singleton, name in list(pending):
                module = sys.modules.get(singleton.module)
                cls = getattr(module, name, None) if module is not None else None
                if isinstance(cls, type):
                    pending.discard((singleton, name))
                    wrap(singleton, name, cls)

    real_import = builtins.__import__

    # A module may be imported at any time, by any statement (a library's own imports too):
    # every import statement checks, after it, whether a known module has appeared.
    def import_and_check(*args: Any, **kwargs: Any) -> Any:
        module = real_import(*args, **kwargs)
        if pending:
            check()
        return module

    check()
    builtins.__import__ = import_and_check

    def restore() -> None:
        builtins.__import__ = real_import
        with lock:
            for cls, init in reversed(wrapped):
                if init is None:
                    del cls.__init__
                else:
                    cls.__init__ = init
            wrapped.clear()

    return restore
