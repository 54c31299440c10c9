"""Fixtures shared by the unit tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest


def fakepg_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("fakepg-"))


@pytest.fixture
def no_leaked_threads() -> Iterator[None]:
    """Fail the test if it leaves any fake-world thread (rank, worker, timer) running."""
    before = set(fakepg_threads())
    yield
    leaked = set(fakepg_threads()) - before
    assert not leaked, f"threads left running: {sorted(leaked)}"
