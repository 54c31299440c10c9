"""Harness power: how many seeded bugs the property suite alone kills, how fast, how small.

For each mutant of ``property_tests/mutants.py`` (``CATALOGUE``), a subprocess runs the
property suite with the mutant in place of the real code (``PROPERTY_TESTS_MUTANT``, see
``property_tests/conftest.py``): the fourteen property files (the reducer's, those that
check this project's DDP, torch's DDP and its comm hooks, FSDP2 and a user's wrapper,
training steps (micro-batches, post-local SGD), the one that checks ``reducer.testing``'s
own check and scenarios, launch's pre-import, the replica check, and this project's DDP
against torch's with its newest options), under
the ``ci`` profile's example counts (derandomized; the core properties get four times the
profile's examples, the unused-parameter and DDP ones eight), generate and shrink phases
only (a failing explicit example would be reported unshrunk). The unit tests (``tests/``)
and the files that test the harness itself (``test_mutants.py``, ``test_profiles.py``,
``test_harness.py``) are left out: the properties alone must kill.

One row per mutant: killed (some property failed), the property that killed it fastest, its
time to kill (that property's run: search plus shrinking, as pytest timed it), and the size of
the example it reported (parameters, ranks; "-" where the example has no ranks, as bucket
assignment), then how many properties failed. Then killed / total, the median time to kill,
and how many reported examples are within 3 parameters and 3 ranks (three: the smallest
world where a rounding that differs only off the powers of two shows). The anchor is the same
suite against the real code, in the same run: every property must pass, and its time is the
cost of a run that kills nothing.

``property_tests/test_mutants.py`` is the fast check CI runs (a narrowed search per mutant);
this script is the full measurement. The mutants of the "torch comm hooks" group replace
torch's own hooks (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``) and are
caught by the properties that run torch's DDP. With ``--jobs 2`` on 2 cores, the 42 mutants
took about 20 minutes on a quiet machine.

    python benchmarks/harness_power.py [--jobs 2] [--mutant NAME ...] [--json results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

# One intra-op thread, as the test suite runs (conftest.py): set before torch is imported, so
# that the machine line says what the suites run with.
os.environ.setdefault("OMP_NUM_THREADS", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, table

from property_tests.mutants import CATALOGUE

ROOT = Path(__file__).resolve().parents[1]
PROPERTIES = (
    "test_exact_averaging.py",
    "test_unused_parameters.py",
    "test_accumulation.py",
    "test_multi_iteration.py",
    "test_ddp_properties.py",
    "test_errors.py",
    "test_torch_equivalence.py",
    "test_wrappers.py",
    "test_torch_comm_hooks.py",
    "test_check_strictness.py",
    "test_launch_preimport.py",
    "test_replica_check.py",
    "test_training_steps.py",
    "test_wrapper_options.py",
)
REAL = "(real code)"
WITHIN = (3, 3)  # the goal: reported examples of at most 3 parameters and 3 ranks


@dataclass(frozen=True)
class Outcome:
    """What the property suite did against one mutant (or the real code)."""

    mutant: str
    group: str
    killed: bool
    killed_by: str | None
    seconds_to_kill: float | None
    parameters: int | None
    ranks: int | None
    failing: tuple[str, ...]
    suite_seconds: float


def run_suite(mutant: str | None, profile: str, timeout_s: float) -> Outcome:
    """The property suite in a subprocess, with ``mutant`` in place (None: the real code)."""
    with tempfile.TemporaryDirectory() as scratch:
        record = Path(scratch) / "record.jsonl"
        env = dict(os.environ, HYPOTHESIS_PROFILE=profile, PROPERTY_TESTS_RECORD=str(record))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        if mutant is not None:
            env["PROPERTY_TESTS_MUTANT"] = mutant
        command = [
            sys.executable,
            "-m",
            "pytest",
            *(f"property_tests/{name}" for name in PROPERTIES),
            "-q",
            "-n",
            "0",  # one process: the mutant is applied in it
            "-p",
            "no:randomly",
            f"--timeout={int(timeout_s)}",
        ]
        start = time.perf_counter()
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, check=False
        )
        elapsed = time.perf_counter() - start
        # pytest's 0 is "all passed" and 1 "some failed"; anything else (an import or usage
        # error, an interrupted run) means the suite did not run, which is neither a kill
        # nor a pass.
        if done.returncode not in (0, 1):
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            raise RuntimeError(
                f"the property suite did not run (pytest exit code {done.returncode}) "
                f"for {mutant or REAL}:\n{tail}"
            )
        lines = record.read_text().splitlines() if record.exists() else []
    tests = [json.loads(line) for line in lines]
    failed = sorted((t for t in tests if not t["passed"]), key=lambda t: t["seconds"])
    first = failed[0] if failed else None
    return Outcome(
        mutant=mutant or REAL,
        group=CATALOGUE[mutant].group if mutant else "",
        killed=bool(failed),
        killed_by=_short(first["test"]) if first else None,
        seconds_to_kill=first["seconds"] if first else None,
        parameters=first["parameters"] if first else None,
        ranks=first["ranks"] if first else None,
        failing=tuple(_short(t["test"]) for t in failed),
        suite_seconds=elapsed,
    )


def _short(nodeid: str) -> str:
    """``test_errors.py::test_x`` from ``property_tests/test_errors.py::test_x``."""
    return nodeid.split("/")[-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="suites run at once (one per core)")
    parser.add_argument("--mutant", action="append", help="only these (repeatable)")
    parser.add_argument("--profile", default="ci", help="Hypothesis profile (default: ci)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per property, seconds")
    parser.add_argument("--json", type=Path, help="also write every outcome here")
    args = parser.parse_args(argv)
    names = args.mutant or list(CATALOGUE)
    unknown = sorted(set(names) - set(CATALOGUE))
    if unknown:
        parser.error(f"unknown mutants {unknown}; the catalogue has {sorted(CATALOGUE)}")

    print("# harness power: the property suite alone against each mutant")
    print(f"# machine: {machine()}")
    print(f"# profile: {args.profile} (generate and shrink phases), {args.jobs} suites at once\n")

    def one(mutant: str | None) -> Outcome:
        outcome = run_suite(mutant, args.profile, args.timeout)
        verdict = f"killed by {outcome.killed_by}" if outcome.killed else "not killed"
        print(f"  {outcome.mutant}: {verdict} ({outcome.suite_seconds:.0f} s)", file=sys.stderr)
        return outcome

    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        outcomes = list(pool.map(one, [None, *names]))
    anchor, results = outcomes[0], outcomes[1:]

    rows = [
        [
            o.mutant,
            o.group,
            "yes" if o.killed else "NO",
            o.killed_by or "-",
            f"{o.seconds_to_kill:.1f}" if o.seconds_to_kill is not None else "-",
            o.parameters if o.parameters is not None else "-",
            o.ranks if o.ranks is not None else "-",
            len(o.failing),
        ]
        for o in results
    ]
    headers = [
        "mutant",
        "group",
        "killed",
        "killed first by",
        "time to kill (s)",
        "parameters",
        "ranks",
        "properties failing",
    ]
    print(table(headers, rows))
    killed = [o for o in results if o.killed]
    within = [o for o in killed if (o.parameters or 0) <= WITHIN[0] and (o.ranks or 0) <= WITHIN[1]]
    times = [o.seconds_to_kill for o in killed if o.seconds_to_kill is not None]
    print()
    print(f"killed: {len(killed)}/{len(results)}")
    if times:
        print(f"median time to kill: {statistics.median(times):.1f} s (max {max(times):.1f} s)")
    print(
        f"reported examples within {WITHIN[0]} parameters and {WITHIN[1]} ranks: "
        f"{len(within)}/{len(killed)}"
    )
    anchor_ok = not anchor.killed
    print(
        f"anchor, the real code: {'every property passes' if anchor_ok else 'FAILS'} "
        f"({', '.join(anchor.failing) or 'none failing'}), suite {anchor.suite_seconds:.0f} s"
    )
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=2))
    return 0 if anchor_ok and len(killed) == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
