"""The reducer: averages gradients across ranks while backward is still running.

The happy path, one iteration:

1. ``prepare_for_backward(outputs)`` resets the per-iteration counters and, given outputs,
   searches their autograd graph for parameters that will get no gradient (unused).
2. During backward, autograd calls a hook after each parameter's gradient is accumulated
   (``_autograd_hook``). The parameter is marked ready; when the last parameter of a bucket
   replica is ready, its gradients are copied into the bucket's flat tensor and divided by
   the world size; when every replica of the bucket is ready, and every earlier bucket has
   launched, one asynchronous ``allreduce`` of the bucket starts (``_mark_bucket_ready``).
3. Once the last bucket has launched, a finalize step is queued on the autograd engine. It runs
   when backward ends, waits for every allreduce and writes the averages into ``.grad``.

Communication of early buckets thus overlaps with the computation of later gradients.

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

# Note [Gradients as bucket views]
# With gradient_as_bucket_view, each dense .grad is a view of its bucket: autograd accumulates
# straight into the bucket, the division and the allreduce happen in place, and nothing is
# copied in or out. A fresh gradient (after zero_grad(set_to_none=True)) is copied in once
# and .grad is pointed back at the view. .grad stays that one view object from iteration to
# iteration (until the buckets are rebuilt), as in torch, so an optimizer or user code that
# holds on to it keeps seeing the gradient. A locally unused parameter (found unused, or
# reached only by outputs the loss did not use) must contribute zeros, yet keep its .grad
# exactly if it is unused on every rank: its values are set aside (``_kept``), the view is
# zeroed for the reduction, and finalize copies them back if no rank used it. The view
# follows the parameter's strides: see Note [Bucket views follow the parameter's strides] in
# reducer.buckets.

# Note [Static graph]
# With static_graph=True the reducer trusts that every iteration runs the same graph. The
# first iteration only counts how often each parameter's hook fires (reentrant checkpointing
# fires some several times) and reduces everything once backward has ended, without overlap.
# Later iterations skip the graph search: the parameters unused in the first iteration are
# marked ready at the first hook call, and a parameter is ready when its hook has fired as
# often as it did in the first iteration. The first iteration's used map is kept.
# The end-of-backward reduction of the first iteration is queued at the first hook call, on
# the graph task that runs it. Inside reentrant checkpointing that is an inner backward, which
# ends before the outer one has produced every gradient; so a caller that sees the outer
# backward start (the DDP wrapper's output sink) queues it there first, with
# ``_queue_recorded_finalize``.

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

import functools
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
from torch import Tensor
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from .buckets import (
    Bucket,
    BucketReplica,
    build_buckets,
    empty_sparse_like,
    shadow_bucket,
    validate_bucket_indices,
)
from .comm_hooks import GRAD_BUCKET_TYPES, CommHook, FutureWork, GradBucket, hook_name
from .errors import (
    REDUCER_WORDING,
    InvalidArgument,
    ReductionError,
    Wording,
    describe_param,
    describe_params,
)
from .graph import gradient_accumulator, reached_accumulators
from .process_group import ProcessGroup, Work
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

# Called at every hook: one global lookup each, instead of a module and an attribute.
_now_ns = time.perf_counter_ns
_grad_enabled = torch.is_grad_enabled


class Reducer:
    """Averages the gradients of ``replicas`` over ``process_group`` during backward.

    ``replicas`` holds one list of parameters per model replica in this process (usually
    one); replicas must agree in parameter count, shapes, dtypes and sparsity.
    ``bucket_indices`` partitions parameter indices into buckets, e.g. from
    :func:`reducer.compute_bucket_assignment_by_size`. ``expect_sparse_gradients[r][i]`` marks
    parameters with sparse gradients (each needs a bucket of its own). ``param_names`` (one
    per parameter) makes error messages name parameters. With ``gradient_as_bucket_view``,
    each dense ``.grad`` is a view into its bucket (see Note [Gradients as bucket views]).
    ``static_graph`` promises the same graph every iteration (see Note [Static graph]).
    ``timeout`` (seconds, finite) bounds the wait for a comm hook's future (collectives have
    their own).
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
    ) -> None:
        self._replicas = check_replicas(replicas, names_hint(param_names, replicas))
        self._as_view = bool(gradient_as_bucket_view)
        count = len(self._replicas[0])
        self._names = check_names(param_names, count)
        self._expect_sparse = check_sparse(expect_sparse_gradients, self._replicas, self._names)
        self._process_group = process_group
        self._world_size = check_process_group(process_group)
        self._lock = threading.Lock()

        # The state machine. Transitions: prepare_for_backward, _mark_variable_ready,
        # _mark_bucket_ready, _finalize_backward.
        # Between prepare_for_backward and finalize: hooks mark parameters ready.
        self._expect_autograd_hooks = False
        # Expecting hooks in an iteration with no special case: see _autograd_hook.
        self._plain_iteration = False
        # Some parameter was marked ready: finalize must run before the next iteration.
        self._require_finalize = False
        # The first bucket not yet launched. See Note [Buckets launch in index order].
        self._next_bucket = 0
        self._all_launched = False
        # See Note [Unused parameters].
        self._find_unused = False
        self._unused: list[tuple[int, int]] = []
        self._unused_set: set[tuple[int, int]] = set()
        # Reached by the outputs, but not by the loss: hook calls without a gradient.
        self._no_gradient: set[tuple[int, int]] = set()
        self._has_marked_unused = False
        self._used_map: tuple[Work, Tensor] | None = None
        # See Note [Locally used].
        self._used = [[False] * count for _ in self._replicas]
        self._ready = [[False] * count for _ in self._replicas]
        self._backward_stats = [[0] * count for _ in self._replicas]
        self._backward_stats_base = 0
        self._bucket_launch_ns: list[int] = []
        # An error raised during an iteration leaves the ranks out of step; the reducer then
        # refuses further use until it is closed and replaced.
        self._failure: BaseException | None = None
        # How errors name the caller's API; the DDP wrapper sets its own (see errors.Wording).
        self._wording: Wording = REDUCER_WORDING
        self._closed = False
        # A comm hook replaces the allreduce; the hook divides, so buckets are not prescaled.
        self._comm_hook: tuple[object, CommHook] | None = None
        # Bucket contents are divided by this before the allreduce: the world size, or the
        # number of ranks still training under DDP's join (see _set_divisor).
        self._divisor = self._world_size
        # A division by 1 is the identity bit for bit: skip that pass.
        self._prescale = self._divisor > 1
        self._timeout = check_timeout(timeout, "Reducer")
        # See Note [Static graph]: hook calls counted in the first iteration, then expected.
        self._static_graph = bool(static_graph)
        self._recording = False
        self._delayed_queued = False
        self._counting: list[list[int]] = []
        self._hook_counts: list[list[int]] | None = None
        self._remaining: list[list[int]] | None = None
        self._static_globally_used: list[int] | None = None
        # See Note [Ready order]: this iteration's, and the last synced iteration's.
        self._hook_order: list[int] = []
        self._last_hook_order: list[int] = []
        # The record of the last synced iteration, for logging and traces.
        self._iterations = 0
        self._last_iteration: IterationStats | None = None

        # Bucket views: the .grad values of locally unused parameters, set aside while their
        # views hold zeros for the reduction. See Note [Gradients as bucket views].
        self._kept: dict[tuple[int, int], Tensor] = {}
        self._buckets: list[Bucket] = []
        # Per replica and parameter: its bucket, bucket replica and position there.
        self._slots: list[list[tuple[Bucket, BucketReplica, int]]] = []
        self.initialize_buckets(bucket_indices)

        # Keep each parameter's accumulator alive, so the graph search recognizes it.
        self._accumulators: dict[Node, tuple[int, int]] = {}
        self._hook_handles: list[RemovableHandle] = []
        this = weakref.ref(self)
        for r, replica in enumerate(self._replicas):
            for i, param in enumerate(replica):
                self._accumulators[gradient_accumulator(param)] = (r, i)
                hook = functools.partial(_grad_ready_hook, this, r, i)
                # torch leaves this method unannotated.
                handle = param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
                self._hook_handles.append(handle)
        # A reducer dropped without close() must not leave hooks on the model.
        weakref.finalize(self, _remove_hooks, self._hook_handles)

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
                raise self._fail(self._unfinished_error())
            outputs = check_outputs(outputs)
            if self._as_view:
                self._check_views_kept()
            self._expect_autograd_hooks = True
            self._next_bucket = 0
            self._all_launched = False
            self._backward_stats_base = time.perf_counter_ns()
            self._bucket_launch_ns = [0] * len(self._buckets)
            for bucket in self._buckets:
                for replica in bucket.replicas:
                    replica.pending = len(replica.variables)
                bucket.pending = len(bucket.replicas)
            count = len(self._replicas[0])
            self._ready = [[False] * count for _ in self._replicas]
            self._has_marked_unused = False
            self._find_unused = bool(outputs)
            self._unused_set = set()
            self._no_gradient = set()
            self._recording = False
            self._remaining = None
            self._hook_order = []
            if self._static_graph and self._hook_counts is not None:
                # See Note [Static graph]: no search, the first iteration's record applies.
                self._find_unused = False
                self._unused_set = {
                    (r, i)
                    for r, counts in enumerate(self._hook_counts)
                    for i, calls in enumerate(counts)
                    if calls == 0
                }
                self._remaining = [list(counts) for counts in self._hook_counts]
            elif self._static_graph:
                self._recording, self._delayed_queued = True, False
                self._find_unused = True  # the used map of this iteration is kept for good
                self._counting = [[0] * count for _ in self._replicas]
            elif outputs:
                reached = reached_accumulators(outputs, self._accumulators)
                self._unused_set = set(self._accumulators.values()) - reached
            self._unused = sorted(self._unused_set)
            # Hooks expected, nothing unused to mark, no static-graph counting: the hook can
            # go straight to _mark_variable_ready. Cleared wherever one of these changes.
            self._plain_iteration = not (
                self._unused or self._recording or self._remaining is not None
            )

    # ---------------------------------------------------------------------------------------
    # 2. During backward.

    def _expect_no_gradient(
        self, outputs_with_grad: Sequence[Tensor], outputs_without_grad: Sequence[Tensor]
    ) -> None:
        """Backward found outputs the loss did not use (``outputs_without_grad``).

        Called before any hook (from the DDP wrapper's output sink). Parameters that only the
        unused outputs reach get hook calls without a gradient: they count as unused, not as
        used with zeros. See Note [Outputs not used in the loss] in reducer.ddp. A parameter
        that the search reaches from neither kind of output is not among them: inside a
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
                    self._move_into_view(replica_index, index)
                return
            if self._recording:  # static graph, first iteration: count, reduce at the end
                self._counting[replica_index][index] += 1
                if replica_index == 0:
                    self._hook_order.append(index)  # See Note [Ready order]
                if not self._delayed_queued:
                    self._delayed_queued = True
                    _at_backward_end(self._finalize_recorded_from_engine)
                return
            if self._remaining is not None:  # static graph: ready after the recorded calls
                left = self._remaining[replica_index][index] - 1
                self._remaining[replica_index][index] = left
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

    def _queue_recorded_finalize(self) -> None:
        """Static graph, first iteration: queue the end-of-backward reduction now.

        Called where the outermost backward starts, before any hook (by the DDP wrapper's
        output sink), so that reentrant checkpointing cannot end it early. See Note [Static
        graph]. Elsewhere a no-op.
        """
        with self._lock:
            if self._expect_autograd_hooks and self._recording and not self._delayed_queued:
                self._delayed_queued = True
                _at_backward_end(self._finalize_recorded_from_engine)

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
            # the average. See Note [Division fused into the copy].
            if self._prescale:
                for run in replica.scale_runs:
                    run.div_(self._divisor)
            bucket.pending -= 1
            if bucket.pending == 0:
                self._mark_bucket_ready(bucket.index)
                # Buckets launch only here: the last launch is seen here too.
                if self._next_bucket == len(self._buckets) and not self._all_launched:
                    self._all_launched = True
                    if self._find_unused:
                        self._launch_used_map()
                    if not self._recording:  # the recording iteration finalizes by itself
                        _at_backward_end(self._finalize_from_engine)

    def _settle_at_hook(
        self, replica_index: int, index: int, bucket: Bucket, replica: BucketReplica, intra: int
    ) -> None:
        """The work a gradient needs at its own hook: a sparse one becomes its bucket's
        contents; a bucket view is checked; a large one is divided on its way in."""
        if bucket.expect_sparse_gradient:
            self._set_sparse_contents(replica_index, index, replica)
        elif self._as_view:
            if (
                replica.variables[intra].grad is replica.views[intra]
                and (self._used[replica_index][index])
            ):
                return  # autograd accumulated into the bucket view: the usual case, done
            self._settle_view(replica_index, index, replica, intra)
        elif self._prescale:  # replica.fused[intra]
            # See Note [Division fused into the copy]: a large gradient, divided on the way in.
            grad = self._contribution(replica_index, index, replica.variables[intra])
            if grad is None:
                replica.views[intra].zero_()
            else:
                torch.div(grad, self._divisor, out=replica.views[intra])

    def _contribution(self, replica_index: int, index: int, param: Tensor) -> Tensor | None:
        """The dense gradient ``param`` contributes, or None where it contributes zeros
        (no gradient, or unused here: see Note [Unused parameters])."""
        grad = param.grad
        if grad is None or not self._used[replica_index][index]:
            return None
        if grad.layout != torch.strided:
            raise self._fail(self._layout_error(replica_index, index, expected="dense"))
        return grad

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
        if self._plain_iteration and not (self._prescale and any(replica.fused)):
            # Every parameter's hook fired with its gradient in place (see _autograd_hook), so
            # each contributes .grad as it is: one multi-tensor copy, no per-parameter checks.
            # A gradient that is None (reset by another hook) or sparse makes the copy raise
            # before any harm: the checked path below then zeroes or reports it.
            grads = [param.grad for param in replica.variables]
            if _try_copy_all(replica.views, grads):
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
        _copy_all(destinations, sources)

    def _settle_view(
        self, replica_index: int, index: int, replica: BucketReplica, intra: int
    ) -> None:
        """Bucket views: make sure the view holds what this parameter contributes.

        See Note [Gradients as bucket views]."""
        view = replica.views[intra]
        param = replica.variables[intra]
        if not self._used[replica_index][index]:
            if param.grad is view:
                # .grad keeps being the view; its values wait aside while it holds zeros.
                self._kept[(replica_index, index)] = view.clone()
            view.zero_()
            return
        if param.grad is view:  # autograd accumulated into the bucket already
            return
        grad = self._contribution(replica_index, index, param)
        if grad is None:
            view.zero_()
        else:
            view.copy_(grad)
            param.grad = view  # a fresh gradient (after set_to_none): the bucket holds it now

    def _move_into_view(self, replica_index: int, index: int) -> None:
        """Bucket views: a gradient autograd created afresh (after set_to_none) moves into
        its view, so that .grad is the view again. See Note [Gradients as bucket views]."""
        bucket, replica, intra = self._slots[replica_index][index]
        if bucket.expect_sparse_gradient:
            return
        param, view = replica.variables[intra], replica.views[intra]
        if param.grad is not None and param.grad is not view:
            view.copy_(param.grad)
            param.grad = view

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
                replica.contents.div_(self._divisor)

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
        else:
            state, hook = self._comm_hook
            grad_bucket = GradBucket(
                bucket.index,
                bucket.replicas[0],
                is_last=bucket.index == len(self._buckets) - 1,
                process_group=self._process_group,
            )
            try:
                future = hook(state, grad_bucket)
            except Exception as exc:
                # The other ranks wait for this bucket: fail here, loudly, and for good.
                raise self._fail(
                    ReductionError(
                        f"the comm hook {hook_name(hook)!r} raised for bucket "
                        f"{bucket.index} on rank {self._rank()}: {type(exc).__name__}: {exc}. "
                        "The ranks are out of step now; fix the hook, then "
                        f"{self._wording.recover}"
                    )
                ) from exc
            if not _is_future(future):
                raise self._fail(
                    ReductionError(
                        f"the comm hook {hook_name(hook)!r} returned a "
                        f"{type(future).__name__} for bucket {bucket.index}, not a "
                        "torch.futures.Future; return the future of the reduction, e.g. "
                        "work.get_future().then(lambda f: f.value()[0])"
                    )
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
    # 3. When backward ends.

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
        order, which launches every bucket; then finalize as usual. See Note [Static graph].
        """
        with self._lock, torch.no_grad():
            try:
                self._hook_counts = self._counting
                self._unused_set = {
                    (r, i)
                    for r, counts in enumerate(self._counting)
                    for i, calls in enumerate(counts)
                    if calls == 0
                }
                self._unused = sorted(self._unused_set)
                for r, counts in enumerate(self._counting):
                    for i in range(len(counts)):
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
        globally_used: list[int] | None = self._static_globally_used
        if self._used_map is not None:
            work, used = self._used_map
            self._used_map = None
            work.wait()
            globally_used = used.tolist()
            if self._recording:
                self._static_globally_used = globally_used
        done = []
        with torch.no_grad():
            for bucket in self._buckets:
                assert bucket.work is not None  # every bucket launched before finalize queued
                work, bucket.work = bucket.work, None
                work.wait()
                done.append(self._completion_ns(work))
                if bucket.expect_sparse_gradient:
                    _write_sparse(bucket, work.result(), globally_used)
                    continue
                if self._comm_hook is not None:
                    _adopt_hook_result(bucket, work.result())
                if self._as_view:
                    self._point_grads_at_views(bucket, globally_used)
                else:
                    _write_dense(bucket, globally_used)
        self._recording = False
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

    def _point_grads_at_views(self, bucket: Bucket, globally_used: list[int] | None) -> None:
        """Bucket views: the average is in the bucket; make every used .grad that view.

        A parameter unused on every rank gets its values back (see Note [Gradients as bucket
        views])."""
        for r, replica in enumerate(bucket.replicas):
            for index, param, view in zip(
                bucket.variable_indices, replica.variables, replica.views, strict=True
            ):
                kept = self._kept.pop((r, index), None)
                if globally_used is not None and not globally_used[index]:
                    if kept is not None:
                        view.copy_(kept)  # unused on every rank: .grad as it was
                    continue
                if param.grad is not view:
                    param.grad = view

    # ---------------------------------------------------------------------------------------
    # Setup, inspection, teardown.

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
                self._check_views_kept()
            indices = validate_bucket_indices(bucket_indices, len(self._replicas[0]), self._names)
            buckets, locators = build_buckets(
                self._replicas,
                indices,
                self._expect_sparse,
                self._names,
                fuse_division=not self._as_view,
            )
            self._buckets = buckets
            self._slots = [
                [
                    (
                        buckets[loc.bucket_index],
                        buckets[loc.bucket_index].replicas[r],
                        loc.intra_bucket_index,
                    )
                    for loc in locators
                ]
                for r in range(len(self._replicas))
            ]
            if self._as_view:
                self._attach_views()

    def _attach_views(self) -> None:
        """Move existing dense gradients into their bucket views and make .grad the view."""
        self._kept = {}
        with torch.no_grad():
            for bucket in self._buckets:
                if bucket.expect_sparse_gradient:
                    continue
                for replica in bucket.replicas:
                    for param, view in zip(replica.variables, replica.views, strict=True):
                        if param.grad is not None and param.grad is not view:
                            view.copy_(param.grad)
                            param.grad = view

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

    # ---------------------------------------------------------------------------------------
    # What the DDP wrapper needs beyond the contract (torch's reducer has the same calls).

    def _set_static_graph(self) -> None:
        """Promise the same graph every iteration from now on, as ``static_graph=True`` does
        (see Note [Static graph]). Only before the first iteration, which records the graph."""
        with self._lock:
            self._check_usable("_set_static_graph")
            if self._iterations > 0 or self._expect_autograd_hooks:
                raise ReductionError(
                    f"_set_static_graph() was called after the first iteration started (this "
                    f"{self._wording.owner} has run {self._iterations} synced iteration(s)); "
                    "the first iteration records the graph, so call it right after "
                    f"construction, before the first {self._wording.starts_iteration}, or "
                    f"build the {self._wording.owner} with static_graph=True"
                )
            self._static_graph = True

    def _set_divisor(self, divisor: int) -> None:
        """Divide bucket contents by ``divisor`` from the next iteration on, not by the world
        size: DDP's ``join(divide_by_initial_world_size=False)`` averages over the ranks still
        training. A comm hook divides by itself and ignores it."""
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
                raise ReductionError(
                    f"rank {self._rank()} joined (ran out of inputs) in the middle of an "
                    f"iteration: {self._wording.starts_iteration} ran, but its backward did not; "
                    "leave the join context only after a complete iteration"
                )
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

    @property
    def last_iteration(self) -> IterationStats | None:
        """Timings of the last synced iteration (None before the first finished)."""
        return self._last_iteration

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
        _remove_hooks(self._hook_handles)

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
    # Errors.

    def _check_usable(self, what: str) -> None:
        words = self._wording
        if what == "prepare_for_backward":
            what = words.starts_iteration
        if self._closed:
            raise ReductionError(f"{what} on a closed {words.owner}; build a new {words.owner}")
        if self._failure is not None:
            raise ReductionError(
                f"{what}: this {words.owner} failed in an earlier iteration "
                f"({type(self._failure).__name__}: {self._failure}); the ranks are out of "
                f"step: {words.recover}"
            ) from self._failure

    def _fail(self, error: BaseException) -> BaseException:
        self._failure = error
        self._expect_autograd_hooks = False
        self._plain_iteration = False
        return error

    def _check_views_kept(self) -> None:
        """Bucket views: a .grad replaced by user code would silently stop being reduced."""
        for bucket in self._buckets:
            if bucket.expect_sparse_gradient:
                continue
            for replica in bucket.replicas:
                for index, param, view in zip(
                    bucket.variable_indices, replica.variables, replica.views, strict=True
                ):
                    grad = param.grad
                    if grad is None or grad is view:
                        continue
                    raise ReductionError(
                        f"{describe_param(index, self._names)}: its .grad was replaced by a "
                        "tensor that is not its bucket view, but gradient_as_bucket_view=True "
                        "reduces the bucket in place. Change .grad in place (zero_(), mul_(), "
                        "copy_()) or set it to None (zero_grad(set_to_none=True)) instead."
                    )

    def _rank(self) -> int:
        return self._process_group.rank()

    def _unfinished_error(self) -> ReductionError:
        words = self._wording
        what = (
            f"{words.starts_iteration} started a new iteration before the previous one "
            "finished its reduction (Expected to have finished reduction in the prior "
            "iteration before starting a new one)"
        )
        per_replica = []
        for r, ready in enumerate(self._ready):
            missing = [i for i, is_ready in enumerate(ready) if not is_ready]
            if missing:
                prefix = f"replica {r}: " if len(self._replicas) > 1 else ""
                per_replica.append(prefix + describe_params(missing, self._names))
        if not per_replica:
            return ReductionError(
                f"{what}: on rank {self._rank()}, every parameter got its gradient, but the "
                "backward pass did not reach its end (it raised after the last gradient, or "
                "was interrupted), so the end-of-backward step that waits for the buckets and "
                f"writes .grad never ran. The ranks are out of step now: {words.recover}."
            )
        return ReductionError(
            f"{what}: on rank {self._rank()}, these parameters never got a gradient: "
            f"{'; '.join(per_replica)}. They were not used to compute the loss, so their "
            f"buckets never launched. {words.search_for_unused}"
        )

    def _marked_twice_error(self, replica_index: int, index: int) -> ReductionError:
        what = describe_param(index, self._names)
        where = f" of replica {replica_index}" if len(self._replicas) > 1 else ""
        if (replica_index, index) in self._unused_set:
            cause = (
                f"It was found unused ({self._wording.found_unused_because}) and marked "
                "ready, then got a gradient anyway: it was used outside the forward pass, in "
                "a tensor not among the outputs, or inside reentrant activation checkpointing "
                "(which hides it from the search; use torch.utils.checkpoint with "
                "use_reentrant=False). Use it inside forward and return what depends on it, "
                f"or {self._wording.no_search}."
            )
        else:
            cause = (
                "Its gradient hook fired twice in one backward pass. Either it is used in two "
                "reentrant activation checkpoints (or in one and outside it): each runs a "
                "backward of its own, so the parameter gets two gradients; use "
                "torch.utils.checkpoint(..., use_reentrant=False), or static_graph=True if "
                "the graph is the same every iteration. Or a second backward went through "
                "the same graph (retain_graph=True) before the reduction finished; call "
                "backward once per iteration (sum the losses first)."
            )
        return ReductionError(
            f"Expected to mark a variable ready only once: {what}{where} was marked ready "
            f"twice in one iteration on rank {self._rank()}. {cause}"
        )

    def _not_static_error(self, replica_index: int, index: int) -> ReductionError:
        assert self._hook_counts is not None
        recorded = self._hook_counts[replica_index][index]
        return ReductionError(
            f"{describe_param(index, self._names)} got more gradient hook calls in this "
            f"iteration than the {recorded} recorded in the first one, on rank {self._rank()}; "
            "static_graph=True needs the same graph every iteration (the same parameters used "
            f"the same number of times). {self._wording.no_static_graph}"
        )

    def _layout_error(self, replica_index: int, index: int, *, expected: str) -> ReductionError:
        """A gradient whose layout (sparse or dense) is not the one its bucket was built for."""
        got = "dense" if expected == "sparse" else "sparse"
        what = (
            f"{describe_param(index, self._names)} got a {got} gradient but its bucket expects "
            f"a {expected} one, on rank {self._rank()}"
        )
        if self._wording.sparse_flags_from_modules:
            # The wrapper derives the flags from nn.Embedding / nn.EmbeddingBag(sparse=True).
            if got == "sparse":
                fix = (
                    "Only the weights of nn.Embedding(sparse=True) and nn.EmbeddingBag("
                    "sparse=True) are bucketed for sparse gradients, and this parameter is not "
                    "one: compute its sparse gradient through such a module, or make it dense "
                    "(sparse=False, e.g. in F.embedding)"
                )
            else:
                fix = (
                    "It belongs to an nn.Embedding or nn.EmbeddingBag with sparse=True, but got "
                    "a dense gradient: it is also used outside the module's lookup (weight "
                    "tying, say). Build that module with sparse=False, or use its weight only "
                    "through the lookup"
                )
        else:
            # A sparse gradient needs the flag set (a bucket of its own); a dense one, cleared.
            flag = "True" if got == "sparse" else "False"
            fix = (
                f"Pass expect_sparse_gradients[{replica_index}][{index}]={flag} (and bucket "
                "assignments computed with the same flags: a sparse gradient needs a bucket of "
                "its own). nn.Embedding(sparse=True) and nn.EmbeddingBag(sparse=True) give "
                "sparse gradients"
            )
        return ReductionError(f"{what}. {fix}.")


