"""``DistributedDataParallel``: the module wrapper training scripts call, over any ProcessGroup.

It keeps the argument names and meanings of ``torch.nn.parallel.DistributedDataParallel``:

- construction checks that every rank holds the same parameters, broadcasts parameters and
  buffers from rank 0, and buckets them as torch does (in parameter order, 1 MiB for the first
  bucket and ``bucket_cap_mb`` after, then the list of buckets reversed, so the last layers'
  gradients, ready first, are reduced first);
- ``forward`` syncs buffers (``broadcast_buffers``), runs the module and prepares the reducer
  (searching the outputs for unused parameters with ``find_unused_parameters``);
- after the first iteration the buckets are rebuilt once, in the order gradients actually
  became ready on rank 0 (see Note [Rebuilding buckets]);
- ``no_sync()``, or setting ``require_backward_grad_sync = False`` as nanoGPT does, accumulates
  gradients locally; the next synced backward reduces the accumulated sum;
- ``register_comm_hook`` replaces the allreduce (see reducer.comm_hooks), and
  ``logging_data()`` reports what torch's ``_get_ddp_logging_data()`` does.

Errors name parameters by their path in the wrapped module (``layer.3.weight``).

# Note [Outputs not used in the loss]
# With find_unused_parameters or static_graph, the outputs pass through ``_OutputSink``, an
# identity whose backward sees which outputs got no gradient because the loss did not use them.
# Parameters reachable only from such outputs get their hook called with no gradient (the sink
# joins every output to the graph); the reducer is told beforehand, so they count as unused
# (zeros here, .grad untouched if unused everywhere) rather than as used, which would
# contribute whatever stale .grad they hold. torch's DDP uses its sink in the first
# static-graph iteration only; later ones would contribute that stale .grad, so this wrapper
# keeps it. The sink's backward runs when the outermost backward starts, which is also where
# the first static-graph iteration queues its reduction (see Note [Static graph] in
# reducer.reducer).

# Note [Rebuilding buckets]
# The initial buckets (torch's rule: see ddp_bucket_assignment) guess that gradients become
# ready in reverse parameter order. After the first synced iteration the reducer knows the
# real order (its hooks record it: Reducer.ready_order). At the next forward with gradients
# enabled, rank 0's order is broadcast so every rank agrees (ranks may see different orders,
# and buckets must match), and the buckets are rebuilt in it, the first holding 1 MiB and the
# others bucket_cap_mb, so the first bucket fills and launches as early as possible. That
# happens once. torch does not rebuild when searching for unused parameters (the order may
# change every iteration), and neither does this wrapper.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from .buckets import (
    compute_bucket_assignment_by_size,
    ddp_bucket_assignment,
    sparse_gradient_flags,
)
from .comm_hooks import CommHook
from .errors import InvalidArgument, describe_param
from .process_group import ProcessGroup
from .reducer import Reducer
from .stats import IterationStats
from .validation import check_process_group

__all__ = ["DDPLoggingData", "DistributedDataParallel"]


@dataclasses.dataclass(frozen=True, slots=True)
class DDPLoggingData:
    """What torch's ``_get_ddp_logging_data()`` reports, as a plain record.

    Times are in milliseconds. The plain ones are the last synced iteration's (0 before the
    first): ``forward_ms`` the wrapped module's forward, ``backward_compute_ms`` from
    ``prepare_for_backward`` until the last gradient was ready, ``comm_ms`` from the first
    bucket launch to the last completion, ``overlap_ms`` the part of it during backward. The
    ``avg_`` ones average every synced iteration so far. ``unused_parameters`` counts the
    parameters that got no gradient on this rank in the last synced iteration (found unused,
    or reached only by outputs the loss did not use). ``grad_ready_order`` is the order their
    gradients became ready in it (see ``Reducer.ready_order``).
    """

    rank: int
    world_size: int
    module_name: str
    process_group: str
    bucket_cap_mb: float
    find_unused_parameters: bool
    gradient_as_bucket_view: bool
    static_graph: bool
    broadcast_buffers: bool
    comm_hook: str | None
    num_parameters: int
    total_parameter_size_bytes: int
    dtypes: tuple[str, ...]
    num_buckets: int
    bucket_sizes: tuple[int, ...]
    bucket_param_indices: tuple[tuple[int, ...], ...]
    buckets_rebuilt: bool
    grad_ready_order: tuple[int, ...]
    iterations: int
    forward_ms: float
    backward_compute_ms: float
    comm_ms: float
    overlap_ms: float
    avg_forward_ms: float
    avg_backward_compute_ms: float
    avg_comm_ms: float
    avg_overlap_ms: float
    unused_parameters: int


class DistributedDataParallel(nn.Module):
    """Wraps ``module`` so that backward averages its gradients over ``process_group``.

    The arguments mean what they mean for ``torch.nn.parallel.DistributedDataParallel``;
    ``process_group`` is any :class:`reducer.ProcessGroup` (``fakepg`` groups, or
    :class:`reducer.TorchProcessGroup` over gloo or NCCL). Every rank must construct it at the
    same point with the same arguments: construction runs collectives.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: ProcessGroup,
        *,
        bucket_cap_mb: float = 25.0,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = True,
        static_graph: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise InvalidArgument(
                f"DistributedDataParallel wraps an nn.Module, got {type(module).__name__}"
            )
        if isinstance(bucket_cap_mb, bool) or not (
            isinstance(bucket_cap_mb, int | float) and bucket_cap_mb > 0
        ):
            raise InvalidArgument(
                f"DistributedDataParallel: bucket_cap_mb must be a number of MiB > 0, got "
                f"{bucket_cap_mb!r}"
            )
        check_process_group(process_group)
        self.module = module
        self.process_group = process_group
        self.find_unused_parameters = bool(find_unused_parameters)
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.broadcast_buffers = bool(broadcast_buffers)
        self.static_graph = bool(static_graph)
        self.bucket_cap_mb = float(bucket_cap_mb)
        # Toggled directly by training scripts (nanoGPT) for gradient accumulation.
        self.require_backward_grad_sync = True

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._param_names = [n for n, _ in named]
        self._params: list[Tensor] = [p for _, p in named]
        # First, on every rank alike: a rank that raised alone would leave the others waiting.
        _verify_same_parameters(self._param_names, self._params, process_group)
        if not named:
            raise InvalidArgument(
                "DistributedDataParallel: the module has no parameter that requires grad; "
                "there is nothing to reduce"
            )
        self._sparse = sparse_gradient_flags(module, self._params)
        _broadcast_from_rank0([*self._params, *module.buffers()], process_group)
        self._first_bucket_mb = min(1.0, self.bucket_cap_mb)
        buckets = ddp_bucket_assignment(
            self._params,
            bucket_cap_mb=self.bucket_cap_mb,
            first_bucket_mb=self._first_bucket_mb,
            expect_sparse_gradient=self._sparse,
        )
        self.reducer = Reducer(
            [self._params],
            buckets,
            process_group,
            [self._sparse],
            param_names=self._param_names,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
        )
        self._buckets_rebuilt = False
        self._comm_hook_name: str | None = None
        self._timings = _Timings()

    # ---------------------------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        grad_enabled = torch.is_grad_enabled()
        synced = grad_enabled and self.require_backward_grad_sync
        if grad_enabled and self._should_rebuild():
            self._rebuild_buckets()
        if self.broadcast_buffers:
            buffers = list(self.module.buffers())
            if buffers:
                _broadcast_from_rank0(buffers, self.process_group)
        start = time.perf_counter_ns()
        output = self.module(*inputs, **kwargs)
        forward_ns = time.perf_counter_ns() - start
        if not synced:
            return output  # no_sync / eval: gradients accumulate locally
        self._timings.forward(forward_ns, self.reducer.last_iteration)
        searching = self.find_unused_parameters and not self.static_graph
        recording = self.static_graph and self.reducer.iterations == 0
        tensors = _find_tensors(output) if searching or self.static_graph else []
        self.reducer.prepare_for_backward(tensors if searching else [])
        # See Note [Outputs not used in the loss].
        passed = [t for t in tensors if t.requires_grad]
        if passed:
            # torch leaves Function.apply unannotated.
            sunk = _OutputSink.apply(weakref.ref(self.reducer), recording, *passed)  # type: ignore[no-untyped-call]
            replacement = dict(zip(map(id, passed), sunk, strict=True))
            output = _replace_tensors(output, replacement)
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
        self.reducer.register_comm_hook(state, hook)
        self._comm_hook_name = getattr(hook, "__name__", None) or type(hook).__name__

    # ---------------------------------------------------------------------------------------
    # Rebuilding buckets. See Note [Rebuilding buckets].

    def _should_rebuild(self) -> bool:
        return (
            not self._buckets_rebuilt
            and self.reducer.iterations >= 1
            and (self.static_graph or not self.find_unused_parameters)
        )

    def _rebuild_buckets(self) -> None:
        device = self._params[0].device  # NCCL broadcasts device tensors only
        order = torch.tensor(self.reducer.ready_order, dtype=torch.int64, device=device)
        self.process_group.broadcast([order], 0).wait()  # rank 0's order, for every rank
        ready_order = [int(i) for i in order.tolist()]
        in_order = compute_bucket_assignment_by_size(
            [self._params[i] for i in ready_order],
            [int(self._first_bucket_mb * (1 << 20)), int(self.bucket_cap_mb * (1 << 20))],
            [self._sparse[i] for i in ready_order],
        )
        self.reducer.initialize_buckets([[ready_order[j] for j in b] for b in in_order])
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
            rank=self.process_group.rank(),
            world_size=self.process_group.size(),
            module_name=type(self.module).__name__,
            process_group=type(self.process_group).__name__,
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
        """torch's name for :meth:`logging_data`, as a dict."""
        return dataclasses.asdict(self.logging_data())


