"""The fake world as a torch.distributed backend, so that torch's own code runs on it.

After :func:`register_torch_backend`, each rank's thread may call
``torch.distributed.init_process_group("fakepg", rank=r, world_size=W, store=store,
pg_options=world)`` with a :class:`fakepg.World` of ``W`` ranks; ``dist.all_reduce``,
``torch.nn.parallel.DistributedDataParallel`` and anything else written against
``torch.distributed`` then run on the fake world: asynchronously (a torch ``Work`` completes
when the fake collective does) and deterministically (see Note [Deterministic reduction order]
in fakepg.collectives). :func:`run_torch` does all of it for you::

    import fakepg, torch
    fakepg.register_torch_backend()

    def step(pg):                              # pg: this rank's fakepg.FakeProcessGroup
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        model(torch.randn(3, 4) * (pg.rank() + 1)).sum().backward()
        return model.module.weight.grad        # the same bits on every rank

    fakepg.run_torch(step, world_size=4)

# Guarantees: ``register_torch_backend`` is safe from any thread and idempotent. A torch group
# of this backend belongs to its rank's thread (torch.distributed state is per thread once the
# backend is registered: see Note [Per-thread torch.distributed state]); its collectives may be
# issued from that thread and from autograd's. Works are safe from any thread. Nothing here
# holds state shared between worlds: each torch group refers to its own world's
# FakeProcessGroup, and the per-thread state lives in each thread.

# Note [Per-thread torch.distributed state]
# torch.distributed keeps one default group per process: its Python state (the default group,
# group names and ranks) lives in ``distributed_c10d._world``, and its C++ registry of groups by
# name is process-wide. W rank threads each calling init_process_group would collide on both
# (every thread's default group is named "0"). Registering the backend therefore
# (1) replaces ``_world`` by a proxy that gives every thread its own world state, except the
#     thread that registered, which keeps the state it had (groups it created before stay
#     usable there), and
# (2) turns on c10d's thread isolation mode, which makes the C++ registry per thread, and
#     registers the registering thread's existing groups again in its own registry.
# Both are process-wide and permanent (there is no safe moment to undo them while another
# thread may hold a group), which is why registering is an explicit call, never an import side
# effect. Threads then see only the groups they created themselves, as processes would.

# Note [Errors in torch futures]
# ``torch.futures.Future.set_exception`` (what fakepg.Work.get_future uses) stores the exception
# as the future's *value*, with a Python-side hook that raises it: to C++ the future completed
# successfully. torch's C++ DistributedDataParallel reads such a value as its result, which
# crashes (it pickles the exception in search of tensors). A future whose callback raises is
# marked failed in C++ too, so the backend hands torch ``fake_future.then(_value_or_raise)``:
# a failed collective fails the C++ reducer's wait, and backward raises on every rank.

# Note [How torch collectives map to the fake world]
# Every torch collective of a rank becomes the next fake collective of that rank in its group,
# in issue order, so torch collectives and direct FakeProcessGroup calls on the same group
# interleave consistently as long as every rank issues the same sequence. Each torch collective
# maps to the FakeProcessGroup method of the same meaning, one to one (a tensor list of
# allreduce, reduce or broadcast is one collective: its tensors are replicas, as in
# reducer.ProcessGroup; the coalesced forms of all_gather_into_tensor and reduce_scatter_tensor
# are one collective each), except allreduce_coalesced, which issues one fake allreduce per
# tensor. send and recv are matched per pair and tag (see Note [Point-to-point matching] in
# fakepg.world), so batch_isend_irecv works as torch runs it, one op at a time. A receive from
# any source is refused (its match would depend on thread timing). torch's Python-side
# ``dist.monitored_barrier`` accepts only gloo groups; registering the backend lets it call a
# fakepg group's own monitored_barrier (see _install_monitored_barrier).

# Note [Subgroups through torch]
# ``dist.new_group`` and DeviceMesh create a group per call on every rank thread, each with the
# name torch computes alike on every rank (a counter of the thread's own group state); the
# backend maps the name and members to one subgroup of the default group's world (see Note
# [Subgroups] in fakepg.world), found through the thread that created the default group. A
# Python backend is the ProcessGroup itself (torch registers no Backend object under it), so
# torch's C++ getter of the group name has nowhere to read it from: the group answers
# ``group_name`` itself, which is what DeviceMesh and FSDP ask.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d as _c10d

from reducer.process_group import ReduceOp

from .netmodel import NetworkModel
from .work import Work
from .world import FakeProcessGroup, World

__all__ = ["init_torch_group", "register_torch_backend", "run_torch"]

T = TypeVar("T")

_BACKEND = "fakepg"

# The world and rank of the default fakepg group created on this thread, so that subgroups
# (created without pg_options) find it. See Note [Subgroups through torch].
_thread_default = threading.local()

# Guards torch's process-wide state, not any world's: the first registration (two threads
# registering at once install the per-thread state once), and the two fields below, which
# put sys.excepthook back after init_process_group (see _init_default_group).
_PROCESS_LOCK = threading.Lock()
_inits_in_flight = 0
_saved_excepthook = sys.excepthook
# One store per world for init_torch_group (init_process_group wants one; the backend does
# not use it). Guarded by _PROCESS_LOCK.
_stores: weakref.WeakKeyDictionary[World, Any] = weakref.WeakKeyDictionary()
# torch's own, whatever replaces dist.init_process_group later (python -m reducer launch does).
_torch_init_process_group = _c10d.init_process_group

_OPS: dict[Any, ReduceOp] = {
    dist.ReduceOp.SUM: ReduceOp.SUM,
    dist.ReduceOp.AVG: ReduceOp.AVG,
    dist.ReduceOp.PRODUCT: ReduceOp.PRODUCT,
    dist.ReduceOp.MIN: ReduceOp.MIN,
    dist.ReduceOp.MAX: ReduceOp.MAX,
}


def register_torch_backend() -> None:
    """Register the ``"fakepg"`` backend with torch.distributed. Idempotent.

    Makes torch.distributed's group state per thread (see Note [Per-thread torch.distributed
    state]); call it before starting rank threads, from the thread that owns any group created
    so far (usually the main thread).
    """
    with _PROCESS_LOCK:
        _install_per_thread_worlds()
        _install_monitored_barrier()
        if not hasattr(dist.Backend, _BACKEND.upper()):
            dist.Backend.register_backend(
                _BACKEND, _create_backend, extended_api=True, devices=["cpu"]
            )


def run_torch(
    fn: Callable[[FakeProcessGroup], T],
    world_size: int,
    *,
    timeout: float = 60.0,
    network: NetworkModel | None = None,
    per_rank_rng: bool = True,
) -> list[T]:
    """Like :func:`fakepg.run`, with torch.distributed's default group on the fake world.

    Registers the backend, starts a world of ``world_size`` ranks, and on each rank's thread
    calls ``init_process_group("fakepg")``, then ``fn(pg)`` (``pg`` is the rank's
    FakeProcessGroup, on the same world as the torch group), then ``destroy_process_group``.
    Failures behave as in :func:`fakepg.run`: a failure anywhere aborts the world, every rank
    blocked in a collective (a torch one included) wakes, and the first failure is re-raised
    with a note naming its rank. Returns the results in rank order.
    """
    if not callable(fn):
        raise ValueError(f"run_torch: fn must be callable, got {fn!r}")
    register_torch_backend()
    with World(world_size, timeout=timeout, network=network) as world:
        # Unused by the backend, but init_process_group wants a store. (torch re-exports
        # HashStore without listing it, hence the ignore.)
        store = dist.HashStore()  # type: ignore[attr-defined]

        def rank_main(pg: FakeProcessGroup) -> T:
            _init_default_group(pg.rank(), world, store, timeout)
            try:
                return fn(pg)
            finally:
                dist.destroy_process_group()

        return world.run(rank_main, per_rank_rng=per_rank_rng)


def init_torch_group(world: World, rank: int) -> None:
    """On rank ``rank``'s thread: torch.distributed's default group, on ``world``.

    What :func:`run_torch` does on each rank before calling its function, for rank threads
    started some other way (``World.run``, or ``python -m reducer launch``, which calls it from
    the training script's own ``init_process_group``). The torch group's collectives time out
    after ``world.timeout``; call ``dist.destroy_process_group()`` on the thread when done.
    """
    if not isinstance(world, World):
        raise ValueError(f"init_torch_group: world must be a fakepg.World, got {world!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world.world_size:
        raise ValueError(
            f"init_torch_group: rank must be an int in [0, {world.world_size}), got {rank!r}"
        )
    register_torch_backend()
    with _PROCESS_LOCK:
        store = _stores.get(world)
        if store is None:
            store = _stores[world] = dist.HashStore()  # type: ignore[attr-defined]
    _init_default_group(rank, world, store, world.timeout)


def _init_default_group(rank: int, world: World, store: Any, timeout: float) -> None:
    """init_process_group("fakepg") for ``rank``, without torch's excepthook side effect.

    Each init_process_group wraps ``sys.excepthook`` to prefix tracebacks with the rank: in a
    process that runs worlds on threads again and again that chain would grow without end (and
    print a wrong rank). The hook from before the first of the inits in flight is put back when
    the last of them ends. No lock is held during the init itself: with
    TORCH_DIST_INIT_BARRIER=1 it waits for the other ranks' inits.
    """
    global _inits_in_flight, _saved_excepthook
    with _PROCESS_LOCK:
        if _inits_in_flight == 0:
            _saved_excepthook = sys.excepthook
        _inits_in_flight += 1
    try:
        _torch_init_process_group(
            _BACKEND,
            rank=rank,
            world_size=world.world_size,
            store=store,
            pg_options=world,
            timeout=timedelta(seconds=timeout),
        )
    finally:
        with _PROCESS_LOCK:
            _inits_in_flight -= 1
            if _inits_in_flight == 0:
                sys.excepthook = _saved_excepthook


# -------------------------------------------------------------------------------------------
# The backend: a torch ProcessGroup whose collectives are a FakeProcessGroup's.


def _create_backend(options: Any, world: object) -> _TorchGroup:
    """torch's backend constructor (extended API): ``world`` is init_process_group's (or
    new_group's) ``pg_options``; ``options`` carries the rank, size, name and members."""
    rank, size = int(options.group_rank), int(options.group_size)
    name = str(options.group_id)
    members = tuple(int(r) for r in options.global_ranks_in_group)
    if not members:  # the default group: init_process_group
        if not isinstance(world, World):
            raise ValueError(
                f"init_process_group('{_BACKEND}') needs the fake world the ranks share: pass "
                f"pg_options=world, a fakepg.World({size}) created once for all rank threads "
                f"(got pg_options={world!r}); fakepg.run_torch does this for you"
            )
        if size != world.world_size:
            raise ValueError(
                f"init_process_group('{_BACKEND}'): world_size={size} but the fake world has "
                f"{world.world_size} ranks; pass world_size={world.world_size} (use "
                "dist.new_group for a group of fewer ranks)"
            )
        if not 0 <= rank < size:
            raise ValueError(
                f"init_process_group('{_BACKEND}'): rank={rank} is not in [0, {size}); pass "
                "each rank thread its own rank"
            )
        _thread_default.world = world
        return _TorchGroup(world.group(rank), name)
    # A subgroup. See Note [Subgroups through torch].
    owner = world if isinstance(world, World) else getattr(_thread_default, "world", None)
    if owner is None:
        raise ValueError(
            f"new_group on the '{_BACKEND}' backend: this thread has no default fakepg group; "
            "call init_process_group('fakepg', ..., pg_options=world) on it first"
        )
    return _TorchGroup(owner._named_group(name, members, members[rank]), name)


class _TorchGroup(dist.ProcessGroup):
    """One rank's torch group over its FakeProcessGroup. See Note [How torch collectives map
    to the fake world]."""

    def __init__(self, fake: FakeProcessGroup, name: str) -> None:
        # The (rank, size) constructor of Python backends; torch's stub lists only the other.
        super().__init__(fake.rank(), fake.size())  # type: ignore[call-arg]
        self._fake = fake
        self._name = name

    @property
    def fake_group(self) -> FakeProcessGroup:
        return self._fake

    @property
    def group_name(self) -> str:  # type: ignore[override]
        """The name torch gave this group. See Note [Subgroups through torch]."""
        return self._name

    def getBackendName(self) -> str:
        return _BACKEND

    # torch passes its options objects positionally; defaults of None stand for "no options".
    # The overrides ignore [override]: torch's stub overloads each method with the C++-only
    # convenience forms, but a Python backend receives exactly these arguments.

    def allreduce(self, tensors: list[Tensor], opts: Any = None) -> _TorchWork:  # type: ignore[override]
        op = _reduce_op(opts, "allreduce")
        return self._work([self._fake.allreduce(list(tensors), op)], list(tensors))

    def allreduce_coalesced(self, tensors: list[Tensor], opts: Any = None) -> _TorchWork:
        op = _reduce_op(opts, "allreduce_coalesced")
        works = [self._fake.allreduce([t], op) for t in tensors]
        return self._work(works, list(tensors))

    def reduce(self, tensors: list[Tensor], opts: Any = None) -> _TorchWork:  # type: ignore[override]
        op = _reduce_op(opts, "reduce")
        root = 0 if opts is None else int(opts.rootRank)
        return self._work([self._fake.reduce(list(tensors), root, op)], list(tensors))

    def broadcast(self, tensors: list[Tensor], opts: Any = None) -> _TorchWork:  # type: ignore[override]
        root = 0 if opts is None else int(opts.rootRank)
        return self._work([self._fake.broadcast(list(tensors), root)], list(tensors))

    def allgather(  # type: ignore[override]
        self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any = None
    ) -> _TorchWork:
        outputs = [list(out) for out in output_lists]
        work = self._fake.allgather(outputs, list(inputs))
        return self._work([work], [t for out in outputs for t in out])

    def allgather_coalesced(
        self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any = None
    ) -> _TorchWork:
        return self.allgather(output_lists, inputs, opts)

    def all_gather_single(
        self, output: Tensor, input_tensor: Tensor, opts: Any = None
    ) -> _TorchWork:
        """all_gather_into_tensor: rank r's input lands in the r-th chunk of the output."""
        return self._work([self._fake.allgather_into_tensor(output, input_tensor)], [output])

    def _allgather_base(self, output: Tensor, input_tensor: Tensor, opts: Any = None) -> _TorchWork:
        return self.all_gather_single(output, input_tensor, opts)

    def all_gather_single_coalesced(
        self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None
    ) -> _TorchWork:
        work = self._fake.allgather_into_tensor_coalesced(list(outputs), list(inputs))
        return self._work([work], list(outputs))

    def allgather_into_tensor_coalesced(
        self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None
    ) -> _TorchWork:
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any = None
    ) -> _TorchWork:
        op = _reduce_op(opts, "reduce_scatter")
        if len(outputs) != 1 or len(input_lists) != 1:
            raise ValueError(
                f"reduce_scatter on the '{_BACKEND}' backend takes one output and one input "
                f"list, got {len(outputs)} and {len(input_lists)}"
            )
        work = self._fake.reduce_scatter(outputs[0], list(input_lists[0]), op)
        return self._work([work], list(outputs))

    def reduce_scatter_single(
        self, output: Tensor, input_tensor: Tensor, opts: Any = None
    ) -> _TorchWork:
        """reduce_scatter_tensor: rank r gets the reduction of every rank's r-th chunk."""
        op = _reduce_op(opts, "reduce_scatter_tensor")
        return self._work([self._fake.reduce_scatter_tensor(output, input_tensor, op)], [output])

    def _reduce_scatter_base(
        self, output: Tensor, input_tensor: Tensor, opts: Any = None
    ) -> _TorchWork:
        return self.reduce_scatter_single(output, input_tensor, opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None
    ) -> _TorchWork:
        op = _reduce_op(opts, "reduce_scatter_tensor_coalesced")
        work = self._fake.reduce_scatter_tensor_coalesced(list(outputs), list(inputs), op)
        return self._work([work], list(outputs))

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None
    ) -> _TorchWork:
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)

    def alltoall(self, outputs: list[Tensor], inputs: list[Tensor], opts: Any = None) -> _TorchWork:
        return self._work([self._fake.all_to_all(list(outputs), list(inputs))], list(outputs))

    def all_to_all_single(
        self,
        output: Tensor,
        input_tensor: Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        opts: Any = None,
    ) -> _TorchWork:
        work = self._fake.all_to_all_single(
            output, input_tensor, output_split_sizes, input_split_sizes
        )
        return self._work([work], [output])

    def alltoall_base(
        self,
        output: Tensor,
        input_tensor: Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        opts: Any = None,
    ) -> _TorchWork:
        return self.all_to_all_single(
            output, input_tensor, output_split_sizes, input_split_sizes, opts
        )

    def gather(  # type: ignore[override]
        self, output_lists: list[list[Tensor]], inputs: list[Tensor], opts: Any = None
    ) -> _TorchWork:
        root = 0 if opts is None else int(opts.rootRank)
        gather_list = list(output_lists[0]) if output_lists else None
        tensor = _single(inputs, "gather")
        work = self._fake.gather(tensor, gather_list, root)
        return self._work([work], gather_list or [])

    def scatter(  # type: ignore[override]
        self, outputs: list[Tensor], input_lists: list[list[Tensor]], opts: Any = None
    ) -> _TorchWork:
        root = 0 if opts is None else int(opts.rootRank)
        scatter_list = list(input_lists[0]) if input_lists else None
        tensor = _single(outputs, "scatter")
        return self._work([self._fake.scatter(tensor, scatter_list, root)], [tensor])

    def send(self, tensors: list[Tensor], dst: int, tag: int = 0) -> _TorchWork:
        return self._work([self._fake.send(list(tensors), dst, tag)], list(tensors))

    def recv(self, tensors: list[Tensor], src: int, tag: int = 0) -> _TorchWork:
        return self._work([self._fake.recv(list(tensors), src, tag)], list(tensors))

    def recv_anysource(self, tensors: list[Tensor], tag: int = 0) -> _TorchWork:
        raise RuntimeError(
            f"recv from any source on the '{_BACKEND}' backend (rank {self._fake.rank()}): "
            "which send it matches would depend on thread timing, and the fake world is "
            "deterministic; pass src"
        )

    def barrier(self, opts: Any = None) -> _TorchWork:
        return self._work([self._fake.barrier()], [])

    def monitored_barrier(
        self, timeout: timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """A barrier whose timeout names every rank that did not arrive."""
        seconds = None if timeout is None else timeout.total_seconds()
        self._fake.monitored_barrier(seconds, wait_all_ranks)

    def _work(self, works: list[Work], outputs: list[Tensor]) -> _TorchWork:
        return _TorchWork(works, outputs, self._fake.world.timeout)

    def __repr__(self) -> str:
        return f"<fakepg torch group rank={self._fake.rank()} size={self._fake.size()}>"


def _single(tensors: Sequence[Tensor], what: str) -> Tensor:
    if len(tensors) != 1:
        raise ValueError(
            f"{what} on the '{_BACKEND}' backend takes one tensor per rank, got {len(tensors)}"
        )
    return tensors[0]


def _reduce_op(opts: Any, what: str) -> ReduceOp:
    if opts is None:
        return ReduceOp.SUM
    op = _OPS.get(opts.reduceOp.op)
    if op is None:
        raise ValueError(
            f"{what} on the '{_BACKEND}' torch backend: reduce op {opts.reduceOp.op} is not "
            "supported; use SUM, AVG, PRODUCT, MIN or MAX (for PREMUL_SUM, multiply first)"
        )
    return op


class _TorchWork(dist.Work):
    """A torch Work over one or more fake works: complete when all of them are."""

    def __init__(self, works: Sequence[Work], outputs: list[Tensor], timeout: float) -> None:
        super().__init__()
        self._works = list(works)
        self._timeout = timeout  # the world's default, for waits without a timeout
        self._outputs = outputs
        self._future: torch.futures.Future[list[Tensor]] | None = None
        self._future_done = threading.Event()
        # _lock guards _future: torch may ask for the future from several threads.
        self._lock = threading.Lock()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        # torch's "no timeout" is zero: then the world's default timeout bounds the wait.
        seconds = timeout.total_seconds()
        limit = seconds if seconds > 0 else None
        for work in self._works:
            work.wait(limit)
        with self._lock:
            future = self._future
        if future is not None:
            # The future completes in the fake world's done-callbacks, just after the works'
            # Events are set: after wait() returns, the future must be done too.
            bound = self._timeout if limit is None else limit
            if not self._future_done.wait(bound):
                raise RuntimeError(
                    f"fakepg torch backend: the collective completed but its future did not "
                    f"within {bound:g} s (a done-callback of it is blocked)"
                )
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)

    def is_success(self) -> bool:
        return all(work.is_success() for work in self._works)

    def result(self) -> list[Tensor]:
        return list(self._outputs)

    def get_future(self) -> torch.futures.Future[list[Tensor]]:
        """Completes with the output tensors (or the first error) when every part is done."""
        with self._lock:
            if self._future is None:
                self._future = self._make_future()
                self._future.add_done_callback(lambda _f: self._future_done.set())
            return self._future

    def _make_future(self) -> torch.futures.Future[list[Tensor]]:
        # See Note [Errors in torch futures]: the error must be raised in a callback.
        if len(self._works) == 1:
            return self._works[0].get_future().then(_value_or_raise)
        outputs = self._outputs

        def unpack(
            all_done: torch.futures.Future[list[torch.futures.Future[list[Tensor]]]],
        ) -> list[Tensor]:
            for part in all_done.value():
                part.value()  # raises the first part's error
            return outputs

        parts = [work.get_future() for work in self._works]
        return torch.futures.collect_all(parts).then(unpack)


