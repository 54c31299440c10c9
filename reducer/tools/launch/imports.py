"""Imports on rank threads: the script's leading imports, run once on the launching thread
before the rank threads start, and every other import serialised while they run.

Rank threads share ``sys.modules``. Python's import of one module is thread-safe, but a
library's lazy attributes often are not: transformers' ``_LazyModule`` imports a submodule the
first time one of its names is read, and when N rank threads run ``from transformers import
GPT2Model`` at once, one of them can find a half-imported module and fail with an ImportError.
Under torchrun each process imports alone. So before the ranks start, the launch runs the
script's leading import statements (the imports at its top, before any other statement: what
every rank runs first anyway) once, on the launching thread, and reads once each attribute
that the script takes from a module bound there (``transformers.AutoModel``), so that the ranks
find everything already imported. See Note [Imports before the ranks start].

An import in a function (a model-building helper's ``from transformers import BertConfig``)
runs on the rank threads, all at once. :func:`serialise` makes that safe: while the ranks run,
one thread at a time loads a module, and one at a time resolves a lazy module's attribute
(a module ``__getattr__``, or a module class's, as transformers' ``_LazyModule``). See Note
[One import at a time].

# Guarantees: preimport() and serialise() (and the restore it returns) are called on the
# launching thread, before any rank thread exists and after they ended; the hooks serialise()
# installs are safe from any thread (one re-entrant lock).
"""

from __future__ import annotations

import ast
import builtins
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from types import CodeType, ModuleType
from typing import Any

from . import children

__all__: list[str] = []

# Note [Imports before the ranks start]
# Only the leading block is run (after the docstring, up to the first statement that is not an
# import), in the script's order: a later import may depend on what the script did before it
# (sys.path.insert, os.environ), and then it is not the launch's to run early. It runs with
# rank 0's environment and output (a module's globals are shared by every rank anyway: whoever
# imports first sets them, under torchrun each process). An import that fails here stops the
# pre-import and is left to the ranks: each runs it itself, as torchrun's workers would, and
# reports its own error at the script's line. Imports in functions, or after other statements,
# run on the rank threads as written.


def leading_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements at the top of ``tree``, up to its first other statement."""
    found: list[ast.Import | ast.ImportFrom] = []
    for index, node in enumerate(tree.body):
        if isinstance(node, ast.Import | ast.ImportFrom):
            if not (isinstance(node, ast.ImportFrom) and node.module == "__future__"):
                found.append(node)
        elif not (index == 0 and _is_docstring(node)):
            break
    return found


def preimport(tree: ast.Module, filename: str, package: str | None) -> None:
    """Run ``tree``'s leading imports once (see the module's docstring), then read the module
    attributes the script uses. Errors are left to the ranks: see Note [Imports before the
    ranks start]."""
    namespace: dict[str, object] = {
        "__name__": "__reducer_launch_preimport__",
        "__package__": package,
        "__builtins__": builtins,
    }
    for node in leading_imports(tree):
        try:
            exec(_compile_one(node, filename), namespace)
        except Exception:  # the rank threads run it again, and each reports its own error
            break
    modules = {name: value for name, value in namespace.items() if isinstance(value, ModuleType)}
    # A module's __getattr__ may warn (deprecations); the script's own reads warn, not these.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, chain in _attribute_chains(tree, set(modules)):
            _touch(modules[name], chain)


def _compile_one(node: ast.stmt, filename: str) -> CodeType:
    # Line numbers kept: a traceback names the script's own line.
    return compile(ast.Module(body=[node], type_ignores=[]), filename, "exec")


def _is_docstring(node: ast.stmt) -> bool:
    return (
        isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
    )


def _attribute_chains(tree: ast.Module, names: set[str]) -> Iterator[tuple[str, list[str]]]:
    """``(name, [attr, ...])`` for each ``name.attr.attr...`` read anywhere in ``tree``."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain: list[str] = []
        value: ast.expr = node
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in names:
            yield value.id, chain[::-1]


