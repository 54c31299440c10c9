"""The pytest plugin of ``reducer.testing``, registered by the package's ``pytest11`` entry
point, so that installing ``ddp-reducer[testing]`` makes it available to every test suite.

It does nothing until used (as Hypothesis's own plugin): its fixtures exist only for the
tests that ask for them, and its one option, ``--ddp-profile NAME``, registers the profiles
of :mod:`reducer.testing.profiles` and loads ``NAME`` (``ci``, ``dev`` or ``thorough``).

Fixtures:

- ``world_size``: 2; override it with ``@pytest.mark.parametrize("world_size", [...])``.
- ``fake_world``: a :class:`fakepg.World` of ``world_size`` ranks, closed after the test.
- ``on_every_rank``: ``on_every_rank(fn, *, torch=False)`` runs ``fn(pg)`` on one thread
  per rank of a fresh fake world of ``world_size`` ranks and returns the results in rank
  order; with ``torch=True``, torch.distributed's default group is initialized on the same
  world first (so ``DistributedDataParallel(model)`` and ``fully_shard`` run on it).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest

import fakepg

T = TypeVar("T")
OPTION = "--ddp-profile"
ENTRY_POINT = "reducer.testing.plugin"


def loaded_by_entry_point() -> bool:
    """Whether pytest loads this plugin by the installed package's entry point.

    A suite that also names it (``pytest_plugins``, ``-p``) must not where this is true:
    pytest refuses a plugin registered twice. Every distribution on the path is read, as
    pytest reads them, since a stale ``*.egg-info`` in a checkout can shadow the installed
    distribution by name in ``importlib.metadata.entry_points()``.
    """
    from importlib.metadata import distributions

    return any(
        ep.group == "pytest11" and ep.value == ENTRY_POINT
        for dist in distributions()
        for ep in dist.entry_points
    )


class RunOnEveryRank:
    """What the ``on_every_rank`` fixture returns (see the module docstring)."""

    def __init__(self, world_size: int, timeout: float) -> None:
        self.world_size = world_size
        self.timeout = timeout

    def __call__(
        self, fn: Callable[[fakepg.FakeProcessGroup], T], *, torch: bool = False
    ) -> list[T]:
        if not callable(fn):
            raise ValueError(f"on_every_rank: fn must be callable, got {fn!r}")
        if not torch:
            return fakepg.run(fn, self.world_size, timeout=self.timeout)
        # init_process_group chains sys.excepthook: put the test's own back afterwards.
        hook = sys.excepthook
        try:
            return fakepg.run_torch(fn, self.world_size, timeout=self.timeout)
        finally:
            sys.excepthook = hook


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ddp-reducer", "ddp-reducer's data-parallel testing")
    group.addoption(
        OPTION,
        action="store",
        default=None,
        metavar="NAME",
        help="load the Hypothesis profile NAME of reducer.testing.profiles (ci, dev, thorough)",
    )


def pytest_configure(config: pytest.Config) -> None:
    name = config.getoption(OPTION, default=None)
    if name is None:
        return
    # Imported only when asked for: a suite that never uses the option pays nothing.
    from hypothesis import settings

    from .profiles import PROFILES, register_profiles

    if name not in PROFILES:
        raise pytest.UsageError(f"{OPTION}={name!r}: choose one of {', '.join(PROFILES)}")
    register_profiles()
    settings.load_profile(name)


@pytest.fixture
def world_size() -> int:
    """Ranks of the ``fake_world`` and ``on_every_rank`` fixtures; parametrize to change."""
    return 2


@pytest.fixture
def fake_world(world_size: int) -> Iterator[fakepg.World]:
    """A fake world of ``world_size`` ranks (``world.group(rank)``, ``world.run(fn)``)."""
    with fakepg.World(world_size, timeout=30.0) as world:
        yield world


@pytest.fixture
def on_every_rank(world_size: int) -> RunOnEveryRank:
    """Runs a function on every rank of a fresh fake world of ``world_size`` ranks."""
    return RunOnEveryRank(world_size, timeout=60.0)
