"""The comm hook protocol: what the reducer hands a hook and how it waits for the result.

A hook is ``hook(state, bucket) -> torch.futures.Future[Tensor]``. It receives a
:class:`GradBucket` whose buffer holds the bucket's gradients, flat and *not* divided by the
world size, and returns a future of the reduced buffer (the average). The reducer waits for it
(through :class:`FutureWork`, with a deadline) in finalize and writes the result into ``.grad``.
This is the core's side of the contract, as torch keeps ``GradBucket`` in c10d; the built-in
hooks (allreduce, fp16/bf16, PowerSGD, post-local SGD) live in :mod:`reducer.hooks`.

# Note [Collectives of a hook are issued from the hook]
# Collectives match across ranks by the order in which each rank issues them (see Note
# [Buckets launch in index order] in reducer.reducer). A hook runs when its bucket launches, on
# the thread that launches it, in bucket order; so collectives it issues there are issued in
# the same order on every rank. A collective issued later from a future's callback is not: the
# callback runs on whichever thread completes the future, when it does (on the fake world, a
# completion thread of the rank's own), so it can overtake the next bucket's collectives on
# one rank and not on another. So the built-in hooks issue every collective from the hook
# itself, waiting there for a result they need before the next one (PowerSGD's P before Q),
# and leave to callbacks only local arithmetic on results that have arrived.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from .buckets import bucket_view
from .errors import ReductionError
from .process_group import ProcessGroup, Work

if TYPE_CHECKING:
    from .buckets import BucketReplica

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
        self._buffer = replica.contents

    def index(self) -> int:
        """The bucket's index; bucket 0 is reduced first."""
        return self._index

    def buffer(self) -> Tensor:
        """The flat tensor of the bucket's gradients (the sparse gradient, in a sparse bucket),
        or what :meth:`set_buffer` put in its place."""
        return self._buffer

    def set_buffer(self, tensor: Tensor) -> None:
        """Make ``tensor`` the buffer that :meth:`buffer` and :meth:`gradients` show, as torch's
        ``GradBucket.set_buffer`` does: same shape, any dtype (compression wrappers pass a
        float16 copy). The reducer's own bucket is unchanged; the hook's result is what
        lands in ``.grad``."""
        current = self._buffer
        if not isinstance(tensor, Tensor) or tensor.shape != current.shape:
            got = (
                f"{tensor.dtype} {tuple(tensor.shape)}"
                if isinstance(tensor, Tensor)
                else type(tensor).__name__
            )
            raise ReductionError(
                f"GradBucket.set_buffer: bucket {self._index} holds {current.dtype} "
                f"{tuple(current.shape)}, got {got}; pass a tensor of the same shape (its "
                "dtype may differ, e.g. a float16 copy for compression)"
            )
        self._buffer = tensor

    def is_last(self) -> bool:
        """True for the last bucket to be reduced in an iteration."""
        return self._is_last

    def parameters(self) -> list[Tensor]:
        """The parameters whose gradients are in this bucket, in buffer order."""
        return list(self._replica.variables)

    def gradients(self) -> list[Tensor]:
        """Each parameter's gradient as a view into the buffer, shaped like the parameter.

        The view has the parameter's strides where the parameter is dense (a channels_last
        conv weight, a transposed weight), as the bucket lays the gradient out (see Note
        [Bucket views follow the parameter's strides] in reducer.buckets), whether the buffer
        is the bucket's own or one :meth:`set_buffer` put in its place (the fp16 and bf16
        wrappers do): every element is where the parameter's layout says. torch differs:
        its ``GradBucket.gradients()`` always views row-major (``buffer.narrow(...).view(
        sizes)``), so there a hook sees a channels_last gradient's elements in another order,
        and a hook that looks at gradients as matrices (PowerSGD) computes something else for
        such a parameter than here.
        """
        replica = self._replica
        if not replica.views:  # a sparse bucket: its one gradient is the buffer
            return [self._buffer]
        if self._buffer is replica.contents:
            return list(replica.views)
        return [
            bucket_view(self._buffer, offset, param)
            for offset, param in zip(replica.offsets, replica.variables, strict=True)
        ]

    def __repr__(self) -> str:
        return f"<reducer.GradBucket {self._index} of {len(self._replica.variables)} parameters>"


# What a hook's ``bucket`` parameter may be annotated with: ours, or torch's (hooks written for
# torch's DDP annotate ``dist.GradBucket``).
# (torch.distributed does not list GradBucket among its exports, hence getattr.)
GRAD_BUCKET_TYPES: tuple[type, ...] = (GradBucket, getattr(dist, "GradBucket"))  # noqa: B009


class FutureWork:
    """A comm hook's future seen as a :class:`reducer.Work`, with a bounded wait."""

    def __init__(
        self,
        future: torch.futures.Future[Tensor],
        bucket_index: int,
        timeout: float,
        hook_name: str = "comm hook",
    ) -> None:
        self._future = future
        self._bucket_index = bucket_index
        self._timeout = timeout
        self._hook_name = hook_name
        self._done = threading.Event()
        future.add_done_callback(lambda _: self._done.set())

    def wait(self, timeout: float | None = None) -> None:
        limit = self._timeout if timeout is None else timeout
        if not self._done.wait(limit):
            raise ReductionError(
                f"the comm hook {self._hook_name!r}'s future for bucket {self._bucket_index} "
                f"did not complete within {limit:g} s; a peer may have skipped the collective, "
                "or the hook returned a future that nothing completes"
            )
        try:
            self._future.wait()  # raises the hook's error, if it failed
        except Exception as exc:
            raise ReductionError(
                f"the comm hook {self._hook_name!r}'s future for bucket {self._bucket_index} "
                f"failed: {type(exc).__name__}: {exc}. Its collective failed (look for the "
                "first failing rank), or a callback chained with then() raised"
            ) from exc

    def is_completed(self) -> bool:
        return bool(self._future.done())

    def result(self) -> list[Tensor]:
        """The future's tensor (or list of tensors), checked: a callback that returns nothing
        leaves None, which must be reported, naming the hook and bucket."""
        value: object = self._future.value()
        if isinstance(value, Tensor):
            return [value]
        if isinstance(value, list | tuple) and value and all(isinstance(t, Tensor) for t in value):
            return list(value)
        raise ReductionError(
            f"the comm hook {self._hook_name!r} returned a future for bucket "
            f"{self._bucket_index} that completed with {describe_value(value)}, not a tensor. "
            "Its future must hold the reduced bucket buffer: end a then() chain with a callback "
            "that returns it, e.g. work.get_future().then(lambda fut: fut.value()[0]) (a "
            "callback without a return statement gives None)"
        )


def describe_value(value: object) -> str:
    """How errors describe what a future completed with, when it is not a tensor."""
    if value is None:
        return "None"
    if isinstance(value, list | tuple):
        return f"a {type(value).__name__} of {len(value)} item(s)"
    return f"a {type(value).__name__}"


def hook_name(hook: object) -> str:
    """How errors name a hook: its ``__name__`` (a wrapper's includes the wrapped hook's)."""
    name = getattr(hook, "__name__", None)
    return name if isinstance(name, str) else repr(hook)


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


def completed(value: Tensor) -> torch.futures.Future[Tensor]:
    """A future that already holds ``value``."""
    future: torch.futures.Future[Tensor] = torch.futures.Future()
    future.set_result(value)
    return future