def _touch(module: ModuleType, chain: list[str]) -> None:
    """Read ``module.a.b...`` while the values are modules (a lazy module imports the
    submodule behind a name on first read); any error is the script's to meet later."""
    value: object = module
    for attr in chain:
        if not isinstance(value, ModuleType):
            return
        try:
            value = getattr(value, attr)
        except Exception:
            return


# Note [One import at a time]
# Python imports one module at a time per module (a lock per module), not one at a time: two
# threads that import modules which import each other, in opposite orders, meet its deadlock
# detection, and one of them gets a partially initialized module ("cannot import name ...");
# a lazy module's own bookkeeping (which submodule is being loaded) has no lock at all. Under
# torchrun each process imports alone. So while the ranks run, one re-entrant lock is held by
# (1) importlib's _find_and_load, through which every import that loads a module passes (the
# import statement, importlib.import_module; an import of a module already loaded does not
# take it), and (2) each lazy module's __getattr__ (a module-level one, PEP 562, or one of its
# module class), wrapped when its module is loaded or, for those loaded before, when the
# launch starts: the thread that gets the lock second finds the name resolved. _find_and_load
# is private importlib API (stable since Python 3.3), the one point every load passes.
# A thread that waits longer than the launch allows (an import at whose top the ranks meet in
# a collective would otherwise deadlock) goes on without the lock, as Python alone would.
#
# Two gaps remain with these two hooks alone, both met by transformers on every launch at W = 4:
# (3) An import statement that finds its module in sys.modules while another thread still runs
# it waits for that module's own lock and then returns the module object it found, not the one
# in sys.modules at the end: a package that replaces itself in sys.modules (transformers puts a
# _LazyModule there) hands the waiting thread the plain, empty module ("cannot import name
# 'BertConfig' from 'transformers'"). So builtins.__import__ is wrapped too: an import statement
# takes the lock unless its module is already loaded and no thread is loading one (a dict read
# and an int test, so the imports on the training path stay cheap); with the lock it calls
# Python's import after the loader has finished, and finds what sys.modules holds then.
# (4) A module class with a lazy __getattr__ is wrapped where it is defined, when its module
# loads, not when its first instance is loaded: a thread can read an attribute of that instance
# between the load and the wrap.
#
# A lazy __getattr__ that never caches (torch._VF's, which Tensor.split reads at every call)
# would take the lock at every call, on the training path of every rank. So a name whose
# resolution, under the lock, loaded no module is remembered for its module, and later reads of
# it call the original __getattr__ without the lock: what needs one at a time is loading, and
# that name's resolution does none.

# Protocol: any thread; re-entrant (an import runs imports); held while a module loads, while a
# lazy attribute resolves, and for a whole import statement that met a module being loaded.
_LOCK = threading.RLock()
# How many loads are in progress under _LOCK (written only by the thread holding it): while one
# is, every import statement takes the lock (see (3) in the note above).
_loading = 0
# How many loads have started, ever (written only by the thread holding _LOCK): a lazy
# attribute whose resolution left it unchanged loaded nothing (see the end of the note above).
_loads = 0


def _remembering(plain: set[Any], key: Any, resolve: Callable[[], Any]) -> Any:
    """``resolve()`` under the lock; ``key`` joins ``plain`` (read without the lock from then
    on) where it loaded no module. See the end of Note [One import at a time]."""
    before = _loads
    value = resolve()
    if _loads == before:
        plain.add(key)
    return value


@contextmanager
def _one_at_a_time(timeout: float) -> Iterator[None]:
    got = _LOCK.acquire(timeout=timeout)
    try:
        yield
    finally:
        if got:
            _LOCK.release()


