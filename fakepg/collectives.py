"""The data movement of each collective: local validation, fingerprints, and the kernels.

A collective's kernel is a list of independent *tasks* that the world's executor runs on its
worker threads once every rank has joined. Tasks never take a lock: the world hands them
tensors that no rank touches until the collective's ``Work`` completes.

# Note [Deterministic reduction order]
# The dense SUM of contributions x0, x1, ... (ascending rank, replica order within a rank) is
# computed element-wise as ((x0 + x1) + x2) + ..., one rounding per addition, and the single
# result is written to every rank. Splitting the element range into parts (one per worker) and
# blocks (cache-sized) changes which thread computes an element, never the order of its
# additions, so the bits do not depend on chunking, thread count or timing. The reference a
# test computes with ``torch`` ops in the same order is therefore matched exactly.

# Note [Cache-blocked reduction]
# Each part walks its element range in blocks of about 256 KiB: the block of x0 and x1 is
# combined into a scratch accumulator that stays in the core's cache, every further
# contribution is added to it, and the accumulator is then copied to every rank's tensor. Each
# input byte is read once and each output byte written once, so a W-rank allreduce moves the
# same bytes as one copy of W tensors, the memory-bandwidth floor. NumPy runs the element
# loops (a ufunc call costs far less than a torch op and releases the GIL, so parts run in
# parallel); dtypes NumPy lacks (bfloat16) and non-CPU tensors use the same loop in torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from reducer.process_group import ReduceOp

__all__: list[str] = []

Task = Callable[[], None]

_BLOCK_BYTES = 256 * 1024
# Below this many elements per part, splitting costs more in hand-offs than it saves.
_MIN_PART_ELEMENTS = 64 * 1024


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What must agree about a tensor across ranks: dtype, shape, layout, device."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: torch.layout
    device: torch.device

    @classmethod
    def of(cls, tensor: Tensor) -> TensorSpec:
        return cls(tensor.dtype, tuple(tensor.shape), tensor.layout, tensor.device)

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        text = f"{dtype}[{', '.join(str(s) for s in self.shape)}]"
        if self.layout != torch.strided:
            text += f" {str(self.layout).removeprefix('torch.')}"
        if self.device.type != "cpu":
            text += f" on {self.device}"
        return text


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A collective as one rank issued it; ranks must agree on it (desync detection)."""

    kind: str
    op: ReduceOp | None = None
    root: int | None = None
    specs: tuple[TensorSpec, ...] = ()

    def __str__(self) -> str:
        args = []
        if self.op is not None:
            args.append(f"op={self.op.name}")
        if self.root is not None:
            args.append(f"root={self.root}")
        if self.kind != "barrier":
            args.append("[" + ", ".join(str(s) for s in self.specs) + "]")
        return f"{self.kind}({', '.join(args)})"

    def differences(self, other: Fingerprint) -> list[str]:
        """The fields in which ``other`` differs from this fingerprint, for error messages."""
        found = [
            name for name in ("kind", "op", "root") if getattr(self, name) != getattr(other, name)
        ]
        if len(self.specs) != len(other.specs):
            found.append("tensor count")
        else:
            for field in ("dtype", "shape", "layout", "device"):
                if any(
                    getattr(a, field) != getattr(b, field)
                    for a, b in zip(self.specs, other.specs, strict=True)
                ):
                    found.append(field)
        return found


# --------------------------------------------------------------------------------------------
# Local validation: raised from the call on the rank that passed the bad argument.


