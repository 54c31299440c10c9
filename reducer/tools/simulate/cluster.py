"""Predict a data-parallel step on a real cluster: one rank run for real, the network modelled.

One rank's model is built by shape on the meta device and wrapped in this project's
``DistributedDataParallel`` over a :class:`VirtualGroup`: a process group that says it has
``world_size`` ranks, moves no data, and charges each collective the network model's time.
The real reducer decides everything it decides in a job: the buckets (and their rebuild in
gradient-ready order after the first step), the order they launch in, and when each launches
(the hook of the last gradient it waits for). The other ranks are modelled as identical, so
W = 4096 costs what W = 8 does.

Time is a virtual clock (see Note [The virtual clock]): compute comes either from an estimate
of every kernel against a named GPU's peaks (:mod:`reducer.tools.simulate.gpu`) or from a
profile measured where the job will run (:class:`Profile`: per-parameter gradient-ready
times, forward and optimizer time).

# Note [The virtual clock]
# The clock is the GPU compute stream's: forward, backward and optimizer kernels advance it
# (estimated per kernel, or set from the profile at each parameter's gradient hook). A
# collective launches at the clock's time when the reducer calls it, and runs on the
# communication stream: collectives of one process group run one after another in launch
# order (one NCCL communicator, one stream); with several round-robin groups, collectives in
# flight at once share the network equally. Waiting for a collective (finalize, at the end of
# backward) moves the clock to its completion. With overlap off, no collective starts
# before backward has ended (the first wait of the step). With shared cores (gloo on CPU
# tensors, a core per rank), a collective's work is done by the cores that compute: it runs
# when launched and the compute clock waits for it, so nothing overlaps. There the host's
# own cost of each collective call (``host_call_s``: the reducer's work to launch a bucket
# and the process group's call, measured where the job runs) is on the same cores too, and
# the clock pays it before the collective; so is the reducer's own cost per gradient hook
# (``host_hook_s``), paid at each hook of a synchronised backward. With a GPU the host is
# taken to run ahead of the stream, so neither is charged (see Note [Communication slowing
# compute] in fakepg.clusternet for what a collective does cost the GPU).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from reducer import DistributedDataParallel, ReduceOp

from . import chrome_profile, shapes
from .gpu import GpuSpec, OpClock
from .profile import Profile

__all__ = [
    "PREDICTED_DTYPES",
    "ClusterPrediction",
    "CollectiveRecord",
    "Profile",
    "VirtualGroup",
    "load_profile",
    "measure_profile",
    "predict",
]


class CostModel:
    """What the prediction needs from a network model (``fakepg.NetworkModel`` fits)."""

    def collective_time_s(self, kind: str, nbytes: int, world_size: int) -> float:
        raise NotImplementedError


@dataclass(slots=True)
class CollectiveRecord:
    """One collective of the step: what, how big, on which group, when (s on the clock)."""

    kind: str
    nbytes: int
    group: int
    launch_s: float
    in_backward: bool = False  # launched by a gradient hook (overlap off delays these)
    start_s: float = math.nan
    done_s: float = math.nan


class _VirtualWork:
    def __init__(self, group: VirtualGroup, record: CollectiveRecord, tensors: list[Tensor]):
        self._group, self._record, self._tensors = group, record, tensors

    def wait(self, timeout: float | None = None) -> None:
        self._group.wait_for(self._record)

    def is_completed(self) -> bool:
        return True

    def result(self) -> list[Tensor]:
        return self._tensors


class VirtualGroup:
    """``world_size`` ranks, of which this is rank 0; see Note [The virtual clock].

    ``groups`` > 1 deals collectives out round robin to that many process groups (torch's
    ``_round_robin_process_groups``)."""

    def __init__(
        self,
        world_size: int,
        network: Any,
        clock: OpClock,
        *,
        groups: int = 1,
        overlap: bool = True,
        shared_cores: bool = False,
        host_call_s: float = 0.0,
    ) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if groups < 1:
            raise ValueError(f"process_groups must be >= 1, got {groups}")
        _check_host_call(host_call_s)
        self.world_size, self.network, self.clock = world_size, network, clock
        self.groups, self.overlap, self.shared_cores = groups, overlap, shared_cores
        self.host_call_s = host_call_s
        self.stolen_s = 0.0  # compute time the collectives took (shared cores)
        self.records: list[CollectiveRecord] = []
        self._issued = 0
        self.in_backward = False  # set by the caller around backward
        self.backward_end_s: float | None = None  # the first wait in backward: its end

    def begin_step(self) -> None:
        """A new step: forget the last one's collectives."""
        self.records = []
        self.backward_end_s = None

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self.world_size

    def _record(self, kind: str, tensors: list[Tensor]) -> _VirtualWork:
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        record = CollectiveRecord(
            kind, nbytes, self._issued % self.groups, self.clock.now_s, self.in_backward
        )
        self._issued += 1
        self.records.append(record)
        if self.shared_cores:  # See Note [The virtual clock]
            self.clock.now_s += self.host_call_s
            self.stolen_s += self.host_call_s
            record.launch_s = self.clock.now_s
            cost = self._cost_s(record)
            record.start_s, record.done_s = self.clock.now_s, self.clock.now_s + cost
            self.clock.now_s += cost
            self.stolen_s += cost
        return _VirtualWork(self, record, tensors)

    def allreduce(self, tensors: list[Tensor], op: ReduceOp = ReduceOp.SUM) -> _VirtualWork:
        sparse = any(t.is_sparse for t in tensors)
        return self._record("sparse_allreduce" if sparse else "allreduce", list(tensors))

    def broadcast(self, tensors: list[Tensor], root: int = 0) -> _VirtualWork:
        return self._record("broadcast", list(tensors))

    def allgather(self, output_lists: list[list[Tensor]], inputs: list[Tensor]) -> _VirtualWork:
        return self._record("allgather", list(inputs))

    def barrier(self) -> _VirtualWork:
        return self._record("barrier", [])

    def wait_for(self, record: CollectiveRecord) -> None:
        """Finalize waits: schedule what was launched, move the clock to ``record``'s end."""
        if self.in_backward and self.backward_end_s is None:
            self.backward_end_s = self.clock.now_s
            self.clock.charging = self.clock.gpu is not None  # finalize's copies are estimated
        if not self.shared_cores:
            self._schedule()
        self.clock.advance_to(record.done_s)

    def busy_s(self, start_s: float, end_s: float) -> float:
        """Seconds of [start_s, end_s] during which at least one collective was in flight
        (the union of their [start, done] intervals, clipped to the window)."""
        spans = sorted((r.start_s, r.done_s) for r in self.records if not math.isnan(r.done_s))
        total, covered = 0.0, start_s  # covered: the window is counted up to here
        for start, done in spans:
            lo, hi = max(start, covered), min(done, end_s)
            if hi > lo:
                total += hi - lo
            covered = max(covered, min(done, end_s))
        return total

    def _cost_s(self, record: CollectiveRecord) -> float:
        if self.network is None:
            return 0.0
        return float(self.network.collective_time_s(record.kind, record.nbytes, self.world_size))

    def _schedule(self) -> None:
        """Start and end of every collective so far: FIFO per group, equal shares of the
        network among the groups' collectives in flight (processor sharing)."""
        end = self.backward_end_s

        def earliest(record: CollectiveRecord) -> float:
            if not self.overlap and end is not None and record.in_backward:
                return max(record.launch_s, end)
            return record.launch_s

        queues = [[r for r in self.records if r.group == g] for g in range(self.groups)]
        heads = [0] * self.groups
        free = [-math.inf] * self.groups  # when each group's previous collective ended
        remaining: dict[int, float] = {}  # group -> seconds of work left at full rate
        now = -math.inf
        while True:
            for g, queue in enumerate(queues):  # start what can start now
                if g not in remaining and heads[g] < len(queue):
                    record = queue[heads[g]]
                    start = max(earliest(record), free[g])
                    if start <= now:
                        record.start_s = start
                        remaining[g] = self._cost_s(record)
            starts = [
                max(earliest(queue[heads[g]]), free[g])
                for g, queue in enumerate(queues)
                if g not in remaining and heads[g] < len(queue)
            ]
            if not remaining and not starts:
                return
            share = len(remaining)
            finish = min(remaining.values()) * share if remaining else math.inf
            next_start = min(starts) if starts else math.inf
            if not remaining:  # idle until the next start
                now = next_start
                continue
            step = min(finish, next_start - now)
            for g in remaining:
                remaining[g] -= step / share
            now += step
            for g in [g for g, left in remaining.items() if left <= 1e-15]:
                record = queues[g][heads[g]]
                record.done_s = now
                free[g] = now
                heads[g] += 1
                del remaining[g]