def serialise(timeout: float) -> Callable[[], None]:
    """One import and one lazy attribute at a time (see Note [One import at a time]) until
    the returned function is called; a wait for the lock gives up after ``timeout`` s."""
    bootstrap: Any = sys.modules["_frozen_importlib"]  # importlib._bootstrap itself
    real_find = bootstrap._find_and_load
    undo: list[Callable[[], None]] = []
    looked: set[int] = set()  # ids of the module classes already wrapped

    def wrap_class(cls: type) -> None:
        owner = next((c for c in cls.__mro__ if "__getattr__" in vars(c)), None)
        if owner is None or owner is ModuleType or id(owner) in looked:
            return
        looked.add(id(owner))
        original = vars(owner)["__getattr__"]
        # (id of the module, name) resolved without loading anything: no lock needed again.
        # One class serves many modules (transformers' _LazyModule), hence the module's id.
        plain: set[tuple[int, str]] = set()

        def __getattr__(self: ModuleType, name: str) -> Any:
            key = (id(self), name)
            if key in plain:
                return original(self, name)
            with _one_at_a_time(timeout):
                try:  # resolved by the thread that held the lock before
                    return object.__getattribute__(self, name)
                except AttributeError:
                    return _remembering(plain, key, lambda: original(self, name))

        __getattr__.__wrapped__ = original  # type: ignore[attr-defined]
        owner.__getattr__ = __getattr__  # type: ignore[attr-defined]
        undo.append(lambda: setattr(owner, "__getattr__", original))

    def wrap_module(module: ModuleType) -> None:
        namespace = vars(module)
        original = namespace.get("__getattr__")
        if not callable(original) or getattr(original, "_launch_serialised", False):
            return

        plain: set[str] = set()  # names resolved without loading anything: no lock again

        def __getattr__(name: str) -> Any:
            if name in plain:
                return original(name)
            with _one_at_a_time(timeout):
                if name in namespace:
                    return namespace[name]
                return _remembering(plain, name, lambda: original(name))

        __getattr__._launch_serialised = True  # type: ignore[attr-defined]
        namespace["__getattr__"] = __getattr__

        def put_back() -> None:
            if namespace.get("__getattr__") is __getattr__:
                namespace["__getattr__"] = original

        undo.append(put_back)

    def guard(module: object) -> None:
        if not isinstance(module, ModuleType):
            return
        try:
            if type(module) is not ModuleType:
                wrap_class(type(module))
            else:
                wrap_module(module)
            for value in list(vars(module).values()):  # (4) in the note: lazy module classes
                # type(value), not isinstance: that reads __class__, which some objects warn on.
                if issubclass(type(value), type) and ModuleType in value.__mro__:
                    wrap_class(value)
        except (TypeError, AttributeError):  # an odd module object: left as it is
            pass

    def find_and_load(name: str, import_: Any) -> Any:
        global _loading, _loads
        with _one_at_a_time(timeout):
            _loading += 1
            _loads += 1
            try:
                module = real_find(name, import_)
                guard(module)
            finally:
                _loading -= 1
        return module

    for module in list(sys.modules.values()):
        guard(module)
    bootstrap._find_and_load = find_and_load
    undo.append(_serialise_statements(timeout))

    def put_back() -> None:
        bootstrap._find_and_load = real_find
        while undo:
            undo.pop()()

    def in_child() -> None:
        # A forked child imports alone; the lock may have been held by a thread it lacks.
        global _LOCK, _loading
        _LOCK = threading.RLock()
        _loading = 0
        put_back()

    remove_hook = children.in_forked_child(in_child)

    def restore() -> None:
        remove_hook()
        put_back()

    return restore


def _serialise_statements(timeout: float) -> Callable[[], None]:
    """Wrap ``builtins.__import__`` as (3) in Note [One import at a time] says; return the
    function that puts it back."""
    real_import = builtins.__import__

    def import_(
        name: str,
        globals: Mapping[str, object] | None = None,
        locals: Mapping[str, object] | None = None,
        fromlist: Sequence[str] | None = (),
        level: int = 0,
    ) -> ModuleType:
        if level == 0 and not _loading and _loaded(name):
            return real_import(name, globals, locals, fromlist, level)
        with _one_at_a_time(timeout):  # after whoever is loading a module has finished
            return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = import_

    def restore() -> None:
        if builtins.__import__ is import_:
            builtins.__import__ = real_import

    return restore


def _loaded(name: str) -> bool:
    """Whether ``sys.modules`` holds ``name`` and no thread is still running it."""
    module = sys.modules.get(name)
    spec = getattr(module, "__spec__", None)
    return module is not None and not getattr(spec, "_initializing", False)
