"""``python -m reducer`` / ``ddp-reducer``: one entry point, every tool a subcommand, help that
lists the tools, models and presets; the shortcuts (whatif, trace, check), the benchmark
runner, and ``simulate --predict``'s assumptions, JSON and cluster files."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import fakepg
from reducer.tools import benchmarks, cli, shortcuts
from reducer.tools.simulate import models, shapes

ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def help_of(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    with pytest.raises(SystemExit) as raised:
        cli.main([*args, "--help"])
    assert raised.value.code == 0
    return capsys.readouterr().out


# -- one entry point, every tool ------------------------------------------------------------


@pytest.mark.slow
def test_help_lists_every_tool_model_and_preset() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "reducer", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-800:]
    out = done.stdout
    tools = {"simulate", "whatif", "trace", "launch", "check", "validate", "benchmark"}
    assert set(cli.SUBCOMMANDS) == tools
    for name in tools:
        assert f"\n    {name}" in out, name  # in the list of commands, with its help line
    for name in [*fakepg.CLUSTER_PRESETS, *models.MODELS, *shapes.SHAPE_MODELS]:
        assert f"\n  {name} " in out, name
    for link in ("10gbe", "25gbe", "100gbe", "ib-hdr"):
        assert f"\n  {link} " in out, link
    assert "FILE.toml or FILE.json" in out


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_every_subcommand_has_its_own_help(capsys: pytest.CaptureFixture[str], name: str) -> None:
    out = help_of(capsys, name)
    assert out.startswith(f"usage: python -m reducer {name}"), out[:200]
    where = cli.SUBCOMMANDS[name][0]
    tool = cli._load(where)
    first = (tool.__doc__ or "").strip().splitlines()[0]
    assert first.split()[0] in out, (name, first)


def test_simulate_help_lists_the_cluster_presets_and_gpus(
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = help_of(capsys, "simulate")
    assert "cluster presets (--network):" in out
    for name, text in fakepg.CLUSTER_DESCRIPTIONS.items():
        assert name in out and text.split(",")[0] in out
    for gpu in ("v100", "a100", "h100", "h200"):
        assert f"\n  {gpu} " in out
    for option in ("--dtype", "--seq-len", "--json"):
        assert option in out


def test_the_console_script_names_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/usr/bin/ddp-reducer"])
    assert cli.build_parser().prog == "ddp-reducer"
    monkeypatch.setattr(sys, "argv", ["-m"])
    assert cli.build_parser().prog == "python -m reducer"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'ddp-reducer = "reducer.tools.cli:main"' in pyproject


# -- the shortcuts ------------------------------------------------------------------------------


def test_whatif_compares_the_caps_and_names_the_best(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli(
        capsys, "whatif", "--model", "mlp", "--steps", "4", "--world-size", "8",
        "--network", "10gbe", "--caps", "0,25", "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert "predicted step at 8 ranks on 10gbe" in out
    assert "best: --bucket-cap-mb " in out


def test_whatif_compares_the_usual_caps_by_default() -> None:
    args = cli.build_parser("whatif").parse_args(["whatif"])
    assert args.sweep_bucket_cap == shortcuts.DEFAULT_CAPS == "0,1,5,25,default"


def test_trace_writes_a_timeline(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    code, out, err = run_cli(
        capsys, "trace", "--steps", "2", "--world-size", "2", "-o", str(path), "--no-progress"
    )
    assert code == 0, err
    events = json.loads(path.read_text())["traceEvents"]
    assert {e.get("pid") for e in events if e.get("ph") == "X"} == {0, 1}  # a track per rank
    assert f"written to {path}" in out
    code, _, err = run_cli(capsys, "trace", "--sweep-bucket-cap", "1,25")
    assert code == 2 and "drop --sweep-bucket-cap" in err
    assert cli.build_parser("trace").parse_args(["trace"]).trace == "trace.json"


_IN_SYNC = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(2):
    torch.manual_seed(dist.get_rank() * 10 + step)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_check_runs_the_replica_check_and_refuses_to_run_without_it(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    synced = tmp_path / "synced.py"
    synced.write_text(_IN_SYNC)
    code, _, err = run_cli(capsys, "check", "--nproc", "2", str(synced))
    assert code == 0, err
    # Without the wrapper each rank steps on its own gradient: the check stops the ranks.
    diverged = tmp_path / "diverged.py"
    diverged.write_text(_IN_SYNC.replace("torch.nn.parallel.DistributedDataParallel(", "("))
    code, out, err = run_cli(capsys, "check", "--nproc", "2", str(diverged))
    assert code == 3, out + err
    code, _, err = run_cli(capsys, "check", "--no-check", str(synced))
    assert code == 2 and "launch --no-check" in err


# -- the benchmarks ----------------------------------------------------------------------------


def test_benchmark_lists_the_repositorys_scripts(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run_cli(capsys, "benchmark")
    assert code == 0
    assert "published_figures" in out and "Predicted against published" in out
    assert "gpu_check " in out  # the shell script that runs gpu_check.py
    assert "models" not in out.split()  # a module the scripts share, not a benchmark
    code, _, err = run_cli(capsys, "benchmark", "no_such")
    assert code == 2 and "no benchmark 'no_such'" in err


def test_benchmark_runs_one_with_its_arguments(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "_common.py").write_text("")
    (tmp_path / "benchmarks" / "echo.py").write_text(
        textwrap.dedent(
            '''
            """Echo its arguments."""
            import os, sys
            if __name__ == "__main__":
                print(sys.argv[1:], os.environ["PYTHONPATH"].split(os.pathsep)[0])
                sys.exit(7)
            '''
        )
    )
    monkeypatch.setattr(benchmarks, "find_benchmarks", lambda: tmp_path / "benchmarks")
    code = cli.main(["benchmark", "echo", "--quick", "x"])
    assert code == 7
    monkeypatch.setattr(benchmarks, "find_benchmarks", lambda: None)
    code, _, err = run_cli(capsys, "benchmark")
    assert code == 2 and "come with a clone" in err


# -- simulate --predict: what it assumed, and JSON ---------------------------------------------


def _predict(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    return run_cli(capsys, "simulate", "--predict", *args)


def test_predict_prints_what_it_assumed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _predict(
        capsys, "--model", "bert-base", "--world-size", "16", "--network", "nccl-dgx-h100",
        "--gpu", "h100",
    )  # fmt: skip
    assert code == 0, err
    assumed = " ".join(out[out.index("assumed (and the flag that changes it):") :].split())
    for line in (
        "batch size      32 samples per rank per micro-batch; 512 per optimizer step",
        "seq len         128 tokens per sequence (--seq-len)",
        "dtype           float32 parameters, gradients and buckets (--dtype)",
        "optimizer       SGD with momentum 0.9",
        "loss            cross-entropy",
        "world size      16 ranks: 2 node(s) of up to 8 GPUs (--world-size)",
    ):
        assert " ".join(line.split()) in assumed, line


def _json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code, out, err = _predict(capsys, *args, "--json", "-")
    assert code == 0, err
    data: dict[str, Any] = json.loads(out)  # stdout is the JSON alone
    assert "assumed (and the flag" in err  # the table went to stderr
    return data


@pytest.mark.slow
def test_predict_writes_its_assumptions_and_results_as_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    data = _json(capsys, "--model", "resnet50", "--world-size", "16", "--network",
                 "nccl-dgx1-v100", "--sweep-bucket-cap", "0,25")  # fmt: skip
    a = data["assumptions"]
    assert (a["model"], a["batch_size"], a["seq_len"], a["dtype"]) == (
        "resnet50", 32, None, "float32"
    )  # fmt: skip
    assert (a["world_size"], a["nodes"], a["overlap"], a["step"]) == (16, 2, True, "third")
    assert a["network"]["name"] == "nccl-dgx1-v100"
    assert a["network"]["inter_node"] == {"bandwidth": "100 Gbit/s"}
    assert a["compute"]["source"] == "estimate" and a["compute"]["gpu"] == "V100-SXM2"
    caps = [p["bucket_cap_mb"] for p in data["predictions"]]
    assert caps == [0.0, 25.0]
    assert data["predictions"][0]["buckets"] == 161  # cap 0: one per parameter
    best = min(data["predictions"], key=lambda p: p["step_ms"])
    assert data["best"] == {"bucket_cap_mb": best["bucket_cap_mb"], "step_ms": best["step_ms"]}
    path = tmp_path / "p.json"
    code, out, err = _predict(capsys, "--model", "resnet50", "--json", str(path))
    assert code == 0, err
    assert json.loads(path.read_text())["assumptions"]["world_size"] == 4
    assert f"json: written to {path}" in out


@pytest.mark.slow
def test_predict_seq_len_and_dtype_change_the_step(capsys: pytest.CaptureFixture[str]) -> None:
    base = _json(capsys, "--model", "bert-base", "--world-size", "8", "--network", "nccl-dgx-h100")
    short = _json(capsys, "--model", "bert-base", "--world-size", "8", "--network",
                  "nccl-dgx-h100", "--seq-len", "64")  # fmt: skip
    half = _json(capsys, "--model", "bert-base", "--world-size", "8", "--network",
                 "nccl-dgx-h100", "--dtype", "bfloat16")  # fmt: skip
    assert short["assumptions"]["seq_len"] == 64
    assert short["predictions"][0]["forward_ms"] < base["predictions"][0]["forward_ms"]
    # The same parameters, so the same buckets: the sequence is not a parameter.
    assert short["predictions"][0]["bucket_bytes"] == base["predictions"][0]["bucket_bytes"]
    assert half["assumptions"]["dtype"] == "bfloat16"
    assert sum(half["predictions"][0]["bucket_bytes"]) * 2 == sum(
        base["predictions"][0]["bucket_bytes"]
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--predict", "--model", "resnet50", "--seq-len", "64"], "resnet50 reads no sequences"),
        (["--predict", "--model", "gpt2", "--seq-len", "2048"], "takes sequences of 1 to 1024"),
        (["--model", "mlp", "--json", "-"], "--json writes a prediction's assumptions"),
        (["--predict", "--model", "resnet50", "--network", "nccl-dgx-h100", "--world-size",
          "12"], "world_size 12 is not a multiple of gpus_per_node 8"),
    ],
)  # fmt: skip
def test_predict_bad_options_say_what_to_do(
    capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    code, _, err = run_cli(capsys, "simulate", "--no-progress", *args)
    assert code == 2
    assert message in err


# -- cluster files on the command line ---------------------------------------------------------

_CLUSTER = """\
name = "two-h100-nodes"
nodes = 2
gpus_per_node = 8
nics_per_node = 8

