"""Hypothesis profiles for every test directory, chosen with HYPOTHESIS_PROFILE (``ci``,
``dev`` by default, ``thorough``: defined once, in ``reducer.testing.profiles``).

Also one intra-op thread per test process, unless OMP_NUM_THREADS says otherwise: the tests
run tiny tensors on many threads (ranks, fake-world workers, pytest-xdist workers), where
torch's OpenMP teams only oversubscribe the cores; on a busy two-core machine they made a
small convolution's backward 30 times slower. The variable reaches the subprocesses the tests
start; this process may have imported torch already (the ``reducer.testing`` plugin, loaded
by its entry point before this file), so its count is also set here. The tests, their rank
threads and their subprocesses then compute with the same count, and so with the same bits.

The pytest plugin of ``reducer.testing`` (fixtures: ``fake_world``, ``on_every_rank``) is
loaded from here when the installed package does not register it as an entry point already.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
from hypothesis import settings

from reducer.testing.plugin import ENTRY_POINT, loaded_by_entry_point
from reducer.testing.profiles import register_profiles

pytest_plugins = [] if loaded_by_entry_point() else [ENTRY_POINT]

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

register_profiles()
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
