"""``python -m reducer simulate``: short real runs through the CLI, the check failing on purpose,
unused parameters, comm hooks, the network, the sweep, bad arguments, and 64 ranks."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fakepg.executor import default_thread_count
from reducer.tools import cli, simulate

OPTIONS = [
    "--world-size", "--model", "--steps", "--bucket-cap-mb", "--find-unused", "--unused-pattern",
    "--no-sync-every", "--comm-hook", "--network", "--trace", "--seed", "--sweep-bucket-cap",
    "--device", "--predict", "--gpu", "--profile", "--save-profile", "--overlap",
    "--process-groups", "--shared-cores", "--host-call-us", "--host-hook-us",
]  # fmt: skip


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["simulate", "--no-progress", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def verdict(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("verification: ")]
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.slow
def test_help_lists_every_option() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "reducer", "simulate", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-600:]
    for option in OPTIONS:
        assert option in out.stdout, option
    assert (
        "{mlp,convnet,embedding,transformer-block,resnet50,bert-base,bert-large,gpt2,"
        "gpt2-medium,gpt2-large,gpt2-xl}" in out.stdout
    )
    assert "{none,random,rank-skew}" in out.stdout
    assert "--corrupt-grad" not in out.stdout  # for tests only


def test_a_short_run_verifies_every_step(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "--world-size", "2", "--steps", "3")
    assert code == 0, out
    assert verdict(out).startswith(
        "verification: passed: 3 steps x 2 ranks x 12 parameters, bit-exact (torch.equal)"
    )
    rows = ["mlp: 12 parameters", "3 verified of 3", "1: 279.54 KiB", "forward", "backward",
            "comm (first launch to last done)", "overlap with backward", "step (wall"]  # fmt: skip
    for row in rows:
        assert row in out, row


@pytest.mark.parametrize("model", ["mlp", "convnet", "embedding", "transformer-block"])
def test_every_model_verifies_with_unused_parameters_and_accumulation(
    capsys: pytest.CaptureFixture[str], model: str
) -> None:
    code, out, _ = run_cli(
        capsys, "--model", model, "--world-size", "3", "--steps", "2", "--find-unused",
        "--unused-pattern", "random", "--no-sync-every", "2", "--bucket-cap-mb", "0.01",
    )  # fmt: skip
    assert code == 0, out
    assert "verification: passed: 2 steps x 3 ranks" in verdict(out)
    if model == "embedding":
        assert "sparse within the reordering bound" in verdict(out)


def test_unused_parameters_are_counted(capsys: pytest.CaptureFixture[str]) -> None:
    """rank-skew on 2 ranks: aux_a (branch 0) runs where (rank + step) is even, aux_b (branch 1)
    where it is a multiple of 3, so at step 1 aux_b is unused on both ranks."""
    code, out, _ = run_cli(
        capsys, "--world-size", "2", "--steps", "2", "--find-unused", "--unused-pattern",
        "rank-skew",
    )  # fmt: skip
    assert code == 0, out
    # step 0: rank 1 lacks aux_a and aux_b (4); step 1: rank 0 lacks aux_a, both lack aux_b (6)
    assert "10 (rank, step, parameter) without a local gradient" in out
    assert "2 (step, parameter) unused on every rank" in out
    assert "verification: passed" in verdict(out)


@pytest.mark.parametrize(
    ("hook", "model"), [("fp16", "mlp"), ("bf16", "mlp"), ("fp16", "embedding")]
)
def test_comm_hooks_are_checked_against_their_wire_dtype(
    capsys: pytest.CaptureFixture[str], hook: str, model: str
) -> None:
    code, out, _ = run_cli(
        capsys, "--comm-hook", hook, "--model", model, "--world-size", "3", "--steps", "2"
    )
    assert code == 0, out
    assert "verification: passed: 2 steps x 3 ranks" in verdict(out)
    assert f"comm hook {hook}" in out


def test_a_corrupted_gradient_stops_the_run_naming_rank_and_parameter(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The check can fail: one element of one reduced gradient moved by one ulp is caught."""
    code, out, _ = run_cli(
        capsys, "--world-size", "3", "--steps", "4", "--corrupt-grad", "1:2:trunk.0.weight"
    )
    assert code == 1
    line = verdict(out)
    assert line.startswith(
        "verification: FAILED at step 1, rank 2, parameter 2 ('trunk.0.weight'): "
        "max |reduced - reference| = "
    ), line
    assert "(1 of 16384 elements differ)" in line
    match = re.search(r"= ([0-9.e+-]+) \(", line)
    assert match is not None and 0 < float(match.group(1)) < 1e-6
    assert "1 verified of 4" in out  # step 0 passed, step 1 stopped the run


