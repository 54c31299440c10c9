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

``--world fake`` runs each test's ranks as threads of one fake world instead (see
benchmarks/_torch_suite_fake.py): the same test class, torch's own scaffolding judging the
ranks' exit codes, in a worker process per mode and DDP that runs one test after another (a
test that does not answer within ``--timeout`` plus two minutes has its worker killed, and the
next test gets a new one). ``--world both`` runs every test in both worlds, one after the
other, and ends with a comparison: verdicts that differ, and the seconds of each world.

    PYTHONPATH=$PWD python benchmarks/torch_ddp_suite.py --world fake --mode cpu
    PYTHONPATH=$PWD python benchmarks/torch_ddp_suite.py --world both --mode cpu -k hook
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import re
import select
import statistics
import subprocess
import sys
import tempfile
import time
import unittest
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

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


# -------------------------------------------------------------------------------------------
# The fake world: a worker process per mode and DDP (the CPU mapping and the DDP patched in
# are one process's, as in each spawned rank), running the tests it is sent one at a time.

# How long the runner waits for a worker to start, and for a test beyond its --timeout (the
# worker stops a test's ranks at --timeout itself; this is for a worker that cannot).
_WORKER_START_S = 300.0
_WORKER_SLACK_S = 120.0


def fake_worker(timeout: int) -> NoReturn:
    """``--fake-worker``: run the tests named on stdin (one a line) on the fake world, with
    the DDP and mode of ``DDP_SUITE_IMPL`` and ``DDP_SUITE_CPU``; write "ready", then one JSON
    line per test (its Outcome), to the original stdout. Everything else, the ranks' output
    included, goes to stderr."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    commands = os.fdopen(os.dup(0), "r")  # the launch points fd 0 at the null device
    os.dup2(2, 1)
    _set_timeout(timeout)
    import _torch_suite_fake

    print("ready", file=answers, flush=True)
    for line in commands:
        name = line.strip()
        if not name:
            continue
        print(f"===== {name} (fake world) impl={os.environ.get('DDP_SUITE_IMPL')} "
              f"cpu={os.environ.get('DDP_SUITE_CPU')}", file=sys.stderr, flush=True)  # fmt: skip
        case = _torch_suite_fake.TestDistBackendOnFakeWorld(name)
        result = _Result()
        start = time.monotonic()
        case.run(result)
        result.outcome.seconds = time.monotonic() - start
        print(json.dumps(dataclasses.asdict(result.outcome)), file=answers, flush=True)
    # No interpreter teardown (torch's exit handlers, threads a test left behind): minutes
    # on a loaded machine, for nothing the runner reads.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class FakeWorker:
    """The runner's side of a ``--fake-worker`` process: ``run(name)`` sends a test and waits
    for its outcome, within a deadline; a worker that misses it, or dies, is replaced by a new
    one at the next test. ``startup_s`` adds up the seconds its processes took to be ready
    and to end."""

    def __init__(self, impl: str, cpu: bool, timeout: int, log: Path) -> None:
        self.impl, self.cpu, self.timeout, self.log = impl, cpu, timeout, log
        self.startup_s = 0.0
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._ended = False

    def _start(self) -> str | None:
        """A new worker process; None when ready, else why not."""
        env = dict(os.environ, DDP_SUITE_IMPL=self.impl, DDP_SUITE_CPU="1" if self.cpu else "0")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
        )
        start = time.monotonic()
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen(
                [sys.executable, __file__, "--fake-worker", "--timeout", str(self.timeout)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
            )  # fmt: skip
        self._buffer = b""
        self._ended = False  # its output ended (it exited, or is exiting)
        line = self._readline(start + _WORKER_START_S)
        self.startup_s += time.monotonic() - start
        if line != "ready":
            return self._fail(f"the fake-world worker did not start ({line or 'no answer'})")
        return None

    def _readline(self, deadline: float) -> str | None:
        """The worker's next line, or None at its deadline or end of output."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                self._ended = True
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _fail(self, why: str) -> str:
        """Kill the worker (a new one starts at the next test); say why, with its exit code."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            code = self._proc.wait()
            why = f"{why}; worker exit code {code}"
            self._proc = None
        return why

    def run(self, name: str) -> Outcome:
        start = time.monotonic()
        if self._proc is None:
            why = self._start()
            if why is not None:
                return Outcome("FAIL", why, time.monotonic() - start)
            start = time.monotonic()
        assert self._proc is not None and self._proc.stdin is not None
        try:
            self._proc.stdin.write(f"{name}\n".encode())
            self._proc.stdin.flush()
        except OSError as exc:
            return Outcome("FAIL", self._fail(f"the worker is gone ({exc})"), 0.0)
        line = self._readline(start + self.timeout + _WORKER_SLACK_S)
        seconds = time.monotonic() - start
        if line is None:
            why = "the worker died" if self._ended else "no answer: the worker was killed"
            return Outcome("FAIL", self._fail(why), seconds)
        outcome = Outcome(**json.loads(line))
        outcome.seconds = seconds  # as the runner saw it, as for gloo
        return outcome

    def close(self) -> None:
        if self._proc is not None:
            assert self._proc.stdin is not None
            start = time.monotonic()
            self._proc.stdin.close()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._fail("closing")
            self._proc = None
            self.startup_s += time.monotonic() - start


def _has_cuda_devices() -> bool:
    """What the CUDA skips of torch's suite ask: a CUDA device per rank."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"])


