"""The replica check (``reducer.tools.check``; on by default in ``python -m reducer launch``).

The corpus (tests/scripts/divergence/) models each known way data-parallel ranks silently
diverge, buggy and fixed, on torch's DDP and on this project's: every buggy form must stop with
exit code 3 and its cause named; every fixed or clean form must pass with exit code 0. The
scripts run through the CLI in this process (the same code path as a launch process); one
test runs a real process for the exit codes.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import fakepg
from reducer.tools import cli
from reducer.tools.check import DIVERGED_EXIT_CODE, RanksDiverged, ReplicaCheck, run_checked
from reducer.tools.check._rendezvous import Rendezvous, RendezvousBroken

ROOT = Path(__file__).parent.parent
CORPUS = Path(__file__).parent / "scripts" / "divergence"
BOTH = ("torch", "ours")


def launch(
    capsys: pytest.CaptureFixture[str],
    script: str,
    *args: str,
    nproc: int = 2,
    launch_args: tuple[str, ...] = (),
) -> tuple[int, str, str]:
    code = cli.main(
        [
            "launch",
            "--nproc",
            str(nproc),
            "--timeout",
            "30",
            *launch_args,
            str(CORPUS / script),
            *args,
        ]
    )
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def step_line(script: str) -> str:
    """``script:line`` of the script's call of optimizer.step()."""
    lines = (CORPUS / script).read_text().splitlines()
    number = next(n for n, line in enumerate(lines, 1) if "optimizer.step()" in line)
    return f"{script}:{number}"


def param_sums(out: str) -> list[str]:
    return sorted(line.split("param sum ")[1] for line in out.splitlines() if "param sum" in line)


# -------------------------------------------------------------------------------------------
# The corpus: (script, variant, the words the report must contain).

BUGGY = [
    (
        "module_bypass.py",
        "buggy",
        [
            "gradient of '0.weight' differs before optimizer step 0",
            "{line}",
            "never ran its forward",
            "`ddp(x)`, not `ddp.module(x)`",
        ],
    ),
    (
        "accumulation_off_by_one.py",
        "buggy",
        [
            "before optimizer step 0",
            "{line}",
            "forward ran under no_sync() on the optimizer step's micro-batch",
        ],
    ),
    (
        "pipeline_schedule.py",
        "buggy",
        [
            "before optimizer step 0",
            "ran with require_backward_grad_sync=False on the last micro-step",
        ],
    ),
    (
        "uneven_sync.py",
        "buggy",
        [
            "only some ranks reduced before optimizer step 0",
            "ranks [1] reached the step",
            "rank 0: 2 synced forward(s)",
            "rank 1: 1 synced forward(s), 1 not (require_backward_grad_sync)",
        ],
    ),
    ("comm_hook.py", "sum", ["is the sum of the local gradients, not their average"]),
    ("comm_hook.py", "twice", ["divided by 2 twice"]),
    (
        "comm_hook.py",
        "drop",
        ["The comm hook hook_for.<locals>.hook returned its bucket unreduced"],
    ),
    (
        "rank_zero_scheduler.py",
        "buggy",
        [
            "parameter '0.weight' differs after optimizer step 1",
            "The gradients agreed before the step",
        ],
    ),
    (
        "checkpointing.py",
        "unused-not-found",
        [
            "gradient of 'inp.weight' differs before optimizer step 0",
            "rank 0: heads.1.weight, heads.1.bias; rank 1: heads.0.weight, heads.0.bias",
            "find_unused_parameters=False",
        ],
    ),
    (
        "checkpointing.py",
        "accumulate-nonreentrant",
        [
            "gradient of 'inp.weight' differs before optimizer step 0",
            "The wrapper's reduction ran before this gradient's last accumulation, on every rank",
        ],
    ),
    (
        "checkpointing.py",
        "accumulate-plain",
        ["The wrapper's reduction ran before this gradient's last accumulation, on every rank"],
    ),
    (
        "frozen_backbone.py",
        "buggy",
        [
            "parameter '0.weight' differs before optimizer step 0",
            "{line}",
            "It is frozen (requires_grad=False)",
            "weights loaded on rank 0 only, after wrapping?",
        ],
    ),
    (
        "summed_bucket.py",
        "buggy",
        [
            "gradient of 'left.weight' differs before optimizer step 0",
            "The reduction summed different parameters across ranks: rank 0's 'left.weight' is "
            "bit for bit the average of rank 0's 'left.weight', rank 1's 'right.weight'",
            "skip_all_reduce_unused_params=True",
        ],
    ),
]


