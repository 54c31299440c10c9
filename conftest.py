"""Hypothesis profiles for every test directory, chosen with HYPOTHESIS_PROFILE (``ci``,
``dev`` by default, ``thorough``: defined once, in ``reducer.testing.profiles``).

Also one intra-op thread per test process, unless OMP_NUM_THREADS says otherwise: the tests
run tiny tensors on many threads (ranks, fake-world workers, pytest-xdist workers), where
torch's OpenMP teams only oversubscribe the cores; on a busy two-core machine they made a
small convolution's backward 30 times slower. It must be set before torch is imported (this
file is loaded first), so that every thread of the process agrees on it.

The pytest plugin of ``reducer.testing`` (fixtures: ``fake_world``, ``on_every_rank``) is
loaded from here when the installed package does not register it as an entry point already.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from hypothesis import settings

from reducer.testing.plugin import ENTRY_POINT, loaded_by_entry_point
from reducer.testing.profiles import register_profiles

pytest_plugins = [] if loaded_by_entry_point() else [ENTRY_POINT]

register_profiles()
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
