"""A torch.distributed process group (gloo, NCCL, any registered backend) as a reducer.ProcessGroup.

:class:`TorchProcessGroup` is the thin adapter between the protocol the reducer is written
against (:mod:`reducer.process_group`) and torch's real backends. Each collective is one (or,
for lists, a few) public ``torch.distributed`` calls with ``async_op=True``; the returned
:class:`TorchWork` keeps the protocol's promises: the call returns at once, ``wait`` has a
deadline and raises an error that names the rank and the collective, and ``result`` holds the
output tensors (the reduced tensor for a sparse allreduce, which gloo does not do in place)::

    import torch.distributed as dist, reducer
    dist.init_process_group("gloo")               # under torchrun, or with MASTER_ADDR etc.
    pg = reducer.TorchProcessGroup(dist.group.WORLD)
    red = reducer.Reducer([params], reducer.ddp_bucket_assignment(params), pg)

The reducer reaches ``torch.distributed`` only through this adapter (the ``validate``
command imports it too, to set up groups and run torch's DDP beside the reducer).

# Guarantees: a TorchProcessGroup may be used from the rank's threads (the one that runs
# forward and backward, and autograd's); issuing collectives is serialized by a lock so that
# their sequence numbers (used in error messages) follow issue order. TorchWork methods are
# safe from any thread; its post-processing (division for an emulated AVG, copies to the other
# tensors of a list) runs exactly once, on the thread that completes the backend's future,
# before the work counts as completed.

# Note [Tensor lists on real backends]
# The protocol's allreduce takes a list of tensors (one per model replica) and combines every
# tensor of every rank. torch's gloo and NCCL groups take one tensor per process, so a list is
# first combined locally, in list order, into its first tensor ((t0 op t1) op t2 ...), that
# tensor is allreduced, and the result is copied into the others once it arrives. For SUM this
# adds each rank's replicas before the ranks' sums; on dyadic data (see reducer.validate) the
# order makes no difference. allgather and broadcast of a list issue one torch call per tensor.

# Note [AVG where the backend lacks it]
# reducer.ReduceOp.AVG is the sum divided by the number of contributions, ranks times tensors
# per rank. NCCL (and the fakepg torch backend) average natively; gloo does not. There the
# adapter allreduces the SUM and divides by size() * len(tensors) when the sum arrives. With
# native AVG and a list of n tensors, the backend divides by size() and the adapter by n.

# Note [Waiting with a deadline]
# torch's Work.wait(timeout) is honoured differently by each backend. The adapter waits on the
# backend's future through an Event set by a done-callback, so every wait has the deadline the
# caller asked for, on every backend; then it calls the backend's own wait (which, on NCCL,
# orders the current CUDA stream after the collective) and raises the collective's error, if
# any. After a timeout the collective may still be in flight: the group is no longer usable.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .errors import InvalidArgument, ReductionError
from .process_group import ReduceOp

__all__ = [
    "TorchCollectiveError",
    "TorchCollectiveTimeout",
    "TorchProcessGroup",
    "TorchWork",
]


class TorchCollectiveError(ReductionError):
    """A collective on a torch.distributed group failed; the message names rank and collective."""


class TorchCollectiveTimeout(TorchCollectiveError, TimeoutError):
    """``TorchWork.wait`` passed its deadline before the collective completed."""


_TORCH_OPS: dict[ReduceOp, dist.ReduceOp.RedOpType] = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.AVG,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}
# How a tensor list is combined locally. See Note [Tensor lists on real backends].
_COMBINE: dict[ReduceOp, Callable[..., Tensor]] = {
    ReduceOp.SUM: torch.add,
    ReduceOp.AVG: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
}
# Backends known to implement ReduceOp.AVG themselves. See Note [AVG where the backend lacks it].
_NATIVE_AVG = frozenset({"nccl", "fakepg"})


class TorchProcessGroup:
    """``torch_pg`` (a ``torch.distributed.ProcessGroup``) as a :class:`reducer.ProcessGroup`.

    Pass the group itself, e.g. ``dist.group.WORLD`` after ``init_process_group`` or the result
    of ``dist.new_group``. ``timeout`` (seconds) bounds every ``Work.wait()`` called without a
    timeout of its own; the backend's own timeout (``init_process_group(timeout=...)``) still
    applies underneath.
    """

    def __init__(self, torch_pg: dist.ProcessGroup, *, timeout: float = 300.0) -> None:
        if not isinstance(torch_pg, dist.ProcessGroup):
            raise InvalidArgument(
                f"TorchProcessGroup takes a torch.distributed.ProcessGroup, got "
                f"{type(torch_pg).__name__}; call dist.init_process_group(...) first and pass "
                "dist.group.WORLD (or a group from dist.new_group)"
            )
        if not timeout > 0:
            raise InvalidArgument(
                f"TorchProcessGroup: timeout must be > 0 seconds, got {timeout!r}"
            )
        self._pg = torch_pg
        self._rank = torch_pg.rank()
        self._size = torch_pg.size()
        self._backend = str(torch_pg.name()).lower()
        self.timeout = float(timeout)
        # _lock guards _seq and makes issuing a collective atomic, so sequence numbers follow
        # the order in which the backend saw the calls.
        self._lock = threading.Lock()
        self._seq = 0

    @property
    def torch_group(self) -> dist.ProcessGroup:
        """The wrapped torch.distributed group."""
        return self._pg

    @property
    def backend(self) -> str:
        """The torch backend's name: ``"gloo"``, ``"nccl"``, ..."""
        return self._backend

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    # ---------------------------------------------------------------------------------------
    # Collectives.

    def allreduce(self, tensors: list[Tensor], op: ReduceOp = ReduceOp.SUM) -> TorchWork:
        """Reduce in place across ranks; a list is combined locally first (see Note [Tensor
        lists on real backends]). Sparse tensors (gloo) come back through ``result()`` and
        are also copied into the inputs."""
        tensors = _check_allreduce(tensors, op)
        if tensors[0].is_sparse:
            return self._sparse_allreduce(tensors, op)
        first, count = tensors[0], len(tensors)
        native = op is not ReduceOp.AVG or self._backend in _NATIVE_AVG
        torch_op = _TORCH_OPS[op] if native else dist.ReduceOp.SUM
        divisor = 1 if op is not ReduceOp.AVG else count if native else count * self._size

        def finish(_value: object) -> list[Tensor]:
            with torch.no_grad():
                if divisor != 1:
                    first.div_(divisor)
                for t in tensors[1:]:
                    t.copy_(first)
            return tensors

        with self._lock:
            seq = self._next()
            with torch.no_grad():
                for t in tensors[1:]:
                    _COMBINE[op](first, t, out=first)
            work = dist.all_reduce(first, torch_op, group=self._pg, async_op=True)
        return TorchWork(self, _describe("allreduce", seq, op, tensors), [work], tensors, finish)

    def _sparse_allreduce(self, tensors: list[Tensor], op: ReduceOp) -> TorchWork:
        count = len(tensors)
        with self._lock:
            seq = self._next()
            with torch.no_grad():
                total = tensors[0]
                for t in tensors[1:]:
                    total = total + t
            work = dist.all_reduce(total, dist.ReduceOp.SUM, group=self._pg, async_op=True)

        def finish(value: object) -> list[Tensor]:
            # gloo's future holds the sum as a new tensor (the input keeps its entries).
            result = value[0] if isinstance(value, list) and value else total
            with torch.no_grad():
                if op is ReduceOp.AVG:
                    result = result / (count * self._size)
                for t in tensors:
                    # In place on the input itself, as the protocol says; see fakepg's sparse
                    # kernel for why not through .detach().
                    t.copy_(result)
            return tensors

        return TorchWork(self, _describe("allreduce", seq, op, tensors), [work], tensors, finish)

    def allgather(self, output_lists: list[list[Tensor]], inputs: list[Tensor]) -> TorchWork:
        """``output_lists[i][r]`` = rank r's ``inputs[i]``; one torch all_gather per input."""
        outputs, inputs = _check_allgather(output_lists, inputs, self._size)
        with self._lock:
            seq = self._next()
            works = [
                dist.all_gather(out, inp, group=self._pg, async_op=True)
                for out, inp in zip(outputs, inputs, strict=True)
            ]
        flat = [t for out in outputs for t in out]
        return TorchWork(self, _describe("allgather", seq, None, inputs), works, flat, None)

    def broadcast(self, tensors: list[Tensor], root: int) -> TorchWork:
        """Rank ``root``'s tensors into everyone's; one torch broadcast per tensor."""
        tensors = _check_tensor_list(tensors, "broadcast")
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self._size:
            raise InvalidArgument(
                f"broadcast: root must be a rank in [0, {self._size}), got {root!r}"
            )
        with self._lock:
            seq = self._next()
            works = [
                dist.broadcast(t, group=self._pg, async_op=True, group_src=root) for t in tensors
            ]
        what = _describe("broadcast", seq, None, tensors, extra=f"root={root}")
        return TorchWork(self, what, works, tensors, None)

    def barrier(self) -> TorchWork:
        with self._lock:
            seq = self._next()
            work = dist.barrier(group=self._pg, async_op=True)
        return TorchWork(self, f"barrier #{seq}", [work], [], None)

    def _next(self) -> int:
        seq = self._seq
        self._seq += 1
        return seq

    def __repr__(self) -> str:
        return f"<reducer.TorchProcessGroup {self._backend} rank={self._rank} size={self._size}>"