def check_tensor_list(tensors: object, what: str) -> list[Tensor]:
    """``tensors`` as a list, or a ValueError saying what is wrong with it."""
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence):
        raise ValueError(f"{what} takes a list of tensors, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"{what} got an empty list of tensors; pass at least one tensor")
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise ValueError(f"{what}: element {i} is a {type(t).__name__}, not a tensor")
    return list(tensors)


def check_allreduce(tensors: object, op: object) -> list[Tensor]:
    """Validate one rank's allreduce arguments; every tensor must match the first one."""
    if not isinstance(op, ReduceOp):
        raise ValueError(f"allreduce: op must be a reducer.ReduceOp, got {op!r}")
    tensors = check_tensor_list(tensors, "allreduce")
    first = TensorSpec.of(tensors[0])
    for i, t in enumerate(tensors):
        if TensorSpec.of(t) != first:
            raise ValueError(
                f"allreduce: tensor {i} is {TensorSpec.of(t)} but tensor 0 is {first}; all "
                "tensors of one allreduce (one per replica) must have the same dtype, shape, "
                "layout and device"
            )
        if t.layout == torch.strided and not t.is_contiguous():
            raise ValueError(
                f"allreduce: tensor {i} ({first}) is not contiguous; pass .contiguous() and "
                "copy the result back"
            )
    if first.layout not in (torch.strided, torch.sparse_coo):
        raise ValueError(f"allreduce: layout {first.layout} is not supported (dense or COO)")
    if first.layout == torch.sparse_coo and op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"allreduce: sparse tensors support SUM and AVG only, not {op.name}")
    if op == ReduceOp.AVG and not (first.dtype.is_floating_point or first.dtype.is_complex):
        raise ValueError(f"allreduce: AVG needs a floating dtype, got {first.dtype}")
    return tensors


def check_allgather(
    output_lists: object, inputs: object, world_size: int
) -> tuple[list[list[Tensor]], list[Tensor]]:
    checked_inputs = check_tensor_list(inputs, "allgather inputs")
    if (
        isinstance(output_lists, Tensor)
        or not isinstance(output_lists, Sequence)
        or len(output_lists) != len(checked_inputs)
    ):
        raise ValueError(
            f"allgather: got {len(checked_inputs)} input tensor(s) and output lists "
            f"{type(output_lists).__name__}; pass one list of world_size outputs per input"
        )
    outputs = []
    for i, (raw, inp) in enumerate(zip(output_lists, checked_inputs, strict=True)):
        out = check_tensor_list(raw, f"allgather output list {i}")
        if len(out) != world_size:
            raise ValueError(
                f"allgather: output list {i} has {len(out)} tensor(s); it needs one per rank "
                f"({world_size})"
            )
        for r, t in enumerate(out):
            if TensorSpec.of(t) != TensorSpec.of(inp):
                raise ValueError(
                    f"allgather: output {i}[{r}] is {TensorSpec.of(t)} but input {i} is "
                    f"{TensorSpec.of(inp)}; outputs must match their input"
                )
        outputs.append(out)
    return outputs, checked_inputs


# --------------------------------------------------------------------------------------------
# Kernels: each returns the tasks that perform the collective. See Note [Cache-blocked
# reduction] and Note [Deterministic reduction order].

_NumpyOp = Callable[..., object]
_NUMPY_OPS: dict[ReduceOp, _NumpyOp] = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PRODUCT: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}
_TORCH_OPS: dict[ReduceOp, Callable[..., Tensor]] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
}


def _as_numpy(tensor: Tensor) -> np.ndarray | None:
    """A flat NumPy view sharing ``tensor``'s memory, or None where NumPy cannot."""
    if tensor.device.type != "cpu" or tensor.dtype == torch.bfloat16:
        return None
    try:
        return tensor.detach().view(-1).numpy()
    except (TypeError, RuntimeError):  # dtypes or bits (conj, neg) NumPy cannot represent
        return None


