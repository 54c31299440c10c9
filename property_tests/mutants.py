"""Deliberately broken reducers ("bad machines") that the properties must catch.

Each is the real :class:`reducer.Reducer` with one seeded bug, in one overridden method, so a
property that lets any of them pass is too weak. ``MUTANTS`` maps a short name to the class:
the bugs of one synced iteration, caught by the exact-averaging properties (1-3).
``TRAINING_MUTANTS``, ``BUCKETING_MUTANTS`` and ``MISUSE_MUTANTS`` are the bugs that the
multi-iteration (4), torch-equivalence (5) and error (6) properties exist for.

The mutants reach into the reducer's private state on purpose; if it is renamed, a mutant
stops being broken and ``test_mutants.py`` says so (the property no longer fails).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

import reducer
from reducer.buckets import Bucket


class SkipDivide(reducer.Reducer):
    """Never divides by the world size: the sum instead of the average."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._divisor = 1


class OffByOneOffset(reducer.Reducer):
    """Every parameter after the first of a bucket sits one element too early."""

    def initialize_buckets(self, bucket_indices: list[list[int]]) -> None:
        super().initialize_buckets(bucket_indices)
        for bucket in self._buckets:
            if bucket.expect_sparse_gradient:
                continue
            for replica in bucket.replicas:
                for i in range(1, len(replica.views)):
                    start = replica.offsets[i] - 1
                    shape = replica.variables[i].shape
                    replica.views[i] = replica.contents[start : start + replica.lengths[i]].view(
                        shape
                    )


class LaunchOutOfOrder(reducer.Reducer):
    """Launches each bucket as soon as it is ready, ignoring the index order."""

    def _mark_bucket_ready(self, bucket_index: int) -> None:
        self._launch(self._buckets[bucket_index])
        self._next_bucket += 1


class _Done:
    """A work that is already complete: its result is the local contents."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self._tensors = tensors

    def wait(self, timeout: float | None = None) -> None:
        pass

    def is_completed(self) -> bool:
        return True

    def result(self) -> list[Tensor]:
        return self._tensors


class _NoWait:
    """Wraps a real work but does not wait for it."""

    def __init__(self, work: reducer.Work) -> None:
        self._work = work

    def wait(self, timeout: float | None = None) -> None:
        pass

    def is_completed(self) -> bool:
        return True

    def result(self) -> list[Tensor]:
        return self._work.result()


class ForgetToWait(reducer.Reducer):
    """Finalize reads the buckets without waiting for their allreduce."""

    def _launch(self, bucket: Bucket) -> None:
        super()._launch(bucket)
        assert bucket.work is not None
        bucket.work = _NoWait(bucket.work)


class DropLastBucket(reducer.Reducer):
    """Never reduces the last bucket (it keeps the local, divided gradients)."""

    def _launch(self, bucket: Bucket) -> None:
        if bucket.index == len(self._buckets) - 1:
            bucket.work = _Done([r.contents for r in bucket.replicas])
        else:
            super()._launch(bucket)


class GloballyUnusedAsZero(reducer.Reducer):
    """Treats a parameter unused on every rank as used: writes zeros into its .grad."""

    def _launch_used_map(self) -> None:
        super()._launch_used_map()
        assert self._used_map is not None
        work, used = self._used_map
        work.wait()
        used.fill_(1)
        self._used_map = (_Done([used]), used)


class LoseAccumulated(reducer.Reducer):
    """Forgets that a parameter got a gradient while hooks were not expected (no_sync
    steps): if the synced step does not use it, what it accumulated is not contributed."""

    def _autograd_hook(self, replica_index: int, index: int) -> None:
        if self._expect_autograd_hooks:
            super()._autograd_hook(replica_index, index)
            return
        was_used = self._used[replica_index][index]
        super()._autograd_hook(replica_index, index)
        self._used[replica_index][index] = was_used


class ReduceOnlyReplicaZero(reducer.Reducer):
    """Allreduces replica 0 only; the other replicas keep their local contents."""

    def _launch(self, bucket: Bucket) -> None:
        bucket.work = self._process_group.allreduce([bucket.replicas[0].contents])
        others = [r.contents for r in bucket.replicas[1:]]
        if bucket.expect_sparse_gradient:
            real = bucket.work
            bucket.work = _Prepend(real, others)


class _Prepend:
    """A sparse bucket's result list for all replicas, from a work over replica 0 only."""

    def __init__(self, work: reducer.Work, others: list[Tensor]) -> None:
        self._work = work
        self._others = others

    def wait(self, timeout: float | None = None) -> None:
        self._work.wait(timeout)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def result(self) -> list[Tensor]:
        return self._work.result()[:1] + [torch.Tensor.coalesce(t) for t in self._others]


