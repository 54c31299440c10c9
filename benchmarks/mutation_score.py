"""Mutation score of the property suite alone: mutmut's mutants of a module, killed or not.

For each target (a module, optionally some of its functions, and the property tests that
draw them), this copies the project into a work folder, points mutmut at that module and
those tests (``[tool.mutmut]`` of pyproject.toml, narrowed in the copy), runs it for at most
``--limit-s`` seconds, and prints one row per target: mutants, killed, survived, timed out,
no tests (no selected test calls the mutated function), not checked (the time limit came
first) and the score, (killed + timed out) / (killed + survived + timed out): a mutant that
makes the properties hang is caught too (pytest-timeout fails them in CI). ``--show`` prints each
survivor's diff, to triage (a property that draws its corner, or a Note saying why the
mutant is equivalent: docs/design/mutation-testing.md). Not part of CI: a target takes
minutes (every mutant reruns the property tests that reach it).

    PYTHONPATH=$PWD python benchmarks/mutation_score.py [TARGET ...] [--list] [--show]
        [--limit-s 600] [--mutmut PATH] [--workdir DIR [--resume]]

mutmut is not a dependency of the project: install it where you run this
(``python -m venv --system-site-packages /tmp/mut && /tmp/mut/bin/pip install mutmut==3.8.1``,
then ``--mutmut /tmp/mut/bin/mutmut``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COPIED = ("reducer", "fakepg", "property_tests", "conftest.py", "pyproject.toml")


@dataclass(frozen=True)
class Target:
    """A module, the functions of it to mutate (empty: every one; ``Class.method`` for a
    method), and the property tests (pytest arguments) that run against the mutants."""

    module: str  # a path: reducer/ddp/_setup.py
    functions: tuple[str, ...]
    tests: tuple[str, ...]


# The modules (or functions) changed for the features the properties now draw, and those
# tests. Names are what the first column prints.
TARGETS: dict[str, Target] = {
    "streams": Target("fakepg/streams.py", (), ("property_tests/test_stream_order.py",)),
    "rebuild-sync": Target(
        "reducer/ddp/_setup.py",
        ("sync_bucket_indices",),
        ("property_tests/test_wrapper_options.py", "-k", "caps"),
    ),
    "rebuild": Target(
        "reducer/ddp/_wrapper.py",
        ("DistributedDataParallel._rebuild_buckets", "DistributedDataParallel._should_rebuild"),
        ("property_tests/test_wrapper_options.py", "-k", "caps or static"),
    ),
    "mixed-precision": Target(
        "reducer/ddp/_mixed_precision.py",
        ("setup", "_twin_attributes"),
        ("property_tests/test_wrappers.py", "-k", "mixed_precision"),
    ),
    "hierarchical": Target(
        "reducer/testing/algorithms.py",
        ("_Hierarchical.__init__", "_Hierarchical.parameter_groups_at", "_consecutive"),
        ("property_tests/test_training_steps.py", "-k", "hierarchical"),
    ),
    # The search for a wrapper wrong only at three ranks (the scenarios' property) reruns
    # the check 25 times: left out here, where the check itself is mutated. The bounded
    # comparison is drawn by the strictness properties (a hook moved inside or beyond its
    # bounds) and by torch's hooks under the check (PowerSGD within atol and rtol);
    # test_comm_hook_bounds.py derives PowerSGD's bounds without the check (it reaches no
    # mutant here), its slow error-feedback property left out.
    "judge-roundings": Target(
        "reducer/testing/_judge.py",
        ("_judge_one", "_same"),
        (
            "property_tests/test_check_strictness.py",
            "property_tests/test_torch_comm_hooks.py",
            "property_tests/test_comm_hook_bounds.py",
            "-k",
            "not division and not error_feedback",
        ),
    ),
    "averages": Target(
        "reducer/_averages.py",
        ("average", "averages", "_terms", "bits_equal", "rank_order_sum"),
        ("property_tests/test_check_strictness.py", "-k", "not division"),
    ),
    "replica-join": Target(
        "reducer/tools/check/_check.py",
        ("ReplicaCheck._joining",),
        ("property_tests/test_replica_check.py", "-k", "plain"),
    ),
}


def mutant_glob(target: Target, function: str) -> str:
    """mutmut's name for the mutants of ``function`` (its trampoline's: x_f, xǁCǁm)."""
    module = target.module.removesuffix(".py").replace("/", ".")
    if "." in function:
        cls, method = function.split(".", 1)
        return f"{module}.x\u01c1{cls}\u01c1{method}__mutmut_*"
    return f"{module}.x_{function}__mutmut_*"


def _narrowed_config(text: str, target: Target) -> str:
    """pyproject.toml with [tool.mutmut] pointed at ``target`` alone."""
    only = f"only_mutate = {json.dumps([target.module])}"
    tests = f"pytest_add_cli_args_test_selection = {json.dumps(list(target.tests))}"
    text = re.sub(r"^only_mutate = .*$", only, text, flags=re.M)
    text = re.sub(r"^do_not_mutate = .*$", "do_not_mutate = []", text, flags=re.M)
    return re.sub(r"^pytest_add_cli_args_test_selection = .*$", tests, text, flags=re.M)


@dataclass
class Result:
    name: str
    target: Target
    counts: Counter[str]
    survivors: list[str]
    seconds: float
    folder: Path

    @property
    def score(self) -> float | None:
        caught = self.counts["killed"] + self.counts["timeout"]
        judged = caught + self.counts["survived"]
        return None if not judged else caught / judged


# mutmut's exit codes (its stats.status_by_exit_code), read from its .meta files.
_STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 36: "timeout"}
_STATUS.update({24: "timeout", -24: "timeout", 152: "timeout", 255: "timeout", 34: "skipped"})


def run_target(
    name: str, target: Target, mutmut: str, limit_s: float, work: Path, *, resume: bool = False
) -> Result:
    """Run ``target`` in ``work/name``: a fresh copy of the project, or, with ``resume``,
    the copy a run stopped by its time limit left (mutmut checks only what it has not)."""
    folder = work / name
    if not (resume and (folder / "mutants").exists()):
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
        for item in COPIED:
            source = ROOT / item
            if source.is_dir():
                shutil.copytree(source, folder / item, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(source, folder / item)
        config = folder / "pyproject.toml"
        config.write_text(_narrowed_config(config.read_text(), target))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the copy, not ROOT
    env.update(HYPOTHESIS_PROFILE="ci", OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    globs = [mutant_glob(target, f) for f in target.functions]
    start = time.monotonic()
    with open(folder / "mutmut.log", "w") as log:
        process = subprocess.Popen(
            [mutmut, "run", "--max-children", "1", *globs],
            cwd=folder,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            process.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            process.terminate()  # mutmut ends its workers; the rest stays "not checked"
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    seconds = time.monotonic() - start
    meta = folder / "mutants" / (target.module + ".meta")
    codes: dict[str, int | None] = {}
    if meta.exists():
        codes = json.loads(meta.read_text())["exit_code_by_key"]
    wanted = [key for key in codes if not globs or any(_fnmatch(key, pattern) for pattern in globs)]
    counts: Counter[str] = Counter()
    survivors = []
    for key in wanted:
        code = codes[key]
        status = "not checked" if code is None else _STATUS.get(code, "suspicious")
        counts[status] += 1
        if status == "survived":
            survivors.append(key)
    return Result(name, target, counts, survivors, seconds, folder)


def _fnmatch(name: str, pattern: str) -> bool:
    import fnmatch

    return fnmatch.fnmatchcase(name, pattern)


def show(mutmut: str, result: Result, key: str) -> str:
    shown = subprocess.run(
        [mutmut, "show", key],
        cwd=result.folder,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        check=False,
    )
    return shown.stdout.strip()


COLUMNS = ("killed", "survived", "timeout", "no tests", "not checked")


def table(results: list[Result]) -> str:
    lines = [
        "| target | module (functions) | mutants | " + " | ".join(COLUMNS) + " | score | seconds |",
        "|---" * (len(COLUMNS) + 5) + "|",
    ]
    for r in results:
        named = f" ({', '.join(r.target.functions)})" if r.target.functions else ""
        where = r.target.module + named
        total = sum(r.counts.values())
        score = "-" if r.score is None else f"{100 * r.score:.0f}%"
        cells = " | ".join(str(r.counts[c]) for c in COLUMNS)
        lines.append(f"| {r.name} | {where} | {total} | {cells} | {score} | {r.seconds:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", help=f"of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--list", action="store_true", help="list the targets and exit")
    parser.add_argument("--show", action="store_true", help="print each survivor's diff")
    parser.add_argument("--limit-s", type=float, default=600.0, help="per target")
    parser.add_argument("--mutmut", default=shutil.which("mutmut") or "mutmut")
    parser.add_argument("--workdir", type=Path, help="keep the copies here (default: a temp)")
    parser.add_argument(
        "--resume", action="store_true", help="go on where a run in --workdir stopped"
    )
    args = parser.parse_args(argv)
    if args.list:
        for name, t in TARGETS.items():
            print(f"{name}: {t.module} {list(t.functions)} <- {' '.join(t.tests)}")
        return 0
    unknown = [t for t in args.targets if t not in TARGETS]
    if unknown:
        parser.error(f"unknown target(s) {unknown}; --list shows them")
    if not Path(args.mutmut).exists() and shutil.which(args.mutmut) is None:
        parser.error(f"mutmut not found at {args.mutmut!r}: install it, or pass --mutmut PATH")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mutation_score_"))
    results = []
    for name in args.targets or list(TARGETS):
        result = run_target(
            name, TARGETS[name], args.mutmut, args.limit_s, work, resume=args.resume
        )
        results.append(result)
        print(f"{name}: {dict(result.counts)} in {result.seconds:.0f} s", file=sys.stderr)
    print(f"mutmut against the property tests alone; per target at most {args.limit_s:.0f} s\n")
    print(table(results))
    for result in results:
        if result.survivors:
            print(f"\nsurvivors of {result.name}:")
            for key in result.survivors:
                print(f"- {key}")
                if args.show:
                    print(show(args.mutmut, result, key))
    print(f"\nwork folders: {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
