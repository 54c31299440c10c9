"""Deliberately broken reducers ("bad machines") that the properties must catch.

Each :class:`Mutant` is the real code with one realistic, seeded bug: a subclass of
:class:`reducer.Reducer`, :class:`reducer.DistributedDataParallel` or the reducer's
``BucketViews`` overriding one method, a replacement for one function that ``reducer.reducer``,
``reducer.graph``, ``reducer.ddp``, ``reducer.buckets``, ``reducer.hooks`` or DDP's mixed
precision calls (or DDP's reducer class, or the wrapper's unpickling), a
broken ``compute_bucket_assignment_by_size``, a broken piece of the fake world (its
reduce_scatter, its per-rank random streams), a broken comm hook of torch's own (run by
torch's DDP), or a broken piece of a tool (launch's pre-import, the replica check's
comparison, its choice of what to compare, its diagnosis).
:func:`applied` puts one in place of the real code for everything that looks it up at call
time (the properties do), so a property that lets any of them pass is too weak.
:data:`CATALOGUE` holds them all, by short name, grouped by what they break: averaging, unused
parameters, accumulation, comm hooks, checkpointing and higher-order backward, the DDP
wrapper's outputs, buckets, buffers, ignored parameters, join and construction options,
teardown, bucket assignment and errors, the fake world, torch's comm hooks, the tools.

``property_tests/test_mutants.py`` checks, within CI's time, that each is caught and shrunk
by the property meant for it, on a narrowed search; ``benchmarks/harness_power.py`` runs the
whole property suite against each and measures which property kills it, how fast, and how
small the reported example is.

The catalogue keeps the bugs mutmut cannot write as one of its own mutants (an order of
events between threads, a protocol across methods or modules, a change of several
statements, or one outside mutmut's operators); those it can are measured by its run,
``benchmarks/mutation_score.py`` (docs/design/mutation-testing.md, "Hand-written mutants the
tool expresses").

The mutants reach into private state and functions on purpose; if one is renamed, the mutant
stops being broken (or fails to apply) and ``test_mutants.py`` says so.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import Tensor
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import fakepg._schedule.explore
import fakepg._schedule.probe
import fakepg._schedule.timeline
import fakepg.clusterfile
import fakepg.collectives
import fakepg.rng
import fakepg.schedule
import fakepg.streams
import reducer
import reducer.bucket_views
import reducer.buckets
import reducer.ddp._join
import reducer.ddp._mixed_precision
import reducer.ddp._reducer
import reducer.ddp._setup
import reducer.ddp._wrapper
import reducer.graph
import reducer.hooks._default
import reducer.reducer
import reducer.testing._arguments
import reducer.testing._judge
import reducer.testing._run
import reducer.testing.algorithms
import reducer.testing.checks
import reducer.testing.strategies
import reducer.tools.check
import reducer.tools.check._audit
from reducer.bucket_views import BucketViews
from reducer.buckets import Bucket, BucketReplica

# The real code, captured at import: the mutants subclass and call these, whatever is applied.
_Reducer = reducer.Reducer
_DDPReducer = reducer.ddp._reducer.DDPReducer
_DDP = reducer.DistributedDataParallel
_assign = reducer.compute_bucket_assignment_by_size
_copy_all = reducer.bucket_views.copy_all
_replace_tensors = reducer.ddp._wrapper.replace_tensors
_read_buffers = reducer.ddp._wrapper.read_buffers
_synced_parameters = reducer.ddp._wrapper.synced_parameters
_named_buffers = reducer.ddp._wrapper.named_buffers
_mesh_group = reducer.ddp._wrapper.mesh_group
_bucket_limits = reducer.ddp._setup.bucket_limits
_ReplicaCheck = reducer.tools.check.ReplicaCheck
_waste = reducer.tools.check._audit._waste
_same = reducer.testing._judge._same
_bucket_view = reducer.buckets.bucket_view
_mp_setup = reducer.ddp._mixed_precision.setup
_compress_wrapper = reducer.hooks._default._compress_wrapper
_reduce_scatter_tasks = fakepg.collectives.reduce_scatter_tasks
_torch_fp16_hook = default_hooks.fp16_compress_hook
_rank_stream = fakepg.rng.rank_stream
_Scheduler = fakepg.schedule._Scheduler
_StreamOrder = fakepg.streams.StreamOrder
_Hierarchical = reducer.testing.algorithms._Hierarchical
_judge_one = reducer.testing._judge._judge_one
_Pct = fakepg._schedule.explore.Pct


# -------------------------------------------------------------------------------------------
# Averaging.


class SkipDivide(_Reducer):
    """Never divides by the world size: the sum instead of the average."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._divisor = 1


