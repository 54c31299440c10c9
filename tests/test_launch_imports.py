"""``python -m reducer launch``: an import anywhere in a script is safe on rank threads.

tests/scripts/lazypkg resolves its names lazily and fails whenever two threads resolve one at
once (the race is forced: the first thread waits for the second). tests/scripts/replacingpkg
puts another module in its place in sys.modules, as transformers does, while the other ranks
wait at their import statement (forced too). Imported inside a function on every rank
together, both must work; and so must transformers, where it is installed.
"""

from __future__ import annotations

import builtins
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from reducer.tools import cli
from reducer.tools.launch import imports

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).parent.parent


def _forgetting(*packages: str) -> Iterator[None]:
    """``packages`` not imported yet (their races happen at the first import only)."""

    def forget() -> None:
        for name in [m for m in sys.modules if m.split(".")[0] in packages]:
            del sys.modules[name]

    forget()
    yield
    forget()


@pytest.fixture
def fresh_lazypkg() -> Iterator[None]:
    yield from _forgetting("lazypkg")


@pytest.fixture
def fresh_replacingpkg() -> Iterator[None]:
    yield from _forgetting("replacingpkg", "importrace")


@pytest.mark.slow
def test_a_lazy_import_inside_a_function_on_every_rank_at_once(
    fresh_lazypkg: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["launch", "--nproc", "3", "--no-check", str(SCRIPTS / "lazy_in_function.py")])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for rank in range(3):
        assert f"[rank{rank}]: rank {rank}: Model Config" in captured.out


def test_without_serialised_imports_the_forced_race_fails(
    fresh_lazypkg: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The race is real: the same launch with imports left to Python fails."""
    monkeypatch.setattr(imports, "serialise", lambda timeout: lambda: None)
    code = cli.main(["launch", "--nproc", "3", "--no-check", str(SCRIPTS / "lazy_in_function.py")])
    assert code == 1
    assert "from partially initialized module 'lazypkg." in capsys.readouterr().err


def test_a_package_replacing_itself_while_the_other_ranks_wait_at_its_import(
    fresh_replacingpkg: None, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(
        ["launch", "--nproc", "3", "--no-check", str(SCRIPTS / "self_replacing_in_function.py")]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    for rank in range(3):
        assert f"[rank{rank}]: rank {rank}: Config" in captured.out


def test_without_serialised_import_statements_the_waiting_ranks_get_the_replaced_module(
    fresh_replacingpkg: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The race is real: with module loads and lazy attributes serialised but import
    statements left to Python, the ranks that waited get the module object replaced."""
    monkeypatch.setattr(imports, "_serialise_statements", lambda timeout: lambda: None)
    code = cli.main(
        ["launch", "--nproc", "3", "--no-check", str(SCRIPTS / "self_replacing_in_function.py")]
    )
    assert code == 1
    err = capsys.readouterr().err
    assert "[rank1]: ImportError: cannot import name 'Config' from 'replacingpkg'" in err
    assert "[rank2]: ImportError: cannot import name 'Config' from 'replacingpkg'" in err


def test_serialise_puts_everything_back(tmp_path: Path) -> None:
    lazy = ModuleType("lazy_for_serialise")
    original = lambda name: name.upper()  # noqa: E731
    lazy.__getattr__ = original  # type: ignore[method-assign]
    sys.modules[lazy.__name__] = lazy
    bootstrap = sys.modules["_frozen_importlib"]
    find, import_ = bootstrap._find_and_load, builtins.__import__
    try:
        restore = imports.serialise(timeout=5.0)
        assert bootstrap._find_and_load is not find
        assert builtins.__import__ is not import_
        assert vars(lazy)["__getattr__"] is not original
        assert lazy.abc == "ABC"  # resolved through the lock
        restore()
    finally:
        del sys.modules[lazy.__name__]
    assert bootstrap._find_and_load is find
    assert builtins.__import__ is import_
    assert vars(lazy)["__getattr__"] is original


def test_a_wait_for_the_import_lock_gives_up_after_its_timeout() -> None:
    """So that ranks meeting in a collective during an import cannot deadlock on the lock."""
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with imports._one_at_a_time(5.0):
            held.set()
            release.wait(5.0)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(5.0)
        start = time.monotonic()
        with imports._one_at_a_time(0.1):
            waited = time.monotonic() - start
        assert 0.05 < waited < 2.0
    finally:
        release.set()
        thread.join(5.0)


@pytest.mark.slow
def test_transformers_imported_in_a_function_on_four_ranks() -> None:
    pytest.importorskip("transformers")
    for _ in range(3):  # each in a fresh process: the race is at the first import only
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "reducer",
                "launch",
                "--nproc",
                "4",
                "--no-check",
                str(SCRIPTS / "transformers_in_function.py"),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=ROOT,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        for rank in range(4):
            assert f"[rank{rank}]: rank {rank}: BertConfig" in done.stdout


def test_a_lazy_module_class_is_wrapped_when_its_module_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not at its first instance's load: a thread could read an attribute in between."""
    (tmp_path / "defines_lazy_class.py").write_text(
        "import types\n\n"
        "class Lazy(types.ModuleType):\n"
        "    def __getattr__(self, name):\n"
        "        return name.upper()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    restore = imports.serialise(timeout=5.0)
    try:
        import defines_lazy_class  # type: ignore[import-not-found]

        wrapped = vars(defines_lazy_class.Lazy)["__getattr__"]
        assert wrapped.__wrapped__ is not None
        assert defines_lazy_class.Lazy("m").abc == "ABC"
    finally:
        restore()
        sys.modules.pop("defines_lazy_class", None)
    assert not hasattr(vars(defines_lazy_class.Lazy)["__getattr__"], "__wrapped__")


@pytest.mark.parametrize("kind", ["module class", "module function"])
def test_a_lazy_name_that_loads_nothing_is_read_without_the_lock_after_its_first_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """A lazy __getattr__ that never caches (torch._VF's, read by every Tensor.split) takes
    the import lock only until a read of that name has loaded nothing; a name whose read loads
    a module keeps taking it."""
    (tmp_path / "loaded_by_a_lazy_read.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    held: list[tuple[str, bool]] = []

    def resolve(name: str) -> object:
        held.append((name, imports._LOCK._is_owned()))  # type: ignore[attr-defined]
        if name == "loads":
            sys.modules.pop("loaded_by_a_lazy_read", None)  # a fresh load at every read
            import loaded_by_a_lazy_read  # type: ignore[import-not-found]

            return loaded_by_a_lazy_read.VALUE
        return name.upper()

    if kind == "module class":

        class Lazy(ModuleType):
            def __getattr__(self, name: str) -> object:
                return resolve(name)

        lazy: ModuleType = Lazy("lazy_never_caching")
    else:
        lazy = ModuleType("lazy_never_caching")
        lazy.__getattr__ = resolve  # type: ignore[method-assign]
    sys.modules[lazy.__name__] = lazy
    restore = imports.serialise(timeout=5.0)
    try:
        reads = [lazy.abc, lazy.abc, lazy.abc, lazy.loads, lazy.loads]
    finally:
        restore()
        del sys.modules[lazy.__name__]
        sys.modules.pop("loaded_by_a_lazy_read", None)
    assert reads == ["ABC", "ABC", "ABC", 7, 7]
    assert held == [("abc", True), ("abc", False), ("abc", False), ("loads", True), ("loads", True)]
