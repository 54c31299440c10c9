"""The argument rules every process group shares: a part of the protocol, beside
``reducer.process_group``.

The fake world (``fakepg``) and the torch.distributed adapter (:class:`TorchProcessGroup`)
accept the same arguments, apart from a few rules their backends dictate (see
:class:`CollectiveRules`). One implementation keeps their checks and messages from drifting
apart. A check raises from the call, on the rank that passed the bad argument, with the
implementation's own error class (a ``ValueError``; a ``TypeError`` for a timeout that is not
a number), before any rank is involved. Besides the protocol's four collectives there are
checks for the rest of torch.distributed's (reduce, reduce_scatter, all_to_all, gather,
scatter, allgather_into_tensor, send and recv, wait timeouts), which fakepg uses, under
either implementation's rules.

A backend imports this module and ``reducer.process_group``, nothing else of ``reducer``; this
module imports only ``reducer.process_group`` (dependencies point one way).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .process_group import ReduceOp

__all__ = [
    "SPEC_FIELDS",
    "CollectiveRules",
    "TensorSpec",
    "check_tensor_list",
    "check_allreduce",
    "check_allgather",
    "check_tensor",
    "check_dense",
    "check_rank",
    "check_peer",
    "check_tag",
    "check_timeout",
    "check_reduce",
    "check_reduce_scatter",
    "check_reduce_scatter_tensor",
    "check_allgather_into_tensor",
    "check_coalesced",
    "check_all_to_all",
    "check_all_to_all_single",
    "check_gather",
    "check_scatter",
]

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
        # A negative size stands for one that may differ between ranks.
        text = f"{dtype}[{', '.join(str(s) if s >= 0 else '*' for s in self.shape)}]"
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
    return _check_reduction_list(tensors, op, "allreduce", rules, sparse_ok=True)


def _check_reduction_list(
    tensors: object, op: object, what: str, rules: CollectiveRules, *, sparse_ok: bool
) -> list[Tensor]:
    """A list of replicas reduced in place (allreduce, reduce): they match tensor 0 in
    ``rules.allreduce_match``, are contiguous, and suit ``op``."""
    _check_op(op, what, rules)
    checked = check_tensor_list(tensors, what, rules)
    first = TensorSpec.of(checked[0])
    for i, t in enumerate(checked):
        _check_match(
            t,
            f"{what}: tensor {i}",
            first,
            "tensor 0",
            rules.allreduce_match,
            f"all tensors of one {what} (one per replica) must match",
            rules,
        )
        if not rules.contiguous_everywhere:  # otherwise check_tensor_list did it
            _check_contiguous(t, i, what, rules)
    assert isinstance(op, ReduceOp)  # _check_op
    _check_reducible(first, op, what, rules, sparse_ok=sparse_ok)
    return checked


def _check_op(op: object, what: str, rules: CollectiveRules) -> None:
    if not isinstance(op, ReduceOp):
        raise rules.error(f"{what}: op must be a reducer.ReduceOp, got {op!r}")


def _check_reducible(
    spec: TensorSpec, op: ReduceOp, what: str, rules: CollectiveRules, *, sparse_ok: bool
) -> None:
    """``op`` can reduce tensors like ``spec``: dense (or COO where ``sparse_ok``), and a
    floating dtype for AVG."""
    if sparse_ok and spec.layout not in (torch.strided, torch.sparse_coo):
        raise rules.error(f"{what}: layout {spec.layout} is not supported (dense or COO)")
    if not sparse_ok and spec.layout != torch.strided:
        raise rules.error(
            f"{what}: layout {spec.layout} is not supported (dense tensors only); pass .to_dense()"
        )
    if spec.layout == torch.sparse_coo and op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise rules.error(f"{what}: sparse tensors support SUM and AVG only, not {op.name}")
    if op is ReduceOp.AVG and not (spec.dtype.is_floating_point or spec.dtype.is_complex):
        raise rules.error(
            f"{what}: AVG needs a floating dtype, got {spec.dtype}; use SUM and divide"
        )


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


def check_tensor(tensor: object, what: str, rules: CollectiveRules) -> Tensor:
    """``tensor`` itself, or ``rules.error`` saying it is not a tensor (or not contiguous where
    ``rules`` need that)."""
    if not isinstance(tensor, Tensor):
        raise rules.error(f"{what} takes a tensor, got {type(tensor).__name__}")
    if rules.contiguous_everywhere:
        _check_contiguous(tensor, 0, what, rules)
    return tensor


def check_dense(tensor: Tensor, what: str, rules: CollectiveRules) -> Tensor:
    """``tensor`` if it is dense (strided); collectives other than allreduce move dense data."""
    if tensor.layout != torch.strided:
        raise rules.error(
            f"{what}: layout {tensor.layout} is not supported (dense tensors only); pass "
            ".to_dense()"
        )
    return tensor


def check_rank(value: object, size: int, what: str, name: str, rules: CollectiveRules) -> int:
    """A rank of the group (``root``, ``src``, ``dst``): an int in ``[0, size)``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < size:
        raise rules.error(f"{what}: {name} must be a rank in [0, {size}), got {value!r}")
    return value