def _value_or_raise(done: torch.futures.Future[list[Tensor]]) -> list[Tensor]:
    return done.value()


# -------------------------------------------------------------------------------------------
# Per-thread torch.distributed state. See Note [Per-thread torch.distributed state].


class _ThreadWorld(_c10d._World):
    """torch's group state for one thread: torch's ``_World`` keeps some of it in module
    globals shared by every instance, so those properties are given storage of their own."""

    def __init__(self) -> None:
        super().__init__()
        self._own_pg_map: dict[Any, Any] = {}
        self._own_pg_names: dict[Any, Any] = {}
        self._own_pg_group_ranks: dict[Any, dict[int, int]] = {}
        self._own_pg_backend_config: dict[Any, str] = {}
        self._own_group_count = 0
        self._own_tags_to_pg: dict[str, list[Any]] = {}
        self._own_pg_to_tag: dict[Any, str] = {}

    @property
    def pg_map(self) -> dict[Any, Any]:
        return self._own_pg_map

    @property
    def pg_names(self) -> dict[Any, Any]:
        return self._own_pg_names

    @property
    def pg_group_ranks(self) -> dict[Any, dict[int, int]]:
        return self._own_pg_group_ranks

    @property
    def pg_backend_config(self) -> dict[Any, str]:
        return self._own_pg_backend_config

    @property
    def group_count(self) -> int:
        return self._own_group_count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._own_group_count = value

    @property
    def tags_to_pg(self) -> dict[str, list[Any]]:
        return self._own_tags_to_pg

    @property
    def pg_to_tag(self) -> dict[Any, str]:
        return self._own_pg_to_tag


