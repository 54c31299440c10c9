"""``python -m reducer launch``: torchrun-style scripts on rank threads, exact, and loud when stuck.

The nanoGPT-style script (tests/scripts/nanogpt_train.py) is checked against a reference that
replays each rank's random stream (init, batches, dropout) in one thread and averages the
accumulated gradients as DDP does (``acc0 / 2 + acc1 / 2``, exact at two ranks). Two runs go
through a real ``python -m reducer launch`` process (exit codes, output); the others call the
CLI in this process, which is the same code path.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import ClassVar

import pytest
import torch
from helpers import write_script as write

from reducer.tools import cli

SCRIPTS = Path(__file__).parent / "scripts"
NANOGPT = SCRIPTS / "nanogpt_train.py"
NANOGPT_CUDA = SCRIPTS / "nanogpt_cuda.py"
NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False)"
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


@pytest.mark.slow
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


@pytest.mark.parametrize("backend", ["gloo", "cuda:nccl", "cpu:gloo,cuda:nccl"])
def test_this_projects_ddp_trains_the_script_to_the_same_bits(
    backend: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "params.pt"
    args = ["--nproc", "2", str(NANOGPT), "--backend", backend, "--ddp", "reducer"]
    code = cli.main(["launch", *args, "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    want = reference_params(world_size=2, steps=3, grad_accum=4, batch_size=4)
    assert all(torch.equal(a, b) for a, b in zip(torch.load(out), want, strict=True))


@pytest.mark.slow
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


@pytest.mark.slow
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
    # A clean message, every rank stopped, and torchrun's summary; no launcher traceback.
    assert "KeyboardInterrupt: ;" not in err, err
    assert not [line for line in err.splitlines() if line.startswith("Traceback")], err
    summary = err[err.index("spin.py FAILED") :]
    assert "Root Cause (first observed failure):\n  [0]: interrupted (Ctrl-C, SIGINT)" in summary
    assert "[1]: rank 0: exitcode 1: WorldAborted" in summary
    assert "the launch was interrupted (Ctrl-C)" in summary
    assert "[2]: rank 1: exitcode 1: fakepg: this rank was stopped" in summary
    report = err[err.index("[launch] interrupted; where every rank is:") :]
    rank0 = report[report.index("[launch] rank 0:") : report.index("[launch] rank 1:")]
    rank1 = report[report.index("[launch] rank 1:") :]
    assert 'spin.py", line ' in rank0 and 'spin.py", line ' in rank1
    # Normally rank 0 waits in the barrier and rank 1 sleeps in its loop:
    assert "line 7, in <module>\n    dist.barrier()" in rank0 or "line 5" in rank0, rank0
    assert "line 9, in <module>\n    time.sleep(0.01)" in rank1 or "line 5" in rank1, rank1


# -------------------------------------------------------------------------------------------
# Imports and process-wide state on rank threads.


@pytest.mark.slow
def test_a_lazily_importing_package_is_imported_once_before_the_ranks_start() -> None:
    """tests/scripts/lazypkg fails every time two threads ask for a lazy name at once (as
    transformers' lazy module may): the script's leading imports, and the attributes it reads
    from modules imported there, are done once before the rank threads start."""
    done = launch_process("--nproc", "2", str(SCRIPTS / "lazy_imports.py"))
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [
        "[rank0]: rank 0: Model Config",
        "[rank1]: rank 1: Model Config",
    ]


def test_an_import_that_fails_is_reported_by_every_rank_at_the_scripts_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As torchrun's workers would: each rank's own traceback, at the script's line."""
    script = write(tmp_path, "missing.py", "import os\nimport no_such_module_for_launch\n")
    assert cli.main(["launch", "--nproc", "2", str(script)]) == 1
    err = capsys.readouterr().err
    for rank in (0, 1):
        assert f'[rank{rank}]:   File "{script}", line 2, in <module>' in err
        assert (
            f"[rank{rank}]: ModuleNotFoundError: No module named 'no_such_module_for_launch'" in err
        )
    assert "Failures:\n  [1]: rank " in err and ": exitcode 1: ModuleNotFoundError" in err


def test_imports_after_other_statements_are_left_to_the_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An import may need what the script did before it (here sys.path): only the leading
    block runs early."""
    package = tmp_path / "deps"
    package.mkdir()
    (package / "needs_path_for_launch.py").write_text("VALUE = 7\n")
    script = write(
        tmp_path,
        "late.py",
        f"""
        import sys
        sys.path.insert(0, {str(package)!r})
        import needs_path_for_launch
        print(needs_path_for_launch.VALUE)
        """,
    )
    try:
        assert cli.main(["launch", "--nproc", "2", str(script)]) == 0
    finally:
        sys.modules.pop("needs_path_for_launch", None)
        while str(package) in sys.path:
            sys.path.remove(str(package))
    assert sorted(capsys.readouterr().out.splitlines()) == ["[rank0]: 7", "[rank1]: 7"]


@pytest.mark.slow
def test_accelerates_per_process_state_is_per_rank_on_rank_threads() -> None:
    """Accelerate's state is one per process (every instance shares a class-level dict): on
    rank threads both ranks would get the first rank's index (or an AttributeError). With the
    stand-in of it (tests/scripts/standins/accelerate: the real package is not a test
    dependency; tests/test_launch_accelerate.py runs it where installed), each rank has a
    state of its own."""
    done = launch_process("--nproc", "2", str(SCRIPTS / "standins" / "accelerate_train.py"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(done.stdout.splitlines()) == [
        "[rank0]: process index 0",
        "[rank1]: process index 1",
    ]


@pytest.mark.parametrize("imported", [False, True], ids=["not-imported", "already-imported"])
def test_per_rank_state_and_refusals_end_with_the_launch(
    imported: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On rank threads a class-level state dict is the rank's own and a refused class
    raises saying why; off rank threads, and after the launch, the classes are as they
    were. The stand-in modules leave sys.modules as they found it: a real ``accelerate.state``
    imported before (test_launch_accelerate.py imports accelerate when collected) is put back,
    not dropped, or a later launch finds no module to make per rank while Accelerator still
    uses the old one's shared state, and its rank 1 skips init_process_group."""
    import threading

    from reducer.tools.launch import singletons

    class PartialState:
        _shared_state: ClassVar[dict[str, int]] = {}

        def __init__(self) -> None:
            self.__dict__ = self._shared_state

    class DeepSpeedPlugin:
        def __init__(self) -> None:
            self.made = True

    state = ModuleType("accelerate.state")
    state.PartialState = PartialState  # type: ignore[attr-defined]
    plugins = ModuleType("accelerate.utils.dataclasses")
    plugins.DeepSpeedPlugin = DeepSpeedPlugin  # type: ignore[attr-defined]
    shared = PartialState._shared_state
    rank: list[int | None] = [None]
    names = ("accelerate.state", "accelerate.utils.dataclasses")
    if imported:  # what sys.modules holds where accelerate was imported before this test
        for name in names:
            monkeypatch.setitem(sys.modules, name, ModuleType(name))
    before = {name: sys.modules.get(name) for name in names}
    with pytest.MonkeyPatch.context() as modules:
        modules.setitem(sys.modules, "accelerate.state", state)
        modules.setitem(sys.modules, "accelerate.utils.dataclasses", plugins)
        restore = singletons.install(lambda: rank[0], 2)
        try:
            assert DeepSpeedPlugin().made  # not a rank thread
            PartialState().index = 0  # type: ignore[attr-defined]
            seen: list[object] = []
            other = threading.Thread(target=lambda: seen.append(PartialState().__dict__))
            other.start()
            other.join(5.0)
            assert seen == [{}]  # another thread's state is its own
            assert PartialState().index == 0  # type: ignore[attr-defined]
            # A rank's state is the rank's, not its thread's: rank threads are kept between
            # jobs, and a rank that ended hands its thread to the next one to start.
            rank[0] = 0
            PartialState().index = 10  # type: ignore[attr-defined]
            rank[0] = 1
            assert PartialState().__dict__ == {}  # on the thread rank 0 ran on
            PartialState().index = 11  # type: ignore[attr-defined]
            rank[0] = 0
            assert PartialState().index == 10  # type: ignore[attr-defined]
            rank[0] = 1
            with pytest.raises(singletons.SharedStateError, match="on rank 1: Accelerate's Deep"):
                DeepSpeedPlugin()
        finally:
            restore()
        assert DeepSpeedPlugin().made
        assert not hasattr(DeepSpeedPlugin.__init__, "__wrapped__")
        assert PartialState.__dict__["_shared_state"] is shared and shared == {}
    assert {name: sys.modules.get(name) for name in names} == before


def test_a_class_missing_from_its_module_is_found_when_the_module_is_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Import statements stop looking for a class once its module is complete without it,
    until another module object takes that name (a package replacing itself, a stand-in)."""
    from reducer.tools.launch import singletons

    class PartialState:
        _shared_state: ClassVar[dict[str, int]] = {}

    kind = singletons.PerRank("per_rank_state_later", ("PartialState",))
    monkeypatch.setitem(sys.modules, kind.module, ModuleType(kind.module))  # without the class
    restore = singletons.install(lambda: None, 2, known=(), per_rank=(kind,))
    try:
        __import__("json")  # an import statement: the module is complete, without the class

        assert isinstance(PartialState.__dict__["_shared_state"], dict)
        real = ModuleType(kind.module)
        real.PartialState = PartialState  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, kind.module, real)
        __import__("json")  # another module object holds the name now

        assert isinstance(PartialState.__dict__["_shared_state"], singletons.PerRankState)
    finally:
        restore()
    assert isinstance(PartialState.__dict__["_shared_state"], dict)


# -------------------------------------------------------------------------------------------
# The launcher's own defects: errors, stacks, stuck ranks, Ctrl-C, torchrun's flags.


def test_a_script_that_does_not_compile_is_an_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(tmp_path, "broken.py", "import os\nx = (\n")
    assert cli.main(["launch", "--nproc", "2", str(script)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"python -m reducer launch: error: {script} does not compile:\n")
    assert f'File "{script}", line 2' in err and "SyntaxError: '(' was never closed" in err
    assert "Traceback" not in err


def test_fakepg_frames_are_folded_unless_full_stacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(
        tmp_path,
        "desync2.py",
        """
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(3))
        else:
            dist.broadcast(torch.ones(3), src=0)
        """,
    )
    fakepg_frame = f'{Path("fakepg", "work.py")}", line '
    assert cli.main(["launch", "--nproc", "2", str(script)]) == 1
    err = capsys.readouterr().err
    report = err[err.index("[launch] where every rank was") :]
    assert fakepg_frame not in report
    assert "frame(s) in libraries (innermost: wait in work.py:" in report
    assert cli.main(["launch", "--nproc", "2", "--full-stacks", str(script)]) == 1
    assert fakepg_frame in capsys.readouterr().err


def test_each_rank_is_shown_where_it_stopped_not_in_a_finished_collective(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rank 1 fails right after an all_reduce that rank 0 is still returning from (held
    there half a second by a profile function, as a busy machine may hold it): a snapshot
    would show rank 0 inside that finished all_reduce. The report shows where rank 0
    stopped, its own traceback: the barrier of the next line, which the abort failed."""
    script = write(
        tmp_path,
        "consistent.py",
        """
        import sys, time
        import torch, torch.distributed as dist

        def slow_return(frame, event, arg):
            code = frame.f_code
            in_work = code.co_filename.endswith("work.py")
            if event == "return" and code.co_name == "wait" and in_work:
                time.sleep(0.5)

        dist.init_process_group("gloo")
        if dist.get_rank() == 0:
            sys.setprofile(slow_return)
        dist.all_reduce(torch.ones(2))
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 fails")
        sys.setprofile(None)
        dist.barrier()
        """,
    )
    assert cli.main(["launch", "--nproc", "2", "--timeout", "30", str(script)]) == 1
    err = capsys.readouterr().err
    report = err[err.index("[launch] where every rank was when rank 1 failed:") :]
    rank0 = report[report.index("[launch] rank 0") : report.index("[launch] rank 1")]
    barrier = script.read_text().splitlines().index("dist.barrier()") + 1
    assert f"line {barrier}, in <module>\n    dist.barrier()" in rank0, rank0
    assert "dist.all_reduce" not in rank0, rank0


