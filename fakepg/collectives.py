"""The data movement of each collective: argument rules, fingerprints, and the kernels.

A collective's kernel is a list of independent *tasks* that the world's executor runs on its
worker threads once every rank has joined. Tasks never take a lock: the world hands them
tensors that no rank touches until the collective's ``Work`` completes.

# Note [Deterministic reduction order]
# The dense SUM of contributions x0, x1, ... (ascending rank, replica order within a rank) is
# computed element-wise as ((x0 + x1) + x2) + ..., one rounding per addition, and the single
# result is written to every rank (allreduce), to the root (reduce), or, per destination rank
# r, from every rank's r-th chunk to rank r's output (reduce_scatter). Splitting the element
# range into parts (one per worker) and blocks (cache-sized) changes which thread computes an
# element, never the order of its
# additions, so the bits do not depend on chunking, thread count or timing. The reference a
# test computes with ``torch`` ops in the same order is therefore matched exactly.

# Note [Cache-blocked reduction]
# Each part walks its element range in blocks of about 256 KiB: the block of x0 and x1 is
# combined into a scratch accumulator that stays in the core's cache, every further
# contribution is added to it, and the accumulator is then copied to every target. Each
# input byte is read once and each output byte written once, so a W-rank allreduce moves the
# same bytes as one copy of W tensors, the memory-bandwidth floor. Where there is one target
# and it overlaps no contribution (reduce_scatter, a reduce into a separate buffer), the
# target's own block is the accumulator: no scratch, no copy after the last addition. NumPy
# runs the element loops (a ufunc call costs far less than a torch op and releases the GIL, so
# parts run in parallel); dtypes NumPy lacks (bfloat16) and non-CPU tensors use the same loop
# in torch.

# Note [Cache-blocked fan-out]
# A collective that copies one source into several destinations (broadcast: the root's
# tensor into every other rank's; all_gather: each rank's input into its chunk of every
# rank's output) copies it block by block, each block of about 256 KiB into every
# destination while it is in the core's cache, instead of one whole copy per destination.
# The source is then read from memory once, not once per destination: the bytes moved are
# those of the writes alone, below the floor of one copy per destination. The element range
# is cut into parts that the workers copy in parallel (NumPy, GIL released); where NumPy
# cannot view a tensor, whole copies as before. Copies are exact, so the bits are those of
# the per-destination copies.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np
import torch
from torch import Tensor

from reducer.collectives import SPEC_FIELDS, CollectiveRules, TensorSpec
from reducer.process_group import ReduceOp

__all__: list[str] = []

Task = Callable[[], None]

_BLOCK_BYTES = 256 * 1024
# Kinds whose fingerprint lists no tensors.
_NO_TENSORS = frozenset({"barrier", "monitored_barrier"})
# Below this many elements per part, splitting costs more in hand-offs than it saves.
_MIN_PART_ELEMENTS = 64 * 1024


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A collective as one rank issued it; ranks must agree on it (desync detection)."""

    kind: str
    op: ReduceOp | None = None
    root: int | None = None
    specs: tuple[TensorSpec, ...] = ()
    # How this rank took part where ranks legitimately differ (a p2p's "send" or "recv"):
    # shown in messages, never compared.
    role: str | None = field(default=None, compare=False)

    def __str__(self) -> str:
        args = []
        if self.op is not None:
            args.append(f"op={self.op.name}")
        if self.root is not None:
            args.append(f"root={self.root}")
        if self.kind not in _NO_TENSORS:
            args.append("[" + ", ".join(str(s) for s in self.specs) + "]")
        return f"{self.role or self.kind}({', '.join(args)})"

    def differences(self, other: Fingerprint) -> list[str]:
        """The fields in which ``other`` differs from this fingerprint, for error messages."""
        found = [
            name for name in ("kind", "op", "root") if getattr(self, name) != getattr(other, name)
        ]
        if len(self.specs) != len(other.specs):
            found.append("tensor count")
        else:
            for field in SPEC_FIELDS:
                if any(
                    getattr(a, field) != getattr(b, field)
                    for a, b in zip(self.specs, other.specs, strict=True)
                ):
                    found.append(field)
        return found