def _check_host_call(
    seconds: float, name: str = "host_call_s", what: str = "collective call"
) -> None:
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise ValueError(
            f"{name} must be a finite number of seconds >= 0 (the host's cost of one {what}), "
            f"got {seconds!r}"
        )


# -------------------------------------------------------------------------------------------
# Profiles: compute measured where the job runs.


def load_profile(path: str | Path, *, model: str, batch_size: int = 0) -> Profile:
    """A profile from ``path``: this project's JSON (:meth:`Profile.load`), or
    torch.profiler's Chrome trace of ``model`` (:mod:`.chrome_profile`)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"profile {path}: cannot read it as JSON: {exc}") from exc
    if isinstance(data, dict) and "traceEvents" in data:
        return chrome_profile.load(path, model, batch_size)
    return Profile.from_json(data, source=str(path))


def measure_profile(
    model: str, *, device: str | torch.device, batch_size: int | None = None, steps: int = 5
) -> Profile:
    """Run ``model`` (random weights) on ``device`` for ``steps`` steps after two warm-up
    steps and time them: on CUDA with events on the stream (what the GPU did, not when the
    host issued it), on the CPU with the host clock. Medians over the steps."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch sees no GPU; use a profile or --gpu")
    net = shapes.build(model, device)
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    for _, p in named:
        with torch.no_grad():
            nn.init.normal_(p, std=0.02)
    batch = batch_size or shapes.SHAPE_MODELS[model].batch_size
    x, y = net.make_batch(batch, device)  # type: ignore[operator]
    optimizer = torch.optim.SGD(net.parameters(), lr=1e-4, momentum=0.9)
    stamp = _stamper(device)
    ready: list[Any] = [None] * len(named)
    handles = [
        p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
            lambda _p, i=i: ready.__setitem__(i, stamp())
        )
        for i, (_, p) in enumerate(named)
    ]
    forward, optim, per_param = [], [], []
    try:
        for step in range(steps + 2):
            optimizer.zero_grad(set_to_none=True)
            t0 = stamp()
            loss = net.loss(net(x), y)  # type: ignore[operator]
            t1 = stamp()
            loss.backward()
            t2 = stamp()
            optimizer.step()
            t3 = stamp()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step < 2:
                continue
            elapsed = _elapsed_ms(device)
            forward.append(elapsed(t0, t1))
            optim.append(elapsed(t2, t3))
            per_param.append([elapsed(t1, r) for r in ready])
    finally:
        for handle in handles:
            handle.remove()
    return Profile(
        model=model,
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
        batch_size=batch,
        forward_ms=statistics.median(forward),
        optimizer_ms=statistics.median(optim),
        names=tuple(n for n, _ in named),
        shapes=tuple(tuple(p.shape) for _, p in named),
        ready_ms=tuple(statistics.median(s[i] for s in per_param) for i in range(len(named))),
    )


