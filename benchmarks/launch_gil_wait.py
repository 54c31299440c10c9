"""Where ``python -m reducer launch``'s rank threads spend the training loop of the
nanoGPT-style script (tests/scripts/nanogpt_train.py, torch's DDP, ``--no-check``): waiting for
the GIL, blocked otherwise, or running, as shares of py-spy's samples.

py-spy samples every thread, idle ones included (``--idle``), with native frames
(``--native``), so a wait is told apart by what the thread waits in: the GIL is a condition
variable that libpython waits on (``take_gil``, inlined; reached from the eval loop,
``PyEval_RestoreThread``, ``PyGILState_Ensure`` or pybind11's ``gil_scoped_acquire`` when C++
calls back into Python); Python locks (an Event, a Condition: a collective's wait) and C++
condition variables (torch's DDP reducer waiting for the allreduce in ``finalize_backward``)
are "blocked"; any other sample is running or runnable. The samples count only the rank
threads, only inside the script's ``main`` loop (the model's construction included). py-spy
pauses the process for each native sample: the shares are the measure, not the speed.
Under torchrun each rank has its own interpreter and GIL: its share there is zero.

    python benchmarks/launch_gil_wait.py                      # N = 2, 4
    python benchmarks/launch_gil_wait.py --nprocs 2 --steps 20 --rate 100
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine, table

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "scripts" / "nanogpt_train.py"
# The frames that wait for the GIL on a condition variable (the innermost native frame above
# pthread_cond_(timed)wait).
_GIL_TAKERS = (
    "libpython",
    "PyEval_RestoreThread",
    "PyEval_AcquireThread",
    "PyGILState_Ensure",
    "gil_scoped_acquire",
)
_RANK = re.compile(r"^thread \(\d+\): fakepg-rank-\d+;(.*) (\d+)$")


def classify(frames: list[str]) -> str:
    """``gil``, ``blocked`` or ``running`` for one sample's frames (outermost first)."""
    waits = [
        i
        for i, f in enumerate(frames)
        if f.startswith(("pthread_cond_timedwait", "pthread_cond_wait"))
    ]
    if waits and waits[-1] > 0:
        caller = frames[waits[-1] - 1]
        return "gil" if any(name in caller for name in _GIL_TAKERS) else "blocked"
    if any(f.startswith("PyThread_acquire_lock") for f in frames):
        return "blocked"
    return "running"


def gil_caller(frames: list[str]) -> str:
    """The frame that needed the GIL: the caller of the innermost GIL-taking frame
    (``c10d::PyProcessGroup::PyWork::getFuture``: C++ calling the Python backend)."""
    waits = [i for i, f in enumerate(frames) if f.startswith("pthread_cond")]
    inner = waits[-1] - 1 if waits else len(frames) - 1
    while inner > 0 and any(name in frames[inner] for name in _GIL_TAKERS):
        inner -= 1
    return frames[inner].split(" (")[0]


def shares(raw: str) -> tuple[int, Counter[str], Counter[str], Counter[str]]:
    """The rank threads' samples in the training loop: count, per class, and of the GIL
    waits, the innermost Python frame and the frame that needed the GIL."""
    classes: Counter[str] = Counter()
    gil_at: Counter[str] = Counter()
    gil_for: Counter[str] = Counter()
    for line in raw.splitlines():
        match = _RANK.match(line)
        if match is None or "main (nanogpt_train.py" not in match.group(1):
            continue
        frames, count = match.group(1).split(";"), int(match.group(2))
        kind = classify(frames)
        classes[kind] += count
        if kind == "gil":
            python = [f for f in frames if ".py:" in f]
            gil_at[python[-1] if python else "?"] += count
            gil_for[gil_caller(frames)] += count
    return sum(classes.values()), classes, gil_at, gil_for


def sample(nproc: int, steps: int, rate: int) -> str:
    launch = [sys.executable, "-m", "reducer", "launch", "--nproc", str(nproc), "--no-check"]
    script = [str(SCRIPT), "--backend", "gloo", "--grad-accum", "8", "--steps", str(steps)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "samples.txt"
        spy = ["py-spy", "record", "--native", "--idle", "--threads", "-r", str(rate)]
        command = [*spy, "-f", "raw", "-o", str(out), "--", *launch, *script]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        if done.returncode != 0 or not out.exists():
            raise SystemExit(f"{command} exited with {done.returncode}:\n{done.stderr[-3000:]}")
        return out.read_text()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", default="2,4")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    args = parser.parse_args()
    if shutil.which("py-spy") is None:
        print("launch_gil_wait: skipped: py-spy is not installed (pip install py-spy)")
        return
    print(f"machine: {machine()}")
    rows, where, needs = [], [], []
    for nproc in (int(n) for n in args.nprocs.split(",")):
        total, classes, gil_at, gil_for = shares(sample(nproc, args.steps, args.rate))
        if total == 0:
            raise SystemExit(f"N = {nproc}: no rank-thread samples in the training loop")
        rows.append(
            [nproc, total, *(f"{classes[k] / total:.1%}" for k in ("gil", "blocked", "running"))]
        )
        for frame, count in gil_at.most_common(3):
            where.append([nproc, frame, f"{count / total:.1%}"])
        for frame, count in gil_for.most_common(5):
            needs.append([nproc, frame[:90], f"{count / total:.1%}"])
    header = ["N", "samples", "waiting for the GIL", "blocked (peers, locks)", "running"]
    print(table(header, rows))
    print()
    print(table(["N", "where the GIL waits are (innermost Python frame)", "share"], where))
    print()
    print(table(["N", "what needed the GIL (the frame that took it)", "share"], needs))


if __name__ == "__main__":
    main()
