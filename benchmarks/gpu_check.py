"""The GPU check: the validation suite, the fake world and the overhead table, on one GPU.

    bash benchmarks/gpu_check.sh [--budget 480] [--only STEP,...] [--list] [--log-dir DIR]

Runs each step below as a process of its own with its own timeout (cut to what is left of
--budget, 8 minutes by default), prints each step's output as it comes, then a table with
PASS, FAIL or SKIP per step, its seconds and one line of detail, and then the tables the
steps printed (the overhead table, ready for BENCHMARKS.md). Exit code 1 if any step failed,
else 0. Without a usable GPU (a torch build without CUDA, or no GPU visible) it runs nothing
and exits 0, saying why. It installs nothing: the steps run with the Python that runs this
script, its torch, and this checkout on PYTHONPATH. A step whose Python packages are missing
(pytest, hypothesis, rich, ...) or that needs NCCL where torch has none is skipped, saying so.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
BUDGET_S = 480.0
# A step is not started with less than this left of the budget: it could not finish.
MIN_STEP_S = 15.0
# Variables that would make `validate` join a rendezvous instead of starting its ranks.
_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_PYTEST_SUMMARY = r"\b(passed|failed|skipped|errors?|deselected)\b.* in [\d.]+s"


@dataclass(frozen=True, slots=True)
class Step:
    """One step: a command, its timeout, what it needs, and how to read its output.

    ``summary``: the last output line that matches is the detail of a pass. ``skipped``: an
    output line that says the step skipped itself (it exits 0 then). ``tables``: echo the
    step's Markdown table lines after the summary.
    """

    name: str
    what: str
    command: tuple[str, ...]
    timeout_s: float
    env: tuple[tuple[str, str], ...] = ()
    modules: tuple[str, ...] = ()
    needs_nccl: bool = False
    summary: str = ""
    skipped: str = ""
    tables: bool = False


@dataclass(frozen=True, slots=True)
class Outcome:
    name: str
    status: str
    seconds: float
    detail: str
    output: list[str] = field(default_factory=list)


def steps(python: str = sys.executable, *, pytest_workers: int | None = 4) -> list[Step]:
    """The steps, in order. Their timeouts add up to 480 s, the default budget."""
    validate = (python, "-m", "reducer", "validate")
    pytest = (python, "-m", "pytest", "-q", "-rs", "-o", "addopts=")
    pytest = (*pytest, "-p", "no:cacheprovider", "-p", "no:randomly")
    simulate = (python, "-m", "reducer", "simulate", "--model", "transformer-block")
    parallel = ("-n", str(pytest_workers)) if pytest_workers else ()
    checks = r"^\d+ checks: "
    return [
        Step(
            "validate-nccl",
            "the validation suite on NCCL, one process",
            (*validate, "--backend", "nccl", "--nproc", "1", "--timeout", "40"),
            55,
            needs_nccl=True,
            summary=checks,
            skipped=r"^validate: skipped",
        ),
        Step(
            "validate-gloo-cuda",
            "the validation suite on gloo with CUDA tensors, two processes on one GPU",
            (*validate, "--backend", "gloo", "--device", "cuda", "--nproc", "2", "--timeout", "40"),
            55,
            summary=checks,
            skipped=r"^validate: skipped",
        ),
        Step(
            "validate-fakepg-cuda",
            "the validation suite on the fake world, four rank threads on one GPU",
            (
                *validate,
                "--backend",
                "fakepg",
                "--device",
                "cuda",
                "--nproc",
                "4",
                "--timeout",
                "30",
            ),
            45,
            modules=("numpy",),
            summary=checks,
            skipped=r"^validate: skipped",
        ),
        Step(
            "properties-cuda",
            "exact averaging, unused parameters, accumulation (ci examples) on one GPU",
            (
                *pytest,
                *parallel,
                "property_tests/test_exact_averaging.py",
                "property_tests/test_unused_parameters.py",
                "property_tests/test_accumulation.py",
            ),
            85,
            env=(("PROPERTY_TESTS_DEVICE", "cuda"), ("HYPOTHESIS_PROFILE", "ci")),
            modules=("pytest", "hypothesis", "numpy"),
            summary=_PYTEST_SUMMARY,
            skipped=r"^(?!.*\bpassed\b).*\bskipped\b.* in [\d.]+s",
        ),
        Step(
            "simulate-cuda",
            "simulate --model transformer-block, four rank threads on one GPU, bit for bit",
            (*simulate, "--device", "cuda", "--world-size", "4", "--steps", "10", "--no-progress"),
            40,
            modules=("numpy", "rich"),
            summary=r"^verification: ",
        ),
        Step(
            "ddp-differential-cuda",
            "torch's DDP against this one, bitwise: NCCL at W = 1, the fake world at W = 2, 3, 4; "
            "the fake world's collectives wait for the stream that wrote their input",
            (*pytest, "tests/test_gpu.py", "-k", "cuda"),
            70,
            modules=("pytest", "hypothesis", "numpy"),
            summary=_PYTEST_SUMMARY,
            skipped=r"^(?!.*\bpassed\b).*\bskipped\b.* in [\d.]+s",
        ),
        Step(
            "launch-cuda",
            "launch of a CUDA nanoGPT-style script at W = 2, 3 on the GPU, check on, bitwise "
            "against torch's DDP",
            (*pytest, "tests/test_launch.py", "-k", "gpu_launch"),
            40,
            modules=("pytest",),
            summary=_PYTEST_SUMMARY,
            skipped=r"^(?!.*\bpassed\b).*\bskipped\b.* in [\d.]+s",
        ),
        Step(
            "overhead",
            "step time against torch's DDP (NCCL, W = 1, bf16 autocast): the table",
            (python, "benchmarks/gpu_overhead.py"),
            90,
            needs_nccl=True,
            summary=r"^reducer against torch DDP",
            skipped=r"^gpu_overhead: skipped",
            tables=True,
        ),
    ]


# -------------------------------------------------------------------------------------------
# What is there.


def gpu_skip_reason() -> str | None:
    """Why nothing can run on a GPU here, or None. Imports torch (it must be importable)."""
    import torch

    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA"
    if not torch.cuda.is_available():
        return "no GPU visible (torch.cuda.is_available() is False)"
    return None


def nccl_available() -> bool:
    import torch.distributed as dist

    return bool(dist.is_available() and dist.is_nccl_available())


def has_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def missing(step: Step, have: Callable[[str], bool], nccl: bool) -> str | None:
    """Why ``step`` cannot run with what is installed, or None."""
    absent = [m for m in step.modules if not have(m)]
    if absent:
        return f"not installed for this Python: {', '.join(absent)} (nothing is installed here)"
    if step.needs_nccl and not nccl:
        return "this torch build has no NCCL"
    return None


def describe_machine() -> str:
    import torch

    parts = [f"Python {sys.version.split()[0]}", f"torch {torch.__version__}"]
    if torch.cuda.is_available():
        parts.append(f"CUDA {torch.version.cuda}")
        parts += [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return ", ".join(parts)


# -------------------------------------------------------------------------------------------
# Running and reading a step.


def step_env(step: Step) -> dict[str, str]:
    """This process's environment, with this checkout first on PYTHONPATH, unbuffered output,
    no rendezvous variables, and the step's own variables."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    path = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + path if path else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.update(step.env)
    return env


