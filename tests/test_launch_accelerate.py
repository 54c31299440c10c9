"""Hugging Face Accelerate, unmodified, on rank threads (skipped where it is not installed):
``tests/scripts/accelerate_train.py`` (Accelerator, prepare, backward, gather, save_state)
under ``python -m reducer launch`` ends with torchrun's parameters on gloo, bit for bit, and
each rank saves its own random state."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reducer.tools import cli

pytest.importorskip("accelerate")

SCRIPT = Path(__file__).parent / "scripts" / "accelerate_train.py"
ROOT = Path(__file__).parent.parent


def test_an_accelerate_script_is_bitwise_with_torchrun(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "state"
    out = tmp_path / "launch.pt"
    code = cli.main(
        ["launch", "--nproc", "2", str(SCRIPT), "--out", str(out), "--state-dir", str(state)]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "[check] verdict: the ranks stayed in sync" in captured.err
    assert "[rank0]: rank 0 of 2: params" in captured.out
    assert "[rank1]: rank 1 of 2: params" in captured.out
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in state.iterdir()}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    done = subprocess.run(
        [*torchrun, "--nproc-per-node", "2", str(SCRIPT), "--out", str(tmp_path / "torchrun.pt")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    launched, reference = torch.load(tmp_path / "launch.pt"), torch.load(tmp_path / "torchrun.pt")
    assert all(torch.equal(a, b) for a, b in zip(launched, reference, strict=True))
