"""A package that puts another module object in its place in ``sys.modules`` at the end of
its import, as transformers does (its ``_LazyModule``). A thread whose import statement meets
the package while another thread still runs it waits for it, and Python then hands that thread
the module object it met (this one, without ``Config``), not the one in ``sys.modules``.

To make the race certain rather than likely, the import says it has begun
(``importrace.started``), then waits, up to ``WAIT_S`` seconds, until ``importrace.others``
other threads are at an import statement in a function named ``build``, before it replaces
itself.
"""

from __future__ import annotations

import dis
import gc
import sys
import time
from types import ModuleType

import importrace

WAIT_S = 5.0


def _at_import(frame: object) -> bool:
    """Whether ``frame`` or a caller of it is a ``build`` function at an import statement."""
    while frame is not None:
        code = frame.f_code  # type: ignore[attr-defined]
        if code.co_name == "build" and code.co_code[frame.f_lasti] == dis.opmap["IMPORT_NAME"]:  # type: ignore[attr-defined]
            return True
        frame = frame.f_back  # type: ignore[attr-defined]
    return False


def _wait_for_the_others() -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        collecting = gc.isenabled()
        gc.disable()  # reading other threads' frames with the collector on can hang (gh-106883)
        try:
            waiting = sum(_at_import(frame) for frame in sys._current_frames().values())
        finally:
            if collecting:
                gc.enable()
        if waiting >= importrace.others + 1:  # this thread's build() is at its import too
            return
        time.sleep(0.01)


class _Replacement(ModuleType):
    Config = type("Config", (), {})


importrace.started.set()
_wait_for_the_others()
_replacement = _Replacement(__name__)
_replacement.__dict__.update(__spec__=__spec__, __path__=__path__, __file__=__file__)
sys.modules[__name__] = _replacement
