"""Causes the user declared deliberate: by :func:`deliberate` in the script, or by the
``REDUCER_DELIBERATE`` environment variable; both the launch's report and
``check_same_training`` leave them out of the findings."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable

from ._findings import CAUSES

ENV_VAR = "REDUCER_DELIBERATE"

_DECLARED: set[str] = set()  # causes the script declared deliberate (guarded by _LOCK)
_LOCK = threading.Lock()


def _checked(causes: Iterable[str], where: str) -> frozenset[str]:
    out = set()
    for cause in causes:
        name = cause.strip()
        if not name:
            continue
        if name not in CAUSES:
            known = ", ".join(sorted(CAUSES))
            raise ValueError(f"{where}: unknown cause {name!r}; the causes are: {known}")
        out.add(name)
    return frozenset(out)


def deliberate(*causes: str) -> None:
    """Declare causes deliberate (e.g. ``deliberate("summed-loss")`` where the learning rate
    is scaled for a summed loss): the same-training report does not count them as findings,
    and says they were declared. The causes are the keys of :data:`CAUSES`; an unknown one is
    a ValueError. Any rank may call it, any number of times."""
    names = _checked(causes, "reducer.testing.sametrain.deliberate")
    with _LOCK:
        _DECLARED.update(names)


def declared() -> frozenset[str]:
    """The causes declared by :func:`deliberate` and ``REDUCER_DELIBERATE``."""
    env = os.environ.get(ENV_VAR, "")
    with _LOCK:
        mine = frozenset(_DECLARED)
    return mine | _checked(env.split(","), f"{ENV_VAR}={env!r}")
