"""Child processes of a rank, for ``python -m reducer launch``: as a torchrun worker's children.

A torchrun worker is a process, and its children (DataLoader workers, a ``multiprocessing.Pool``,
a ``ProcessPoolExecutor``, ``subprocess``) start from it: a forked child is a copy of that
worker, a spawned one a fresh interpreter with that worker's environment. Ranks of a launch are
threads of one process, so while a launch runs:

- a child forked on a rank thread (``os.fork``, multiprocessing's ``fork`` start method) is
  given back everything the launch made per rank, in the child, before ``fork()`` returns there
  (:func:`in_forked_child` hooks, run from ``os.register_at_fork``): the real ``os._exit``,
  ``signal.signal``, ``sys.stdin`` and import machinery, the forking rank's environment as the
  process's ``os.environ`` (and C ``getenv``), that rank's ``__main__``; a collective in the
  child raises :class:`ChildCollectiveError` (the process group's peers are threads of the
  launch process, not of the child);
- a child started by ``exec`` from a rank thread (``subprocess``, the ``spawn`` start method,
  a ``forkserver``) gets that rank's environment (:func:`install` wraps
  ``_posixsubprocess.fork_exec``, which all of them go through, where it is given none);
- the ``forkserver`` start method has a fork server per rank, started with that rank's
  environment, as each torchrun worker has its own.

See docs/howto/launch-child-processes.md for what a forked child of a rank thread can and
cannot do.

# Guarantees: install() and the restore it returns run on the launching thread, before the
# rank threads start and after they ended. The at-fork hook runs in the child, where only the
# forking thread exists: the hooks take no lock (any lock may have been held, at the fork, by a
# thread the child does not have). _lock guards the fork servers.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

__all__: list[str] = []


class ChildCollectiveError(RuntimeError):
    """A child process of a rank tried a collective of that rank's process group."""


# The hooks run in a child forked while a launch runs, last registered first. The list is
# replaced, never mutated, so that a fork copies a consistent one whatever another thread does.
_hooks: tuple[Callable[[], None], ...] = ()


def in_forked_child(hook: Callable[[], None]) -> Callable[[], None]:
    """Run ``hook`` in every child forked until the returned function is called (hooks run
    last registered first, as the restores they mirror)."""
    global _hooks
    _hooks = (hook, *_hooks)

    def remove() -> None:
        global _hooks
        _hooks = tuple(h for h in _hooks if h is not hook)

    return remove


def _after_fork_in_child() -> None:
    global _hooks
    hooks, _hooks = _hooks, ()
    for hook in hooks:
        hook()


os.register_at_fork(after_in_child=_after_fork_in_child)


def become_environment(real: Any, view: Mapping[str, str]) -> None:
    """Make the process's environment ``real`` (``os``'s own mapping, which also sets C's) be
    ``view``: in a forked child, the forking rank's environment."""
    for key in [k for k in real if k not in view]:
        del real[key]
    for key, value in view.items():
        if real.get(key) != value:
            real[key] = value


def collective_message(rank: int | None, what: str) -> str:
    whose = "the launch" if rank is None else f"rank {rank}"
    return (
        f"{what} in a child process of {whose} (pid {os.getpid()}, forked from it): the "
        "process group's peers are the other ranks, threads of the launch process, and a "
        "forked child has none of them (fork copies only the forking thread). A child process "
        "(a DataLoader worker, a Pool's process) cannot take part in its parent's collectives, "
        "under torchrun either (there it hangs, or breaks the rank's connections). Return what "
        "the child computed to the rank (the DataLoader's batches, a queue, a Pool's results) "
        "and run the collective there."
    )


def install(environ_of_thread: Callable[[], dict[str, str] | None]) -> Callable[[], None]:
    """Children started by exec on a rank thread (or a thread a rank started: one whose
    ``environ_of_thread()`` is not None) get that rank's environment, and the ``forkserver``
    start method a server per rank, until the returned function is called."""
    import _posixsubprocess
    import multiprocessing.forkserver as forkserver
    import subprocess

    real_fork_exec = _posixsubprocess.fork_exec

    # fork_exec(args, executable_list, close_fds, pass_fds, cwd, env, ...): env is the sixth
    # argument from Python 3.10 to 3.14; None means "this process's environment".
    def fork_exec(*args: Any) -> Any:
        view = environ_of_thread() if len(args) > 5 and args[5] is None else None
        if view is not None:
            env = [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in view.items()]
            args = (*args[:5], env, *args[6:])
        return real_fork_exec(*args)

    # subprocess took its own reference at its import.
    wrapped = [m for m in (_posixsubprocess, subprocess) if _fork_exec_of(m) is real_fork_exec]
    for module in wrapped:
        _set_fork_exec(module, fork_exec)

    lock = threading.Lock()
    servers: dict[int, tuple[dict[str, str], Any]] = {}  # by id of the rank's environment
    names = (
        "ensure_running",
        "get_inherited_fds",
        "connect_to_new_process",
        "set_forkserver_preload",
    )
    real = {name: getattr(forkserver, name) for name in names}

    def server() -> Any:
        """The calling rank's fork server (started on first use), or the process's own."""
        view = environ_of_thread()
        if view is None:
            return forkserver._forkserver
        with lock:
            entry = servers.get(id(view))
            if entry is None:
                found = forkserver.ForkServer()
                found._preload_modules = list(forkserver._forkserver._preload_modules)  # type: ignore[attr-defined]
                entry = servers[id(view)] = (view, found)
            return entry[1]

    def dispatching(name: str) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            return getattr(server(), name)(*args)

        call.__name__ = call.__qualname__ = name
        return call

    for name in names:
        setattr(forkserver, name, dispatching(name))
    put_back_start_methods = _start_method_per_rank(environ_of_thread)

    def put_back(*, forked: bool = False) -> None:
        for module in wrapped:
            _set_fork_exec(module, real_fork_exec)
        for name, function in real.items():
            setattr(forkserver, name, function)
        put_back_start_methods(forked=forked)

    # A forked child has the process's own server, and the rank's start method.
    remove_hook = in_forked_child(functools.partial(put_back, forked=True))

    def restore() -> None:
        remove_hook()
        put_back()
        with lock:
            stopping = [found for _, found in servers.values()]
            servers.clear()
        for found in stopping:
            _stop(found)

    return restore


