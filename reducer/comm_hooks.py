"""Communication hooks: replace a bucket's allreduce with any future-returning reduction.

A hook is ``hook(state, bucket) -> torch.futures.Future[Tensor]``. It receives a
:class:`GradBucket` whose buffer holds the bucket's gradients, flat and *not* divided by the
world size, and returns a future of the reduced buffer (the average). The reducer waits for it
in finalize and writes the result into ``.grad``. The built-in hooks mirror torch's
``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``; their ``state`` is the process
group to reduce over (None: the reducer's own).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .errors import ReductionError
from .process_group import ProcessGroup, ReduceOp, Work

if TYPE_CHECKING:
    from .buckets import BucketReplica

__all__ = [
    "CommHook",
    "GradBucket",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
]

CommHook = Callable[[object, "GradBucket"], "torch.futures.Future[Tensor]"]


class GradBucket:
    """One bucket as a comm hook sees it (the names of torch's ``dist.GradBucket``)."""

    def __init__(
        self,
        index: int,
        replica: BucketReplica,
        *,
        is_last: bool,
        process_group: ProcessGroup,
    ) -> None:
        self._index = index
        self._replica = replica
        self._is_last = is_last
        self._process_group = process_group

    def index(self) -> int:
        """The bucket's index; bucket 0 is reduced first."""
        return self._index

    def buffer(self) -> Tensor:
        """The flat tensor of the bucket's gradients (the sparse gradient, in a sparse bucket)."""
        return self._replica.contents

    def set_buffer(self, tensor: Tensor) -> None:
        """Replace the buffer's contents with ``tensor`` (same shape and dtype)."""
        contents = self._replica.contents
        if tensor.shape != contents.shape or tensor.dtype != contents.dtype:
            raise ReductionError(
                f"GradBucket.set_buffer: bucket {self._index} holds {contents.dtype} "
                f"{tuple(contents.shape)}, got {tensor.dtype} {tuple(tensor.shape)}"
            )
        contents.copy_(tensor)

    def is_last(self) -> bool:
        """True for the last bucket to be reduced in an iteration."""
        return self._is_last

    def parameters(self) -> list[Tensor]:
        """The parameters whose gradients are in this bucket, in buffer order."""
        return list(self._replica.variables)

    def gradients(self) -> list[Tensor]:
        """Each parameter's gradient as a view into the buffer, shaped like the parameter."""
        if not self._replica.views:
            return [self._replica.contents]
        return list(self._replica.views)

    def __repr__(self) -> str:
        return f"<reducer.GradBucket {self._index} of {len(self._replica.variables)} parameters>"


class FutureWork:
    """A comm hook's future seen as a :class:`reducer.Work`, with a bounded wait."""

    def __init__(self, future: torch.futures.Future[Tensor], bucket_index: int, timeout: float):
        self._future = future
        self._bucket_index = bucket_index
        self._timeout = timeout
        self._done = threading.Event()
        future.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: float | None = None) -> None:
        limit = self._timeout if timeout is None else timeout
        if not self._done.wait(limit):
            raise ReductionError(
                f"the comm hook's future for bucket {self._bucket_index} did not complete "
                f"within {limit:g} s; a peer may have skipped the collective, or the hook "
                "returned a future that nothing completes"
            )
        try:
            self._future.wait()  # raises the hook's error, if it failed
        except Exception as exc:
            raise ReductionError(
                f"the comm hook's future for bucket {self._bucket_index} failed: "
                f"{type(exc).__name__}: {exc}. Its collective failed (look for the first "
                "failing rank), or a callback chained with then() raised"
            ) from exc

    def is_completed(self) -> bool:
        return bool(self._future.done())

    def result(self) -> list[Tensor]:
        value = self._future.value()
        return [value] if isinstance(value, Tensor) else list(value)


def future_of(work: Work) -> torch.futures.Future[list[Tensor]]:
    """The work's torch future; for a Work without ``get_future``, one completed by waiting.

    The fake world and :class:`reducer.TorchProcessGroup` give real futures, which keep the
    overlap; for another protocol implementation this waits here, still correct.
    """
    get_future = getattr(work, "get_future", None)
    if callable(get_future):
        future: torch.futures.Future[list[Tensor]] = get_future()
        return future
    work.wait()
    done: torch.futures.Future[list[Tensor]] = torch.futures.Future()
    done.set_result(work.result())
    return done


def _group(state: object, bucket: GradBucket) -> ProcessGroup:
    if state is None:
        return bucket._process_group
    if not callable(getattr(state, "allreduce", None)):
        raise ReductionError(
            f"a built-in comm hook takes a process group (or None) as its state, got "
            f"{type(state).__name__}"
        )
    return state  # type: ignore[return-value]


def allreduce_hook(state: object, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """Divide by the world size and allreduce: what the reducer does without a hook."""
    group = _group(state, bucket)
    buffer = bucket.buffer()
    buffer.div_(group.size())
    return future_of(group.allreduce([buffer], ReduceOp.SUM)).then(lambda f: f.value()[0])


def _compress_hook(dtype: torch.dtype) -> CommHook:
    def hook(state: object, bucket: GradBucket) -> torch.futures.Future[Tensor]:
        group = _group(state, bucket)
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(group.size())
        work = group.allreduce([compressed], ReduceOp.SUM)

        def decompress(future: torch.futures.Future[list[Tensor]]) -> Tensor:
            buffer.copy_(future.value()[0])
            return buffer

        return future_of(work).then(decompress)

    return hook


fp16_compress_hook = _compress_hook(torch.float16)
fp16_compress_hook.__name__ = "fp16_compress_hook"
fp16_compress_hook.__doc__ = """Allreduce in float16 (half the bytes), then back to the
buffer's dtype. Divides before the reduction, as torch's hook does, to avoid overflow."""

bf16_compress_hook = _compress_hook(torch.bfloat16)
bf16_compress_hook.__name__ = "bf16_compress_hook"
bf16_compress_hook.__doc__ = """Allreduce in bfloat16 (half the bytes, float32's range), then
back to the buffer's dtype."""
