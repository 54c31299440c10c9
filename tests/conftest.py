"""Fixtures shared by the unit tests."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

import fakepg


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
