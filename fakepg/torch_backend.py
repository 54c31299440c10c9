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
# fakepg.world), so batch_isend_irecv works as torch runs it, one op at a time (registering the
# backend wraps it: see _install_batch_isend_irecv). A receive from any source is refused (its
# match would depend on thread timing). torch's Python-side ``dist.monitored_barrier`` accepts
# only gloo groups; registering the backend lets it call a fakepg group's own monitored_barrier
# (see _install_monitored_barrier). The works are completed, and their futures' callbacks run,
# on each rank's own completion thread (see Note [Completion lanes] in fakepg.completion).

# Note [The bindings' argument forms]
# torch's C++ bindings give each collective of a ProcessGroup two forms: the one torch's
# dispatcher calls, with tensor lists and an options object (``allreduce([t], opts)``), and
# convenience overloads that take one tensor and plain arguments (``allreduce(t, op,
# timeout)``, ``broadcast(t, root)``, ``reduce(t, root, op)``, ``allgather(outputs, t)``,
# ``gather(outputs, t, root)``, ``scatter(t, inputs, root)``, ``reduce_scatter(t, inputs,
# op)``, ``barrier(timeout)``), which wrap the tensor in a list and fill in the options. On a
# C++ group pybind picks the overload; a Python backend *is* the group, so Python code that
# calls it directly reaches the Python method in either form: torch's DDP calls
# ``process_group.allreduce(local_used_map)`` with a bare tensor on a rank that has joined
# (``_match_unused_params_allreduce``). So each method takes both forms and converts the
# convenience one as the bindings do (a tensor becomes a list of it; an op, a root or a
# timeout fills in the options); anything else is a TypeError naming the argument. A timeout
# (the convenience argument, or a set ``opts.timeout``) bounds the waits of that work.

# Note [Works that C++ keeps]
# A work of this backend is a Python subclass of ``dist.Work``. torch's C++ side reaches only
# its ``wait`` and ``get_future``, and only while its Python object lives (pybind's trampoline
# finds the override through it); ``result()`` is never reached (the C++ base raises). torch's
# DDP under ``join(divide_by_initial_world_size=False)`` hands the work of Join's notifying
# all_reduce to its C++ reducer, which keeps it past the Python object's life and later calls
# ``wait()`` and ``result()`` to learn how many ranks still train: the base ``wait`` waits
# for nothing that ever happens (a hang). So that handoff gets a C++ Work made from the work's
# future (``_create_work_from_future``: ``result()`` reads the future's value, ``wait()``
# waits for it, bounded by the world's watchdog).

# Note [Subgroups through torch]
# ``dist.new_group`` and DeviceMesh create a group per call on every rank thread, each with the
# name torch computes alike on every rank (a counter of the thread's own group state); the
# backend maps the name and members to one subgroup of the default group's world (see Note
# [Subgroups] in fakepg.world), found through the thread that created the default group. A
# Python backend is the ProcessGroup itself (torch registers no Backend object under it), so
# torch's C++ getter of the group name has nowhere to read it from: the group answers
# ``group_name`` itself, which is what DeviceMesh and FSDP ask.

# Note [The CUDA device guard on rank threads]
# On a CUDA build of torch without a usable GPU, entering a FakeTensorMode (DTensor does, to
# propagate shapes, so FSDP2 does on every rank) calls torch._C._ensureCUDADeviceGuardSet. When
# the registered CUDA device guard reports no device, that replaces the process-wide guard with
# a stand-in owned by the calling thread (a C++ thread_local). Once that thread ends, the
# process-wide guard points at freed memory, and the next thread to enter a FakeTensorMode
# crashes the process: torch 2.11's CUDA build segfaults in the second FSDP2 world of a test
# process. register_torch_backend therefore installs the stand-in once on a thread that lives
# as long as the process: the main thread, or else a daemon thread kept for it. Later calls
# find a guard that reports devices and leave it alone. Where a GPU is usable, or torch has no
# such call, nothing is done.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d as _c10d

from reducer.process_group import ReduceOp

from . import _homes, _threads
from .netmodel import NetworkModel
from .schedule import Schedule, wait_event
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
        _keep_the_cuda_device_guard()
        _install_per_thread_worlds()
        _install_monitored_barrier()
        _install_batch_isend_irecv()
        _install_forward_pass_work_handle()
        _threads.after_each_job(_reset_thread_groups)
        if not hasattr(dist.Backend, _BACKEND.upper()):
            dist.Backend.register_backend(
                _BACKEND, _create_backend, extended_api=True, devices=["cpu", "cuda"]
            )


