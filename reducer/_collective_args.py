"""Local validation of collective arguments, shared by every process group of the project.

The fake world (``fakepg``) and the torch.distributed adapter (:class:`TorchProcessGroup`)
accept the same arguments, apart from a few rules their backends dictate (see
:class:`CollectiveRules`). One implementation keeps their checks and messages from drifting
apart. A check raises from the call, on the rank that passed the bad argument, with the
implementation's own error class (a ``ValueError``), before any rank is involved.

``fakepg`` imports this module; it imports nothing from ``fakepg`` (dependencies point one way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .process_group import ReduceOp

__all__: list[str] = []

# The fields of a TensorSpec, in the order messages list them.
SPEC_FIELDS = ("dtype", "shape", "layout", "device")


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What may have to agree about tensors (across ranks, replicas, input and output):
    dtype, shape, layout, device."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: torch.layout
    device: torch.device

    @classmethod
    def of(cls, tensor: Tensor) -> TensorSpec:
        return cls(tensor.dtype, tuple(tensor.shape), tensor.layout, tensor.device)

    def differences(self, other: TensorSpec, fields: Sequence[str] = SPEC_FIELDS) -> list[str]:
        """Those of ``fields`` in which ``other`` differs from this spec."""
        return [f for f in fields if getattr(self, f) != getattr(other, f)]

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        text = f"{dtype}[{', '.join(str(s) for s in self.shape)}]"
        if self.layout != torch.strided:
            text += f" {str(self.layout).removeprefix('torch.')}"
        if self.device.type != "cpu":
            text += f" on {self.device}"
        return text


@dataclass(frozen=True, slots=True)
class CollectiveRules:
    """What one process-group implementation requires of collective arguments."""

    # Raised for every invalid argument: ValueError for fakepg, reducer.InvalidArgument (a
    # ValueError) for the torch adapter.
    error: type[ValueError]
    # Who needs contiguous tensors, as messages say it ("torch backends", "fakepg's kernels").
    name: str
    # TensorSpec fields in which every tensor of one allreduce must equal tensor 0. The torch
    # adapter leaves out the device: it combines replicas on several devices locally first.
    allreduce_match: tuple[str, ...]
    # TensorSpec fields in which every allgather output must equal its input.
    allgather_match: tuple[str, ...]
    # True: every tensor of every collective must be contiguous (torch hands the memory to its
    # C++ backends as is). False: only allreduce's (fakepg's kernels work on flat views;
    # allgather and broadcast copy into strided tensors as well).
    contiguous_everywhere: bool


def check_tensor_list(tensors: object, what: str, rules: CollectiveRules) -> list[Tensor]:
    """``tensors`` as a list, or ``rules.error`` saying what is wrong with it."""
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence):
        raise rules.error(
            f"{what} takes a list of tensors, got {type(tensors).__name__}; wrap a single "
            "tensor as [tensor]"
        )
    if not tensors:
        raise rules.error(f"{what} got an empty list of tensors; pass at least one tensor")
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise rules.error(f"{what}: element {i} is a {type(t).__name__}, not a tensor")
        if rules.contiguous_everywhere:
            _check_contiguous(t, i, what, rules)
    return list(tensors)


def check_allreduce(tensors: object, op: object, rules: CollectiveRules) -> list[Tensor]:
    """Validate one rank's allreduce arguments; every tensor must match the first one in
    ``rules.allreduce_match``."""
    if not isinstance(op, ReduceOp):
        raise rules.error(f"allreduce: op must be a reducer.ReduceOp, got {op!r}")
    checked = check_tensor_list(tensors, "allreduce", rules)
    first = TensorSpec.of(checked[0])
    for i, t in enumerate(checked):
        _check_match(
            t,
            f"allreduce: tensor {i}",
            first,
            "tensor 0",
            rules.allreduce_match,
            "all tensors of one allreduce (one per replica) must match",
            rules,
        )
        if not rules.contiguous_everywhere:  # otherwise check_tensor_list did it
            _check_contiguous(t, i, "allreduce", rules)
    if first.layout not in (torch.strided, torch.sparse_coo):
        raise rules.error(f"allreduce: layout {first.layout} is not supported (dense or COO)")
    if first.layout == torch.sparse_coo and op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise rules.error(f"allreduce: sparse tensors support SUM and AVG only, not {op.name}")
    if op is ReduceOp.AVG and not (first.dtype.is_floating_point or first.dtype.is_complex):
        raise rules.error(
            f"allreduce: AVG needs a floating dtype, got {first.dtype}; use SUM and divide"
        )
    return checked


def check_allgather(
    output_lists: object, inputs: object, world_size: int, rules: CollectiveRules
) -> tuple[list[list[Tensor]], list[Tensor]]:
    """Validate one rank's allgather arguments: one list of ``world_size`` outputs per input,
    each output matching its input in ``rules.allgather_match``."""
    checked_inputs = check_tensor_list(inputs, "allgather inputs", rules)
    if (
        isinstance(output_lists, Tensor)
        or not isinstance(output_lists, Sequence)
        or len(output_lists) != len(checked_inputs)
    ):
        raise rules.error(
            f"allgather: got {len(checked_inputs)} input tensor(s) and output lists of type "
            f"{_type_and_length(output_lists)}; pass one list of size() = {world_size} "
            "outputs per input"
        )
    outputs = []
    for i, (raw, inp) in enumerate(zip(output_lists, checked_inputs, strict=True)):
        out = check_tensor_list(raw, f"allgather output list {i}", rules)
        if len(out) != world_size:
            raise rules.error(
                f"allgather: output list {i} has {len(out)} tensor(s); it needs one per rank "
                f"({world_size})"
            )
        want = TensorSpec.of(inp)
        for r, t in enumerate(out):
            _check_match(
                t,
                f"allgather: output {i}[{r}]",
                want,
                f"input {i}",
                rules.allgather_match,
                "outputs must match their input",
                rules,
            )
        outputs.append(out)
    return outputs, checked_inputs


def _check_match(
    t: Tensor,
    this: str,
    want: TensorSpec,
    that: str,
    fields: tuple[str, ...],
    rule: str,
    rules: CollectiveRules,
) -> None:
    """Raise unless ``t`` (called ``this``) equals ``want`` (``that``) in ``fields``."""
    spec = TensorSpec.of(t)
    differ = want.differences(spec, fields)
    if differ:
        raise rules.error(
            f"{this} is {spec} but {that} is {want} (they differ in {_and(differ)}); {rule} in "
            f"{_and(fields)}"
        )


def _check_contiguous(t: Tensor, i: int, what: str, rules: CollectiveRules) -> None:
    if t.layout == torch.strided and not t.is_contiguous():
        raise rules.error(
            f"{what}: tensor {i} ({TensorSpec.of(t)}) is not contiguous, and {rules.name} need "
            "contiguous tensors: pass .contiguous() and copy the result back"
        )


def _type_and_length(value: object) -> str:
    """``list of length 3``, or the type alone for what is not a list."""
    if isinstance(value, Tensor) or not isinstance(value, Sequence):
        return type(value).__name__
    return f"{type(value).__name__} of length {len(value)}"


def _and(words: Sequence[str]) -> str:
    """``["dtype", "shape", "device"]`` -> ``"dtype, shape and device"``."""
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"
