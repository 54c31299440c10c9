"""torch's own DDP test suite, run against torch's DistributedDataParallel and this one.

torch ships its main DDP tests in the wheel: ``DistributedTest._DistTestBase`` in
``torch/testing/_internal/distributed/distributed_test.py``. This runs those that build a
DDP (directly or through a helper: about a hundred) as upstream's
test/distributed/test_distributed_spawn.py runs them (``BACKEND=gloo``, ``WORLD_SIZE=2``,
``TEMP_DIR``, ``INIT_METHOD``; each test spawns one process per rank), in two modes:

- plain: as upstream runs them on this machine; most skip for want of 2 CUDA devices;
- cpu: the tests that skip only for that reason (``skip_if_lt_x_gpu(2)``,
  ``skip_if_no_gpu``), with CUDA devices in their arguments mapped to "cpu" and
  ``device_ids`` dropped (see benchmarks/_torch_suite_case.py);

and, in each mode, once with torch's DDP and once with ``reducer.DistributedDataParallel``
patched in for ``torch.nn.parallel.DistributedDataParallel`` in every rank. It prints one
row per test (torch's result, this DDP's, the reason of a failure or skip) and a summary:
how many torch's DDP passes, and how many of those this one passes too.

    PYTHONPATH=$PWD python benchmarks/torch_ddp_suite.py [--mode plain|cpu|both]
        [--impl torch|ours|both] [-k PATTERN ...] [--timeout 120] [--list] [--quiet]

``-k`` keeps the tests whose name contains any of the patterns (a Python regex search).
A whole run spawns some 400 rank processes; on 2 busy cores it takes the better part of an
hour: run a ``-k`` selection while developing. The ranks' logs go to ``--log``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import re
import sys
import tempfile
import time
import unittest
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _prepare_environment() -> str:
    """What upstream's test_distributed_spawn.py expects, set before torch's suite is
    imported; and a path on which the spawned ranks find this directory and the project.
    Called from main() only: each spawned rank imports this script again (as __mp_main__)."""
    temp = tempfile.mkdtemp(prefix="torch_ddp_suite_")
    os.makedirs(os.path.join(temp, "barrier"), exist_ok=True)
    os.environ.setdefault("BACKEND", "gloo")
    os.environ.setdefault("WORLD_SIZE", "2")
    os.environ["TEMP_DIR"] = temp
    os.environ.setdefault("INIT_METHOD", "env://")
    for path in (str(HERE), str(ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)
    return temp


@dataclass
class Outcome:
    """One test's result in one run: pass, fail, skip or error, and why."""

    result: str
    reason: str = ""
    seconds: float = 0.0


# -------------------------------------------------------------------------------------------
# Which tests.


def _base() -> type:
    from torch.testing._internal.distributed.distributed_test import DistributedTest

    return DistributedTest._DistTestBase  # type: ignore[no-any-return]


def _source(cls: type, name: str) -> str:
    func = getattr(cls, name, None)
    if not callable(func):
        return ""
    while hasattr(func, "__wrapped__"):
        func = func.__wrapped__
    try:
        return inspect.getsource(func)
    except (OSError, TypeError):
        return ""


def ddp_tests() -> list[str]:
    """The tests of _DistTestBase that build a DDP, directly or through a helper method."""
    base = _base()
    memo: dict[str, bool] = {}

    def builds(name: str, seen: set[str]) -> bool:
        if name in memo:
            return memo[name]
        if name in seen:
            return False
        seen.add(name)
        text = _source(base, name)
        found = bool(re.search(r"DistributedDataParallel|\bDDP\(", text)) or any(
            builds(helper, seen) for helper in set(re.findall(r"self\.(_\w+)\(", text))
        )
        memo[name] = found
        return found

    return [n for n in sorted(dir(base)) if n.startswith("test_") and builds(n, set())]


def _decorators(func: object) -> list[tuple[str, dict[str, object]]]:
    """The functools.wraps chain of a test: each wrapper's defining function and closure."""
    chain = []
    while hasattr(func, "__wrapped__"):
        code = func.__code__  # type: ignore[attr-defined]
        cells = func.__closure__ or ()  # type: ignore[attr-defined]
        values = {}
        for var, cell in zip(code.co_freevars, cells, strict=True):
            with contextlib.suppress(ValueError):
                values[var] = cell.contents if hasattr(cell, "contents") else cell.cell_contents
        chain.append((code.co_qualname.split(".<locals>")[0], values))
        func = func.__wrapped__
    return chain


