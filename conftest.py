"""Hypothesis profiles for every test directory, chosen with HYPOTHESIS_PROFILE.

- ``ci``: bounded and derandomized, so CI on two cores is quick and repeatable.
- ``dev`` (the default): more examples, random, failures saved and replayed from the database.
- ``thorough``: many examples, for a long hunt (``tox -e property``).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]

settings.register_profile(
    "ci",
    max_examples=25,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile("dev", max_examples=60, deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile(
    "thorough", max_examples=2000, deadline=None, suppress_health_check=_SLOW_OK
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
