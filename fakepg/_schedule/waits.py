"""Waits that are scheduling points on a controlled thread and plain waits elsewhere: a
``threading.Event`` the world waits on, and any torch future's Python-level ``wait``."""

from __future__ import annotations

import threading
from typing import Any

import torch

from .scheduler import current_scheduler


def wait_event(event: threading.Event, timeout: float, what: str) -> bool:
    """``event.wait(timeout)``, as a scheduling point on a controlled thread."""
    sched = current_scheduler()
    if sched is not None and not event.is_set():
        sched.block(event.is_set, "wait", what)
    return event.wait(timeout)


# torch.futures.Future is a Python subclass of torch._C.Future; then() returns the C++ type
# itself: the wait is patched on the C++ type, which covers both.
_installed = False
_install_lock = threading.Lock()


def install_future_wait() -> None:
    """Make a Python-level wait on any torch future (``fut.wait()``, on the futures ``then``
    returns too) a scheduling point on controlled threads, and nothing else anywhere else.
    Process-wide and permanent; idempotent."""
    global _installed
    with _install_lock:
        if _installed:
            return
        future_type: Any = torch._C.Future
        original = future_type.wait

        def wait(self: Any) -> Any:
            sched = current_scheduler()
            if sched is not None and not self.done():
                sched.block(self.done, "wait", "a torch future")
            return original(self)

        wait.__doc__ = original.__doc__
        future_type.wait = wait
        _installed = True
