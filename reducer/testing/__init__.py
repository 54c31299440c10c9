"""Property-based tests for data-parallel training: this project's, torch's, and yours.

Installed with the package (``pip install "ddp-reducer[testing]"`` adds Hypothesis and
pytest). It holds what the project's own property suite is built on:

- :mod:`~reducer.testing.reference`: the exact rank-order average a reduced gradient must
  equal on the fake world (``rank_order_average``), with torch's rounding or the bare
  reducer's (``scaling``);
- :mod:`~reducer.testing.model`, :mod:`~reducer.testing.strategies`: random models described
  by plain data, and Hypothesis strategies for models, bucket assignments, world sizes,
  unused-parameter patterns and whole reducer scenarios;
- :mod:`~reducer.testing.harness`: plays a reducer scenario on the fake world and checks it
  against the reference (``check_against_reference``).

This module is a tool layer: it imports the core and ``fakepg``; the core never imports it.
Importing it registers nothing (see :mod:`reducer.testing.plugin` for the pytest plugin).
"""

from __future__ import annotations

from .harness import Scenario, check_against_reference
from .reference import rank_order_average, sparse_average

__all__ = [
    "Scenario",
    "check_against_reference",
    "rank_order_average",
    "sparse_average",
]
