"""The built-in comm hooks: allreduce, and the fp16/bf16 compression hooks and wrappers.

They mirror torch's ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``; their
``state`` is the process group to reduce over (None: the reducer's own; a ``torch.distributed``
group is wrapped in a :class:`reducer.TorchProcessGroup`). ``fp16_compress_wrapper`` /
``bf16_compress_wrapper`` run any hook on a low-precision copy of the buffer. Each issues its
collectives from the hook itself: see Note [Collectives of a hook are issued from the hook] in
reducer.comm_hook.
"""

from __future__ import annotations

import threading
import weakref

import torch
import torch.distributed as dist
from torch import Tensor

from reducer.comm_hook import CommHook, GradBucket, describe_value, future_of, hook_name
from reducer.errors import InvalidArgumentType, ReductionError
from reducer.process_group import ProcessGroup, ReduceOp
from reducer.torch_backend import TorchProcessGroup

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
                    f"{bucket.index()} that completed with {describe_value(value)}, not the "
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