# The daemon thread that owns the CUDA device guard's stand-in, once one was needed. Guarded by
# _PROCESS_LOCK. See Note [The CUDA device guard on rank threads].
_guard_keeper: threading.Thread | None = None


def _keep_the_cuda_device_guard() -> None:
    """Install torch's no-GPU stand-in for the CUDA device guard on a thread that outlives the
    rank threads. See Note [The CUDA device guard on rank threads]. Call with _PROCESS_LOCK."""
    global _guard_keeper
    # A private torch call, in this one place: the one FakeTensorMode makes.
    ensure = getattr(torch._C, "_ensureCUDADeviceGuardSet", None)
    if ensure is None or torch.cuda.is_available():
        return
    if threading.current_thread() is threading.main_thread():
        ensure()
    elif _guard_keeper is None:
        installed = threading.Event()

        def keep() -> None:
            try:
                ensure()
            finally:
                installed.set()
            threading.Event().wait()  # never set: the stand-in lives as long as this thread

        _guard_keeper = threading.Thread(target=keep, name="torch-cuda-device-guard", daemon=True)
        _guard_keeper.start()
        if not installed.wait(60.0):
            raise RuntimeError("fakepg: torch's CUDA device guard was not set up within 60 s")


def run_torch(
    fn: Callable[[FakeProcessGroup], T],
    world_size: int,
    *,
    timeout: float = 60.0,
    network: NetworkModel | None = None,
    per_rank_rng: bool = True,
    schedule: Schedule | None = None,
) -> list[T]:
    """Like :func:`fakepg.run`, with torch.distributed's default group on the fake world.

    Registers the backend, starts a world of ``world_size`` ranks, and on each rank's thread
    calls ``init_process_group("fakepg")``, then ``fn(pg)`` (``pg`` is the rank's
    FakeProcessGroup, on the same world as the torch group), then ``destroy_process_group``.
    Failures behave as in :func:`fakepg.run`: a failure anywhere aborts the world, every rank
    blocked in a collective (a torch one included) wakes, and the first failure is re-raised
    with a note naming its rank. Returns the results in rank order. ``schedule``: see
    :func:`fakepg.run`.
    """
    if not callable(fn):
        raise ValueError(f"run_torch: fn must be callable, got {fn!r}")
    register_torch_backend()
    with World(world_size, timeout=timeout, network=network, schedule=schedule) as world:
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

    # torch's dispatcher calls these with tensor lists and an options object; Python code that
    # holds the group may call them in the bindings' convenience forms too. See Note [The
    # bindings' argument forms]. The overrides ignore [override]: torch's stub lists the
    # overloads of the C++ bindings, which one Python method cannot spell.

    def allreduce(  # type: ignore[override]
        self, tensors: Any, opts: Any = None, timeout: Any = None, *, op: Any = None
    ) -> _TorchWork:
        what = "allreduce"
        seconds = _seconds(opts, timeout, what)
        tensors = _tensor_list(tensors, what, "tensors")
        reduce_op = _reduce_op(opts if op is None else op, what)
        work = self._fake.allreduce(tensors, reduce_op)
        return self._work([work], tensors, seconds)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> _TorchWork:
        what = "allreduce_coalesced"
        seconds = _seconds(opts, None, what)
        tensors = _tensor_list(tensors, what, "tensors", bare=False)
        op = _reduce_op(opts, what)
        works = [self._fake.allreduce([t], op) for t in tensors]
        return self._work(works, tensors, seconds)

    def reduce(  # type: ignore[override]
        self,
        tensors: Any,
        opts: Any = None,
        op: Any = None,
        timeout: Any = None,
        *,
        root: Any = None,
    ) -> _TorchWork:
        what = "reduce"
        seconds = _seconds(opts, timeout, what)
        tensors = _tensor_list(tensors, what, "tensors")
        root_rank = _root(opts if root is None else root, what)
        reduce_op = _reduce_op(_options_or_none(opts) if op is None else op, what)
        work = self._fake.reduce(tensors, root_rank, reduce_op)
        return self._work([work], tensors, seconds)

    def broadcast(  # type: ignore[override]
        self, tensors: Any, opts: Any = None, timeout: Any = None, *, root: Any = None
    ) -> _TorchWork:
        what = "broadcast"
        seconds = _seconds(opts, timeout, what)
        tensors = _tensor_list(tensors, what, "tensors")
        root_rank = _root(opts if root is None else root, what)
        work = self._fake.broadcast(tensors, root_rank)
        return self._work([work], tensors, seconds)

    def allgather(  # type: ignore[override]
        self, output_lists: Any, inputs: Any, opts: Any = None, timeout: Any = None
    ) -> _TorchWork:
        what = "allgather"
        seconds = _seconds(opts, timeout, what)
        if isinstance(inputs, Tensor):  # allgather(output_tensors, input_tensor)
            outputs = [_tensor_list(output_lists, what, "output_tensors", bare=False)]
            inputs = [inputs]
        else:
            outputs = _tensor_lists(output_lists, what, "output_tensors")
            inputs = _tensor_list(inputs, what, "input_tensors", bare=False)
        work = self._fake.allgather(outputs, inputs)
        flat = [t for out in outputs for t in out]
        return self._work([work], flat, seconds)

    def allgather_coalesced(self, output_lists: Any, inputs: Any, opts: Any = None) -> _TorchWork:
        return self.allgather(output_lists, inputs, opts)

    def all_gather_single(
        self, output: Tensor, input_tensor: Tensor, opts: Any = None
    ) -> _TorchWork:
        """all_gather_into_tensor: rank r's input lands in the r-th chunk of the output."""
        seconds = _seconds(opts, None, "all_gather_into_tensor")
        work = self._fake.allgather_into_tensor(output, input_tensor)
        return self._work([work], [output], seconds)

    def _allgather_base(self, output: Tensor, input_tensor: Tensor, opts: Any = None) -> _TorchWork:
        return self.all_gather_single(output, input_tensor, opts)

    def all_gather_single_coalesced(
        self, outputs: Any, inputs: Any, opts: Any = None
    ) -> _TorchWork:
        what = "allgather_into_tensor_coalesced"
        seconds = _seconds(opts, None, what)
        outputs = _tensor_list(outputs, what, "outputs", bare=False)
        inputs = _tensor_list(inputs, what, "inputs", bare=False)
        work = self._fake.allgather_into_tensor_coalesced(outputs, inputs)
        return self._work([work], outputs, seconds)

    def allgather_into_tensor_coalesced(
        self, outputs: Any, inputs: Any, opts: Any = None
    ) -> _TorchWork:
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    def reduce_scatter(  # type: ignore[override]
        self,
        outputs: Any,
        input_lists: Any,
        opts: Any = None,
        timeout: Any = None,
        *,
        op: Any = None,
    ) -> _TorchWork:
        what = "reduce_scatter"
        seconds = _seconds(opts, timeout, what)
        if isinstance(outputs, Tensor):  # reduce_scatter(output, input_list, op)
            output, inputs = outputs, _tensor_list(input_lists, what, "input_tensors", bare=False)
        else:
            outs = _tensor_list(outputs, what, "output_tensors", bare=False)
            lists = _tensor_lists(input_lists, what, "input_tensors")
            if len(outs) != 1 or len(lists) != 1:
                raise ValueError(
                    f"reduce_scatter on the '{_BACKEND}' backend takes one output and one "
                    f"input list, got {len(outs)} and {len(lists)}"
                )
            output, inputs = outs[0], lists[0]
        reduce_op = _reduce_op(opts if op is None else op, what)
        work = self._fake.reduce_scatter(output, inputs, reduce_op)
        return self._work([work], [output], seconds)

    def reduce_scatter_single(
        self, output: Tensor, input_tensor: Tensor, opts: Any = None
    ) -> _TorchWork:
        """reduce_scatter_tensor: rank r gets the reduction of every rank's r-th chunk."""
        what = "reduce_scatter_tensor"
        seconds = _seconds(opts, None, what)
        op = _reduce_op(opts, what)
        work = self._fake.reduce_scatter_tensor(output, input_tensor, op)
        return self._work([work], [output], seconds)

    def _reduce_scatter_base(
        self, output: Tensor, input_tensor: Tensor, opts: Any = None
    ) -> _TorchWork:
        return self.reduce_scatter_single(output, input_tensor, opts)

    def reduce_scatter_single_coalesced(
        self, outputs: Any, inputs: Any, opts: Any = None
    ) -> _TorchWork:
        what = "reduce_scatter_tensor_coalesced"
        seconds = _seconds(opts, None, what)
        outputs = _tensor_list(outputs, what, "outputs", bare=False)
        inputs = _tensor_list(inputs, what, "inputs", bare=False)
        op = _reduce_op(opts, what)
        work = self._fake.reduce_scatter_tensor_coalesced(outputs, inputs, op)
        return self._work([work], outputs, seconds)

    def reduce_scatter_tensor_coalesced(
        self, outputs: Any, inputs: Any, opts: Any = None
    ) -> _TorchWork:
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)

    def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> _TorchWork:
        what = "alltoall"
        seconds = _seconds(opts, None, what)
        outputs = _tensor_list(outputs, what, "output_tensors", bare=False)
        inputs = _tensor_list(inputs, what, "input_tensors", bare=False)
        work = self._fake.all_to_all(outputs, inputs)
        return self._work([work], outputs, seconds)

    def all_to_all_single(
        self,
        output: Tensor,
        input_tensor: Tensor,
        output_split_sizes: list[int] | None,
        input_split_sizes: list[int] | None,
        opts: Any = None,
    ) -> _TorchWork:
        seconds = _seconds(opts, None, "all_to_all_single")
        work = self._fake.all_to_all_single(
            output, input_tensor, output_split_sizes, input_split_sizes
        )
        return self._work([work], [output], seconds)

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

    def gather(
        self, output_lists: Any, inputs: Any, opts: Any = None, timeout: Any = None
    ) -> _TorchWork:
        what = "gather"
        seconds = _seconds(opts, timeout, what)
        if isinstance(inputs, Tensor):  # gather(output_tensors, input_tensor, root)
            outputs = [_tensor_list(output_lists, what, "output_tensors", bare=False)]
            tensor = inputs
        else:
            outputs = _tensor_lists(output_lists, what, "output_tensors")
            tensor = _single(_tensor_list(inputs, what, "input_tensors", bare=False), what)
        root = _root(opts, what)
        # Ranks other than the root pass no list (torch's gather) or an empty one (the
        # convenience form).
        gather_list = list(outputs[0]) if outputs and outputs[0] else None
        work = self._fake.gather(tensor, gather_list, root)
        return self._work([work], gather_list or [], seconds)

    def scatter(
        self, outputs: Any, input_lists: Any, opts: Any = None, timeout: Any = None
    ) -> _TorchWork:
        what = "scatter"
        seconds = _seconds(opts, timeout, what)
        if isinstance(outputs, Tensor):  # scatter(output_tensor, input_tensors, root)
            tensor = outputs
            lists = [_tensor_list(input_lists, what, "input_tensors", bare=False)]
        else:
            tensor = _single(_tensor_list(outputs, what, "output_tensors", bare=False), what)
            lists = _tensor_lists(input_lists, what, "input_tensors")
        root = _root(opts, what)
        scatter_list = list(lists[0]) if lists and lists[0] else None
        work = self._fake.scatter(tensor, scatter_list, root)
        return self._work([work], [tensor], seconds)

    def send(self, tensors: Any, dst: int, tag: int = 0) -> _TorchWork:
        tensors = _tensor_list(tensors, "send", "tensors", bare=False)
        return self._work([self._fake.send(tensors, dst, tag)], tensors)

    def recv(self, tensors: Any, src: int, tag: int = 0) -> _TorchWork:
        tensors = _tensor_list(tensors, "recv", "tensors", bare=False)
        return self._work([self._fake.recv(tensors, src, tag)], tensors)

    def recv_anysource(self, tensors: list[Tensor], tag: int = 0) -> _TorchWork:
        raise RuntimeError(
            f"recv from any source on the '{_BACKEND}' backend (rank {self._fake.rank()}): "
            "which send it matches would depend on thread timing, and the fake world is "
            "deterministic; pass src"
        )

    def barrier(self, opts: Any = None, timeout: Any = None) -> _TorchWork:  # type: ignore[override]
        seconds = _seconds(opts, timeout, "barrier")
        return self._work([self._fake.barrier()], [], seconds)

    def monitored_barrier(
        self, timeout: timedelta | None = None, wait_all_ranks: bool = False
    ) -> None:
        """A barrier whose timeout names every rank that did not arrive."""
        seconds = None if timeout is None else timeout.total_seconds()
        self._fake.monitored_barrier(seconds, wait_all_ranks)

    def _work(
        self, works: list[Work], outputs: list[Tensor], timeout: float | None = None
    ) -> _TorchWork:
        return _TorchWork(works, outputs, self._fake.world.timeout if timeout is None else timeout)

    def __repr__(self) -> str:
        return f"<fakepg torch group rank={self._fake.rank()} size={self._fake.size()}>"