def _parts(numel: int, max_parts: int) -> list[tuple[int, int]]:
    count = max(1, min(max_parts, numel // _MIN_PART_ELEMENTS))
    step = math.ceil(numel / count)
    return [(lo, min(numel, lo + step)) for lo in range(0, numel, step)] or [(0, 0)]


def dense_allreduce_tasks(contributions: list[Tensor], op: ReduceOp, max_parts: int) -> list[Task]:
    """Tasks that reduce ``contributions`` (rank order, replica order) into all of them."""
    count = len(contributions)
    numel = contributions[0].numel()
    if count == 1 or numel == 0:
        return []  # x op nothing is x, bit for bit, for every op (x / 1 == x for AVG too)
    arrays = [_as_numpy(t) for t in contributions]
    if all(a is not None for a in arrays):
        np_arrays = [a for a in arrays if a is not None]
        block = max(1, _BLOCK_BYTES // np_arrays[0].itemsize)
        return [
            _numpy_part(np_arrays, lo, hi, block, op, count) for lo, hi in _parts(numel, max_parts)
        ]
    flats = [t.detach().view(-1) for t in contributions]
    if flats[0].device.type != "cpu":
        return [_torch_part(flats, 0, numel, numel, op, count)]  # one device kernel per step
    block = max(1, _BLOCK_BYTES // flats[0].element_size())
    return [_torch_part(flats, lo, hi, block, op, count) for lo, hi in _parts(numel, max_parts)]


def _numpy_part(
    arrays: list[np.ndarray], lo: int, hi: int, block: int, op: ReduceOp, count: int
) -> Task:
    combine = _NUMPY_OPS[op]

    def run() -> None:
        scratch = np.empty(min(block, hi - lo), dtype=arrays[0].dtype)
        for start in range(lo, hi, block):
            end = min(start + block, hi)
            acc = scratch[: end - start]
            combine(arrays[0][start:end], arrays[1][start:end], out=acc)
            for a in arrays[2:]:
                combine(acc, a[start:end], out=acc)
            if op == ReduceOp.AVG:
                np.true_divide(acc, count, out=acc)
            for a in arrays:
                a[start:end] = acc

    return run


def _torch_part(
    flats: list[Tensor], lo: int, hi: int, block: int, op: ReduceOp, count: int
) -> Task:
    combine = _TORCH_OPS[op]

    def run() -> None:
        with torch.no_grad():
            scratch = torch.empty(min(block, hi - lo), dtype=flats[0].dtype, device=flats[0].device)
            for start in range(lo, hi, block):
                end = min(start + block, hi)
                acc = scratch[: end - start]
                combine(flats[0][start:end], flats[1][start:end], out=acc)
                for f in flats[2:]:
                    combine(acc, f[start:end], out=acc)
                if op == ReduceOp.AVG:
                    acc.div_(count)
                for f in flats:
                    f[start:end].copy_(acc)

    return run


def sparse_allreduce_tasks(contributions: list[Tensor], op: ReduceOp) -> list[Task]:
    """One task: concatenate every contribution, coalesce (summing duplicates), copy back.

    The result is computed once and copied into every input, so all ranks hold the same bits;
    ``copy_`` gives each input its own indices and values, so ranks never share storage.
    """

    def run() -> None:
        with torch.no_grad():
            # Contributions with no entries add nothing; skipping them also lets a rank that
            # has no gradient send an empty tensor whose sparse/dense split differs.
            parts = [t.coalesce() for t in contributions if t._nnz() > 0] or [
                contributions[0].coalesce()
            ]
            indices = torch.cat([p.indices() for p in parts], dim=1)
            values = torch.cat([p.values() for p in parts], dim=0)
            total = torch.sparse_coo_tensor(indices, values, contributions[0].shape).coalesce()
            if op == ReduceOp.AVG:
                total = torch.sparse_coo_tensor(
                    total.indices(),
                    total.values() / len(contributions),
                    total.shape,
                    is_coalesced=True,
                )
            for t in contributions:
                # Not through .detach(): a detached sparse tensor is a separate impl, and
                # copy_ would replace its indices and values, not those of the input.
                t.copy_(total)

    return [run]


def allgather_tasks(outputs: list[list[list[Tensor]]], inputs: list[list[Tensor]]) -> list[Task]:
    """One task per destination rank: ``outputs[dst][i][src] = inputs[src][i]``."""

    def for_rank(dst: int) -> Task:
        def run() -> None:
            with torch.no_grad():
                for i, out_list in enumerate(outputs[dst]):
                    for src, out in enumerate(out_list):
                        out.detach().copy_(inputs[src][i])

        return run

    return [for_rank(dst) for dst in range(len(outputs))]


def broadcast_tasks(tensors: list[list[Tensor]], root: int) -> list[Task]:
    """One task per non-root rank: ``tensors[dst][i] = tensors[root][i]``."""

    def for_rank(dst: int) -> Task:
        def run() -> None:
            with torch.no_grad():
                for mine, theirs in zip(tensors[dst], tensors[root], strict=True):
                    mine.detach().copy_(theirs)

        return run

    return [for_rank(dst) for dst in range(len(tensors)) if dst != root]