class DivideByContributions(_Reducer):
    """Divides by the number of contributions (world size times replicas), not the world
    size: the replicas of a rank are averaged instead of summed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._divisor *= len(self._replicas)
        self._prescale = self._divisor > 1


class DivideLargeTwice(_Reducer):
    """Divides a large gradient on its way into the bucket, and again with the rest of the
    bucket at completion."""

    def initialize_buckets(self, bucket_indices: list[list[int]]) -> None:
        super().initialize_buckets(bucket_indices)
        for bucket in self._buckets:
            for replica in bucket.replicas:
                if not bucket.expect_sparse_gradient and any(replica.fused):
                    replica.scale_runs = [replica.contents]


class OffByOneOffset(_Reducer):
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


class LaunchOutOfOrder(_Reducer):
    """Launches each bucket as soon as it is ready, ignoring the index order."""

    def _mark_bucket_ready(self, bucket_index: int) -> None:
        self._launch(self._buckets[bucket_index])
        self._next_bucket += 1


class KeepLaunchPointer(_Reducer):
    """Does not reset the next bucket to launch when a new iteration starts."""

    def prepare_for_backward(self, outputs: Sequence[Tensor] = ()) -> None:
        kept = self._next_bucket
        super().prepare_for_backward(outputs)
        self._next_bucket = kept


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


class ForgetToWait(_Reducer):
    """Finalize reads the buckets without waiting for their allreduce."""

    def _launch(self, bucket: Bucket) -> None:
        super()._launch(bucket)
        assert bucket.work is not None
        bucket.work = _NoWait(bucket.work)


class DropLastBucket(_Reducer):
    """Never reduces the last bucket (it keeps the local, divided gradients)."""

    def _launch(self, bucket: Bucket) -> None:
        if bucket.index == len(self._buckets) - 1:
            bucket.work = _Done([r.contents for r in bucket.replicas])
        else:
            super()._launch(bucket)


# -------------------------------------------------------------------------------------------
# Replicas.


class ReduceOnlyReplicaZero(_Reducer):
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


class ReplicasReadReplicaZero(_Reducer):
    """Copies replica 0's gradient into every replica's bucket."""

    def _contribution(self, replica_index: int, index: int, param: Tensor) -> Tensor | None:
        return super()._contribution(0, index, self._replicas[0][index])

    def _copy_replica(self, replica_index: int, bucket: Bucket, replica: BucketReplica) -> None:
        # The batched copy too: replica 0's parameters, this replica's views.
        first = dataclasses.replace(replica, variables=bucket.replicas[0].variables)
        super()._copy_replica(replica_index, bucket, first)


def _write_dense_replica_zero(bucket: Bucket, globally_used: list[int] | None) -> None:
    """Writes the averages into replica 0's ``.grad`` only; the other replicas keep their
    local gradients."""
    grads: list[Tensor] = []
    views: list[Tensor] = []
    replica = bucket.replicas[0]
    for index, param, view in zip(
        bucket.variable_indices, replica.variables, replica.views, strict=True
    ):
        if globally_used is not None and not globally_used[index]:
            continue
        if param.grad is None:
            param.grad = torch.empty_like(param, memory_format=torch.preserve_format)
        grads.append(param.grad)
        views.append(view)
    _copy_all(grads, views)


# -------------------------------------------------------------------------------------------
# Unused parameters and the used map.


class GloballyUnusedAsZero(_Reducer):
    """Treats a parameter unused on every rank as used: writes zeros into its .grad."""

    def _launch_used_map(self) -> None:
        super()._launch_used_map()
        assert self._used_map is not None
        work, used = self._used_map
        work.wait()
        used.fill_(1)
        self._used_map = (_Done([used]), used)


class UsedMapAtPrepare(_Reducer):
    """Takes the used map when the iteration starts, so it misses every use in the synced
    backward itself (only gradients accumulated before count)."""

    def prepare_for_backward(self, outputs: Sequence[Tensor] = ()) -> None:
        super().prepare_for_backward(outputs)
        self._early_used = [any(per_replica) for per_replica in zip(*self._used, strict=True)]

    def _launch_used_map(self) -> None:
        used = torch.tensor(self._early_used, dtype=torch.int32)
        self._used_map = (self._process_group.allreduce([used]), used)


class UsedMapMin(_Reducer):
    """Reduces the used map with MIN: a parameter counts as used only if every rank used it."""

    def _launch_used_map(self) -> None:
        used = torch.tensor(
            [any(per_replica) for per_replica in zip(*self._used, strict=True)], dtype=torch.int32
        )
        self._used_map = (self._process_group.allreduce([used], reducer.ReduceOp.MIN), used)


class ContributeStale(_Reducer):
    """A parameter unused on this rank contributes whatever its .grad holds, not zeros."""

    def _contribution(self, replica_index: int, index: int, param: Tensor) -> Tensor | None:
        grad = param.grad
        return grad if grad is not None and grad.layout == torch.strided else None


class LoseAccumulated(_Reducer):
    """Forgets that a parameter got a gradient while hooks were not expected (no_sync
    steps): if the synced step does not use it, what it accumulated is not contributed."""

    def _autograd_hook(self, replica_index: int, index: int) -> None:
        if self._expect_autograd_hooks:
            super()._autograd_hook(replica_index, index)
            return
        was_used = self._used[replica_index][index]
        super()._autograd_hook(replica_index, index)
        self._used[replica_index][index] = was_used


class KeepLocallyUsed(_Reducer):
    """Never clears the per-iteration "locally used" map: a parameter used in one iteration
    still counts as used in the next ones."""

    def _finalize_backward(self) -> None:
        used = [list(per_replica) for per_replica in self._used]
        super()._finalize_backward()
        self._used = used


# -------------------------------------------------------------------------------------------
# Gradients as bucket views.


class ViewKeepsStale(BucketViews):
    """Bucket views: a parameter unused on this rank whose .grad is its view contributes
    what the view holds (an older gradient), not zeros."""

    def set_aside(self, key: tuple[int, int], param: Tensor, view: Tensor) -> None:
        if param.grad is view:
            return
        super().set_aside(key, param, view)


class KeepOldViews(BucketViews):
    """Bucket views: moves the gradients into views once, at construction; rebuilt buckets
    leave each .grad in the old bucket."""

    def attach(self, buckets: list[Bucket]) -> None:
        if not getattr(self, "_views_attached", False):
            self._views_attached = True
            super().attach(buckets)


def _contiguous_view(contents: Tensor, offset: int, param: Tensor) -> Tensor:
    """A parameter's slot of its bucket, always laid out contiguously: with
    gradient_as_bucket_view a channels_last or transposed parameter gets a ``.grad`` of other
    strides than its own."""
    _bucket_view(contents, offset, param)  # the real one's checks
    return contents[offset : offset + param.numel()].view(param.shape)


# -------------------------------------------------------------------------------------------
# Sparse gradients.


class SparseNotDivided(_Reducer):
    """A sparse gradient's bucket is reduced without dividing it by the world size."""

    def _set_sparse_contents(
        self, replica_index: int, index: int, replica: reducer.buckets.BucketReplica
    ) -> None:
        prescale, self._prescale = self._prescale, False
        try:
            super()._set_sparse_contents(replica_index, index, replica)
        finally:
            self._prescale = prescale


class SparseSkippedContributesStale(_Reducer):
    """A sparse table this rank skipped in the synced step (unused here, used elsewhere)
    contributes the sparse .grad it still holds, not an empty one."""

    def _set_sparse_contents(
        self, replica_index: int, index: int, replica: reducer.buckets.BucketReplica
    ) -> None:
        used = self._used[replica_index]
        was, used[index] = used[index], True
        try:
            super()._set_sparse_contents(replica_index, index, replica)
        finally:
            used[index] = was


class _Everything(set[tuple[int, int]]):
    def __contains__(self, key: object) -> bool:
        return True


class ViewsAlwaysMultiply(BucketViews):
    """Bucket views multiply by 1 / W even where autograd accumulated into the view in
    place (torch divides those): the last bit differs at 3 ranks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fresh = _Everything()

    def attach(self, buckets: list[Bucket]) -> None:
        super().attach(buckets)
        self.fresh = _Everything()


class ViewsScaledTwice(_Reducer):
    """Bucket views: divides every run of small views once the replica is complete, also the
    views already scaled at their hooks (a gradient copied in while multiplied by 1 / W)."""

    def _scale_replica(self, replica: Any) -> None:
        replica.scaled_at_hook.clear()
        super()._scale_replica(replica)


class FusedCopyDivides(_Reducer):
    """A gradient of 2**16 elements or more, scaled on its way into the bucket (the fused
    copy), is divided by W whatever the reducer's scaling: under DDP, which multiplies by
    ``1.0 / W`` as torch's does, its last bit differs at 3 ranks."""

    def _copy_in(self, view: Tensor, grad: Tensor) -> None:
        if grad.numel() >= reducer.buckets.FUSED_DIVISION_MIN_NUMEL:
            torch.div(grad, self._divisor, out=view)
        else:
            super()._copy_in(view, grad)


class JoinDivisorDivides(_Reducer):
    """Under ``join(divide_by_initial_world_size=False)``, the number of ranks still
    training is applied as a division (``g / n``) where the reducer multiplies by ``1/n``
    as torch's does: the last bit differs where three ranks still train."""

    def _set_divisor(self, divisor: int) -> None:
        super()._set_divisor(divisor)
        self._scaling = "divide" if divisor != self._world_size else "reciprocal"


class DivideInDDP(_Reducer):
    """Divides by the world size where torch's DDP multiplies by its reciprocal (every
    reducer divides, DDP's too): the last bit differs at 3 ranks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._scaling = "divide"


# -------------------------------------------------------------------------------------------
# Comm hooks.


class PrescaleWithHook(_Reducer):
    """Still divides each bucket by the world size when a comm hook is registered (which
    divides too)."""

    def register_comm_hook(self, state: object, hook: reducer.CommHook) -> None:
        super().register_comm_hook(state, hook)
        self._prescale = self._divisor > 1


def _compress_after_reducing(dtype: torch.dtype, hook: reducer.CommHook, name: str) -> Any:
    """The compression wrapper runs the wrapped hook on the full-precision buffer and rounds
    its result to the half type afterwards: the reduction is not compressed, and the bits
    are not those of a sum taken in the half type."""
    _compress_wrapper(dtype, hook, name)  # the real argument checks

    def wrapper_hook(state: object, bucket: reducer.GradBucket) -> torch.futures.Future[Tensor]:
        def round_trip(done: torch.futures.Future[Tensor]) -> Tensor:
            value = done.value()
            return value.copy_(value.to(dtype))

        return hook(state, bucket).then(round_trip)

    return wrapper_hook


# -------------------------------------------------------------------------------------------
# torch's own comm hooks (run by torch's DDP on the fake world).


def _torch_allreduce_not_divided(process_group: Any, bucket: Any) -> Any:
    """torch's allreduce hook without its division: the sum, not the average."""
    group = process_group if process_group is not None else dist.group.WORLD
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0])  # type: ignore[union-attr]


def _torch_fp16_sum_in_full(process_group: Any, bucket: Any) -> Any:
    """torch's fp16 compression hook that casts back before the allreduce: each share is
    rounded to float16, but the sum is taken in float32 (no bandwidth saved, other bits)."""
    buffer = bucket.buffer()
    size = dist.get_world_size(process_group)
    buffer.copy_(buffer.to(torch.float16).div_(size))
    work = dist.all_reduce(buffer, group=process_group, async_op=True)
    return work.get_future().then(lambda f: f.value()[0])  # type: ignore[union-attr]


