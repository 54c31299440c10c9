"""Process-wide state made per rank thread, for ``python -m reducer launch``.

A training script written for torchrun expects a process of its own: its own environment
variables (RANK, WORLD_SIZE, ...) and its own standard output. Ranks of a launch are threads of
one process, so :class:`ThreadEnviron` stands in for ``os.environ`` and :class:`RankOutput`
for ``sys.stdout`` / ``sys.stderr`` while a launch runs: each rank thread sees and changes its
own copy of the environment, and each line a rank writes is prefixed ``[rank0]: ``. Threads
that are not ranks (the launcher, the fake world's workers) see the real ones.

# Guarantees: every method is safe from any thread. A rank thread's environment and pending
# output belong to that thread (thread-local); the real stream is written under one lock, a
# whole line at a time, so lines of different ranks never mix.
"""

from __future__ import annotations

import io
import os
import sys
import threading
from collections.abc import Iterator, MutableMapping
from typing import Any, TextIO

__all__: list[str] = []

# The attributes of a thread that a rank thread started: that rank's environment and __main__
# (see process.install), as a thread of a torchrun worker shares its process's.
INHERITED_ENVIRON = "_launch_rank_environ"
INHERITED_MAIN = "_launch_rank_main"


class ThreadEnviron(MutableMapping[str, str]):
    """``os.environ`` with a copy of its own for each bound (rank) thread, shared with the
    threads that rank starts.

    ``os.getenv``, ``os.environ[...]`` and torch's env:// reads see the thread's copy, and so do
    the rank's child processes (see .children). C code (``getenv`` in C) in the launch process
    still sees the process's real environment.
    """

    def __init__(self, real: MutableMapping[str, str]) -> None:
        self.real = real
        self._local = threading.local()

    def bind(self, overrides: dict[str, str]) -> None:
        """From now on, this thread sees the real environment as it is now plus ``overrides``."""
        self._local.env = {**dict(self.real), **overrides}

    def unbind(self) -> None:
        self._local.env = None

    def bound(self) -> dict[str, str] | None:
        """This thread's environment: a rank's (its own, or that of the rank that started the
        thread: see process.install), or None where the thread sees the real one."""
        env: dict[str, str] | None = getattr(self._local, "env", None)
        if env is None:
            env = getattr(threading.current_thread(), INHERITED_ENVIRON, None)
        return env

    def _env(self) -> MutableMapping[str, str]:
        env = self.bound()
        return self.real if env is None else env

    def __getitem__(self, key: str) -> str:
        return self._env()[key]

    def __setitem__(self, key: str, value: str) -> None:
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"str expected, not {type(key).__name__} / {type(value).__name__}")
        self._env()[key] = value

    def __delitem__(self, key: str) -> None:
        del self._env()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._env()))

    def __len__(self) -> int:
        return len(self._env())

    def copy(self) -> dict[str, str]:
        return dict(self._env())

    def __repr__(self) -> str:
        return f"environ({dict(self._env())!r})"


class RankOutput(io.TextIOBase):
    """A text stream that prefixes each line a rank thread writes with ``[rank<r>]: ``.

    Lines are written to ``target`` whole (a partial line waits for its newline, or for the
    rank's end: :meth:`finish`); ranks outside ``ranks`` (None: all) are not shown, as with
    torchrun's ``--local-ranks-filter``. Other threads write through unchanged.
    """

    def __init__(self, target: TextIO, lock: threading.Lock, ranks: set[int] | None) -> None:
        super().__init__()
        self.target = target
        self._lock = lock  # shared by stdout and stderr: one line at a time on the terminal
        self._ranks = ranks
        self._local = threading.local()
        self._in_child = False  # a forked child's copy (see after_fork)

    def after_fork(self, lock: threading.Lock) -> None:
        """In a child forked on a rank thread: a lock of the child's own (the old one may have
        been held by a thread the child lacks), the real stream through a buffer of the
        child's own (see :func:`_own_buffer`), no partial line of the parent's, and flush()
        writes a partial line, as a process's stream does (a child ends with os._exit)."""
        self._lock = lock
        self.target = _own_buffer(self.target)
        self._in_child = True
        if getattr(self._local, "rank", None) is not None:
            self._local.pending = ""

    def bind(self, rank: int) -> None:
        self._local.rank = rank
        self._local.pending = ""
        self._local.assigned = None

    def finish(self) -> None:
        """Write this rank's partial last line, if any, and stop prefixing on this thread."""
        pending = getattr(self._local, "pending", "")
        if pending:
            self._emit([pending])
        self._local.rank = None
        self._local.pending = ""
        self._local.assigned = None

    def assign(self, stream: Any) -> None:
        """``sys.stdout = stream`` on this rank thread: this rank's output goes there from
        now on (the other ranks' does not). This stream, the real one or Python's original
        (``sys.__stdout__``) put the rank's prefixed output back."""
        back = any(stream is s for s in (self, self.target, sys.__stdout__, sys.__stderr__))
        self._local.assigned = None if back else stream

    def assigned(self) -> Any:
        """What ``sys.stdout`` is on this rank thread: the stream it assigned, or this one."""
        stream = getattr(self._local, "assigned", None)
        return self if stream is None else stream

    def write(self, text: str) -> int:
        assigned = getattr(self._local, "assigned", None)
        if assigned is not None:
            return int(assigned.write(text))
        rank = getattr(self._local, "rank", None)
        if rank is None:
            with self._lock:
                return self.target.write(text)
        lines = (self._local.pending + text).split("\n")
        self._local.pending = lines.pop()
        if lines:
            self._emit(lines)
        return len(text)

    def _emit(self, lines: list[str]) -> None:
        rank = self._local.rank
        if self._ranks is not None and rank not in self._ranks:
            return
        text = "".join(f"[rank{rank}]: {line}\n" for line in lines)
        with self._lock:
            self.target.write(text)
            self.target.flush()

    def flush(self) -> None:
        assigned = getattr(self._local, "assigned", None)
        if assigned is not None:
            assigned.flush()
            return
        pending = getattr(self._local, "pending", "")
        if self._in_child and pending and getattr(self._local, "rank", None) is not None:
            self._local.pending = ""
            self._emit([pending])
        with self._lock:
            self.target.flush()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return self.target.isatty()

    def fileno(self) -> int:
        return self.target.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.target, "encoding", "utf-8")

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return getattr(self.target, "errors", None)

    def __getattr__(self, name: str) -> Any:
        # Anything else a library asks of a real stream (buffer, mode, ...): the target's.
        return getattr(self.target, name)


def rank_environment(rank: int, world_size: int) -> dict[str, str]:
    """The variables torchrun sets for each worker of one node."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "fakepg",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }


def _own_buffer(stream: Any) -> Any:
    """In a forked child: ``stream``'s file through a new buffer, or ``stream`` itself where
    it has no file (a test's capture).

    A buffered stream holds a lock of its own while it writes, and other ranks write their
    lines to the real stream all the time: forked while one of them was in a write, the child
    would find that lock taken for ever (its owner is a thread the child does not have), and
    its first flush (multiprocessing flushes both streams as a child ends) would hang. What
    the parent had buffered stays the parent's to write, not written twice."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return stream
    return io.TextIOWrapper(
        open(fd, "wb", closefd=False),
        encoding=getattr(stream, "encoding", None) or "utf-8",
        errors=getattr(stream, "errors", None) or "strict",
        line_buffering=bool(getattr(stream, "line_buffering", False)),
    )