# This project's DDP refuses the summed bucket before anything is reduced (the ranks agree on
# their skips; see test_summed_bucket_is_refused_by_this_projects_ddp); torch's sums silently.
BUGGY_RUNS = [
    (script, variant, words, ddp)
    for script, variant, words in BUGGY
    for ddp in BOTH
    if not (script == "summed_bucket.py" and ddp == "ours")
]


@pytest.mark.parametrize(
    ("script", "variant", "words", "ddp"),
    BUGGY_RUNS,
    ids=[f"{s}-{v}-{d}" for s, v, _, d in BUGGY_RUNS],
)
def test_every_buggy_script_is_stopped_with_its_cause_named(
    script: str, variant: str, words: list[str], ddp: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = launch(capsys, script, "--ddp", ddp, "--variant", variant)
    assert code == DIVERGED_EXIT_CODE, err
    report = " ".join(err.split())  # the report's lines wrap
    for word in words:
        assert word.replace("{line}", step_line(script)) in report, err
    assert "[check] verdict: RANKS DIVERGED" in err
    assert "Traceback" not in err  # the check's stop is not a crash
    assert "param sum" not in out  # stopped at the first divergence


def test_summed_bucket_is_refused_by_this_projects_ddp(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = launch(capsys, "summed_bucket.py", "--ddp", "ours", "--variant", "buggy")
    assert code == 1, err  # a crash of every rank, before the check has anything to compare
    report = " ".join(err.split())
    assert "skip_all_reduce_unused_params=True) needs the same parameters unused" in report, err
    assert "'right.weight'" in report and "unused on rank(s) [0]" in report, err


FIXED = [
    ("module_bypass.py", "fixed"),
    ("accumulation_off_by_one.py", "fixed"),
    ("no_sync_backward_only.py", "fixed"),
    ("pipeline_schedule.py", "fixed"),
    ("uneven_sync.py", "fixed"),
    ("comm_hook.py", "fixed"),
    ("rank_zero_scheduler.py", "fixed"),
    ("unused_branches.py", "clean"),
    ("checkpointing.py", "fixed"),
    ("checkpointing.py", "twice-reentrant-static"),
    ("checkpointing.py", "unused-reentrant-static"),
    ("frozen_backbone.py", "fixed"),
    ("summed_bucket.py", "fixed"),
    ("zero_optimizer.py", "clean"),
    ("ignored_parameters.py", "clean"),
    ("siamese.py", "clean"),
]


@pytest.mark.parametrize("ddp", BOTH)
@pytest.mark.parametrize(("script", "variant"), FIXED, ids=[f"{s}-{v}" for s, v in FIXED])
def test_every_fixed_script_passes_clean(
    script: str, variant: str, ddp: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = launch(capsys, script, "--ddp", ddp, "--variant", variant)
    assert code == 0, err
    assert "[check] verdict: the ranks stayed in sync" in err
    assert "ERROR" not in err and "WARNING" not in err and "NOTE" not in err
    sums = param_sums(out)
    assert len(sums) == 2 and sums[0] == sums[1]  # and the script's own checksum agrees


@pytest.mark.parametrize("ddp", BOTH)
def test_no_sync_around_backward_only_is_waste_not_divergence(
    ddp: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = launch(capsys, "no_sync_backward_only.py", "--ddp", ddp)
    assert code == 0, err
    report = " ".join(err.split())
    assert "reduced gradients on 3 micro-steps before optimizer step 0" in report
    assert "no_sync() wrapped only the backward" in report
    assert "reductions per optimizer step (rank 0): 3, 696 B on average" in err
    assert report.count("WARNING") == 1  # shown once, not at every step


@pytest.mark.parametrize("ddp", BOTH)
def test_buffers_that_differ_are_a_note_and_dropout_per_rank_is_clean(
    ddp: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = launch(capsys, "dropout_per_rank.py", "--ddp", ddp, "--variant", "clean")
    assert code == 0, err
    assert "NOTE: buffer '1.running_mean' differs after optimizer step 0" in err
    assert "(legitimate with broadcast_buffers=False)" in err
    # Clipped after the reduction: identical on every rank, not the reducer's average any more.
    assert "NOTE: gradients were changed after the backward on rank 0 (gradient clipping" in err
    assert "verdict: the ranks stayed in sync" in err


@pytest.mark.parametrize("ddp", BOTH)
def test_a_sharded_optimizer_is_compared_by_what_it_replicates(
    ddp: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """ZeroRedundancyOptimizer's inner optimizers hold different blocks of the same shapes:
    the whole model is compared at its step, not the shards by position."""
    code, _, err = launch(capsys, "zero_optimizer.py", "--ddp", ddp, "--steps", "3")
    assert code == 0, err
    assert "replica check: 3 optimizer step(s) on 2 ranks, 4 parameter(s) compared" in err


@pytest.mark.parametrize("ddp", BOTH)
def test_ignored_parameters_are_left_alone_and_counted(
    ddp: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = launch(capsys, "ignored_parameters.py", "--ddp", ddp)
    assert code == 0, err
    assert (
        "2 parameter(s) compared bitwise per step (1 ignored by the wrapper, not compared)" in err
    )


def test_a_gradient_it_cannot_explain_is_said_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Scaled on one rank after the reduction: no combination of local gradients gives it."""
    script = tmp_path / "scaled_on_one_rank.py"
    script.write_text(
        "import sys\n"
        f"sys.path.insert(0, {str(CORPUS)!r})\n"
        "import torch\n"
        "from _common import batch, model, setup, wrap\n"
        "rank, _ = setup()\n"
        "net = model()\n"
        "ddp = wrap(net, 'torch')\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.1)\n"
        "ddp(batch(rank, 0)).square().mean().backward()\n"
        "if rank == 1:\n"
        "    net[0].weight.grad.mul_(3.0)\n"
        "opt.step()\n"
    )
    assert cli.main(["launch", "--nproc", "2", str(script)]) == DIVERGED_EXIT_CODE
    err = " ".join(capsys.readouterr().err.split())
    assert "gradient of '0.weight' differs before optimizer step 0" in err
    assert "the check cannot tell why" in err
    assert "summed different parameters" not in err


def test_fsdp2_shards_are_not_compared_and_the_run_is_clean(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = launch(capsys, "fsdp2.py", "--variant", "clean")
    assert code == 0, err
    assert "0 parameter(s) compared bitwise per step (4 sharded, not replicas)" in err
    assert "verdict: the ranks stayed in sync" in err


def test_manual_allreduce_that_skips_the_biases(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = launch(capsys, "manual_allreduce.py", "--variant", "buggy")
    assert code == DIVERGED_EXIT_CODE, err
    report = " ".join(err.split())
    assert "gradient of '0.bias' differs before optimizer step 0" in report
    assert "no data-parallel wrapper holds it, and none of the 2 reduction(s)" in report
    code, _, err = launch(capsys, "manual_allreduce.py", "--variant", "fixed")
    assert code == 0, err
    assert "reductions per optimizer step (rank 0): 4, 232 B on average" in err


@pytest.mark.parametrize("ddp", BOTH)
@pytest.mark.parametrize("variant", ["twice-reentrant", "unused-reentrant"])
def test_checkpointing_patterns_that_ddp_refuses_fail_loudly(
    variant: str, ddp: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both DDPs raise at the first backward: a crash (exit 1), never a silent divergence."""
    code, _, err = launch(capsys, "checkpointing.py", "--ddp", ddp, "--variant", variant)
    assert code == 1, err
    assert "Expected to mark a variable ready only once" in err
    assert "no optimizer step ran on the ranks" in err


# -------------------------------------------------------------------------------------------
# The launch's flags and exit codes.


def test_no_check_lets_a_diverging_script_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = launch(capsys, "module_bypass.py", launch_args=("--no-check",))
    assert code == 0
    assert "[check]" not in err
    sums = param_sums(out)
    assert sums[0] != sums[1]  # what the check would have caught


def test_keep_going_reports_and_runs_to_the_end(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = launch(
        capsys, "module_bypass.py", "--steps", "3", launch_args=("--check-keep-going",)
    )
    assert code == DIVERGED_EXIT_CODE, err
    assert len(param_sums(out)) == 2  # the script ran to its end
    assert "gradient of '0.weight' differs before optimizer step 0" in err
    assert "parameter '0.weight' differs after optimizer step 0" in err
    assert err.count("ERROR") == 2  # each finding once, not again at every step
    assert "replica check: 3 optimizer step(s) on 2 ranks" in err


def test_ranks_that_step_a_different_number_of_times(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "uneven_steps.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "w = torch.nn.Parameter(torch.ones(2))\n"
        "opt = torch.optim.SGD([w], lr=0.1)\n"
        "for _ in range(1 + dist.get_rank()):\n"
        "    opt.step()\n"
    )
    assert cli.main(["launch", "--nproc", "2", str(script)]) == DIVERGED_EXIT_CODE
    err = " ".join(capsys.readouterr().err.split())
    assert "rank 0 ended after 1 optimizer step, while ranks [1] reached optimizer step 1" in err
    assert "uneven_steps.py:6" in err


@pytest.mark.slow
def test_a_launch_process_exits_3_when_ranks_diverge_and_1_when_one_crashes(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "reducer",
            "launch",
            "--nproc",
            "2",
            str(CORPUS / "module_bypass.py"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == DIVERGED_EXIT_CODE, done.stderr
    assert "[check] ERROR: gradient of '0.weight' differs" in done.stderr
    crash = tmp_path / "crash.py"
    crash.write_text("import os\nif os.environ['RANK'] == '1':\n    raise ValueError('boom')\n")
    assert cli.main(["launch", "--nproc", "2", str(crash)]) == 1


def test_the_nanogpt_style_script_passes_at_four_ranks(capsys: pytest.CaptureFixture[str]) -> None:
    script = Path(__file__).parent / "scripts" / "nanogpt_train.py"
    for ddp in ("torch", "reducer"):
        code = cli.main(["launch", "--nproc", "4", str(script), "--ddp", ddp, "--steps", "2"])
        err = capsys.readouterr().err
        assert code == 0, err
        assert "replica check: 2 optimizer step(s) on 4 ranks, 30 parameter(s) compared" in err
        assert "verdict: the ranks stayed in sync" in err


# -------------------------------------------------------------------------------------------
# From Python.


def _train(bypass: bool, steps: int = 2) -> Any:
    def train(pg: Any) -> float:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            x = torch.full((2, 4), float(pg.rank() + step))
            (ddp.module if bypass else ddp)(x).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return float(model[0].weight.detach().sum())

    return train


def test_run_checked_returns_the_results_of_a_clean_run(capsys: pytest.CaptureFixture[str]) -> None:
    check = run_checked(_train(bypass=False), world_size=4)
    assert not check.diverged and check.stopped is False
    assert check.results is not None and len(set(check.results)) == 1
    assert check.steps == 2 and check.compared == 4
    assert "verdict: the ranks stayed in sync" in check.summary()


def test_run_checked_stops_every_rank_at_the_first_divergence(
    capsys: pytest.CaptureFixture[str],
) -> None:
    check = run_checked(_train(bypass=True), world_size=2)
    assert check.diverged and check.stopped and check.results is None
    [error] = check.errors
    assert error.step == 0 and error.title == "gradients differ"
    assert "gradient of '0.weight' differs before optimizer step 0" in error.text
    assert "test_launch_check.py:" in error.text  # the line that called step
    assert "[check] ERROR: gradient of '0.weight'" in capsys.readouterr().err


def test_a_failure_that_is_not_the_checks_is_reraised() -> None:
    def train(pg: Any) -> None:
        if pg.rank() == 1:
            raise KeyError("mine")
        torch.distributed.barrier()

    with pytest.raises(KeyError, match="mine"):
        run_checked(train, world_size=2, timeout=10)


def test_one_check_at_a_time_and_bad_arguments() -> None:
    with fakepg.World(2) as world:
        with ReplicaCheck(2, world=world), pytest.raises(RuntimeError, match="another check"):
            ReplicaCheck(2).__enter__()
        with pytest.raises(ValueError, match="world has 2 ranks, not 3"):
            ReplicaCheck(3, world=world)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        ReplicaCheck(0)


def test_ranks_diverged_is_an_exit_not_an_exception() -> None:
    error = RanksDiverged("what happened")
    assert isinstance(error, SystemExit) and not isinstance(error, Exception)
    assert error.code == DIVERGED_EXIT_CODE and str(error) == "what happened"


# -------------------------------------------------------------------------------------------
# The meeting of the ranks.


def _meet_in_threads(meeting: Rendezvous[int, int], ranks: list[int]) -> dict[int, Any]:
    """Ranks ``ranks`` arrive, each on a thread; their verdicts (or errors) once joined."""
    results: dict[int, Any] = {}

    def arrive(rank: int) -> None:
        try:
            results[rank] = meeting.meet(
                "k", rank, rank * 10, judge=sum, stall=lambda arrived: None, describe="step 0"
            )
        except RendezvousBroken as exc:
            results[rank] = exc

    threads = [threading.Thread(target=arrive, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    results["threads"] = threads  # type: ignore[index]
    return results


def test_the_last_rank_judges_and_every_rank_gets_the_verdict() -> None:
    meeting: Rendezvous[int, int] = Rendezvous(3, timeout=30)
    results = _meet_in_threads(meeting, [0, 1, 2])
    for t in results.pop("threads"):
        t.join(30)
    assert results == {0: 30, 1: 30, 2: 30}


def test_a_meeting_ends_when_a_rank_ended_or_the_deadline_passed_or_the_world_aborted() -> None:
    meeting: Rendezvous[int, int] = Rendezvous(2, timeout=30)
    results = _meet_in_threads(meeting, [1])
    meeting.ended(0, "4 optimizer steps")
    for t in results.pop("threads"):
        t.join(30)
    assert isinstance(results[1], RendezvousBroken) and results[1].kind == "ended"
    assert str(results[1]) == "rank 0 ended after 4 optimizer steps, while ranks [1] reached step 0"

    meeting = Rendezvous(2, timeout=0.2)
    results = _meet_in_threads(meeting, [0])
    for t in results.pop("threads"):
        t.join(30)
    assert results[0].kind == "timeout"
    assert "rank 0 waited 0.2 s at step 0 for ranks [1], which never reached it" in str(results[0])

    aborted = threading.Event()
    meeting = Rendezvous(2, timeout=30, aborted=aborted.is_set)
    results = _meet_in_threads(meeting, [1])
    time.sleep(0.1)
    aborted.set()
    for t in results.pop("threads"):
        t.join(30)
    assert results[1].kind == "aborted"


# -------------------------------------------------------------------------------------------
# The check against this project's own seeded bugs (property_tests/mutants.py).

MUTANTS = [
    ("skip the divide", "is the sum of the local gradients, not their average"),
    ("off-by-one bucket offset", "is not the exact rank-order average"),
    ("drop the last bucket", "it was divided but never reduced across ranks (a dropped bucket)"),
]


@pytest.mark.parametrize(("mutant", "words"), MUTANTS, ids=[m for m, _ in MUTANTS])
def test_the_check_names_a_broken_reducer(mutant: str, words: str) -> None:
    import io

    import reducer
    from property_tests.mutants import CATALOGUE, applied

    def train(pg: Any) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        ddp = reducer.DistributedDataParallel(model, bucket_cap_mb=1e-4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            for micro in range(2):
                ddp.require_backward_grad_sync = micro == 1
                seed = 10 * step + micro + 100 * pg.rank()
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
                ddp(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    out = io.StringIO()
    with applied(CATALOGUE[mutant]):
        check = run_checked(train, world_size=2, out=out)
    assert check.diverged and check.errors[0].step == 0
    assert words in " ".join(check.errors[0].text.split())
    assert check.errors[0].text.startswith("gradient of '0.weight'")
    # And the real reducer, the same training: clean.
    assert not run_checked(train, world_size=2, out=out).diverged


def test_the_fake_world_tells_an_observer_each_collective() -> None:
    seen: list[tuple[int, str, tuple[int, ...], int, int]] = []
    lock = threading.Lock()

    def observer(rank: int, kind: str, members: tuple[int, ...], tensors: Any, nbytes: int) -> None:
        with lock:
            seen.append((rank, kind, members, len(tensors), nbytes))

    def step(pg: Any) -> None:
        pg.allreduce([torch.ones(4)]).wait()
        pg.broadcast([torch.ones(2, dtype=torch.float64)], root=0).wait()

    with fakepg.World(2) as world:
        remove = world.observe(observer)
        world.run(step)
        remove()
        world.run(step)  # no longer observed
        with pytest.raises(ValueError, match="fn must be callable"):
            world.observe(3)  # type: ignore[arg-type]
    assert sorted(seen) == [
        (0, "allreduce", (0, 1), 1, 16),
        (0, "broadcast", (0, 1), 1, 16),
        (1, "allreduce", (0, 1), 1, 16),
        (1, "broadcast", (0, 1), 1, 16),
    ]


@pytest.mark.parametrize("bucket_view", [False, True])
@pytest.mark.parametrize("kind", BOTH)
def test_three_ranks_average_exactly_with_and_without_bucket_views(
    kind: str, bucket_view: bool
) -> None:
    """At W = 3 the roundings of an average differ (1/3 is inexact): torch's DDP multiplies by
    1/W, or divides in place when gradients are bucket views; every one is accepted, and
    gradient accumulation with no_sync and zero_grad(set_to_none=False) stays exact."""
    import reducer

    def train(pg: Any) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3))
        wrapper = (
            nn.parallel.DistributedDataParallel
            if kind == "torch"
            else reducer.DistributedDataParallel
        )
        ddp = wrapper(model, gradient_as_bucket_view=bucket_view)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            for micro in range(2):
                seed = 10 * step + micro + 100 * pg.rank()
                x = torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))
                with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                    ddp(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=step % 2 == 0)

    check = run_checked(train, world_size=3)
    assert not check.findings, check.findings
    assert check.steps == 3 and check.compared == 4


def test_a_rank_that_crashes_wakes_the_ranks_waiting_at_the_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "crash_before_step.py"
    script.write_text(
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "w = torch.nn.Parameter(torch.ones(2))\n"
        "opt = torch.optim.SGD([w], lr=0.1)\n"
        "if dist.get_rank() == 1:\n"
        "    raise ValueError('boom on rank 1')\n"
        "opt.step()\n"
    )
    assert cli.main(["launch", "--nproc", "2", "--timeout", "600", str(script)]) == 1
    err = capsys.readouterr().err
    assert "[0]: rank 1: exitcode 1: ValueError: boom on rank 1" in err  # the root cause
    assert (
        "rank 0: exitcode 1: WorldAborted: the replica check stopped waiting at optimizer step 0"
        in err
    )
    assert "_check.py" not in err.split("[launch]")[0].split("[rank0]")[-1]  # folded away


def test_the_public_api_is_all() -> None:
    import types

    import reducer.tools.check as package

    public = {
        name
        for name in dir(package)
        if not name.startswith("_")
        and name != "annotations"
        and not isinstance(getattr(package, name), types.ModuleType)
    }
    assert set(package.__all__) == public


@pytest.mark.parametrize("ddp", BOTH)
def test_uneven_inputs_under_join_are_a_note(ddp: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = launch(capsys, "uneven_join.py", "--ddp", ddp, "--variant", "clean")
    assert code == 0, err
    assert "NOTE: ranks reached optimizer step 2 unevenly under a wrapper's join()" in err
    assert "verdict: the ranks stayed in sync" in err
    sums = param_sums(out)
    assert len(sums) == 2 and sums[0] == sums[1]
