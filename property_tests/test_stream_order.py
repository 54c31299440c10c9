"""Property 12: the fake world keeps NCCL's stream order, whoever launches from which stream.

A collective on CUDA tensors must read every rank's input after the kernels that wrote it,
whatever stream each rank wrote and launched it from, and whatever a rank queues after
``wait()`` must read the result (see Note [Stream order of a collective] in fakepg.streams).
No GPU here: a simulated CUDA API keeps, per stream, the set of kernels that anything queued
next on it comes after (its happens-before set); an event records a stream's set, a stream
that waits for an event takes the event's set in. The world runs on CPU tensors it is told
are on ``cuda:0``.

Drawn: two or three ranks (one is no order at all), one or two collectives in a row
(allreduce, broadcast, allgather) over tensors on cuda:0, cuda:1 or the CPU, and for each
rank and collective the stream it writes its inputs on and launches from: its thread's
default stream or one of several streams of its own; and how it waits (``wait()`` or its
future). Every part of a collective must run after every rank's producer (a collective
that waits only for the last launching rank's stream reads the others' inputs unwritten), on
the one side stream of its device, and every rank's stream after ``wait()`` must come after
every part; CPU tensors have no stream order at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import event, given
from hypothesis import strategies as st

import fakepg
from fakepg import streams
from reducer.collectives import TensorSpec
from reducer.testing.harness import note_size

DEVICES = {"cuda:0": torch.device("cuda", 0), "cuda:1": torch.device("cuda", 1)}
DEVICES["cpu"] = torch.device("cpu")
CUDA0 = DEVICES["cuda:0"]
KINDS = ("allreduce", "broadcast", "allgather")


class SimStream:
    """A stream: ``before`` is every kernel that a kernel queued on it next comes after."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name, self.device = name, device
        self.before: set[str] = set()

    def wait_event(self, event: SimEvent) -> None:
        self.before |= event.before

    def __repr__(self) -> str:
        return self.name


class SimEvent:
    def __init__(self) -> None:
        self.before: set[str] = set()

    def record(self, stream: SimStream) -> None:
        self.before = set(stream.before)


@dataclass(frozen=True)
class Part:
    """A part of a collective, run with ``stream`` current on its device: a kernel that
    comes after ``before``."""

    kernel: str
    stream: SimStream
    before: frozenset[str]


