"""reducer.tools.simulate.cluster and shapes: a cluster step predicted through the real DDP."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import pytest
import torch

import fakepg
from reducer.tools.simulate import cluster, gpu, shapes
from reducer.tools.simulate.cluster import ClusterConfig, Profile, VirtualGroup, predict

V100 = gpu.GPUS["v100"]
NCCL = fakepg.CLUSTER_PRESETS["nccl-dgx1-v100"]
UNSLOWED = dataclasses.replace(NCCL, compute_slowdown=0.0)


@pytest.mark.parametrize(
    ("name", "tensors", "parameters"),
    [
        ("resnet50", 161, 25_557_032),  # torchvision's resnet50()
        ("bert-base", 199 + 2, 109_482_240 + 768 * 2 + 2),  # BertModel + 2-class head
        ("bert-large", 391 + 2, 335_141_888 + 1024 * 2 + 2),
        ("gpt2", 148, 124_439_808),
        ("gpt2-medium", 292, 354_823_168),
        ("gpt2-large", 436, 774_030_080),
        ("gpt2-xl", 580, 1_557_611_200),
    ],
)
def test_models_by_shape_have_the_published_counts(
    name: str, tensors: int, parameters: int
) -> None:
    params = list(shapes.build(name).parameters())
    assert len(params) == tensors
    assert sum(p.numel() for p in params) == parameters
    assert all(p.is_meta for p in params)


class _Clock(gpu.OpClock):
    def __init__(self) -> None:
        super().__init__(None)


class _Fixed:
    """Every collective takes ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def collective_time_s(self, kind: str, nbytes: int, world_size: int) -> float:
        return self.seconds