class TorchWork:
    """One rank's handle on a collective of a :class:`TorchProcessGroup`.

    Implements :class:`reducer.Work`; ``get_future()`` returns a torch Future that completes
    with ``result()`` (or the error), as ``fakepg.Work.get_future`` does, for comm hooks.
    ``launched_ns`` and ``completed_ns`` (``time.perf_counter_ns``; None until completed) are
    what the reducer's iteration stats read.
    """

    def __init__(
        self,
        group: TorchProcessGroup,
        what: str,
        works: list[dist.Work],
        outputs: list[Tensor],
        finish: Callable[[object], list[Tensor]] | None,
    ) -> None:
        self._group = group
        self._what = what
        self._works = works
        self._outputs = outputs
        if len(works) == 1:
            base: torch.futures.Future[object] = works[0].get_future()
        else:
            base = torch.futures.collect_all([w.get_future() for w in works])  # type: ignore[assignment]
        self._future: torch.futures.Future[list[Tensor]] = base.then(
            lambda done: self._complete(done, finish)
        )
        self.launched_ns = time.perf_counter_ns()
        self.completed_ns: int | None = None  # written before _done is set
        # Set once the future (with its post-processing) completed. See Note [Waiting with a
        # deadline].
        self._done = threading.Event()
        self._future.add_done_callback(self._on_done)

    def _on_done(self, _future: torch.futures.Future[list[Tensor]]) -> None:
        self.completed_ns = time.perf_counter_ns()
        self._done.set()

    def _complete(
        self, done: torch.futures.Future[object], finish: Callable[[object], list[Tensor]] | None
    ) -> list[Tensor]:
        value = done.value()  # raises the backend's error
        if len(self._works) > 1:
            for part in value:  # type: ignore[attr-defined]
                part.value()
        if finish is not None:
            self._outputs = finish(value)
        return self._outputs

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; raise :class:`TorchCollectiveTimeout` after ``timeout`` seconds
        (None: the group's ``timeout``), or :class:`TorchCollectiveError` if it failed."""
        limit = self._group.timeout if timeout is None else float(timeout)
        if not limit >= 0:
            raise InvalidArgument(f"wait: timeout must be >= 0 seconds or None, got {timeout!r}")
        if not self._done.wait(limit):
            raise TorchCollectiveTimeout(
                f"{self._where()}: {self._what} did not complete within {limit:g} s. A peer has "
                "not issued it (it failed, is far behind, or issued a different collective "
                "before this one), or the backend is stuck. Look at the other ranks' errors "
                "first. The collective is still pending and may complete later; if it never "
                "does, the group is unusable: destroy it and restart every rank."
            )
        try:
            for work in self._works:
                work.wait()
            self._future.wait()
        except Exception as exc:
            raise TorchCollectiveError(
                f"{self._where()}: {self._what} failed: {type(exc).__name__}: {exc}. Usually "
                "a peer process died or left the group (look for the first failing rank), or "
                "the ranks issued different collectives. The group is unusable now: destroy "
                "it and restart every rank."
            ) from exc

    def is_completed(self) -> bool:
        """True once complete, successfully or not (and post-processed). Never blocks."""
        return self._done.is_set()

    def result(self) -> list[Tensor]:
        """The outputs; for a sparse allreduce, the reduced tensor, one per input."""
        return list(self._outputs)

    def get_future(self) -> torch.futures.Future[list[Tensor]]:
        """A torch Future that completes with :meth:`result`, or with the collective's error."""
        return self._future

    def _where(self) -> str:
        g = self._group
        return f"rank {g.rank()} of {g.size()} ({g.backend})"

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<reducer.TorchWork {self._what} {self._where()} {state}>"


# -------------------------------------------------------------------------------------------
# Local validation: raised from the call on the rank that passed the bad argument.


def _describe(
    kind: str, seq: int, op: ReduceOp | None, tensors: Sequence[Tensor], extra: str = ""
) -> str:
    """``allreduce #3 (op=SUM, 2 x float32[1024])``: how errors name a collective."""
    parts = [] if op is None else [f"op={op.name}"]
    if extra:
        parts.append(extra)
    if tensors:
        t = tensors[0]
        dtype = str(t.dtype).removeprefix("torch.")
        spec = f"{dtype}[{', '.join(str(s) for s in t.shape)}]"
        if t.is_sparse:
            spec += " sparse"
        parts.append(f"{len(tensors)} x {spec}" if len(tensors) > 1 else spec)
    return f"{kind} #{seq} ({', '.join(parts)})" if parts else f"{kind} #{seq}"


def _check_tensor_list(tensors: object, what: str) -> list[Tensor]:
    if isinstance(tensors, Tensor) or not isinstance(tensors, Sequence):
        raise InvalidArgument(
            f"{what} takes a list of tensors, got {type(tensors).__name__}; wrap a single "
            "tensor as [tensor]"
        )
    if not tensors:
        raise InvalidArgument(f"{what} got an empty list of tensors; pass at least one tensor")
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise InvalidArgument(f"{what}: element {i} is a {type(t).__name__}, not a tensor")
        if t.layout == torch.strided and not t.is_contiguous():
            raise InvalidArgument(
                f"{what}: tensor {i} is not contiguous; torch backends need contiguous tensors: "
                "pass .contiguous() and copy the result back"
            )
    return list(tensors)


def _check_allreduce(tensors: object, op: object) -> list[Tensor]:
    if not isinstance(op, ReduceOp):
        raise InvalidArgument(f"allreduce: op must be a reducer.ReduceOp, got {op!r}")
    checked = _check_tensor_list(tensors, "allreduce")
    first = checked[0]
    for i, t in enumerate(checked[1:], start=1):
        if (t.dtype, t.shape, t.layout, t.device) != (
            first.dtype,
            first.shape,
            first.layout,
            first.device,
        ):
            raise InvalidArgument(
                f"allreduce: tensor {i} is {t.dtype} {tuple(t.shape)} {t.layout} on {t.device} but "
                f"tensor 0 is {first.dtype} {tuple(first.shape)} {first.layout} on "
                f"{first.device}; all tensors of one allreduce (one per replica) must match"
            )
    if first.layout not in (torch.strided, torch.sparse_coo):
        raise InvalidArgument(f"allreduce: layout {first.layout} is not supported (dense or COO)")
    if first.is_sparse and op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise InvalidArgument(f"allreduce: sparse tensors support SUM and AVG only, not {op.name}")
    if op is ReduceOp.AVG and not (first.dtype.is_floating_point or first.dtype.is_complex):
        raise InvalidArgument(
            f"allreduce: AVG needs a floating dtype, got {first.dtype}; use SUM and divide"
        )
    return checked


def _check_allgather(
    output_lists: object, inputs: object, size: int
) -> tuple[list[list[Tensor]], list[Tensor]]:
    checked_inputs = _check_tensor_list(inputs, "allgather inputs")
    if (
        isinstance(output_lists, Tensor)
        or not isinstance(output_lists, Sequence)
        or len(output_lists) != len(checked_inputs)
    ):
        raise InvalidArgument(
            f"allgather: got {len(checked_inputs)} input tensor(s) and output lists of type "
            f"{type(output_lists).__name__}; pass one list of size() outputs per input"
        )
    outputs = []
    for i, (raw, inp) in enumerate(zip(output_lists, checked_inputs, strict=True)):
        out = _check_tensor_list(raw, f"allgather output list {i}")
        if len(out) != size:
            raise InvalidArgument(
                f"allgather: output list {i} has {len(out)} tensor(s); it needs one per rank "
                f"({size})"
            )
        for r, t in enumerate(out):
            if (t.dtype, t.shape, t.device) != (inp.dtype, inp.shape, inp.device):
                raise InvalidArgument(
                    f"allgather: output {i}[{r}] is {t.dtype} {tuple(t.shape)} on {t.device} but "
                    f"input {i} is {inp.dtype} {tuple(inp.shape)} on {inp.device}; outputs must "
                    "match their input"
                )
        outputs.append(out)
    return outputs, checked_inputs