class SimCuda:
    """``Event``, ``Stream``, ``current_stream`` and ``stream`` of ``torch.cuda``, with
    happens-before sets, for CUDA devices only (a CPU device is refused, as torch.cuda
    refuses it). A thread's default stream of a device is its own, kept for its lifetime;
    whatever runs inside ``stream(side)`` of the world's side stream is a kernel: it
    records what it comes after (``parts``) and joins the stream's set when it ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards parts, _defaults and the kernel counter
        self._local = threading.local()
        self._defaults: dict[tuple[int, torch.device], SimStream] = {}
        self._kernels = itertools.count()
        self.parts: list[Part] = []

    @staticmethod
    def _cuda(device: object) -> torch.device:
        assert isinstance(device, torch.device) and device.type == "cuda", device
        return device

    def Event(self) -> SimEvent:
        return SimEvent()

    def Stream(self, device: torch.device) -> SimStream:
        return SimStream(f"side@{self._cuda(device)}", device)

    def _current(self) -> dict[torch.device, SimStream]:
        current: dict[torch.device, SimStream] = vars(self._local).setdefault("current", {})
        return current

    def current_stream(self, device: torch.device) -> SimStream:
        stream = self._current().get(self._cuda(device))
        if stream is not None:
            return stream
        key = (threading.get_ident(), device)
        with self._lock:
            if key not in self._defaults:
                name = f"{threading.current_thread().name}@{device}"
                self._defaults[key] = SimStream(name, device)
            return self._defaults[key]

    @contextmanager
    def stream(self, stream: SimStream) -> Iterator[None]:
        current = self._current()
        device = self._cuda(stream.device)
        before = current.get(device)
        current[device] = stream
        side = stream.name.startswith("side@")
        if side:
            with self._lock:
                kernel = f"part{next(self._kernels)}@{device}"
                self.parts.append(Part(kernel, stream, frozenset(stream.before)))
        try:
            yield
        finally:
            if side:
                with self._lock:
                    stream.before.add(kernel)
            if before is None:
                del current[device]
            else:
                current[device] = before


@contextmanager
def simulated_cuda(devices_of: Callable[[], tuple[torch.device, ...]]) -> Iterator[SimCuda]:
    """The world's stream order on a simulated CUDA API; the i-th tensor of a collective
    is taken to be on ``devices_of()[i]`` (the launching rank's current collective)."""
    api = SimCuda()
    saved = streams.cuda, streams.cuda_devices
    real = streams.cuda_devices  # the world's own rule, on the specs moved

    def moved(specs: Iterable[TensorSpec]) -> tuple[torch.device, ...]:
        devices = devices_of()
        return real([dataclasses.replace(s, device=devices[i]) for i, s in enumerate(list(specs))])

    streams.cuda = api
    streams.cuda_devices = moved
    try:
        yield api
    finally:
        streams.cuda, streams.cuda_devices = saved


@dataclass(frozen=True)
class StreamScenario:
    """Per collective in a row: its kind, the devices of its tensors (the same on every
    rank), and per rank the stream it writes and launches from (None: its thread's default
    stream; k: its own stream k of each device)."""

    world_size: int
    kinds: tuple[str, ...]
    devices: tuple[tuple[str, ...], ...]  # [collective][tensor]
    launching: tuple[tuple[int | None, ...], ...]  # [collective][rank]
    future: bool  # wait through the future rather than wait()


@st.composite
def stream_scenarios(draw: st.DrawFn) -> StreamScenario:
    """Two or three ranks, one or two collectives, each over tensors on cuda:0, cuda:1 or
    the CPU (one or two tensors; allgather one), the launching streams drawn per rank and
    collective from the default and three others (several ranks on different streams)."""
    world = draw(st.sampled_from([2, 3]))
    count = draw(st.integers(1, 2))
    kinds = tuple(draw(st.sampled_from(KINDS)) for _ in range(count))
    device = st.sampled_from(["cuda:0", "cuda:1", "cpu"])
    devices = tuple(
        tuple(draw(st.lists(device, min_size=1, max_size=1 if kind == "allgather" else 2)))
        for kind in kinds
    )
    choice = st.sampled_from([1, None, 2, 0])
    launching = tuple(tuple(draw(choice) for _ in range(world)) for _ in range(count))
    return StreamScenario(world, kinds, devices, launching, draw(st.booleans()))


def _launch(pg: fakepg.FakeProcessGroup, kind: str, xs: list[torch.Tensor]) -> Any:
    if kind == "allreduce":
        return pg.allreduce(xs)
    if kind == "broadcast":
        return pg.broadcast(xs, 0)
    outputs = [[torch.empty_like(x) for _ in range(pg.size())] for x in xs]
    return pg.allgather(outputs, xs)


def _cuda_of(names: tuple[str, ...]) -> list[torch.device]:
    """The CUDA devices among ``names``, each once, in order."""
    return [DEVICES[n] for n in dict.fromkeys(names) if n != "cpu"]


def check_stream_order(s: StreamScenario) -> None:
    """The property: each part of a collective on CUDA tensors, on each device's side
    stream, comes after every rank's producer of every input of it; each device has one
    side stream for the world (NCCL's one stream per communicator); after ``wait()`` each
    rank's stream of each device comes after every part on it; a collective on CPU
    tensors only runs no part on a side stream; and the values are right."""
    after_wait: dict[tuple[int, int], dict[torch.device, frozenset[str]]] = {}
    values: dict[tuple[int, int], float] = {}
    # After a wait of collective i returns, every part of it has run and none of i + 1 (this
    # rank has not launched it): the parts seen so far are those of collectives 0..i.
    boundaries: dict[tuple[int, int], int] = {}
    launching = threading.local()

    def devices_of() -> tuple[torch.device, ...]:
        return tuple(DEVICES[n] for n in s.devices[launching.index])

    with simulated_cuda(devices_of) as api:

        def rank_main(pg: fakepg.FakeProcessGroup) -> None:
            rank = pg.rank()
            for index, kind in enumerate(s.kinds):
                launching.index = index
                choice = s.launching[index][rank]
                cuda = _cuda_of(s.devices[index])
                xs = [torch.full((4,), float(rank + 1)) for _ in s.devices[index]]
                with contextlib.ExitStack() as stack:
                    if choice is not None:
                        for device in cuda:
                            own = SimStream(f"rank{rank}-s{choice}@{device}", device)
                            stack.enter_context(api.stream(own))
                    for device in cuda:  # the kernels writing the inputs on this device
                        api.current_stream(device).before.add(f"produce{index}-r{rank}@{device}")
                    work = _launch(pg, kind, xs)
                    if s.future:
                        work.get_future().wait()
                    else:
                        work.wait()
                    after_wait[index, rank] = {
                        d: frozenset(api.current_stream(d).before) for d in cuda
                    }
                    boundaries[index, rank] = len(api.parts)
                    values[index, rank] = float(xs[0][0])

        fakepg.run(rank_main, world_size=s.world_size, timeout=30.0)
    ends = [boundaries[i, 0] for i in range(len(s.kinds))]
    for i in range(len(s.kinds)):
        assert {boundaries[i, r] for r in range(s.world_size)} == {ends[i]}, boundaries
    starts = [0, *ends[:-1]]
    sides: dict[torch.device, set[int]] = {}
    for index, kind in enumerate(s.kinds):
        cuda = _cuda_of(s.devices[index])
        producers = {f"produce{index}-r{r}@{d}" for r in range(s.world_size) for d in cuda}
        parts = api.parts[starts[index] : ends[index]]
        if not cuda:
            assert not parts, f"collective {index} ({kind}) on the CPU ran on a side stream"
            continue
        assert {p.stream.device for p in parts} == set(cuda), (index, kind, parts)
        for part in parts:
            sides.setdefault(part.stream.device, set()).add(id(part.stream))
            missing = producers - part.before
            assert not missing, (
                f"collective {index} ({kind}): its {part.kernel} may run before "
                f"{sorted(missing)} (ranks launched from streams {s.launching[index]}: None is "
                "a thread's default)"
            )
        if s.future:  # the future completes on the rank's completion lane: its streams
            continue
        for rank in range(s.world_size):
            for device in cuda:
                kernels = {p.kernel for p in parts if p.stream.device == device}
                missing = kernels - after_wait[index, rank][device]
                assert not missing, f"rank {rank}, collective {index}: wait() misses {missing}"
    for device, ids in sides.items():
        assert len(ids) == 1, f"{len(ids)} side streams on {device}: one per device and world"
    for index, kind in enumerate(s.kinds):
        for rank in range(s.world_size):
            want = {
                # Every rank's every tensor (a rank's tensors are replicas).
                "allreduce": float(len(s.devices[index]) * sum(range(1, s.world_size + 1))),
                "broadcast": 1.0,
                "allgather": float(rank + 1),  # the input is left as it was
            }[kind]
            assert values[index, rank] == want, (index, kind, rank, values[index, rank])


@given(stream_scenarios())
def test_collectives_keep_the_stream_order_of_every_launching_rank(s: StreamScenario) -> None:
    note_size(0, s.world_size)
    event(f"{s.world_size} ranks, {len(s.kinds)} collective(s)")
    event(f"distinct launching streams: {len(set(s.launching[0]))}")
    event(f"devices of the first: {sorted(set(s.devices[0]))}")
    check_stream_order(s)


def test_the_simulated_api_is_what_the_world_uses() -> None:
    """The property's simulation stands in for torch.cuda inside the block only."""
    real = streams.cuda
    with simulated_cuda(lambda: (CUDA0,)) as api:
        assert streams.cuda is api
        assert streams.record_ready([TensorSpec(torch.float32, (1,), torch.strided, CUDA0)])
    assert streams.cuda is real