def _torch_fp16_divide_after_sum(process_group: Any, bucket: Any) -> Any:
    """torch's fp16 compression hook as it was before its overflow fix (pytorch#59576): the
    float16 shares are summed undivided and the sum divided afterwards, so gradients whose
    sum passes 65504 come back inf."""
    buffer = bucket.buffer()
    size = dist.get_world_size(process_group)
    compressed = buffer.to(torch.float16)
    work = dist.all_reduce(compressed, group=process_group, async_op=True)
    return work.get_future().then(  # type: ignore[union-attr]
        lambda f: buffer.copy_(f.value()[0].div_(size))
    )


for _hook, _typed in (
    (_torch_allreduce_not_divided, _torch_fp16_hook),
    (_torch_fp16_sum_in_full, _torch_fp16_hook),
    (_torch_fp16_divide_after_sum, _torch_fp16_hook),
):
    # torch's DDP checks a hook's annotations; this module's are strings.
    _hook.__annotations__ = dict(_typed.__annotations__)


# -------------------------------------------------------------------------------------------
# The fake world's collectives (under torch's FSDP2).


def _reduce_scatter_reversed(
    inputs: list[list[Tensor]], outputs: list[Tensor], op: reducer.ReduceOp, max_parts: int
) -> list[Any]:
    """reduce_scatter hands rank r the reduction of every rank's chunk ``W - 1 - r`` (the
    chunks counted from the other end), not chunk r."""
    return _reduce_scatter_tasks([per_src[::-1] for per_src in inputs], outputs, op, max_parts)


def _one_stream_for_all(streams: Any, rank: int) -> Any:
    """Every rank thread draws from rank 0's generator: a rank's ``torch.manual_seed`` reseeds
    the others, and their dropout masks interleave by thread timing."""
    return _rank_stream(streams, 0)


# -------------------------------------------------------------------------------------------
# The fake world's controlled scheduler.


class IgnoreChoices(_Scheduler):
    """The scheduler reads every choice as 0: each run takes the natural order, whatever the
    schedule says, so no schedule shows a race that the natural order hides."""

    def _choose_locked(self, options: list[tuple[str, Any]]) -> tuple[int, tuple[int, int] | None]:
        super()._choose_locked(options)  # consumes the choice, as the real one does
        return 0, None


class OldestFirst(_Scheduler):
    """A decision to complete a collective completes the oldest ready one, whichever the
    schedule drew: collectives in flight together always complete in issue order."""

    def _complete_locked(self, ready: Any) -> Any:
        return super()._complete_locked(self._ready[0])


def _replay_without_policy(taken: Sequence[int], schedule: Any) -> Any:
    """A run's decisions replayed in the early completion policy, whatever the run's was: a
    late-policy run, pasted back, takes other options."""
    return fakepg.schedule.Schedule(list(taken))


class PctEarlyChanges(_Pct):
    """PCT's change points drawn only among the first 8 choice points: a run whose race
    follows a constructor's broadcasts never sees a priority change there."""

    def change_points(self) -> list[int]:
        return sorted(self.draws.draw(min(8, self.horizon.steps)) for _ in range(self.depth - 1))


class CompleteAtOnce(_Scheduler):
    """A collective completes the moment its last rank issues it, not when a decision says
    so: as if a collective were never in flight, so no rank ever reads a tensor early."""

    def issued(self, what: str, tensors: str, complete: Callable[[], None] | None) -> None:
        if complete is not None:
            complete()
        super().issued(what, tensors, None)


# -------------------------------------------------------------------------------------------
# Nested and higher-order backward.


def _finalize_on_current_task(callback: Callable[[], None]) -> None:
    """Queues finalize on the backward pass running now, which a reentrant checkpoint's
    inner backward is: finalize runs before the outer backward's later gradients."""
    engine: Any = torch.autograd.Variable._execution_engine
    engine.queue_callback(callback)


def _hook_in_grad_mode(reducer_ref: Any, replica_index: int, index: int, _param: Tensor) -> None:
    """Runs the reducer's hook in whatever grad mode autograd runs hooks in: under
    ``backward(create_graph=True)``, its copies and in-place division are recorded."""
    red = reducer_ref()
    if red is not None:
        red._autograd_hook(replica_index, index)


class MarkReadyTwiceSilently(_Reducer):
    """A parameter marked ready again in the same iteration is ignored, not an error."""

    def _mark_variable_ready(self, replica_index: int, index: int) -> None:
        if self._ready[replica_index][index]:
            return
        super()._mark_variable_ready(replica_index, index)


# -------------------------------------------------------------------------------------------
# Static graph.


class StaticForgetsUnused(_Reducer):
    """Static graph: after the first iteration, the parameters it found unused are not
    marked ready any more."""

    def prepare_for_backward(self, outputs: Sequence[Tensor] = ()) -> None:
        super().prepare_for_backward(outputs)
        if self._static.remaining is not None:
            self._unused, self._unused_set = [], set()


class StaticReadyAtFirstCall(_Reducer):
    """Static graph: a parameter is ready at its first hook call, however many the first
    iteration counted (reentrant checkpointing fires some hooks several times)."""

    def prepare_for_backward(self, outputs: Sequence[Tensor] = ()) -> None:
        super().prepare_for_backward(outputs)
        remaining = self._static.remaining
        if remaining is not None:
            self._static.remaining = [[min(c, 1) for c in counts] for counts in remaining]


# -------------------------------------------------------------------------------------------
# The DDP wrapper: outputs, buckets, no_sync.


class LeftOutHeadsUsed(_Reducer):
    """Parameters reached only by outputs the loss leaves out count as used (with their
    stale .grad, or zeros), not as unused."""

    def _expect_no_gradient(self, *outputs: Sequence[Tensor]) -> None:
        pass


