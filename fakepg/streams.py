"""CUDA stream order for the fake world's collectives, as NCCL keeps it (CUDA tensors only).

A rank thread issues a collective while the GPU may still be writing its input: the kernels
that produce it are queued on the thread's current CUDA stream, and the host runs ahead. The
world's kernels run on its worker threads, whose current stream is another one. NCCL orders
this with events, and so does the fake world (see Note [Stream order of a collective]).
On the CPU nothing here runs: a collective whose tensors are all on the CPU has no events.

# Guarantees: record_ready() runs on the issuing rank's thread; StreamOrder is created by the
# thread that completes the collective's membership, its parts run on worker threads (or
# inline under a controlled schedule), record_done() runs once, on the thread that ends the
# last part, before the collective is marked done, and wait_done() on any thread after that.
# SideStreams is safe from any thread (its lock guards the dict of streams).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from contextlib import ExitStack
from typing import Any

import torch

from reducer.collectives import TensorSpec

__all__: list[str] = []

# Note [Stream order of a collective]
# 1. Issue (rank thread): an event is recorded on the caller's current stream of each CUDA
#    device the collective's tensors are on (record_ready): it marks "the input is written".
# 2. Start (when the last rank joins): the world's side stream of each such device waits for
#    every rank's events; the collective's parts run with those side streams current, so
#    every kernel they queue comes after every rank's producer (NCCL: its stream waits on the
#    caller's stream).
# 3. End: after the last part has queued its kernels, a done event is recorded on each side
#    stream (record_done).
# 4. Work.wait() (and a future's completion, on the rank's completion lane) makes the
#    caller's current stream wait for the done events: the host does not wait for the GPU,
#    but whatever the caller queues next reads the result (NCCL's wait() does the same).
# One side stream per device and world, as NCCL has one per communicator: collectives in
# flight queue behind each other there, never ahead of their inputs. Not done (NCCL does it
# with recordStream): a caller that frees an input before waiting lets the allocator reuse
# its memory while the side stream may still read it; wait before freeing.

# The CUDA API used here; tests replace it with a fake that records the calls (no GPU).
cuda: Any = torch.cuda


def cuda_devices(specs: Iterable[TensorSpec]) -> tuple[torch.device, ...]:
    """The CUDA devices among ``specs`` (in first-seen order, each once)."""
    found: list[torch.device] = []
    for spec in specs:
        if spec.device.type == "cuda" and spec.device not in found:
            found.append(spec.device)
    return tuple(found)


def record_ready(specs: Sequence[TensorSpec]) -> list[tuple[torch.device, Any]]:
    """Step 1 of Note [Stream order of a collective]: ``(device, event)`` per CUDA device of
    ``specs``, the event recorded on this thread's current stream of it; empty on the CPU."""
    events = []
    for device in cuda_devices(specs):
        event = cuda.Event()
        event.record(cuda.current_stream(device))
        events.append((device, event))
    return events


class SideStreams:
    """The world's side stream per CUDA device, created at first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _streams
        self._streams: dict[torch.device, Any] = {}

    def get(self, device: torch.device) -> Any:
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = cuda.Stream(device=device)
            return stream


class StreamOrder:
    """Steps 2 to 4 of Note [Stream order of a collective] for one collective."""

    def __init__(self, side: SideStreams, ready: Sequence[tuple[torch.device, Any]]) -> None:
        """``ready``: every rank's ``record_ready``."""
        self._devices = tuple(dict.fromkeys(device for device, _ in ready))
        self._streams = [side.get(device) for device in self._devices]
        for stream in self._streams:
            for _, event in ready:
                stream.wait_event(event)
        self._done: list[Any] = []

    def wrap(self, task: Callable[[], None]) -> Callable[[], None]:
        """``task`` run with the side streams as this thread's current streams."""
        streams = self._streams

        def run() -> None:
            with ExitStack() as stack:
                for stream in streams:
                    stack.enter_context(cuda.stream(stream))
                task()

        return run

    def record_done(self) -> None:
        events = []
        for stream in self._streams:
            event = cuda.Event()
            event.record(stream)
            events.append(event)
        self._done = events

    def wait_done(self) -> None:
        """The calling thread's current stream of each device waits for the collective."""
        for device, event in zip(self._devices, self._done, strict=False):
            cuda.current_stream(device).wait_event(event)
