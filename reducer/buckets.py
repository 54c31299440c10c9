"""Which parameters share a bucket, and each bucket's flat layout.

``compute_bucket_assignment_by_size`` groups parameters into buckets by byte size, per dtype
and device, as torch's ``_compute_bucket_assignment_by_size`` does. ``build_buckets`` turns a
bucket assignment into the reducer's buckets: per model replica, one flat tensor holding the
gradients of its parameters back to back, and a view of it per parameter.

# Note [Bucket views follow the parameter's strides]
# A parameter's slot in the flat contents is ``numel`` elements from its offset; the view of
# that slot has the parameter's own strides whenever the parameter is non-overlapping and
# dense (a channels_last conv weight, a transposed weight), as in torch's reducer. Autograd
# creates gradients with the parameter's strides, so copies into and out of the view are
# plain element-for-element copies, and with gradient_as_bucket_view ``.grad`` has the
# parameter's layout, as the optimizer expects. Other parameters get a row-major view. The
# layout decides which element of the flat contents is which, so every rank (and every
# replica) must lay a parameter out alike: DistributedDataParallel checks the strides across
# ranks, build_buckets across replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ._map_order import unordered_map_order
from .errors import BucketAssignmentError, InvalidArgument, MixedBucketError, describe_param
from .process_group import Work

__all__ = [
    "compute_bucket_assignment_by_size",
    "ddp_bucket_assignment",
    "sparse_gradient_flags",
]


def compute_bucket_assignment_by_size(
    tensors: Sequence[Tensor] | Tensor,
    bucket_size_limits: Sequence[int],
    expect_sparse_gradient: Sequence[bool] | None = None,
    tensor_indices: Sequence[int] | None = None,
) -> list[list[int]]:
    """Group ``tensors`` (indices into it) into buckets of about ``bucket_size_limits`` bytes.

    Buckets are keyed by (dtype, device), so a bucket never mixes them. A bucket closes as soon
    as its size reaches the current limit of its key; that key then moves on to the next
    limit, and the last limit repeats (torch's DDP passes a small first bucket, then its cap).
    A tensor expecting a sparse gradient gets a bucket of its own. The result is sorted by the
    smallest index in each bucket: parameters come in forward order, so buckets become ready
    in index order during backward.

    ``tensor_indices`` (torch's argument, used by its bucket rebuild) names each tensor's
    index: ``tensors`` are then the parameters in the order their gradients became ready, the
    buckets hold ``tensor_indices[i]`` for ``tensors[i]`` (``expect_sparse_gradient`` is
    indexed by it too), and they are not sorted: see Note [Rebuilt buckets are not sorted].
    """
    if isinstance(tensors, Tensor) or not tensors:
        raise InvalidArgument("compute_bucket_assignment_by_size: pass a non-empty list of tensors")
    limits = [int(limit) for limit in bucket_size_limits]
    if not limits or any(limit < 0 for limit in limits):
        raise InvalidArgument(
            f"compute_bucket_assignment_by_size: bucket_size_limits must be a non-empty list "
            f"of byte counts >= 0, got {list(bucket_size_limits)!r}"
        )
    if expect_sparse_gradient is not None and len(expect_sparse_gradient) not in (
        0,
        len(tensors),
    ):
        raise InvalidArgument(
            f"compute_bucket_assignment_by_size: expect_sparse_gradient has "
            f"{len(expect_sparse_gradient)} entries for {len(tensors)} tensors; give one per "
            "tensor or none"
        )
    sparse = list(expect_sparse_gradient or [False] * len(tensors))
    index_of = _tensor_indices(tensor_indices, len(tensors))

    result: list[list[int]] = []
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    limit_index: dict[tuple[torch.dtype, torch.device], int] = {}
    for i, tensor in enumerate(tensors):
        if tensor.is_sparse:
            raise InvalidArgument(
                f"compute_bucket_assignment_by_size: tensor {i} is sparse; bucket the "
                "parameters (dense), and mark sparse gradients with expect_sparse_gradient"
            )
        if sparse[index_of[i]]:
            result.append([index_of[i]])
            continue
        key = (tensor.dtype, tensor.device)
        indices, size = open_buckets.get(key, ([], 0))
        indices.append(index_of[i])
        size += tensor.numel() * tensor.element_size()
        current = limit_index.setdefault(key, 0)
        if size >= limits[current]:
            result.append(indices)
            open_buckets[key] = ([], 0)
            limit_index[key] = min(current + 1, len(limits) - 1)
        else:
            open_buckets[key] = (indices, size)
    if tensor_indices is None:
        result.extend(indices for indices, _ in open_buckets.values() if indices)
        result.sort(key=min)
        return result
    # See Note [Rebuilt buckets are not sorted]: the open buckets in torch's hash-map order.
    for key in unordered_map_order(list(open_buckets)):
        if open_buckets[key][0]:
            result.append(open_buckets[key][0])
    return result


# Note [Rebuilt buckets are not sorted]
# torch's rebuild (Reducer::rebuild_buckets) buckets the parameters in the order their
# gradients became ready, passing their indices as ``tensor_indices``, and keeps the buckets
# in the order they come out: each bucket as it closes (a sparse one where its parameter
# comes), then the buckets still open at the end, one per (dtype, device) key, in the order
# its C++ hash map iterates the keys (reducer._map_order; for a few float dtypes on one
# device: the last key seen first). tests/test_buckets.py checks it against torch's
# ``_compute_bucket_assignment_by_size``. So a bucket left
# open (the last of its key) is reduced after every bucket that closed, even one whose
# gradients became ready later; sorting would reorder what torch's comm hooks see.


def _tensor_indices(tensor_indices: Sequence[int] | None, count: int) -> list[int]:
    """Each tensor's index (its position where ``tensor_indices`` is None), checked."""
    if tensor_indices is None:
        return list(range(count))
    indices = [int(i) for i in tensor_indices]
    if sorted(indices) != list(range(count)):
        raise InvalidArgument(
            f"compute_bucket_assignment_by_size: tensor_indices must order the {count} "
            f"tensors' indices 0 to {count - 1}, each once, got {list(tensor_indices)!r}"
        )
    return indices


def ddp_bucket_assignment(
    params: Sequence[Tensor],
    *,
    bucket_cap_mb: float = 25.0,
    first_bucket_mb: float = 1.0,
    expect_sparse_gradient: Sequence[bool] | None = None,
) -> list[list[int]]:
    """The assignment torch's DDP starts with: by size in parameter order, buckets reversed.

    Parameters are bucketed in the order they are defined, the first bucket holding up to
    ``first_bucket_mb`` and the others up to ``bucket_cap_mb``; then the list of buckets is
    reversed, because gradients of the last layers are ready first in backward. So the small
    bucket, holding the first layers, is reduced last: little communication is left once
    backward ends. This is ``torch.distributed._compute_bucket_assignment_by_size`` followed
    by ``reversed``, exactly as ``torch.nn.parallel.DistributedDataParallel`` builds its
    reducer with ``find_unused_parameters=True`` and no static graph (torch 2.13 passes a
    first bucket smaller than the cap only for the default cap; without the search, or with
    a static graph, it starts with one bucket per dtype and device for the whole model).
    """
    if not bucket_cap_mb > 0 or not first_bucket_mb > 0:
        raise InvalidArgument(
            f"bucket sizes must be > 0 MiB, got bucket_cap_mb={bucket_cap_mb!r}, "
            f"first_bucket_mb={first_bucket_mb!r}"
        )
    limits = [int(first_bucket_mb * (1 << 20)), int(bucket_cap_mb * (1 << 20))]
    return list(reversed(compute_bucket_assignment_by_size(params, limits, expect_sparse_gradient)))


def sparse_gradient_flags(module: nn.Module, params: Sequence[Tensor]) -> list[bool]:
    """Which of ``params`` get sparse gradients: those of ``nn.Embedding(sparse=True)`` and
    ``nn.EmbeddingBag(sparse=True)`` in ``module`` (each needs a bucket of its own)."""
    sparse_ids = {
        id(p)
        for m in module.modules()
        if isinstance(m, nn.Embedding | nn.EmbeddingBag) and m.sparse
        for p in m.parameters(recurse=False)
    }
    return [id(p) in sparse_ids for p in params]


# --------------------------------------------------------------------------------------------
# The reducer's bucket layout.


@dataclass(frozen=True, slots=True)
class Locator:
    """Where a parameter's gradient lives: its bucket, and its position within that bucket."""

    bucket_index: int
    intra_bucket_index: int


# Note [Division fused into the copy]
# A bucket replica's contents are divided by the world size once complete (or multiplied by
# its reciprocal: see Note [Gradient scaling] in reducer.bucket_views). For a large
# parameter that is a second pass over its bytes, so its gradient is instead divided while it
# is copied in (``torch.div(grad, W, out=view)``: the same bits as a copy then ``div_``). Runs of
# small parameters are copied as they are and divided together when the replica completes:
# one op for a run beats one op per parameter. ``fused[i]`` says which way parameter i goes;
# ``scale_runs`` are the views that still need dividing at completion. With
# gradient_as_bucket_view a large gradient is already in its view and is divided there at its
# hook (``view.div_(W)``), as torch's reducer divides each view at its hook: dividing a large
# bucket as a whole at completion would put a pass over all of it between the bucket's last
# gradient and its launch.
FUSED_DIVISION_MIN_NUMEL = 1 << 16


@dataclass(slots=True)
class BucketReplica:
    """One model replica's part of a bucket.

    Dense: ``contents`` is one flat tensor; parameter ``i`` of the bucket occupies
    ``contents[offsets[i] : offsets[i] + lengths[i]]``, seen with its own shape as ``views[i]``.
    Sparse (one parameter): ``contents`` is set each iteration to the scaled sparse gradient.
    ``pending`` counts the parameters not yet ready in the current iteration.
    """

    variables: list[Tensor]
    contents: Tensor
    offsets: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    views: list[Tensor] = field(default_factory=list)
    fused: list[bool] = field(default_factory=list)
    scale_runs: list[Tensor] = field(default_factory=list)
    pending: int = 0
    # Bucket views: small views scaled at their own hook in the current iteration. See Note
    # [Bucket views scaled by runs] in reducer.reducer.
    scaled_at_hook: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Bucket:
    """Parameters reduced together by one allreduce (of every replica's contents)."""

    index: int
    variable_indices: list[int]
    replicas: list[BucketReplica]
    expect_sparse_gradient: bool
    pending: int = 0  # replicas not yet complete in the current iteration
    work: Work | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of one replica's dense contents (0 for a sparse bucket)."""
        if self.expect_sparse_gradient:
            return 0
        contents = self.replicas[0].contents
        return contents.numel() * contents.element_size()


def validate_bucket_indices(
    bucket_indices: object, variable_count: int, names: Sequence[str] | None
) -> list[list[int]]:
    """``bucket_indices`` as lists of ints, each parameter in exactly one non-empty bucket."""
    if isinstance(bucket_indices, Tensor | str) or not isinstance(bucket_indices, Sequence):
        raise BucketAssignmentError(
            f"bucket_indices must be a list of lists of parameter indices, got "
            f"{type(bucket_indices).__name__}"
        )
    owner: dict[int, int] = {}
    result = []
    for b, bucket in enumerate(bucket_indices):
        if isinstance(bucket, Tensor | str) or not isinstance(bucket, Sequence) or not bucket:
            raise BucketAssignmentError(
                f"bucket {b} is empty or not a list; every bucket needs at least one parameter "
                "index (drop empty buckets)"
            )
        indices = []
        for raw in bucket:
            if isinstance(raw, bool) or not isinstance(raw, int):
                raise BucketAssignmentError(
                    f"bucket {b} holds {raw!r}, not a parameter index (an int)"
                )
            if not 0 <= raw < variable_count:
                raise BucketAssignmentError(
                    f"bucket {b} holds parameter index {raw}, out of range: the model has "
                    f"{variable_count} parameters (0 to {variable_count - 1})"
                )
            if raw in owner:
                where = "twice in" if owner[raw] == b else f"in bucket {owner[raw]} and"
                raise BucketAssignmentError(
                    f"{describe_param(raw, names)} is {where} bucket {b}; each parameter must "
                    "be in exactly one bucket"
                )
            owner[raw] = b
            indices.append(raw)
        result.append(indices)
    missing = [i for i in range(variable_count) if i not in owner]
    if missing:
        shown = ", ".join(describe_param(i, names) for i in missing[:10])
        raise BucketAssignmentError(
            f"{shown}{' and more' if len(missing) > 10 else ''} "
            f"{'is' if len(missing) == 1 else 'are'} in no bucket; every parameter must be in "
            "exactly one (compute_bucket_assignment_by_size gives a valid assignment)"
        )
    return result


def build_buckets(
    replicas: list[list[Tensor]],
    bucket_indices: list[list[int]],
    expect_sparse: list[bool],
    names: Sequence[str] | None,
    *,
    fuse_division: bool = True,
) -> tuple[list[Bucket], list[Locator]]:
    """Allocate each bucket's per-replica contents and views; locate every parameter.

    ``fuse_division=False`` divides every bucket as a whole at completion (no parameter is
    scaled at its own hook; see Note [Division fused into the copy]).
    """
    buckets: list[Bucket] = []
    locators: list[Locator | None] = [None] * len(replicas[0])
    for b, indices in enumerate(bucket_indices):
        sparse = [i for i in indices if expect_sparse[i]]
        if sparse and len(indices) > 1:
            raise BucketAssignmentError(
                f"bucket {b} holds {describe_param(sparse[0], names)}, which expects a sparse "
                f"gradient, together with {len(indices) - 1} other parameter(s); a parameter "
                "with a sparse gradient needs a bucket of its own"
            )
        if not sparse:
            _check_same_layout(replicas, indices, names)
        bucket_replicas = [
            _sparse_replica(replica, indices[0])
            if sparse
            else _dense_replica(replica, indices, b, names, fuse_division)
            for replica in replicas
        ]
        buckets.append(Bucket(b, list(indices), bucket_replicas, bool(sparse)))
        for intra, i in enumerate(indices):
            locators[i] = Locator(b, intra)
    assert all(loc is not None for loc in locators)  # validate_bucket_indices guarantees it
    return buckets, [loc for loc in locators if loc is not None]


Slot = tuple[Bucket, BucketReplica, int]


def slots(buckets: list[Bucket], locators: list[Locator], replicas: int) -> list[list[Slot]]:
    """Per replica and parameter: its bucket, bucket replica and position there (the
    reducer's lookup at every hook)."""
    return [
        [
            (
                buckets[loc.bucket_index],
                buckets[loc.bucket_index].replicas[r],
                loc.intra_bucket_index,
            )
            for loc in locators
        ]
        for r in range(replicas)
    ]


def _check_same_layout(
    replicas: list[list[Tensor]], indices: list[int], names: Sequence[str] | None
) -> None:
    """Replicas are reduced element by element: a parameter's strides must agree across
    them. See Note [Bucket views follow the parameter's strides]."""
    for r, replica in enumerate(replicas[1:], start=1):
        for i in indices:
            if replica[i].stride() != replicas[0][i].stride():
                raise InvalidArgument(
                    f"{describe_param(i, names)} has strides {replica[i].stride()} in replica "
                    f"{r} but {replicas[0][i].stride()} in replica 0; replicas must have the "
                    "same memory layout (convert every replica alike, e.g. "
                    ".to(memory_format=torch.channels_last))"
                )


def _dense_replica(
    replica: list[Tensor],
    indices: list[int],
    bucket: int,
    names: Sequence[str] | None,
    fuse_division: bool,
) -> BucketReplica:
    first = replica[indices[0]]
    for i in indices[1:]:
        param = replica[i]
        for what, mine, theirs in (
            ("dtype", param.dtype, first.dtype),
            ("device", param.device, first.device),
        ):
            if mine != theirs:
                raise MixedBucketError(
                    f"bucket {bucket} mixes {what}s: {describe_param(indices[0], names)} is "
                    f"{theirs} but {describe_param(i, names)} is {mine}; a bucket holds one "
                    "dtype on one device (compute_bucket_assignment_by_size keys buckets so)"
                )
    offsets, lengths = [], []
    offset = 0
    for i in indices:
        offsets.append(offset)
        lengths.append(replica[i].numel())
        offset += replica[i].numel()
    contents = torch.zeros(offset, dtype=first.dtype, device=first.device)
    views = [bucket_view(contents, o, replica[i]) for o, i in zip(offsets, indices, strict=True)]
    # See Note [Division fused into the copy].
    fused = [fuse_division and n >= FUSED_DIVISION_MIN_NUMEL for n in lengths]
    scale_runs = []
    start: int | None = None
    for o, is_fused in zip([*offsets, offset], [*fused, True], strict=True):
        if not is_fused and start is None:
            start = o
        elif is_fused and start is not None:
            scale_runs.append(contents[start:o])
            start = None
    return BucketReplica(
        [replica[i] for i in indices], contents, offsets, lengths, views, fused, scale_runs
    )


def bucket_view(contents: Tensor, offset: int, param: Tensor) -> Tensor:
    """``param``'s slot of ``contents`` (its ``numel`` elements from ``offset``), shaped like
    ``param``. See Note [Bucket views follow the parameter's strides]."""
    if _is_non_overlapping_and_dense(param):
        return contents.as_strided(param.shape, param.stride(), contents.storage_offset() + offset)
    return contents[offset : offset + param.numel()].view(param.shape)


def _is_non_overlapping_and_dense(t: Tensor) -> bool:
    """Its elements fill ``numel`` consecutive memory slots, each once, in some dimension
    order: the strides, sorted, are the running products of the matching sizes (dimensions
    of size 1 aside). torch has no public test for it."""
    expected = 1
    for stride, size in sorted(
        (st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


def _sparse_replica(replica: list[Tensor], index: int) -> BucketReplica:
    return BucketReplica([replica[index]], empty_sparse_like(replica[index]))


def shadow_bucket(bucket: Bucket) -> Bucket:
    """A copy of ``bucket`` with the same layout and zero contents: what a rank whose inputs
    ran out contributes while the others train (DDP's join). Reducing it issues the same
    collective as the bucket itself, and leaves the real contents (which may be .grad) alone."""
    replicas = []
    for replica in bucket.replicas:
        if bucket.expect_sparse_gradient:
            replicas.append(_sparse_replica(replica.variables, 0))
            continue
        contents = torch.zeros_like(replica.contents)
        views = [
            bucket_view(contents, o, param)
            for o, param in zip(replica.offsets, replica.variables, strict=True)
        ]
        offsets, lengths = list(replica.offsets), list(replica.lengths)
        replicas.append(BucketReplica(list(replica.variables), contents, offsets, lengths, views))
    return Bucket(
        bucket.index, list(bucket.variable_indices), replicas, bucket.expect_sparse_gradient
    )


def empty_sparse_like(param: Tensor) -> Tensor:
    """A sparse gradient with no entries, laid out as nn.Embedding's (one sparse dimension)."""
    sparse_dims = min(1, param.dim())
    return torch.sparse_coo_tensor(
        torch.empty((sparse_dims, 0), dtype=torch.int64, device=param.device),
        torch.empty((0, *param.shape[sparse_dims:]), dtype=param.dtype, device=param.device),
        param.shape,
    )
