"""The forward's outputs: every tensor in them, and the sink that watches their gradients.

See Note [Outputs not used in the loss] in reducer.ddp._wrapper.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch import Tensor

from reducer.reducer import Reducer

__all__: list[str] = []


def find_tensors(obj: Any) -> list[Tensor]:
    """Every tensor in ``obj``: nested tuples, lists, dicts and dataclasses, in order."""
    found: list[Tensor] = []
    seen: set[int] = set()

    def walk(o: Any) -> None:
        if isinstance(o, Tensor):
            if id(o) not in seen:
                seen.add(id(o))
                found.append(o)
        elif isinstance(o, list | tuple):
            for item in o:
                walk(item)
        elif isinstance(o, dict):
            for item in o.values():
                walk(item)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            for f in dataclasses.fields(o):
                walk(getattr(o, f.name))

    walk(obj)
    return found


def replace_tensors(obj: Any, replacement: dict[int, Tensor]) -> Any:
    """``obj`` with each tensor whose id is in ``replacement`` swapped, structure kept."""
    if isinstance(obj, Tensor):
        return replacement.get(id(obj), obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(replace_tensors(o, replacement) for o in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(replace_tensors(o, replacement) for o in obj)
    if isinstance(obj, dict):
        items = {k: replace_tensors(v, replacement) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:
            return items
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: replace_tensors(getattr(obj, f.name), replacement)
                   for f in dataclasses.fields(obj) if f.init}  # fmt: skip
        return dataclasses.replace(obj, **changes)
    return obj


class OutputSink(torch.autograd.Function):
    """Identity on the outputs, whose backward runs when the outermost backward starts.

    It tells the reducer which outputs got no gradient (see Note [Outputs not used in the
    loss]) and, in the first static-graph iteration (``recording``), queues the reduction on
    the outermost backward (see Note [Static graph] in reducer.static_graph).
    """

    @staticmethod
    def forward(
        ctx: Any,
        reducer_ref: weakref.ReferenceType[Reducer],
        recording: bool,
        clone: bool,
        *outputs: Tensor,
    ) -> Any:
        ctx.reducer_ref = reducer_ref
        ctx.recording = recording
        ctx.set_materialize_grads(False)  # an output the loss did not use gets None
        ctx.save_for_backward(*outputs)
        # New tensors, each an output of the sink: clones (torch's default), so that the loss
        # may be modified in place; or views, without the copies (_set_ddp_sink_clone(False)).
        return tuple(o.clone() if clone else o.view_as(o) for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> Any:
        outputs = ctx.saved_tensors
        reducer = ctx.reducer_ref()
        if reducer is not None:
            if any(g is None for g in grads):
                with_grad = [o for o, g in zip(outputs, grads, strict=True) if g is not None]
                without = [o for o, g in zip(outputs, grads, strict=True) if g is None]
                reducer._expect_no_gradient(with_grad, without)
            if ctx.recording:
                reducer._queue_recorded_finalize()
        return (None, None, None, *grads)