def _as_json(results: dict[str, dict[str, dict[str, Outcome]]]) -> dict[str, object]:
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


def report(
    mode: str, names: list[str], runs: dict[str, dict[str, Outcome]], world: str = "gloo"
) -> tuple[int, int]:
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
    print(f"\n## mode: {mode}" + ("" if world == "gloo" else f" ({world} world)") + "\n")
    print(f"| {'test'.ljust(width)} | torch | ours  | reason")
    print(f"|{'-' * (width + 2)}|-------|-------|-------")
    for name, t_res, o_res, reason in rows:
        mark = " *" if t_res == "pass" and o_res not in ("pass", "-") else ""
        print(f"| {name.ljust(width)} | {t_res:5} | {o_res:5} | {reason}{mark}")
    torch_pass = [n for n in names if torch_runs.get(n, Outcome("-")).result == "pass"]
    both = [n for n in torch_pass if ours_runs.get(n, Outcome("-")).result == "pass"]
    ours_pass = sum(1 for n in names if ours_runs.get(n, Outcome("-")).result == "pass")
    label = mode if world == "gloo" else f"{mode} ({world} world)"
    print(
        f"\nsummary {label}: {len(names)} tests; torch's DDP passes {len(torch_pass)}; "
        f"this DDP passes {len(both)} of those ({ours_pass} in all)"
    )
    return len(torch_pass), len(both)


def verdict(outcome: Outcome) -> tuple[str, str]:
    """What must agree between the worlds: the result, and a skip's reason (a failure's
    message may word the same failure differently: processes and threads)."""
    return (outcome.result, outcome.reason if outcome.result == "skip" else "")


def compare_worlds(
    plan: dict[str, list[str]],
    results: dict[str, dict[str, dict[str, dict[str, Outcome]]]],
    startup: dict[tuple[str, str], float],
) -> None:
    """Print, per mode and DDP, how many verdicts agree and each world's seconds; then the
    tests whose verdicts differ."""
    print("\n## fake world against gloo processes\n")
    print("| mode | DDP | tests | verdicts matching | gloo s | fake s | gloo / fake | "
          "per-test median gloo / fake |")  # fmt: skip
    print("|------|-----|------:|------------------:|-------:|-------:|------------:|"
          "----------------------------:|")  # fmt: skip
    differ = []
    for mode, names in plan.items():
        for impl in ("torch", "ours"):
            gloo = results.get("gloo", {}).get(mode, {}).get(impl, {})
            fake = results.get("fake", {}).get(mode, {}).get(impl, {})
            both = [n for n in names if n in gloo and n in fake]
            if not both:
                continue
            same = [n for n in both if verdict(gloo[n]) == verdict(fake[n])]
            differ += [(mode, impl, n, gloo[n], fake[n]) for n in both if n not in same]
            gloo_s = sum(gloo[n].seconds for n in both)
            fake_s = sum(fake[n].seconds for n in both) + startup.get((mode, impl), 0.0)
            ratios = [
                gloo[n].seconds / fake[n].seconds
                for n in both
                if gloo[n].seconds > 0 and fake[n].seconds > 0
            ]
            median = f"{statistics.median(ratios):.1f}x" if ratios else "-"
            print(
                f"| {mode} | {'torch' if impl == 'torch' else 'this'} | {len(both)} | "
                f"{len(same)} | {gloo_s:.1f} | {fake_s:.1f} | "
                f"{gloo_s / fake_s if fake_s else float('nan'):.1f}x | {median} |"
            )
    print("\n(fake s includes starting and ending its worker processes)")
    if differ:
        print("\nverdicts that differ:\n")
        print("| mode | DDP | test | gloo | fake |")
        print("|------|-----|------|------|------|")
        for mode, impl, name, g, f in differ:
            print(f"| {mode} | {impl} | {name} | {g.result}: {g.reason} | {f.result}: {f.reason} |")
    else:
        print("\nevery verdict agrees")


