"""Whether a rank's tensors are still as it issued them when the collective moves its data.

# Note [A tensor changed in flight]
# A collective's kernels read and write the tensors each rank handed in, later, on another
# thread: the last rank's, a worker's, a decision's. A rank that resizes one of them, frees
# its storage (``t.untyped_storage().resize_(0)``, as FSDP-style code does), or swaps its
# memory (``t.data = ...``, a reallocation) before its work completes has a race that a real
# backend turns into wrong numbers or a crash. Here the kernels' NumPy views would read freed
# memory (garbage, or a segfault), and a shrunk tensor would be reduced in part, silently. So
# each rank's tensors are recorded as issued (shape, data pointer) and looked at once more
# just before the data moves (the same shape, a storage that still holds every byte the view
# reaches, the same memory); a change fails the collective on every rank with
# :class:`fakepg.TensorChanged`, naming the rank, the tensor and what changed.
# The window between that look and the kernels is the user's own race, as on a real backend;
# the look closes the common case: a change made before the last rank joined.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__: list[str] = []


class Issued(NamedTuple):
    """One tensor as its rank issued it (a tuple: one is made per tensor per collective)."""

    tensor: Tensor
    shape: torch.Size
    data_ptr: int


def _tensors(payload: Any, into: list[Tensor]) -> list[Tensor]:
    """The tensors of a payload (tensors in nested tuples and lists), in order."""
    if isinstance(payload, Tensor):
        into.append(payload)
    elif isinstance(payload, (list, tuple)):
        for item in payload:
            _tensors(item, into)
    return into


def _span_bytes(t: Tensor) -> int:
    """How many bytes of its storage a non-empty ``t`` reaches into, from the storage's start."""
    if t.is_contiguous():
        last = t.storage_offset() + t.numel() - 1
    else:
        last = t.storage_offset() + sum((t.size(d) - 1) * t.stride(d) for d in range(t.dim()))
    return int((last + 1) * t.element_size())


def snapshot(payload: Any) -> tuple[Issued, ...]:
    """The strided tensors of ``payload`` as they are now (sparse ones have no one storage)."""
    return tuple(
        Issued(t, t.shape, t.data_ptr()) for t in _tensors(payload, []) if t.layout == torch.strided
    )


def _intact(t: Tensor, was: Issued) -> bool:
    """The common case, checked first and fast: nothing changed."""
    return (
        t.shape == was.shape
        and t.data_ptr() == was.data_ptr
        and (t.numel() == 0 or t.untyped_storage().nbytes() >= _span_bytes(t))
    )


def first_change(issued: dict[int, tuple[Issued, ...]]) -> str | None:
    """What changed first (ranks in order) since the tensors were issued, or None."""
    for rank in sorted(issued):
        for index, was in enumerate(issued[rank]):
            t = was.tensor
            if _intact(t, was):
                continue
            whose = f"rank {rank}'s tensor {index} ({t.dtype}, issued with shape {list(was.shape)})"
            if t.shape != was.shape:
                how = f"was resized to {list(t.shape)}"
            elif t.numel() == 0:
                continue  # no bytes to move: its storage may come and go
            elif (held := t.untyped_storage().nbytes()) < (span := _span_bytes(t)):
                how = f"had its storage freed or shrunk ({held} bytes left of the {span} it spans)"
            else:  # the same shape, every byte held: not where it was
                how = "had its memory replaced (its storage reallocated, or .data swapped)"
            return (
                f"{whose} {how} while the collective was in flight. A collective's tensors "
                "must stay as issued until its work completes: wait() on the work (or its "
                "future) before resizing, freeing or replacing them."
            )
    return None