_START_METHOD_NAMES = ("get_context", "get_start_method", "set_start_method")


def _start_method_per_rank(
    environ_of_thread: Callable[[], dict[str, str] | None],
) -> Callable[..., None]:
    """``multiprocessing.set_start_method`` once per rank, as once per torchrun worker: every
    rank's script sets it (``mp.set_start_method("spawn")``), and Python allows it once per
    process. On a rank thread (or a thread it started) the method set is that rank's, and
    ``get_context()``/``get_start_method()`` answer with it; elsewhere, the process's own.
    Returns the function that puts Python's back (``forked=True``: in a forked child, with the
    forking rank's method as the process's)."""
    import multiprocessing
    import multiprocessing.spawn  # it holds the methods too: wrapped below
    from multiprocessing import context

    default = context._default_context
    real_get_context = default.get_context
    real_get_start_method = default.get_start_method
    real_set_start_method = default.set_start_method
    methods: dict[int, str] = {}  # by id of the rank's environment (it lives as long as the rank)

    def rank_method() -> str | None:
        view = environ_of_thread()
        return None if view is None else methods.get(id(view))

    def get_context(method: str | None = None) -> Any:
        return real_get_context(method if method is not None else rank_method())

    def get_start_method(allow_none: bool = False) -> Any:
        method = rank_method()
        return method if method is not None else real_get_start_method(allow_none)

    def set_start_method(method: str | None, force: bool = False) -> None:
        view = environ_of_thread()
        if view is None:
            real_set_start_method(method, force)
            return
        if id(view) in methods and not force:
            raise RuntimeError("context has already been set")  # Python's own words
        if method is None:
            methods.pop(id(view), None)
            return
        real_get_context(method)  # an unknown method: Python's ValueError
        methods[id(view)] = method

    # The bound methods multiprocessing put in its namespace at import (one object each, which
    # the modules that import them by name share).
    bound = {name: getattr(multiprocessing, name) for name in _START_METHOD_NAMES}
    replacements = {
        "get_context": get_context,
        "get_start_method": get_start_method,
        "set_start_method": set_start_method,
    }
    # multiprocessing bound these methods to module names at its import, and modules that
    # imported them by name (multiprocessing.spawn, torch.multiprocessing) hold them too.
    owners = [m for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)]
    undo: list[Callable[[], None]] = []
    for name, replacement in replacements.items():
        setattr(default, name, replacement)
        undo.append(functools.partial(delattr, default, name))
        for owner in owners:
            try:
                held = vars(owner).get(name)
            except TypeError:
                continue
            if held is not None and held is bound[name]:
                setattr(owner, name, replacement)
                undo.append(functools.partial(setattr, owner, name, held))

    def put_back(*, forked: bool = False) -> None:
        method = rank_method() if forked else None
        while undo:
            undo.pop()()
        if method is not None:  # a forked child of the rank: a process with the rank's method
            real_set_start_method(method, force=True)

    return put_back


def _fork_exec_of(module: Any) -> Any:
    return getattr(module, "_fork_exec" if module.__name__ == "subprocess" else "fork_exec", None)


def _set_fork_exec(module: Any, function: Any) -> None:
    setattr(module, "_fork_exec" if module.__name__ == "subprocess" else "fork_exec", function)


def _stop(server: Any) -> None:
    """Let a rank's fork server end, as it does when its torchrun worker ends: it exits once
    every process holding its "alive" pipe (the rank and the children it forked) closed it."""
    from multiprocessing import util

    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is None:
        return
    os.close(fd)
    server._forkserver_alive_fd = None
    pid = server._forkserver_pid
    server._forkserver_pid = None
    address = server._forkserver_address
    server._forkserver_address = None
    if address is not None and not util.is_abstract_socket_namespace(address):
        with contextlib.suppress(OSError):
            os.unlink(address)
    for _ in range(50):  # reaped once it exited (at most 0.5 s; it exits on its own after)
        try:
            done, _status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done:
            return
        threading.Event().wait(0.01)