def run_step(step: Step, timeout_s: float, *, echo: bool = True) -> Outcome:
    """Run ``step`` from the checkout's root, echoing its output to stdout (with ``echo``);
    stop it (its whole process group: validate starts ranks of its own) after ``timeout_s``."""
    start = time.monotonic()
    proc = subprocess.Popen(
        step.command,
        cwd=ROOT,
        env=step_env(step),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=read, name=f"gpu-check-{step.name}", daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _stop_group(proc)
    reader.join(10.0)
    return classify(step, proc.returncode, lines, timed_out, time.monotonic() - start, timeout_s)


def _stop_group(proc: subprocess.Popen[str]) -> None:
    """SIGTERM to the step's process group (it was started in a session of its own), then
    SIGKILL to what is left after a grace period."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def classify(
    step: Step,
    code: int | None,
    lines: Sequence[str],
    timed_out: bool,
    seconds: float,
    timeout_s: float,
) -> Outcome:
    """The step's result from its exit code and output."""
    out = list(lines)
    if timed_out:
        return Outcome(step.name, FAIL, seconds, f"timed out after {timeout_s:g} s", out)
    last = next((line.strip() for line in reversed(out) if line.strip()), "")
    if code != 0:
        return Outcome(step.name, FAIL, seconds, f"exit code {code}: {last}", out)
    if step.skipped:
        said = [line.strip() for line in out if re.search(step.skipped, line.strip())]
        if said:
            return Outcome(step.name, SKIP, seconds, said[-1], out)
    if step.summary:
        found = [line.strip() for line in out if re.search(step.summary, line.strip())]
        if found:
            return Outcome(step.name, PASS, seconds, found[-1], out)
    return Outcome(step.name, PASS, seconds, last, out)


Runner = Callable[[Step, float], Outcome]


def run_all(
    plan: Sequence[Step],
    budget_s: float,
    *,
    run: Runner = run_step,
    clock: Callable[[], float] = time.monotonic,
    have: Callable[[str], bool] = has_module,
    nccl: bool = True,
    min_step_s: float = MIN_STEP_S,
) -> list[Outcome]:
    """Run ``plan`` in order within ``budget_s``: each step gets its own timeout, or what is
    left of the budget if less; a step that lacks what it needs, or for which less than
    ``min_step_s`` is left, is skipped with the reason."""
    deadline = clock() + budget_s
    outcomes = []
    for step in plan:
        reason = missing(step, have, nccl)
        left = deadline - clock()
        if reason is None and left < min_step_s:
            reason = f"{max(left, 0.0):.0f} s left of the {budget_s:g} s budget"
        if reason is not None:
            outcomes.append(Outcome(step.name, SKIP, 0.0, reason))
            continue
        outcomes.append(run(step, min(step.timeout_s, left)))
    return outcomes


def summary_table(outcomes: Sequence[Outcome]) -> str:
    """A Markdown table: step, result, seconds, detail."""
    rows = [[o.name, o.status, f"{o.seconds:.1f}", o.detail] for o in outcomes]
    cells = [["step", "result", "seconds", "detail"], *rows]
    widths = [max(len(r[i]) for r in cells) for i in range(4)]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def exit_code(outcomes: Sequence[Outcome]) -> int:
    return 1 if any(o.status == FAIL for o in outcomes) else 0


# -------------------------------------------------------------------------------------------
# The command line.


def parse_args(argv: Sequence[str] | None, names: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bash benchmarks/gpu_check.sh",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=BUDGET_S,
        help=f"seconds for all steps together (default {BUDGET_S:g})",
    )
    parser.add_argument(
        "--only", default=None, metavar="STEP,...", help="run these steps only, in plan order"
    )
    parser.add_argument("--list", action="store_true", help="print the steps and exit")
    parser.add_argument(
        "--log-dir", type=Path, default=None, help="also write each step's output there"
    )
    args = parser.parse_args(argv)
    if not args.budget > 0:
        parser.error(f"--budget must be > 0 seconds, got {args.budget:g}")
    if args.only is not None:
        chosen = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = [s for s in chosen if s not in names]
        if unknown or not chosen:
            parser.error(
                f"--only: no step named {', '.join(unknown) or repr(args.only)}; the steps are "
                f"{', '.join(names)}"
            )
        args.only = chosen
    return args


def main(argv: Sequence[str] | None = None) -> int:
    try:
        import torch  # noqa: F401  (the steps need it; nothing is installed here)
    except ImportError as exc:
        print(f"gpu_check: torch is not importable with {sys.executable}: {exc}", file=sys.stderr)
        return 2
    plan = steps(pytest_workers=4 if has_module("xdist") else None)
    args = parse_args(argv, [s.name for s in plan])
    if args.only is not None:
        plan = [s for s in plan if s.name in args.only]
    if args.list:
        for s in plan:
            print(f"{s.name} ({s.timeout_s:g} s): {s.what}\n    {' '.join(s.command)}")
        return 0
    reason = gpu_skip_reason()
    if reason is not None:
        print(f"gpu_check: skipped: {reason}. Nothing ran; with a GPU this runs: ", end="")
        print(", ".join(s.name for s in plan))
        return 0
    print(f"gpu_check: {describe_machine()}; budget {args.budget:g} s", flush=True)

    def run(step: Step, timeout_s: float) -> Outcome:
        print(f"\n==> {step.name} (limit {timeout_s:.0f} s): {' '.join(step.command)}", flush=True)
        outcome = run_step(step, timeout_s)
        print(f"<== {step.name}: {outcome.status} in {outcome.seconds:.1f} s", flush=True)
        return outcome

    outcomes = run_all(plan, args.budget, run=run, nccl=nccl_available())
    report = summary_table(outcomes)
    print(f"\n# gpu_check: {describe_machine()}\n\n{report}")
    for step, outcome in zip(plan, outcomes, strict=True):
        table = [line for line in outcome.output if line.startswith(("|", "# ", "reducer "))]
        if step.tables and table:
            print(f"\n## {step.name}\n\n" + "\n".join(table))
    if args.log_dir is not None:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        for outcome in outcomes:
            (args.log_dir / f"{outcome.name}.log").write_text("\n".join(outcome.output) + "\n")
        (args.log_dir / "summary.md").write_text(report + "\n")
    return exit_code(outcomes)


if __name__ == "__main__":
    sys.exit(main())
