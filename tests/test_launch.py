"""``python -m reducer launch``: torchrun-style scripts on rank threads, exact, and loud when stuck.

The nanoGPT-style script (tests/scripts/nanogpt_train.py) is checked against a reference that
replays each rank's random stream (init, batches, dropout) in one thread and averages the
accumulated gradients as DDP does (``acc0 / 2 + acc1 / 2``, exact at two ranks). Two runs go
through a real ``python -m reducer launch`` process (exit codes, output); the others call the
CLI in this process, which is the same code path.
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from reducer.tools import cli

SCRIPTS = Path(__file__).parent / "scripts"
NANOGPT = SCRIPTS / "nanogpt_train.py"
ROOT = Path(__file__).parent.parent


def launch_process(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "reducer", "launch", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )


def nanogpt() -> ModuleType:
    spec = importlib.util.spec_from_file_location("nanogpt_train", NANOGPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_params(
    world_size: int, steps: int, grad_accum: int, batch_size: int
) -> list[torch.Tensor]:
    """The script's training, every rank replayed in this thread with its own random stream."""
    gpt = nanogpt()
    micro = grad_accum // world_size
    states, models = [], []
    for rank in range(world_size):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1337 + rank)
            models.append(gpt.GPT())  # every rank draws its init; DDP keeps rank 0's
            states.append(torch.get_rng_state())
    model = models[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    batches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * world_size
    for _ in range(steps):
        accumulated = []
        for rank in range(world_size):
            model.zero_grad(set_to_none=True)
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(states[rank])
                if batches[rank] is None:
                    batches[rank] = gpt.get_batch(batch_size)
                for _ in range(micro):
                    x, y = batches[rank]  # type: ignore[misc]
                    loss = model(x, y) / micro
                    batches[rank] = gpt.get_batch(batch_size)
                    loss.backward()
                states[rank] = torch.get_rng_state()
            accumulated.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        for i, p in enumerate(model.parameters()):
            total = accumulated[0][i] * (1 / world_size)
            for acc in accumulated[1:]:
                total = total + acc[i] * (1 / world_size)
            p.grad = total
        optimizer.step()
    return [p.detach() for p in model.parameters()]


def test_a_nanogpt_style_script_trains_exactly_under_launch(tmp_path: Path) -> None:
    """Unmodified torchrun script, backend "nccl", torch's DDP, gradient accumulation with
    require_backward_grad_sync: every rank ends with the reference's parameters, bit for bit,
    and every output line carries its rank."""
    out = tmp_path / "params.pt"
    done = launch_process("--nproc", "2", str(NANOGPT), "--backend", "nccl", "--out", str(out))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("[rank0]: step 0: loss ")
    sums = sorted(line for line in lines if " params " in line)
    assert [s.split(":")[0] for s in sums] == ["[rank0]", "[rank1]"]
    assert sums[0].split()[-1] == sums[1].split()[-1]  # the same parameters on both ranks
    got = torch.load(out)
    want = reference_params(world_size=2, steps=3, grad_accum=4, batch_size=4)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("backend", ["gloo", "cpu:gloo,cuda:nccl"])
def test_this_projects_ddp_trains_the_script_to_the_same_bits(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "params.pt"
    args = ["--nproc", "2", str(NANOGPT), "--backend", backend, "--ddp", "reducer"]
    code = cli.main(["launch", *args, "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    want = reference_params(world_size=2, steps=3, grad_accum=4, batch_size=4)
    assert all(torch.equal(a, b) for a, b in zip(torch.load(out), want, strict=True))


def test_a_deadlocked_script_ends_within_the_timeout_naming_the_missing_ranks() -> None:
    start = time.monotonic()
    done = launch_process("--nproc", "2", "--timeout", "2", str(SCRIPTS / "deadlock.py"))
    elapsed = time.monotonic() - start
    assert done.returncode == 1
    assert elapsed < 2 + 2 * 2 + 30  # the timeout, the stop grace, and interpreter start-up
    err = done.stderr
    # Which ranks are missing from which collective. Both ranks wait with the same timeout:
    # whichever expires first is the root cause (the other rank is then woken by the abort).
    allreduce = "allreduce #1 (op=SUM) timed out after 2 s (this rank's wait): rank 1 never "
    allreduce += "issued it (rank 0 did)"
    recv = "send/recv #0 from rank 0 to rank 1 (tag 0) timed out after 2 s (this rank's wait): "
    recv += "rank 0 never sent it (rank 1 posted the recv)"
    root = err[err.index("Root Cause (first observed failure):") :]
    assert (allreduce in root) != (recv in root), root
    # Every rank's stack, at the line where it waits:
    assert "[launch] where every rank was when rank" in err
    report = err[err.index("[launch] where every rank was") :]
    assert 'deadlock.py", line 15, in <module>\n    dist.all_reduce(t)' in report
    assert 'deadlock.py", line 17, in <module>\n    dist.recv(t, src=0)' in report
    # torchrun's summary:
    assert "deadlock.py FAILED" in err and "Root Cause (first observed failure):" in err
    assert "[rank0]: step 0 done: 2.0" in done.stdout


def write(tmp_path: Path, name: str, source: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return path


def test_each_rank_has_its_own_environment_argv_and_main(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(
        tmp_path,
        "env.py",
        """
        import os, sys
        import torch.distributed as dist

        def main():
            dist.init_process_group("nccl", init_method="env://")
            rank = int(os.environ["RANK"])
            os.environ["MINE"] = f"set by {rank}"
            dist.barrier()  # every rank has set MINE before any reads it
            keys = ("LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            print(rank, dist.get_rank(), dist.get_world_size(), os.getenv("MINE"),
                  [os.environ[k] for k in keys], sys.argv[1:])
            dist.destroy_process_group()

        if __name__ == "__main__":
            main()
        """,
    )
    assert cli.main(["launch", "--nproc", "3", str(script), "--flag", "x"]) == 0
    lines = sorted(capsys.readouterr().out.splitlines())
    for rank, line in enumerate(lines):
        assert line == (
            f"[rank{rank}]: {rank} {rank} 3 set by {rank} "
            f"['{rank}', '3', '3', '127.0.0.1', '29500'] ['--flag', 'x']"
        )
    import os

    assert "MINE" not in os.environ  # the real environment was never touched


def test_exit_codes_are_torchruns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clean = write(tmp_path, "clean.py", "import sys\nprint('bye')\nsys.exit(0)\n")
    assert cli.main(["launch", "--nproc", "2", str(clean)]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == ["[rank0]: bye", "[rank1]: bye"]

    failing = write(
        tmp_path,
        "exit3.py",
        """
        import os, sys
        import torch.distributed as dist
        dist.init_process_group("gloo")
        if os.environ["RANK"] == "1":
            sys.exit(3)
        dist.barrier()
        """,
    )
    assert cli.main(["launch", "--nproc", "2", str(failing)]) == 1
    err = capsys.readouterr().err
    assert "exit3.py FAILED" in err
    assert "[0]: rank 1: exitcode 3: SystemExit(3)" in err
    assert "rank 0: exitcode 1: WorldAborted" in err


def test_a_desync_shows_both_sides_and_the_stacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(
        tmp_path,
        "desync.py",
        """
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(3))
        else:
            dist.broadcast(torch.ones(3), src=0)
        """,
    )
    assert cli.main(["launch", "--nproc", "2", "--timeout", "30", str(script)]) == 1
    err = capsys.readouterr().err
    assert "CollectiveMismatch: fakepg: ranks disagree on collective #0" in err
    assert "allreduce(op=SUM, [float32[3]])" in err and "broadcast(root=0, [float32[3]])" in err
    # The script's lines 5 and 7 (its first line is empty):
    assert 'desync.py", line 5, in <module>\n    dist.all_reduce' in err
    assert 'desync.py", line 7, in <module>\n    dist.broadcast' in err


def test_output_of_other_ranks_can_be_filtered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(tmp_path, "hello.py", "import os\nprint('hello from', os.environ['RANK'])\n")
    args = ["--nproc", "3", "--local-ranks-filter", "0,2", "--network", "10gbe", str(script)]
    assert cli.main(["launch", *args]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == [
        "[rank0]: hello from 0",
        "[rank2]: hello from 2",
    ]


def test_init_process_group_with_another_rank_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(
        tmp_path,
        "wrong_rank.py",
        "import torch.distributed as dist\ndist.init_process_group('gloo', rank=5, world_size=2)\n",
    )
    assert cli.main(["launch", "--nproc", "2", str(script)]) == 1
    err = capsys.readouterr().err
    assert "init_process_group(rank=5) on rank 0 of a launch of 2" in err


def test_bad_launch_arguments_exit_with_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["launch", "--nproc", "2", "no/such/script.py"]) == 2
    assert "no such script: no/such/script.py" in capsys.readouterr().err
    assert cli.main(["launch", "--nproc", "0", str(NANOGPT)]) == 2
    assert cli.main(["launch", "--nproc", "2", "--timeout", "inf", str(NANOGPT)]) == 2
    assert "timeout must be > 0 seconds and finite" in capsys.readouterr().err


def test_a_module_runs_with_dash_m(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    package = tmp_path / "pkg_for_launch"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text("import os\nprint('rank', os.environ['RANK'], __name__)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        assert cli.main(["launch", "--nproc", "2", "-m", "pkg_for_launch.train"]) == 0
    finally:
        sys.path.remove(str(tmp_path))
    assert sorted(capsys.readouterr().out.splitlines()) == [
        "[rank0]: rank 0 __main__",
        "[rank1]: rank 1 __main__",
    ]


def test_ctrl_c_prints_where_every_rank_is(tmp_path: Path) -> None:
    script = write(
        tmp_path,
        "spin.py",
        """
        import os, sys, time
        import torch.distributed as dist
        dist.init_process_group("gloo")
        print("started", flush=True)
        if os.environ["RANK"] == "0":
            dist.barrier()  # waits for rank 1, which never comes
        while True:
            time.sleep(0.01)
        """,
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "reducer",
            "launch",
            "--nproc",
            "2",
            "--timeout",
            "600",
            str(script),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        started = 0
        while started < 2:  # both ranks are past init_process_group
            line = process.stdout.readline()
            assert line, "the launch ended before both ranks started"
            started += "started" in line
        time.sleep(0.5)  # let them reach the barrier and the loop (a stack shows either way)
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 130
    report = err[err.index("[launch] interrupted; where every rank is:") :]
    rank0 = report[report.index("[launch] rank 0:") : report.index("[launch] rank 1:")]
    rank1 = report[report.index("[launch] rank 1:") :]
    assert 'spin.py", line ' in rank0 and 'spin.py", line ' in rank1
    # Normally rank 0 waits in the barrier and rank 1 sleeps in its loop:
    assert "line 7, in <module>\n    dist.barrier()" in rank0 or "line 5" in rank0, rank0
    assert "line 9, in <module>\n    time.sleep(0.01)" in rank1 or "line 5" in rank1, rank1
