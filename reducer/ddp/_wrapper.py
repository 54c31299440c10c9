"""``DistributedDataParallel``: the module wrapper training scripts call, over any ProcessGroup.

It takes ``torch.nn.parallel.DistributedDataParallel``'s arguments, in torch's order and with
torch's meanings, so that ``DistributedDataParallel(model)`` after ``init_process_group`` (or
on fakepg's torch backend) is a drop-in; arguments it cannot honour are refused by name:

- construction resolves the process group (none: torch.distributed's default group; a torch
  group is wrapped in TorchProcessGroup), checks that every rank holds the same parameters
  (dtype, shape, strides), broadcasts parameters and buffers from rank 0, and buckets them
  as torch 2.13 does (see Note [Rebuilding buckets]). Parameters and buffers named by
  ``_set_params_and_buffers_to_ignore_for_model`` are neither reduced nor broadcast;
- ``forward`` syncs buffers (``broadcast_buffers``), moves inputs to ``device_ids[0]`` for a
  module on one accelerator, runs the module and prepares the reducer (searching the outputs
  for unused parameters with ``find_unused_parameters``);
- after the first iteration (with ``static_graph``, the second) the buckets are rebuilt
  once, in the order gradients actually became ready on rank 0 (see Note [Rebuilding
  buckets]);
- ``no_sync()``, or setting ``require_backward_grad_sync = False`` as nanoGPT does, accumulates
  gradients locally; the next synced backward reduces the accumulated sum;
- ``join()`` (or torch's ``Join``) trains ranks with different numbers of batches (see
  reducer.ddp._join);
- ``register_comm_hook`` replaces the allreduce (see reducer.comm_hook and reducer.hooks), and
  ``logging_data()`` reports what torch's ``_get_ddp_logging_data()`` does; ``close()``
  removes the reducer's hooks, after which the module can be wrapped again.

Errors name parameters by their path in the wrapped module (``layer.3.weight``) and speak of
the wrapper's arguments (``find_unused_parameters``), not of the reducer's calls.

# Note [Outputs not used in the loss]
# With find_unused_parameters or static_graph, the outputs pass through ``OutputSink`` (in
# reducer.ddp._outputs), an identity whose backward sees which outputs got no gradient
# because the loss did not use them. Parameters reachable only from such outputs get their
# hook called with no gradient (the sink joins every output to the graph); the reducer is
# told beforehand, so they count as unused (zeros here, .grad untouched if unused everywhere)
# rather than as used, which would contribute whatever stale .grad they hold. torch's DDP uses
# its sink in the first static-graph iteration only; later ones would contribute that stale
# .grad, so this wrapper keeps it. The sink's backward runs when the outermost backward
# starts, which is also where the first static-graph iteration queues its reduction (see Note
# [Static graph] in reducer.static_graph).

# Note [Pickling the wrapper]
# As torch's: the state pickles without the process group and the reducer (neither can be
# pickled), which only works for a wrapper over torch.distributed's default group; loading
# it takes the default group again and builds a new reducer on the loaded parameters, with
# torch's initial buckets for the static graph known now (see Note [Rebuilding buckets]),
# rebuilt as after construction, without collectives.

# Note [Rebuilding buckets]
# The buckets are torch 2.13's, in every iteration, so that comm hooks see the same
# GradBuckets (index, buffer, parameters). The limits come from reducer.ddp._setup's
# bucket_limits (torch's _BucketCapacityConfig): the first bucket holds 1 MiB where
# bucket_cap_mb is left at its default and the cap where it is given; bucket_cap_mb_list
# sets every limit, the last repeating; 0 closes every bucket at its first parameter.
# The initial buckets guess that gradients become ready in reverse parameter order: the
# parameters are bucketed in order and the list reversed (see ddp_bucket_assignment). But
# where unused parameters are not searched for, or the graph is static, torch does not
# guess: one bucket per dtype and device holds every parameter until the rebuild. After the
# first synced iteration (a static graph: the second, as its first defers the reduction to
# the end of backward and records no order) the reducer knows the real order (its hooks
# record it: Reducer.ready_order). At the next synced forward (gradients enabled, outside
# no_sync), each rank buckets its order with the first limit, then the cap (or the list),
# unsorted (see Note [Rebuilt buckets are not sorted] in reducer.buckets), so the first
# bucket fills and launches as early as possible; then rank 0's bucket indices are
# broadcast (torch's sync_bucket_indices: reducer.ddp._setup) and every rank takes them,
# since ranks may see different orders, or be built with different caps (bucket_cap_mb
# 0.0001 on one rank, 25 on another), and buckets must match. That happens once. torch
# does not rebuild when searching for unused parameters without a static graph (the order
# may change every iteration), and neither does this wrapper. A rank that ran out of
# inputs under join takes part in the broadcasts at the same iteration: it counts the
# iterations it shadowed (see reducer.ddp._join). One difference
# is left: in a static graph's first iteration torch's GradBucket.index() is 0 for every
# bucket (its deferred reduction launches them all at its bucket cursor); here each bucket
# has its own index.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.join import Joinable

# torch's enum for where a buffer comm hook runs, so that torch's own callers' values work.
from torch.nn.parallel.distributed import _BufferCommHookLocation

from reducer.buckets import compute_bucket_assignment_by_size, sparse_gradient_flags
from reducer.comm_hook import CommHook
from reducer.ddp import _join
from reducer.ddp import _mixed_precision as _mp
from reducer.ddp._logging import DDPLoggingData, Timings, torch_logging_data
from reducer.ddp._outputs import OutputSink, find_tensors, replace_tensors
from reducer.ddp._reducer import ddp_reducer_class
from reducer.ddp._setup import (
    broadcast_from,
    bucket_limits,
    buffer_slots,
    check_initialized,
    common_rank,
    ignored_names,
    mesh_group,
    move_inputs,
    named_buffers,
    names_devices,
    read_buffers,
    refuse_cpu_sync_batchnorm,
    refuse_unsupported,
    resolve_devices,
    resolve_process_group,
    sync_bucket_indices,
    synced_parameters,
    verify_same_parameters,
    warn_broadcast_buffers,
)
from reducer.errors import (
    DDP_WORDING,
    InvalidArgument,
    InvalidArgumentType,
    InvalidModel,
    ReducerError,
)
from reducer.hooks import allreduce_hook, fp16_compress_hook
from reducer.process_group import ProcessGroup
from reducer.reducer import Reducer
from reducer.stats import IterationStats

__all__ = ["DDPLoggingData", "DistributedDataParallel"]

DeviceIds = Sequence[int | str | torch.device]


class _BufferHook(NamedTuple):
    """A buffer comm hook: see DistributedDataParallel._register_buffer_comm_hook."""

    hook: Callable[[object, dict[str, Tensor]], Any]
    state: object
    location: _BufferCommHookLocation


class DistributedDataParallel(nn.Module, Joinable):
    """Wraps ``module`` so that backward averages its gradients over ``process_group``.

    The arguments are ``torch.nn.parallel.DistributedDataParallel``'s, in its order, and mean
    what they mean there. ``process_group`` is a :class:`reducer.ProcessGroup` (``fakepg``
    groups, :class:`reducer.TorchProcessGroup`), a ``torch.distributed`` group (wrapped in a
    TorchProcessGroup), or None: torch.distributed's default group, as in torch. A group
    passed second, where torch's ``device_ids`` goes (``DistributedDataParallel(model, pg)``),
    is taken as ``process_group``: only None, a list of devices or a device is taken as
    ``device_ids`` there, and a group is none of these. ``device_ids`` names the one device of
    a module on an accelerator (``[local_rank]``); several devices are refused.
    ``delay_all_reduce_named_params`` and ``param_to_hook_all_reduce`` are refused with an
    error that names them; ``mixed_precision`` (see reducer.ddp._mixed_precision),
    ``device_mesh`` (one-dimensional: its group) and ``skip_all_reduce_unused_params`` (see
    Note [Skipping buckets of unused parameters] in reducer.ddp._reducer) are torch's;
    ``check_reduction`` warns, as torch's does; gradient copies are always batched
    per bucket, whatever ``batched_grad_copy`` says. ``comm_hook_timeout`` (seconds, keyword
    only) bounds the wait for a comm hook's future.

    Every rank must construct it at the same point with the same arguments: construction runs
    collectives (skipped with ``init_sync=False``).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: DeviceIds | ProcessGroup | dist.ProcessGroup | None = None,
        output_device: int | str | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: ProcessGroup | dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        delay_all_reduce_named_params: object = None,
        param_to_hook_all_reduce: object = None,
        mixed_precision: object = None,
        device_mesh: object = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        comm_hook_timeout: float = 300.0,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        if not isinstance(module, nn.Module):
            raise InvalidArgument(
                f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}"
            )
        if not names_devices(device_ids):  # DistributedDataParallel(model, pg)
            if process_group is not None:
                raise InvalidArgument(
                    "DistributedDataParallel: a process group was passed both second (where "
                    "torch's device_ids goes) and as process_group=; pass it once, as "
                    "process_group=pg"
                )
            process_group, device_ids = device_ids, None  # type: ignore[assignment]
        refuse_unsupported(
            delay_all_reduce_named_params=delay_all_reduce_named_params,
            param_to_hook_all_reduce=param_to_hook_all_reduce,
            check_reduction=check_reduction,
        )
        self.bucket_cap_mb, self._initial_limits, self._rebuild_limits = bucket_limits(
            bucket_cap_mb,
            bucket_cap_mb_list,
            static_graph=bool(static_graph),
            find_unused_parameters=bool(find_unused_parameters),
        )
        # torch's attributes, in bytes (see bucket_limits).
        self.bucket_bytes_cap = max(self._rebuild_limits)
        self.bucket_bytes_cap_list = list(self._rebuild_limits) if bucket_cap_mb_list else []
        # Whether the first bucket is torch's default 1 MiB, smaller than the cap.
        self.bucket_bytes_cap_default = self._rebuild_limits[0] < self.bucket_bytes_cap and (
            not bucket_cap_mb_list
        )
        self.broadcast_bucket_size = 250 * 1024 * 1024  # torch's; broadcasts here are flat
        if device_mesh is not None:
            process_group = mesh_group(device_mesh, process_group)  # type: ignore[assignment]
            self.device_mesh = device_mesh
        group, self._torch_group = resolve_process_group(process_group)
        self.module = module
        # What the caller passed (or torch.distributed's default group), as torch keeps it;
        # the wrapper reduces over _group, the same group as a reducer.ProcessGroup.
        self.process_group: Any = (
            process_group if process_group is not None else (self._torch_group)
        )
        self._group = group
        # Names, as torch keeps them; see _set_params_and_buffers_to_ignore_for_model.
        self.parameters_to_ignore = ignored_names(module)
        synced = synced_parameters(module, self.parameters_to_ignore)
        check_initialized([n for n, _ in synced], [p for _, p in synced])
        self.device_ids, self.output_device, self.device_type = resolve_devices(
            [p for _, p in synced], device_ids, output_device
        )
        self.dim = dim  # torch scatters along it over several devices; one device: unused
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.batched_grad_copy = bool(batched_grad_copy)
        self.static_graph = False  # see _set_static_graph, below
        self.skip_all_reduce_unused_params = bool(skip_all_reduce_unused_params)
        self.mixed_precision = (
            None if mixed_precision is None else _mp.check_config(mixed_precision)
        )
        # torch: forward_sync_buffers, when given, syncs buffers in forward and always at
        # construction; otherwise broadcast_buffers (deprecated, default True) decides both.
        warn_broadcast_buffers(broadcast_buffers, forward_sync_buffers)
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, init_buffers = bool(forward_sync_buffers), True
        else:
            default = True if broadcast_buffers is None else bool(broadcast_buffers)
            self.forward_sync_buffers = init_buffers = default
        # Toggled directly by training scripts (nanoGPT) for gradient accumulation.
        self.require_backward_grad_sync = True
        # See Note [Buffers synced after a synced forward].
        self.require_forward_param_sync = True

        named = [(n, p) for n, p in synced if p.requires_grad]
        self._param_names = [n for n, _ in named]
        self._params: list[Tensor] = [p for _, p in named]
        if init_sync:
            # First, on every rank alike: a rank that raised alone would leave the others
            # waiting.
            verify_same_parameters([n for n, _ in synced], [p for _, p in synced], group)
        refuse_cpu_sync_batchnorm(module, self.device_type)
        if not named:
            raise InvalidModel(
                "DistributedDataParallel: the module has no parameter that requires grad (not "
                "counting ignored ones), so there is nothing to reduce (DistributedDataParallel "
                "is not needed when a module doesn't have any parameter that requires a "
                "gradient). Wrap the part of the model that trains"
            )
        self.device = synced[0][1].device  # where join's and the rebuild's tensors live
        # See buffer_slots: found once, read by name at each broadcast.
        self._buffer_slots = buffer_slots(module, self.parameters_to_ignore)
        if init_sync:
            buffers = read_buffers(self._buffer_slots) if init_buffers else []
            broadcast_from([*(p for _, p in synced), *buffers], group, 0)
        self._sparse = sparse_gradient_flags(module, self._params)
        self._comm_hook_timeout = comm_hook_timeout
        self._world_size = group.size()
        self._divide_by_initial_world_size = True
        self._shadowed = 0  # synced iterations this rank shadowed under join
        self._buckets_rebuilt = False
        self._comm_hook_name: str | None = None
        self._timings = Timings()
        self._ddp_sink_clone = True
        self._logged_error: str | None = None  # the last error raised, for the logging data
        self._build_reducer()
        if static_graph:
            self._set_static_graph()

    def _build_reducer(self) -> None:
        """The reducer over the parameters, in torch's initial buckets (construction, and
        after unpickling); with mixed precision, the parameters' low-precision twins and the
        comm hook that reduces in ``reduce_dtype``."""
        buckets = compute_bucket_assignment_by_size(
            self._params, self._initial_limits, self._sparse
        )
        # Reducer looked up now: see ddp_reducer_class.
        self.reducer = ddp_reducer_class(Reducer)(
            [self._params],
            list(reversed(buckets)),  # see reducer.ddp_bucket_assignment
            self._group,
            [self._sparse],
            param_names=self._param_names,
            # Under mixed precision .grad changes dtype each iteration: no views (same bits).
            gradient_as_bucket_view=self.gradient_as_bucket_view and not self.mixed_precision,
            timeout=self._comm_hook_timeout,
            gradient_scaling="reciprocal",  # torch's rounding, at every world size
        )
        self.reducer._wording = DDP_WORDING
        self.reducer.skip_all_reduce_unused_params = self.skip_all_reduce_unused_params
        # What torch's logging data reports as bucket_sizes: the buckets it was built with
        # (the rebuilt ones are rebuilt_bucket_sizes).
        self._built_bucket_sizes = tuple(self.reducer.bucket_nbytes)
        self._divisor = self._world_size  # the reducer's; see join
        self._mp_twins: _mp.Twins = {}
        if self.mixed_precision is not None:
            self._mp_twins = _mp.setup(self.mixed_precision, self.module)
            state = _mp.UpcastState(self, self._group)
            self.reducer.register_comm_hook(state, _mp.allreduce_and_upcast)  # type: ignore[arg-type]

    @property
    def broadcast_buffers(self) -> bool:
        """Whether forward broadcasts buffers from rank 0 (torch's ``forward_sync_buffers``)."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = bool(value)

    # ---------------------------------------------------------------------------------------

    # torch.compile(ddp) runs the wrapper eagerly, module included: its bookkeeping (locks,
    # clocks, collectives) is nothing a graph can hold. To compile the model, compile the
    # module before wrapping it: DistributedDataParallel(torch.compile(model)).
    @torch.compiler.disable  # type: ignore[untyped-decorator]
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        try:
            return self._forward(inputs, kwargs)
        except ReducerError as error:
            self._logged_error = f"{type(error).__name__}: {error}"  # for the logging data
            raise

    def _forward(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self.reducer._check_usable("forward")
        grad_enabled = torch.is_grad_enabled()
        synced = grad_enabled and self.require_backward_grad_sync
        notified = None
        if self._join_config.enable:  # See Note [The collectives of a joined iteration].
            notified = _join.notify_join_context(self)
            _join.announce_sync(self, synced)
        if synced:
            # Before the rebuild, as torch: an unfinished reduction is the error to report.
            self.reducer._check_prior_reduction_finished()
        if synced and self._should_rebuild():
            self._rebuild_buckets()
        if self._buffer_hook_at(_BufferCommHookLocation.PRE_FORWARD):
            self._sync_buffers(candidate=True)
        if self.device_ids:
            device = torch.device(self.device_type, self.device_ids[0])
            inputs, kwargs = move_inputs(inputs, kwargs, device)
        if self.mixed_precision is not None:
            inputs, kwargs = _mp.cast_inputs(self.mixed_precision.param_dtype, inputs, kwargs)
            _mp.to_low_precision(self.mixed_precision, self.module, self._mp_twins)
            self.reducer._refresh_accumulators()  # new ones, for the low-precision data
        start = time.perf_counter_ns()
        output = self.module(*inputs, **kwargs)
        forward_ns = time.perf_counter_ns() - start
        if self._buffer_hook_at(_BufferCommHookLocation.POST_FORWARD):
            self._sync_buffers(candidate=True)
        self.require_forward_param_sync = synced  # See Note [Buffers synced after a synced forward]
        training = self._world_size if notified is None else _join.training_ranks(notified)
        if not synced:
            return output  # no_sync / eval: gradients accumulate locally
        divisor = self._world_size if self._divide_by_initial_world_size else training
        if divisor != self._divisor:
            self.reducer._set_divisor(divisor)
            self._divisor = divisor
        self._timings.forward(forward_ns, self.reducer.last_iteration, start)
        searching = self.find_unused_parameters and not self.static_graph
        recording = self.static_graph and self.reducer.iterations == 0
        tensors = find_tensors(output) if searching or self.static_graph else []
        self.reducer.prepare_for_backward(tensors if searching else [])
        # See Note [Outputs not used in the loss].
        passed = [t for t in tensors if t.requires_grad]
        if passed:
            # torch leaves Function.apply unannotated.
            sunk = OutputSink.apply(
                weakref.ref(self.reducer), recording, self._ddp_sink_clone, *passed
            )  # type: ignore[no-untyped-call]
            replacement = dict(zip(map(id, passed), sunk, strict=True))
            output = replace_tensors(output, replacement)
        return output

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally inside the block; sugar for the attribute toggle.

        The first forward-backward after the block reduces everything accumulated since the
        last synced step, on every rank.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]``, torch's contract.

        Register once, before the first backward. The hook receives a
        :class:`reducer.GradBucket` whose buffer is *not* divided by the world size (the hook
        divides: see :func:`reducer.allreduce_hook`) and returns a future of the reduced flat
        buffer.
        """
        try:
            self.reducer.register_comm_hook(state, hook)
        except ReducerError as error:
            self._logged_error = f"{type(error).__name__}: {error}"  # for the logging data
            raise
        self._comm_hook_name = (  # torch logs the qualified name
            getattr(hook, "__qualname__", None)
            or getattr(hook, "__name__", None)
            or type(hook).__name__
        )

    def _set_static_graph(self) -> None:
        """Promise the same graph every iteration, as ``static_graph=True`` does; torch's
        name, for calling after construction and before the first iteration."""
        if self.static_graph:
            warnings.warn(
                "You've set static_graph to be True, no need to set it again.", stacklevel=2
            )
            return
        try:
            self.reducer._set_static_graph()
        except ReducerError as error:
            self._logged_error = f"{type(error).__name__}: {error}"  # for the logging data
            raise
        self.static_graph = True
        if self.find_unused_parameters:
            warnings.warn(
                "You passed find_unused_parameters=true to DistributedDataParallel, "
                "`_set_static_graph` will detect unused parameters automatically, so you do "
                "not need to set find_unused_parameters=true, just be sure these unused "
                "parameters will not change during training loop while calling "
                "`_set_static_graph`.",
                stacklevel=2,
            )

    def close(self) -> None:
        """Remove the reducer's hooks from the module's parameters; this wrapper is done.

        After an error during training the ranks are out of step: close the wrapper on every
        rank and wrap the module in a new DistributedDataParallel. Idempotent.
        """
        self.reducer.close()

    @staticmethod
    def _set_params_and_buffers_to_ignore_for_model(
        module: nn.Module, params_and_buffers_to_ignore: Sequence[str]
    ) -> None:
        """Name parameters and buffers of ``module`` that DDP neither reduces nor broadcasts.

        torch's call, with torch's effect (the module remembers the names, and each named
        tensor is marked ``_ddp_ignored``), so either DDP honours it; call it before
        wrapping. Names are those ``module.named_parameters()`` and ``named_buffers()`` give.
        """
        module._ddp_params_and_buffers_to_ignore = params_and_buffers_to_ignore  # type: ignore[assignment]
        for name, param in module.named_parameters():
            if name in params_and_buffers_to_ignore:
                param._ddp_ignored = True  # type: ignore[attr-defined]
        for name, buffer in module.named_buffers():
            if name in params_and_buffers_to_ignore:
                buffer._ddp_ignored = True  # type: ignore[attr-defined]

    # ---------------------------------------------------------------------------------------
    # Uneven inputs. See reducer.ddp._join.

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> _join.Join:
        """A context manager for ranks with different numbers of batches, as torch's.

        Run the training loop inside it. A rank that has run out shadows the others'
        iterations (contributing zeros) until all have run out; then every rank takes the
        model of a rank that trained last. Gradients are divided by the world size
        (``divide_by_initial_world_size=True``: every sample weighs the same) or by the number
        of ranks still training. With ``throw_on_early_termination`` every rank raises a
        RuntimeError as soon as one has run out. Works over any process group; torch's
        ``Join([ddp])`` works too where the group is a torch.distributed one.
        """
        return _join.Join(
            self,
            enable=enable,
            throw_on_early_termination=throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> _join.DDPJoinHook:
        """What torch's ``Join`` runs for this wrapper once this rank has run out."""
        return _join.DDPJoinHook(self, kwargs.get("divide_by_initial_world_size", True))

    @property
    def join_device(self) -> torch.device:
        """Where join's bookkeeping tensors live: the parameters' device."""
        return self.device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The torch.distributed group under this wrapper's, for torch's ``Join``."""
        if self._torch_group is None:
            raise InvalidArgument(
                "torch's Join runs its collectives through torch.distributed, but this "
                f"DistributedDataParallel reduces over {self._group!r}, which is not a "
                "torch.distributed group; use ddp.join() instead (it works over any process "
                "group)"
            )
        return self._torch_group

    def _buffer_hook_at(self, location: _BufferCommHookLocation) -> bool:
        """Whether forward syncs buffers at ``location``: before the module runs, unless a
        buffer comm hook asks for after."""
        hook = self.__dict__.get("buffer_hook")
        wanted = _BufferCommHookLocation.PRE_FORWARD if hook is None else hook.location
        return location == wanted

    # Note [Buffers synced after a synced forward]
    # As torch's DDP, a forward syncs the buffers only where the forward before it (through
    # this wrapper, the first one excepted) was synced: grad enabled and
    # require_backward_grad_sync (``require_forward_param_sync``, set at the end of each
    # forward, and by a joined rank's shadow of each iteration). So the synced micro-batch
    # after no_sync() ones starts from each rank's own buffers, and the first micro-batch of
    # the next step from rank 0's.

    def _sync_buffers(self, *, candidate: bool) -> None:
        """Broadcast buffers from rank 0; under join, from the highest rank still training
        (``candidate``: this rank is one). A buffer comm hook replaces the broadcast. Only
        after a synced forward: see Note [Buffers synced after a synced forward]."""
        if not self.forward_sync_buffers or not self.require_forward_param_sync:
            return
        buffers = read_buffers(self._buffer_slots)
        if not buffers:
            return
        root = 0
        if self._join_config.enable:
            root = common_rank(self._group, self.device, candidate)
        hook = self.__dict__.get("buffer_hook")
        if hook is None:
            broadcast_from(buffers, self._group, root)
            return
        with torch.no_grad():
            futures = hook.hook(hook.state, named_buffers(self.module, self._buffer_slots))
        if futures is not None:
            self.reducer._install_post_backward_futures(futures)

    def _register_buffer_comm_hook(
        self,
        state: object,
        hook: Callable[[object, dict[str, Tensor]], Any],
        comm_hook_location: _BufferCommHookLocation = _BufferCommHookLocation.POST_FORWARD,
    ) -> None:
        """Sync buffers with ``hook(state, {name: buffer})`` instead of the broadcast from
        rank 0 (torch's call): e.g. an allreduce that averages running statistics.

        It runs in forward where the broadcast would (whenever buffers are synced), before
        (``PRE_FORWARD``) or after (``POST_FORWARD``, the default) the module runs. It may
        return a list of futures: they are awaited when that iteration's backward ends, so
        the communication overlaps with backward. Any collective it issues must be issued
        the same way on every rank.
        """
        if not callable(hook):
            raise InvalidArgumentType(
                f"_register_buffer_comm_hook: hook must be callable, got {type(hook).__name__}"
            )
        if not isinstance(comm_hook_location, _BufferCommHookLocation):
            raise InvalidArgument(
                "_register_buffer_comm_hook: comm_hook_location must be "
                "torch.nn.parallel.distributed._BufferCommHookLocation.PRE_FORWARD or "
                f"POST_FORWARD, got {comm_hook_location!r}"
            )
        self.buffer_hook = _BufferHook(hook, state, comm_hook_location)

    def _default_broadcast_coalesced(
        self,
        bufs: Sequence[Tensor] | None = None,
        bucket_size: int | None = None,
        authoritative_rank: int = 0,
    ) -> None:
        """Broadcast ``bufs`` (default: the synced buffers) from ``authoritative_rank``, as
        forward does; torch's name, for buffer comm hooks. One flat broadcast per dtype:
        ``bucket_size`` does not split it here."""
        tensors = read_buffers(self._buffer_slots) if bufs is None else list(bufs)
        with torch.no_grad():
            broadcast_from(tensors, self._group, authoritative_rank)

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """Every rank takes the highest last joiner's parameters (and synced buffers)."""
        root = common_rank(self._group, self.device, is_last_joiner)
        self._authoritative_rank = root  # torch's name: the rank the final model came from
        tensors: list[Tensor] = [
            p for _, p in synced_parameters(self.module, self.parameters_to_ignore)
        ]
        if self.forward_sync_buffers:
            tensors += read_buffers(self._buffer_slots)
        broadcast_from(tensors, self._group, root)

    # ---------------------------------------------------------------------------------------
    # Rebuilding buckets. See Note [Rebuilding buckets].

    def _should_rebuild(self) -> bool:
        # A static graph's first iteration records no order (its reduction waits for the end
        # of backward): it rebuilds after its second, as torch's.
        return (
            not self._buckets_rebuilt
            and self.reducer.iterations + self._shadowed >= (2 if self.static_graph else 1)
            and (self.static_graph or not self.find_unused_parameters)
        )

    def _rebuild_buckets(self) -> None:
        ready_order = self.reducer.ready_order
        # Bucketed in ready order, not sorted: see Note [Rebuilt buckets are not sorted].
        rebuilt = compute_bucket_assignment_by_size(
            [self._params[i] for i in ready_order],
            self._rebuild_limits,
            self._sparse,
            tensor_indices=ready_order,
        )
        # Rank 0's buckets for every rank. See Note [Rebuilding buckets].
        rebuilt = sync_bucket_indices(rebuilt, self._group, self.device)
        self.reducer.initialize_buckets(rebuilt)
        self._buckets_rebuilt = True

    # ---------------------------------------------------------------------------------------
    # Logging.

    def logging_data(self) -> DDPLoggingData:
        """Configuration, buckets and the timings of the synced iterations so far."""
        last: IterationStats | None = self.reducer.last_iteration
        timings = self._timings
        timings.absorb(last)
        ms = 1e-6
        return DDPLoggingData(
            rank=self._group.rank(),
            world_size=self._group.size(),
            module_name=type(self.module).__name__,
            process_group=type(self._group).__name__,
            bucket_cap_mb=self.bucket_cap_mb,
            find_unused_parameters=self.find_unused_parameters,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
            broadcast_buffers=self.broadcast_buffers,
            comm_hook=self._comm_hook_name,
            num_parameters=len(self._params),
            total_parameter_size_bytes=sum(p.numel() * p.element_size() for p in self._params),
            dtypes=tuple(sorted({str(p.dtype).removeprefix("torch.") for p in self._params})),
            num_buckets=len(self.reducer.bucket_indices),
            bucket_sizes=tuple(self.reducer.bucket_nbytes),
            bucket_param_indices=tuple(tuple(b) for b in self.reducer.bucket_indices),
            buckets_rebuilt=self._buckets_rebuilt,
            grad_ready_order=tuple(self.reducer.ready_order) if last else (),
            iterations=self.reducer.iterations,
            forward_ms=timings.last_forward_ns * ms if last else 0.0,
            backward_compute_ms=last.backward_ns * ms if last else 0.0,
            comm_ms=last.comm_ns * ms if last else 0.0,
            overlap_ms=last.overlap_ns * ms if last else 0.0,
            avg_forward_ms=timings.average("forward") * ms,
            avg_backward_compute_ms=timings.average("backward") * ms,
            avg_comm_ms=timings.average("comm") * ms,
            avg_overlap_ms=timings.average("overlap") * ms,
            unused_parameters=last.unused_parameters if last else 0,
        )

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """torch's name for :meth:`logging_data`, as a dict: its fields, then the other keys
        of torch's logging data that have a meaning here (see torch_logging_data). Where a
        field and a torch key share a name, torch's format is used (this is torch's call);
        :meth:`logging_data` has the fields as they are."""
        data = self.logging_data()
        found = {**dataclasses.asdict(data), **torch_logging_data(self, data)}
        if data.comm_hook is None:
            del found["comm_hook"]  # torch's has the key only once a hook is registered
        return found

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """torch's call: how often (in iterations, after the first 10) torch samples its
        runtime stats. Every synced iteration is timed here; the rate is kept and checked."""
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate < 1:
            raise InvalidArgument(
                "DDP runtime logging sample rate should be equal or greater than 1, got "
                f"{sample_rate!r}"
            )
        self.reducer._set_ddp_runtime_logging_sample_rate(sample_rate)
        self._timings.sample_rate = sample_rate

    # ---------------------------------------------------------------------------------------
    # torch's calls, for tools and torch's own helpers.

    def _register_builtin_comm_hook(self, comm_hook_type: object) -> None:
        """torch's built-in hooks by their ``dist.BuiltinCommHookType``: ALLREDUCE and
        FP16_COMPRESS, here the Python hooks that compute the same (reducer.allreduce_hook,
        reducer.fp16_compress_hook)."""
        builtin = getattr(dist, "BuiltinCommHookType", None)
        hooks = {}
        if builtin is not None:
            hooks = {builtin.ALLREDUCE: allreduce_hook, builtin.FP16_COMPRESS: fp16_compress_hook}
        hook = hooks.get(comm_hook_type)
        if hook is None:
            raise InvalidArgument(
                f"_register_builtin_comm_hook: {comm_hook_type!r} is not a "
                "torch.distributed.BuiltinCommHookType (ALLREDUCE or FP16_COMPRESS)"
            )
        self.register_comm_hook(None, hook)
        self._comm_hook_name = str(comm_hook_type)

    @staticmethod
    def _get_data_parallel_params(module: nn.Module, named_params: bool = False) -> Iterator[Any]:
        """The parameters of ``module`` that DDP reduces (not marked ignored), as torch's
        staticmethod gives them: names too with ``named_params``."""
        items = module.named_parameters() if named_params else module.parameters()
        for item in items:
            param = item[1] if named_params else item
            if not hasattr(param, "_ddp_ignored"):
                yield item

    def _build_params_for_reducer(self) -> tuple[list[Tensor], list[bool]]:
        """The parameters the reducer reduces, in its order, and which have sparse
        gradients (torch's call; this wrapper built them at construction)."""
        return list(self._params), list(self._sparse)

    def _build_debug_param_to_name_mapping(self, parameters: Sequence[Tensor]) -> dict[int, str]:
        """Each index in ``parameters`` (the reducer's list) to the parameter's name in the
        module: torch's call, with torch's checks (ValueError where the list and the
        module's trainable, not ignored parameters differ)."""
        index_of = {id(p): i for i, p in enumerate(parameters)}
        names: dict[int, str] = {}
        for name, param in self.module.named_parameters():
            if name in self.parameters_to_ignore or not param.requires_grad:
                continue
            if id(param) not in index_of:
                raise InvalidArgument(
                    f"Param with name {name} found in module parameters, but not DDP "
                    "parameters: the list given is not the one this wrapper reduces (see "
                    "_build_params_for_reducer)"
                )
            names[index_of[id(param)]] = name
        if len(index_of) != len(names):
            raise InvalidArgument(
                "Expected param to name mapping to cover all parameters, but got conflicting "
                f"lengths: {len(index_of)} vs {len(names)}: the list given holds parameters "
                "this wrapper does not reduce"
            )
        return names

    def _set_ddp_sink_clone(self, val: bool) -> None:
        """Whether the output sink (reducer.ddp._outputs) clones the outputs (torch's
        default: the loss may then be modified in place) or returns views of them."""
        self._ddp_sink_clone = bool(val)

    def _remove_autograd_hooks(self) -> None:
        """Take the reducer's hooks off the parameters without closing it (torch's call,
        e.g. after an error in backward, before wrapping the module again)."""
        self.reducer._remove_autograd_hooks()

    # ---------------------------------------------------------------------------------------
    # Pickling. See Note [Pickling the wrapper].

    def __getstate__(self) -> dict[str, Any]:
        default = dist.group.WORLD if dist.is_initialized() else None
        if default is None or self._torch_group is not default:
            raise InvalidModel(
                "DDP Pickling/Unpickling are only supported when using DDP with the default "
                "process group. That is, when you have called init_process_group and have not "
                "passed process_group argument to DDP constructor. To save this wrapper's "
                "training state, save ddp.module.state_dict() instead"
            )
        state = dict(self.__dict__)
        # The mixed-precision twins too: see reducer.ddp._mixed_precision (made anew on load).
        for key in ("process_group", "_group", "_torch_group", "reducer", "_mp_twins"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self.__dict__.setdefault("require_forward_param_sync", True)  # an older pickle
        self._group, self._torch_group = resolve_process_group(None)
        self.process_group = self._torch_group
        self._world_size = self._group.size()
        self._buckets_rebuilt, self._shadowed, self._timings = False, 0, Timings()
        if self.static_graph and not self.bucket_bytes_cap_list:
            # torch buckets the reloaded wrapper knowing its static graph, even one set by
            # _set_static_graph() after construction: one bucket until the rebuild.
            self._initial_limits = [sys.maxsize]
        self._build_reducer()  # a new reducer, as torch's: buckets rebuilt after its first step
        if self.static_graph:
            self.reducer._set_static_graph()
