"""Process-wide calls made per rank thread, for ``python -m reducer launch``.

A torchrun worker is a process: ``os._exit`` ends it alone, ``sys.stdout = ...`` redirects its
own output, ``signal.signal`` installs its own handler, its ``__main__`` is its script, and
pickle finds the script's classes there. Ranks of a launch are threads of one process, so
while a launch runs:

- ``os._exit(code)`` on a rank thread ends that rank only (:class:`RankExit`, reported as
  torchrun reports a worker's exit code); elsewhere it is the real one;
- ``sys.stdout``/``sys.stderr`` assigned on a rank thread redirect that rank's output only
  (``sys``'s class is swapped for :class:`_PerRankSys` for the duration: module attribute
  assignment has no other hook);
- ``sys.stdin`` (its ``buffer`` too) and ``input()`` read end-of-file on rank threads, with a
  note, and file descriptor 0 is the null device while the ranks run (``os.read(0, n)``,
  ``sys.__stdin__``): threads of one process reading one stdin at once would each get an
  arbitrary part of it, or Python aborts;
- ``signal.signal`` on a rank thread raises a ValueError that says why and what to do;
- ``sys.modules["__main__"]`` is :class:`MainModules`: on a rank thread, that rank's run of
  the script (a module of its own), so that pickle finds the script's classes and functions
  (``torch.save(Net())``, ``mp.spawn(worker, ...)``); elsewhere the process's own.

# Guarantees: install() and the restore it returns run on the launching thread, before the
# rank threads start and after they ended; everything else is safe from any thread (per-rank
# state is thread-local).
"""

from __future__ import annotations

import io
import os
import signal
import sys
import threading
import types
from collections.abc import Callable
from typing import Any, NoReturn

from . import children
from .threads import INHERITED_ENVIRON, INHERITED_MAIN, RankOutput, ThreadEnviron

__all__: list[str] = []


class RankExit(BaseException):
    """``os._exit(code)`` on a rank thread: that rank ends with exit code ``code``.

    A BaseException, so that a script's ``except Exception`` does not swallow it (``finally``
    blocks do run, unlike a process's ``os._exit``).
    """

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code

    def __str__(self) -> str:
        return f"os._exit({self.code})"