def _find_top_level_tensors(obj: Any) -> list[Tensor]:
    """Finds the output tensor, or the tensors of a flat list or tuple; nothing in dicts,
    namedtuple fields nested deeper, dataclasses or nested containers."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, list | tuple):
        return [o for o in obj if isinstance(o, Tensor)]
    return []


def _replace_but_dicts(obj: Any, replacement: dict[int, Tensor]) -> Any:
    """Rebuilds the outputs with the sink's tensors, except inside dicts (left as they are,
    so the loss bypasses the sink there)."""
    if isinstance(obj, dict):
        return obj
    return _replace_tensors(obj, replacement)


class JoinedRankUsesEverything(_Reducer):
    """A rank that has run out of inputs (join) reports every parameter as used in the steps
    it shadows: a parameter no training rank used gets a zero gradient, not left alone."""

    def _shadow_iteration(self, *, used_map: bool) -> None:
        super()._shadow_iteration(used_map=False)
        if used_map:
            used = torch.ones(len(self._replicas[0]), dtype=torch.int32)
            self._process_group.allreduce([used]).wait()


class IgnoreSyncToggle(_DDP):
    """Reduces at every forward with grad enabled: ``require_backward_grad_sync = False``
    (and so ``no_sync()``) is ignored."""

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        self.require_backward_grad_sync = True
        return super().forward(*inputs, **kwargs)


class OnlyNoSyncAccumulates(_DDP):
    """Accumulates only inside ``no_sync()``: ``require_backward_grad_sync = False`` set by
    hand (as nanoGPT's train.py does) is ignored, and that micro-batch reduces too."""

    _inside_no_sync = False

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self._inside_no_sync = True
        try:
            with super().no_sync():
                yield
        finally:
            self._inside_no_sync = False

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if not self._inside_no_sync:
            self.require_backward_grad_sync = True
        return super().forward(*inputs, **kwargs)


class SyncBuffersAtEveryForward(_DDP):
    """Syncs buffers at every forward, not only after a synced one: the synced micro-batch
    after ``no_sync()`` ones starts from rank 0's buffers, where torch's DDP leaves each
    rank its own."""

    def _sync_buffers(self, *, candidate: bool) -> None:
        self.require_forward_param_sync = True
        super()._sync_buffers(candidate=candidate)


class HeldGradNotContributed(_DDPReducer):
    """A parameter found unused on this rank contributes zeros, not the ``.grad`` it holds:
    the average an earlier synced micro-batch of the step left there is dropped from the
    next reduction (torch's DDP reduces it again)."""

    _unused_contribute_held = False


def _by_hand_forgotten(model: torch.nn.Module, loss: Any, args: Any) -> None:
    """Accumulation by hand that forgets the unsynced micro-batch: its gradients are
    computed past the wrapper and never added into ``.grad``."""
    inner = getattr(model, "module", model)
    params = [p for p in inner.parameters() if p.requires_grad]
    torch.autograd.grad(loss(inner(*args)), params, allow_unused=True)


class ReaveragesUntouchedGrad(reducer.testing.algorithms._GroupAverage):
    """DDP's reference averages again, at a later sync of the step, a .grad no backward gave
    anything since the last sync (it reduces wherever some rank holds a gradient): torch's
    DDP leaves it as it is."""

    def _reduces(self, hooked: bool, views: bool, chains: Any) -> bool:
        return reducer.testing.algorithms._held(chains)


def _shard_evenly(tensor: Tensor, rank: int, world_size: int) -> Tensor:
    """The FSDP2 reference shards with ``torch.tensor_split`` (rows spread as evenly as
    possible), not ``torch.chunk`` as FSDP2 does (ceil(n / W) rows each, the last ranks
    short or empty): 4 rows over 3 ranks become 2, 1, 1 instead of 2, 2, 0."""
    if tensor.dim() == 0:
        return tensor
    return torch.tensor_split(tensor, world_size, dim=0)[rank]


class RebuildFromOwnOrder(_DDP):
    """Rebuilds the buckets in this rank's own ready order, without taking rank 0's."""

    def _rebuild_buckets(self) -> None:
        ready_order = self.reducer.ready_order
        rebuilt = _assign(
            [self._params[i] for i in ready_order], self._rebuild_limits, self._sparse, ready_order
        )
        self.reducer.initialize_buckets(rebuilt)
        self._buckets_rebuilt = True


def _first_iteration_by_cap(
    bucket_cap_mb: float | None,
    bucket_cap_mb_list: Sequence[float] | None,
    *,
    static_graph: bool,
    find_unused_parameters: bool,
) -> tuple[float, list[int], list[int]]:
    """Buckets the first iteration by the caps, as after the rebuild, even where torch holds
    every parameter in one bucket until then (no search for unused parameters, or a static
    graph)."""
    cap, _, rebuild = _bucket_limits(
        bucket_cap_mb,
        bucket_cap_mb_list,
        static_graph=static_graph,
        find_unused_parameters=find_unused_parameters,
    )
    return cap, rebuild, rebuild


def _rebuilt_sorted(
    tensors: Sequence[Tensor],
    limits: Sequence[int],
    sparse: Sequence[bool] | None = None,
    tensor_indices: Sequence[int] | None = None,
) -> list[list[int]]:
    """Sorts the rebuilt buckets by their first ready parameter, where torch keeps them as
    they come out (the open ones last, in its hash map's order)."""
    buckets = _assign(tensors, limits, sparse, tensor_indices)
    if tensor_indices is None:
        return buckets
    position = {index: i for i, index in enumerate(tensor_indices)}
    return sorted(buckets, key=lambda bucket: min(position[i] for i in bucket))


class ReloadReducesIgnored(_DDP):
    """Once unpickled, lists its parameters again from the module, forgetting the ones it
    was told to ignore: the reloaded wrapper averages their gradients."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        module: torch.nn.Module = state["_modules"]["module"]
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        state = {
            **state,
            "_param_names": [n for n, _ in named],
            "_params": params,
            "_sparse": reducer.buckets.sparse_gradient_flags(module, params),
        }
        super().__setstate__(state)


class ReloadForgetsStaticGraph(_DDP):
    """Once unpickled, a ``static_graph=True`` wrapper builds its new reducer without the
    static graph (the flag is kept, the reducer not told): a parameter that then gets no
    gradient is waited for, and the next step finds the reduction unfinished."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__({**state, "static_graph": False})
        self.static_graph = bool(state.get("static_graph", False))


class ShadowStaticUsedMapAlways(reducer.ddp._join.DDPJoinHook):
    """Under join, a rank that ran out shadows every iteration of a static graph with a used
    map, as in its first (recording) iteration: the ranks still training reduce none after
    it, and their collectives no longer match."""

    def main_hook(self) -> None:
        ddp: Any = self._ddp
        synced = reducer.ddp._join._count(ddp._group, ddp.join_device, 0.0) > 0
        if synced and ddp._should_rebuild():
            ddp._rebuild_buckets()
        ddp._sync_buffers(candidate=False)
        if not synced:
            return
        searched = ddp.find_unused_parameters and not ddp.static_graph
        ddp.reducer._shadow_iteration(used_map=searched or ddp.static_graph)
        ddp._shadowed += 1


class SkipPartlyUnusedBucket(_DDPReducer):
    """With ``skip_all_reduce_unused_params``, skips a bucket where any of its parameters is
    unused, not only where all are: the used ones keep their local, unaveraged gradients."""

    def _launch(self, bucket: Bucket) -> None:
        if bucket.index == 0:
            self._reducing = 0
        if (
            self.skip_all_reduce_unused_params
            and self._expect_autograd_hooks
            and any(
                (0, i) in self._unused_set and not self._used[0][i] for i in bucket.variable_indices
            )
        ):
            bucket.work = reducer.ddp._reducer._Kept([r.contents for r in bucket.replicas])
        else:
            self._reducing += 1
            _Reducer._launch(self, bucket)
        if bucket.index == len(self._buckets) - 1:
            self.buckets_reduced = self._reducing


class SkipForgetsNoSync(_DDPReducer):
    """With ``skip_all_reduce_unused_params``, a bucket unused in the synced pass counts as
    skippable even where this rank accumulated gradients into it under ``no_sync``: what
    the rank computed stays local, never averaged."""

    def _local_skips(self) -> list[int]:
        return [
            2 if all((0, i) in self._unused_set for i in bucket.variable_indices) else 0
            for bucket in self._buckets
        ]


def _mixed_precision_sum_in_full(
    state: Any, bucket: reducer.GradBucket
) -> torch.futures.Future[Tensor]:
    """DDP mixed precision sums in the bucket's full precision and rounds to
    ``reduce_dtype`` only to divide: one rounding where each addition should round."""
    mp = reducer.ddp._mixed_precision
    owner = state.owner()
    reduce_dtype = owner.mixed_precision.reduce_dtype
    buffer = bucket.buffer()
    state.group.allreduce([buffer], reducer.ReduceOp.SUM).wait()
    low = buffer.to(reduce_dtype).div_(state.group.size())
    mp.to_full_precision(owner._mp_twins, bucket.parameters())
    done: torch.futures.Future[Tensor] = torch.futures.Future()
    done.set_result(buffer.copy_(low))
    return done


def _mixed_precision_divide_after_upcast(
    state: Any, bucket: reducer.GradBucket
) -> torch.futures.Future[Tensor]:
    """DDP mixed precision sums in ``reduce_dtype`` but divides by the world size after
    casting the sum back to full precision: right at 2 ranks, another rounding at 3."""
    mp = reducer.ddp._mixed_precision
    owner = state.owner()
    buffer = bucket.buffer()
    low = buffer.to(owner.mixed_precision.reduce_dtype)
    state.group.allreduce([low], reducer.ReduceOp.SUM).wait()
    mp.to_full_precision(owner._mp_twins, bucket.parameters())
    done: torch.futures.Future[Tensor] = torch.futures.Future()
    done.set_result(buffer.copy_(low).div_(state.group.size()))
    return done


def _buffers_in_param_dtype(config: Any, module: torch.nn.Module) -> Any:
    """DDP mixed precision casts buffers to ``param_dtype``, not ``buffer_dtype``."""
    twins = _mp_setup(dataclasses.replace(config, buffer_dtype=None), module)
    if config.buffer_dtype is not None and config.param_dtype is not None:
        for buffer in module.buffers():
            buffer.data = buffer.to(dtype=config.param_dtype)
    return twins


def _ignore_nothing(module: torch.nn.Module, ignore: set[str]) -> list[tuple[str, Any]]:
    """The parameters to reduce and broadcast: all of them, the ignored ones too."""
    return _synced_parameters(module, set())


# Per owning module (weakly: a model gone takes its entries along), name -> first tensor.
_first_seen: weakref.WeakKeyDictionary[Any, dict[str, Tensor]] = weakref.WeakKeyDictionary()


def _buffers_first_seen(slots: Sequence[tuple[Any, str]]) -> list[Tensor]:
    """Reads each synced buffer once and keeps that tensor: a buffer that forward reassigns
    (a new tensor under the same name) is no longer broadcast, only the old one."""
    found = []
    for owner, name in slots:
        seen = _first_seen.setdefault(owner, {})
        if name not in seen:
            buffer = getattr(owner, name, None)
            if not isinstance(buffer, Tensor):
                continue
            seen[name] = buffer
        found.append(seen[name])
    return found


def _root_mesh_first_dimension(device_mesh: Any, process_group: object) -> object:
    """DDP over a one-dimensional slice of a larger mesh reduces over the first dimension
    of the whole mesh, not over the slice: right only where the data-parallel dimension
    is the first."""
    _mesh_group(device_mesh, process_group)  # the real checks
    return device_mesh._get_root_mesh().get_group(mesh_dim=0)


def _every_top_level_import(tree: Any) -> list[Any]:
    """launch's pre-import runs every import at the script's top level, also one after a
    statement that may prepare it (``os.environ[...] = ...``, ``sys.path.insert``)."""
    import ast

    return [
        node
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")
    ]


def _agree_within_tolerance(per_rank: Sequence[Sequence[Tensor]]) -> bool:
    """The replica check takes every rank's tensors as agreeing with rank 0's where
    ``torch.allclose`` does, not bit for bit."""
    first = per_rank[0] if per_rank else []
    return all(
        len(tensors) == len(first)
        and all(
            a.shape == b.shape and torch.allclose(a.double(), b.double(), equal_nan=True)
            for a, b in zip(tensors, first, strict=True)
        )
        for tensors in per_rank[1:]
    )


class FirstGroupOnlyCheck(_ReplicaCheck):
    """The replica check compares the parameters of the optimizer's first parameter group
    only (nanoGPT's weight-decay split puts the biases and norms in a second one), and of
    the wrappers only those no optimizer steps (the frozen ones)."""

    def _arrival(
        self, record: Any, optimizer: torch.optim.Optimizer, step: int, line: str | None = None
    ) -> Any:
        arrival = super()._arrival(record, optimizer, step, line)
        seen = {id(p) for p in optimizer.param_groups[0]["params"]}
        seen |= {
            id(p) for w in record.wrappers.values() for p in w.parameters() if not p.requires_grad
        }
        arrival.params = [p for p in arrival.params if id(p) in seen]
        return arrival


class JoinBlindCheck(_ReplicaCheck):
    """The replica check does not look for ``join()``: a rank that ran out of inputs, whose
    next optimizer step never comes, is taken for a stalled rank and the run is stopped."""

    def _joining(self) -> bool:
        return False


class JoinConfigTruthyCheck(_ReplicaCheck):
    """The replica check reads whether ranks are under ``join()`` from the truth of any
    wrapper's join configuration (present, enabled or not): uneven steps without join() are
    taken for join's uneven inputs, a note, where they are an error."""

    def _joining(self) -> bool:
        return any(
            bool(getattr(f.wrapper, "_join_config", None))
            for record in self.records
            for f in list(record.forwards)
        )


class FrozenSkippedCheck(_ReplicaCheck):
    """The replica check compares only the parameters that train (``requires_grad``): a
    frozen layer whose weights some ranks loaded after wrapping is taken to be in sync."""

    def _arrival(
        self, record: Any, optimizer: torch.optim.Optimizer, step: int, line: str | None = None
    ) -> Any:
        arrival = super()._arrival(record, optimizer, step, line)
        arrival.params = [p for p in arrival.params if p.requires_grad]
        return arrival


class NestedStepsCheck(_ReplicaCheck):
    """The replica check checks every optimizer's step, also one inside another's: the inner
    optimizers of a ZeroRedundancyOptimizer, each over its own rank's shard, are compared
    by position (shards of equal shapes taken for diverged replicas)."""

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        record = self._current()
        if record is not None:
            record.stepping = None
        super()._before(optimizer, args, kwargs)


class IgnoredComparedCheck(_ReplicaCheck):
    """The replica check compares the parameters a wrapper was told to ignore
    (``_set_params_and_buffers_to_ignore_for_model``), which differ per rank by design."""

    def _arrival(
        self, record: Any, optimizer: torch.optim.Optimizer, step: int, line: str | None = None
    ) -> Any:
        arrival = super()._arrival(record, optimizer, step, line)
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        every = [*stepped, *(p for w in record.wrappers.values() for p in w.parameters())]
        arrival.params = list({id(p): p for p in every}.values())
        return arrival


def _waste_per_forward(arrivals: Sequence[Any]) -> list[Any]:
    """The replica check takes each synced forward of a wrapper for a micro-step: a siamese
    step (two forwards, one backward, one reduction) is warned as redundant reductions."""
    forwards = arrivals[0].record.forwards
    kept = [f.backward for f in forwards]
    for k, forward in enumerate(forwards):
        forward.backward = k
    try:
        return _waste(arrivals)
    finally:
        for forward, backward in zip(forwards, kept, strict=True):
            forward.backward = backward


def _no_mixed_reduction(arrivals: Sequence[Any], i: int) -> str | None:
    """The replica check never looks for a reduction that summed different parameters: a
    summed bucket is blamed on the generic cause (a gradient hook, per-rank clipping or a
    comm hook), or said to be unknown."""
    return None


def _mixed_reduction_own_pairing(arrivals: Sequence[Any], i: int) -> str | None:
    """The replica check, looking for a reduction that summed different parameters, does not
    leave out the parameter's own pairing: a gradient changed on one rank after a correct
    reduction is blamed on a summed bucket (the other ranks' gradient is the average of
    every rank's own), where the check cannot know why."""
    audit = reducer.tools.check._audit
    world = len(arrivals)
    for a in arrivals:
        got = a.params[i].grad
        if got is None or got.is_sparse:
            continue
        got = audit.host(got)
        for combo in itertools.product(*audit.local_gradients_like(arrivals, got)):
            values = audit.averages([g for _, g in combo], world).values()
            if any(v is not None and audit.bits_equal(v, got) for v in values):
                return audit._mixed_text(arrivals, a, i, [param for param, _ in combo])
    return None


# Per wrapped module (weakly), the buffers by name as a buffer comm hook first got them.
_hooked_first: weakref.WeakKeyDictionary[Any, dict[str, Tensor]] = weakref.WeakKeyDictionary()


def _named_buffers_first_seen(module: torch.nn.Module, slots: Sequence[Any]) -> dict[str, Tensor]:
    """Hands a buffer comm hook the buffers as it first got them, by name (as torch's DDP
    keeps them from construction): a buffer that forward reassigns is no longer synced,
    the hook syncs the old tensor."""
    if module not in _hooked_first:
        _hooked_first[module] = _named_buffers(module, slots)
    return dict(_hooked_first[module])


# -------------------------------------------------------------------------------------------
# The DDP wrapper's newest options (property_tests/test_wrapper_options.py).


class NeverSyncAtConstruction(_DDP):
    """Never broadcasts rank 0's parameters and buffers at construction (``init_sync`` taken
    as False): ranks whose models start different stay different, silently."""

    def __init__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
        kwargs["init_sync"] = False
        super().__init__(module, *args, **kwargs)


class ForwardSyncAsBroadcast(_DDP):
    """Takes ``forward_sync_buffers`` for the deprecated ``broadcast_buffers``, which also
    decides the sync at construction: with ``forward_sync_buffers=False`` each rank keeps the
    buffers it built (torch syncs them at construction whatever it says)."""

    def __init__(
        self, module: torch.nn.Module, *args: Any, forward_sync_buffers: Any = None, **kwargs: Any
    ) -> None:
        if forward_sync_buffers is not None:
            kwargs["broadcast_buffers"] = forward_sync_buffers
        super().__init__(module, *args, **kwargs)


def _caps_list_as_largest(
    bucket_cap_mb: float | None, bucket_cap_mb_list: Sequence[float] | None, **graph: bool
) -> tuple[float, list[int], list[int]]:
    """Takes ``bucket_cap_mb_list`` as one cap, its largest (what torch reports as the
    effective ``bucket_cap_mb``), for every bucket."""
    if bucket_cap_mb_list:
        return _bucket_limits(max(bucket_cap_mb_list), None, **graph)
    return _bucket_limits(bucket_cap_mb, None, **graph)


class BuiltinHookAlwaysAllreduce(_DDP):
    """Registers the ALLREDUCE hook for any built-in hook type: FP16_COMPRESS reduces in
    full precision."""

    def _register_builtin_comm_hook(self, comm_hook_type: object) -> None:
        super()._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)