# -------------------------------------------------------------------------------------------
# Hooks and the engine.


def _grad_ready_hook(
    reducer_ref: weakref.ReferenceType[Reducer], replica_index: int, index: int, _param: Tensor
) -> None:
    # Through a weak reference: the model must not keep a dropped reducer alive.
    reducer = reducer_ref()
    if reducer is None:
        return
    if _grad_enabled():
        # backward(create_graph=True) runs hooks in grad mode: the reducer's copies and its
        # in-place division of leaf-derived buffers must not be recorded (autograd refuses
        # in-place ops on leaves that require grad). The checked fast path is the usual one.
        with torch.no_grad():
            reducer._autograd_hook(replica_index, index)
    else:
        reducer._autograd_hook(replica_index, index)


def _is_future(value: object) -> bool:
    """A torch future: ``torch.futures.Future``, or what its ``then`` returns.

    ``Future.then`` returns the C++ future that the Python class wraps, not an instance of
    the Python class, and torch has no public name for that type; so the check is on it.
    """
    return isinstance(value, torch._C.Future)


def _remove_hooks(handles: list[RemovableHandle]) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


# Note [Finalize at the outermost backward's end]
# The engine runs a queued callback when the *current* graph task ends. A backward started
# inside another one (reentrant activation checkpointing: the checkpoint's backward node runs
# a backward of its own) is a graph task of its own, which ends while the outer backward may
# still produce gradients: finalizing there would take every later gradient of this iteration
# for local accumulation, silently. So a callback that finds itself at the end of a nested
# backward (the engine is still inside the outer backward's node) does not run: it hooks that
# node, and when the node is done, on the outer graph task, queues itself again. It runs once
# the outermost backward ends. A parameter whose hook fires again meanwhile (the same layer in
# two reentrant checkpoints) is then marked ready twice: a loud error, not a wrong gradient.