def test_a_skipped_branch_without_find_unused_is_explained(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(
        capsys, "--world-size", "2", "--steps", "2", "--unused-pattern", "rank-skew"
    )
    assert code == 1
    line = verdict(out)
    assert "step 0: the gradient reduction did not finish on rank 1" in line, line
    assert "6 ('aux_a.weight'), 7 ('aux_a.bias'), 8 ('aux_b.weight'), 9 ('aux_b.bias')" in line
    assert "pass --find-unused" in line


def test_a_bucket_cap_of_0_puts_each_parameter_in_its_own_bucket(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(capsys, "--world-size", "2", "--steps", "2", "--bucket-cap-mb", "0")
    assert code == 0, out
    assert "verification: passed" in verdict(out)
    assert re.search(r"│ buckets\s+│ 12: ", out), out  # the mlp's 12 parameters


def test_a_simulated_network(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(
        capsys, "--world-size", "2", "--steps", "2", "--network", "10gbe", "--bucket-cap-mb", "0.1"
    )
    assert code == 0, out
    assert "10gbe: ring, latency 25 us, bandwidth 1.25 GB/s" in out
    assert "verification: passed" in verdict(out)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world-size", "0"], "--world-size must be >= 1"),
        (["--no-sync-every", "0"], "--no-sync-every must be >= 1"),
        (["--bucket-cap-mb", "-1"], "--bucket-cap-mb must be >= 0"),
        (
            ["--network", "nccl-dgx1-v100", "--world-size", "12"],
            "world_size 12 is not a multiple of gpus_per_node 8",
        ),
        (["--network", "20gbe"], "unknown network '20gbe'"),
        (["--sweep-bucket-cap", "1,x"], "--sweep-bucket-cap takes bucket caps in MiB"),
        (["--corrupt-grad", "0:0:nope"], "--corrupt-grad: no rank 0 or parameter 'nope'"),
    ],
)
def test_bad_arguments_say_what_to_do(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, _, err = run_cli(capsys, *args)
    assert code == 2
    assert message in err


def test_the_sweep_predicts_each_cap_and_names_the_best(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(
        capsys, "--sweep-bucket-cap", "0.05,1,25", "--network", "10gbe", "--world-size", "64",
        "--steps", "4",
    )  # fmt: skip
    assert code == 0, out
    assert "measured: mlp, 1 rank(s), 4 verified steps" in out
    assert "predicted step at 64 ranks on 10gbe" in out
    rows = [line for line in out.splitlines() if re.match(r"^│\s+[0-9.]+( \*)?\s+│", line)]
    assert len(rows) == 3, out
    assert sum(" * " in row for row in rows) == 1
    best = re.search(r"best: --bucket-cap-mb ([0-9.]+) \(predicted", out)
    assert best is not None and best.group(1) in {"0.05", "1", "25"}


def fakepg_threads() -> int:
    return sum(t.name.startswith("fakepg-") for t in threading.enumerate())


@pytest.fixture
def peak_fakepg_threads() -> Iterator[list[int]]:
    """The most fake-world threads alive at once while the test runs."""
    peak = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.005):
            peak[0] = max(peak[0], fakepg_threads())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    yield peak
    stop.set()
    watcher.join(5.0)


@pytest.mark.usefixtures("no_leaked_threads")
def test_64_ranks_run_with_bounded_threads(peak_fakepg_threads: list[int]) -> None:
    parser = argparse.ArgumentParser()
    simulate.add_arguments(parser)
    args = parser.parse_args(["--world-size", "64", "--steps", "2", "--network", "fixed=1ms"])
    result = simulate.simulate(args)
    assert result.ok, result.failure or result.mismatch
    assert result.verified_steps == 2
    assert len(result.steps) == 64 * 2
    # One thread per rank, the world's workers and its timer; nothing per collective or step.
    assert 64 < peak_fakepg_threads[0] <= 64 + default_thread_count() + 1


# -------------------------------------------------------------------------------------------
# --device: the run on a GPU is the GPU check's (tests/test_gpu.py, bash
# benchmarks/gpu_check.sh); here, every path a machine without a GPU reaches.


def test_device_cpu_verifies_and_is_recorded(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "trace.json"
    code, out, _ = run_cli(
        capsys, "--device", "cpu", "--world-size", "2", "--steps", "2", "--trace", str(trace)
    )
    assert code == 0, out
    assert verdict(out).startswith("verification: passed: 2 steps x 2 ranks x 12 parameters")
    assert "device: " not in out  # the note is for GPUs
    assert json.loads(trace.read_text())["otherData"]["device"] == "cpu"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "tpu"], "--device takes cpu, cuda or cuda:N, got 'tpu'"),
        (["--device", "cuda:x"], "--device takes cpu, cuda or cuda:N, got 'cuda:x'"),
        (
            ["--device", "cuda", "--sweep-bucket-cap", "1,5"],
            "--sweep-bucket-cap predicts from the times the host measures, which on cuda are "
            "when work was issued, not done; run the sweep with --device cpu",
        ),
    ],
)
def test_bad_devices_say_what_to_do(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, _, err = run_cli(capsys, *args)
    assert code == 2
    assert message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the run would use it")
def test_device_cuda_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "--device", "cuda")
    assert code == 2
    assert "simulate: --device cuda: this torch (" in err
    assert "; run on the CPU (--device cpu) or on a machine with a GPU" in err


