"""reducer.tools.trace: Chrome trace events from hand-made records, and from a real simulation."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest

from reducer import IterationStats
from reducer.tools import cli
from reducer.tools.trace import Pass, RankStep, Span, chrome_trace, write_chrome_trace

NAMES = ["a.weight", "a.bias", "b.weight"]
T0 = 1_000_000_000  # an absolute perf_counter_ns origin


def record(rank: int, step: int, shift: int = 0) -> RankStep:
    """A step of 3 parameters in 2 buckets whose allreduces overlap in time."""
    base = T0 + shift + 2_000  # prepare_for_backward, inside forward
    it = IterationStats(
        start_ns=base,
        ready_ns=((5_000, 4_000, 1_000),),
        launch_ns=(1_500, 5_500),  # bucket 0 = [2], bucket 1 = [0, 1]
        done_ns=(7_000, 9_000),  # bucket 0 still in flight when bucket 1 launches
        finalize_start_ns=6_000,
        finalize_end_ns=9_500,
        bucket_nbytes=(16, 32),
        unused_parameters=1,
    )
    return RankStep(
        rank=rank,
        step=step,
        passes=(Pass(Span(T0 + shift, base + 500), Span(base + 500, base + 10_000), True),),
        optimizer=Span(base + 10_000, base + 10_500),
        iteration=it,
        bucket_indices=((2,), (0, 1)),
        unused=(1,),
    )


def by_cat(events: list[dict[str, Any]], cat: str) -> list[dict[str, Any]]:
    return [e for e in events if e.get("cat") == cat]


def test_events_of_one_step() -> None:
    trace = chrome_trace([record(0, 0)], NAMES, metadata={"model": "x"})
    events = trace["traceEvents"]
    assert trace["otherData"] == {"model": "x"}
    assert Counter(e.get("cat") for e in events if e["ph"] != "M") == {
        "step": 1, "forward": 1, "backward": 1, "ready": 3, "allreduce": 2, "finalize": 1,
        "optimizer": 1,
    }  # fmt: skip
    forward = by_cat(events, "forward")[0]
    assert (forward["ts"], forward["dur"], forward["tid"]) == (0.0, 2.5, 0)  # microseconds
    ready = {e["args"]["parameter"]: e for e in by_cat(events, "ready")}
    assert ready[2]["ts"] == 3.0 and ready[2]["name"] == "ready b.weight"
    assert ready[2]["args"]["bucket"] == 0 and ready[0]["args"]["bucket"] == 1
    assert ready[1]["args"]["unused"] is True and ready[0]["args"]["unused"] is False
    assert all(e["ph"] == "i" and e["s"] == "t" for e in ready.values())
    b0, b1 = sorted(by_cat(events, "allreduce"), key=lambda e: e["args"]["bucket"])
    assert (b0["ts"], b0["dur"], b0["args"]["parameters"]) == (3.5, 5.5, ["b.weight"])
    assert (b1["ts"], b1["dur"], b1["args"]["bytes"]) == (7.5, 3.5, 32)
    # They overlap, so they are on different lanes: complete events on one thread must nest.
    assert {b0["tid"], b1["tid"]} == {1, 2}
    finalize = by_cat(events, "finalize")[0]
    assert (finalize["ts"], finalize["dur"]) == (8.0, 3.5)
    step = by_cat(events, "step")[0]
    assert (step["name"], step["ts"], step["dur"]) == ("step 0", 0.0, 12.0)
    optimizer = by_cat(events, "optimizer")[0]
    assert optimizer["ts"] == 12.0  # after backward; the step event ends with the backward


def test_metadata_names_every_track() -> None:
    trace = chrome_trace([record(0, 0), record(1, 0, shift=300)], NAMES)
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    assert processes == {0: "rank 0", 1: "rank 1"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert threads == {
        (0, 0): "compute", (0, 1): "allreduce lane 0", (0, 2): "allreduce lane 1",
        (1, 0): "compute", (1, 1): "allreduce lane 0", (1, 2): "allreduce lane 1",
    }  # fmt: skip
    timed = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    assert min(e["ts"] for e in timed) == 0.0  # the origin is the earliest event
    assert min(e["ts"] for e in timed if e["pid"] == 1) == 0.3


def test_lanes_are_reused_once_free() -> None:
    steps = [record(0, 0), record(0, 1, shift=20_000)]
    events = chrome_trace(steps, NAMES)["traceEvents"]
    allreduces = by_cat(events, "allreduce")
    assert len(allreduces) == 4 and {e["tid"] for e in allreduces} == {1, 2}


def test_a_step_without_a_finished_reduction_has_no_reducer_events() -> None:
    unfinished = RankStep(0, 0, (Pass(Span(T0, T0 + 10), Span(T0 + 10, T0 + 20), True),))
    events = chrome_trace([unfinished], NAMES)["traceEvents"]
    assert Counter(e.get("cat") for e in events if e["ph"] != "M") == {
        "step": 1,
        "forward": 1,
        "backward": 1,
    }


def test_write_chrome_trace_writes_json(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    count = write_chrome_trace(path, [record(0, 0)], NAMES)
    loaded = json.loads(path.read_text())
    assert len(loaded["traceEvents"]) == count == 5 + 10  # 5 metadata events (2 lanes)


# ---------------------------------------------------------------------------------------------
# A real simulation's trace.


NS = 1e-3  # one nanosecond, in the trace's microseconds


def ends(e: dict[str, Any]) -> float:
    return float(e["ts"] + e["dur"])


def test_a_simulation_writes_a_consistent_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "sim.json"
    argv = [
        "simulate", "--world-size", "2", "--steps", "3", "--model", "mlp", "--bucket-cap-mb",
        "0.02", "--network", "fixed=2ms", "--no-sync-every", "2", "--trace", str(path),
        "--no-progress",
    ]  # fmt: skip
    assert cli.main(argv) == 0, capsys.readouterr().out
    assert f"events written to {path}" in capsys.readouterr().out
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    assert trace["otherData"]["world_size"] == 2
    assert {e["pid"] for e in events} == {0, 1}
    params = 12  # the mlp: stem, 2 trunk layers, aux_a, aux_b, head; weight and bias each
    per = defaultdict(list)
    for e in events:
        per[(e["pid"], e["args"]["step"] if "args" in e else None, e["cat"])].append(e)
    for rank in (0, 1):
        for step in range(3):
            cats = ("forward", "backward", "ready", "allreduce", "finalize", "step")
            counts = {cat: len(per[(rank, step, cat)]) for cat in cats}
            buckets = counts["allreduce"]
            # torch 2.13's first iteration (no search for unused parameters): one bucket;
            # the rebuilt ones follow the cap.
            assert buckets == 1 if step == 0 else buckets >= 3
            assert counts == {
                "forward": 2, "backward": 2, "ready": params, "allreduce": buckets,
                "finalize": 1, "step": 1,
            }, (rank, step)  # fmt: skip
            assert [e["name"] for e in per[(rank, step, "backward")]] == [
                "backward (no_sync)",
                "backward",
            ]
            ready = {e["args"]["parameter"]: e["ts"] for e in per[(rank, step, "ready")]}
            synced = per[(rank, step, "backward")][1]
            finalize = per[(rank, step, "finalize")][0]
            for a in per[(rank, step, "allreduce")]:
                members = [NAME_INDEX[n] for n in a["args"]["parameters"]]
                # A bucket launches after its last gradient was ready, and takes the link's
                # 2 ms at least.
                assert a["ts"] >= max(ready[i] for i in members)
                assert a["dur"] >= 2000.0 - NS  # ts + dur rounds in floating point
                # Finalize ends after every completion.
                assert ends(finalize) >= ends(a)
            # Finalize runs inside the synced backward.
            assert synced["ts"] <= finalize["ts"] and ends(finalize) <= ends(synced)
    # On each thread, complete events nest or follow each other (what trace viewers need).
    by_thread = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_thread[(e["pid"], e["tid"])].append(e)
    for thread_events in by_thread.values():
        stack: list[float] = []
        for e in sorted(thread_events, key=lambda e: (e["ts"], -e["dur"])):
            # ts + dur rounds in floating point: within a nanosecond counts as touching.
            while stack and stack[-1] <= e["ts"] + NS:
                stack.pop()
            assert not stack or ends(e) <= stack[-1] + NS, e
            stack.append(ends(e))


MLP_NAMES = [
    "stem.weight", "stem.bias", "trunk.0.weight", "trunk.0.bias", "trunk.1.weight",
    "trunk.1.bias", "aux_a.weight", "aux_a.bias", "aux_b.weight", "aux_b.bias", "head.weight",
    "head.bias",
]  # fmt: skip
NAME_INDEX = {name: i for i, name in enumerate(MLP_NAMES)}