def _stamper(device: torch.device) -> Callable[[], Any]:
    if device.type == "cuda":

        def event() -> Any:
            e = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            e.record()
            return e

        return event
    import time

    return time.perf_counter


def _elapsed_ms(device: torch.device) -> Callable[[Any, Any], float]:
    if device.type == "cuda":
        return lambda a, b: float(a.elapsed_time(b))
    return lambda a, b: (b - a) * 1e3


# -------------------------------------------------------------------------------------------
# The prediction.


@dataclass
class ClusterPrediction:
    """One predicted steady-state step (the third: after DDP's bucket rebuild); times in s."""

    model: str
    world_size: int
    bucket_cap_mb: float | None  # None: torch's default
    overlap: bool
    compute: str  # where compute times came from
    step_s: float
    forward_s: float
    backward_s: float  # from the start of backward until its last kernel
    optimizer_s: float
    comm_s: float  # first collective start to last end
    exposed_s: float  # communication after backward ended
    slowed_s: float = 0.0  # what the step lost to collectives slowing backward (in step_s)
    backward_start_s: float = 0.0  # of the synced micro-batch, from the step's start
    bucket_nbytes: list[int] = field(default_factory=list)
    collectives: list[CollectiveRecord] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """What to predict. ``gpu`` estimates compute; ``profile`` (which wins) measured it."""

    model: str
    world_size: int
    network: Any = None
    bucket_cap_mb: float | None = None  # torch's default: 25 MiB, the first bucket 1 MiB
    overlap: bool = True
    no_sync_every: int = 1
    process_groups: int = 1
    batch_size: int | None = None
    gpu: GpuSpec | None = None
    profile: Profile | None = None
    dtype: torch.dtype = torch.float32
    find_unused: bool = False
    ddp: bool = True
    shared_cores: bool = False  # see Note [The virtual clock]
    host_call_s: float = 0.0  # charged on shared cores only: see Note [The virtual clock]
    host_hook_s: float = 0.0  # the same, per gradient hook of DDP
    seq_len: int | None = None  # tokens per sequence (None: the model's own)

    def check(self) -> None:
        if self.model not in shapes.SHAPE_MODELS:
            raise ValueError(
                f"model: unknown {self.model!r}; choose one of {', '.join(shapes.SHAPE_MODELS)}"
            )
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb >= 0:
            raise ValueError(f"bucket_cap_mb must be >= 0 (0: one bucket per parameter), got "
                             f"{self.bucket_cap_mb}")  # fmt: skip
        if self.no_sync_every < 1:
            raise ValueError(f"no_sync_every must be >= 1, got {self.no_sync_every}")
        if self.find_unused:
            raise ValueError(
                "find_unused: not predicted: finalize reads the all-reduced map of used "
                "parameters, data a model on the meta device does not have; predict without it"
            )
        _check_host_call(self.host_call_s)
        _check_host_call(self.host_hook_s, "host_hook_s", "gradient hook of DDP")
        if self.gpu is None and self.profile is None:
            raise ValueError("compute: give a GPU to estimate from or a measured profile")
        if self.dtype not in PREDICTED_DTYPES.values():
            raise ValueError(
                f"dtype: {self.dtype} is not predicted; choose one of {', '.join(PREDICTED_DTYPES)}"
            )
        if self.seq_len is not None and self.profile is not None:
            raise ValueError(
                "--seq-len: a profile was measured at its own sequence length; predict from "
                "it without --seq-len, or measure a profile at the length you want"
            )
        topology = getattr(self.network, "topology", None)
        if topology is not None:
            topology.nodes(self.world_size)  # raises if the world does not fill whole nodes


