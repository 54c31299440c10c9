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
# safe from any thread; its post-processing on the collective's device (division for an
# emulated AVG, copies to the other tensors of a list) runs exactly once, on the thread that
# completes the backend's future, before the work counts as completed; copying a staged result
# back to the CPU (see Note [CPU tensors on a GPU-only backend]) runs once, in the first wait.

# Note [Tensor lists on real backends]
# The protocol's allreduce takes a list of tensors (one per model replica) and combines every
# tensor of every rank. torch's gloo and NCCL groups take one tensor per process, so a list is
# first combined locally, in list order, into its first tensor ((t0 op t1) op t2 ...; replicas
# on other devices are brought to the first one's), that tensor is allreduced, and the result
# is copied into the others once it arrives. For SUM this adds each rank's replicas before the
# ranks' sums; on dyadic data (see reducer.tools.validate) the order makes no difference. allgather
# and broadcast of a list issue one torch call per tensor.

# Note [AVG where the backend lacks it]
# reducer.ReduceOp.AVG is the sum divided by the number of contributions, ranks times tensors
# per rank. NCCL (and the fakepg torch backend) average natively; gloo does not. There the
# adapter allreduces the SUM and divides by size() * len(tensors) when the sum arrives. With
# native AVG and a list of n tensors, the backend divides by size() and the adapter by n.
# Which backend applies is decided per device ("cpu:gloo,cuda:nccl" groups have both).

# Note [CPU tensors on a GPU-only backend]
# The reducer keeps small bookkeeping tensors on the CPU (the per-rank used map of
# find-unused-parameters; the DDP wrapper's parameter counts). NCCL takes CUDA tensors only,
# so a CPU tensor on a group without a CPU backend is staged: copied to the group's device
# (its bound device, else the current CUDA device), reduced there, and copied back to the CPU
# tensor in the first successful wait (or when get_future's value is produced). Copying back
# in wait keeps the issuing call asynchronous: NCCL completes its future as soon as the
# kernel is queued, so a blocking device-to-host copy in its callback would block the issuer.

# Note [Waiting with a deadline]
# torch's Work.wait(timeout) is honoured differently by each backend. The adapter waits on the
# backend's future through an Event set by a done-callback, so every wait has the deadline the
# caller asked for, on every backend; then it calls the backend's own wait (which, on NCCL,
# orders the current CUDA stream after the collective) and raises the collective's error, if
# any. After a timeout the collective may still be in flight: the group is no longer usable.
# (For a single in-place allreduce the done-callback is added at the first wait: see Note
# [No Python on the backend's thread].)
# On NCCL the future completes once the collective is queued on the GPU, so the deadline
# bounds the CPU side only; a collective that never completes on the GPU is NCCL's watchdog's
# to catch (init_process_group's timeout), as for torch's own DDP. is_completed() asks the
# backend's works too, so on NCCL it turns True only when the GPU has finished.