class MainModules(types.ModuleType):
    """``sys.modules["__main__"]`` during a launch: on a rank thread bound to a module (its
    run of the script), that module; on any other thread, the process's own ``__main__``.
    Attribute reads, writes and deletes go to whichever applies (pickle looks up
    ``sys.modules["__main__"].Net``; multiprocessing's spawn reads its ``__file__``)."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("__main__")
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_local", threading.local())

    def bind(self, module: types.ModuleType | None) -> None:
        """The calling thread's ``__main__`` from now on (None: the process's own)."""
        object.__getattribute__(self, "_local").module = module

    def _target(self) -> types.ModuleType:
        module: types.ModuleType | None = getattr(
            object.__getattribute__(self, "_local"), "module", None
        )
        if module is None:  # a thread a rank started: that rank's
            module = getattr(threading.current_thread(), INHERITED_MAIN, None)
        if module is None:
            real: types.ModuleType = object.__getattribute__(self, "_real")
            return real
        return module

    def __getattribute__(self, name: str) -> Any:
        if name in ("bind", "_target", "__class__"):
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "_target")(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target(), name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._target(), name)

    def __dir__(self) -> list[str]:
        return dir(self._target())

    def __repr__(self) -> str:
        return repr(self._target())


class RankInput(io.TextIOBase):
    """``sys.stdin`` during a launch: end-of-file on rank threads (a note the first time each
    rank reads), the real stream elsewhere. No ``fileno`` on rank threads, so that ``input()``
    reads through it (and gets EOFError) rather than from the terminal directly."""

    def __init__(self, real: Any, rank_of_thread: Callable[[], int | None]) -> None:
        super().__init__()
        self.real = real
        self._rank_of_thread = rank_of_thread
        self._noted: set[int] = set()
        self._lock = threading.Lock()

    def _rank_reads(self) -> bool:
        rank = self._rank_of_thread()
        if rank is None:
            return False
        with self._lock:
            first = rank not in self._noted
            self._noted.add(rank)
        if first:
            print(
                "[launch] note: this rank read its standard input, and gets end-of-file: the "
                "ranks are threads of one process and share one stdin, which no rank reads. "
                "Give a script its input as an argument or a file.",
                file=sys.stderr,
                flush=True,
            )
        return True

    def read(self, size: int | None = -1) -> str:
        return "" if self._rank_reads() else str(self.real.read(size))

    @property
    def buffer(self) -> Any:
        """The binary stream under stdin: empty on rank threads (``sys.stdin.buffer.read()``
        gives every rank b""), the real one elsewhere."""
        return io.BytesIO() if self._rank_reads() else self.real.buffer

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        return "" if self._rank_reads() else str(self.real.readline(size))

    def readlines(self, hint: int = -1) -> list[str]:  # type: ignore[override]
        return [] if self._rank_reads() else list(self.real.readlines(hint))

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        if self._rank_of_thread() is not None:
            raise io.UnsupportedOperation("a rank thread has no stdin of its own")
        return int(self.real.fileno())

    def isatty(self) -> bool:
        return self._rank_of_thread() is None and bool(self.real.isatty())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _signal_message(signum: Any, rank: int) -> str:
    try:
        name = signal.Signals(signum).name
    except (ValueError, TypeError):
        name = str(signum)
    return (
        f"signal.signal({name}, ...) on rank {rank}: the ranks of `python -m reducer launch` "
        "are threads of one process, and a signal handler belongs to the whole process (Python "
        "lets only its main thread set one). Set it only in a process of its own: guard it "
        "with `if threading.current_thread() is threading.main_thread():`, or test the "
        "script's signal handling under torchrun. The launch handles Ctrl-C itself (it prints "
        "where every rank is and stops them)."
    )


def _stdin_to_devnull() -> int | None:
    """Point file descriptor 0 at the null device (a read there is end-of-file) and return a
    copy of what it was, to put back; None where the process has no fd 0. Reads that bypass
    ``sys.stdin`` (``sys.__stdin__``, ``os.read(0, n)``, ``open(0)``) then give every rank
    end-of-file too, instead of whatever part of piped input a rank happens to read first."""
    try:
        saved = os.dup(0)
    except OSError:
        return None
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        os.dup2(null, 0)
    finally:
        os.close(null)
    return saved


def install(
    rank_of_thread: Callable[[], int | None],
    stdout: RankOutput,
    stderr: RankOutput,
    environ: ThreadEnviron | None = None,
) -> tuple[MainModules, Callable[[], None]]:
    """Make the process-wide calls above per rank until the returned function is called;
    the ``__main__`` stand-in, which each rank thread binds to its module. A thread a rank
    thread starts shares that rank's ``__main__`` and environment (``environ``'s view)."""
    real_exit = os._exit
    real_start = threading.Thread.start
    real_signal = signal.signal
    real_main = sys.modules["__main__"]
    real_stdin = sys.stdin
    main = MainModules(real_main)
    streams = {"stdout": stdout, "stderr": stderr}

    def _exit(status: int) -> NoReturn:
        if rank_of_thread() is None:
            real_exit(status)
        raise RankExit(int(status))

    def signal_(signalnum: Any, handler: Any) -> Any:
        rank = rank_of_thread()
        if rank is not None:
            raise ValueError(_signal_message(signalnum, rank))
        return real_signal(signalnum, handler)

    class _PerRankSys(types.ModuleType):
        """``sys`` with ``stdout``/``stderr`` assigned per rank thread (see the module's
        docstring). print() and C code read sys's dict, which keeps the rank streams; the
        rank streams write to the rank's own target, when it assigned one."""

        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            # importlib makes every new module as type(sys)(name): a plain module, not this.
            return types.ModuleType(*args, **kwargs)

        def __getattribute__(self, name: str) -> Any:
            stream = streams.get(name)
            if stream is not None and rank_of_thread() is not None:
                return stream.assigned()
            return super().__getattribute__(name)

        def __setattr__(self, name: str, value: Any) -> None:
            stream = streams.get(name)
            if stream is not None and rank_of_thread() is not None:
                stream.assign(value)
                return
            super().__setattr__(name, value)

    def start(thread: threading.Thread) -> None:
        # Before the thread runs: what its code reads (pickle's __main__, os.environ) is the
        # starting rank's, as in a torchrun worker (a Pool's task thread pickles __main__.f).
        module = object.__getattribute__(main, "_target")()
        if module is not real_main:
            setattr(thread, INHERITED_MAIN, module)
        env = None if environ is None else environ.bound()
        if env is not None:
            setattr(thread, INHERITED_ENVIRON, env)
        real_start(thread)

    stdin_fd = _stdin_to_devnull()
    os._exit = _exit
    signal.signal = signal_
    threading.Thread.start = start  # type: ignore[method-assign, assignment]
    sys.stdin = RankInput(real_stdin, rank_of_thread)
    sys.modules["__main__"] = main
    sys.__class__ = _PerRankSys

    def in_child() -> None:
        # A forked child is a process of its own: the real calls back, and the forking rank's
        # run of the script as its __main__ (pickle finds the script's classes there).
        forking_main = main._target()
        sys.__class__ = types.ModuleType
        sys.modules["__main__"] = forking_main
        sys.stdin = real_stdin
        signal.signal = real_signal
        os._exit = real_exit
        threading.Thread.start = real_start  # type: ignore[method-assign]

    remove_hook = children.in_forked_child(in_child)

    def restore() -> None:
        remove_hook()
        if stdin_fd is not None:
            os.dup2(stdin_fd, 0)
            os.close(stdin_fd)
        sys.__class__ = types.ModuleType
        sys.modules["__main__"] = real_main
        sys.stdin = real_stdin
        signal.signal = real_signal
        os._exit = real_exit
        threading.Thread.start = real_start  # type: ignore[method-assign]

    return main, restore