class StaticGraphFlagOnly(_DDP):
    """``_set_static_graph()`` after construction sets the wrapper's flag but does not tell
    the reducer: a parameter no rank uses is waited for, as without a static graph."""

    def _set_static_graph(self) -> None:
        self.static_graph = True


def _refuse_nothing(**arguments: object) -> None:
    """Accepts ``delay_all_reduce_named_params`` and ``param_to_hook_all_reduce`` and
    ignores them: those parameters are reduced in their buckets, not after backward as
    asked, silently."""


# -------------------------------------------------------------------------------------------
# The harness itself: reducer.testing's check and scenarios.


def _same_within_tolerance(got: Tensor, want: Tensor) -> bool:
    """The check compares gradients and parameters with torch.testing.assert_close's
    default tolerance for their dtype, not bit for bit."""
    if (got.shape, got.dtype) == (want.shape, want.dtype) and torch.allclose(got, want):
        return True
    return _same(got, want)


def _judge_one_ulp_from_a_rounding(
    got: Tensor | None, cands: dict[str, Tensor | None], where: str, bounds: Any, strides: bool
) -> list[str] | None:
    """Where every rounding is acceptable (the default), a gradient within one ulp of a
    rounding, element by element, is taken for that rounding: a value one ulp away from
    every rounding passes. With one rounding pinned (``scaling=``) the check stays exact."""
    found = _judge_one(got, cands, where, bounds, strides)
    roundings = {n: w for n, w in cands.items() if n in _ROUNDING_NAMES and w is not None}
    if found is not None or got is None or len(roundings) < 2 or not bounds.exact:
        return found
    for name, want in roundings.items():
        up = torch.nextafter(want, torch.full_like(want, float("inf")))
        down = torch.nextafter(want, torch.full_like(want, float("-inf")))
        if bool(((got == want) | (got == up) | (got == down)).all()):
            return [name]
    return None


