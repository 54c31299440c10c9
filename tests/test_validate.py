"""``python -m reducer validate``: the suite on gloo (processes it starts, and under torchrun)
and fakepg (threads), a check that is broken on purpose, the NCCL skip, and argument errors.

Most runs call ``reducer.tools.validate.main``, the subcommand's own entry point (the same
``add_arguments`` and ``run`` that ``python -m reducer validate`` dispatches to, and what the
spawned ranks run); the torchrun test and ``test_the_cli_dispatches_validate`` go through
``python -m reducer validate`` itself.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reducer.tools import validate

ROOT = Path(__file__).resolve().parent.parent

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
        [sys.executable, "-m", "reducer.tools.validate", *args],
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


@pytest.mark.slow
def test_gloo_two_processes_pass_every_check(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """This process launches the two ranks (no torchrun variables here); rank 0 prints."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    code = validate.main(["--backend", "gloo", "--nproc", "2", "--timeout", "60"])
    out = capfd.readouterr()
    assert code == 0, out.out + out.err
    assert "backend gloo, 2 ranks as processes, rendezvous 127.0.0.1:" in out.out
    table = rows(out.out)
    assert list(table) == CHECKS
    assert all(result == "pass" for result, _ in table.values()), out.out
    assert "bit-exact" in table["exact average"][1]
    # torch's DDP rule on 100-byte buckets: [[5], [3, 4], [1, 2], [0]].
    assert "4 buckets" in table["exact average"][1]
    assert "no_sync accumulation; 2 steps each: bit-identical" in table["same as torch DDP"][1]
    assert "6 checks: 6 passed, 0 failed, 0 skipped" in out.out
    assert out.out.count("| check") == 1  # only rank 0 prints the table