@pytest.mark.slow
def test_a_rank_stuck_in_c_code_is_said_to_be_abandoned() -> None:
    script_dir = SCRIPTS  # a real process: the abandoned thread must not outlive this test
    done = launch_process(
        "--nproc", "2", "--timeout", "2", str(script_dir / "stuck_in_c.py"), timeout=120
    )
    assert done.returncode == 1
    err = done.stderr
    assert "[launch] rank 1 (did not stop; abandoned here):" in err
    stuck = err[err.index("[launch] rank 1 (did not stop; abandoned here):") :]
    assert "time.sleep(60)" in stuck.split("=" * 60)[0]
    assert "rank 1: did not end: still running 2 s after" in err
    assert "so the launch abandoned its thread" in err
    assert "stopped by the launch" not in err


def test_the_usage_error_names_only_what_is_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["launch"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error: the following arguments are required: script\n" in err
    assert "script_args" not in err.splitlines()[-1]


def test_torchruns_single_node_flags_are_accepted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(tmp_path, "size.py", "import os\nprint(os.environ['WORLD_SIZE'])\n")
    flags = ["--standalone", "--nnodes", "1", "--nproc-per-node", "2"]
    assert cli.main(["launch", *flags, str(script)]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == ["[rank0]: 2", "[rank1]: 2"]
    assert cli.main(["launch", "--nnodes=1:1", str(script)]) == 0  # and a default of 1 rank
    assert capsys.readouterr().out.splitlines() == ["[rank0]: 1"]
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        want = accelerator.device_count()
    else:
        want = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert cli.main(["launch", "--nproc-per-node", "auto", str(script)]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == sorted(
        f"[rank{r}]: {want}" for r in range(int(want or 1))
    )


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--nnodes", "2"], "--nnodes 2: a launch runs the ranks of one node"),
        (["--nnodes", "1:4"], "only --nnodes 1 (or 1:1). For several nodes, use torchrun"),
        (["--nproc-per-node", "many"], "--nproc-per-node takes a number of ranks, auto, cpu"),
        (["--nproc-per-node", "0"], "--nproc must be >= 1, got 0"),
    ],
)
def test_torchrun_flags_a_launch_cannot_honour_are_refused(
    args: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["launch", *args, str(NANOGPT)]) == 2
    err = capsys.readouterr().err
    assert words in err
    assert "no such script" not in err  # --nnodes is an option, never the script


def test_the_launch_examples_name_scripts_that_exist() -> None:
    """Every ``python -m reducer launch`` example in the README, the docs and the command's help
    runs a script of this repository (a newcomer copies them)."""
    from reducer.tools import launch

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    texts = [*(page.read_text() for page in pages), launch.__doc__ or ""]
    examples = [
        line
        for text in texts
        for line in text.replace("\\\n", " ").splitlines()
        if "python -m reducer launch " in line
    ]
    assert len(examples) >= 6, examples
    for line in examples:
        words = line.split("python -m reducer launch ", 1)[1].split()
        scripts = [word for word in words if word.endswith(".py")]
        modules = [words[i + 1] for i, word in enumerate(words[:-1]) if word == "-m"]
        scripts += [module.replace(".", "/") + ".py" for module in modules]
        for script in scripts:
            assert (ROOT / script).is_file(), f"{script} (in: {line.strip()})"


# -------------------------------------------------------------------------------------------
# CUDA scripts: --cuda-as-cpu here; on a GPU, the ranks on it (benchmarks/gpu_check.py runs
# the gpu_launch tests).


@pytest.mark.parametrize("ddp", ["torch", "reducer"])
def test_a_cuda_script_runs_unmodified_on_the_cpu_with_cuda_as_cpu(
    ddp: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """nanogpt_cuda.py: set_device(cuda:LOCAL_RANK), .to(device), pinned non-blocking
    batches, device_ids=[local_rank], a GradScaler (disabled), torch.cuda.synchronize: the
    same bits as the CPU script's reference, and torch.cuda is put back afterwards."""
    out = tmp_path / "params.pt"
    args = ["--nproc", "2", "--cuda-as-cpu", str(NANOGPT_CUDA), "--ddp", ddp, "--out", str(out)]
    cuda_before = (torch.cuda.is_available, torch.Tensor.cuda, torch.Tensor.pin_memory)
    code = cli.main(["launch", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.err.count("[launch] --cuda-as-cpu: every CUDA device is the CPU here") == 1
    assert "[check] verdict: the ranks stayed in sync" in captured.err
    assert captured.out.count("on CPU (--cuda-as-cpu)") == 2
    want = reference_params(world_size=2, steps=3, grad_accum=4, batch_size=4)
    assert all(torch.equal(a, b) for a, b in zip(torch.load(out), want, strict=True))
    assert (torch.cuda.is_available, torch.Tensor.cuda, torch.Tensor.pin_memory) == cuda_before
    assert "cuda" not in vars(torch.Tensor) and "pin_memory" not in vars(torch.Tensor)


def test_autocast_and_a_grad_scaler_for_cuda_run_on_the_cpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """bf16 autocast and an enabled GradScaler: the ranks stay in sync, and the check notes
    that the scaler changed the gradients (it does not mistake that for a wrong average)."""
    args = ["--nproc", "2", "--cuda-as-cpu", str(NANOGPT_CUDA), "--amp", "--steps", "2"]
    code = cli.main(["launch", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "NOTE: gradients were unscaled by a GradScaler on rank 0" in captured.err
    sums = [line.split()[2] for line in captured.out.splitlines() if " params " in line]
    assert len(sums) == 2 and sums[0] == sums[1]


def test_cuda_as_cpu_refuses_what_a_real_node_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Device indices at or beyond device_count() fail as CUDA fails them ("invalid device
    ordinal"), wherever the script names one; what the CPU cannot stand for is named."""
    script = tmp_path / "ordinals.py"
    script.write_text(
        textwrap.dedent(
            """\
            import os
            import torch
            local_rank = int(os.environ["LOCAL_RANK"])
            x = torch.ones(2)
            attempts = {
                "set_device": lambda: torch.cuda.set_device(local_rank + 4),
                "factory": lambda: torch.zeros(2, device=f"cuda:{torch.cuda.device_count()}"),
                "to": lambda: x.to(torch.device("cuda", 2)),
                "cuda": lambda: x.cuda(7),
                "device": lambda: torch.cuda.device(2),
                "properties": lambda: torch.cuda.get_device_properties(2),
                "graph": lambda: torch.cuda.CUDAGraph(),
            }
            for name, attempt in attempts.items():
                try:
                    attempt()
                except (RuntimeError, AssertionError) as exc:
                    print(name, type(exc).__name__, str(exc).split(" (")[0])
                else:
                    print(name, "accepted")
            torch.cuda.set_device(local_rank)  # in range: accepted, as on the node
            state = torch.cuda.get_rng_state()
            print("current", torch.cuda.current_device(), torch.equal(state, torch.get_rng_state()))
            """
        )
    )
    assert cli.main(["launch", "--nproc", "2", "--cuda-as-cpu", str(script)]) == 0
    out = capsys.readouterr().out
    invalid = "AcceleratorError CUDA error: invalid device ordinal"
    for rank in (0, 1):
        for name in ("set_device", "factory", "to", "cuda", "device"):
            assert f"[rank{rank}]: {name} {invalid}" in out
        assert f"[rank{rank}]: properties AssertionError Invalid device id" in out
        assert (
            f"[rank{rank}]: graph RuntimeError torch.cuda.CUDAGraph under --cuda-as-cpu: "
            "the CPU cannot stand for it"
        ) in out
        assert f"[rank{rank}]: current {rank} True" in out


def test_device_maps() -> None:
    from reducer.tools.launch import devices

    shared = devices.round_robin(2)
    assert shared(torch.device("cuda", 3)) == torch.device("cuda", 1)
    assert shared(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert shared(torch.device("cuda")) == torch.device("cuda")
    assert devices.as_cpu(torch.device("cuda", 1)) == torch.device("cpu")
    with devices.DeviceMap(devices.as_cpu):
        made = torch.zeros(2, device="cuda:1")
        moved = torch.ones(2).to("cuda", non_blocking=True)
        again = torch.ones(2).to(1)
    assert made.device.type == moved.device.type == again.device.type == "cpu"


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("world_size", [2, 3])
def test_gpu_launch_of_a_cuda_script_bitwise_against_torchs_ddp(
    world_size: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the GPUs there are (round-robin when fewer than the ranks), with the check on:
    this project's DDP ends with torch's DDP's parameters, bit for bit."""
    params = {}
    for ddp in ("torch", "reducer"):
        out = tmp_path / f"{ddp}.pt"
        args = ["--nproc", str(world_size), str(NANOGPT_CUDA), "--ddp", ddp, "--out", str(out)]
        code = cli.main(["launch", *args, "--grad-accum", str(2 * world_size)])
        captured = capsys.readouterr()
        assert code == 0, captured.err
        assert "[check] verdict: the ranks stayed in sync" in captured.err
        assert "CPU" not in captured.out
        params[ddp] = torch.load(out)
    assert all(torch.equal(a, b) for a, b in zip(params["torch"], params["reducer"], strict=True))


def test_a_comm_hooks_callback_runs_in_its_rank_under_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(
        tmp_path,
        "hook.py",
        """
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        def hook(state, bucket):
            fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))

        def main():
            dist.init_process_group("gloo")
            torch.manual_seed(0)
            model = DDP(torch.nn.Linear(2, 1))
            model.register_comm_hook(None, hook)
            model(torch.ones(1, 2) * (dist.get_rank() + 1)).sum().backward()
            print(dist.get_rank(), model.module.bias.grad.item())
            dist.destroy_process_group()

        if __name__ == "__main__":
            main()
        """,
    )
    assert cli.main(["launch", "--nproc", "2", str(script)]) == 0
    assert sorted(capsys.readouterr().out.splitlines()) == ["[rank0]: 0 1.0", "[rank1]: 1 1.0"]