class _Timings:
    """Sums of the synced iterations' timings, for the averages of :class:`DDPLoggingData`.

    The forward time of a synced iteration is measured before its backward; it is counted
    once that iteration's stats appear (a forward whose backward never ran is left out).
    """

    def __init__(self) -> None:
        self.totals = {"forward": 0, "backward": 0, "comm": 0, "overlap": 0}
        self.count = 0
        self.last_forward_ns = 0
        self._pending_forward_ns: int | None = None
        self._seen: IterationStats | None = None

    def forward(self, forward_ns: int, last: IterationStats | None) -> None:
        """A synced forward took ``forward_ns``; ``last`` is the reducer's newest stats."""
        self.absorb(last)
        self._pending_forward_ns = forward_ns

    def absorb(self, last: IterationStats | None) -> None:
        """Count ``last`` if it is an iteration not counted yet."""
        if last is None or last is self._seen:
            return
        self._seen = last
        forward_ns = self._pending_forward_ns or 0
        self._pending_forward_ns = None
        self.last_forward_ns = forward_ns
        for key, value in (
            ("forward", forward_ns),
            ("backward", last.backward_ns),
            ("comm", last.comm_ns),
            ("overlap", last.overlap_ns),
        ):
            self.totals[key] += value
        self.count += 1

    def average(self, key: str) -> float:
        return self.totals[key] / self.count if self.count else 0.0