# -------------------------------------------------------------------------------------------
# Arguments as torch's bindings take them. See Note [The bindings' argument forms].


def _kind(value: object) -> str:
    if isinstance(value, list | tuple):
        inner = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {', '.join(inner) or 'nothing'}"
    return type(value).__name__


def _tensor_list(value: object, what: str, name: str, *, bare: bool = True) -> list[Tensor]:
    """``value`` as a list of tensors; with ``bare``, one tensor stands for a list of it (as
    the bindings' convenience forms wrap it)."""
    if bare and isinstance(value, Tensor):
        return [value]
    if isinstance(value, list | tuple) and all(isinstance(t, Tensor) for t in value):
        return list(value)
    wanted = "a tensor or a list of tensors" if bare else "a list of tensors"
    raise TypeError(
        f"{what} on the '{_BACKEND}' backend: {name} must be {wanted}, got {_kind(value)}"
    )


def _tensor_lists(value: object, what: str, name: str) -> list[list[Tensor]]:
    if isinstance(value, list | tuple) and all(isinstance(v, list | tuple) for v in value):
        return [_tensor_list(v, what, f"each of {name}", bare=False) for v in value]
    raise TypeError(
        f"{what} on the '{_BACKEND}' backend: {name} must be a list of lists of tensors, got "
        f"{_kind(value)}"
    )