_STEPS = 3  # DDP rebuilds its buckets after the first step; the third is steady

# The parameters' (and so the gradients' and buckets') dtypes a prediction takes.
PREDICTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def step_delay_s(lost_s: float, exposed_s: float, last_s: float) -> float:
    """How much later the step ends when backward ends ``lost_s`` later (compute taken by
    collectives, Note [Communication slowing compute] in fakepg.clusternet): the last bucket
    launches that much later too, but what was queued before it (the exposed tail
    ``exposed_s`` beyond the last bucket's own ``last_s``) has had that long to drain."""
    backlog = max(0.0, exposed_s - last_s)
    return lost_s - min(lost_s, backlog)


def predict(config: ClusterConfig) -> ClusterPrediction:
    """The predicted step of ``config``; see the module's docstring."""
    config.check()
    clock = OpClock(config.gpu)
    group = VirtualGroup(
        config.world_size,
        config.network,
        clock,
        groups=config.process_groups,
        overlap=config.overlap,
        shared_cores=config.shared_cores,
        host_call_s=config.host_call_s,
    )
    net = shapes.build(config.model, seq_len=config.seq_len).to(config.dtype)
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    profile = config.profile
    if profile is not None:
        profile.check_matches(config.model, named)
    batch = config.batch_size or (
        profile.batch_size if profile else shapes.SHAPE_MODELS[config.model].batch_size
    )
    hook_s = config.host_hook_s if (config.shared_cores and config.ddp) else 0.0
    marks = _Marks(clock, group, profile, hook_s)
    marks.install(named)  # before DDP's hooks, so that they run first
    if config.ddp:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            model: nn.Module = DistributedDataParallel(
                net,
                group,
                bucket_cap_mb=config.bucket_cap_mb,
                find_unused_parameters=config.find_unused,
                init_sync=False,  # its checks read data back; meta tensors have none
            )
        # Where DDP puts the rebuild's order tensor, which it reads back: see Note [The
        # virtual clock]. The meta device has no data to read.
        model.device = torch.device("cpu")  # type: ignore[assignment]
    else:
        model = net
    marks.install_after(named)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    x, y = net.make_batch(batch, torch.device("meta"))  # type: ignore[operator]
    x = x.to(config.dtype) if x.is_floating_point() else x
    optimizer_s = 0.0
    with clock:
        for _ in range(_STEPS):
            group.begin_step()
            clock.now_s = 0.0
            optimizer.zero_grad(set_to_none=True)
            for micro in range(config.no_sync_every):
                marks.micro_batch(model, x, y, net, synced=micro == config.no_sync_every - 1)
            before = clock.now_s
            marks.optimizer_step(optimizer)
            optimizer_s = clock.now_s - before
    if config.ddp:
        model.reducer.close()  # type: ignore[operator,union-attr]
    marks.remove()
    records = group.records
    # The gradients' collectives (buckets, the used map), not the forward's buffer broadcast.
    timed = [r for r in records if r.kind.endswith("allreduce") and not math.isnan(r.done_s)]
    backward_end = marks.backward_end_s
    # See Note [Communication slowing compute] in fakepg.clusternet: backward's kernels lose
    # the SMs of the collectives in flight beside them, so backward (and the step) ends later.
    slowdown = float(getattr(config.network, "compute_slowdown", 0.0))
    slowed = lost = 0.0
    comm_end = max((r.done_s for r in timed), default=backward_end)
    if slowdown and not config.shared_cores and timed:
        lost = slowdown * group.busy_s(marks.backward_start_s, backward_end)
        last = max(timed, key=lambda r: r.launch_s)
        slowed = step_delay_s(lost, comm_end - backward_end, last.done_s - last.start_s)
    return ClusterPrediction(
        model=config.model,
        world_size=config.world_size,
        bucket_cap_mb=config.bucket_cap_mb,
        overlap=config.overlap,
        compute=(
            f"profile ({profile.device})" if profile else f"estimate ({config.gpu.name})"  # type: ignore[union-attr]
        ),
        step_s=clock.now_s + slowed,
        forward_s=marks.forward_s,
        backward_s=backward_end - marks.backward_start_s + lost,
        optimizer_s=optimizer_s,
        comm_s=comm_end - min((r.start_s for r in timed), default=comm_end),
        exposed_s=max(0.0, comm_end - backward_end - (lost - slowed)),
        slowed_s=slowed,
        backward_start_s=marks.backward_start_s,
        bucket_nbytes=[r.nbytes for r in records if r.kind.endswith("allreduce")],
        collectives=list(records),
    )