[intra_node]
bandwidth = "450 GB/s"

[inter_node]
bandwidth = "200 Gbit/s"
"""


def test_predict_takes_a_cluster_file_and_its_node_count(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "cluster.toml"
    path.write_text(_CLUSTER)
    data = _json(capsys, "--model", "resnet50", "--network", str(path))
    a = data["assumptions"]
    assert (a["world_size"], a["nodes"]) == (16, 2)  # every GPU of the file's 2 nodes
    assert a["network"]["inter_node"] == {"bandwidth": "200 Gbit/s"}
    code, _, err = _predict(capsys, "--model", "resnet50", "--network", str(path),
                            "--world-size", "32")  # fmt: skip
    assert code == 2 and "does not fit in its 2 nodes of 8 GPUs (16)" in err


def test_simulate_runs_on_a_cluster_file(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "cluster.json"
    path.write_text(fakepg.dumps_cluster(fakepg.load_cluster(_write(tmp_path)), "json"))
    code, out, err = run_cli(
        capsys, "simulate", "--world-size", "2", "--steps", "2", "--network", str(path),
        "--no-progress",
    )  # fmt: skip
    assert code == 0, err
    assert "verification: passed" in out and "two-h100-nodes: NCCL auto" in out


def _write(tmp_path: Path) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(_CLUSTER)
    return path