# Note [Failures when issuing]
# A backend may refuse a collective in the call itself (a communicator that was aborted, a
# peer already gone). The protocol surfaces collective failures through Work.wait, on every
# rank that waits, so such an error is caught and returned as a failed TorchWork. Invalid
# arguments, found by the adapter before torch is called, still raise InvalidArgument (a
# ValueError) from the call itself.
"""

from __future__ import annotations

import functools
import re
import threading
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from . import collectives as _args
from .errors import InvalidArgument, ReductionError
from .process_group import ReduceOp
from .validation import check_timeout

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
# What torch's backends require of collective arguments, checked before torch is called (the
# checks are shared with fakepg). Replicas of one allreduce may be on several devices: see Note
# [Tensor lists on real backends].
_RULES = _args.CollectiveRules(
    error=InvalidArgument,
    name="torch backends",
    allreduce_match=("dtype", "shape", "layout"),
    allgather_match=("dtype", "shape", "device"),
    contiguous_everywhere=True,
)
# Backends known to implement ReduceOp.AVG themselves. See Note [AVG where the backend lacks it].
_NATIVE_AVG = frozenset({"nccl", "fakepg"})
# Backends known to have no sparse allreduce (stock NCCL builds).
_NO_SPARSE = frozenset({"nccl"})

# What a finished TorchWork does with the backend's future value (on the completing thread),
# and what it does once in the first successful wait (on the waiting thread).
_Finish = Callable[[object], list[Tensor]]
_Settle = Callable[[], None]


class TorchProcessGroup:
    """``torch_pg`` (a ``torch.distributed.ProcessGroup``) as a :class:`reducer.ProcessGroup`.

    Pass the group itself, e.g. ``dist.group.WORLD`` after ``init_process_group`` or the result
    of ``dist.new_group``. ``timeout`` (seconds, finite, or a ``timedelta``) bounds every
    ``Work.wait()`` called without a timeout of its own; the backend's own timeout
    (``init_process_group(timeout=...)``) still applies underneath. Infinity is refused: every
    wait has a deadline (and torch cannot express an infinite one either).
    """

    def __init__(self, torch_pg: dist.ProcessGroup, *, timeout: float = 300.0) -> None:
        if not isinstance(torch_pg, dist.ProcessGroup):
            raise InvalidArgument(
                f"TorchProcessGroup takes a torch.distributed.ProcessGroup, got "
                f"{type(torch_pg).__name__}; call dist.init_process_group(...) first and pass "
                "dist.group.WORLD (or a group from dist.new_group)"
            )
        self.timeout = timeout  # checked by the setter
        self._pg = torch_pg
        self._rank = torch_pg.rank()
        self._size = torch_pg.size()
        self._backend = str(torch_pg.name()).lower()
        # Device type -> backend name; None where torch does not say (a group that
        # init_process_group or new_group did not create): then nothing is staged.
        self._device_backends = _device_backends(torch_pg, self._backend)
        # _lock guards _seq and makes issuing a collective atomic, so sequence numbers follow
        # the order in which the backend saw the calls.
        self._lock = threading.Lock()
        self._seq = 0

    @property
    def timeout(self) -> float:
        """Seconds a ``Work.wait()`` without a timeout of its own waits (settable)."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._timeout = check_timeout(seconds, "TorchProcessGroup")

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
        tensors = _args.check_allreduce(tensors, op, _RULES)
        if tensors[0].is_sparse:
            return self._sparse_allreduce(tensors, op)
        first, count = tensors[0], len(tensors)
        stage = self._stage_device(first, "allreduce")
        target = first if stage is None else torch.empty_like(first, device=stage)
        native = op is not ReduceOp.AVG or self._backend_of(target) in _NATIVE_AVG
        torch_op = _TORCH_OPS[op] if native else dist.ReduceOp.SUM
        divisor = 1 if op is not ReduceOp.AVG else count if native else count * self._size

        def finish(_value: object) -> list[Tensor]:
            with torch.no_grad():
                if divisor != 1:
                    target.div_(divisor)
                if stage is None:
                    for t in tensors[1:]:
                        t.copy_(first)
            return tensors

        def settle() -> None:
            with torch.no_grad():
                first.copy_(target)
                for t in tensors[1:]:
                    t.copy_(first)

        def issue() -> list[dist.Work]:
            with torch.no_grad():
                for t in tensors[1:]:
                    _COMBINE[op](first, t.to(first.device), out=first)
                if stage is not None:
                    target.copy_(first)
            return [_issued(dist.all_reduce(target, torch_op, group=self._pg, async_op=True))]

        what = ("allreduce", op, tensors, "")
        # One tensor, reduced where it is, nothing to divide: nothing to do on completion.
        plain = count == 1 and stage is None and divisor == 1
        return self._issue(
            what, issue, tensors, None if plain else finish, None if stage is None else settle
        )

    def _sparse_allreduce(self, tensors: list[Tensor], op: ReduceOp) -> TorchWork:
        count = len(tensors)
        backend = self._backend_of(tensors[0])
        if backend in _NO_SPARSE:
            raise InvalidArgument(
                f"allreduce: the {backend} backend (rank {self._rank}) has no sparse allreduce; "
                "reduce sparse gradients over a gloo group (init_process_group("
                "'cpu:gloo,cuda:nccl') gives both), or make them dense (e.g. "
                "nn.Embedding(sparse=False))"
            )
        self._stage_device(tensors[0], "allreduce")  # only checks: sparse tensors stay put
        total = tensors[0]

        def finish(value: object) -> list[Tensor]:
            # gloo's future holds the sum as a new tensor (the input may keep its entries).
            result = value[0] if isinstance(value, list) and value else total
            with torch.no_grad():
                if op is ReduceOp.AVG:
                    result = result / (count * self._size)
                for t in tensors:
                    if t is not result:
                        # In place on the input itself, as the protocol says; see fakepg's
                        # sparse kernel for why not through .detach().
                        t.copy_(result)
            return tensors

        def issue() -> list[dist.Work]:
            nonlocal total
            with torch.no_grad():
                for t in tensors[1:]:
                    total = total + t.to(total.device)
            return [
                _issued(dist.all_reduce(total, dist.ReduceOp.SUM, group=self._pg, async_op=True))
            ]

        return self._issue(("allreduce", op, tensors, ""), issue, tensors, finish, None)

    def allgather(self, output_lists: list[list[Tensor]], inputs: list[Tensor]) -> TorchWork:
        """``output_lists[i][r]`` = rank r's ``inputs[i]``; one torch all_gather per input."""
        outputs, inputs = _args.check_allgather(output_lists, inputs, self._size, _RULES)
        stage = self._stage_device(inputs[0], "allgather")
        for t in [*inputs, *(t for out in outputs for t in out)]:
            if self._stage_device(t, "allgather") != stage:
                raise InvalidArgument(
                    f"allgather on rank {self._rank}: inputs and outputs mix devices that the "
                    f"{self._backend} backend handles differently ({inputs[0].device} and "
                    f"{t.device}); put them all on one device"
                )
        flat = [t for out in outputs for t in out]
        if stage is None:
            staged_in, staged_out = inputs, outputs
        else:
            staged_in = [t.to(stage) for t in inputs]
            staged_out = [[torch.empty_like(t, device=stage) for t in out] for out in outputs]

        def issue() -> list[dist.Work]:
            return [
                _issued(dist.all_gather(out, inp, group=self._pg, async_op=True))
                for out, inp in zip(staged_out, staged_in, strict=True)
            ]

        def settle() -> None:
            for out, staged in zip(outputs, staged_out, strict=True):
                for t, s in zip(out, staged, strict=True):
                    t.copy_(s)

        what = ("allgather", None, inputs, "")
        return self._issue(what, issue, flat, None, None if stage is None else settle)

    def broadcast(self, tensors: list[Tensor], root: int) -> TorchWork:
        """Rank ``root``'s tensors into everyone's; one torch broadcast per tensor."""
        tensors = _args.check_tensor_list(tensors, "broadcast", _RULES)
        if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < self._size:
            raise InvalidArgument(
                f"broadcast: root must be a rank in [0, {self._size}), got {root!r}"
            )
        stages = [self._stage_device(t, "broadcast") for t in tensors]
        staged = [t if s is None else t.to(s) for t, s in zip(tensors, stages, strict=True)]

        def issue() -> list[dist.Work]:
            return [
                _issued(dist.broadcast(t, group=self._pg, async_op=True, group_src=root))
                for t in staged
            ]

        def settle() -> None:
            for t, s in zip(tensors, staged, strict=True):
                if s is not t:
                    t.copy_(s)

        needs_settle = any(s is not None for s in stages)
        what = ("broadcast", None, tensors, f"root={root}")
        return self._issue(what, issue, tensors, None, settle if needs_settle else None)

    def barrier(self) -> TorchWork:
        def issue() -> list[dist.Work]:
            return [_issued(dist.barrier(group=self._pg, async_op=True))]

        return self._issue(("barrier", None, [], ""), issue, [], None, None)

    # ---------------------------------------------------------------------------------------
    # Issuing.

    def _issue(
        self,
        what: tuple[str, ReduceOp | None, Sequence[Tensor], str],
        issue: Callable[[], list[dist.Work]],
        outputs: list[Tensor],
        finish: _Finish | None,
        settle: _Settle | None,
    ) -> TorchWork:
        """Issue under the lock, numbering the collective; a backend's refusal becomes a
        failed work. See Note [Failures when issuing]."""
        kind, op, tensors, extra = what
        with self._lock:
            seq = self._seq
            self._seq += 1
            launched_ns = time.perf_counter_ns()
            try:
                works = issue()
            except InvalidArgument:
                raise
            except Exception as exc:
                failed: torch.futures.Future[object] = torch.futures.Future()
                failed.set_exception(exc)
                description = functools.partial(_describe, kind, seq, op, tensors, extra)
                return TorchWork(self, description, [], failed, outputs, None, None, launched_ns)
        if len(works) == 1:
            future: torch.futures.Future[object] = works[0].get_future()
        else:
            future = torch.futures.collect_all([w.get_future() for w in works])  # type: ignore[assignment]
        # Formatted only when an error or repr needs it: this is on every bucket's path.
        description = functools.partial(_describe, kind, seq, op, tensors, extra)
        direct = kind == "allreduce" and len(works) == 1 and finish is None and settle is None
        return TorchWork(
            self, description, works, future, outputs, finish, settle, launched_ns, direct=direct
        )

    def _backend_of(self, tensor: Tensor) -> str:
        """The backend that handles ``tensor``'s device in this group."""
        if self._device_backends is None:
            return self._backend
        return self._device_backends.get(tensor.device.type, self._backend)

    def _stage_device(self, tensor: Tensor, what: str) -> torch.device | None:
        """Where ``tensor`` must be copied for this group's backend, or None if it can stay.
        See Note [CPU tensors on a GPU-only backend]."""
        backends = self._device_backends
        if backends is None or tensor.device.type in backends:
            return None
        if tensor.device.type == "cpu" and "cuda" in backends:
            bound = getattr(self._pg, "bound_device_id", None)
            if isinstance(bound, torch.device):
                return bound
            return torch.device("cuda", torch.cuda.current_device())
        handled = ", ".join(sorted(backends))
        raise InvalidArgument(
            f"{what} on rank {self._rank}: a tensor on {tensor.device}, but this group "
            f"({self._backend}) has backends for {handled} only; move the tensor there"
        )

    def __repr__(self) -> str:
        return f"<reducer.TorchProcessGroup {self._backend} rank={self._rank} size={self._size}>"