def check_peer(
    value: object, rank: int, size: int, what: str, name: str, rules: CollectiveRules
) -> int:
    """The other end of a send or recv: a rank of the group other than the caller's."""
    peer = check_rank(value, size, what, name, rules)
    if peer == rank:
        raise rules.error(
            f"{what}: {name}={peer} is this rank itself; a rank cannot {what} to or from "
            "itself (copy the tensor instead)"
        )
    return peer


def check_tag(tag: object, what: str, rules: CollectiveRules) -> int:
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise rules.error(f"{what}: tag must be an int, got {tag!r}")
    return tag


def check_timeout(timeout: object, what: str, rules: CollectiveRules) -> float | None:
    """A wait's ``timeout``: None (the default), or a finite number of seconds > 0.

    Refused on the calling rank only: a bad argument is not a collective failure.
    """
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(
            f"{what}: timeout must be a number of seconds or None, got {type(timeout).__name__}"
        )
    if not (timeout > 0 and math.isfinite(timeout)):
        raise rules.error(
            f"{what}: timeout must be a finite number of seconds > 0, got {timeout!r}; pass "
            "None for the default (every wait has a deadline)"
        )
    return float(timeout)


def check_reduce(
    tensors: object, root: object, op: object, size: int, rules: CollectiveRules
) -> tuple[list[Tensor], int]:
    """reduce: replicas as in allreduce (dense only), and a root rank."""
    checked = _check_reduction_list(tensors, op, "reduce", rules, sparse_ok=False)
    return checked, check_rank(root, size, "reduce", "root", rules)


def check_reduce_scatter(
    output: object, inputs: object, op: object, size: int, rules: CollectiveRules
) -> tuple[Tensor, list[Tensor]]:
    """reduce_scatter, list form: ``size`` inputs (one per destination rank), each matching
    ``output``."""
    what = "reduce_scatter"
    _check_op(op, what, rules)
    out = check_tensor(output, f"{what} output", rules)
    checked = check_tensor_list(inputs, f"{what} inputs", rules)
    if len(checked) != size:
        raise rules.error(
            f"{what}: got {len(checked)} input tensor(s); pass one per rank ({size}), input r "
            "being what this rank contributes to rank r's output"
        )
    want = TensorSpec.of(out)
    for r, t in enumerate(checked):
        _check_match(
            t,
            f"{what}: input {r}",
            want,
            "the output",
            SPEC_FIELDS,
            "inputs must match the output",
            rules,
        )
    for i, t in enumerate([out, *checked]):
        _check_contiguous(t, i, what, rules)
    assert isinstance(op, ReduceOp)
    _check_reducible(want, op, what, rules, sparse_ok=False)
    return out, checked


def check_reduce_scatter_tensor(
    output: object,
    input_tensor: object,
    op: object,
    size: int,
    rules: CollectiveRules,
    what: str = "reduce_scatter_tensor",
) -> tuple[Tensor, Tensor]:
    """reduce_scatter_tensor: ``input`` holds ``size`` equal chunks (flat order), chunk r
    reduced into rank r's ``output``."""
    _check_op(op, what, rules)
    out = check_tensor(output, f"{what} output", rules)
    inp = check_tensor(input_tensor, f"{what} input", rules)
    # The reduction works on flat views of both.
    _check_flat_pair(out, inp, size, what, "input", "output", rules, contiguous=(out, inp))
    assert isinstance(op, ReduceOp)
    _check_reducible(TensorSpec.of(out), op, what, rules, sparse_ok=False)
    return out, inp