# -------------------------------------------------------------------------------------------
# Construction helpers.


# Every dtype torch knows, in a fixed order: the same codes on every rank (same torch).
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_MAX_DIMS = 8  # shapes are compared up to this many dimensions, and by numel


def _fingerprint(p: Tensor) -> list[int]:
    """dtype, rank and shape of a parameter as ints (shape padded), comparable across ranks."""
    dtype = _DTYPES.index(p.dtype) if p.dtype in _DTYPES else len(_DTYPES)
    shape = list(p.shape)[:_MAX_DIMS]
    return [dtype, p.dim(), p.numel(), *shape, *([-1] * (_MAX_DIMS - len(shape)))]


def _verify_same_parameters(names: list[str], params: list[Tensor], pg: ProcessGroup) -> None:
    """Every rank must hold the same parameters, or gradients would be mixed up silently.

    Two allgathers (counts, then one fingerprint per parameter); every rank sees every rank's
    data, so every rank raises the same error and none is left waiting in a collective.
    """
    world = pg.size()
    if world == 1:
        return
    device = params[0].device if params else torch.device("cpu")  # NCCL: device tensors
    count = torch.tensor([len(params)], dtype=torch.int64, device=device)
    counts = [torch.empty_like(count) for _ in range(world)]
    pg.allgather([counts], [count]).wait()
    per_rank = [int(c.item()) for c in counts]
    if len(set(per_rank)) > 1:
        listing = ", ".join(f"rank {r}: {n}" for r, n in enumerate(per_rank))
        raise InvalidArgument(
            f"DistributedDataParallel: ranks hold different numbers of parameters that require "
            f"grad ({listing}); every rank must build the same model (same modules, same "
            "requires_grad) before wrapping it"
        )
    mine = torch.tensor([_fingerprint(p) for p in params], dtype=torch.int64, device=device)
    theirs = [t.cpu() for t in _allgather(pg, mine)]
    for i in range(len(params)):
        differing = [r for r in range(1, world) if not torch.equal(theirs[r][i], theirs[0][i])]
        if differing:
            others = ", ".join(f"rank {r} has {_describe(theirs[r][i])}" for r in differing)
            raise InvalidArgument(
                f"DistributedDataParallel: {describe_param(i, names)} differs between ranks: "
                f"rank 0 has {_describe(theirs[0][i])}, {others}. Every rank must build the "
                "same model (same modules in the same order, same shapes and dtypes) before "
                "wrapping it"
            )


