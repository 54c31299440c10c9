"""What one rank calls: :class:`FakeProcessGroup`, its view of a group of a fake world.

Each collective checks its arguments on the calling rank (shared rules:
``reducer.collectives``), builds the fingerprint that every rank must agree on, and a
plan: the kernel tasks (see :mod:`fakepg.collectives`) that move the data once every rank has
joined. Roots and peers are ranks of this group; world ranks appear only in errors.

# Guarantees: a FakeProcessGroup is meant for its rank's threads; every method is thread-safe
# (the world serializes issuing).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from reducer import collectives as _args
from reducer.process_group import ReduceOp

from . import collectives as _c
from .work import Channel, Work

if TYPE_CHECKING:
    from .executor import Executor

__all__ = ["FakeProcessGroup"]

_Spec = _args.TensorSpec


class WorldView(Protocol):
    """What a group view uses of its world; :class:`fakepg.World` is the one implementation.
    A protocol, not an import: the world imports this module to build the views."""

    @property
    def timeout(self) -> float: ...

    @property
    def world_size(self) -> int: ...

    @property
    def executor(self) -> Executor: ...

    def _new_group(
        self, parent: Channel, rank: int, ranks: tuple[int, ...]
    ) -> FakeProcessGroup | None: ...

    def _p2p_channel(self, group: Channel, src: int, dst: int, tag: int) -> Channel: ...

    def _issue(
        self,
        channel: Channel,
        rank: int,
        fingerprint: _c.Fingerprint,
        payload: Any,
        outputs: list[Tensor],
        plan: Callable[[list[Any]], list[_c.Task]],
        nbytes: int,
        net_kind: str,
    ) -> Work: ...


class FakeProcessGroup:
    """Rank ``rank``'s view of a group of a :class:`World` (the whole world, or a subgroup
    from :meth:`new_group`); implements ``reducer.ProcessGroup``."""

    def __init__(self, world: WorldView, channel: Channel, global_rank: int) -> None:
        self._world = world
        self._channel = channel
        self._global_rank = global_rank
        self._rank = channel.members.index(global_rank)

    @property
    def world(self) -> WorldView:
        """The :class:`fakepg.World` this group belongs to (typed by what groups use of it)."""
        return self._world

    @property
    def global_rank(self) -> int:
        """This rank in the world (equal to ``rank()`` on the world's own groups)."""
        return self._global_rank

    @property
    def group_ranks(self) -> tuple[int, ...]:
        """The world ranks of this group, in group-rank order."""
        return self._channel.members

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return len(self._channel.members)

    def new_group(self, ranks: Sequence[int]) -> FakeProcessGroup | None:
        """A subgroup of ``ranks`` (ranks of this group), with its own sequence numbers.

        Every rank of this group calls it with the same ranks, in the same order, as with
        ``torch.distributed.new_group``; it returns this rank's view of the subgroup, or None
        where this rank is not a member. See Note [Subgroups] in fakepg.world.
        """
        size = self.size()
        raw: object = ranks
        if isinstance(raw, str) or not isinstance(raw, Sequence) or not raw:
            raise ValueError(f"new_group: ranks must be a non-empty list of ranks, got {ranks!r}")
        for r in ranks:
            _args.check_rank(r, size, "new_group", "each of ranks", _c.RULES)
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"new_group: ranks {list(ranks)} name a rank twice")
        members = tuple(self._channel.members[r] for r in sorted(ranks))
        return self._world._new_group(self._channel, self._global_rank, members)

    # ---------------------------------------------------------------------------------------
    # The collectives of reducer.ProcessGroup.

    def allreduce(self, tensors: list[Tensor], op: ReduceOp = ReduceOp.SUM) -> Work:
        """Reduce in place; see Note [Deterministic reduction order] in fakepg.collectives."""
        tensors = _args.check_allreduce(tensors, op, _c.RULES)
        fingerprint = _c.Fingerprint("allreduce", op, None, _specs(tensors))
        sparse = tensors[0].is_sparse
        max_parts = self._max_parts()

        def plan(per_rank: list[list[Tensor]]) -> list[_c.Task]:
            contributions = [t for ts in per_rank for t in ts]
            if sparse:
                return _c.sparse_allreduce_tasks(contributions, op)
            return _c.dense_allreduce_tasks(contributions, op, max_parts)

        kind = "sparse_allreduce" if sparse else "allreduce"
        return self._issue(fingerprint, tensors, tensors, plan, _nbytes(tensors), kind)

    def allgather(self, output_lists: list[list[Tensor]], inputs: list[Tensor]) -> Work:
        outputs, inputs = _args.check_allgather(output_lists, inputs, self.size(), _c.RULES)
        fingerprint = _c.Fingerprint("allgather", None, None, _specs(inputs))

        def plan(per_rank: list[tuple[list[list[Tensor]], list[Tensor]]]) -> list[_c.Task]:
            return _c.allgather_tasks([o for o, _ in per_rank], [i for _, i in per_rank])

        flat_outputs = [t for out in outputs for t in out]
        payload = (outputs, inputs)
        return self._issue(fingerprint, payload, flat_outputs, plan, _nbytes(inputs), "allgather")

    def broadcast(self, tensors: list[Tensor], root: int) -> Work:
        tensors = _args.check_tensor_list(tensors, "broadcast", _c.RULES)
        root = _args.check_rank(root, self.size(), "broadcast", "root", _c.RULES)
        fingerprint = _c.Fingerprint("broadcast", None, root, _specs(tensors))
        max_parts = self._max_parts()

        def plan(per_rank: list[list[Tensor]]) -> list[_c.Task]:
            return _c.batched(_c.broadcast_tasks(per_rank, root, max_parts), max_parts)

        return self._issue(fingerprint, tensors, tensors, plan, _nbytes(tensors), "broadcast")

    def barrier(self) -> Work:
        return self._issue(_c.Fingerprint("barrier"), None, [], lambda _: [], 0, "barrier")

    # ---------------------------------------------------------------------------------------
    # The rest of torch.distributed's collectives. Reductions add in ascending group rank,
    # as allreduce does; every output is written by the world's workers.

    def reduce(self, tensors: list[Tensor], root: int, op: ReduceOp = ReduceOp.SUM) -> Work:
        """The reduction of every rank's ``tensors`` (replicas, as in allreduce) into the
        root's; other ranks' tensors are left as they were."""
        tensors, root = _args.check_reduce(tensors, root, op, self.size(), _c.RULES)
        fingerprint = _c.Fingerprint("reduce", op, root, _specs(tensors))
        max_parts = self._max_parts()

        def plan(per_rank: list[list[Tensor]]) -> list[_c.Task]:
            return _c.reduce_tasks(per_rank, root, op, max_parts)

        return self._issue(fingerprint, tensors, tensors, plan, _nbytes(tensors), "reduce")

    def reduce_scatter(
        self, output: Tensor, inputs: list[Tensor], op: ReduceOp = ReduceOp.SUM
    ) -> Work:
        """``output`` on rank r = the reduction over ranks s of rank s's ``inputs[r]``."""
        output, inputs = _args.check_reduce_scatter(output, inputs, op, self.size(), _c.RULES)
        fingerprint = _c.Fingerprint("reduce_scatter", op, None, _specs(inputs))
        max_parts = self._max_parts()

        def plan(per_rank: list[tuple[Tensor, list[Tensor]]]) -> list[_c.Task]:
            tasks = _c.reduce_scatter_tasks(
                [ins for _, ins in per_rank], [out for out, _ in per_rank], op, max_parts
            )
            return _c.batched(tasks, max_parts)

        payload = (output, inputs)
        nbytes = _nbytes(inputs)
        return self._issue(fingerprint, payload, [output], plan, nbytes, "reduce_scatter")

    def reduce_scatter_tensor(
        self, output: Tensor, input_tensor: Tensor, op: ReduceOp = ReduceOp.SUM
    ) -> Work:
        """``output`` on rank r = the reduction over ranks of the r-th of ``size()`` equal flat
        chunks of their ``input_tensor``."""
        what = "reduce_scatter_tensor"
        _args.check_reduce_scatter_tensor(output, input_tensor, op, self.size(), _c.RULES, what)
        return self._reduce_scatter_tensors(what, [output], [input_tensor], op)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[Tensor], inputs: list[Tensor], op: ReduceOp = ReduceOp.SUM
    ) -> Work:
        """Several reduce_scatter_tensor pairs as one collective (one sequence number)."""
        what = "reduce_scatter_tensor_coalesced"
        outputs, inputs = _args.check_coalesced(outputs, inputs, what, _c.RULES)
        for out, inp in zip(outputs, inputs, strict=True):
            _args.check_reduce_scatter_tensor(out, inp, op, self.size(), _c.RULES, what)
        return self._reduce_scatter_tensors(what, outputs, inputs, op)

    def _reduce_scatter_tensors(
        self, what: str, outputs: list[Tensor], inputs: list[Tensor], op: ReduceOp
    ) -> Work:
        size = self.size()
        specs = _specs([*outputs, *inputs])
        fingerprint = _c.Fingerprint(what, op, None, specs)
        max_parts = self._max_parts()

        def plan(per_rank: list[tuple[list[Tensor], list[Tensor]]]) -> list[_c.Task]:
            tasks: list[_c.Task] = []
            for i in range(len(outputs)):
                chunks = [_c.flat_chunks(ins[i], size) for _, ins in per_rank]
                outs = [outs[i] for outs, _ in per_rank]
                tasks += _c.reduce_scatter_tasks(chunks, outs, op, max_parts)
            return _c.batched(tasks, max_parts)

        payload = (outputs, inputs)
        nbytes = _nbytes(inputs)
        return self._issue(fingerprint, payload, outputs, plan, nbytes, "reduce_scatter")

    def all_to_all(self, outputs: list[Tensor], inputs: list[Tensor]) -> Work:
        """``outputs[s]`` on rank r = rank s's ``inputs[r]`` (shapes may differ per pair)."""
        outputs, inputs = _args.check_all_to_all(outputs, inputs, self.size(), _c.RULES)
        # Only the dtype (and device) must agree: shapes are matched per pair by the plan.
        fingerprint = _c.Fingerprint("all_to_all", None, None, (_shapeless(inputs[0]),))

        max_parts = self._max_parts()

        def plan(per_rank: list[tuple[list[Tensor], list[Tensor]]]) -> list[_c.Task]:
            tasks = _c.all_to_all_tasks([o for o, _ in per_rank], [i for _, i in per_rank])
            return _c.batched(tasks, max_parts)

        payload = (outputs, inputs)
        return self._issue(fingerprint, payload, outputs, plan, _nbytes(inputs), "all_to_all")

    def all_to_all_single(
        self,
        output: Tensor,
        input_tensor: Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> Work:
        """Rows (dim 0) of ``input_tensor``, split by ``input_split_sizes`` (None: equal
        parts), go to the ranks in order; ``output`` receives one part per source rank, split
        by ``output_split_sizes``. Rank s's split for r must equal rank r's split for s."""
        output, input_tensor, out_splits, in_splits = _args.check_all_to_all_single(
            output, input_tensor, output_split_sizes, input_split_sizes, self.size(), _c.RULES
        )
        trailing = _args.TensorSpec(
            input_tensor.dtype, (-1, *input_tensor.shape[1:]), torch.strided, input_tensor.device
        )
        fingerprint = _c.Fingerprint("all_to_all_single", None, None, (trailing,))

        max_parts = self._max_parts()

        def plan(per_rank: list[tuple[Tensor, Tensor, list[int], list[int]]]) -> list[_c.Task]:
            tasks = _c.all_to_all_single_tasks(
                [p[0] for p in per_rank],
                [p[1] for p in per_rank],
                [p[2] for p in per_rank],
                [p[3] for p in per_rank],
            )
            return _c.batched(tasks, max_parts)

        payload = (output, input_tensor, out_splits, in_splits)
        nbytes = _nbytes([input_tensor])
        return self._issue(fingerprint, payload, [output], plan, nbytes, "all_to_all")

    def gather(self, tensor: Tensor, gather_list: list[Tensor] | None, root: int) -> Work:
        """Every rank's ``tensor`` into the root's ``gather_list`` (one per rank, in rank
        order); the other ranks pass ``gather_list=None``."""
        tensor, outputs, root = _args.check_gather(
            tensor, gather_list, root, self._rank, self.size(), _c.RULES
        )
        fingerprint = _c.Fingerprint("gather", None, root, (_Spec.of(tensor),))

        max_parts = self._max_parts()

        def plan(per_rank: list[tuple[Tensor, list[Tensor]]]) -> list[_c.Task]:
            tasks = _c.gather_tasks([t for t, _ in per_rank], per_rank[root][1])
            return _c.batched(tasks, max_parts)

        payload = (tensor, outputs)
        return self._issue(fingerprint, payload, outputs, plan, _nbytes([tensor]), "gather")

    def scatter(self, tensor: Tensor, scatter_list: list[Tensor] | None, root: int) -> Work:
        """The root's ``scatter_list[r]`` into rank r's ``tensor``; the other ranks pass
        ``scatter_list=None``."""
        tensor, inputs, root = _args.check_scatter(
            tensor, scatter_list, root, self._rank, self.size(), _c.RULES
        )
        fingerprint = _c.Fingerprint("scatter", None, root, (_Spec.of(tensor),))

        max_parts = self._max_parts()

        def plan(per_rank: list[tuple[Tensor, list[Tensor]]]) -> list[_c.Task]:
            tasks = _c.scatter_tasks(per_rank[root][1], [t for t, _ in per_rank])
            return _c.batched(tasks, max_parts)

        payload = (tensor, inputs)
        return self._issue(fingerprint, payload, [tensor], plan, _nbytes([tensor]), "scatter")

    def allgather_into_tensor(self, output: Tensor, input_tensor: Tensor) -> Work:
        """Rank r's ``input_tensor`` into the r-th of ``size()`` equal flat chunks of
        ``output``, on every rank."""
        what = "allgather_into_tensor"
        _args.check_allgather_into_tensor(output, input_tensor, self.size(), _c.RULES, what)
        return self._allgather_into_tensors(what, [output], [input_tensor])

    def allgather_into_tensor_coalesced(self, outputs: list[Tensor], inputs: list[Tensor]) -> Work:
        """Several allgather_into_tensor pairs as one collective (one sequence number)."""
        what = "allgather_into_tensor_coalesced"
        outputs, inputs = _args.check_coalesced(outputs, inputs, what, _c.RULES)
        for out, inp in zip(outputs, inputs, strict=True):
            _args.check_allgather_into_tensor(out, inp, self.size(), _c.RULES, what)
        return self._allgather_into_tensors(what, outputs, inputs)

    def _allgather_into_tensors(
        self, what: str, outputs: list[Tensor], inputs: list[Tensor]
    ) -> Work:
        fingerprint = _c.Fingerprint(what, None, None, _specs(inputs))

        max_parts = self._max_parts()

        def plan(per_rank: list[tuple[list[Tensor], list[Tensor]]]) -> list[_c.Task]:
            tasks = _c.allgather_into_tensor_tasks(
                [o for o, _ in per_rank], [i for _, i in per_rank], max_parts
            )
            return _c.batched(tasks, max_parts)

        payload = (outputs, inputs)
        return self._issue(fingerprint, payload, outputs, plan, _nbytes(inputs), "allgather")

    def send(self, tensors: list[Tensor], dst: int, tag: int = 0) -> Work:
        """Send ``tensors`` to rank ``dst``; completes when ``dst`` has received them. See
        Note [Point-to-point matching] in fakepg.world."""
        return self._p2p("send", tensors, dst, tag)

    def recv(self, tensors: list[Tensor], src: int, tag: int = 0) -> Work:
        """Receive into ``tensors`` what rank ``src`` sends with ``tag``."""
        return self._p2p("recv", tensors, src, tag)

    def _p2p(self, role: str, tensors: list[Tensor], peer: int, tag: int) -> Work:
        name = "dst" if role == "send" else "src"
        tensors = _args.check_tensor_list(tensors, role, _c.RULES)
        for t in tensors:
            _args.check_dense(t, role, _c.RULES)
        peer = _args.check_peer(peer, self._rank, self.size(), role, name, _c.RULES)
        tag = _args.check_tag(tag, role, _c.RULES)
        me, other = self._global_rank, self._channel.members[peer]
        src, dst = (me, other) if role == "send" else (other, me)
        channel = self._world._p2p_channel(self._channel, src, dst, tag)
        fingerprint = _c.Fingerprint("p2p", None, None, _specs(tensors), role=role)

        def plan(per_rank: list[list[Tensor]]) -> list[_c.Task]:
            return _c.p2p_tasks(per_rank[0], per_rank[1])  # members are (src, dst)

        return self._world._issue(
            channel, me, fingerprint, tensors, tensors, plan, _nbytes(tensors), "send"
        )

    def monitored_barrier(self, timeout: float | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier that waits at most ``timeout`` seconds (None: the world's default) and
        then raises CollectiveTimeout naming every rank that did not arrive.

        ``wait_all_ranks`` is accepted for torch's signature: every rank that did not arrive
        is always named.
        """
        limit = _args.check_timeout(timeout, "monitored_barrier", _c.RULES)
        work = self._issue(
            _c.Fingerprint("monitored_barrier"), None, [], lambda _: [], 0, "barrier"
        )
        work.wait(limit)

    # ---------------------------------------------------------------------------------------

    def _issue(
        self,
        fingerprint: _c.Fingerprint,
        payload: Any,
        outputs: list[Tensor],
        plan: Callable[[list[Any]], list[_c.Task]],
        nbytes: int,
        net_kind: str,
    ) -> Work:
        return self._world._issue(
            self._channel, self._global_rank, fingerprint, payload, outputs, plan, nbytes, net_kind
        )

    def _max_parts(self) -> int:
        return self._world.executor.num_threads

    def __repr__(self) -> str:
        where = "" if self._channel.label == "" else f" group={list(self._channel.members)}"
        return f"<fakepg.FakeProcessGroup rank={self._rank} size={self.size()}{where}>"


def _specs(tensors: Sequence[Tensor]) -> tuple[_args.TensorSpec, ...]:
    return tuple(map(_Spec.of, tensors))


def _shapeless(t: Tensor) -> _args.TensorSpec:
    """What every rank's tensors must share when shapes may differ per rank: the dtype,
    layout and device (the shape shows as ``[*]``)."""
    return _args.TensorSpec(t.dtype, (-1,), t.layout, t.device)


def _nbytes(tensors: Sequence[Tensor]) -> int:
    total = 0
    for t in tensors:
        if t.is_sparse:
            # int64 indices per entry, and each entry's values (a row, for a hybrid tensor
            # such as an embedding's gradient).
            total += t._nnz() * t.sparse_dim() * 8 + t._values().numel() * t.element_size()
        else:
            total += t.numel() * t.element_size()
    return total
