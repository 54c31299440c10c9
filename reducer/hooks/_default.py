"""Communication hooks: replace a bucket's allreduce with any future-returning reduction.

A hook is ``hook(state, bucket) -> torch.futures.Future[Tensor]``. It receives a
:class:`GradBucket` whose buffer holds the bucket's gradients, flat and *not* divided by the
world size, and returns a future of the reduced buffer (the average). The reducer waits for it
in finalize and writes the result into ``.grad``. The built-in hooks mirror torch's
``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``; their ``state`` is the process
group to reduce over (None: the reducer's own; a ``torch.distributed`` group is wrapped in a
:class:`reducer.TorchProcessGroup`). ``fp16_compress_wrapper`` / ``bf16_compress_wrapper`` run
any hook on a low-precision copy of the buffer. PowerSGD and post-local SGD live in
``reducer._powersgd`` and ``reducer._post_local_sgd``.

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
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import Tensor

from .buckets import bucket_view
from .errors import InvalidArgumentType, ReductionError
from .process_group import ProcessGroup, ReduceOp, Work
from .torch_backend import TorchProcessGroup

if TYPE_CHECKING:
    from .buckets import BucketReplica

__all__ = [
    "CommHook",
    "GradBucket",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
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
            f"{self._bucket_index} that completed with {_describe_value(value)}, not a tensor. "
            "Its future must hold the reduced bucket buffer: end a then() chain with a callback "
            "that returns it, e.g. work.get_future().then(lambda fut: fut.value()[0]) (a "
            "callback without a return statement gives None)"
        )


def _describe_value(value: object) -> str:
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


# torch.distributed groups passed as a hook's state, each wrapped once.
_ADAPTERS: weakref.WeakKeyDictionary[dist.ProcessGroup, TorchProcessGroup] = (
    weakref.WeakKeyDictionary()
)
_ADAPTERS_LOCK = threading.Lock()


def as_process_group(group: object, what: str) -> ProcessGroup:
    """``group`` as a :class:`reducer.ProcessGroup`: a torch.distributed group is wrapped (once)
    in a :class:`reducer.TorchProcessGroup`; anything else must implement the protocol."""
    if isinstance(group, dist.ProcessGroup):
        with _ADAPTERS_LOCK:
            adapter = _ADAPTERS.get(group)
            if adapter is None:
                adapter = _ADAPTERS[group] = TorchProcessGroup(group)
        return adapter
    if not (callable(getattr(group, "allreduce", None)) and callable(getattr(group, "size", None))):
        raise ReductionError(
            f"{what} must be a process group (reducer.ProcessGroup or a torch.distributed "
            f"group) or None for the reducer's own, got {type(group).__name__}"
        )
    return group  # type: ignore[return-value]


def _group(state: object, bucket: GradBucket) -> ProcessGroup:
    if state is None:
        return bucket._process_group
    try:
        return as_process_group(state, "a built-in comm hook's state")
    except ReductionError:
        raise ReductionError(
            f"a built-in comm hook takes a process group (or None) as its state, got "
            f"{type(state).__name__}"
        ) from None


def allreduce_divided(group: ProcessGroup, tensor: Tensor) -> torch.futures.Future[Tensor]:
    """Divide ``tensor`` by the group size in place, allreduce it (SUM), and return a future
    of it: what the reducer does without a hook (torch's ``_allreduce_fut``)."""
    tensor.div_(group.size())
    return future_of(group.allreduce([tensor], ReduceOp.SUM)).then(lambda f: f.value()[0])


def allreduce_hook(state: object, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """Divide by the world size and allreduce: what the reducer does without a hook."""
    return allreduce_divided(_group(state, bucket), bucket.buffer())


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
fp16_compress_hook.__name__ = fp16_compress_hook.__qualname__ = "fp16_compress_hook"
fp16_compress_hook.__doc__ = """Allreduce in float16 (half the bytes), then back to the
buffer's dtype. Divides before the reduction, as torch's hook does, to avoid overflow."""

bf16_compress_hook = _compress_hook(torch.bfloat16)
bf16_compress_hook.__name__ = bf16_compress_hook.__qualname__ = "bf16_compress_hook"
bf16_compress_hook.__doc__ = """Allreduce in bfloat16 (half the bytes, float32's range), then
back to the buffer's dtype."""


def _compress_wrapper(dtype: torch.dtype, hook: CommHook, name: str) -> CommHook:
    if not callable(hook):
        raise InvalidArgumentType(
            f"{name} wraps a comm hook (a callable hook(state, bucket)), got {hook!r}"
        )

    def wrapper_hook(state: object, bucket: GradBucket) -> torch.futures.Future[Tensor]:
        original = bucket.buffer()
        bucket.set_buffer(original.to(dtype))
        future = hook(state, bucket)

        def decompress(done: torch.futures.Future[Tensor]) -> Tensor:
            value = done.value()
            if not isinstance(value, Tensor):
                raise ReductionError(
                    f"{name}: the wrapped hook {hook_name(hook)!r} returned a future for bucket "
                    f"{bucket.index()} that completed with {_describe_value(value)}, not the "
                    "reduced buffer (a tensor)"
                )
            # Back into the bucket's own buffer, in its dtype (in place: no second copy).
            original.copy_(value)
            bucket.set_buffer(original)
            return original

        return future.then(decompress)

    wrapper_hook.__name__ = wrapper_hook.__qualname__ = f"{name}_hook"
    wrapper_hook.__doc__ = f"{hook_name(hook)} on a {dtype} copy of the buffer, cast back."
    return wrapper_hook


def fp16_compress_wrapper(hook: CommHook) -> CommHook:
    """``hook`` run on a float16 copy of the bucket's buffer; its result is cast back into the
    buffer's dtype. ``fp16_compress_wrapper(allreduce_hook)`` is ``fp16_compress_hook`` (the
    same bits); ``fp16_compress_wrapper(powerSGD_hook)`` compresses PowerSGD's factors too."""
    return _compress_wrapper(torch.float16, hook, "fp16_compress_wrapper")


def bf16_compress_wrapper(hook: CommHook) -> CommHook:
    """``hook`` run on a bfloat16 copy of the bucket's buffer; its result is cast back into
    the buffer's dtype (see :func:`fp16_compress_wrapper`)."""
    return _compress_wrapper(torch.bfloat16, hook, "bf16_compress_wrapper")