def _load(paths: list[Path]) -> dict[str, dict[str, dict[str, dict[str, Outcome]]]]:
    """Results a --save wrote: {mode: {impl: ...}} for gloo, "fake:<mode>" keys for fake."""
    saved: dict[str, dict[str, dict[str, dict[str, Outcome]]]] = {}
    for path in paths:
        for key, by_impl in json.loads(path.read_text()).items():
            world, _, mode = key.rpartition(":")
            for impl, outcomes in by_impl.items():
                for name, fields in outcomes.items():
                    saved.setdefault(world or "gloo", {}).setdefault(mode, {}).setdefault(impl, {})[
                        name
                    ] = Outcome(**fields)
    return saved


def _as_saved(results: dict[str, dict[str, dict[str, dict[str, Outcome]]]]) -> object:
    out = {}
    for world, by_mode in results.items():
        for mode, value in _as_json(by_mode).items():
            out[mode if world == "gloo" else f"{world}:{mode}"] = value
    return out


def main(argv: list[str] | None = None) -> int:
    temp = _prepare_environment()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("plain", "cpu", "both"), default="both")
    parser.add_argument("--impl", choices=("torch", "ours", "both"), default="both")
    parser.add_argument(
        "--world", choices=("gloo", "fake", "both"), default="gloo",
        help="gloo: a spawned process per rank, as upstream; fake: the ranks as threads of "
        "one fake world; both: each test in both, then a comparison",
    )  # fmt: skip
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
    parser.add_argument("--fake-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.fake_worker:
        return fake_worker(args.timeout)
    _set_timeout(args.timeout)
    selected = [n for n in ddp_tests() if not args.k or any(re.search(k, n) for k in args.k)]
    modes = ("plain", "cpu") if args.mode == "both" else (args.mode,)
    impls = ("torch", "ours") if args.impl == "both" else (args.impl,)
    worlds = ("fake", "gloo") if args.world == "both" else (args.world,)
    plan = {m: selected if m == "plain" else [n for n in selected if cuda_gated(n)] for m in modes}
    if args.list:
        for mode, names in plan.items():
            print(f"{mode}: {len(names)} tests")
            for name in names:
                print(f"  {name}")
        return 0

    saved = _load(args.load)
    torch_passes: dict[str, set[str]] | None = None
    if args.where_torch_passes:
        loaded = _load([args.where_torch_passes])
        torch_passes = {
            mode: {n for n, o in r.get("torch", {}).items() if o.result == "pass"}
            for mode, r in loaded.get(worlds[0], loaded.get("gloo", {})).items()
        }
    totals = {}
    results: dict[str, dict[str, dict[str, dict[str, Outcome]]]] = {}
    startup: dict[tuple[str, str], float] = {}  # (mode, impl) -> its fake workers' start, s
    start = time.monotonic()
    for mode, names in plan.items():
        workers = {impl: FakeWorker(impl, mode == "cpu", args.timeout, args.log) for impl in impls}
        runs = {w: results.setdefault(w, {}).setdefault(mode, {}) for w in worlds}
        for by_impl in runs.values():
            for impl in impls:
                by_impl.setdefault(impl, {})
        for world in worlds:
            for impl, outcomes in saved.get(world, {}).get(mode, {}).items():
                runs[world].setdefault(impl, {}).update(
                    {n: o for n, o in outcomes.items() if n in names}
                )
        try:
            for name in names:
                for impl in impls:
                    if impl == "ours" and name not in (torch_passes or {}).get(mode, {name}):
                        continue  # --where-torch-passes: torch's DDP does not pass it
                    for world in worlds:
                        if name in runs[world][impl]:
                            continue
                        if mode == "plain" and cuda_gated(name) and not _has_cuda_devices():
                            # The test's own decorator would skip it in each rank; said here,
                            # without starting them.
                            outcome = Outcome("skip", "Need at least 2 CUDA devices (not spawned)")
                        elif world == "fake":
                            outcome = workers[impl].run(name)
                        else:
                            outcome = run_one(name, impl, mode == "cpu", args.log)
                        runs[world][impl][name] = outcome
                        if args.save:
                            args.save.write_text(json.dumps(_as_saved(results), indent=1))
                        if not args.quiet:
                            where = "" if args.world == "gloo" else f" {world}"
                            print(
                                f"[{mode}{where}] {name} {impl}: {outcome.result} "
                                f"({outcome.seconds:.1f} s) {outcome.reason}",
                                flush=True,
                            )
        finally:
            for impl, worker in workers.items():
                worker.close()
                startup[(mode, impl)] = worker.startup_s
        for world in worlds:
            totals[(mode, world)] = report(mode, names, runs[world], world)
    wall = time.monotonic() - start
    if args.world == "both":
        compare_worlds(plan, results, startup)
    print()
    for (mode, world), (torch_pass, both) in totals.items():
        label = mode if args.world == "gloo" else f"{mode} ({world} world)"
        print(f"acceptance {label}: this DDP passes {both} of the {torch_pass} torch's DDP passes")
    print(f"wall time: {wall:.1f} s ({', '.join(worlds)})")
    print(f"rank logs: {args.log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
