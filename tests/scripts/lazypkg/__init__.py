"""A package that imports its submodules on first attribute access, not thread-safely, as
transformers' ``_LazyModule`` does in effect: while one thread imports a submodule, another
thread that asks for a name of it finds it half imported and gets the ImportError that Python
gives for a partially initialized module.

To make the race certain rather than likely, the first thread to ask for a submodule waits,
before importing it, up to ``WAIT_S`` seconds for a second thread to ask too (as if the import
were slow). Alone (imports done once, before the ranks start) it waits and then succeeds.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

WAIT_S = 2.0
_SUBMODULES = {"Model": "modeling", "Config": "configuration"}
# No lock guards these: that is the point.
_state: dict[str, str] = {}  # submodule -> "loading" or "done"
_arrived = {sub: threading.Event() for sub in _SUBMODULES.values()}


def __getattr__(name: str) -> Any:
    sub = _SUBMODULES.get(name)
    if sub is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if _state.get(sub) == "loading":
        _arrived[sub].set()
        raise ImportError(
            f"cannot import name {name!r} from partially initialized module "
            f"'{__name__}.{sub}' (most likely due to a circular import)"
        )
    _state[sub] = "loading"
    _arrived[sub].wait(WAIT_S)
    value = getattr(importlib.import_module(f".{sub}", __name__), name)
    globals()[name] = value
    _state[sub] = "done"
    return value