class KeepLocallyUsed(reducer.Reducer):
    """Never clears the per-iteration "locally used" map: a parameter used in one iteration
    still counts as used in the next ones."""

    def _finalize_backward(self) -> None:
        used = [list(per_replica) for per_replica in self._used]
        super()._finalize_backward()
        self._used = used


class VagueErrors(reducer.Reducer):
    """Every misuse during training raises a bare RuntimeError that names nothing."""

    def _fail(self, error: BaseException) -> BaseException:
        super()._fail(error)
        return RuntimeError("reduction failed")


class AcceptInvalidBuckets(reducer.Reducer):
    """Silently replaces an invalid bucket assignment with one bucket per parameter."""

    def initialize_buckets(self, bucket_indices: list[list[int]]) -> None:
        try:
            super().initialize_buckets(bucket_indices)
        except reducer.BucketAssignmentError:
            super().initialize_buckets([[i] for i in range(len(self._replicas[0]))])


Assign = Callable[[Sequence[Tensor], Sequence[int], Sequence[bool] | None], list[list[int]]]
_assign = reducer.compute_bucket_assignment_by_size


def _close_above_limit(
    tensors: Sequence[Tensor], limits: Sequence[int], sparse: Sequence[bool] | None
) -> list[list[int]]:
    """Closes a bucket only once it exceeds the limit (``>`` for ``>=``)."""
    return _assign(tensors, [limit + 1 for limit in limits], sparse)


def _first_limit_only(
    tensors: Sequence[Tensor], limits: Sequence[int], sparse: Sequence[bool] | None
) -> list[list[int]]:
    """Never moves on to the next limit."""
    return _assign(tensors, limits[:1], sparse)


def _sparse_not_alone(
    tensors: Sequence[Tensor], limits: Sequence[int], sparse: Sequence[bool] | None
) -> list[list[int]]:
    """Ignores the sparse flags: a sparse-gradient tensor shares a bucket."""
    return _assign(tensors, limits, None)


def _unsorted(
    tensors: Sequence[Tensor], limits: Sequence[int], sparse: Sequence[bool] | None
) -> list[list[int]]:
    """Returns the buckets last first instead of sorted by their smallest index."""
    return _assign(tensors, limits, sparse)[::-1]


MUTANTS: dict[str, type[reducer.Reducer]] = {
    "skip the divide": SkipDivide,
    "off-by-one bucket offset": OffByOneOffset,
    "launch out of order": LaunchOutOfOrder,
    "forget to wait": ForgetToWait,
    "drop the last bucket": DropLastBucket,
    "globally unused as zero": GloballyUnusedAsZero,
    "lose accumulated gradients": LoseAccumulated,
    "reduce only replica 0": ReduceOnlyReplicaZero,
}

TRAINING_MUTANTS: dict[str, type[reducer.Reducer]] = {
    "stale locally-used map": KeepLocallyUsed,
}

BUCKETING_MUTANTS: dict[str, Assign] = {
    "close a bucket above the limit": _close_above_limit,
    "never move to the next limit": _first_limit_only,
    "sparse gradients not alone": _sparse_not_alone,
    "buckets unsorted": _unsorted,
}

MISUSE_MUTANTS: dict[str, type[reducer.Reducer]] = {
    "vague errors": VagueErrors,
    "accept invalid buckets": AcceptInvalidBuckets,
}
