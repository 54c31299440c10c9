"""The Hypothesis profiles the properties run under, defined once.

- ``ci``: bounded and derandomized, so CI on two cores is quick and repeatable; a failure is
  printed with its reproduction blob.
- ``dev``: more examples, random, failures saved and replayed from the database
  (``.hypothesis/examples``; a failing example is tried first on the next run).
- ``thorough``: many examples, for a long hunt.

:func:`register_profiles` registers them (the project's root ``conftest.py`` does, then loads
the one ``HYPOTHESIS_PROFILE`` names; the pytest plugin does with ``--ddp-profile``).
Registering is all it does: which profile is loaded stays the caller's choice.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

__all__ = ["CI_MAX_EXAMPLES", "PROFILES", "register_profiles"]

PROFILES = ("ci", "dev", "thorough")
CI_MAX_EXAMPLES = 25
_SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large]
# The directory failures are saved in, relative to where pytest runs.
_DATABASE = ".hypothesis/examples"


def register_profiles() -> None:
    """Register ``ci``, ``dev`` and ``thorough`` with Hypothesis (idempotent)."""
    # Every profile states its randomness and database outright: under a ``CI`` environment
    # variable Hypothesis's own defaults turn derandomized with no database, and a profile
    # that inherited them would silently stop saving and replaying failures.
    saved = DirectoryBasedExampleDatabase(_DATABASE)
    settings.register_profile(
        "ci",
        max_examples=CI_MAX_EXAMPLES,
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
        database=saved,
        suppress_health_check=_SLOW_OK,
    )
    settings.register_profile(
        "thorough",
        max_examples=2000,
        deadline=None,
        derandomize=False,
        database=saved,
        suppress_health_check=_SLOW_OK,
    )