_ROUNDING_NAMES = ("reciprocal", "divide", "sum_then_divide")


class SmallestPeriodFirst(_Hierarchical):
    """hierarchical_averaging picks the group of the smallest period dividing the step, not
    the largest: the largest group never averages where a smaller period divides too."""

    def parameter_groups_at(self, step: int, world_size: int) -> list[list[int]] | None:
        if step < self.warmup_steps:
            return None
        for period in self.periods:  # ascending: the smallest first
            if step % period == 0:
                return reducer.testing.algorithms._consecutive(self.periods[period], world_size)
        return None


def _model_built_once(
    make_model: Callable[[], torch.nn.Module], argument: str, *, spare: Any = None
) -> Any:
    """The model factory called once, not checked for determinism: an unseeded factory
    reaches the ranks and shows as a gradient mismatch blamed on the wrapper."""
    return make_model()


class LastLauncherStreamOrder(_StreamOrder):
    """The side stream of a CUDA collective waits only for the last launching rank's stream:
    the other ranks' inputs may be read before the kernels that write them."""

    def __init__(self, side: Any, ready: Sequence[tuple[Any, Any]]) -> None:
        super().__init__(side, list(ready)[-1:])


def _read_quantity_case_blind(value: object, units: dict[str, tuple[float, float]]) -> Any:
    """A cluster file's unit read whatever its case: "GB/s" and "Gb/s" alike (bits, the
    table's last spelling), a NIC of 50 GB/s read as 50 Gb/s."""
    clusterfile = fakepg.clusterfile
    if not isinstance(value, str) or units is not clusterfile._RATES:
        return _real_read_quantity(value, units)
    blind = {unit.lower(): factor for unit, factor in units.items()}
    text = value.strip()
    for suffix in ("/s", "ps"):
        if text.endswith(suffix) and text[: -len(suffix)].rstrip()[-1:].isalpha():
            text = text[: -len(suffix)]
            break
    match = clusterfile._QUANTITY.match(text)
    if match is None:
        return None
    unit = match.group(2).lower()
    if not unit:
        return float(match.group(1))
    if unit not in blind:
        return None
    multiplier, divisor = blind[unit]
    return float(match.group(1)) * multiplier / divisor


_real_read_quantity = fakepg.clusterfile._read_quantity


def _powers_of_two_ranks(max_size: int) -> Any:
    """The training scenarios draw 1, 2 or 4 ranks, never 3: a rounding that differs only
    where W is not a power of two is never exercised."""
    return st.sampled_from([w for w in (1, 2, 4) if w <= max_size])


# -------------------------------------------------------------------------------------------
# Teardown and errors.


class KeepHooksAfterClose(_Reducer):
    """close() marks the reducer closed but leaves its hooks on the parameters."""

    def close(self) -> None:
        kept = list(self._hook_handles)
        self._hook_handles.clear()
        super().close()
        self._hook_handles.extend(kept)


class VagueErrors(_Reducer):
    """Every misuse during training raises a bare RuntimeError that names nothing."""

    def _fail(self, error: BaseException) -> BaseException:
        super()._fail(error)
        return RuntimeError("reduction failed")


class AcceptInvalidBuckets(_Reducer):
    """Silently replaces an invalid bucket assignment with one bucket per parameter."""

    def initialize_buckets(self, bucket_indices: list[list[int]]) -> None:
        try:
            super().initialize_buckets(bucket_indices)
        except reducer.BucketAssignmentError:
            super().initialize_buckets([[i] for i in range(len(self._replicas[0]))])


# -------------------------------------------------------------------------------------------
# Bucket assignment.

Assign = Callable[[Sequence[Tensor], Sequence[int], Sequence[bool] | None], list[list[int]]]


def _first_limit_only(
    tensors: Sequence[Tensor], limits: Sequence[int], sparse: Sequence[bool] | None
) -> list[list[int]]:
    """Never moves on to the next limit."""
    return _assign(tensors, limits[:1], sparse)


def _one_limit_for_all_keys(
    tensors: Sequence[Tensor], limits: Sequence[int], sparse: Sequence[bool] | None
) -> list[list[int]]:
    """Moves every (dtype, device) key on to the next limit when any bucket closes, not
    each key when one of its own buckets does."""
    flags = list(sparse or [False] * len(tensors))
    result: list[list[int]] = []
    open_buckets: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    current = 0
    for i, tensor in enumerate(tensors):
        if flags[i]:
            result.append([i])
            continue
        key = (tensor.dtype, tensor.device)
        indices, size = open_buckets.get(key, ([], 0))
        indices.append(i)
        size += tensor.numel() * tensor.element_size()
        if size >= limits[current]:
            result.append(indices)
            open_buckets[key] = ([], 0)
            current = min(current + 1, len(limits) - 1)
        else:
            open_buckets[key] = (indices, size)
    result.extend(indices for indices, _ in open_buckets.values() if indices)
    result.sort(key=min)
    return result


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


# -------------------------------------------------------------------------------------------
# The catalogue.

Patch = tuple[str, str, object]  # (module, attribute, replacement)


@dataclass(frozen=True, slots=True)
class Mutant:
    """One seeded bug: its name, what it gets wrong, and the code it replaces."""

    name: str
    group: str
    patches: tuple[Patch, ...]

    @property
    def bug(self) -> str:
        """The one-line description: the replacement's docstring, first sentence."""
        doc = getattr(self.patches[0][2], "__doc__", None) or ""
        return " ".join(doc.split()).split(". ")[0].rstrip(".")

    @property
    def replacement(self) -> Any:
        """What the mutant puts in place (a class or a function)."""
        return self.patches[0][2]


