"""A fast subset of torch's own DDP test suite, on gloo at world size 2, with torch's DDP and
with this one patched in for it (benchmarks/torch_ddp_suite.py; the whole run, and its
figures, are in BENCHMARKS.md).

One test that torch's DDP passes on a CPU machine as upstream runs it: it trains a CPU model
against a local baseline for several iterations, pickling the wrapper mid-way (torch.save and
torch.load). It spawns two ranks per DDP: some 40 s on two idle cores.

The same test and one that skips from inside its ranks, on the fake world (``--world fake``:
the ranks as threads, torch's own scaffolding judging their exit codes), with the verdicts the
gloo processes give: some 17 s on two idle cores, most of it starting the runner and its
workers (each imports torch's suite).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["test_DistributedDataParallelCPU"]


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_torchs_suite_subset_passes_with_both_ddps() -> None:
    pattern = "|".join(f"^{name}$" for name in TESTS)
    done = subprocess.run(
        [sys.executable, "benchmarks/torch_ddp_suite.py", "--mode", "plain", "-k", pattern,
         "--quiet", "--timeout", "200"],
        cwd=ROOT, capture_output=True, text=True, timeout=480,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {
        cells[1]: (cells[2], cells[3])
        for line in done.stdout.splitlines()
        if line.startswith("| test_") and len(cells := [c.strip() for c in line.split("|")]) > 3
    }
    assert rows == {name: ("pass", "pass") for name in TESTS}, done.stdout
    assert "acceptance plain: this DDP passes 1 of the 1 torch's DDP passes" in done.stdout


# On gloo processes: test_DistributedDataParallelCPU passes with both DDPs, and the hierarchical
# SGD test's ranks exit with torch's skip code for "Need at least 4 CUDA devices" (its
# skip_if_lt_x_gpu(4) runs in each rank).
FAKE_WORLD_VERDICTS = {
    "test_DistributedDataParallelCPU": ("pass", "pass", ""),
    "test_post_localSGD_optimizer_parity_with_hierarchical_sgd": (
        "skip",
        "skip",
        "Need at least 4 CUDA devices",
    ),
}


@pytest.mark.timeout(500)
def test_torchs_suite_on_the_fake_world_gives_the_process_verdicts() -> None:
    pattern = "|".join(f"^{name}$" for name in FAKE_WORLD_VERDICTS)
    done = subprocess.run(
        [sys.executable, "benchmarks/torch_ddp_suite.py", "--world", "fake", "--mode", "plain",
         "-k", pattern, "--quiet", "--timeout", "200"],
        cwd=ROOT, capture_output=True, text=True, timeout=480,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    rows = {
        cells[1]: (cells[2], cells[3], cells[4])
        for line in done.stdout.splitlines()
        if line.startswith("| test_") and len(cells := [c.strip() for c in line.split("|")]) > 4
    }
    assert rows == FAKE_WORLD_VERDICTS, done.stdout
    assert "acceptance plain (fake world): this DDP passes 1 of the 1" in done.stdout
