"""``python -m reducer launch``: what a process does once, done per rank thread.

Each test runs a small script through the CLI in this process (the same code path as a launch
process): os._exit and sys.exit end one rank, sys.stdout/sys.stderr assignment is per rank,
input() reads end-of-file, signal.signal is refused with why, script-defined classes and
functions pickle, a directory or zip with __main__.py runs, contradictory flags are refused.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
from helpers import launch_two_ranks as launch
from helpers import write_script as write


def lines(text: str, rank: int) -> list[str]:
    prefix = f"[rank{rank}]: "
    return [line.removeprefix(prefix) for line in text.splitlines() if line.startswith(prefix)]


def test_os_exit_0_ends_that_rank_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = write(
        tmp_path,
        "exit_early.py",
        """\
        import os
        import time
        if os.environ["RANK"] == "0":
            os._exit(0)
        time.sleep(0.2)  # rank 0 has ended by now: rank 1 goes on
        print("rank 1 still runs")
        """,
    )
    assert launch(str(script)) == 0
    captured = capsys.readouterr()
    assert lines(captured.out, 1) == ["rank 1 still runs"]
    assert "[check] verdict: no optimizer step ran" in captured.err  # the summary is there


def test_os_exit_with_a_code_is_that_ranks_exit_code(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(
        tmp_path,
        "exit_3.py",
        """\
        import os
        if os.environ["RANK"] == "1":
            os._exit(3)
        print("rank 0 ends")
        """,
    )
    assert launch(str(script)) == 1  # torchrun's: a worker failed
    captured = capsys.readouterr()
    assert lines(captured.out, 0) == ["rank 0 ends"]
    assert "Root Cause (first observed failure):\n  [0]: rank 1: exitcode 3: os._exit(3)" in (
        captured.err
    )
    assert "Traceback" not in captured.err  # an exit, not a crash


def test_off_the_rank_threads_everything_is_the_real_one_and_is_put_back() -> None:
    import threading

    from reducer.tools.launch import process
    from reducer.tools.launch.threads import RankOutput

    real = (os._exit, signal.signal, sys.stdin, sys.modules["__main__"], type(sys))
    out = RankOutput(sys.stdout, threading.Lock(), None)
    main, restore = process.install(lambda: None, out, out)
    try:
        assert os._exit is not real[0] and signal.signal is not real[1]
        previous = signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # not a rank: allowed
        signal.signal(signal.SIGUSR1, previous)
        assert main.__name__ == real[3].__name__  # the process's own __main__
    finally:
        restore()
    assert (os._exit, signal.signal, sys.stdin, sys.modules["__main__"], type(sys)) == real


@pytest.mark.parametrize(("code", "expected"), [(0, 0), (2, 1), ("bye", 1)])
def test_sys_exit_ends_that_rank_only(
    code: object, expected: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(
        tmp_path,
        "sys_exit.py",
        f"""\
        import os
        import sys
        import time
        if os.environ["RANK"] == "1":
            sys.exit({code!r})
        time.sleep(0.2)
        print("rank 0 still runs")
        """,
    )
    assert launch(str(script)) == expected
    captured = capsys.readouterr()
    if code == 0:
        assert lines(captured.out, 0) == ["rank 0 still runs"]
    elif code == 2:
        assert "rank 1: exitcode 2: SystemExit(2)" in captured.err
    else:
        assert "[rank1]: bye" in captured.err  # printed, as python prints sys.exit("bye")
        assert "rank 1: exitcode 1: SystemExit('bye')" in captured.err


def test_stdout_and_stderr_assignment_is_per_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(
        tmp_path,
        "quiet.py",
        """\
        import io
        import os
        import sys
        import time
        rank = int(os.environ["RANK"])
        if rank != 0:
            sys.stdout = open(os.devnull, "w")
            sys.stderr = io.StringIO()
        time.sleep(0.2)  # both ranks print after rank 1 silenced itself
        print(f"out from {rank}")
        print(f"err from {rank}", file=sys.stderr)
        if rank != 0:
            captured = sys.stderr.getvalue()
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
            print(f"rank 1 captured {captured.strip()!r}")
        """,
    )
    assert launch("--no-check", str(script)) == 0
    captured = capsys.readouterr()
    assert lines(captured.out, 0) == ["out from 0"]
    assert lines(captured.err, 0) == ["err from 0"]
    assert lines(captured.out, 1) == ["rank 1 captured 'err from 1'"]  # prefixed again
    assert lines(captured.err, 1) == []
    assert sys.stdout is not None and type(sys).__name__ == "module"  # put back


def test_input_reads_end_of_file_with_a_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(
        tmp_path,
        "asks.py",
        """\
        import sys
        try:
            input("name? ")
        except EOFError:
            print("got EOF")
        print("read", repr(sys.stdin.readline()))
        """,
    )
    assert launch("--no-check", str(script)) == 0
    captured = capsys.readouterr()
    for rank in (0, 1):
        assert "got EOF" in " ".join(lines(captured.out, rank))
        assert "read ''" in lines(captured.out, rank)
        notes = [line for line in lines(captured.err, rank) if "standard input" in line]
        assert len(notes) == 1  # once per rank
        assert "gets end-of-file" in notes[0] and "threads of one process" in notes[0]


@pytest.mark.slow
def test_piped_stdin_gives_every_rank_end_of_file_however_it_is_read(tmp_path: Path) -> None:
    """100,000 bytes piped to a launch: no rank reads any of them, by any route (the text
    stream, its buffer, the original stream, the file descriptor), and the launch's own stdin
    is put back afterwards."""
    script = write(
        tmp_path,
        "reads.py",
        """        import os
        import sys
        import time
        got = [len(sys.stdin.buffer.read()), len(sys.stdin.read())]
        time.sleep(0.2)  # the other rank reads meanwhile
        fd0 = open(0, "rb", closefd=False)
        got += [len(sys.__stdin__.buffer.read()), len(os.read(0, 1000)), len(fd0.read())]
        print("read", got)
        """,
    )
    root = Path(__file__).parent.parent
    done = subprocess.run(
        [sys.executable, "-c", LAUNCH_THEN_READ, "--nproc", "2", "--no-check", str(script)],
        input=b"x" * 100_000,
        capture_output=True,
        timeout=120,
        cwd=root,
        check=False,
    )
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    for rank in (0, 1):
        assert lines(out, rank) == ["read [0, 0, 0, 0, 0]"]
    assert "after the launch: 100000 bytes" in out  # fd 0 is the pipe again


# A launch process that reads what is left of its stdin after the launch.
LAUNCH_THEN_READ = """\
import os, sys
from reducer.tools import cli
code = cli.main(["launch", *sys.argv[1:]])
print(f"after the launch: {len(sys.stdin.buffer.read())} bytes", flush=True)
sys.exit(code)
"""


def test_signal_handlers_are_refused_on_rank_threads_with_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(
        tmp_path,
        "handler.py",
        """\
        import signal
        signal.signal(signal.SIGTERM, lambda *args: None)
        """,
    )
    before = signal.getsignal(signal.SIGTERM)
    assert launch("--no-check", str(script)) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "ValueError: signal.signal(SIGTERM, ...) on rank 0: the ranks of" in err
    assert "are threads of one process" in err
    assert "threading.current_thread() is threading.main_thread()" in err
    assert signal.getsignal(signal.SIGTERM) is before


def test_script_classes_and_functions_pickle_per_rank(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(
        tmp_path,
        "saves.py",
        """\
        import io
        import os
        import pickle
        import __main__
        import fresh_module_for_launch
        import torch

        RANK = int(os.environ["RANK"])


        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.scale = torch.nn.Parameter(torch.full((2,), float(RANK)))


        def double(x):
            return 2 * x


        buffer = io.BytesIO()
        torch.save(Net(), buffer)
        buffer.seek(0)
        net = torch.load(buffer, weights_only=False)
        again = pickle.loads(pickle.dumps(double))
        print(type(net).__name__, net.scale.tolist(), again(RANK), __main__.RANK)
        """,
    )
    (tmp_path / "fresh_module_for_launch.py").write_text("VALUE = 1\n")
    try:
        assert launch("--no-check", str(script)) == 0
        # A module first imported on a rank is a plain module (importlib makes new modules
        # as type(sys)(name), and the launch changes sys's class).
        assert type(sys.modules["fresh_module_for_launch"]) is ModuleType
    finally:
        sys.modules.pop("fresh_module_for_launch", None)
    out = capsys.readouterr().out
    assert lines(out, 0) == ["Net [0.0, 0.0] 0 0"]
    assert lines(out, 1) == ["Net [1.0, 1.0] 2 1"]  # each rank's own module
    assert isinstance(sys.modules["__main__"], type(sys))  # put back


def test_multiprocessing_spawn_of_a_script_function(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(
        tmp_path,
        "spawns.py",
        """\
        import multiprocessing
        import os


        def worker(rank, queue):
            queue.put(rank * 10)


        if __name__ == "__main__":
            rank = int(os.environ["RANK"])
            context = multiprocessing.get_context("spawn")
            queue = context.Queue()
            child = context.Process(target=worker, args=(rank, queue))
            child.start()
            said = queue.get(timeout=60)  # every wait has a timeout: a failed child fails
            child.join(60)
            print("child said", said, "exit code", child.exitcode)
        """,
    )
    assert launch("--no-check", str(script)) == 0
    out = capsys.readouterr().out
    assert lines(out, 0) == ["child said 0 exit code 0"]
    assert lines(out, 1) == ["child said 10 exit code 0"]


MAIN = """\
import os
import helper_for_launch_main
print("main of", __file__.replace(os.sep, "/").rsplit("/", 2)[-2], helper_for_launch_main.VALUE)
"""


def test_a_directory_with_main_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    app = tmp_path / "app"
    app.mkdir()
    (app / "__main__.py").write_text(MAIN)
    (app / "helper_for_launch_main.py").write_text("VALUE = 'dir'\n")
    try:
        assert launch("--no-check", str(app)) == 0
    finally:
        sys.modules.pop("helper_for_launch_main", None)
    out = capsys.readouterr().out
    assert lines(out, 0) == lines(out, 1) == ["main of app dir"]


def test_a_zip_with_main_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    archive = tmp_path / "app.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("__main__.py", MAIN)
        z.writestr("helper_for_launch_main.py", "VALUE = 'zip'\n")
    try:
        assert launch("--no-check", str(archive)) == 0
    finally:
        sys.modules.pop("helper_for_launch_main", None)
    out = capsys.readouterr().out
    assert lines(out, 0) == lines(out, 1) == ["main of app.zip zip"]


def test_a_directory_without_main_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert launch(str(tmp_path)) == 2
    assert "is a directory without a __main__.py" in capsys.readouterr().err


def test_contradictory_flags_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = write(tmp_path, "nothing.py", "print('ran')\n")
    assert launch("--no-check", "--check-keep-going", str(script)) == 2
    captured = capsys.readouterr()
    assert "--no-check and --check-keep-going contradict each other" in captured.err
    assert "ran" not in captured.out


def test_a_module_run_with_m_pickles_its_classes_per_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    package = tmp_path / "pkg_pickles_for_launch"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(
        textwrap.dedent(
            """\
            import os
            import pickle


            class Box:
                def __init__(self, value):
                    self.value = value


            if __name__ == "__main__":
                box = pickle.loads(pickle.dumps(Box(int(os.environ["RANK"]))))
                print(type(box).__module__, box.value, __spec__.name)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert launch("--no-check", "-m", "pkg_pickles_for_launch.train") == 0
    finally:
        for name in [m for m in sys.modules if m.startswith("pkg_pickles_for_launch")]:
            del sys.modules[name]
    out = capsys.readouterr().out
    assert lines(out, 0) == ["__main__ 0 pkg_pickles_for_launch.train"]
    assert lines(out, 1) == ["__main__ 1 pkg_pickles_for_launch.train"]


@pytest.mark.parametrize("given", [None, "0.002"], ids=["default", "given"])
def test_the_switch_interval_is_the_launchs_while_the_ranks_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], given: str | None
) -> None:
    """Ranks take turns at the GIL every 0.5 ms by default (--switch-interval), and the
    process has Python's interval back once they have ended."""
    script = write(
        tmp_path,
        "interval.py",
        "import sys\nprint(f'interval {sys.getswitchinterval():g}')\n",
    )
    before = sys.getswitchinterval()
    flags = () if given is None else ("--switch-interval", given)
    assert launch("--nproc", "2", "--no-check", *flags, str(script)) == 0
    out = capsys.readouterr().out
    expected = "0.0005" if given is None else given
    for rank in (0, 1):
        assert f"[rank{rank}]: interval {expected}" in out
    assert sys.getswitchinterval() == before


@pytest.mark.parametrize("value", ["0", "-1", "2"])
def test_a_switch_interval_out_of_range_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    script = write(tmp_path, "nothing.py", "print('ran')\n")
    assert launch("--switch-interval", value, str(script)) == 2
    captured = capsys.readouterr()
    assert f"--switch-interval {float(value)}: give the seconds a rank thread may keep" in (
        captured.err
    )
    assert "ran" not in captured.out
