"""Property 12: the fake world keeps NCCL's stream order, whoever issues from which stream.

A collective on CUDA tensors must read every rank's input after the kernels that wrote it,
whatever stream each rank wrote and issued it from, and whatever a rank queues after
``wait()`` must read the result (see Note [Stream order of a collective] in fakepg.streams).
No GPU here: a simulated CUDA API keeps, per stream, the set of kernels that anything queued
next on it comes after (its happens-before set); an event records a stream's set, a stream
that waits for an event takes the event's set in. The world runs on CPU tensors it is told
are on ``cuda:0``.

Drawn: two or three ranks (one is no order at all), one or two collectives in a row
(allreduce, broadcast, allgather), and for each rank and collective the stream it writes its
input on and issues from: its thread's default stream or one of several side streams of its
own; and how it waits (``wait()`` or its future). Every part of a collective must run after
every rank's producer (a collective that waits only for the last issuing rank's stream
reads the others' inputs unwritten), and every rank's stream after ``wait()`` must come
after every part.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
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

CUDA0 = torch.device("cuda", 0)
KINDS = ("allreduce", "broadcast", "allgather")


class SimStream:
    """A stream: ``before`` is every kernel that a kernel queued on it next comes after."""

    def __init__(self, name: str) -> None:
        self.name = name
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


class SimCuda:
    """``Event``, ``Stream``, ``current_stream`` and ``stream`` of ``torch.cuda``, with
    happens-before sets. A thread's default stream is its own, kept for its lifetime; a
    part of a collective run inside ``stream(side)`` is a kernel: it records what it comes
    after (``parts``) and joins the stream's set when it ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards parts, _defaults and the kernel counter
        self._local = threading.local()
        self._defaults: dict[int, SimStream] = {}
        self._kernels = itertools.count()
        self.parts: list[tuple[str, frozenset[str]]] = []  # (kernel, what it comes after)

    def Event(self) -> SimEvent:
        return SimEvent()

    def Stream(self, device: torch.device) -> SimStream:
        return SimStream(f"side@{device}")

    def _current(self) -> dict[torch.device, SimStream]:
        current: dict[torch.device, SimStream] = vars(self._local).setdefault("current", {})
        return current

    def current_stream(self, device: torch.device) -> SimStream:
        stream = self._current().get(device)
        if stream is not None:
            return stream
        ident = threading.get_ident()
        with self._lock:
            if ident not in self._defaults:
                name = f"{threading.current_thread().name}@{device}"
                self._defaults[ident] = SimStream(name)
            return self._defaults[ident]

    @contextmanager
    def stream(self, stream: SimStream) -> Iterator[None]:
        current = self._current()
        before = current.get(CUDA0)
        current[CUDA0] = stream
        side = stream.name.startswith("side@")
        if side:
            with self._lock:
                kernel = f"part{next(self._kernels)}"
                self.parts.append((kernel, frozenset(stream.before)))
        try:
            yield
        finally:
            if side:
                with self._lock:
                    stream.before.add(kernel)
            if before is None:
                del current[CUDA0]
            else:
                current[CUDA0] = before


@contextmanager
def simulated_cuda() -> Iterator[SimCuda]:
    """The world's stream order on a simulated CUDA API, every tensor taken for cuda:0."""
    api = SimCuda()
    saved = streams.cuda, streams.cuda_devices
    streams.cuda = api
    streams.cuda_devices = lambda specs: (CUDA0,) if list(specs) else ()
    try:
        yield api
    finally:
        streams.cuda, streams.cuda_devices = saved


@dataclass(frozen=True)
class StreamScenario:
    """Per collective in a row: its kind, and per rank the stream it writes and issues
    from (None: its thread's default stream; k: its own side stream k)."""

    world_size: int
    kinds: tuple[str, ...]
    issuing: tuple[tuple[int | None, ...], ...]  # [collective][rank]
    future: bool  # wait through the future rather than wait()


@st.composite
def stream_scenarios(draw: st.DrawFn) -> StreamScenario:
    """Two or three ranks, one or two collectives, the issuing streams drawn per rank and
    collective from the default and three others (several ranks on different streams)."""
    world = draw(st.sampled_from([2, 3]))
    count = draw(st.integers(1, 2))
    kinds = tuple(draw(st.sampled_from(KINDS)) for _ in range(count))
    choice = st.sampled_from([1, None, 2, 0])
    issuing = tuple(tuple(draw(choice) for _ in range(world)) for _ in range(count))
    return StreamScenario(world, kinds, issuing, draw(st.booleans()))


