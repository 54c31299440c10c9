"""``python -m reducer validate``: the suite on gloo (processes) and fakepg (threads), a check
that is broken on purpose, the NCCL skip, and argument errors.

The runs go through ``python -m reducer.validate``, the subcommand's own entry point (the same
``add_arguments`` and ``run`` that ``python -m reducer validate`` dispatches to, and what the
spawned ranks run); ``test_the_cli_dispatches_validate`` checks that dispatch.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from reducer import validate

CHECKS = [
    "exact average",
    "exact average, bucket views",
    "unused parameters",
    "sparse gradients",
    "gradient accumulation",
    "same as torch DDP",
]


def run_validate(*args: str, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, "-m", "reducer.validate", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def rows(stdout: str) -> dict[str, tuple[str, str]]:
    """The table's rows: check name -> (result, detail)."""
    found = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|", 2)]
        if len(cells) == 3 and cells[0] in CHECKS:
            found[cells[0]] = (cells[1], cells[2])
    return found


def test_gloo_two_processes_pass_every_check() -> None:
    out = run_validate("--backend", "gloo", "--nproc", "2", "--timeout", "60")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "backend gloo, 2 ranks as processes, rendezvous 127.0.0.1:" in out.stdout
    table = rows(out.stdout)
    assert list(table) == CHECKS
    assert all(result == "pass" for result, _ in table.values()), out.stdout
    assert "bit-exact" in table["exact average"][1]
    assert "3 buckets" in table["exact average"][1]
    assert "6 checks: 6 passed, 0 failed, 0 skipped" in out.stdout
    assert out.stdout.count("| check") == 1  # only rank 0 prints the table


def test_fakepg_three_threads_pass_every_check() -> None:
    out = run_validate("--backend", "fakepg", "--nproc", "3", "--timeout", "60")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "backend fakepg, 3 ranks as threads" in out.stdout
    table = rows(out.stdout)
    assert list(table) == CHECKS
    assert all(result == "pass" for result, _ in table.values()), out.stdout
    assert "bit-identical" in table["same as torch DDP"][1]
    assert "6 checks: 6 passed, 0 failed, 0 skipped" in out.stdout


@pytest.mark.parametrize(("backend", "broken"), [("gloo", "unused parameters")])
def test_a_failing_check_makes_it_exit_non_zero(backend: str, broken: str) -> None:
    out = run_validate(
        "--backend", backend, "--nproc", "2", "--timeout", "60", "--break-check", broken
    )
    assert out.returncode == 1, out.stdout + out.stderr
    table = rows(out.stdout)
    assert table[broken][0] == "FAIL"
    assert table[broken][1].startswith("rank(s) 0: ")  # the rank that saw it, and how
    assert "gradients differ" in table[broken][1] and "max abs error 1" in table[broken][1]
    assert all(result == "pass" for name, (result, _) in table.items() if name != broken)
    assert "6 checks: 5 passed, 1 failed, 0 skipped" in out.stdout


def test_break_check_on_fakepg_fails_that_check_only(capsys: pytest.CaptureFixture[str]) -> None:
    code = validate.main(
        ["--backend", "fakepg", "--nproc", "2", "--break-check", "gradient accumulation"]
    )
    out = capsys.readouterr().out
    assert code == 1
    table = rows(out)
    assert [name for name, (result, _) in table.items() if result != "pass"] == [
        "gradient accumulation"
    ]


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="there are GPUs: the suite runs")
def test_nccl_without_enough_gpus_skips_with_a_clear_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert validate.main(["--backend", "nccl", "--nproc", "2"]) == 0
    assert "skipped: --backend nccl needs one GPU per rank: 2 ranks but" in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs for NCCL")
def test_nccl_two_gpus_pass_every_check() -> None:
    out = run_validate("--backend", "nccl", "--nproc", "2", "--timeout", "120", timeout=180.0)
    assert out.returncode == 0, out.stdout + out.stderr
    table = rows(out.stdout)
    assert table.pop("sparse gradients")[0] == "skip"  # NCCL has no sparse allreduce
    assert all(result == "pass" for result, _ in table.values()), out.stdout


def test_fakepg_under_torchrun_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert validate.main(["--backend", "fakepg"]) == 2
    assert "without torchrun" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--nproc", "0"], "--nproc must be >= 1"),
        (["--timeout", "0"], "--timeout must be > 0"),
        (["--break-check", "nope"], "names no check; choose one of exact average"),
    ],
)
def test_bad_arguments_exit_2_and_say_why(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert validate.main(["--backend", "fakepg", *args]) == 2
    assert words in capsys.readouterr().err


def test_the_cli_dispatches_validate() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "reducer", "validate", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, (
        "python -m reducer validate is not reachable; reducer/cli.py imports every subcommand "
        f"module when it builds its parser:\n{out.stderr[-600:]}"
    )
    assert "--backend {fakepg,gloo,nccl}" in out.stdout and "--nproc" in out.stdout