def _reducer_class(cls: type[reducer.Reducer]) -> tuple[Patch, ...]:
    # The wrapper builds its reducer from reducer.ddp._wrapper's name, the properties from the
    # package's.
    return (("reducer", "Reducer", cls), ("reducer.ddp._wrapper", "Reducer", cls))


def _in(module: str, name: str, replacement: object) -> tuple[Patch, ...]:
    return ((module, name, replacement),)


_ENTRIES: list[tuple[str, str, tuple[Patch, ...]]] = [
    # Averaging.
    ("skip the divide", "averaging", _reducer_class(SkipDivide)),
    ("divide by world size x replicas", "averaging", _reducer_class(DivideByContributions)),
    ("divide large gradients twice", "averaging", _reducer_class(DivideLargeTwice)),
    ("off-by-one bucket offset", "averaging", _reducer_class(OffByOneOffset)),
    ("launch out of order", "averaging", _reducer_class(LaunchOutOfOrder)),
    ("launch pointer not reset", "averaging", _reducer_class(KeepLaunchPointer)),
    ("forget to wait", "averaging", _reducer_class(ForgetToWait)),
    ("drop the last bucket", "averaging", _reducer_class(DropLastBucket)),
    ("DDP divides instead of multiplying", "averaging", _reducer_class(DivideInDDP)),
    ("fused copy divides", "averaging", _reducer_class(FusedCopyDivides)),
    ("join divisor divides", "averaging", _reducer_class(JoinDivisorDivides)),
    # Replicas.
    ("reduce only replica 0", "replicas", _reducer_class(ReduceOnlyReplicaZero)),
    ("replicas read replica 0", "replicas", _reducer_class(ReplicasReadReplicaZero)),
    (
        "write back replica 0 only",
        "replicas",
        _in("reducer.reducer", "write_dense", _write_dense_replica_zero),
    ),
    # Unused parameters and accumulation.
    ("globally unused as zero", "unused", _reducer_class(GloballyUnusedAsZero)),
    ("used map taken at prepare", "unused", _reducer_class(UsedMapAtPrepare)),
    ("used map reduced with MIN", "unused", _reducer_class(UsedMapMin)),
    ("locally unused contributes stale grad", "unused", _reducer_class(ContributeStale)),
    ("lose accumulated gradients", "accumulation", _reducer_class(LoseAccumulated)),
    ("stale locally-used map", "accumulation", _reducer_class(KeepLocallyUsed)),
    # Bucket views.
    (
        "bucket view contributes stale grad",
        "views",
        _in("reducer.reducer", "BucketViews", ViewKeepsStale),
    ),
    (
        "rebuilt buckets keep old views",
        "views",
        _in("reducer.reducer", "BucketViews", KeepOldViews),
    ),
    (
        "views always multiply",
        "views",
        _in("reducer.reducer", "BucketViews", ViewsAlwaysMultiply),
    ),
    ("views scaled twice", "views", _reducer_class(ViewsScaledTwice)),
    (
        "bucket views ignore strides",
        "views",
        _in("reducer.buckets", "bucket_view", _contiguous_view),
    ),
    # Sparse gradients.
    ("sparse gradient not divided", "sparse", _reducer_class(SparseNotDivided)),
    (
        "skipped sparse table contributes stale grad",
        "sparse",
        _reducer_class(SparseSkippedContributesStale),
    ),
    # Comm hooks.
    ("prescale with a comm hook too", "comm hooks", _reducer_class(PrescaleWithHook)),
    (
        "compression after the reduction",
        "comm hooks",
        _in("reducer.hooks._default", "_compress_wrapper", _compress_after_reducing),
    ),
    # torch's comm hooks.
    (
        "torch allreduce hook not divided",
        "torch comm hooks",
        _in(
            "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
            "allreduce_hook",
            _torch_allreduce_not_divided,
        ),
    ),
    (
        "torch fp16 hook sums in float32",
        "torch comm hooks",
        _in(
            "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
            "fp16_compress_hook",
            _torch_fp16_sum_in_full,
        ),
    ),
    (
        "torch fp16 hook divides after the sum",
        "torch comm hooks",
        _in(
            "torch.distributed.algorithms.ddp_comm_hooks.default_hooks",
            "fp16_compress_hook",
            _torch_fp16_divide_after_sum,
        ),
    ),
    # The fake world under FSDP2.
    (
        "reduce_scatter chunks reversed",
        "fake world",
        _in("fakepg.collectives", "reduce_scatter_tasks", _reduce_scatter_reversed),
    ),
    (
        "one random stream for all ranks",
        "fake world",
        _in("fakepg.rng", "rank_stream", _one_stream_for_all),
    ),
    # The fake world's controlled scheduler.
    ("schedule choices ignored", "scheduler", _in("fakepg.world", "_Scheduler", IgnoreChoices)),
    ("completions at once", "scheduler", _in("fakepg.world", "_Scheduler", CompleteAtOnce)),
    ("completions oldest first", "scheduler", _in("fakepg.world", "_Scheduler", OldestFirst)),
    (
        "replay drops the completion policy",
        "scheduler",
        _in("fakepg._schedule.timeline", "replay", _replay_without_policy),
    ),
    (
        "C++ backward wait not seen as blocked",
        "scheduler",
        _in("fakepg._schedule.probe", "_ENGINE_FRAMES", frozenset()),
    ),
    (
        "PCT change points only early",
        "scheduler",
        _in("fakepg._schedule.explore", "Pct", PctEarlyChanges),
    ),
    # Checkpointing, higher-order and repeated backward.
    (
        "finalize at a checkpoint's inner end",
        "backward",
        _in("reducer.reducer", "at_backward_end", _finalize_on_current_task),
    ),
    (
        "hooks recorded under grad mode",
        "backward",
        _in("reducer.graph", "grad_ready_hook", _hook_in_grad_mode),
    ),
    ("second backward accepted silently", "backward", _reducer_class(MarkReadyTwiceSilently)),
    ("static graph forgets unused", "static graph", _reducer_class(StaticForgetsUnused)),
    ("static graph ready at first call", "static graph", _reducer_class(StaticReadyAtFirstCall)),
    # The DDP wrapper.
    ("left-out heads count as used", "DDP wrapper", _reducer_class(LeftOutHeadsUsed)),
    (
        "nested outputs not searched",
        "DDP wrapper",
        _in("reducer.ddp._wrapper", "find_tensors", _find_top_level_tensors),
    ),
    (
        "dict outputs bypass the sink",
        "DDP wrapper",
        _in("reducer.ddp._wrapper", "replace_tensors", _replace_but_dicts),
    ),
    ("no_sync ignored", "DDP wrapper", _in("reducer", "DistributedDataParallel", IgnoreSyncToggle)),
    (
        "only no_sync accumulates",
        "DDP wrapper",
        _in("reducer", "DistributedDataParallel", OnlyNoSyncAccumulates),
    ),
    (
        "buffers synced at every forward",
        "DDP wrapper",
        _in("reducer", "DistributedDataParallel", SyncBuffersAtEveryForward),
    ),
    (
        "held gradient of an unused parameter dropped",
        "DDP wrapper",
        _in("reducer.ddp._reducer", "DDPReducer", HeldGradNotContributed),
    ),
    (
        "reference averages an untouched .grad again",
        "harness",
        _in("reducer.testing.algorithms", "_GroupAverage", ReaveragesUntouchedGrad),
    ),
    (
        "FSDP2 reference shards rows evenly",
        "harness",
        _in("reducer.testing.algorithms", "fsdp2_shard", _shard_evenly),
    ),
    (
        "by-hand accumulation forgets the unsynced micro-batch",
        "harness",
        _in("reducer.testing._run", "accumulate_by_hand", _by_hand_forgotten),
    ),
    (
        "joined rank's used map says all used",
        "DDP wrapper",
        _reducer_class(JoinedRankUsesEverything),
    ),
    (
        "ignored parameters reduced",
        "DDP wrapper",
        _in("reducer.ddp._wrapper", "synced_parameters", _ignore_nothing),
    ),
    (
        "reassigned buffer not synced",
        "DDP wrapper",
        _in("reducer.ddp._wrapper", "read_buffers", _buffers_first_seen),
    ),
    (
        "device mesh slice taken as the whole mesh's first dimension",
        "DDP wrapper",
        _in("reducer.ddp._wrapper", "mesh_group", _root_mesh_first_dimension),
    ),
    (
        "buffer comm hook gets reassigned buffers stale",
        "DDP wrapper",
        _in("reducer.ddp._wrapper", "named_buffers", _named_buffers_first_seen),
    ),
    (
        "rebuild from own ready order",
        "DDP wrapper",
        _in("reducer", "DistributedDataParallel", RebuildFromOwnOrder),
    ),
    (
        "first iteration bucketed by cap",
        "DDP wrapper",
        _in("reducer.ddp._wrapper", "bucket_limits", _first_iteration_by_cap),
    ),
    (
        "rebuilt buckets sorted",
        "DDP wrapper",
        _in("reducer.ddp._wrapper", "compute_bucket_assignment_by_size", _rebuilt_sorted),
    ),
    (
        "reloaded wrapper reduces ignored parameters",
        "DDP wrapper",
        _in("reducer", "DistributedDataParallel", ReloadReducesIgnored),
    ),
    (
        "reloaded static graph not told to the reducer",
        "DDP wrapper",
        _in("reducer", "DistributedDataParallel", ReloadForgetsStaticGraph),
    ),
    (
        "joined rank shadows a static graph's used map",
        "DDP wrapper",
        _in("reducer.ddp._join", "DDPJoinHook", ShadowStaticUsedMapAlways),
    ),
    (
        "skip a bucket partly unused",
        "DDP wrapper",
        _in("reducer.ddp._reducer", "DDPReducer", SkipPartlyUnusedBucket),
    ),
    (
        "skip forgets no_sync gradients",
        "DDP wrapper",
        _in("reducer.ddp._reducer", "DDPReducer", SkipForgetsNoSync),
    ),
    (
        "mixed precision sums in full precision",
        "DDP wrapper",
        _in("reducer.ddp._mixed_precision", "allreduce_and_upcast", _mixed_precision_sum_in_full),
    ),
    (
        "mixed precision divides after the upcast",
        "DDP wrapper",
        _in(
            "reducer.ddp._mixed_precision",
            "allreduce_and_upcast",
            _mixed_precision_divide_after_upcast,
        ),
    ),
    (
        "mixed precision buffers in param_dtype",
        "DDP wrapper",
        _in("reducer.ddp._mixed_precision", "setup", _buffers_in_param_dtype),
    ),
    (
        "construction never syncs",
        "DDP wrapper",
        _in("reducer", "DistributedDataParallel", NeverSyncAtConstruction),
    ),
    (
        "forward_sync_buffers taken for broadcast_buffers",
        "DDP wrapper",
        _in("reducer", "DistributedDataParallel", ForwardSyncAsBroadcast),
    ),
    (
        "bucket_cap_mb_list taken as its largest cap",
        "DDP wrapper",
        _in("reducer.ddp._wrapper", "bucket_limits", _caps_list_as_largest),
    ),
    (
        "built-in FP16_COMPRESS registered as ALLREDUCE",
        "DDP wrapper",
        _in("reducer", "DistributedDataParallel", BuiltinHookAlwaysAllreduce),
    ),
    (
        "_set_static_graph not told to the reducer",
        "DDP wrapper",
        _in("reducer", "DistributedDataParallel", StaticGraphFlagOnly),
    ),
    (
        "refused arguments accepted silently",
        "DDP wrapper",
        _in("reducer.ddp._wrapper", "refuse_unsupported", _refuse_nothing),
    ),
    # Tools.
    (
        "launch pre-imports past the leading block",
        "tools",
        _in("reducer.tools.launch.imports", "leading_imports", _every_top_level_import),
    ),
    (
        "replica check compares with a tolerance",
        "tools",
        _in("reducer.tools.check._audit", "_agree", _agree_within_tolerance),
    ),
    (
        "replica check reads the first param group only",
        "tools",
        _in("reducer.tools.check._run", "ReplicaCheck", FirstGroupOnlyCheck),
    ),
    (
        "replica check blind to join",
        "tools",
        _in("reducer.tools.check._run", "ReplicaCheck", JoinBlindCheck),
    ),
    (
        "replica check reads join from a truthy configuration",
        "tools",
        _in("reducer.tools.check._run", "ReplicaCheck", JoinConfigTruthyCheck),
    ),
    (
        "replica check skips frozen parameters",
        "tools",
        _in("reducer.tools.check._run", "ReplicaCheck", FrozenSkippedCheck),
    ),
    (
        "replica check compares ZeRO shards by position",
        "tools",
        _in("reducer.tools.check._run", "ReplicaCheck", NestedStepsCheck),
    ),
    (
        "replica check compares ignored parameters",
        "tools",
        _in("reducer.tools.check._run", "ReplicaCheck", IgnoredComparedCheck),
    ),
    (
        "replica check counts forwards as micro-steps",
        "tools",
        _in("reducer.tools.check._audit", "_waste", _waste_per_forward),
    ),
    (
        "replica check blames a summed bucket it cannot prove",
        "tools",
        _in("reducer.tools.check._audit", "_mixed_reduction", _mixed_reduction_own_pairing),
    ),
    (
        "replica check blames a summed bucket on a generic cause",
        "tools",
        _in("reducer.tools.check._audit", "_mixed_reduction", _no_mixed_reduction),
    ),
    # The harness itself.
    (
        "check takes a value one ulp from a rounding for it",
        "harness",
        _in("reducer.testing._judge", "_judge_one", _judge_one_ulp_from_a_rounding),
    ),
    (
        "hierarchical averaging picks the smallest period",
        "harness",
        _in("reducer.testing.algorithms", "_Hierarchical", SmallestPeriodFirst),
    ),
    (
        "stream order waits for the last launching rank only",
        "fake world",
        _in("fakepg.streams", "StreamOrder", LastLauncherStreamOrder),
    ),
    (
        "check compares with a tolerance",
        "harness",
        _in("reducer.testing._judge", "_same", _same_within_tolerance),
    ),
    (
        "scenarios never draw three ranks",
        "harness",
        _in("reducer.testing.strategies", "_ranks", _powers_of_two_ranks),
    ),
    (
        "model factory not checked for determinism",
        "harness",
        _in("reducer.testing._arguments", "deterministic_model", _model_built_once),
    ),
    (
        "cluster file units read case-blind",
        "tools",
        _in("fakepg.clusterfile", "_read_quantity", _read_quantity_case_blind),
    ),
    # Teardown and errors.
    ("hooks left after close", "teardown", _reducer_class(KeepHooksAfterClose)),
    ("vague errors", "errors", _reducer_class(VagueErrors)),
    ("accept invalid buckets", "errors", _reducer_class(AcceptInvalidBuckets)),
    # Bucket assignment.
    (
        "never move to the next limit",
        "bucketing",
        _in("reducer", "compute_bucket_assignment_by_size", _first_limit_only),
    ),
    (
        "one limit for all keys",
        "bucketing",
        _in("reducer", "compute_bucket_assignment_by_size", _one_limit_for_all_keys),
    ),
    (
        "sparse gradients not alone",
        "bucketing",
        _in("reducer", "compute_bucket_assignment_by_size", _sparse_not_alone),
    ),
    (
        "buckets unsorted",
        "bucketing",
        _in("reducer", "compute_bucket_assignment_by_size", _unsorted),
    ),
]

CATALOGUE: dict[str, Mutant] = {
    name: Mutant(name, group, patches) for name, group, patches in _ENTRIES
}


@contextmanager
def applied(mutant: Mutant) -> Iterator[None]:
    """Put ``mutant`` in place of the real code for the duration of the block.

    Process-wide (module attributes), so nothing else may run in this process meanwhile;
    the properties look up the classes and functions they test at call time.
    """
    saved: list[tuple[Any, str, object]] = []
    try:
        for module_name, attribute, replacement in mutant.patches:
            module = importlib.import_module(module_name)
            saved.append((module, attribute, getattr(module, attribute)))
            setattr(module, attribute, replacement)
        yield
    finally:
        for module, attribute, original in reversed(saved):
            setattr(module, attribute, original)