class _PerThreadWorlds:
    """Stands in for ``distributed_c10d._world``: every attribute is the calling thread's."""

    def __init__(self, original: Any) -> None:
        object.__setattr__(self, "_original", original)
        object.__setattr__(self, "_owner", threading.get_ident())
        object.__setattr__(self, "_local", threading.local())

    def _current(self) -> Any:
        if threading.get_ident() == self._owner:
            return self._original
        world = getattr(self._local, "world", None)
        if world is None:
            world = self._local.world = _ThreadWorld()
        return world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._current(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._current(), name, value)


def _install_per_thread_worlds() -> None:
    """Make torch.distributed's group state per thread, once (later calls do nothing).

    Private torch APIs, unavoidably: torch has no public switch for per-thread groups.
    ``distributed_c10d._world`` is documented as an "extension point to override"; the thread
    isolation mode and the registry functions are what torch's own threaded test backend uses.
    """
    original = _c10d._world
    if isinstance(original, _PerThreadWorlds):
        return
    _c10d._world = _PerThreadWorlds(original)  # type: ignore[assignment]  # a duck-typed _World
    c10d_ext: Any = torch._C._distributed_c10d
    c10d_ext._set_thread_isolation_mode(True)
    # Groups that exist were registered process-wide; isolation hides them even from the thread
    # that made them, so register them again in this (the owner) thread's registry.
    for group, name in list(original.pg_names.items()):
        c10d_ext._register_process_group(name, group)


# -------------------------------------------------------------------------------------------
# dist.monitored_barrier for fakepg groups. See Note [How torch collectives map to the fake
# world].

_torch_monitored_barrier = dist.monitored_barrier


def _monitored_barrier(
    group: Any = None, timeout: timedelta | None = None, wait_all_ranks: bool = False
) -> None:
    """``dist.monitored_barrier``: a fakepg group's own, torch's for any other group."""
    pg = group if group is not None else _c10d._get_default_group()
    if isinstance(pg, _TorchGroup):
        pg.monitored_barrier(timeout, wait_all_ranks)
        return
    _torch_monitored_barrier(group, timeout, wait_all_ranks)


def _install_monitored_barrier() -> None:
    """Let ``dist.monitored_barrier`` reach fakepg groups, once.

    torch checks the backend name ("gloo" only) in Python before it calls the group, so the
    public function is wrapped: groups of other backends still go to torch's own.
    """
    if dist.monitored_barrier is not _monitored_barrier:
        dist.monitored_barrier = _monitored_barrier
        _c10d.monitored_barrier = _monitored_barrier
