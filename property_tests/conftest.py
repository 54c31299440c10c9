"""The property suite against a mutant, and a record of what each property found.

Two environment variables, set by ``benchmarks/harness_power.py`` for a run of its own:

- ``PROPERTY_TESTS_MUTANT=<name>`` puts that mutant of ``property_tests.mutants.CATALOGUE``
  in place of the real code for the whole run (before any test module is imported), and
  loads the ``mutation`` profile: the profile named by ``HYPOTHESIS_PROFILE`` without its
  explicit examples (Hypothesis reports a failing explicit example as it is, unshrunk; the
  measurement is of what generation finds and how far it shrinks) and without the explain
  phase (which only reruns variants of the shrunk example).
- ``PROPERTY_TESTS_RECORD=<path>`` appends one JSON line per test to ``path``: its id, whether
  it passed, how long it ran (for a failing property: searching plus shrinking), and the size
  of the example it checked last (after a failure, the reported one: Hypothesis runs the
  shrunk example last), as parameters and ranks.

Without them, this file only silences torch's warning about ``backward(create_graph=True)``
leaving a reference cycle, which the higher-order scenarios trigger on purpose.
"""

from __future__ import annotations

import json
import os
from collections.abc import Generator
from typing import Any

import pluggy
import pytest
from hypothesis import Phase, settings

from reducer.testing.harness import last_example_size

_MUTANT = os.environ.get("PROPERTY_TESTS_MUTANT")
_RECORD = os.environ.get("PROPERTY_TESTS_RECORD")

if _MUTANT:
    from .mutants import CATALOGUE, applied

    if _MUTANT not in CATALOGUE:
        raise pytest.UsageError(
            f"PROPERTY_TESTS_MUTANT={_MUTANT!r} is not in property_tests.mutants.CATALOGUE; "
            f"choose one of {sorted(CATALOGUE)}"
        )
    settings.register_profile(
        "mutation",
        settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev")),
        phases=[Phase.generate, Phase.target, Phase.shrink],
    )
    settings.load_profile("mutation")
    # For the whole process: the subprocess exists for this one mutant. The context is kept
    # referenced: a collected generator would run its finally and restore the real code.
    _APPLIED = applied(CATALOGUE[_MUTANT])
    _APPLIED.__enter__()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "filterwarnings", r"ignore:Using backward\(\) with create_graph=True:UserWarning"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[Any]
) -> Generator[None, pluggy.Result[pytest.TestReport], None]:
    outcome = yield
    if not _RECORD or call.when != "call":
        return
    report = outcome.get_result()
    size = last_example_size[0] if last_example_size else (None, None)
    last_example_size.clear()
    line = {
        "test": item.nodeid,
        "passed": report.passed,
        "seconds": round(call.duration, 3),
        "parameters": size[0],
        "ranks": size[1],
    }
    with open(_RECORD, "a") as record:
        record.write(json.dumps(line) + "\n")