def check_allgather_into_tensor(
    output: object,
    input_tensor: object,
    size: int,
    rules: CollectiveRules,
    what: str = "allgather_into_tensor",
) -> tuple[Tensor, Tensor]:
    """allgather_into_tensor: rank r's ``input`` lands in the r-th of ``size`` equal chunks of
    ``output`` (flat order)."""
    out = check_tensor(output, f"{what} output", rules)
    inp = check_tensor(input_tensor, f"{what} input", rules)
    # The output is written through flat views of its chunks; the input is only read.
    _check_flat_pair(inp, out, size, what, "output", "input", rules, contiguous=(out,))
    return out, inp


def _check_flat_pair(
    small: Tensor,
    big: Tensor,
    size: int,
    what: str,
    big_name: str,
    small_name: str,
    rules: CollectiveRules,
    *,
    contiguous: tuple[Tensor, ...],
) -> None:
    """``big`` holds ``size`` chunks of ``small``'s size, in flat order; ``contiguous`` must be
    (every tensor must, under ``rules.contiguous_everywhere``)."""
    for i, t in enumerate((small, big)):
        if t.layout != torch.strided:
            raise rules.error(f"{what}: layout {t.layout} is not supported (dense tensors only)")
        if rules.contiguous_everywhere or any(t is c for c in contiguous):
            _check_contiguous(t, i, what, rules)
    differ = TensorSpec.of(small).differences(TensorSpec.of(big), ("dtype", "device"))
    if differ:
        raise rules.error(
            f"{what}: the {big_name} is {TensorSpec.of(big)} but the {small_name} is "
            f"{TensorSpec.of(small)} (they differ in {_and(differ)}); they must match in dtype "
            "and device"
        )
    if big.numel() != size * small.numel():
        raise rules.error(
            f"{what}: the {big_name} has {big.numel()} elements but needs size() x the "
            f"{small_name}'s = {size} x {small.numel()} = {size * small.numel()}; rank r's "
            "part is its r-th chunk"
        )


def check_coalesced(
    outputs: object, inputs: object, what: str, rules: CollectiveRules
) -> tuple[list[Tensor], list[Tensor]]:
    """The tensor pairs of a coalesced collective: two lists of the same length."""
    outs = check_tensor_list(outputs, f"{what} outputs", rules)
    ins = check_tensor_list(inputs, f"{what} inputs", rules)
    if len(outs) != len(ins):
        raise rules.error(
            f"{what}: got {len(outs)} output(s) and {len(ins)} input(s); pass one output per input"
        )
    return outs, ins


def check_all_to_all(
    outputs: object, inputs: object, size: int, rules: CollectiveRules
) -> tuple[list[Tensor], list[Tensor]]:
    """all_to_all: ``size`` inputs (input r goes to rank r) and ``size`` outputs (output s
    comes from rank s), all of one dtype. Shapes are matched across ranks when all joined."""
    outs = check_tensor_list(outputs, "all_to_all outputs", rules)
    ins = check_tensor_list(inputs, "all_to_all inputs", rules)
    for name, ts in (("outputs", outs), ("inputs", ins)):
        if len(ts) != size:
            raise rules.error(f"all_to_all: got {len(ts)} {name}; pass one per rank ({size})")
    want = TensorSpec.of(ins[0])
    for name, ts in (("input", ins), ("output", outs)):
        for r, t in enumerate(ts):
            _check_match(
                t,
                f"all_to_all: {name} {r}",
                want,
                "input 0",
                ("dtype", "layout", "device"),
                "all tensors must match",
                rules,
            )
    if want.layout != torch.strided:
        raise rules.error(f"all_to_all: layout {want.layout} is not supported (dense tensors only)")
    return outs, ins


