"""The benchmark scripts that need neither gloo nor a GPU run end to end on a tiny budget.

Their numbers are the record in BENCHMARKS.md; these runs only check that a script still
works against the code it measures (an API it calls, a scenario it cannot take).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, f"{args} exited with {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.mark.slow
def test_property_throughput_runs_every_configuration() -> None:
    out = _run("benchmarks/property_throughput.py", "--examples", "3")
    rows = [line for line in out.splitlines() if line.startswith("|") and "ranks" in line]
    # The three configurations, each with its three examples counted.
    assert len(rows) == 3, out
    assert all(line.split("|")[2].strip() == "3" for line in rows), out


@pytest.mark.slow
def test_launch_check_measures_both_variants() -> None:
    out = _run(
        "benchmarks/launch_check.py",
        "--nprocs",
        "2",
        "--steps",
        "1",
        "--repeats",
        "1",
        "--process-repeats",
        "1",
    )
    rows = [line for line in out.splitlines() if line.startswith("| 2 |")]
    assert [row.split("|")[3].strip() for row in rows] == ["process", "in-process"], out


@pytest.mark.slow
def test_published_figures_prints_predicted_beside_published() -> None:
    out = _run("benchmarks/published_figures.py", "--quick")
    rows = [line for line in out.splitlines() if line.startswith("|") and "DDP" in line]
    assert len(rows) == 2, out  # no DDP at 1 GPU; DDP at 16
    assert rows[1].split("|")[3].strip() == "104", out  # the README's 16-GPU row
    # A verdict per published figure compared: the step without a wrapper, at 16 GPUs with
    # the default cap and with cap 1, and cap 1's slow-down; each reproduced or not, by how much.
    verdicts = [line.split("|")[1:-1] for line in out.splitlines() if "reproduced |" in line]
    assert [cells[0].strip() for cells in verdicts] == [
        "torch README: step without a wrapper",
        "torch README: step at 16 GPUs",
        "torch README: step at 16 GPUs, cap 1",
        "torch README: cap 1 slower at 16 GPUs",
    ], out
    for cells in verdicts:
        published, predicted, tolerance, said, off = (c.strip() for c in cells[1:])
        assert published and predicted and tolerance, cells
        assert said in ("reproduced", "NOT reproduced") and off[0] in "+-", cells
    done = sum(cells[4].strip() == "reproduced" for cells in verdicts)
    assert f"{done} of 4 published figures reproduced within their tolerance" in out


@pytest.mark.slow
def test_fakepg_collectives_time_every_way() -> None:
    out = _run(
        "benchmarks/fakepg_allreduce.py",
        "--world-sizes",
        "2",
        "--sizes",
        "4KB",
        "--blocks",
        "2",
        "--repeats",
        "2",
        "--skip-threaded",
        "--explain",
    )
    rows = [line.split("|") for line in out.splitlines() if line.startswith("|")]
    names = ("allreduce", "reduce_scatter", "all_to_all", "all_gather", "broadcast")
    cells = [row for row in rows if row[1].strip() in names]
    # Each collective once as it prints, once in the final table; every timing way filled in.
    assert len(cells) == 10, out
    for row in cells:
        ms = [row[4], row[11], row[13], row[15]]  # ranks refilled, then the three other ways
        assert all(float(v) > 0 for v in ms), out
        assert (row[10].strip() != "") == (row[1].strip() == "reduce_scatter"), out


@pytest.mark.slow
def test_harness_vs_torch_counts_examples_and_shrinks_the_seeded_bug() -> None:
    out = _run(
        "benchmarks/harness_vs_torch.py",
        "--ways", "fakepg,threaded", "--world-sizes", "2", "--examples", "3",
        "--rounds", "1", "--seeds", "1",
    )  # fmt: skip
    rows = [line.split("|") for line in out.splitlines() if line.startswith("|")]
    rates = [row for row in rows if row[1].strip().startswith(("(a)", "(b)"))]
    # Each row once as it is measured, once in the final table.
    assert len(rates) == 4 and all(float(row[2]) > 0 for row in rates), out
    hunts = {row[1].strip(): row for row in rows if row[1].strip() in ("fakepg", "threaded")}
    # Found by both, shrunk to the narrowest width whose bucket skips the divide (8w + 3 > 96).
    assert set(hunts) == {"fakepg", "threaded"}, out
    assert all(row[3].strip() == "1" and row[7].strip() == "[12]" for row in hunts.values()), out


@pytest.mark.slow
def test_schedule_throughput_measures_every_workload() -> None:
    out = _run("benchmarks/schedule_throughput.py", "--examples", "2")
    rows = [line.split("|") for line in out.splitlines() if line.startswith("|")]
    counts = [row[2].strip() for row in rows[2:]]  # after the header and its rule
    assert counts == ["2"] * 4, out


def test_launch_gil_wait_tells_the_waits_apart() -> None:
    """Its classification of py-spy's native samples (py-spy itself is not a test
    dependency): a GIL wait, a collective's wait, C++ waiting, running."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "launch_gil_wait", ROOT / "benchmarks" / "launch_gil_wait.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    loop = "thread (7): fakepg-rank-0;Thread.run (threading.py:982);main (nanogpt_train.py:134)"
    raw = "\n".join(
        [
            f"{loop};Linear.forward (linear.py:134);PyEval_RestoreThread (libpython3.11.so);"
            "pthread_cond_timedwait (libc.so.6) 3",
            f"{loop};_engine_run_backward (graph.py:979);c10d::Reducer::finalize_backward "
            "(libtorch_cpu.so);std::condition_variable::wait (libstdc++.so);"
            "pthread_cond_wait (libc.so.6) 2",
            f"{loop};Event.wait (threading.py:629);PyThread_acquire_lock_timed (libpython) 1",
            f"{loop};Linear.forward (linear.py:134);at::native::addmm (libtorch_cpu.so) 4",
            "thread (8): fakepg-rank-1;Thread.run (threading.py:982);build (x.py:1) 9",
        ]
    )
    total, classes, gil_at, gil_for = module.shares(raw)
    assert total == 10
    assert classes == {"gil": 3, "blocked": 3, "running": 4}
    assert gil_at == {"Linear.forward (linear.py:134)": 3}
    assert gil_for == {"Linear.forward": 3}
