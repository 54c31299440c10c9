"""The reducer: averages gradients across ranks while backward is still running.

The happy path, one iteration, in the order of this module's ``Reducer``:

1. ``prepare_for_backward(outputs)`` resets the per-iteration counters and, given outputs,
   searches their autograd graph for parameters that will get no gradient (unused).
2. During backward, autograd calls a hook after each parameter's gradient is accumulated
   (``_autograd_hook``). The parameter is marked ready (``_mark_variable_ready``); when the
   last parameter of a bucket replica is ready, its gradients are copied into the bucket's
   flat tensor and divided by the world size (or multiplied by its reciprocal, as torch's DDP
   does: see Note [Gradient scaling] in reducer.bucket_views); when every replica of the
   bucket is ready, and every earlier bucket has launched, one asynchronous ``allreduce`` of
   the bucket starts (``_mark_bucket_ready``, ``_launch``).
3. Once the last bucket has launched, a finalize step is queued on the autograd engine. It runs
   when backward ends, waits for every allreduce and writes the averages into ``.grad``
   (``_finalize_backward``).

Communication of early buckets thus overlaps with the computation of later gradients. The
special cases live next to what they serve: the graph search, the hooks and the end of
backward in reducer.graph; bucket layout in reducer.buckets; the batched copies, the
write-back into ``.grad`` and gradient_as_bucket_view in reducer.bucket_views; the static
graph's record in reducer.static_graph; the error messages in reducer.errors.

# Guarantees: hooks run on autograd threads (one per device); every state transition happens
# under ``_lock``, so hooks of replicas on different devices may run concurrently. Public
# methods may be called from the thread that runs forward and backward.

# Note [Buckets launch in index order]
# Collectives match across ranks by the order in which each rank issues them, but gradients
# become ready in an order that can differ between ranks (unused parameters, timing). So a
# bucket that is ready waits until every bucket before it has launched: ``_next_bucket`` is
# the first bucket not launched yet, and only it may launch, followed by any ready run of
# buckets after it. Every rank thus issues bucket 0, 1, 2, ... and then the used map.

# Note [Unused parameters]
# A parameter whose accumulator the outputs' graph does not reach gets no hook call this
# iteration. It is marked ready at the first hook call (not in prepare_for_backward: the
# outputs may never see a backward). It contributes zeros, unless it got a gradient during
# local accumulation since the last synced step (see Note [Locally used]). When every rank
# found it unused, its ``.grad`` is left exactly as it was: the ranks agree on that through
# an allreduce of the per-parameter "locally used" map, issued after the last bucket.

# Note [Ready order]
# ``_hook_order`` lists the parameters of replica 0 in the order their hooks made them ready
# (in the first static-graph iteration: the order of each parameter's last hook call, when its
# gradient was complete). Buckets rebuilt in that order become ready one after the other
# (reducer.ddp rebuilds them once, from rank 0's order). Parameters marked ready because they
# were unused are not in it.

# Note [Locally used]
# ``_used[replica][param]`` is set by every hook call since the last synced step, including
# calls while hooks are not expected (gradient accumulation, no_sync): a gradient a rank
# accumulated locally is contributed on the next synced step even if the parameter is unused
# in that step's forward. Nothing a rank computed is lost. Finalize clears it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import torch
from torch import Tensor

from . import errors
from .bucket_views import (
    BucketViews,
    GradientScaling,
    adopt_hook_result,
    check_gradient_scaling,
    copy_all,
    scale_,
    scale_into,
    try_copy_all,
    write_dense,
    write_sparse,
)
from .buckets import (
    Bucket,
    BucketReplica,
    Slot,
    build_buckets,
    empty_sparse_like,
    shadow_bucket,
    slots,
    validate_bucket_indices,
)
from .comm_hook import GRAD_BUCKET_TYPES, CommHook, FutureWork, GradBucket, hook_name
from .errors import REDUCER_WORDING, InvalidArgument, ReductionError, Wording
from .graph import (
    at_backward_end,
    attach_ready_hooks,
    is_future,
    reached_accumulators,
    remove_hooks,
)
from .process_group import ProcessGroup, Work
from .static_graph import StaticGraph
from .stats import IterationStats
from .validation import (
    check_comm_hook,
    check_names,
    check_outputs,
    check_process_group,
    check_replicas,
    check_sparse,
    check_timeout,
    names_hint,
)

__all__ = ["Reducer"]

# Called at every hook: one global lookup, instead of a module and an attribute.
_now_ns = time.perf_counter_ns


class Reducer:
    """Averages the gradients of ``replicas`` over ``process_group`` during backward.

    ``replicas`` holds one list of parameters per model replica in this process (usually
    one); replicas must agree in parameter count, shapes, dtypes and sparsity.
    ``bucket_indices`` partitions parameter indices into buckets, e.g. from
    :func:`reducer.compute_bucket_assignment_by_size`. ``expect_sparse_gradients[r][i]`` marks
    parameters with sparse gradients (each needs a bucket of its own). ``param_names`` (one
    per parameter) makes error messages name parameters. With ``gradient_as_bucket_view``,
    each dense ``.grad`` is a view into its bucket (see Note [Gradients as bucket views] in
    reducer.bucket_views). ``static_graph`` promises the same graph every iteration (see Note
    [Static graph] in reducer.static_graph). ``timeout`` (seconds, finite) bounds the wait for
    a comm hook's future (collectives have their own). ``gradient_scaling`` is how bucket
    contents are scaled before the SUM: ``"divide"`` (``g / W``, the default) or
    ``"reciprocal"`` (``g * (1.0 / W)``, torch's DDP rounding: the two differ in the last bit
    where W is not a power of two; see Note [Gradient scaling] in reducer.bucket_views).

    The state machine, per iteration: ``prepare_for_backward`` expects hooks; each
    ``_autograd_hook`` marks a parameter ready (``_mark_variable_ready``), which completes
    bucket replicas, then buckets (``_mark_bucket_ready``), which launch in index order
    (``_launch``); the last launch queues ``_finalize_backward`` for the end of backward,
    which waits, writes ``.grad`` and stops expecting hooks. Hooks outside that window
    accumulate locally. An error during an iteration fails the reducer for good (``_fail``).
    """

    def __init__(
        self,
        replicas: list[list[Tensor]],
        bucket_indices: list[list[int]],
        process_group: ProcessGroup,
        expect_sparse_gradients: list[list[bool]] | None = None,
        *,
        param_names: Sequence[str] | None = None,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        timeout: float = 300.0,
        gradient_scaling: GradientScaling = "divide",
    ) -> None:
        self._replicas = check_replicas(replicas, names_hint(param_names, replicas))
        self._as_view = bool(gradient_as_bucket_view)
        count = len(self._replicas[0])
        self._names = check_names(param_names, count)
        self._expect_sparse = check_sparse(expect_sparse_gradients, self._replicas, self._names)
        self._process_group = process_group
        self._world_size = check_process_group(process_group)
        self._timeout = check_timeout(timeout, "Reducer")
        self._scaling = check_gradient_scaling(gradient_scaling)
        self._lock = threading.Lock()

        # The state machine. Between prepare_for_backward and finalize: hooks mark parameters
        # ready. Plain: expecting hooks in an iteration with no special case (_autograd_hook).
        self._expect_autograd_hooks = False
        self._plain_iteration = False
        # Some parameter was marked ready: finalize must run before the next iteration.
        self._require_finalize = False
        # The first bucket not yet launched. See Note [Buckets launch in index order].
        self._next_bucket = 0
        self._all_launched = False
        # See Note [Unused parameters]. _no_gradient: reached by the outputs, but not by the
        # loss (hook calls without a gradient).
        self._find_unused = False
        self._unused: list[tuple[int, int]] = []
        self._unused_set: set[tuple[int, int]] = set()
        self._no_gradient: set[tuple[int, int]] = set()
        self._has_marked_unused = False
        self._used_map: tuple[Work, Tensor] | None = None
        # See Note [Locally used].
        self._used = [[False] * count for _ in self._replicas]
        self._ready = [[False] * count for _ in self._replicas]
        # See Note [Static graph] in reducer.static_graph.
        self._static = StaticGraph(bool(static_graph))
        # See Note [Ready order]: this iteration's, and the last synced iteration's.
        self._hook_order: list[int] = []
        self._last_hook_order: list[int] = []

        # Bucket contents are scaled by this before the allreduce: the world size, or the
        # number of ranks still training under DDP's join (see _set_divisor), with the
        # rounding of _scaling (see Note [Gradient scaling] in reducer.bucket_views). A comm
        # hook replaces the allreduce and divides by itself, so buckets are not prescaled then.
        self._divisor = self._world_size
        # Scaling by 1 is the identity bit for bit, either way: skip that pass.
        self._prescale = self._divisor > 1
        self._comm_hook: tuple[object, CommHook] | None = None

        # An error raised during an iteration leaves the ranks out of step; the reducer then
        # refuses further use until it is closed and replaced.
        self._failure: BaseException | None = None
        # How errors name the caller's API; the DDP wrapper sets its own (see errors.Wording).
        self._wording: Wording = REDUCER_WORDING
        self._closed = False

        # Timings, and the record of the last synced iteration, for logging and traces.
        self._backward_stats = [[0] * count for _ in self._replicas]
        self._backward_stats_base = 0
        self._bucket_launch_ns: list[int] = []
        self._iterations = 0
        self._last_iteration: IterationStats | None = None

        self._views = BucketViews(self._names)
        self._buckets: list[Bucket] = []
        self._slots: list[list[Slot]] = []  # See buckets.slots
        self.initialize_buckets(bucket_indices)
        self._accumulators, self._hook_handles = attach_ready_hooks(self, self._replicas)

    # ---------------------------------------------------------------------------------------
    # 1. Before backward.

    def prepare_for_backward(self, outputs: Sequence[Tensor] = ()) -> None:
        """Expect hooks for a new iteration; with ``outputs``, find unused parameters.

        With no outputs every parameter's hook is expected. With outputs, the parameters their
        autograd graph does not reach count as unused (see Note [Unused parameters]). Every
        rank must make the same choice, since the search adds a collective.
        """
        with self._lock:
            self._check_usable("prepare_for_backward")
            if self._require_finalize:
                error = errors.unfinished_error(
                    self._wording, self._rank(), self._ready, self._names
                )
                raise self._fail(error)
            outputs = check_outputs(outputs)
            if self._as_view:
                self._views.check_kept(self._buckets)
            self._expect_autograd_hooks = True
            self._next_bucket = 0
            self._all_launched = False
            self._backward_stats_base = time.perf_counter_ns()
            self._bucket_launch_ns = [0] * len(self._buckets)
            for bucket in self._buckets:
                for replica in bucket.replicas:
                    replica.pending = len(replica.variables)
                    replica.scaled_at_hook.clear()
                bucket.pending = len(bucket.replicas)
            count = len(self._replicas[0])
            self._ready = [[False] * count for _ in self._replicas]
            self._has_marked_unused = False
            self._unused_set = set()
            self._no_gradient = set()
            self._hook_order = []
            static = self._static
            static.start_iteration(len(self._replicas), count)
            if static.remaining is not None:
                # No search: the first iteration's record applies (see Note [Static graph]).
                self._find_unused = False
                self._unused_set = static.recorded_unused()
            elif static.recording:
                self._find_unused = True  # the used map of this iteration is kept for good
            else:
                self._find_unused = bool(outputs)
                if outputs:
                    reached = reached_accumulators(outputs, self._accumulators)
                    self._unused_set = set(self._accumulators.values()) - reached
            self._unused = sorted(self._unused_set)
            # Hooks expected, nothing unused to mark, no static-graph counting: the hook can
            # go straight to _mark_variable_ready. Cleared wherever one of these changes.
            self._plain_iteration = not (
                self._unused or static.recording or static.remaining is not None
            )

    def _expect_no_gradient(
        self, outputs_with_grad: Sequence[Tensor], outputs_without_grad: Sequence[Tensor]
    ) -> None:
        """Backward found outputs the loss did not use (``outputs_without_grad``).

        Called before any hook (from the DDP wrapper's output sink). Parameters that only the
        unused outputs reach get hook calls without a gradient: they count as unused, not as
        used with zeros. See Note [Outputs not used in the loss] in reducer.ddp._wrapper. A
        parameter that the search reaches from neither kind of output is not among them: inside a
        reentrant checkpoint (whose forward ran without grad, hiding it from the search), it
        gets a real gradient from the checkpoint's own backward.
        """
        with self._lock:
            if not self._expect_autograd_hooks:
                return
            reached = reached_accumulators(outputs_with_grad, self._accumulators)
            only_unused = reached_accumulators(outputs_without_grad, self._accumulators)
            self._no_gradient = only_unused - reached - self._unused_set
            self._plain_iteration = self._plain_iteration and not self._no_gradient

    def _queue_recorded_finalize(self) -> None:
        """Static graph, first iteration: queue the end-of-backward reduction now.

        Called where the outermost backward starts, before any hook (by the DDP wrapper's
        output sink), so that reentrant checkpointing cannot end it early. See Note [Static
        graph] in reducer.static_graph. Elsewhere a no-op.
        """
        with self._lock:
            static = self._static
            if self._expect_autograd_hooks and static.recording and not static.finalize_queued:
                static.finalize_queued = True
                at_backward_end(self._finalize_recorded_from_engine)

    # ---------------------------------------------------------------------------------------
    # 2. During backward: hook, mark ready, launch.

    def _autograd_hook(self, replica_index: int, index: int) -> None:
        """Called by autograd after ``param.grad`` of (replica, index) was accumulated."""
        with self._lock:
            if self._plain_iteration:  # the common case, with none of the checks below
                self._used[replica_index][index] = True  # See Note [Locally used]
                if replica_index == 0:
                    self._hook_order.append(index)  # See Note [Ready order]
                self._mark_variable_ready(replica_index, index)
                return
            # A hook call without a gradient happens only in a synced backward; the set is
            # that iteration's, and must not hide the real gradients of later no_sync passes.
            no_gradient = (
                self._expect_autograd_hooks and (replica_index, index) in self._no_gradient
            )
            if not no_gradient:
                self._used[replica_index][index] = True  # See Note [Locally used]
            if not self._expect_autograd_hooks:
                # Accumulating locally; the next synced step reduces the sum.
                if self._as_view:
                    bucket, replica, intra = self._slots[replica_index][index]
                    if not bucket.expect_sparse_gradient:
                        self._views.move_into(replica, intra, (replica_index, index))
                return
            static = self._static  # See Note [Static graph] in reducer.static_graph
            if static.recording:  # the first iteration: count, reduce at the end
                static.counting[replica_index][index] += 1
                if replica_index == 0:
                    self._hook_order.append(index)  # See Note [Ready order]
                if not static.finalize_queued:
                    static.finalize_queued = True
                    at_backward_end(self._finalize_recorded_from_engine)
                return
            if static.remaining is not None:  # later ones: ready after the recorded calls
                left = static.remaining[replica_index][index] - 1
                static.remaining[replica_index][index] = left
                if left > 0:
                    return
                if left < 0:
                    raise self._fail(self._not_static_error(replica_index, index))
            if self._unused and (replica_index, index) in self._unused_set:
                # Found unused, yet here is its gradient: the search could not see its use.
                raise self._fail(self._marked_twice_error(replica_index, index))
            if not self._has_marked_unused:
                self._has_marked_unused = True
                for unused in self._unused:
                    self._mark_variable_ready(*unused)
            if replica_index == 0:
                self._hook_order.append(index)  # See Note [Ready order]
            self._mark_variable_ready(replica_index, index)

    def _mark_variable_ready(self, replica_index: int, index: int) -> None:
        ready = self._ready[replica_index]
        if ready[index]:
            raise self._fail(self._marked_twice_error(replica_index, index))
        ready[index] = True
        self._backward_stats[replica_index][index] = _now_ns() - self._backward_stats_base
        self._require_finalize = True
        bucket, replica, intra = self._slots[replica_index][index]
        if bucket.expect_sparse_gradient or self._as_view or replica.fused[intra]:
            self._settle_at_hook(replica_index, index, bucket, replica, intra)
        # Otherwise the gradient is copied with the rest of its replica, below: see Note
        # [Copies batched per bucket replica].
        replica.pending -= 1
        if replica.pending == 0:
            if not (bucket.expect_sparse_gradient or self._as_view):
                self._copy_replica(replica_index, bucket, replica)
            # The replica's last gradient: finish prescaling, so that the sum over ranks is
            # the average. See Note [Division fused into the copy] in reducer.buckets.
            if self._prescale:
                self._scale_replica(replica)
            bucket.pending -= 1
            if bucket.pending == 0:
                self._mark_bucket_ready(bucket.index)
                # Buckets launch only here: the last launch is seen here too.
                if self._next_bucket == len(self._buckets) and not self._all_launched:
                    self._all_launched = True
                    if self._find_unused:
                        self._launch_used_map()
                    if not self._static.recording:  # the recording iteration finalizes itself
                        at_backward_end(self._finalize_from_engine)

    def _settle_at_hook(
        self, replica_index: int, index: int, bucket: Bucket, replica: BucketReplica, intra: int
    ) -> None:
        """The work a gradient needs at its own hook: a sparse one becomes its bucket's
        contents; a bucket view is checked; a large one is scaled on its way in."""
        if bucket.expect_sparse_gradient:
            self._set_sparse_contents(replica_index, index, replica)
        elif self._as_view:
            # See Note [Gradients as bucket views] in reducer.bucket_views and Note [Bucket
            # views scaled by runs].
            param, view = replica.variables[intra], replica.views[intra]
            fused = replica.fused[intra]
            multiply = self._prescale and self._scaling == "reciprocal"
            key = (replica_index, index)
            fresh = key in self._views.fresh  # copied in while accumulating locally
            self._views.fresh.discard(key)
            if not self._used[replica_index][index]:
                self._views.set_aside(key, param, view)  # zeros: any scaling keeps them
            elif param.grad is not view:
                grad = self._contribution(replica_index, index, param)
                scaled = grad is not None and (multiply or (self._prescale and fused))
                self._views.settle(param, view, grad, self._copy_in if scaled else Tensor.copy_)
                if scaled and not fused:
                    replica.scaled_at_hook.append(intra)
            elif multiply and fresh:  # torch would copy it in now, multiplying
                view.mul_(1.0 / self._divisor)
                if not fused:
                    replica.scaled_at_hook.append(intra)
            elif self._prescale and fused:  # autograd accumulated into a large view
                view.div_(self._divisor)
            # Otherwise a small view that autograd accumulated into is divided with its run.
        elif self._prescale:  # replica.fused[intra]
            # See Note [Division fused into the copy]: a large gradient, scaled on the way in.
            grad = self._contribution(replica_index, index, replica.variables[intra])
            if grad is None:
                replica.views[intra].zero_()
            else:
                self._copy_in(replica.views[intra], grad)

    # Note [Bucket views scaled by runs]
    # With gradient_as_bucket_view, torch's reducer scales each view at its hook: it divides
    # a gradient that autograd accumulated into the view in place, and multiplies by 1 / W
    # one it copies in (see Note [Gradient scaling] in reducer.bucket_views). Dividing a
    # small view at its own hook costs an op dispatch per parameter; dividing the runs of
    # small views (``scale_runs``) once the replica is complete is the same element-wise op
    # on the same elements, so the same bits, in one op per run. So a small view accumulated
    # in place waits for its run; a small view scaled at its hook (copied in while
    # multiplying, or multiplied in place because it was moved in while accumulating
    # locally) is listed in ``replica.scaled_at_hook``, and a replica with such views divides
    # the others one by one instead. Large views are scaled at their hooks (see Note
    # [Division fused into the copy] in reducer.buckets); zeros (unused here) stay zeros.

    def _scale_replica(self, replica: BucketReplica) -> None:
        """Scale what was not scaled at its hook in a complete replica. Copies: the runs of
        small gradients, with the reducer's rounding. Bucket views: the small views that
        autograd accumulated into, divided (see Note [Bucket views scaled by runs])."""
        if not self._as_view:
            for run in replica.scale_runs:
                scale_(run, self._divisor, self._scaling)
        elif not replica.scaled_at_hook:
            for run in replica.scale_runs:
                run.div_(self._divisor)
        else:
            done = set(replica.scaled_at_hook)
            for intra, view in enumerate(replica.views):
                if not replica.fused[intra] and intra not in done:
                    view.div_(self._divisor)

    def _copy_in(self, view: Tensor, grad: Tensor) -> None:
        """``view = grad``, scaled on the way in. See Note [Gradient scaling]."""
        scale_into(grad, view, self._divisor, self._scaling)

    def _contribution(self, replica_index: int, index: int, param: Tensor) -> Tensor | None:
        """The dense gradient ``param`` contributes, or None where it contributes zeros
        (no gradient, or unused here: see Note [Unused parameters])."""
        grad = param.grad
        if grad is None or not self._used[replica_index][index]:
            return None
        if grad.layout != torch.strided:
            raise self._fail(self._layout_error(replica_index, index, expected="dense"))
        return grad

    def _set_sparse_contents(self, replica_index: int, index: int, replica: BucketReplica) -> None:
        """A sparse bucket's contents are the scaled gradient itself (a copy: .grad stays)."""
        param = replica.variables[0]
        grad = param.grad
        if grad is None or not self._used[replica_index][index]:
            replica.contents = empty_sparse_like(param)
        elif not grad.is_sparse:
            raise self._fail(self._layout_error(replica_index, index, expected="sparse"))
        else:
            replica.contents = grad.clone()
            if self._prescale:
                # torch divides sparse gradients in either mode: see Note [Gradient scaling].
                replica.contents.div_(self._divisor)

    # Note [Copies batched per bucket replica]
    # Copying each gradient at its hook costs one op dispatch per parameter, which dominates
    # for many small parameters; the replica's copies instead go together when its last
    # gradient is ready. Nothing is lost by waiting: the bucket cannot launch before then, and
    # a gradient cannot change after its hook (a second accumulation would mark it ready
    # twice). Large gradients are still divided on the way in at their own hook (see Note
    # [Division fused into the copy]). In a plain iteration (every gradient arrives through
    # its own hook, nothing unused) the copy needs no per-parameter decision at all, so the
    # Python loop is skipped too: one list of the .grad tensors, one multi-tensor copy.

    def _copy_replica(self, replica_index: int, bucket: Bucket, replica: BucketReplica) -> None:
        """Copy a complete bucket replica's gradients into its contents, as one call.
        See Note [Copies batched per bucket replica]."""
        if self._plain_iteration:
            # Every parameter's hook fired with its gradient in place (see _autograd_hook), so
            # each contributes .grad as it is: one multi-tensor copy, no per-parameter checks.
            # A gradient that is None (reset by another hook) or sparse makes the copy raise
            # before any harm: the checked path below then zeroes or reports it.
            if self._prescale and any(replica.fused):  # those were copied at their hooks
                pairs = [
                    (view, param.grad)
                    for view, param, fused in zip(
                        replica.views, replica.variables, replica.fused, strict=True
                    )
                    if not fused
                ]
                views, grads = [v for v, _ in pairs], [g for _, g in pairs]
            else:
                views, grads = replica.views, [param.grad for param in replica.variables]
            if try_copy_all(views, grads):
                return
        destinations: list[Tensor] = []
        sources: list[Tensor] = []
        for intra, (index, param, view) in enumerate(
            zip(bucket.variable_indices, replica.variables, replica.views, strict=True)
        ):
            if replica.fused[intra] and self._prescale:
                continue  # copied at its hook
            grad = self._contribution(replica_index, index, param)
            if grad is None:
                view.zero_()
            else:
                destinations.append(view)
                sources.append(grad)
        copy_all(destinations, sources)

    def _mark_bucket_ready(self, bucket_index: int) -> None:
        """Launch this bucket and every ready one after it, if it is next in line."""
        if bucket_index > self._next_bucket:
            return  # See Note [Buckets launch in index order]
        while (
            self._next_bucket < len(self._buckets) and self._buckets[self._next_bucket].pending == 0
        ):
            self._launch(self._buckets[self._next_bucket])
            self._next_bucket += 1

    def _launch(self, bucket: Bucket) -> None:
        """Start the allreduce of every replica's contents of ``bucket``, as one collective
        (or hand the bucket to the comm hook)."""
        # The launch time is taken before the call: the collective may start, and its clock
        # run, before the call returns to this thread.
        self._bucket_launch_ns[bucket.index] = time.perf_counter_ns() - self._backward_stats_base
        if self._comm_hook is None:
            bucket.work = self._process_group.allreduce([r.contents for r in bucket.replicas])
            return
        state, hook = self._comm_hook
        is_last = bucket.index == len(self._buckets) - 1
        grad_bucket = GradBucket(
            bucket.index, bucket.replicas[0], is_last=is_last, process_group=self._process_group
        )
        try:
            future = hook(state, grad_bucket)
        except Exception as exc:
            # The other ranks wait for this bucket: fail here, loudly, and for good.
            error = errors.comm_hook_raised_error(
                self._wording, self._rank(), hook_name(hook), bucket.index, exc
            )
            raise self._fail(error) from exc
        if not is_future(future):
            raise self._fail(
                errors.comm_hook_not_future_error(hook_name(hook), bucket.index, future)
            )
        bucket.work = FutureWork(future, bucket.index, self._timeout, hook_name(hook))

    def _launch_used_map(self) -> None:
        """Allreduce which parameters got a gradient on this rank. See Note [Unused parameters].

        The map lives on the parameters' device, as torch's DDP keeps it: NCCL reduces CUDA
        tensors only, and a CPU map would depend on the group moving it to the right GPU."""
        used = torch.tensor(
            [any(per_replica) for per_replica in zip(*self._used, strict=True)],
            dtype=torch.int32,
            device=self._replicas[0][0].device,
        )
        self._used_map = (self._process_group.allreduce([used]), used)

    # ---------------------------------------------------------------------------------------
    # 3. When backward ends: finalize.

    def _finalize_from_engine(self) -> None:
        # No grad mode: after backward(create_graph=True) the engine runs callbacks with it on.
        with self._lock, torch.no_grad():
            try:
                self._finalize_backward()
            except BaseException as exc:
                self._fail(exc)
                raise

    def _finalize_recorded_from_engine(self) -> None:
        """Static graph, first iteration: backward has ended, every gradient is complete.

        A parameter whose hook never fired is unused; all are marked ready now, in index
        order, which launches every bucket; then finalize as usual. See Note [Static graph]
        in reducer.static_graph.
        """
        with self._lock, torch.no_grad():
            try:
                self._unused_set = self._static.end_recording()
                self._unused = sorted(self._unused_set)
                for r, replica in enumerate(self._replicas):
                    for i in range(len(replica)):
                        self._mark_variable_ready(r, i)
                self._finalize_backward()
            except BaseException as exc:
                self._fail(exc)
                raise

    def _finalize_backward(self) -> None:
        """Wait for every bucket and write the averaged gradients into ``.grad``."""
        finalize_start = time.perf_counter_ns()
        self._expect_autograd_hooks = False
        self._plain_iteration = False
        self._require_finalize = False
        globally_used: list[int] | None = self._static.globally_used
        if self._used_map is not None:
            work, used = self._used_map
            self._used_map = None
            work.wait()
            globally_used = used.tolist()
        done = []
        with torch.no_grad():
            for bucket in self._buckets:
                assert bucket.work is not None  # every bucket launched before finalize queued
                work, bucket.work = bucket.work, None
                work.wait()
                done.append(self._completion_ns(work))
                if bucket.expect_sparse_gradient:
                    write_sparse(bucket, work.result(), globally_used)
                    continue
                if self._comm_hook is not None:
                    adopt_hook_result(bucket, work.result())
                if self._as_view:
                    self._views.write_back(bucket, globally_used)
                else:
                    write_dense(bucket, globally_used)
        self._static.end_iteration(globally_used)
        count = len(self._replicas[0])
        self._used = [[False] * count for _ in self._replicas]
        self._last_hook_order = self._hook_order
        self._iterations += 1
        base = self._backward_stats_base
        self._last_iteration = IterationStats(
            start_ns=base,
            ready_ns=tuple(tuple(stats) for stats in self._backward_stats),
            launch_ns=tuple(self._bucket_launch_ns),
            done_ns=tuple(done),
            finalize_start_ns=finalize_start - base,
            finalize_end_ns=time.perf_counter_ns() - base,
            bucket_nbytes=tuple(b.nbytes for b in self._buckets),
            # Found unused, or reached only by outputs the loss did not use.
            unused_parameters=len(self._unused) + len(self._no_gradient),
        )

    def _completion_ns(self, work: Work) -> int:
        """When ``work`` completed, as an offset from this iteration's start."""
        completed = getattr(work, "completed_ns", None)
        now = time.perf_counter_ns()
        when = completed if isinstance(completed, int) and completed <= now else now
        return when - self._backward_stats_base

    # ---------------------------------------------------------------------------------------
    # Setup between iterations.

    def initialize_buckets(self, bucket_indices: list[list[int]]) -> None:
        """Replace the bucket assignment (between iterations only)."""
        with self._lock:
            self._check_usable("initialize_buckets")
            if self._expect_autograd_hooks:
                raise ReductionError(
                    "initialize_buckets was called after prepare_for_backward and before "
                    "backward finished; change the bucket assignment between iterations"
                )
            if self._as_view and self._buckets:
                # Moving the gradients into new views would adopt a replaced .grad silently.
                self._views.check_kept(self._buckets)
            indices = validate_bucket_indices(bucket_indices, len(self._replicas[0]), self._names)
            buckets, locators = build_buckets(
                self._replicas,
                indices,
                self._expect_sparse,
                self._names,
            )
            self._buckets = buckets
            self._slots = slots(buckets, locators, len(self._replicas))
            if self._as_view:
                self._views.attach(buckets)

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]`` instead of allreduce.

        The hook gets a :class:`reducer.GradBucket` whose buffer holds the bucket's gradients,
        not divided by the world size (the hook divides, as the built-in hooks do), and returns
        a future of the reduced flat tensor. Register once, before the first backward.
        """
        with self._lock:
            self._check_usable("register_comm_hook")
            check_comm_hook(hook, GRAD_BUCKET_TYPES)
            if self._comm_hook is not None:
                raise ReductionError(
                    "register_comm_hook: a comm hook is already registered; register one, once"
                )
            if self._iterations > 0 or self._expect_autograd_hooks:
                raise ReductionError(
                    "register_comm_hook must be called before the first backward pass"
                )
            if len(self._replicas) > 1:
                raise InvalidArgument(
                    f"register_comm_hook: comm hooks take one replica per process, this "
                    f"reducer has {len(self._replicas)}"
                )
            self._comm_hook = (state, hook)
            self._prescale = False

    # What the DDP wrapper needs beyond the contract (torch's reducer has the same calls).

    def _set_static_graph(self) -> None:
        """Promise the same graph every iteration from now on, as ``static_graph=True`` does
        (see Note [Static graph] in reducer.static_graph). Only before the first iteration,
        which records the graph."""
        with self._lock:
            self._check_usable("_set_static_graph")
            if self._iterations > 0 or self._expect_autograd_hooks:
                raise errors.static_graph_too_late_error(self._wording, self._iterations)
            self._static.enabled = True

    def _set_divisor(self, divisor: int) -> None:
        """Scale bucket contents by ``divisor`` from the next iteration on, not by the world
        size: DDP's ``join(divide_by_initial_world_size=False)`` averages over the ranks still
        training (with the reducer's rounding: torch multiplies by ``1.0 / divisor``). A comm
        hook divides by itself and ignores it."""
        with self._lock:
            if self._expect_autograd_hooks:
                raise ReductionError(
                    "_set_divisor was called during an iteration; change it between iterations"
                )
            if isinstance(divisor, bool) or not isinstance(divisor, int):
                raise InvalidArgument(f"_set_divisor: divisor must be an int, got {divisor!r}")
            if not 1 <= divisor <= self._world_size:
                raise InvalidArgument(
                    f"_set_divisor: divisor must be a number of ranks, 1 to {self._world_size}, "
                    f"got {divisor}"
                )
            self._divisor = divisor
            self._prescale = self._comm_hook is None and divisor > 1

    def _shadow_iteration(self, *, used_map: bool) -> None:
        """Issue the collectives of one synced backward, contributing zeros, and wait for them.

        A rank whose inputs ran out (DDP's join) must still match what the ranks that train
        issue: one reduction per bucket in index order (through the comm hook, if one is
        registered: the hook sees a bucket of zeros), then, where they search for unused
        parameters, the used map (all zeros: nothing is used here). This rank's gradients and
        buckets are left alone. Between iterations only.
        """
        works: list[Work] = []
        with self._lock:
            self._check_usable("join")
            if self._expect_autograd_hooks:
                raise errors.joined_mid_iteration_error(self._wording, self._rank())
            launch_ns = self._bucket_launch_ns  # the last real iteration's, kept for stats
            self._bucket_launch_ns = [0] * len(self._buckets)
            try:
                for bucket in self._buckets:
                    shadow = shadow_bucket(bucket)
                    self._launch(shadow)
                    assert shadow.work is not None  # _launch sets it or raises
                    works.append(shadow.work)
                if used_map:
                    unused = torch.zeros(len(self._replicas[0]), dtype=torch.int32)
                    works.append(self._process_group.allreduce([unused]))
            finally:
                self._bucket_launch_ns = launch_ns
        for work in works:
            work.wait()

    # ---------------------------------------------------------------------------------------
    # Inspection and teardown.

    @property
    def last_iteration(self) -> IterationStats | None:
        """Timings of the last synced iteration (None before the first finished)."""
        return self._last_iteration

    @property
    def gradient_scaling(self) -> GradientScaling:
        """How bucket contents are scaled before the SUM: "divide" or "reciprocal" (see Note
        [Gradient scaling] in reducer.bucket_views)."""
        return self._scaling

    @property
    def iterations(self) -> int:
        """How many synced iterations finished."""
        return self._iterations

    @property
    def backward_stats(self) -> list[list[int]]:
        """Per replica and parameter: ns from prepare_for_backward until it was ready."""
        return [list(stats) for stats in self._backward_stats]

    @property
    def ready_order(self) -> list[int]:
        """Parameter indices in the order their gradients became ready in the last synced
        iteration (replica 0), then those that got none, in index order. See Note [Ready
        order]."""
        order = list(dict.fromkeys(reversed(self._last_hook_order)))[::-1]  # last call counts
        seen = set(order)
        return order + [i for i in range(len(self._replicas[0])) if i not in seen]

    @property
    def bucket_launch_stats(self) -> list[int]:
        """Per bucket: ns from prepare_for_backward until its allreduce was issued."""
        return list(self._bucket_launch_ns)

    @property
    def bucket_indices(self) -> list[list[int]]:
        """The current bucket assignment (parameter indices per bucket)."""
        return [list(b.variable_indices) for b in self._buckets]

    @property
    def bucket_nbytes(self) -> list[int]:
        """Bytes of one replica's contents per bucket (0 for sparse buckets)."""
        return [b.nbytes for b in self._buckets]

    @property
    def unused_parameters(self) -> list[tuple[int, int]]:
        """(replica, parameter) pairs found unused by the last prepare_for_backward."""
        return list(self._unused)

    def close(self) -> None:
        """Remove every hook this reducer put on the parameters. Idempotent."""
        with self._lock:
            self._closed = True
            self._expect_autograd_hooks = False
            self._plain_iteration = False
        remove_hooks(self._hook_handles)

    def __enter__(self) -> Reducer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<reducer.Reducer {len(self._replicas[0])} parameters x {len(self._replicas)} "
            f"replica(s), {len(self._buckets)} buckets, world size {self._world_size}>"
        )

    # ---------------------------------------------------------------------------------------
    # Failing. The messages are built in reducer.errors.

    def _check_usable(self, what: str) -> None:
        words = self._wording
        if what == "prepare_for_backward":
            what = words.starts_iteration
        if self._closed:
            raise errors.closed_error(what, words)
        if self._failure is not None:
            raise errors.failed_error(what, words, self._failure) from self._failure

    def _fail(self, error: BaseException) -> BaseException:
        """Fail for good (see ``_failure``): stop expecting hooks; returns ``error``."""
        self._failure = error
        self._expect_autograd_hooks = False
        self._plain_iteration = False
        return error

    def _rank(self) -> int:
        return self._process_group.rank()

    def _marked_twice_error(self, replica_index: int, index: int) -> ReductionError:
        found_unused = (replica_index, index) in self._unused_set
        return errors.marked_twice_error(
            self._wording,
            self._rank(),
            self._names,
            replica_index,
            index,
            replicas=len(self._replicas),
            found_unused=found_unused,
        )

    def _not_static_error(self, replica_index: int, index: int) -> ReductionError:
        assert self._static.hook_counts is not None  # recorded before calls are expected
        recorded = self._static.hook_counts[replica_index][index]
        return errors.not_static_error(self._wording, self._rank(), self._names, index, recorded)

    def _layout_error(self, replica_index: int, index: int, *, expected: str) -> ReductionError:
        return errors.layout_error(
            self._wording, self._rank(), self._names, replica_index, index, expected=expected
        )