def _allgather(pg: ProcessGroup, tensor: Tensor) -> list[Tensor]:
    gathered = [torch.empty_like(tensor) for _ in range(pg.size())]
    pg.allgather([gathered], [tensor]).wait()
    return gathered


def _describe(row: Tensor) -> str:
    dtype, ndim, numel, *shape = (int(x) for x in row.tolist())
    name = str(_DTYPES[dtype]).removeprefix("torch.") if dtype < len(_DTYPES) else "other dtype"
    if ndim > _MAX_DIMS:
        return f"{name} with {ndim} dimensions, {numel} elements"
    return f"{name} {tuple(shape[:ndim])}"


def _broadcast_from_rank0(tensors: Sequence[Tensor], pg: ProcessGroup) -> None:
    """Copy rank 0's values into every rank's tensors: one flat broadcast per dtype/device."""
    if pg.size() == 1 or not tensors:
        return
    groups: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        flats = {key: torch.cat([t.detach().reshape(-1) for t in ts]) for key, ts in groups.items()}
        pg.broadcast(list(flats.values()), 0).wait()
        for key, ts in groups.items():
            offset = 0
            for t in ts:
                t.copy_(flats[key][offset : offset + t.numel()].view_as(t))
                offset += t.numel()


# -------------------------------------------------------------------------------------------
# Outputs. See Note [Outputs not used in the loss].


def _find_tensors(obj: Any) -> list[Tensor]:
    """Every tensor in ``obj``: nested tuples, lists, dicts and dataclasses, in order."""
    found: list[Tensor] = []
    seen: set[int] = set()

    def walk(o: Any) -> None:
        if isinstance(o, Tensor):
            if id(o) not in seen:
                seen.add(id(o))
                found.append(o)
        elif isinstance(o, list | tuple):
            for item in o:
                walk(item)
        elif isinstance(o, dict):
            for item in o.values():
                walk(item)
        elif dataclasses.is_dataclass(o) and not isinstance(o, type):
            for f in dataclasses.fields(o):
                walk(getattr(o, f.name))

    walk(obj)
    return found


def _replace_tensors(obj: Any, replacement: dict[int, Tensor]) -> Any:
    """``obj`` with each tensor whose id is in ``replacement`` swapped, structure kept."""
    if isinstance(obj, Tensor):
        return replacement.get(id(obj), obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_replace_tensors(o, replacement) for o in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_replace_tensors(o, replacement) for o in obj)
    if isinstance(obj, dict):
        items = {k: _replace_tensors(v, replacement) for k, v in obj.items()}
        try:
            return type(obj)(items)
        except TypeError:
            return items
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: _replace_tensors(getattr(obj, f.name), replacement)
                   for f in dataclasses.fields(obj) if f.init}  # fmt: skip
        return dataclasses.replace(obj, **changes)
    return obj


class _OutputSink(torch.autograd.Function):
    """Identity on the outputs, whose backward runs when the outermost backward starts.

    It tells the reducer which outputs got no gradient (see Note [Outputs not used in the
    loss]) and, in the first static-graph iteration (``recording``), queues the reduction on
    the outermost backward (see Note [Static graph] in reducer.reducer).
    """

    @staticmethod
    def forward(
        ctx: Any, reducer_ref: weakref.ReferenceType[Reducer], recording: bool, *outputs: Tensor
    ) -> Any:
        ctx.reducer_ref = reducer_ref
        ctx.recording = recording
        ctx.set_materialize_grads(False)  # an output the loss did not use gets None
        ctx.save_for_backward(*outputs)
        # Clones: returning an input as is would make it an alias, not an output of the sink.
        return tuple(o.clone() for o in outputs)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> Any:
        outputs = ctx.saved_tensors
        reducer = ctx.reducer_ref()
        if reducer is not None:
            if any(g is None for g in grads):
                with_grad = [o for o, g in zip(outputs, grads, strict=True) if g is not None]
                without = [o for o, g in zip(outputs, grads, strict=True) if g is None]
                reducer._expect_no_gradient(with_grad, without)
            if ctx.recording:
                reducer._queue_recorded_finalize()
        return (None, None, *grads)