def _at_backward_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the outermost backward pass running now ends, on its thread.

    See Note [Finalize at the outermost backward's end]. torch has no public API for either
    step: the engine's ``queue_callback`` (what torch's own DDP uses) and
    ``_current_autograd_node`` (the node whose execution the current backward is nested in)
    are the only ways, so both are isolated here. It must be called from inside backward.
    """
    engine: Any = torch.autograd.Variable._execution_engine

    def at_end() -> None:
        outer: Node | None = torch._C._current_autograd_node()
        if outer is None:  # the outermost backward ended
            callback()
            return
        handles: list[RemovableHandle] = []

        def after_outer_node(*_: object) -> None:
            handles.pop().remove()  # once
            _at_backward_end(callback)  # now on the outer graph task

        handles.append(outer.register_hook(after_outer_node))

    engine.queue_callback(at_end)


# -------------------------------------------------------------------------------------------
# Writing results into .grad.


def _write_dense(bucket: Bucket, globally_used: list[int] | None) -> None:
    if globally_used is None:
        # Every parameter's .grad gets its average. Those that have a .grad take it in one
        # multi-tensor copy; a None among them (a first backward, set_to_none) makes the
        # copy raise, and the loop below allocates what is missing.
        done = True
        for replica in bucket.replicas:
            present = [param.grad for param in replica.variables]
            done = _try_copy_all(present, replica.views) and done
        if done:
            return
    grads: list[Tensor] = []
    views: list[Tensor] = []
    for replica in bucket.replicas:
        for index, param, view in zip(
            bucket.variable_indices, replica.variables, replica.views, strict=True
        ):
            if globally_used is not None and not globally_used[index]:
                continue  # unused on every rank: .grad stays as it was
            if param.grad is None:
                param.grad = torch.empty_like(param, memory_format=torch.preserve_format)
            grads.append(param.grad)
            views.append(view)
    _copy_all(grads, views)


# torch's multi-tensor copy (what its optimizers use); not public API, hence the fallback.
_FOREACH_COPY: Callable[[list[Tensor], list[Tensor]], None] | None = getattr(
    torch, "_foreach_copy_", None
)


def _copy_all(destinations: list[Tensor], sources: list[Tensor]) -> None:
    """``d.copy_(s)`` for every pair, as one call.

    A bucket of many small parameters costs one op dispatch per ``copy_``, which dominates
    the write-back; torch's multi-tensor ``_foreach_copy_`` does them all in one dispatch,
    with the same bits.
    """
    if _FOREACH_COPY is not None and len(destinations) > 1:
        _FOREACH_COPY(destinations, sources)
        return
    for destination, source in zip(destinations, sources, strict=True):
        destination.copy_(source)


_MaybeTensors = list[Tensor] | list[Tensor | None]


def _try_copy_all(destinations: _MaybeTensors, sources: _MaybeTensors) -> bool:
    """:func:`_copy_all` where every entry is a dense tensor; False (nothing to rely on
    copied) where some entry is None or sparse, which the caller handles one by one."""
    try:
        _copy_all(cast(list[Tensor], destinations), cast(list[Tensor], sources))
    except (TypeError, RuntimeError, AttributeError):
        return False
    return True


def _adopt_hook_result(bucket: Bucket, results: list[Tensor]) -> None:
    """A comm hook returns the reduced flat tensor; bring it into the bucket's contents."""
    contents = bucket.replicas[0].contents
    result = results[0]
    if result is contents:
        return
    if result.shape != contents.shape:
        raise ReductionError(
            f"the comm hook returned a tensor of shape {tuple(result.shape)} for bucket "
            f"{bucket.index}, whose buffer has shape {tuple(contents.shape)}; return the "
            "reduced buffer (same shape), e.g. bucket.buffer() after copying into it"
        )
    contents.copy_(result)


def _write_sparse(bucket: Bucket, results: list[Tensor], globally_used: list[int] | None) -> None:
    index = bucket.variable_indices[0]
    if globally_used is not None and not globally_used[index]:
        return
    for replica, result in zip(bucket.replicas, results, strict=True):
        replica.variables[0].grad = result