def test_fakepg_three_threads_pass_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    code = validate.main(["--backend", "fakepg", "--nproc", "3", "--timeout", "60"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "backend fakepg, 3 ranks as threads" in out
    table = rows(out)
    assert list(table) == CHECKS
    assert all(result == "pass" for result, _ in table.values()), out
    assert "bit-identical" in table["same as torch DDP"][1]
    assert "6 checks: 6 passed, 0 failed, 0 skipped" in out


@pytest.mark.slow
def test_under_torchrun_a_failing_check_makes_every_rank_exit_non_zero() -> None:
    """torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK: the suite joins
    its rendezvous instead of starting ranks. One check broken on rank 0 fails the run."""
    broken = "unused parameters"
    out = subprocess.run(
        [
            *(sys.executable, "-m", "torch.distributed.run", "--standalone"),
            *("--nproc-per-node", "2", "-m", "reducer", "validate", "--backend", "gloo"),
            *("--timeout", "60", "--break-check", broken),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")},
    )
    assert out.returncode != 0, out.stdout + out.stderr
    assert "backend gloo, 2 ranks as processes, rendezvous " in out.stdout
    table = rows(out.stdout)
    assert list(table) == CHECKS
    assert table[broken][0] == "FAIL"
    assert table[broken][1].startswith("rank(s) 0: ")  # the rank that saw it, and how
    assert "gradients differ" in table[broken][1] and "max abs error 1" in table[broken][1]
    assert all(result == "pass" for name, (result, _) in table.items() if name != broken)
    assert "6 checks: 5 passed, 1 failed, 0 skipped" in out.stdout
    assert "exitcode  : 1" in out.stderr  # torchrun's summary: a rank exited with 1


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
    out = capsys.readouterr().out
    assert "skipped: --backend nccl needs one GPU per rank: 2 ranks on this machine but" in out


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="there are GPUs: the suite runs")
def test_nccl_under_torchrun_without_enough_gpus_skips_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every rank of the machine decides alike, before any rendezvous (one that joined would
    wait for the others forever)."""
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("LOCAL_RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "1")  # nothing listens: joining would fail
        assert validate.main(["--backend", "nccl", "--timeout", "5"]) == 0
        out = capsys.readouterr().out
        assert f"skipped on rank {rank}: --backend nccl needs one GPU per rank: 2 ranks" in out
        assert "--nproc-per-node" in out or "no GPU visible" in out


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


@pytest.mark.slow
def test_the_cli_dispatches_validate() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "reducer", "validate", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, (
        "python -m reducer validate is not reachable; reducer/tools/cli.py imports every "
        f"subcommand module when it builds its parser:\n{out.stderr[-600:]}"
    )
    assert "--backend {fakepg,gloo,nccl}" in out.stdout and "--nproc" in out.stdout


# -------------------------------------------------------------------------------------------
# --device: where the models live. The CUDA runs themselves are the GPU check's
# (bash benchmarks/gpu_check.sh); here, every path a machine without a GPU reaches.


def parsed(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    validate.add_arguments(parser)
    return parser.parse_args(argv)


def test_fakepg_with_device_cpu_passes_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    code = validate.main(["--backend", "fakepg", "--device", "cpu", "--nproc", "2"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "backend fakepg, 2 ranks as threads, device cpu" in out
    table = rows(out)
    assert list(table) == CHECKS
    assert all(result == "pass" for result, _ in table.values()), out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the suite runs on it")
@pytest.mark.parametrize("backend", ["gloo", "fakepg"])
def test_device_cuda_without_a_gpu_skips_with_a_clear_message(
    backend: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert validate.main(["--backend", backend, "--device", "cuda", "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("validate: skipped: --device cuda: ")
    assert "has no CUDA" in out or "no GPU visible here" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the suite runs on it")
def test_device_cuda_under_torchrun_without_a_gpu_skips_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Decided before the rendezvous (nothing listens on the port: joining would fail)."""
    for rank in range(2):
        for name, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", 2)):
            monkeypatch.setenv(name, str(value))
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", "1")
        assert validate.main(["--backend", "gloo", "--device", "cuda", "--timeout", "5"]) == 0
        assert f"skipped on rank {rank}: --device cuda: " in capsys.readouterr().out


def test_nccl_on_the_cpu_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert validate.main(["--backend", "nccl", "--device", "cpu"]) == 2
    assert "--backend nccl reduces CUDA tensors only; drop --device cpu" in capsys.readouterr().err


def test_started_ranks_get_the_same_options() -> None:
    args = parsed("--backend", "gloo", "--device", "cuda", "--nproc", "3", "--timeout", "9")
    assert validate._rank_command(args)[1:] == [
        *("-m", "reducer.tools.validate", "--backend", "gloo", "--device", "cuda"),
        *("--timeout", "9.0"),
    ]
    args = parsed("--backend", "gloo", "--break-check", "sparse gradients")
    assert validate._rank_command(args)[1:] == [
        *("-m", "reducer.tools.validate", "--backend", "gloo", "--timeout", "120.0"),
        *("--break-check", "sparse gradients"),
    ]


def test_each_rank_gets_its_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL: one GPU per local rank. --device cuda: ranks share the GPUs round robin (two
    gloo processes on one GPU). Otherwise the CPU."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert validate._rank_device("nccl", None, 1) == torch.device("cuda", 1)
    assert validate._rank_device("gloo", "cuda", 1) == torch.device("cuda", 0)
    assert validate._rank_device("fakepg", "cuda", 0) == torch.device("cuda", 0)
    assert validate._rank_device("gloo", None, 1) == torch.device("cpu")
    assert validate._rank_device("gloo", "cpu", 0) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert validate._rank_device("gloo", "cuda", 3) == torch.device("cuda", 1)


def test_checks_on_cuda_use_ieee_float32_and_restore_the_settings() -> None:
    """TF32 would round the dyadic products (see Note [Dyadic data]); the settings are
    process-wide, so they are put back afterwards. Nothing changes on the CPU."""
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.allow_tf32 = True
        with validate._exact_float32(torch.device("cpu")):
            assert torch.get_float32_matmul_precision() == "high"
        with validate._exact_float32(torch.device("cuda", 0)):
            assert torch.get_float32_matmul_precision() == "highest"
            assert torch.backends.cudnn.allow_tf32 is False
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cudnn.allow_tf32 is True
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]


@pytest.mark.slow
def test_the_cli_lists_the_device_option() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "reducer", "validate", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-600:]
    assert "--device {cpu,cuda}" in out.stdout


TEARDOWN_PROBE = (
    "import atexit, runpy, sys; "
    "atexit.register(lambda: print('interpreter teardown ran', flush=True)); "
    "sys.argv = ['reducer', *sys.argv[1:]]; "
    "runpy.run_module('reducer', run_name='__main__', alter_sys=True)"
)


@pytest.mark.slow
@pytest.mark.parametrize("command", ["validate", "launch"])
def test_python_m_reducer_validate_leaves_without_interpreter_teardown(
    command: str, tmp_path: Path
) -> None:
    """``torchrun -m reducer validate`` runs reducer/__main__.py: like validate's own
    ``__main__``, it must end a settled rank with os._exit, before interpreter teardown (where
    gloo's C++ threads winding down sometimes abort the process with SIGABRT after a passing
    table). An atexit handler shows whether teardown ran. ``launch`` must still run it: a
    training script's atexit handlers are its own."""
    if command == "validate":
        # Skips at once, exit code 0, on any machine (the GPUs hidden).
        args = ["validate", "--backend", "nccl", "--nproc", "1"]
    else:
        script = tmp_path / "hello.py"
        script.write_text("print('hello')\n")
        args = ["launch", "--nproc", "1", str(script)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    out = subprocess.run(
        [sys.executable, "-c", TEARDOWN_PROBE, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    ran = "interpreter teardown ran" in out.stdout
    assert ran == (command == "launch"), out.stdout