def check_all_to_all_single(
    output: object,
    input_tensor: object,
    output_split_sizes: object,
    input_split_sizes: object,
    size: int,
    rules: CollectiveRules,
) -> tuple[Tensor, Tensor, list[int], list[int]]:
    """all_to_all_single: rows of ``input`` (dim 0) split by ``input_split_sizes`` (None or []:
    equal parts) go to the ranks in order; ``output`` is split the same way by source rank."""
    what = "all_to_all_single"
    out = check_tensor(output, f"{what} output", rules)
    inp = check_tensor(input_tensor, f"{what} input", rules)
    for name, t in (("output", out), ("input", inp)):
        if t.dim() == 0 or t.layout != torch.strided:
            raise rules.error(
                f"{what}: the {name} is {TensorSpec.of(t)}; it must be a dense tensor with at "
                "least one dimension (split along dim 0)"
            )
    differ = TensorSpec.of(inp).differences(TensorSpec.of(out), ("dtype", "device"))
    if differ or out.shape[1:] != inp.shape[1:]:
        raise rules.error(
            f"{what}: the output is {TensorSpec.of(out)} but the input is {TensorSpec.of(inp)}; "
            "they must match in dtype, device and every dimension but the first"
        )
    out_splits = _split_sizes(output_split_sizes, out, size, what, "output_split_sizes", rules)
    in_splits = _split_sizes(input_split_sizes, inp, size, what, "input_split_sizes", rules)
    return out, inp, out_splits, in_splits


def _split_sizes(
    value: object, t: Tensor, size: int, what: str, name: str, rules: CollectiveRules
) -> list[int]:
    rows = t.shape[0]
    if value is None or (isinstance(value, Sequence) and len(value) == 0):
        if rows % size:
            raise rules.error(
                f"{what}: {name} is not given, so dim 0 ({rows}) is split into size() = {size} "
                f"equal parts, but {rows} is not a multiple of {size}; pass {name}"
            )
        return [rows // size] * size
    if isinstance(value, Tensor):
        value = value.tolist()
    if (
        not isinstance(value, Sequence)
        or len(value) != size
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value)
    ):
        raise rules.error(
            f"{what}: {name} must be a list of size() = {size} ints >= 0, got {value!r}"
        )
    if sum(value) != rows:
        raise rules.error(
            f"{what}: {name} {list(value)} add up to {sum(value)}, but dim 0 has {rows} rows"
        )
    return list(value)


def check_gather(
    tensor: object,
    gather_list: object,
    root: object,
    rank: int,
    size: int,
    rules: CollectiveRules,
) -> tuple[Tensor, list[Tensor], int]:
    """gather: every rank's ``tensor`` into the root's ``gather_list`` (``size`` tensors, each
    matching ``tensor``); other ranks pass no list."""
    t = check_dense(check_tensor(tensor, "gather", rules), "gather", rules)
    dst = check_rank(root, size, "gather", "root", rules)
    outs = _root_list(gather_list, t, dst, rank, size, "gather", "gather_list", rules)
    return t, outs, dst


def check_scatter(
    tensor: object,
    scatter_list: object,
    root: object,
    rank: int,
    size: int,
    rules: CollectiveRules,
) -> tuple[Tensor, list[Tensor], int]:
    """scatter: the root's ``scatter_list`` (``size`` tensors, each matching ``tensor``) r-th
    into rank r's ``tensor``; other ranks pass no list."""
    t = check_dense(check_tensor(tensor, "scatter", rules), "scatter", rules)
    src = check_rank(root, size, "scatter", "root", rules)
    ins = _root_list(scatter_list, t, src, rank, size, "scatter", "scatter_list", rules)
    return t, ins, src


def _root_list(
    value: object,
    t: Tensor,
    root: int,
    rank: int,
    size: int,
    what: str,
    name: str,
    rules: CollectiveRules,
) -> list[Tensor]:
    empty = value is None or (isinstance(value, Sequence) and len(value) == 0)
    if rank != root:
        if not empty:
            raise rules.error(
                f"{what}: {name} is given on rank {rank}, but only the root (rank {root}) "
                f"passes one; pass {name}=None on the other ranks"
            )
        return []
    if empty:
        raise rules.error(
            f"{what}: the root (rank {root}) must pass {name}, one tensor per rank ({size})"
        )
    checked = check_tensor_list(value, f"{what} {name}", rules)
    if len(checked) != size:
        raise rules.error(
            f"{what}: {name} has {len(checked)} tensor(s); it needs one per rank ({size})"
        )
    want = TensorSpec.of(t)
    for r, x in enumerate(checked):
        _check_match(
            x,
            f"{what}: {name}[{r}]",
            want,
            "the tensor",
            SPEC_FIELDS,
            f"{name} must match the tensor",
            rules,
        )
    return checked


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