def test_on_cuda_kernels_are_deterministic_for_the_run_only() -> None:
    """cuDNN's deterministic algorithms and the math attention kernel while a CUDA run lasts,
    so that each rank's reference copy recomputes its bits; process-wide, hence restored."""
    cuda = torch.backends.cuda
    before = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    flags = cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled()
    try:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = False, True
        with simulate._deterministic_kernels(torch.device("cpu")):
            assert torch.backends.cudnn.benchmark is True
        with simulate._deterministic_kernels(torch.device("cuda")):
            assert torch.backends.cudnn.deterministic is True
            assert torch.backends.cudnn.benchmark is False
            assert not cuda.flash_sdp_enabled() and not cuda.mem_efficient_sdp_enabled()
            assert cuda.math_sdp_enabled()
        assert (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark) == (False, True)
        assert (
            cuda.flash_sdp_enabled(),
            cuda.mem_efficient_sdp_enabled(),
            cuda.math_sdp_enabled(),
        ) == flags
    finally:
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before


@pytest.mark.slow
def test_predict_sweeps_a_real_model_on_a_cluster(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    trace = tmp_path / "predicted.json"
    code, out, err = run_cli(
        capsys, "--predict", "--model", "resnet50", "--world-size", "16",
        "--network", "nccl-dgx1-v100", "--sweep-bucket-cap", "0,25", "--overlap", "off",
        "--trace", str(trace),
    )  # fmt: skip
    assert code == 0, err
    events = json.loads(trace.read_text())["traceEvents"]
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    backward = spans["backward"]
    allreduces = [e for name, e in spans.items() if name.startswith("allreduce")]
    assert len(allreduces) == 161  # the first cap's: one per parameter
    # Overlap off: every bucket after backward's end.
    assert min(e["ts"] for e in allreduces) >= backward["ts"] + backward["dur"] - 1e-6
    assert "predicted step: resnet50 at 16 ranks" in out
    assert "network: nccl-dgx1-v100: NCCL auto" in out
    assert "overlap off" in out
    assert "compute: ESTIMATE for V100-SXM2" in out
    rows = [line for line in out.splitlines() if re.match(r"^│\s+[0-9.]+( \*)?\s+│", line)]
    assert len(rows) == 2, out
    assert re.search(r"│\s+0( \*)?\s+│\s+161\s+│", out), out  # cap 0: one per bucket
    assert re.search(r"best: --bucket-cap-mb (0|25) \(predicted", out)


@pytest.mark.slow
def test_predict_on_shared_cores_pays_the_hosts_cost_per_call(
    capsys: pytest.CaptureFixture[str],
) -> None:
    steps = {}
    for host in ("0", "1000"):
        code, out, err = run_cli(
            capsys, "--predict", "--model", "resnet50", "--world-size", "2", "--network",
            "10gbe", "--shared-cores", "--host-call-us", host, "--bucket-cap-mb", "25",
            "--host-hook-us", "0" if host == "0" else "10",
        )  # fmt: skip
        assert code == 0, err
        row = re.search(r"│\s+25\s+│\s+(\d+)\s+│.*│\s+([0-9.]+)\s+│\n", out)
        assert row is not None, out
        steps[host] = (int(row.group(1)), float(row.group(2)))
    assert "host's cost per collective call: 1000 us (on the cores that compute)" in out
    assert "host's cost per gradient hook: 10 us (on the cores that compute)" in out
    buckets = steps["0"][0]
    # One call per bucket in backward and the forward's buffer broadcasts: at least one ms
    # more per bucket, and 10 us for each of the 161 gradient hooks.
    assert steps["1000"][1] - steps["0"][1] >= buckets * 1.0 + 1.61 - 1e-6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--predict", "--model", "mlp"], "--predict takes a model by shape"),
        (
            [
                "--predict",
                "--model",
                "resnet50",
                "--world-size",
                "12",
                "--network",
                "nccl-dgx1-v100",
            ],
            "not a multiple of gpus_per_node 8",
        ),
        (["--predict", "--model", "resnet50", "--gpu", "tpu"], "unknown GPU 'tpu'"),
        (["--predict", "--model", "resnet50", "--process-groups", "0"], "--process-groups"),
        (["--predict", "--model", "resnet50", "--host-call-us", "-5"], "--host-call-us takes"),
        (["--predict", "--model", "resnet50", "--host-call-us", "nan"], "--host-call-us takes"),
        (["--predict", "--model", "resnet50", "--host-hook-us", "-1"], "--host-hook-us takes"),
        (
            ["--predict", "--model", "resnet50", "--profile", "/nonexistent.json"],
            "cannot read it as JSON",
        ),
    ],
)
def test_predict_bad_arguments_say_what_to_do(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, _, err = run_cli(capsys, *args)
    assert code == 2
    assert message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a GPU")
def test_predict_on_cuda_without_a_gpu_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run_cli(capsys, "--predict", "--model", "resnet50", "--device", "cuda")
    assert code == 2
    assert "sees no GPU; predict from --gpu" in err