def cuda_gated(name: str) -> bool:
    """Whether the test skips here only for want of 2 CUDA devices: it is gated by
    ``skip_if_lt_x_gpu(x <= 2)`` or ``skip_if_no_gpu``, and by no other skip."""
    func = getattr(_base(), name)
    if getattr(func, "__unittest_skip__", False):
        return False
    gated = False
    for wrapper, values in _decorators(func):
        if wrapper == "skip_if_lt_x_gpu":
            x = values.get("x")
            if not isinstance(x, int) or x > int(os.environ["WORLD_SIZE"]):
                return False
            gated = True
        elif wrapper == "skip_if_no_gpu":
            gated = True
        elif wrapper.startswith("skip") and wrapper != "skip_if_rocm_multiprocess":
            return False
    return gated


# -------------------------------------------------------------------------------------------
# Running.


@contextlib.contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Send this process's stderr (and so the spawned ranks') to ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


def _reason(text: str) -> str:
    """The line of a rank's traceback that says what went wrong."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for line in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Warning)\b.*:", line) or "Error:" in line:
            return line[:200]
    return (lines[-1] if lines else "")[:200]


class _Result(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.outcome = Outcome("error", "no result")

    def addSuccess(self, test: unittest.TestCase) -> None:
        self.outcome = Outcome("pass")

    def addFailure(self, test: unittest.TestCase, err: object) -> None:
        self.outcome = Outcome("FAIL", _reason(self._exc_info_to_string(err, test)))  # type: ignore[arg-type]

    def addError(self, test: unittest.TestCase, err: object) -> None:
        self.outcome = Outcome("FAIL", _reason(self._exc_info_to_string(err, test)))  # type: ignore[arg-type]

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        self.outcome = Outcome("skip", reason[:200])


def run_one(name: str, impl: str, cpu: bool, log: Path) -> Outcome:
    """Run test ``name`` of the suite with ``impl``'s DDP, CPU-mapped or not."""
    os.environ["DDP_SUITE_IMPL"] = impl
    os.environ["DDP_SUITE_CPU"] = "1" if cpu else "0"
    import _torch_suite_case

    case = _torch_suite_case.TestDistBackendWithSpawn(name)
    result = _Result()
    start = time.monotonic()
    with _stderr_to(log):
        print(f"===== {name} impl={impl} cpu={cpu}", file=sys.stderr, flush=True)
        case.run(result)
    result.outcome.seconds = time.monotonic() - start
    return result.outcome