class _Marks:
    """The clock's hooks on the parameters: with a profile, each gradient is ready at its
    measured time and only the reducer's own work (between the hooks around DDP's) is
    estimated; without one, every kernel is."""

    def __init__(
        self, clock: OpClock, group: VirtualGroup, profile: Profile | None, hook_s: float = 0.0
    ) -> None:
        self.clock, self.group, self.profile = clock, group, profile
        self.hook_s = hook_s  # the host's cost of DDP's gradient hook, on shared cores
        self.synced = True
        self.handles: list[Any] = []
        self.forward_s = 0.0
        self.backward_start_s = 0.0
        self.stolen_at_start = 0.0
        self.backward_end_s = 0.0

    def install(self, named: Sequence[tuple[str, Tensor]]) -> None:
        for i, (_, p) in enumerate(named):
            self.handles.append(p.register_hook(functools.partial(self._ready, i)))  # type: ignore[no-untyped-call]
            self.handles.append(p.register_post_accumulate_grad_hook(self._charge_on))  # type: ignore[no-untyped-call]

    def install_after(self, named: Sequence[tuple[str, Tensor]]) -> None:
        for _, p in named:
            self.handles.append(p.register_post_accumulate_grad_hook(self._charge_off))  # type: ignore[no-untyped-call]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()

    def _ready(self, index: int, grad: Tensor) -> Tensor:
        if self.profile is not None:
            shift = self.group.stolen_s - self.stolen_at_start  # shared cores: comm came first
            at = self.backward_start_s + shift + self.profile.ready_ms[index] * 1e-3
            self.clock.advance_to(at)
        return grad

    def _charge_on(self, _param: Tensor) -> None:
        if self.hook_s and self.synced:  # See Note [The virtual clock]: shared cores
            self.clock.now_s += self.hook_s
            self.group.stolen_s += self.hook_s
        if self.profile is not None:
            self.clock.charging = True

    def _charge_off(self, _param: Tensor) -> None:
        if self.profile is not None:
            self.clock.charging = False

    def micro_batch(
        self, model: nn.Module, x: Tensor, y: Tensor, net: nn.Module, synced: bool
    ) -> None:
        """Forward and backward of one micro-batch (under no_sync unless ``synced``)."""
        self.synced = synced
        no_sync = getattr(model, "no_sync", None)
        context = no_sync() if (not synced and no_sync is not None) else contextlib.nullcontext()
        with context:
            start, stolen = self.clock.now_s, self.group.stolen_s
            if self.profile is not None:
                self.clock.charging = False
            loss = net.loss(model(x), y)  # type: ignore[operator]
            if self.profile is not None:
                shift = self.group.stolen_s - stolen
                self.clock.advance_to(start + shift + self.profile.forward_ms * 1e-3)
            self.forward_s = self.clock.now_s - start
            self.backward_start_s = self.clock.now_s
            self.stolen_at_start = self.group.stolen_s
            self.group.in_backward = True
            try:
                loss.backward()
            finally:
                self.group.in_backward = False
            end = self.group.backward_end_s
            self.backward_end_s = self.clock.now_s if end is None else end
            if self.profile is not None:
                self.clock.charging = True

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.profile is None:
            optimizer.step()
            return
        self.clock.charging = False
        start = self.clock.now_s
        optimizer.step()
        self.clock.advance_to(start + self.profile.optimizer_ms * 1e-3)
        self.clock.charging = True