# --------------------------------------------------------------------------------------------
# Local validation: the checks are shared with reducer.TorchProcessGroup; these are the fake
# world's rules. They raise ValueError from the call on the rank that passed the bad argument.

RULES = CollectiveRules(
    error=ValueError,
    name="fakepg's kernels",
    allreduce_match=SPEC_FIELDS,
    allgather_match=SPEC_FIELDS,
    contiguous_everywhere=False,
)


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
    return dense_reduce_tasks(contributions, contributions, op, max_parts)


def dense_reduce_tasks(
    contributions: list[Tensor], targets: list[Tensor], op: ReduceOp, max_parts: int
) -> list[Task]:
    """Tasks that write the reduction of ``contributions`` (in this order) into every target.

    Every tensor is contiguous with the same number of elements. Targets may be among the
    contributions (allreduce, reduce): each block is read whole before it is written.
    """
    count = len(contributions)
    numel = contributions[0].numel()
    if numel == 0:
        return []
    if count == 1:
        # x op nothing is x, bit for bit, for every op (x / 1 == x for AVG too).
        copies = [t for t in targets if t is not contributions[0]]
        return [_copy_task(contributions[0], copies)] if copies else []
    in_place = len(targets) == 1 and not any(_overlap(targets[0], t) for t in contributions)
    arrays = [_as_numpy(t) for t in [*contributions, *targets]]
    if all(a is not None for a in arrays):
        np_arrays = [a for a in arrays if a is not None]
        inputs, outputs = np_arrays[:count], np_arrays[count:]
        block = max(1, _BLOCK_BYTES // np_arrays[0].itemsize)
        return [
            _numpy_part(inputs, outputs, lo, hi, block, op, count, in_place)
            for lo, hi in _parts(numel, max_parts)
        ]
    flats = [t.detach().view(-1) for t in contributions]
    outs = [t.detach().view(-1) for t in targets]
    if flats[0].device.type != "cpu":
        # One kernel per step.
        return [_torch_part(flats, outs, 0, numel, numel, op, count, in_place)]
    block = max(1, _BLOCK_BYTES // flats[0].element_size())
    return [
        _torch_part(flats, outs, lo, hi, block, op, count, in_place)
        for lo, hi in _parts(numel, max_parts)
    ]


def _overlap(a: Tensor, b: Tensor) -> bool:
    """Whether the memory of contiguous ``a`` and ``b`` may overlap (byte ranges; storages
    compared first, so tensors on different storages never do)."""
    if a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    a_lo, b_lo = a.data_ptr(), b.data_ptr()
    a_hi = a_lo + a.numel() * a.element_size()
    b_hi = b_lo + b.numel() * b.element_size()
    return a_lo < b_hi and b_lo < a_hi


_Flat = TypeVar("_Flat", np.ndarray, Tensor)
_np_copy: Callable[[np.ndarray, np.ndarray], object] = np.copyto  # dst[...] = src


def _reduce_blocks(
    flats: list[_Flat],
    targets: list[_Flat],
    lo: int,
    hi: int,
    block: int,
    scratch: _Flat | None,
    combine: Callable[..., object],
    average: Callable[[_Flat], None] | None,
    assign: Callable[[_Flat, _Flat], object],
) -> None:
    """Elements ``lo:hi`` of every target become the reduction of the flat contributions,
    block by block.

    The one loop of both element paths (NumPy and torch), so that both add in the same order:
    see Note [Deterministic reduction order] and Note [Cache-blocked reduction]. ``scratch``
    (at least ``min(block, hi - lo)`` long) holds the accumulator; ``assign(dst, src)`` copies
    it into each target. ``scratch=None`` (one target that overlaps no contribution, as in
    reduce_scatter): the accumulator is the target's block itself, so no copy follows.
    """
    for start in range(lo, hi, block):
        end = min(start + block, hi)
        acc = targets[0][start:end] if scratch is None else scratch[: end - start]
        combine(flats[0][start:end], flats[1][start:end], out=acc)
        for f in flats[2:]:
            combine(acc, f[start:end], out=acc)
        if average is not None:
            average(acc)
        if scratch is not None:
            for f in targets:
                assign(f[start:end], acc)


def _numpy_part(
    arrays: list[np.ndarray],
    targets: list[np.ndarray],
    lo: int,
    hi: int,
    block: int,
    op: ReduceOp,
    count: int,
    in_place: bool,
) -> Task:
    combine = _NUMPY_OPS[op]

    def divide(acc: np.ndarray) -> None:
        np.true_divide(acc, count, out=acc)

    average = divide if op == ReduceOp.AVG else None

    def run() -> None:
        scratch = None if in_place else np.empty(min(block, hi - lo), dtype=arrays[0].dtype)
        _reduce_blocks(arrays, targets, lo, hi, block, scratch, combine, average, _np_copy)

    return run


def _torch_part(
    flats: list[Tensor],
    targets: list[Tensor],
    lo: int,
    hi: int,
    block: int,
    op: ReduceOp,
    count: int,
    in_place: bool,
) -> Task:
    combine = _TORCH_OPS[op]

    def divide(acc: Tensor) -> None:
        acc.div_(count)

    average = divide if op == ReduceOp.AVG else None

    def run() -> None:
        with torch.no_grad():
            scratch = (
                None
                if in_place
                else torch.empty(min(block, hi - lo), dtype=flats[0].dtype, device=flats[0].device)
            )
            _reduce_blocks(flats, targets, lo, hi, block, scratch, combine, average, Tensor.copy_)

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


def broadcast_tasks(tensors: list[list[Tensor]], root: int, max_parts: int = 1) -> list[Task]:
    """``tensors[dst][i] = tensors[root][i]`` for every other rank: a fan-out per tensor
    (see Note [Cache-blocked fan-out]), else one task per non-root rank."""
    others = [dst for dst in range(len(tensors)) if dst != root]
    tasks: list[Task] = []
    slow: list[int] = []  # indices of the tensors NumPy cannot copy
    for i, theirs in enumerate(tensors[root]):
        fan = _fan_out_tasks(theirs, [tensors[dst][i] for dst in others], max_parts)
        if fan is None:
            slow.append(i)
        else:
            tasks += fan

    def for_rank(dst: int) -> Task:
        def run() -> None:
            with torch.no_grad():
                for i in slow:
                    tensors[dst][i].detach().copy_(tensors[root][i])

        return run

    return tasks + ([for_rank(dst) for dst in others] if slow else [])


def _fan_out_tasks(src: Tensor, dsts: list[Tensor], max_parts: int) -> list[Task] | None:
    """Tasks that copy ``src`` into every one of ``dsts`` (each of its shape and dtype),
    block by block, in parallel parts; None where NumPy cannot view them all (contiguous CPU
    tensors of a dtype NumPy has). See Note [Cache-blocked fan-out]."""
    if not dsts or src.numel() == 0:
        return []
    views = [
        _as_numpy(t) if t.layout == torch.strided and t.is_contiguous() else None
        for t in [src, *dsts]
    ]
    if any(v is None for v in views) or any(t.dtype != src.dtype for t in dsts):
        return None
    arrays = [v for v in views if v is not None]
    if any(a.size != arrays[0].size for a in arrays):
        return None
    source, targets = arrays[0], arrays[1:]
    block = max(1, _BLOCK_BYTES // source.itemsize)

    def part(lo: int, hi: int) -> Task:
        def run() -> None:
            for start in range(lo, hi, block):
                end = min(start + block, hi)
                piece = source[start:end]
                for t in targets:
                    _np_copy(t[start:end], piece)

        return run

    return [part(lo, hi) for lo, hi in _parts(source.size, max_parts)]


# --------------------------------------------------------------------------------------------
# The other collectives. A plan that finds the ranks' arguments inconsistent in a way their
# fingerprints cannot show (split sizes, per-destination shapes) raises Disagreement; the world
# then fails the collective on every rank with that message.


class Disagreement(Exception):
    """Ranks' arguments do not fit together; the message says which ranks and how."""


def batched(tasks: list[Task], max_parts: int) -> list[Task]:
    """``tasks`` shared round-robin among at most ``max_parts`` tasks: one hand-off to a worker
    per part instead of one per small task (the parts are alike, so the shares balance)."""
    if len(tasks) <= max_parts:
        return tasks

    def share(mine: list[Task]) -> Task:
        def run() -> None:
            for task in mine:
                task()

        return run

    return [share(tasks[i::max_parts]) for i in range(max_parts)]


def _copy(dst: Tensor, src: Tensor) -> None:
    """``dst[...] = src``, with NumPy (GIL released, no intra-op threads) where it can."""
    if dst.dtype == src.dtype and dst.is_contiguous() and src.is_contiguous():
        a, b = _as_numpy(dst), _as_numpy(src)
        if a is not None and b is not None:
            np.copyto(a, b)
            return
    with torch.no_grad():
        # See Note [Hide collectives mutation from autograd] in torch's threaded group: the
        # copy goes through .detach() so autograd does not see an in-place write.
        dst.detach().copy_(src.detach().reshape(dst.shape))


def _copy_task(src: Tensor, dsts: list[Tensor]) -> Task:
    def run() -> None:
        for dst in dsts:
            _copy(dst, src)

    return run


def flat_chunks(t: Tensor, parts: int) -> list[Tensor]:
    """``t`` (contiguous) as ``parts`` equal flat views, in order."""
    flat = t.detach().view(-1)
    step = flat.numel() // parts
    return [flat[i * step : (i + 1) * step] for i in range(parts)]


def reduce_tasks(
    per_rank: list[list[Tensor]], root: int, op: ReduceOp, max_parts: int
) -> list[Task]:
    """reduce: the rank-order reduction of every rank's replicas into the root's replicas."""
    contributions = [t for ts in per_rank for t in ts]
    return dense_reduce_tasks(contributions, per_rank[root], op, max_parts)


def reduce_scatter_tasks(
    inputs: list[list[Tensor]], outputs: list[Tensor], op: ReduceOp, max_parts: int
) -> list[Task]:
    """reduce_scatter: ``outputs[r]`` = the rank-order reduction of ``inputs[s][r]`` over
    ranks s. ``inputs[s][r]`` and ``outputs[r]`` are contiguous and of one size."""
    tasks: list[Task] = []
    for dst, out in enumerate(outputs):
        contributions = [per_src[dst].detach().view(-1) for per_src in inputs]
        tasks += dense_reduce_tasks(contributions, [out.detach().view(-1)], op, max_parts)
    return tasks


def all_to_all_tasks(outputs: list[list[Tensor]], inputs: list[list[Tensor]]) -> list[Task]:
    """all_to_all: ``outputs[dst][src] = inputs[src][dst]``; one task per destination."""
    size = len(outputs)
    bad = [
        (src, dst)
        for dst in range(size)
        for src in range(size)
        if outputs[dst][src].shape != inputs[src][dst].shape
    ]
    if bad:
        src, dst = bad[0]
        raise Disagreement(
            f"rank {src} sends {TensorSpec.of(inputs[src][dst])} to rank {dst}, but rank {dst} "
            f"expects {TensorSpec.of(outputs[dst][src])} from rank {src} (input {dst} of rank "
            f"{src} must have the shape of output {src} of rank {dst})"
        )

    def for_rank(dst: int) -> Task:
        def run() -> None:
            for src in range(size):
                _copy(outputs[dst][src], inputs[src][dst])

        return run

    return [for_rank(dst) for dst in range(size)]


def all_to_all_single_tasks(
    outputs: list[Tensor],
    inputs: list[Tensor],
    output_splits: list[list[int]],
    input_splits: list[list[int]],
) -> list[Task]:
    """all_to_all_single: rows ``input_splits[src][dst]`` of ``inputs[src]`` (in rank order
    along dim 0) into the ``src``-th part of ``outputs[dst]``."""
    size = len(outputs)
    for dst in range(size):
        for src in range(size):
            sent, expected = input_splits[src][dst], output_splits[dst][src]
            if sent != expected:
                raise Disagreement(
                    f"rank {src} sends {sent} row(s) to rank {dst} (its input_split_sizes "
                    f"{input_splits[src]}), but rank {dst} expects {expected} from rank {src} "
                    f"(its output_split_sizes {output_splits[dst]})"
                )

    def offsets(splits: list[int]) -> list[int]:
        out = [0]
        for n in splits:
            out.append(out[-1] + n)
        return out

    def for_rank(dst: int) -> Task:
        def run() -> None:
            out_at = offsets(output_splits[dst])
            for src in range(size):
                rows = output_splits[dst][src]
                if rows == 0:
                    continue
                in_at = offsets(input_splits[src])[dst]
                _copy(outputs[dst].narrow(0, out_at[src], rows), inputs[src].narrow(0, in_at, rows))

        return run

    return [for_rank(dst) for dst in range(size)]


def gather_tasks(inputs: list[Tensor], root_outputs: list[Tensor]) -> list[Task]:
    """gather: ``root_outputs[src] = inputs[src]``; one task per source."""
    return [
        _copy_task(src_tensor, [out]) for src_tensor, out in zip(inputs, root_outputs, strict=True)
    ]


def scatter_tasks(root_inputs: list[Tensor], outputs: list[Tensor]) -> list[Task]:
    """scatter: ``outputs[dst] = root_inputs[dst]``; one task per destination."""
    return [_copy_task(src, [out]) for src, out in zip(root_inputs, outputs, strict=True)]


def allgather_into_tensor_tasks(
    outputs: list[list[Tensor]], inputs: list[list[Tensor]], max_parts: int = 1
) -> list[Task]:
    """allgather_into_tensor (coalesced: several pairs): the ``src``-th flat chunk of
    ``outputs[dst][i]`` = ``inputs[src][i]``: a fan-out of each input into its chunk of
    every output (see Note [Cache-blocked fan-out]), else one task per destination."""
    size = len(outputs)
    fans: list[Task] = []
    for i in range(len(outputs[0])):
        if not all(outputs[dst][i].is_contiguous() for dst in range(size)):
            break
        chunks = [flat_chunks(outputs[dst][i], size) for dst in range(size)]
        for src in range(size):
            flat = inputs[src][i].detach().reshape(-1)
            fan = _fan_out_tasks(flat, [chunks[dst][src] for dst in range(size)], max_parts)
            if fan is None:
                break
            fans += fan
        else:
            continue
        break  # some pair NumPy cannot copy: every pair the whole-copy way
    else:
        return fans

    def for_rank(dst: int) -> Task:
        def run() -> None:
            for i, out in enumerate(outputs[dst]):
                for src, chunk in enumerate(flat_chunks(out, size)):
                    _copy(chunk, inputs[src][i].reshape(-1))

        return run

    return [for_rank(dst) for dst in range(size)]


def p2p_tasks(sent: list[Tensor], received: list[Tensor]) -> list[Task]:
    """send/recv: the receiver's tensors = the sender's."""

    def run() -> None:
        for dst, src in zip(received, sent, strict=True):
            _copy(dst, src)

    return [run]
