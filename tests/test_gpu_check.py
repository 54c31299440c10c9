"""``bash benchmarks/gpu_check.sh``: the skip without a GPU, the arguments, how a step's result
is read from its exit code and output, the budget, the summary table, and the real step
commands on a machine whose GPUs are hidden (each must skip itself, saying why).

The GPU side of the script is what it runs: tests/test_gpu.py, the property tests and the
``validate`` / ``simulate`` commands, each tested on the CPU in its own file.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check  # noqa: E402  (benchmarks/ is not a package)
from gpu_check import FAIL, PASS, SKIP, Outcome, Step  # noqa: E402

NAMES = [
    "validate-nccl",
    "validate-gloo-cuda",
    "validate-fakepg-cuda",
    "properties-cuda",
    "simulate-cuda",
    "ddp-differential-cuda",
    "launch-cuda",
    "overhead",
]


def no_gpu_env(tmp_dir: Path) -> dict[str, str]:
    """This environment with every GPU hidden (so the test means the same on a GPU machine),
    and the script told to run the interpreter that runs the tests (``$PYTHON``). A ``python``
    that cannot run anything comes first on PATH: a script that took ``python`` from PATH
    instead (on many machines one without torch) fails every test here."""
    stub = tmp_dir / "python"
    stub.write_text("#!/bin/sh\necho 'python from PATH was run' >&2\nexit 97\n")
    stub.chmod(0o755)
    path = f"{tmp_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable, "PATH": path}


def script(*args: str) -> subprocess.CompletedProcess[str]:
    with tempfile.TemporaryDirectory() as tmp:
        return subprocess.run(
            ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=no_gpu_env(Path(tmp)),
        )


def test_without_a_gpu_it_runs_nothing_says_why_and_exits_0() -> None:
    out = script()
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith("gpu_check: skipped: ")
    assert "has no CUDA" in out.stdout or "no GPU visible" in out.stdout
    assert f"Nothing ran; with a GPU this runs: {', '.join(NAMES)}" in out.stdout


def test_list_names_every_step_and_its_command() -> None:
    out = script("--list", "--only", "overhead,validate-nccl")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "validate-nccl (55 s): the validation suite on NCCL, one process"
    assert lines[1].endswith("-m reducer validate --backend nccl --nproc 1 --timeout 40")
    assert lines[2].startswith("overhead (90 s): ")
    assert lines[3].endswith("benchmarks/gpu_overhead.py")
    assert len(lines) == 4


def test_the_steps_fit_the_default_budget() -> None:
    """Every step can use its whole timeout and the run still ends within 8 minutes."""
    plan = gpu_check.steps()
    assert [s.name for s in plan] == NAMES
    assert sum(s.timeout_s for s in plan) <= gpu_check.BUDGET_S == 480
    for step in plan:
        for arg in step.command:
            if arg.endswith(".py"):
                assert (ROOT / arg).is_file(), f"{step.name}: {arg} does not exist"


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--only", "nope,overhead"], "--only: no step named nope; the steps are validate-nccl"),
        (["--only", ","], "--only: no step named ','"),
        (["--budget", "0"], "--budget must be > 0 seconds, got 0"),
    ],
)
def test_bad_arguments_exit_2_and_say_why(args: list[str], words: str) -> None:
    out = script(*args)
    assert out.returncode == 2
    assert words in out.stderr


# -------------------------------------------------------------------------------------------
# Reading a step's result.

STEP = Step(
    "demo",
    "a step",
    ("true",),
    10,
    summary=r"^\d+ checks: ",
    skipped=r"^validate: skipped",
)
PYTEST = Step(
    "tests",
    "pytest",
    ("true",),
    10,
    summary=gpu_check._PYTEST_SUMMARY,
    skipped=r"^(?!.*\bpassed\b).*\bskipped\b.* in [\d.]+s",
)


@pytest.mark.parametrize(
    ("step", "code", "lines", "timed_out", "status", "detail"),
    [
        (STEP, 0, ["table", "6 checks: 6 passed, 0 failed", "bye"], False, PASS, "6 checks: 6"),
        (STEP, 0, ["no summary here", "last words", ""], False, PASS, "last words"),
        (STEP, 0, ["validate: skipped: no GPU visible here"], False, SKIP, "validate: skipped: no"),
        (STEP, 1, ["6 checks: 5 passed, 1 failed", "boom"], False, FAIL, "exit code 1: boom"),
        (STEP, -9, ["partial"], True, FAIL, "timed out after 7 s"),
        (PYTEST, 0, ["SKIPPED [1] x", "3 passed, 2 skipped in 1.50s"], False, PASS, "3 passed, 2"),
        (PYTEST, 0, ["2 skipped, 9 deselected in 0.40s"], False, SKIP, "2 skipped, 9 deselected"),
        (PYTEST, 1, ["1 failed, 3 passed in 2.00s"], False, FAIL, "exit code 1: 1 failed"),
        (PYTEST, 5, ["no tests ran in 0.01s"], False, FAIL, "exit code 5: no tests ran"),
    ],
)
def test_classify(
    step: Step,
    code: int,
    lines: list[str],
    timed_out: bool,
    status: str,
    detail: str,
) -> None:
    outcome = gpu_check.classify(step, code, lines, timed_out, 1.25, 7)
    assert (outcome.name, outcome.status, outcome.seconds) == (step.name, status, 1.25)
    assert outcome.detail.startswith(detail), outcome.detail
    assert outcome.output == lines


def test_run_step_echoes_output_and_reads_the_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    code = "print('6 checks: 6 passed'); print('more'); import sys; sys.exit({})"
    ok = Step("ok", "", (sys.executable, "-c", code.format(0)), 30, summary=r"^\d+ checks")
    bad = Step("bad", "", (sys.executable, "-c", code.format(3)), 30)
    assert gpu_check.run_step(ok, 30).detail == "6 checks: 6 passed"
    assert capsys.readouterr().out == "6 checks: 6 passed\nmore\n"
    failed = gpu_check.run_step(bad, 30, echo=False)
    assert (failed.status, failed.detail) == (FAIL, "exit code 3: more")


@pytest.mark.slow
def test_a_step_past_its_timeout_is_stopped_with_its_children() -> None:
    """validate starts rank processes: the whole process group goes."""
    code = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "print(child.pid, flush=True); time.sleep(120)"
    )
    step = Step("slow", "", (sys.executable, "-c", code), 120)
    start = time.monotonic()
    outcome = gpu_check.run_step(step, 2.0, echo=False)
    assert time.monotonic() - start < 30
    assert (outcome.status, outcome.detail) == (FAIL, "timed out after 2 s")
    grandchild = int(outcome.output[0])
    for _ in range(100):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the step's child process {grandchild} survived the timeout")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("validate-nccl", "validate: skipped: --backend nccl needs one GPU per rank"),
        ("validate-gloo-cuda", "validate: skipped: --device cuda: "),
        ("validate-fakepg-cuda", "validate: skipped: --device cuda: "),
        ("ddp-differential-cuda", "skipped, "),
        ("overhead", "gpu_overhead: skipped: "),
    ],
)
def test_the_real_steps_skip_themselves_where_no_gpu_is_visible(
    name: str, words: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commands as the script runs them, with the GPUs hidden: each starts, sees no GPU,
    and says so, which the script reads as SKIP (so their command lines and patterns work)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    step = next(s for s in gpu_check.steps() if s.name == name)
    outcome = gpu_check.run_step(step, 90, echo=False)
    assert outcome.status == SKIP, outcome.output
    assert words in outcome.detail


# -------------------------------------------------------------------------------------------
# The budget and the table.


class FakeRunner:
    """Records the timeout each step got; each run takes ``took`` seconds of a fake clock."""

    def __init__(self, took: float, status: str = PASS) -> None:
        self.now = 0.0
        self.took = took
        self.status = status
        self.calls: list[tuple[str, float]] = []

    def clock(self) -> float:
        return self.now

    def __call__(self, step: Step, timeout_s: float) -> Outcome:
        self.calls.append((step.name, timeout_s))
        self.now += min(self.took, timeout_s)
        return Outcome(step.name, self.status, min(self.took, timeout_s), "ran")


def plan(*timeouts: float) -> list[Step]:
    return [Step(f"s{i}", "", ("true",), t) for i, t in enumerate(timeouts)]


def test_each_step_gets_its_timeout_or_what_is_left_of_the_budget() -> None:
    runner = FakeRunner(took=40)
    outcomes = gpu_check.run_all(
        plan(60, 60, 60, 60), 100, run=runner, clock=runner.clock, min_step_s=15
    )
    # 100 s: 60 (took 40), 60 (took 40), then 20 left: 20 (took 20), then 0 left: skipped.
    assert runner.calls == [("s0", 60), ("s1", 60), ("s2", 20)]
    assert [o.status for o in outcomes] == [PASS, PASS, PASS, SKIP]
    assert outcomes[3].detail == "0 s left of the 100 s budget"


def test_steps_without_what_they_need_are_skipped_saying_what() -> None:
    runner = FakeRunner(took=1)
    needs = [
        Step("tests", "", ("true",), 10, modules=("pytest", "no_such_module_here")),
        Step("nccl", "", ("true",), 10, needs_nccl=True),
        Step("plain", "", ("true",), 10),
    ]
    outcomes = gpu_check.run_all(
        needs, 100, run=runner, clock=runner.clock, have=gpu_check.has_module, nccl=False
    )
    assert runner.calls == [("plain", 10)]
    assert [(o.status, o.detail) for o in outcomes[:2]] == [
        (SKIP, "not installed for this Python: no_such_module_here (nothing is installed here)"),
        (SKIP, "this torch build has no NCCL"),
    ]


def test_the_summary_table_and_the_exit_code() -> None:
    outcomes = [
        Outcome("validate-nccl", PASS, 12.345, "6 checks: 5 passed, 0 failed, 1 skipped"),
        Outcome("overhead", SKIP, 0.0, "this torch build has no NCCL"),
    ]
    assert gpu_check.summary_table(outcomes).splitlines() == [
        "| step          | result | seconds | detail                                  |",
        "|---------------|--------|---------|-----------------------------------------|",
        "| validate-nccl | PASS   | 12.3    | 6 checks: 5 passed, 0 failed, 1 skipped |",
        "| overhead      | SKIP   | 0.0     | this torch build has no NCCL            |",
    ]
    assert gpu_check.exit_code(outcomes) == 0
    assert gpu_check.exit_code([*outcomes, Outcome("x", FAIL, 1.0, "exit code 1")]) == 1
