"""``python -m reducer launch``: an import anywhere in a script is safe on rank threads.

tests/scripts/lazypkg resolves its names lazily and fails whenever two threads resolve one at
once (the race is forced: the first thread waits for the second). Imported inside a function
on every rank together, it must work; and so must transformers, where it is installed.
"""

from __future__ import annotations

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


@pytest.fixture
def fresh_lazypkg() -> Iterator[None]:
    """lazypkg not imported yet (its race happens at the first resolution only)."""

    def forget() -> None:
        for name in [m for m in sys.modules if m == "lazypkg" or m.startswith("lazypkg.")]:
            del sys.modules[name]

    forget()
    yield
    forget()


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


def test_serialise_puts_everything_back(tmp_path: Path) -> None:
    lazy = ModuleType("lazy_for_serialise")
    original = lambda name: name.upper()  # noqa: E731
    lazy.__getattr__ = original  # type: ignore[method-assign]
    sys.modules[lazy.__name__] = lazy
    bootstrap = sys.modules["_frozen_importlib"]
    find = bootstrap._find_and_load
    try:
        restore = imports.serialise(timeout=5.0)
        assert bootstrap._find_and_load is not find
        assert vars(lazy)["__getattr__"] is not original
        assert lazy.abc == "ABC"  # resolved through the lock
        restore()
    finally:
        del sys.modules[lazy.__name__]
    assert bootstrap._find_and_load is find
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