def _has_cuda_devices() -> bool:
    """What the CUDA skips of torch's suite ask: a CUDA device per rank."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])


def _as_json(results: dict[str, dict[str, dict[str, Outcome]]]) -> object:
    return {
        mode: {
            impl: {n: dataclasses.asdict(o) for n, o in outs.items()} for impl, outs in r.items()
        }
        for mode, r in results.items()
    }


def _set_timeout(seconds: int) -> None:
    from torch.testing._internal import common_distributed

    common_distributed.TIMEOUT_DEFAULT = seconds
    for key in list(common_distributed.TIMEOUT_OVERRIDE):
        common_distributed.TIMEOUT_OVERRIDE[key] = min(
            common_distributed.TIMEOUT_OVERRIDE[key], seconds
        )


# -------------------------------------------------------------------------------------------
# Reporting.


def _short(outcome: Outcome | None) -> str:
    return "-" if outcome is None else outcome.result


def report(mode: str, names: list[str], runs: dict[str, dict[str, Outcome]]) -> tuple[int, int]:
    """Print the comparison table of one mode; return (torch passes, ours among them)."""
    torch_runs, ours_runs = runs.get("torch", {}), runs.get("ours", {})
    rows = []
    for name in names:
        t, o = torch_runs.get(name), ours_runs.get(name)
        reason = ""
        if o is not None and o.result != "pass":
            reason = o.reason
        elif t is not None and t.result != "pass":
            reason = t.reason
        rows.append((name, _short(t), _short(o), reason))
    width = max([len(r[0]) for r in rows] + [4])
    print(f"\n## mode: {mode}\n")
    print(f"| {'test'.ljust(width)} | torch | ours  | reason")
    print(f"|{'-' * (width + 2)}|-------|-------|-------")
    for name, t_res, o_res, reason in rows:
        mark = " *" if t_res == "pass" and o_res not in ("pass", "-") else ""
        print(f"| {name.ljust(width)} | {t_res:5} | {o_res:5} | {reason}{mark}")
    torch_pass = [n for n in names if torch_runs.get(n, Outcome("-")).result == "pass"]
    both = [n for n in torch_pass if ours_runs.get(n, Outcome("-")).result == "pass"]
    ours_pass = sum(1 for n in names if ours_runs.get(n, Outcome("-")).result == "pass")
    print(
        f"\nsummary {mode}: {len(names)} tests; torch's DDP passes {len(torch_pass)}; "
        f"this DDP passes {len(both)} of those ({ours_pass} in all)"
    )
    return len(torch_pass), len(both)


def main(argv: list[str] | None = None) -> int:
    temp = _prepare_environment()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("plain", "cpu", "both"), default="both")
    parser.add_argument("--impl", choices=("torch", "ours", "both"), default="both")
    parser.add_argument("-k", action="append", default=[], help="regex on the test name")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per test")
    parser.add_argument("--log", type=Path, default=Path(temp) / "ranks.log")
    parser.add_argument("--list", action="store_true", help="list the selected tests")
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    parser.add_argument("--save", type=Path, help="write every result to this JSON file")
    parser.add_argument(
        "--load", type=Path, action="append", default=[],
        help="take results from a file --save wrote instead of running them again",
    )  # fmt: skip
    parser.add_argument(
        "--where-torch-passes", type=Path,
        help="run this DDP only on the tests that torch's DDP passes in a file --save wrote",
    )  # fmt: skip
    args = parser.parse_args(argv)

    _set_timeout(args.timeout)
    selected = [n for n in ddp_tests() if not args.k or any(re.search(k, n) for k in args.k)]
    modes = ("plain", "cpu") if args.mode == "both" else (args.mode,)
    impls = ("torch", "ours") if args.impl == "both" else (args.impl,)
    plan = {m: selected if m == "plain" else [n for n in selected if cuda_gated(n)] for m in modes}
    if args.list:
        for mode, names in plan.items():
            print(f"{mode}: {len(names)} tests")
            for name in names:
                print(f"  {name}")
        return 0

    saved: dict[str, dict[str, dict[str, Outcome]]] = {}
    for path in args.load:
        for mode, by_impl in json.loads(path.read_text()).items():
            for impl, outcomes in by_impl.items():
                for name, fields in outcomes.items():
                    saved.setdefault(mode, {}).setdefault(impl, {})[name] = Outcome(**fields)
    torch_passes: dict[str, set[str]] | None = None
    if args.where_torch_passes:
        loaded = json.loads(args.where_torch_passes.read_text())
        torch_passes = {
            mode: {n for n, o in r.get("torch", {}).items() if o["result"] == "pass"}
            for mode, r in loaded.items()
        }
    totals = {}
    results: dict[str, dict[str, dict[str, Outcome]]] = {}
    for mode, names in plan.items():
        runs = results.setdefault(mode, {impl: {} for impl in impls})
        for impl, outcomes in saved.get(mode, {}).items():
            runs.setdefault(impl, {}).update({n: o for n, o in outcomes.items() if n in names})
        for name in names:
            for impl in impls:
                if name in runs[impl]:
                    continue
                if impl == "ours" and name not in (torch_passes or {}).get(mode, {name}):
                    continue  # --where-torch-passes: torch's DDP does not pass it
                if mode == "plain" and cuda_gated(name) and not _has_cuda_devices():
                    # The test's own decorator would skip it in each rank; said here, without
                    # spawning them.
                    outcome = Outcome("skip", "Need at least 2 CUDA devices (not spawned)")
                else:
                    outcome = run_one(name, impl, mode == "cpu", args.log)
                runs[impl][name] = outcome
                if args.save:
                    args.save.write_text(json.dumps(_as_json(results), indent=1))
                if not args.quiet:
                    print(
                        f"[{mode}] {name} {impl}: {outcome.result} ({outcome.seconds:.1f} s) "
                        f"{outcome.reason}",
                        flush=True,
                    )
        totals[mode] = report(mode, names, runs)
    print()
    for mode, (torch_pass, both) in totals.items():
        print(f"acceptance {mode}: this DDP passes {both} of the {torch_pass} torch's DDP passes")
    print(f"rank logs: {args.log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
