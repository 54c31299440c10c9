"""fakepg.streams: collectives on CUDA tensors keep NCCL's stream order (Note [Stream order of
a collective]). No GPU here: a fake CUDA API records, per thread, which stream waited for which
event and which stream was current when a collective's part ran; the world runs on CPU tensors
that it is told are on ``cuda:0``. On a GPU, tests/test_gpu.py checks the same with a producer
slow enough to be overtaken."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import fakepg
from fakepg import streams
from reducer.collectives import TensorSpec

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


class FakeStream:
    def __init__(self, api: FakeCuda, name: str) -> None:
        self.api, self.name = api, name

    def wait_event(self, event: FakeEvent) -> None:
        self.api.log("wait", self.name, event.name)

    def __repr__(self) -> str:
        return self.name


class FakeEvent:
    def __init__(self, api: FakeCuda, name: str) -> None:
        self.api, self.name = api, name

    def record(self, stream: FakeStream) -> None:
        self.api.log("record", stream.name, self.name)


class FakeCuda:
    """``Event``, ``Stream``, ``current_stream`` and ``stream`` of ``torch.cuda``, recorded as
    ``(thread name, what, stream, event)``. A thread's current stream is ``<thread>@<device>``
    until ``stream(s)`` makes it ``s``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self._lock = threading.Lock()
        self._current = threading.local()
        self._count = 0

    def log(self, *call: str) -> None:
        with self._lock:
            self.calls.append((threading.current_thread().name, *call))

    def _next(self, kind: str) -> str:
        with self._lock:
            self._count += 1
            return f"{kind}{self._count}"

    def Event(self) -> FakeEvent:
        return FakeEvent(self, self._next("event"))

    def Stream(self, device: torch.device) -> FakeStream:
        return FakeStream(self, f"side@{device}")

    def current_stream(self, device: torch.device) -> FakeStream:
        streams: dict[torch.device, FakeStream] = vars(self._current).setdefault("streams", {})
        default = FakeStream(self, f"{threading.current_thread().name}@{device}")
        return streams.get(device, default)

    @contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        streams: dict[torch.device, FakeStream] = vars(self._current).setdefault("streams", {})
        device = torch.device(stream.name.split("@")[1])
        before = streams.get(device)
        streams[device] = stream
        self.log("enter", stream.name, "")
        try:
            yield
        finally:
            self.log("exit", stream.name, "")
            if before is None:
                del streams[device]
            else:
                streams[device] = before


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    api = FakeCuda()
    monkeypatch.setattr(streams, "cuda", api)
    return api


def spec(device: torch.device) -> TensorSpec:
    return TensorSpec(torch.float32, (4,), torch.strided, device)


def test_the_cpu_records_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "cuda", None)  # any use would fail
    assert streams.record_ready([spec(torch.device("cpu"))] * 3) == []


def test_an_event_on_the_callers_current_stream_of_each_device(fake_cuda: FakeCuda) -> None:
    ready = streams.record_ready([spec(CUDA0), spec(CUDA1), spec(CUDA0)])
    assert [device for device, _ in ready] == [CUDA0, CUDA1]
    me = threading.current_thread().name
    assert fake_cuda.calls == [
        (me, "record", f"{me}@cuda:0", "event1"),
        (me, "record", f"{me}@cuda:1", "event2"),
    ]


def test_the_side_stream_waits_for_every_rank_runs_the_parts_and_is_waited_for(
    fake_cuda: FakeCuda,
) -> None:
    side = streams.SideStreams()
    ready = [(CUDA0, fake_cuda.Event()), (CUDA0, fake_cuda.Event())]  # two ranks
    order = streams.StreamOrder(side, ready)
    seen: list[str] = []
    part = order.wrap(lambda: seen.append(repr(fake_cuda.current_stream(CUDA0))))
    worker = threading.Thread(target=part, name="worker")
    worker.start()
    worker.join(5.0)
    order.record_done()
    order.wait_done()
    me = threading.current_thread().name
    assert seen == ["side@cuda:0"]
    assert fake_cuda.calls == [
        (me, "wait", "side@cuda:0", "event1"),
        (me, "wait", "side@cuda:0", "event2"),
        ("worker", "enter", "side@cuda:0", ""),
        ("worker", "exit", "side@cuda:0", ""),
        (me, "record", "side@cuda:0", "event3"),
        (me, "wait", f"{me}@cuda:0", "event3"),
    ]
    assert side.get(CUDA0) is side.get(CUDA0)  # one side stream per device


def on_cuda0(monkeypatch: pytest.MonkeyPatch) -> None:
    """The world's collectives take every tensor for one on cuda:0."""
    real = streams.cuda_devices
    monkeypatch.setattr(streams, "cuda_devices", lambda specs: real([spec(CUDA0) for _ in specs]))


@pytest.mark.parametrize("how", ["wait", "future"])
def test_a_world_allreduce_keeps_the_stream_order(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    on_cuda0(monkeypatch)
    got: dict[int, list[float]] = {}

    def rank_main(pg: fakepg.FakeProcessGroup) -> None:
        rank = pg.rank()
        x = torch.full((4,), float(rank + 1))
        work = pg.allreduce([x])
        if how == "wait":
            work.wait()
        else:
            work.get_future().wait()
        got[rank] = x.tolist()

    fakepg.run(rank_main, world_size=3, timeout=30.0)
    assert got == {r: [6.0] * 4 for r in range(3)}
    calls = fake_cuda.calls
    ready = {c[3]: i for i, c in enumerate(calls) if c[1] == "record" and "side" not in c[2]}
    assert len(ready) == 3  # one per rank, on its own thread's stream
    side_waits = [i for i, c in enumerate(calls) if c[1:3] == ("wait", "side@cuda:0")]
    assert sorted(calls[i][3] for i in side_waits) == sorted(ready)
    parts = [i for i, c in enumerate(calls) if c[1] == "enter"]
    done = [i for i, c in enumerate(calls) if c[1:3] == ("record", "side@cuda:0")]
    assert parts and len(done) == 1
    assert max(side_waits) < min(parts)  # every rank's input before any kernel
    last_exit = max(i for i, c in enumerate(calls) if c[1] == "exit")
    assert last_exit < done[0]  # done after every part queued its kernels
    done_event = calls[done[0]][3]
    waited = [c for c in calls if c[1] == "wait" and c[3] == done_event]
    assert len(waited) == 3  # each rank's (or its completion lane's) current stream
    assert all("side" not in c[2] for c in waited)