def _launch(group: VirtualGroup, at: float, nbytes: int = 4) -> cluster._VirtualWork:
    group.clock.now_s = at
    return group.allreduce([torch.empty(nbytes // 4, device="meta")])


def test_one_group_runs_its_collectives_one_after_another() -> None:
    clock = _Clock()
    group = VirtualGroup(8, _Fixed(1.0), clock)
    works = [_launch(group, 0.0), _launch(group, 0.5), _launch(group, 5.0)]
    group.in_backward = True
    clock.now_s = 6.0
    works[2].wait()
    assert [(r.start_s, r.done_s) for r in group.records] == [(0, 1), (1, 2), (5, 6)]
    assert clock.now_s == 6.0 and group.backward_end_s == 6.0


def test_round_robin_groups_share_the_network() -> None:
    clock = _Clock()
    group = VirtualGroup(8, _Fixed(1.0), clock, groups=2)
    first, second = _launch(group, 0.0), _launch(group, 0.0)
    second.wait()
    # Both in flight from 0, each at half speed: both end at 2 (one group: 1 and 2).
    assert [r.done_s for r in group.records] == [2.0, 2.0]
    first.wait()
    assert clock.now_s == 2.0


def test_a_later_collective_shares_from_its_start() -> None:
    clock = _Clock()
    group = VirtualGroup(8, _Fixed(1.0), clock, groups=2)
    _launch(group, 0.0)
    last = _launch(group, 0.5)
    last.wait()
    # Alone until 0.5 (half done), then both at half speed: the first ends at 1.5, the
    # second, with 0.5 left alone, at 2.0.
    assert [r.done_s for r in group.records] == [1.5, 2.0]


def test_without_overlap_nothing_starts_before_backward_ends() -> None:
    clock = _Clock()
    group = VirtualGroup(8, _Fixed(1.0), clock, overlap=False)
    before = _launch(group, 0.0)  # in forward (a buffer broadcast): not delayed
    group.in_backward = True
    work = _launch(group, 1.0)  # by a gradient hook
    clock.now_s = 10.0
    work.wait()
    assert (group.records[1].start_s, clock.now_s) == (10.0, 11.0)
    assert group.records[0].done_s == 1.0
    before.wait()
    assert clock.now_s == 11.0


def test_shared_cores_run_each_collective_on_the_compute_clock() -> None:
    clock = _Clock()
    group = VirtualGroup(8, _Fixed(1.0), clock, shared_cores=True)
    group.in_backward = True
    first = _launch(group, 0.5)
    assert clock.now_s == 1.5  # compute waited for it
    second = _launch(group, 2.0)
    second.wait()
    first.wait()
    assert [(r.start_s, r.done_s) for r in group.records] == [(0.5, 1.5), (2.0, 3.0)]
    assert (clock.now_s, group.stolen_s) == (3.0, 2.0)


def test_on_shared_cores_each_call_first_pays_the_hosts_cost() -> None:
    clock = _Clock()
    group = VirtualGroup(8, _Fixed(1.0), clock, shared_cores=True, host_call_s=0.25)
    group.in_backward = True
    _launch(group, 0.5)
    _launch(group, 2.0).wait()
    # Each call: 0.25 s of the host's own work on the cores, then the collective on them.
    assert [(r.launch_s, r.start_s, r.done_s) for r in group.records] == [
        (0.75, 0.75, 1.75),
        (2.25, 2.25, 3.25),
    ]
    assert (clock.now_s, group.stolen_s) == (3.25, 2.5)
    # With a GPU the host runs ahead of the stream: its cost is not on the clock.
    gpu_clock = _Clock()
    ahead = VirtualGroup(8, _Fixed(1.0), gpu_clock, host_call_s=0.25)
    _launch(ahead, 0.5).wait()
    assert (ahead.records[0].start_s, gpu_clock.now_s) == (0.5, 1.5)


@pytest.mark.parametrize("bad", [-1e-6, math.inf, math.nan])
def test_a_host_cost_per_call_must_be_a_time(bad: float) -> None:
    with pytest.raises(ValueError, match="host_call_s"):
        VirtualGroup(8, _Fixed(1.0), _Clock(), host_call_s=bad)
    with pytest.raises(ValueError, match="host_call_s"):
        ClusterConfig("resnet50", 2, None, gpu=V100, host_call_s=bad).check()
    with pytest.raises(ValueError, match=r"host_hook_s .*gradient hook"):
        ClusterConfig("resnet50", 2, None, gpu=V100, host_hook_s=bad).check()


def test_busy_time_is_the_union_of_the_collectives_in_flight() -> None:
    clock = _Clock()
    group = VirtualGroup(8, _Fixed(1.0), clock)
    works = [_launch(group, 0.0), _launch(group, 0.5), _launch(group, 5.0)]
    works[2].wait()  # (0, 1), (1, 2), (5, 6)
    assert group.busy_s(0.5, 5.5) == 0.5 + 1.0 + 0.5
    assert group.busy_s(2.0, 5.0) == 0.0
    shared = VirtualGroup(8, _Fixed(1.0), _Clock(), groups=2)
    _launch(shared, 0.0)
    _launch(shared, 0.0).wait()  # both (0, 2): counted once
    assert shared.busy_s(0.0, 3.0) == 2.0


def test_bad_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="process_groups must be >= 1"):
        VirtualGroup(8, None, _Clock(), groups=0)


@pytest.fixture(scope="module")
def resnet_steps() -> dict[str, cluster.ClusterPrediction]:
    """ResNet50 on 16 V100s (two DGX-1 nodes), a few settings; predicted once per module."""
    base = ClusterConfig("resnet50", 16, NCCL, bucket_cap_mb=25.0, gpu=V100)
    return {
        "25": predict(base),
        "default": predict(ClusterConfig("resnet50", 16, NCCL, gpu=V100)),
        "0": predict(ClusterConfig("resnet50", 16, NCCL, bucket_cap_mb=0, gpu=V100)),
        "off": predict(ClusterConfig("resnet50", 16, NCCL, 25.0, overlap=False, gpu=V100)),
        "unslowed": predict(ClusterConfig("resnet50", 16, UNSLOWED, 25.0, gpu=V100)),
        "alone": predict(ClusterConfig("resnet50", 1, None, gpu=V100, ddp=False)),
    }


@pytest.mark.slow
def test_the_real_reducer_decides_the_buckets(
    resnet_steps: dict[str, cluster.ClusterPrediction],
) -> None:
    ddp = resnet_steps["25"]
    # After the rebuild, in gradient-ready order: bucket_cap_mb=25 given, so torch 2.13's
    # first bucket holds 25 MiB too (1 MiB only where the cap is left at its default).
    assert sum(ddp.bucket_nbytes) == 25_557_032 * 4
    assert len(ddp.bucket_nbytes) == 4
    assert len(resnet_steps["0"].bucket_nbytes) == 161  # cap 0: one parameter per bucket
    # The cap left unset, as most jobs leave it: torch's first bucket of 1 MiB, then 25 MiB.
    default = resnet_steps["default"]
    assert default.bucket_cap_mb is None
    assert sum(default.bucket_nbytes) == 25_557_032 * 4
    assert len(default.bucket_nbytes) == 5
    # fc's weight and bias (8,196,000 bytes), ready first, close the 1 MiB first bucket alone;
    # with the cap given, the first bucket fills to 25 MiB like the others.
    assert default.bucket_nbytes[0] == (2048 * 1000 + 1000) * 4
    assert ddp.bucket_nbytes[0] >= 25 << 20
    launches = [r.launch_s for r in ddp.collectives if r.kind == "allreduce"]
    assert launches == sorted(launches)
    assert all(
        r.done_s >= r.start_s >= r.launch_s for r in ddp.collectives if r.kind == "allreduce"
    )


def test_overlap_hides_communication_behind_backward(
    resnet_steps: dict[str, cluster.ClusterPrediction],
) -> None:
    on, off, alone = resnet_steps["25"], resnet_steps["off"], resnet_steps["alone"]
    assert alone.comm_s == 0 and not alone.bucket_nbytes
    assert alone.step_s < on.step_s < off.step_s
    assert on.exposed_s < off.exposed_s
    assert off.exposed_s == pytest.approx(off.comm_s)  # none of it overlaps
    assert on.compute == "estimate (V100-SXM2)"


def _busy(prediction: cluster.ClusterPrediction, start: float, end: float) -> float:
    """Seconds of [start, end] covered by the prediction's collectives: the elementary
    segments between all their ends, each counted once if any collective covers it."""
    spans = [(r.start_s, r.done_s) for r in prediction.collectives if not math.isnan(r.done_s)]
    cuts = sorted({start, end, *(min(max(t, start), end) for span in spans for t in span)})
    covered = [
        (a, b) for a, b in itertools.pairwise(cuts) if any(x <= (a + b) / 2 < y for x, y in spans)
    ]
    return sum(b - a for a, b in covered)


def test_collectives_in_flight_slow_backward_by_the_sm_fraction(
    resnet_steps: dict[str, cluster.ClusterPrediction],
) -> None:
    slowed, plain, off = resnet_steps["25"], resnet_steps["unslowed"], resnet_steps["off"]
    assert NCCL.compute_slowdown == 8 / 80  # 8 NCCL channels of the V100's 80 SMs
    assert plain.slowed_s == 0.0 and off.slowed_s == 0.0  # off: nothing runs beside backward
    # Note [Communication slowing compute]: backward loses f x (time collectives were in
    # flight during it); the exposed tail after it shrinks by that much, not below the last
    # bucket's own time.
    end = plain.backward_start_s + plain.backward_s
    lost = 0.1 * _busy(plain, plain.backward_start_s, end)
    grads = [r for r in plain.collectives if r.kind == "allreduce"]
    last = max(grads, key=lambda r: r.launch_s)
    backlog = max(0.0, max(r.done_s for r in grads) - end - (last.done_s - last.start_s))
    expected = lost - min(lost, backlog)
    assert lost > 0 and slowed.slowed_s == pytest.approx(expected, rel=1e-9)
    assert slowed.step_s == pytest.approx(plain.step_s + slowed.slowed_s, rel=1e-12)
    assert slowed.backward_s == pytest.approx(plain.backward_s + lost, rel=1e-9)


def test_a_slower_backward_delays_the_step_less_what_the_queue_drains() -> None:
    # Nothing queued behind the last bucket: the whole loss shows.
    assert cluster.step_delay_s(2.0, exposed_s=1.0, last_s=1.0) == 2.0
    # 1.5 s queued before the last bucket: it drains during the 2 s lost, 0.5 s shows.
    assert cluster.step_delay_s(2.0, exposed_s=2.5, last_s=1.0) == 0.5
    # More queued than lost: the step does not move.
    assert cluster.step_delay_s(2.0, exposed_s=4.0, last_s=1.0) == 0.0
    assert cluster.step_delay_s(0.0, exposed_s=0.0, last_s=0.0) == 0.0


def test_no_sync_reduces_once_per_step() -> None:
    every = predict(ClusterConfig("resnet50", 16, NCCL, gpu=V100))
    second = predict(ClusterConfig("resnet50", 16, NCCL, gpu=V100, no_sync_every=2))
    assert len(second.bucket_nbytes) == len(every.bucket_nbytes)
    assert second.step_s > 1.9 * (every.step_s - every.optimizer_s)


def test_a_profile_sets_when_each_gradient_is_ready(tmp_path: Path) -> None:
    net = shapes.build("resnet50")
    named = list(net.named_parameters())
    count = len(named)
    # Ready in reverse parameter order, 0.5 ms apart: backward lasts count / 2 ms.
    ready = [(count - i) * 0.5 for i in range(count)]
    profile = Profile(
        "resnet50", "made up", 32, 30.0, 2.0,
        tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named), tuple(ready),
    )  # fmt: skip
    path = tmp_path / "profile.json"
    profile.save(path)
    assert Profile.load(path) == profile
    alone = predict(ClusterConfig("resnet50", 1, None, profile=profile, ddp=False))
    assert alone.forward_s == pytest.approx(0.030)
    assert alone.backward_s == pytest.approx(max(ready) * 1e-3)
    assert alone.step_s == pytest.approx(0.030 + max(ready) * 1e-3 + 0.002)
    assert alone.compute == "profile (made up)"
    ddp = predict(ClusterConfig("resnet50", 16, NCCL, profile=profile, gpu=V100))
    assert ddp.step_s > alone.step_s  # the reducer's copies and the exposed tail
    # Shared cores: every collective's time adds to the step (nothing overlaps).
    link = fakepg.AlphaBeta(1e-4, 1e9)
    shared = predict(ClusterConfig("resnet50", 2, link, profile=profile, shared_cores=True))
    comm = sum(
        link.collective_time_s(r.kind, r.nbytes, 2) for r in shared.collectives
        if r.kind != "broadcast" or r.in_backward
    )  # fmt: skip
    broadcasts = [r for r in shared.collectives if r.kind == "broadcast"]
    comm += sum(link.collective_time_s("broadcast", r.nbytes, 2) for r in broadcasts)
    assert shared.step_s > alone.step_s + 0.9 * comm


@pytest.mark.slow
def test_the_hosts_cost_per_call_adds_once_per_collective_on_shared_cores() -> None:
    net = shapes.build("resnet50")
    named = list(net.named_parameters())
    ready = [(len(named) - i) * 0.5 for i in range(len(named))]
    profile = Profile(
        "resnet50", "made up", 32, 30.0, 2.0,
        tuple(n for n, _ in named), tuple(tuple(p.shape) for _, p in named), tuple(ready),
    )  # fmt: skip
    link = fakepg.AlphaBeta(1e-4, 1e9)
    for cap in (0.0, 25.0):
        base = ClusterConfig("resnet50", 2, link, cap, profile=profile, shared_cores=True)
        without = predict(base)
        paid = predict(dataclasses.replace(base, host_call_s=3e-4))
        calls = len(paid.collectives)
        assert calls == len(without.collectives) > 0
        assert paid.step_s - without.step_s == pytest.approx(calls * 3e-4, rel=1e-9)
        # And per gradient hook of DDP: once per parameter, in the synchronised backward.
        hooked = predict(dataclasses.replace(base, host_hook_s=2e-4))
        assert hooked.step_s - without.step_s == pytest.approx(len(named) * 2e-4, rel=1e-9)
    # Under no_sync the hooks of the unsynchronised micro-batches are not charged; without
    # DDP there are no hooks; without shared cores the host runs ahead.
    base = ClusterConfig("resnet50", 2, link, profile=profile, shared_cores=True)
    for config in (
        dataclasses.replace(base, no_sync_every=2),
        dataclasses.replace(base, ddp=False),
        dataclasses.replace(base, shared_cores=False),
    ):
        hooked = predict(dataclasses.replace(config, host_hook_s=2e-4))
        extra = len(named) * 2e-4 if config.no_sync_every == 2 else 0.0
        assert hooked.step_s - predict(config).step_s == pytest.approx(extra, abs=1e-12)


def _profile_json(tmp_path: Path) -> dict[str, object]:
    net = shapes.build("resnet50")
    return {
        "format": "ddp-reducer-profile/1", "model": "resnet50", "device": "x",
        "batch_size": 32, "forward_ms": 1.0, "optimizer_ms": 1.0,
        "params": [{"name": n, "shape": list(p.shape), "ready_ms": 1.0}
                   for n, p in net.named_parameters()],
    }  # fmt: skip


def test_a_profile_that_does_not_match_the_model_names_the_field(tmp_path: Path) -> None:
    data = _profile_json(tmp_path)
    params = data["params"]
    assert isinstance(params, list)
    params[3]["shape"] = [1, 2]
    profile = Profile.from_json(data)
    with pytest.raises(ValueError, match=r"params\[3\]\.shape \(layer1\.0\.conv1\.weight\)"):
        predict(ClusterConfig("resnet50", 8, NCCL, profile=profile))
    params[3]["name"] = "conv9.weight"
    with pytest.raises(ValueError, match=r"params\[3\]\.name is 'conv9\.weight'"):
        predict(ClusterConfig("resnet50", 8, NCCL, profile=Profile.from_json(data)))
    del params[5:]
    with pytest.raises(ValueError, match="params has 5 entries, model 'resnet50' has 161"):
        predict(ClusterConfig("resnet50", 8, NCCL, profile=Profile.from_json(data)))
    with pytest.raises(ValueError, match="model is 'resnet50'"):
        predict(ClusterConfig("gpt2", 8, NCCL, profile=Profile.from_json(data)))
    del params[0]["ready_ms"]
    with pytest.raises(ValueError, match=r"params\[0\]\.ready_ms is missing"):
        Profile.from_json(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**data, "format": "other"}))
    with pytest.raises(ValueError, match="format must be 'ddp-reducer-profile/1'"):
        Profile.load(bad)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (ClusterConfig("resnet50", 12, NCCL, gpu=V100), "not a multiple of gpus_per_node 8"),
        (ClusterConfig("resnet51", 8, NCCL, gpu=V100), "model: unknown 'resnet51'"),
        (ClusterConfig("resnet50", 8, NCCL, bucket_cap_mb=-1, gpu=V100), "bucket_cap_mb"),
        (ClusterConfig("resnet50", 8, NCCL), "give a GPU to estimate from or a measured profile"),
        (ClusterConfig("resnet50", 8, NCCL, gpu=V100, no_sync_every=0), "no_sync_every"),
        (ClusterConfig("resnet50", 8, NCCL, gpu=V100, find_unused=True), "find_unused"),
    ],
)
def test_bad_configs_name_the_field(config: ClusterConfig, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        predict(config)


class _Tiny(torch.nn.Module):
    """Two linear layers, for measuring a profile quickly."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.b(torch.relu(self.a(x)))
        return out

    def make_batch(self, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, 16, device=device), torch.zeros(batch, dtype=torch.int64,
                                                                  device=device)  # fmt: skip

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(output, target)


def test_measuring_a_profile_on_the_cpu_gives_one_the_predictor_takes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(shapes.SHAPE_MODELS, "tiny", shapes.ShapeModel(_Tiny, 8, "tiny"))
    profile = cluster.measure_profile("tiny", device="cpu", steps=2)
    assert profile.names == ("a.weight", "a.bias", "b.weight", "b.bias")
    assert profile.forward_ms > 0 and profile.batch_size == 8
    assert all(0 < r < math.inf for r in profile.ready_ms)
    # b's gradients are computed before a's.
    assert max(profile.ready_ms[2:]) <= min(profile.ready_ms[:2])
    step = predict(ClusterConfig("tiny", 2, NCCL, profile=profile, gpu=V100))
    assert step.backward_s >= max(profile.ready_ms) * 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_measuring_a_profile_on_the_gpu() -> None:
    profile = cluster.measure_profile("resnet50", device="cuda", batch_size=8, steps=2)
    assert "cpu" not in profile.device and len(profile.ready_ms) == 161


def test_a_torch_profiler_trace_is_a_profile(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setitem(shapes.SHAPE_MODELS, "tiny", shapes.ShapeModel(_Tiny, 8, "tiny"))
    net = _Tiny()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = net.make_batch(8, torch.device("cpu"))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            optimizer.zero_grad()
            net.loss(net(x), y).backward()
            optimizer.step()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    loaded = cluster.load_profile(trace, model="tiny", batch_size=8)
    assert loaded.names == ("a.weight", "a.bias", "b.weight", "b.bias")
    assert loaded.forward_ms > 0 and loaded.optimizer_ms > 0
    assert max(loaded.ready_ms[2:]) <= min(loaded.ready_ms[:2])  # b before a, as measured
    step = predict(ClusterConfig("tiny", 2, NCCL, profile=loaded, gpu=V100))
    assert step.backward_s >= max(loaded.ready_ms) * 1e-3
    with pytest.raises(ValueError, match=r"is a torch\.profiler trace: load it with"):
        Profile.load(trace)
    with pytest.raises(ValueError, match="not a multiple of resnet50's 161 parameters"):
        cluster.load_profile(trace, model="resnet50")


def test_a_gpu_trace_times_gradients_by_their_kernels(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A hand-written trace: the host runs ahead; ready times come from the kernels' ends."""
    from reducer.tools.simulate import chrome_profile

    monkeypatch.setitem(shapes.SHAPE_MODELS, "tiny", shapes.ShapeModel(_Tiny, 8, "tiny"))
    order = chrome_profile.hook_order("tiny")
    assert sorted(order) == [0, 1, 2, 3] and set(order[:2]) == {2, 3}

    def op(name: str, ts: float, dur: float = 1.0, cat: str = "cpu_op") -> dict[str, object]:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    def kernel(correlation: int, launched: float, start: float, end: float) -> list[object]:
        return [
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launched,
             "dur": 1.0, "args": {"correlation": correlation}},
            {"ph": "X", "cat": "kernel", "name": f"k{correlation}", "ts": start,
             "dur": end - start, "args": {"correlation": correlation}},
        ]  # fmt: skip

    acc = chrome_profile._ACCUMULATE
    events: list[object] = [
        op("Optimizer.zero_grad#SGD.zero_grad", 0, 10),
        *kernel(1, 12, 100, 300),  # forward, from 100 to 300 us on the GPU
        op("autograd::engine::evaluate_function: AddmmBackward0", 20),
        *kernel(2, 21, 300, 1300),  # b's gradients, done at 1300
        op(acc, 22), op(acc, 23),
        *kernel(3, 30, 1300, 3300),  # a's gradients, done at 3300
        op(acc, 31), op(acc, 32),
        op("Optimizer.step#SGD.step", 40, 5),
        *kernel(4, 41, 3300, 3800),
    ]  # fmt: skip
    trace = tmp_path / "gpu.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    loaded = cluster.load_profile(trace, model="tiny", batch_size=8)
    assert loaded.forward_ms == pytest.approx(0.2)  # 100 to 300 us
    ready = dict(zip(order, [1.0, 1.0, 3.0, 3.0], strict=True))  # ms after backward's start
    assert loaded.ready_ms == tuple(ready[i] for i in range(4))
    assert loaded.optimizer_ms == pytest.approx(0.5)
    assert loaded.device.endswith("(GPU)")