def _single(tensors: Sequence[Tensor], what: str) -> Tensor:
    if len(tensors) != 1:
        raise ValueError(
            f"{what} on the '{_BACKEND}' backend takes one tensor per rank, got {len(tensors)}"
        )
    return tensors[0]


def _options_or_none(opts: Any) -> Any:
    """``opts`` if it is an options object (it has ``timeout``), else None."""
    return opts if hasattr(opts, "timeout") else None


def _reduce_op(value: Any, what: str) -> ReduceOp:
    """The op of an options object, a ``dist.ReduceOp`` or one of its members; SUM for None."""
    if value is None:
        return ReduceOp.SUM
    red = getattr(value, "reduceOp", value)  # options -> its dist.ReduceOp
    red = getattr(red, "op", red)  # dist.ReduceOp -> its member
    op = _OPS.get(red) if isinstance(red, dist.ReduceOp.RedOpType) else None
    if op is None:
        raise ValueError(
            f"{what} on the '{_BACKEND}' torch backend: reduce op {red} is not supported; use "
            "SUM, AVG, PRODUCT, MIN or MAX (for PREMUL_SUM, multiply first)"
        )
    return op


def _root(value: Any, what: str) -> int:
    """The root of an options object, or a rank given as it is; 0 for None."""
    if value is None:
        return 0
    root = getattr(value, "rootRank", value)
    if isinstance(root, bool) or not isinstance(root, int):
        raise TypeError(
            f"{what} on the '{_BACKEND}' backend: the root must be a rank (an int) or an "
            f"options object, got {_kind(value)}"
        )
    return root


