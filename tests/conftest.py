"""Fixtures shared by the unit tests."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import fakepg

# Scripts the tests launch in this process, and the benchmark scripts they import, put their
# folders on sys.path and import helper modules of common names (each folder has a _common).
_SCRIPT_FOLDERS = tuple(
    str(Path(__file__).resolve().parent.parent / folder)
    for folder in ("tests/scripts", "benchmarks")
)


@pytest.fixture(autouse=True)
def _scripts_leave_no_modules() -> Iterator[None]:
    """Each test leaves sys.path, and the modules imported from the script folders, as it found
    them: another test's script would otherwise import a stale ``_common`` of another folder."""
    path, before = list(sys.path), set(sys.modules)
    yield
    sys.path[:] = path
    for name in set(sys.modules) - before:
        if (getattr(sys.modules.get(name), "__file__", None) or "").startswith(_SCRIPT_FOLDERS):
            del sys.modules[name]


def fakepg_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("fakepg-"))


@pytest.fixture
def no_leaked_threads() -> Iterator[None]:
    """Fail the test if it leaves any fake-world thread (rank, worker, timer) running."""
    before = set(fakepg_threads())
    yield
    leaked = set(fakepg_threads()) - before
    assert not leaked, f"threads left running: {sorted(leaked)}"


@pytest.fixture
def fakepg_torch_backend() -> Iterator[None]:
    """The fake world registered as torch.distributed's "fakepg" backend, for tests that run
    torch's own DDP (or FSDP2) beside this project's. init_process_group chains
    sys.excepthook; it is put back after the test."""
    fakepg.register_torch_backend()
    hook = sys.excepthook
    yield
    sys.excepthook = hook