def _issue(pg: fakepg.FakeProcessGroup, kind: str, x: torch.Tensor) -> Any:
    if kind == "allreduce":
        return pg.allreduce([x])
    if kind == "broadcast":
        return pg.broadcast([x], 0)
    outputs = [[torch.empty_like(x) for _ in range(pg.size())]]
    return pg.allgather(outputs, [x])


def check_stream_order(s: StreamScenario) -> None:
    """The property: each part of each collective comes after every rank's producer of
    that collective's input, and each rank's stream after its wait comes after every part
    of it; and the values are right."""
    after_wait: dict[tuple[int, int], frozenset[str]] = {}
    values: dict[tuple[int, int], float] = {}
    # After a wait of collective i returns, every part of it has run and none of i + 1 (this
    # rank has not issued it): the parts seen so far are those of collectives 0..i.
    boundaries: dict[tuple[int, int], int] = {}
    with simulated_cuda() as api:

        def rank_main(pg: fakepg.FakeProcessGroup) -> None:
            rank = pg.rank()
            own = [SimStream(f"rank{rank}-s{k}") for k in range(3)]
            for index, kind in enumerate(s.kinds):
                choice = s.issuing[index][rank]
                x = torch.full((4,), float(rank + 1))
                with api.stream(own[choice]) if choice is not None else _default():
                    stream = api.current_stream(CUDA0)
                    stream.before.add(f"produce{index}-rank{rank}")  # the kernel writing x
                    work = _issue(pg, kind, x)
                    if s.future:
                        work.get_future().wait()
                    else:
                        work.wait()
                    after_wait[index, rank] = frozenset(api.current_stream(CUDA0).before)
                    boundaries[index, rank] = len(api.parts)
                    values[index, rank] = float(x[0])

        fakepg.run(rank_main, world_size=s.world_size, timeout=30.0)
    ends = [boundaries[i, 0] for i in range(len(s.kinds))]
    for i in range(len(s.kinds)):
        assert {boundaries[i, r] for r in range(s.world_size)} == {ends[i]}, boundaries
    starts = [0, *ends[:-1]]
    for index, kind in enumerate(s.kinds):
        producers = {f"produce{index}-rank{r}" for r in range(s.world_size)}
        parts = api.parts[starts[index] : ends[index]]
        assert parts, f"collective {index} ({kind}) ran no part on the side stream"
        for kernel, before in parts:
            missing = producers - before
            assert not missing, (
                f"collective {index} ({kind}): its {kernel} may run before {sorted(missing)} "
                f"(ranks issued from streams {s.issuing[index]}: None is a thread's default)"
            )
        if s.future:  # the future completes on the rank's completion lane: its stream
            continue
        kernels = {kernel for kernel, _ in parts}
        for rank in range(s.world_size):
            missing = kernels - after_wait[index, rank]
            assert not missing, f"rank {rank}, collective {index}: wait() misses {missing}"
    for index, kind in enumerate(s.kinds):
        for rank in range(s.world_size):
            want = {
                "allreduce": float(sum(range(1, s.world_size + 1))),
                "broadcast": 1.0,
                "allgather": float(rank + 1),  # the input is left as it was
            }[kind]
            assert values[index, rank] == want, (index, kind, rank, values[index, rank])


@contextmanager
def _default() -> Iterator[None]:
    yield


@given(stream_scenarios())
def test_collectives_keep_the_stream_order_of_every_issuing_rank(s: StreamScenario) -> None:
    note_size(0, s.world_size)
    event(f"{s.world_size} ranks, {len(s.kinds)} collective(s)")
    event(f"distinct issuing streams: {len({c for c in s.issuing[0]})}")
    check_stream_order(s)


def test_the_simulated_api_is_what_the_world_uses() -> None:
    """The property's simulation stands in for torch.cuda inside the block only."""
    real = streams.cuda
    with simulated_cuda() as api:
        assert streams.cuda is api
        assert streams.record_ready([TensorSpec(torch.float32, (1,), torch.strided, CUDA0)])
    assert streams.cuda is real