def _seconds(opts: Any, timeout: Any, what: str) -> float | None:
    """The timeout of this collective in seconds: ``timeout`` (the convenience argument; a
    timedelta passed where the options go counts too), else a set ``opts.timeout``; None for
    the world's."""
    if timeout is None:
        timeout = opts if isinstance(opts, timedelta) else getattr(opts, "timeout", None)
    if timeout is None:
        return None
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"{what} on the '{_BACKEND}' backend: timeout must be a datetime.timedelta, got "
            f"{_kind(timeout)}"
        )
    seconds = timeout.total_seconds()
    return seconds if seconds > 0 else None  # torch's unset timeout is negative


class _TorchWork(dist.Work):
    """A torch Work over one or more fake works: complete when all of them are."""

    def __init__(self, works: Sequence[Work], outputs: list[Tensor], timeout: float) -> None:
        super().__init__()
        self._works = list(works)
        self._timeout = timeout  # the collective's timeout, for waits without one
        self._outputs = outputs
        self._future: torch.futures.Future[list[Tensor]] | None = None
        self._future_done = threading.Event()
        # _lock guards _future: torch may ask for the future from several threads.
        self._lock = threading.Lock()

    def wait(self, timeout: timedelta = timedelta(0)) -> bool:
        # torch's "no timeout" is zero: then the collective's timeout bounds the wait.
        seconds = timeout.total_seconds()
        limit = seconds if seconds > 0 else self._timeout
        for work in self._works:
            work.wait(limit)
        with self._lock:
            future = self._future
        # The future completes on this rank's completion thread once the works are done (see
        # Note [Completion lanes] in fakepg.completion): after wait() returns, it must be too.
        if future is not None and not wait_event(self._future_done, limit, "a torch future"):
            raise RuntimeError(
                f"fakepg torch backend: the collective completed but its future did not "
                f"within {limit:g} s (a done-callback before it on this rank is blocked)"
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

    def as_cpp_work(self) -> dist.Work:
        """This work as a C++ Work, for C++ code that keeps it. See Note [Works that C++
        keeps]."""
        # torch's documented way for Python backends to build a C++ Work; private by name.
        c10d_ext: Any = torch._C._distributed_c10d
        create = c10d_ext._create_work_from_future
        work: dist.Work = create(self.get_future())
        return work


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
        object.__setattr__(self, "_owner", _owner_of_the_original())
        object.__setattr__(self, "_local", threading.local())
        # Thread ident -> the state that thread made (a dict's item operations are atomic).
        object.__setattr__(self, "_by_thread", {})

    def _current(self) -> Any:
        # A state lent to this thread comes first, even on the owner's thread: a thread kept
        # between worlds (fakepg._threads) may be the one that installed this proxy, and
        # later run a rank's callbacks (see :meth:`lent`).
        lent = getattr(self._local, "lent", None)
        if lent is not None:
            return lent
        if threading.current_thread() is self._owner:
            return self._original
        world = getattr(self._local, "world", None)
        if world is None:
            world = self._local.world = _ThreadWorld()
            # Found by the threads that run this thread's callbacks; a later thread with the
            # same ident replaces it (see Note [Callbacks run in their rank] in fakepg._homes).
            self._by_thread[threading.get_ident()] = world
        return world

    def __getattr__(self, name: str) -> Any:
        return getattr(self._current(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._current(), name, value)

    def state_of(self, ident: int) -> Any:
        """The state of the thread ``ident``, if it has made one."""
        return self._by_thread.get(ident)

    @contextmanager
    def lent(self, state: Any) -> Iterator[None]:
        """The calling thread uses ``state`` (another thread's) until the block ends."""
        local = self._local
        previous = getattr(local, "lent", None)
        local.lent = state
        try:
            yield
        finally:
            local.lent = previous


def _owner_of_the_original() -> threading.Thread:
    """The thread that keeps the process's original torch.distributed state: the installing
    thread, known by its object (a thread ident is reused once its thread has ended, and a
    later thread with it must not inherit the original state). When the installer is a
    thread kept between worlds (a rank's, whose ``init_torch_group`` came first), the main
    thread keeps it instead: the cached thread runs later jobs, of other worlds, whose state
    must start empty after each (``_reset_thread_groups``), not carry the first job's groups."""
    if isinstance(_threads.current(), _threads.Job):
        return threading.main_thread()
    return threading.current_thread()


def _reset_thread_groups() -> None:
    """On a cached thread after a job: the thread's torch.distributed state as a new thread's
    (a default group its job left behind destroyed, the group counter from zero), so that the
    group names torch computes on every rank of the next world agree. See Note [Thread-local
    state of cached threads] in fakepg._threads."""
    worlds = _c10d._world
    if not isinstance(worlds, _PerThreadWorlds) or threading.current_thread() is worlds._owner:
        return
    mine = getattr(worlds._local, "world", None)
    if mine is not None and mine.pg_map:
        with contextlib.suppress(Exception):  # a half-initialized group: dropped below anyway
            dist.destroy_process_group()
    worlds._local.world = None
    _thread_default.world = None


def _lend_torch_state() -> Callable[[], AbstractContextManager[None]] | None:
    """On a rank's thread: lends its torch.distributed state to the threads that run its
    callbacks (see Note [Callbacks run in their rank] in fakepg._homes). The state is found
    when lent: the backend may be registered, and the state made, after the rank started
    (a script's own init_process_group under launch)."""
    ident = threading.get_ident()
    me = threading.current_thread()

    def lend() -> AbstractContextManager[None]:
        proxy = _c10d._world
        if isinstance(proxy, _PerThreadWorlds):
            # The thread that registered the backend (a rank's own, under launch) keeps the
            # process's original state.
            state = proxy._original if me is proxy._owner else proxy.state_of(ident)
            if state is not None:
                return proxy.lent(state)
        return contextlib.nullcontext()

    return lend


_homes.register(_lend_torch_state)


def _install_per_thread_worlds() -> None:
    """Make torch.distributed's group state per thread, once (later calls do nothing).

    Private torch APIs, unavoidably: torch has no public switch for per-thread groups.
    ``distributed_c10d._world`` is documented as an "extension point to override"; the thread
    isolation mode and the registry functions are what torch's own threaded test backend uses.
    """
    original = _c10d._world
    if isinstance(original, _PerThreadWorlds):
        return
    proxy = _PerThreadWorlds(original)
    _c10d._world = proxy  # type: ignore[assignment]  # a duck-typed _World
    c10d_ext: Any = torch._C._distributed_c10d
    c10d_ext._set_thread_isolation_mode(True)
    # Groups that exist were registered process-wide; isolation hides them even from the thread
    # that made them, so register them again in this (the owner) thread's registry. (Installed
    # from a cached thread, the owner is the main thread, whose registry this thread cannot
    # reach: the groups stay in the original state, found by name from Python only.)
    if threading.current_thread() is proxy._owner:
        for group, name in list(original.pg_names.items()):
            c10d_ext._register_process_group(name, group)


# -------------------------------------------------------------------------------------------
# dist.monitored_barrier and dist.batch_isend_irecv for fakepg groups. See Note [How torch
# collectives map to the fake world].

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


_torch_batch_isend_irecv = dist.batch_isend_irecv


def _batch_isend_irecv(p2p_op_list: Any) -> list[Any]:
    """``dist.batch_isend_irecv``: one op at a time on a fakepg group, as torch runs it for a
    backend that does not coalesce; torch's own for any other group, and for anything it
    should refuse (an empty list, ops that are not P2POp or name different groups)."""
    ops = p2p_op_list if isinstance(p2p_op_list, list) else []
    group = getattr(ops[0], "group", None) if ops else None
    if (
        not ops
        or not all(isinstance(op, dist.P2POp) and op.group is group for op in ops)
        or not isinstance(group if group is not None else _c10d._get_default_group(), _TorchGroup)
    ):
        return _torch_batch_isend_irecv(p2p_op_list)
    works = []
    for op in ops:
        peer = {"group_dst" if op.op is dist.isend else "group_src": op.group_peer}
        work = op.op(op.tensor, group=op.group, tag=op.tag, **peer)
        if work is not None:
            works.append(work)
    return works


def _install_batch_isend_irecv() -> None:
    """Let ``dist.batch_isend_irecv`` run on fakepg groups, once.

    torch 2.14 calls ``group._get_backend(device)`` for any ProcessGroup to learn whether it
    coalesces; a Python backend is the group itself, with no backend object to return, so the
    call raises. The public function is wrapped: groups of other backends go to torch's own.
    """
    if dist.batch_isend_irecv is not _batch_isend_irecv:
        dist.batch_isend_irecv = _batch_isend_irecv
        _c10d.batch_isend_irecv = _batch_isend_irecv


# -------------------------------------------------------------------------------------------
# The forward pass's work, kept by torch's C++ reducer. See Note [Works that C++ keeps].

_Reducer: Any = torch._C._distributed_c10d.Reducer
_torch_set_forward_pass_work_handle = _Reducer._set_forward_pass_work_handle


def _set_forward_pass_work_handle(reducer: Any, work: Any, use_static_world_size: bool) -> None:
    """torch's ``Reducer._set_forward_pass_work_handle``, given a C++ Work for a fakepg one."""
    if isinstance(work, _TorchWork):
        work = work.as_cpp_work()
    _torch_set_forward_pass_work_handle(reducer, work, use_static_world_size)


def _install_forward_pass_work_handle() -> None:
    """Hand torch's C++ reducer fakepg works it can keep, once.

    A private torch API, unavoidably: the C++ reducer's method is where torch's DDP (under
    ``join(divide_by_initial_world_size=False)``) gives C++ a work issued from Python, and
    nothing public lets a Python work serve C++ ``result()``.
    """
    if _Reducer._set_forward_pass_work_handle is not _set_forward_pass_work_handle:
        _Reducer._set_forward_pass_work_handle = _set_forward_pass_work_handle
