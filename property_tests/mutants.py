"""Deliberately broken reducers ("bad machines") that the properties must catch.

Each is the real :class:`reducer.Reducer` with one seeded bug, in one overridden method, so a
property that lets any of them pass is too weak. ``MUTANTS`` maps a short name to the class.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

import reducer
from reducer.buckets import Bucket


class SkipDivide(reducer.Reducer):
    """Never divides by the world size: the sum instead of the average."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._world_size = 1


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
    """Forgets gradients accumulated while hooks were not expected (no_sync steps)."""

    def _autograd_hook(self, replica_index: int, index: int) -> None:
        if not self._expect_autograd_hooks:
            return
        super()._autograd_hook(replica_index, index)


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
