"""Hypothesis profiles for every test directory, chosen with HYPOTHESIS_PROFILE.

- ``ci``: bounded and derandomized, so CI on two cores is quick and repeatable.
- ``dev`` (the default): more examples, random, failures saved and replayed from the database
  (``.hypothesis/examples``; a failing example is tried first on the next run).
- ``thorough``: many examples, for a long hunt (``tox -e property``).

Also one intra-op thread per test process, unless OMP_NUM_THREADS says otherwise: the tests
run tiny tensors on many threads (ranks, fake-world workers, pytest-xdist workers), where
torch's OpenMP teams only oversubscribe the cores; on a busy two-core machine they made a
small convolution's backward 30 times slower. It must be set before torch is imported (this
file is loaded first), so that every thread of the process agrees on it.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
# Every profile states its randomness and database outright: under a ``CI`` environment
# variable Hypothesis's own defaults turn derandomized with no database, and a profile that
# inherited them would silently stop saving and replaying failures.
_SAVED_FAILURES = DirectoryBasedExampleDatabase(".hypothesis/examples")

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "dev",
    max_examples=60,
    deadline=None,
    derandomize=False,
    database=_SAVED_FAILURES,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "thorough",
    max_examples=2000,
    deadline=None,
    derandomize=False,
    database=_SAVED_FAILURES,
    suppress_health_check=_SLOW_OK,
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
