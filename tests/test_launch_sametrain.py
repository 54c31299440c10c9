"""The same-training verdict of ``python -m reducer launch`` (reducer.testing.sametrain).

The corpus (tests/scripts/sametrain/) holds one script per data-parallel mistake that keeps the
ranks in sync, and its fix: every mistake must be named with its cause, every correct script
must get no finding, at 2 and 3 ranks (each launch runs in this process, in under a second).
The slow test checks each verdict against the truth: the script run as torchrun runs it, on
real gloo processes, against the same training as one process on the global batch.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reducer.testing.sametrain import CAUSES, SameTraining, deliberate
from reducer.tools import cli

ROOT = Path(__file__).parent.parent
CORPUS = ROOT / "tests" / "scripts" / "sametrain"
sys.path.insert(0, str(CORPUS))
import sametrain_common as _common  # type: ignore[import-not-found]  # noqa: E402  (the corpus' reference)

# script -> the causes its verdict must name (none: a correct script)
EXPECTED: dict[str, set[str]] = {
    "ok_mlp": set(),
    "ok_cnn_frozen_bn": set(),
    "ok_dropout": set(),
    "ok_augment": set(),
    "ok_split": set(),
    "ok_summed_declared": set(),
    "ok_cnn_declared": set(),
    "ok_kwargs": set(),
    "ok_gradscaler": set(),
    "kwargs_summed": {"summed-loss"},
    "no_sampler": {"same-batches"},
    "one_replica": {"same-batches"},
    "no_set_epoch": {"repeated-shuffle"},
    "overlap": {"overlapping-shards"},
    "padded": {"overlapping-shards"},
    "summed_loss": {"summed-loss"},
    "accum_forgotten": {"accumulation-scale"},
    "accum_twice": {"accumulation-scale"},
    "uneven": {"uneven-batches"},
    "uneven_join": {"uneven-batches"},
    "cnn_batchnorm": {"per-rank-batchnorm"},
    "same_dropout": {"same-seed"},
    "same_augment": {"same-seed"},
}
DECLARED = {"ok_summed_declared": {"summed-loss"}, "ok_cnn_declared": {"per-rank-batchnorm"}}
RANDOM = {"ok_dropout", "ok_augment", "same_dropout", "same_augment"}  # truth: the seeds


def launch(
    capsys: pytest.CaptureFixture[str], script: Path, nproc: int, *flags: str
) -> tuple[int, str]:
    code = cli.main(["launch", "--nproc", str(nproc), "--timeout", "30", *flags, str(script)])
    return code, capsys.readouterr().err


def findings(report: str) -> set[str]:
    return set(re.findall(r"\[same-training\] FINDING \(([a-z-]+)\)", report))


def declared(report: str) -> set[str]:
    match = re.search(r"declared deliberate, not reported: (.*)", report)
    return set() if match is None else set(match.group(1).split(", "))


def check_verdict(capsys: pytest.CaptureFixture[str], name: str, nproc: int) -> None:
    code, err = launch(capsys, CORPUS / f"{name}.py", nproc)
    assert code == 0, err
    assert findings(err) == EXPECTED[name], err
    assert declared(err) == DECLARED.get(name, set()), err
    verdict = "the same training" if not EXPECTED[name] else "NOT the same training"
    assert f"[same-training] verdict: {verdict}" in err, err
    # Every finding says its evidence and its fix.
    assert err.count("FINDING (") == err.count("  evidence: ") == err.count("  fix: "), err


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_mistake_is_named_and_correct_scripts_get_no_finding(
    capsys: pytest.CaptureFixture[str], name: str, nproc: int
) -> None:
    check_verdict(capsys, name, nproc)


def test_the_evidence_names_ranks_steps_and_batches(capsys: pytest.CaptureFixture[str]) -> None:
    _, err = launch(capsys, CORPUS / "no_set_epoch.py", 2)
    assert "epochs 0 and 1 read the same 6 batches in the same order" in err
    assert "sampler.set_epoch(epoch) is never called" in err
    _, err = launch(capsys, CORPUS / "summed_loss.py", 2)
    assert "cross_entropy(reduction='sum') over 4 element(s)" in err
    assert "1/4 of one process's" in err  # a sum, divided by 2 accumulation steps, 2 ranks
    _, err = launch(capsys, CORPUS / "overlap.py", 2)
    assert "ranks 0 and 1 both read 4 sample(s) (dataset indices [20, 21, 22, 23])" in err


@pytest.mark.slow  # imports transformers and lightning: several seconds each
@pytest.mark.parametrize(
    ("script", "args", "expected"),
    [
        ("hf_gpt2.py", (), set()),
        ("hf_gpt2.py", ("--one-seed",), {"same-seed"}),
        ("lightning_module.py", (), set()),
        ("lightning_module.py", ("--summed",), {"summed-loss"}),
        ("lightning_module.py", ("--no-distributed-sampler",), {"same-batches"}),
        # Lightning runs each step's last micro-batch in the optimizer's closure: the replica
        # check judges the gradients the closure leaves (exit code 0), the verdict is clean.
        ("lightning_module.py", ("--accumulate", "2"), set()),
    ],
)
def test_hf_and_lightning_scripts(
    capsys: pytest.CaptureFixture[str], script: str, args: tuple[str, ...], expected: set[str]
) -> None:
    pytest.importorskip("transformers" if script.startswith("hf") else "lightning")
    code = cli.main(["launch", "--nproc", "2", "--timeout", "60", str(CORPUS / script), *args])
    err = capsys.readouterr().err
    assert code == 0, err
    assert findings(err) == expected, err


def test_nanogpt_shaped_script_gets_no_finding(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = launch(capsys, ROOT / "tests" / "scripts" / "nanogpt_train.py", 2)
    assert code == 0
    assert findings(err) == set()
    assert "[same-training] verdict: the same training" in err


def test_deliberate_flag_and_environment_silence_a_cause(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _, err = launch(capsys, CORPUS / "summed_loss.py", 2, "--deliberate", "summed-loss")
    assert findings(err) == set() and declared(err) == {"summed-loss"}
    monkeypatch.setenv("REDUCER_DELIBERATE", "per-rank-batchnorm")
    _, err = launch(capsys, CORPUS / "cnn_batchnorm.py", 2)
    assert findings(err) == set() and declared(err) == {"per-rank-batchnorm"}


def test_unknown_deliberate_cause_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = launch(capsys, CORPUS / "ok_mlp.py", 2, "--deliberate", "summed")
    assert code == 2
    assert "unknown cause 'summed'" in err and "summed-loss" in err
    with pytest.raises(ValueError, match="unknown cause 'sum'"):
        deliberate("sum")
    assert set(CAUSES) >= {"same-batches", "summed-loss", "per-rank-batchnorm", "same-seed"}


def test_off_with_no_same_training_and_with_no_check(capsys: pytest.CaptureFixture[str]) -> None:
    for flags in (("--no-same-training",), ("--no-check",)):
        code, err = launch(capsys, CORPUS / "summed_loss.py", 2, *flags)
        assert code == 0 and "[same-training]" not in err
    _, err = launch(capsys, CORPUS / "summed_loss.py", 2, "--no-check", "--same-training")
    assert findings(err) == {"summed-loss"}


def test_one_recorder_at_a_time() -> None:
    with SameTraining(2, lambda: None), pytest.raises(RuntimeError, match="another recorder"):
        SameTraining(2, lambda: None).__enter__()
    with pytest.raises(ValueError, match="world_size"):
        SameTraining(0, lambda: None)


# -------------------------------------------------------------------------------------------
# The truth: real gloo processes against one process on the global batch.


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(script: Path, world: int, out: Path) -> list[str]:
    """Run ``script`` as torchrun would, on gloo; each rank's stdout."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(ROOT),
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), "--out", str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    return outputs


def _options(name: str) -> _common.Options:
    """The Options a corpus script passes to main()."""
    text = (CORPUS / f"{name}.py").read_text()
    call = re.search(r"main\((Options\(.*\))\)", text, re.S)
    assert call is not None
    opts = eval(call.group(1), {"Options": _common.Options})  # the script's own literal
    assert isinstance(opts, _common.Options)
    return opts


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_verdict_matches_the_truth_on_real_gloo(
    capsys: pytest.CaptureFixture[str], name: str, tmp_path: Path
) -> None:
    _, err = launch(capsys, CORPUS / f"{name}.py", 2)
    differs = bool(findings(err) | declared(err))  # a declared choice still differs
    outputs = _torchrun(CORPUS / f"{name}.py", 2, tmp_path / "w.pt")
    if name in RANDOM:
        seeds = {re.search(r"generator (\w+)", o).group(1) for o in outputs}  # type: ignore[union-attr]
        assert (len(seeds) == 1) == differs, (seeds, err)
        return
    weights = torch.load(tmp_path / "w.pt")
    truth = _common.reference(_options(name), 2)
    same = all(
        torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(weights, truth, strict=True)
    )
    assert same == (not differs), (name, err)