def _issued(work: dist.Work | None) -> dist.Work:
    """torch's async collectives return None for a rank outside the group."""
    if work is None:
        raise InvalidArgument(
            "torch.distributed returned no work: this process is not a member of the group; "
            "wrap only groups that this rank belongs to"
        )
    return work


def _device_backends(pg: dist.ProcessGroup, name: str) -> dict[str, str] | None:
    """Device type -> backend name for ``pg``, from torch's public backend config
    (``"cpu:gloo,cuda:nccl"``); for a plain ``"nccl"`` group that torch does not know, CUDA."""
    try:
        config = dist.get_backend_config(pg)
    except Exception:  # a group torch's registry does not hold: fall back on the name
        return {"cuda": "nccl"} if name == "nccl" else None
    backends = {}
    for entry in config.split(","):
        device, sep, backend = entry.strip().partition(":")
        if sep and device and backend:
            backends[device.lower()] = backend.lower()
    return backends or None


class TorchWork:
    """One rank's handle on a collective of a :class:`TorchProcessGroup`.

    Implements :class:`reducer.Work`; ``get_future()`` returns a torch Future that completes
    with ``result()`` (or the error), as ``fakepg.Work.get_future`` does, for comm hooks.
    ``launched_ns`` and ``completed_ns`` (``time.perf_counter_ns``; None until completed, and
    for a single in-place allreduce until a wait or ``is_completed`` saw it complete: see
    Note [No Python on the backend's thread]) are what the reducer's iteration stats read.
    """

    def __init__(
        self,
        group: TorchProcessGroup,
        what: Callable[[], str],
        works: list[dist.Work],
        future: torch.futures.Future[object],
        outputs: list[Tensor],
        finish: _Finish | None,
        settle: _Settle | None,
        launched_ns: int,
        *,
        direct: bool = False,
    ) -> None:
        """``direct``: ``future`` is one backend work's, and its value is ``outputs`` as they
        are (an allreduce of one tensor in place), so it serves as this work's future."""
        self._group = group
        self._what = what
        self._works = works
        self._outputs = outputs
        self.launched_ns = launched_ns
        self.completed_ns: int | None = None  # written before _done is set
        # _settle_lock guards _settle (it runs once, in the first successful wait) and
        # _armed (a direct work adds its done-callback once).
        self._settle_lock = threading.Lock()
        self._settle = settle
        # Set once the future (with its post-processing) completed. See Note [Waiting with a
        # deadline].
        self._done = threading.Event()
        self._future: torch.futures.Future[list[Tensor]]
        # See Note [No Python on the backend's thread]: a direct work arms _done in wait.
        self._armed = not direct
        if direct:
            # The backend's own future, whose value is the list of reduced tensors.
            self._future = future  # type: ignore[assignment]
        else:
            self._future = future.then(lambda done: self._complete(done, finish))
            self._future.add_done_callback(self._on_done)

    def _on_done(self, _future: torch.futures.Future[list[Tensor]]) -> None:
        self.completed_ns = time.perf_counter_ns()
        self._done.set()

    # Note [No Python on the backend's thread]
    # A Python done-callback on the backend's future runs on the backend's worker thread and
    # must take the GIL there, while the rank's thread runs the reducer's hooks: the worker
    # then waits for the GIL (up to the interpreter's switch interval) before it can move on
    # to the next bucket's collective. torch's DDP has no Python there. So a direct work (an
    # allreduce of one tensor in place, every bucket's case) adds its callback only when
    # someone waits: already done by then (early buckets), it needs none; otherwise the
    # callback runs while the waiter sleeps with the GIL released. ``completed_ns`` is then
    # when the wait saw it complete, at the latest: on the reducer's timeline (iteration
    # stats, traces) a bucket that finished during backward reads as done when finalize
    # started. The fake world records its own completion times.

    def _arm(self) -> None:
        """Set ``_done`` once the backend's future completes (a direct work, first wait or
        poll)."""
        with self._settle_lock:
            if self._armed:
                return
            self._armed = True
        self._future.add_done_callback(self._on_done)  # runs at once if already done

    def _complete(self, done: torch.futures.Future[object], finish: _Finish | None) -> list[Tensor]:
        value = done.value()  # raises the backend's error
        if len(self._works) > 1:
            for part in value:  # type: ignore[attr-defined]
                part.value()
        if finish is not None:
            self._outputs = finish(value)
        return self._outputs

    def _settle_once(self) -> None:
        with self._settle_lock:
            settle, self._settle = self._settle, None
            if settle is not None:
                settle()

    def wait(self, timeout: float | None = None) -> None:
        """Block until complete; raise :class:`TorchCollectiveTimeout` after ``timeout`` seconds
        (None: the group's ``timeout``), or :class:`TorchCollectiveError` if it failed."""
        limit = self._group.timeout if timeout is None else _wait_limit(timeout)
        if not self._armed:
            self._arm()
        if not self._done.wait(limit):
            raise TorchCollectiveTimeout(
                f"{self._where()}: {self._what()} did not complete within {limit:g} s. A peer has "
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
            g = self._group
            raise TorchCollectiveError(
                f"{self._where()}: {self._what()} failed: {type(exc).__name__}: "
                f"{_first_line(exc)}.{_peer_hint(str(exc), g.rank(), g.size())} Usually a peer "
                "process died or left the group (look for the first failing rank), or the "
                "ranks issued different collectives. The group is unusable now: destroy it and "
                "restart every rank."
            ) from exc
        self._settle_once()

    def is_completed(self) -> bool:
        """True once complete, successfully or not (and post-processed). Never blocks."""
        if not self._armed and self._future.done():
            self._arm()
        return self._done.is_set() and all(w.is_completed() for w in self._works)

    def result(self) -> list[Tensor]:
        """The outputs; for a sparse allreduce, the reduced tensor, one per input."""
        return list(self._outputs)

    def get_future(self) -> torch.futures.Future[list[Tensor]]:
        """A torch Future that completes with :meth:`result`, or with the collective's error."""
        if self._settle is None:
            return self._future

        def settled(done: torch.futures.Future[list[Tensor]]) -> list[Tensor]:
            value = done.value()
            self._settle_once()
            return value

        return self._future.then(settled)

    def _where(self) -> str:
        g = self._group
        return f"rank {g.rank()} of {g.size()} ({g.backend})"

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"<reducer.TorchWork {self._what()} {self._where()} {state}>"


# Note [Naming the peer of a failed collective]
# gloo reports a broken connection by the peer's socket address only ("Connection closed by
# peer [10.0.0.2]:41234"), not its rank, and nothing public maps addresses to ranks: the port
# may be the peer's listening port or an ephemeral one, depending on which side connected, and
# several ranks share a host's address. So the rank is named where it follows from the group
# alone (a group of two: the other rank); otherwise the message lists the ranks the peer can
# be, and says that the rank whose own log shows the first error is the one that failed.
_PEER_ADDRESS = re.compile(r"\[([^\]\s]+)\]:(\d+)")


def _peer_hint(message: str, rank: int, size: int) -> str:
    """A sentence naming the rank of the peer whose address a backend error gives, or ""."""
    found = _PEER_ADDRESS.search(message)
    if found is None or size < 2:
        return ""
    where = f"{found.group(1)}:{found.group(2)}"
    others = [r for r in range(size) if r != rank]
    if len(others) == 1:
        return (
            f" The peer at {where} is rank {others[0]}, the only other rank of this group: "
            f"its log shows why it stopped."
        )
    shown = ", ".join(map(str, others[:16])) + (" and more" if len(others) > 16 else "")
    return (
        f" The peer at {where} is one of ranks {shown} (the backend names peers by address "
        "only, and ranks on one host share it): the rank whose log shows the first error is "
        "the one that stopped."
    )


def _wait_limit(timeout: object) -> float:
    """A wait's own timeout: 0 (poll) or a finite number of seconds."""
    if timeout == 0 and not isinstance(timeout, bool):
        return 0.0
    return check_timeout(timeout, "TorchWork.wait")


def _first_line(exc: BaseException) -> str:
    """The error's message up to torch's appended C++ traceback, on one line."""
    text = str(exc).split("\nException raised from", 1)[0]
    return " ".join(text.split())[:600]


def _describe(
    kind: str, seq: int, op: ReduceOp | None, tensors: Sequence[Tensor], extra: str = ""
) -> str:
    """``allreduce #3 (op=SUM, 2 x float32[1024])``: how errors name a collective (a tensor not
    on the CPU adds its device, a sparse one its layout)."""
    parts = [] if op is None else [f"op={op.name}"]
    if extra:
        parts.append(extra)
    if tensors:
        spec = _args.TensorSpec.of(tensors[0])  # as fakepg's errors print it
        parts.append(f"{len(tensors)} x {spec}" if len(tensors) > 1 else str(spec))
    return f"{kind} #{seq} ({', '.join(parts)})" if parts else f"{kind} #{seq}"
