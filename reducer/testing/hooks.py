"""Comm hooks the properties draw, each with the exact result it gives on the fake world.

A comm hook replaces a bucket's allreduce (``register_comm_hook``); the reducer hands it the
bucket's gradients, flat and not divided, and writes what its future returns into ``.grad``.
On the fake world the sum is taken in ascending rank order (DESIGN.md), so each hook's result
is exactly predictable; ``AVERAGES[name]`` computes it from plain autograd's per-rank
gradients with the hook's own ops, in its order:

- ``allreduce``: :func:`reducer.allreduce_hook`, the buffer divided in place, then summed:
  ``sum_r (g_r / W)``, the reducer's own average.
- ``new tensor``: divides into a *new* tensor, reduces that and returns it, while the bucket
  keeps its undivided local gradients: ``sum_r (g_r / W)`` again, but only if the reducer
  takes the returned tensor, not the bucket.
- ``divide itself``: sums the undivided buffer in place, then divides the sum in a ``then``
  callback: ``(sum_r g_r) / W`` (other bits than the prescaled sum where W is not a power
  of two, and a different value if anything divides the bucket before the hook).
- ``fp16``, ``bf16``: :func:`reducer.fp16_compress_hook` / :func:`reducer.bf16_compress_hook`:
  each ``g_r`` cast to the half type and divided there, summed in the half type, cast back.
- ``fp16 wrapper``, ``bf16 wrapper``: :func:`reducer.fp16_compress_wrapper` /
  :func:`reducer.bf16_compress_wrapper` around :func:`reducer.allreduce_hook`: the same bits
  as ``fp16`` / ``bf16`` (the wrapper compresses before the wrapped hook divides and sums).

Hooks take one replica per process and dense gradients; the strategies draw them only there.
The custom hooks take the process group as their ``state`` (:func:`state_for`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

import reducer

from .reference import rank_order_average

__all__ = ["AVERAGES", "HOOKS", "HOOK_NAMES", "state_for"]

Column = Sequence[Tensor | None]  # one parameter's gradient per contribution, rank order


def _new_tensor_hook(
    pg: reducer.ProcessGroup, bucket: reducer.GradBucket
) -> torch.futures.Future[Tensor]:
    tensor = bucket.buffer() / pg.size()  # a new tensor: the bucket keeps its contents
    future: torch.futures.Future[list[Tensor]] = pg.allreduce([tensor]).get_future()  # type: ignore[attr-defined]
    return future.then(lambda f: f.value()[0])


def _divide_itself_hook(
    pg: reducer.ProcessGroup, bucket: reducer.GradBucket
) -> torch.futures.Future[Tensor]:
    future: torch.futures.Future[list[Tensor]] = pg.allreduce([bucket.buffer()]).get_future()  # type: ignore[attr-defined]
    return future.then(lambda f: f.value()[0].div_(pg.size()))


def _fp16_wrapper_hook(state: object, bucket: reducer.GradBucket) -> torch.futures.Future[Tensor]:
    # The wrapper is built at each call, so that it is the one ``reducer`` holds now.
    return reducer.fp16_compress_wrapper(reducer.allreduce_hook)(state, bucket)


def _bf16_wrapper_hook(state: object, bucket: reducer.GradBucket) -> torch.futures.Future[Tensor]:
    return reducer.bf16_compress_wrapper(reducer.allreduce_hook)(state, bucket)


HOOKS: dict[str, reducer.CommHook] = {
    "allreduce": reducer.allreduce_hook,
    "new tensor": _new_tensor_hook,  # type: ignore[dict-item]
    "divide itself": _divide_itself_hook,  # type: ignore[dict-item]
    "fp16": reducer.fp16_compress_hook,
    "bf16": reducer.bf16_compress_hook,
    "fp16 wrapper": _fp16_wrapper_hook,
    "bf16 wrapper": _bf16_wrapper_hook,
}
HOOK_NAMES = tuple(HOOKS)


def state_for(name: str, pg: reducer.ProcessGroup) -> object:
    """The ``state`` to register hook ``name`` with: the built-in hooks take None (the
    reducer's own group), the custom ones the group itself."""
    return pg if name in ("new tensor", "divide itself") else None


def _terms(column: Column) -> tuple[list[Tensor], Tensor] | None:
    if all(g is None for g in column):
        return None
    like = next(g for g in column if g is not None)
    return [torch.zeros_like(like) if g is None else g for g in column], like


def _sum_then_divide(column: Column, world_size: int) -> Tensor | None:
    found = _terms(column)
    if found is None:
        return None
    terms, _ = found
    acc = terms[0].clone()
    for g in terms[1:]:
        acc = acc + g
    return acc.div_(world_size)


def _compressed(dtype: torch.dtype) -> Callable[[Column, int], Tensor | None]:
    def average(column: Column, world_size: int) -> Tensor | None:
        found = _terms(column)
        if found is None:
            return None
        terms, like = found
        # The hook's ops: buffer.to(half).div_(W), summed in the half type, copied back.
        halves = [g.to(dtype).div_(world_size) for g in terms]
        acc = halves[0]
        for h in halves[1:]:
            acc = acc + h
        return acc.to(like.dtype)

    return average


AVERAGES: dict[str, Callable[[Column, int], Tensor | None]] = {
    "allreduce": rank_order_average,
    "new tensor": rank_order_average,
    "divide itself": _sum_then_divide,
    "fp16": _compressed(torch.float16),
    "bf16": _compressed(torch.bfloat16),
    "fp16 wrapper": _compressed(torch.float16),
    "bf16 wrapper": _compressed(torch.bfloat16),
}
