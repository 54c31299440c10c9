"""A fast subset of torch's own DDP test suite, on gloo at world size 2, with torch's DDP and
with this one patched in for it (benchmarks/torch_ddp_suite.py; the whole run, and its
figures, are in BENCHMARKS.md).

One test that torch's DDP passes on a CPU machine as upstream runs it: it trains a CPU model
against a local baseline for several iterations, pickling the wrapper mid-way (torch.save and
torch.load). It spawns two ranks per DDP: some 40 s on two idle cores.
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
