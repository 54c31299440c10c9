"""Uneven inputs: ``DistributedDataParallel.join()`` and torch's ``Join``, over any ProcessGroup.

A rank whose inputs run out leaves its training loop while the others go on; their forward
and backward issue collectives it no longer issues, and they would wait for it forever. Under
join, the rank that ran out "shadows" each of their iterations instead: it issues the same
collectives, contributing zeros, until every rank has run out; then every rank takes the
model of a rank that trained last. This is torch's algorithm (``torch.distributed.algorithms.
join`` and DDP's ``_DDPJoinHook``), written against reducer.ProcessGroup, so it runs on the
fake world, on gloo or NCCL through TorchProcessGroup, and on fakepg's torch backend.

# Note [The collectives of a joined iteration]
# Per iteration, in this order (the left column on ranks still training, in forward; the
# right on ranks that ran out, in the join loop):
#   notify:  allreduce ones(1)               | allreduce zeros(1): the sum is how many train
#   throw:   allreduce zeros(1) (wait)       | allreduce ones(1), then raise   (only with
#            raise if the sum > 0            |                          throw_on_early_termination)
#   sync:    allreduce [synced](1)           | allreduce zeros(1): will backward reduce?
#   rebuild: broadcasts of rank 0's buckets  | the same, at the same iteration (Note
#            (once, when due and synced)     |   [Rebuilding buckets] in reducer.ddp._wrapper)
#   buffers: allreduce MAX of the rank, then broadcast from the highest rank still training
#   backward: one reduction per bucket, then | the same, of zeros (Reducer._shadow_iteration)
#            the used map where searched     |
# The first two are torch Join's own, with its tensors (float32, one element), so that
# torch's ``Join`` context manager, which issues its side through torch.distributed, matches
# them over the same torch group. When every rank has run out, each finds the highest rank
# that ran out last, and every rank takes that rank's parameters (and buffers) by broadcast.
# With divide_by_initial_world_size=False the ranks still training scale their buckets by
# the notify sum (how many train) instead of the world size, multiplying by its reciprocal as
# torch's reducer does (see Note [Gradient scaling] in reducer.bucket_views); a comm hook
# divides as it does.
"""

from __future__ import annotations

from types import TracebackType
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor
from torch.distributed.algorithms.join import JoinHook

from reducer.errors import ReductionError
from reducer.process_group import ProcessGroup, Work

__all__: list[str] = []


class JoinConfig(NamedTuple):
    """What a join context tells its joinables; the fields of torch's ``_JoinConfig``, which
    torch's ``Join`` sets on them instead."""

    enable: bool
    throw_on_early_termination: bool
    is_first_joinable: bool


DISABLED = JoinConfig(enable=False, throw_on_early_termination=False, is_first_joinable=False)


class _ShadowingReducer(Protocol):
    """What join needs of the wrapper's reducer."""

    @property
    def iterations(self) -> int: ...

    def _shadow_iteration(self, *, used_map: bool) -> None: ...


class JoiningWrapper(Protocol):
    """What join needs of the wrapper: ``reducer.DistributedDataParallel`` is the one.

    A protocol, not an import of ``reducer.ddp``: the wrapper imports this module, and
    dependencies point one way. The attributes join writes are part of it.
    """

    _join_config: JoinConfig
    _divide_by_initial_world_size: bool
    _shadowed: int

    @property
    def _group(self) -> ProcessGroup: ...

    @property
    def find_unused_parameters(self) -> bool: ...

    @property
    def static_graph(self) -> bool: ...

    @property
    def reducer(self) -> _ShadowingReducer: ...

    @property
    def join_device(self) -> torch.device: ...

    def join_hook(self, **kwargs: Any) -> DDPJoinHook: ...

    def _should_rebuild(self) -> bool: ...

    def _rebuild_buckets(self) -> None: ...

    require_forward_param_sync: bool

    def _sync_buffers(self, *, candidate: bool) -> None: ...

    def _sync_final_model(self, is_last_joiner: bool) -> None: ...


class Join:
    """The context manager :meth:`reducer.DistributedDataParallel.join` returns.

    Inside it, run the training loop with however many batches this rank has. On leaving it,
    the rank shadows the others' iterations until every rank has left, then every rank takes
    the model of a rank that trained last. See Note [The collectives of a joined iteration].
    """

    def __init__(
        self,
        ddp: JoiningWrapper,
        *,
        enable: bool,
        throw_on_early_termination: bool,
        divide_by_initial_world_size: bool,
    ) -> None:
        self._ddp = ddp
        self._enable = bool(enable)
        self._throw = bool(throw_on_early_termination)
        self._divide_by_initial_world_size = bool(divide_by_initial_world_size)
        self._hook: DDPJoinHook | None = None

    def __enter__(self) -> Join:
        self._hook = self._ddp.join_hook(
            divide_by_initial_world_size=self._divide_by_initial_world_size
        )
        self._ddp._join_config = JoinConfig(self._enable, self._throw, is_first_joinable=True)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        assert self._hook is not None  # set by __enter__
        try:
            if not self._enable or exc_type is not None:
                return  # an error inside the block propagates as it is
            group, device = self._ddp._group, self._ddp.join_device
            is_last_joiner = True
            while _count(group, device, 0.0) > 0:
                if self._throw:
                    _count(group, device, 1.0)  # tells the others, whose forward raises
                    raise ReductionError(
                        f"Rank {group.rank()} exhausted all inputs "
                        "(join(throw_on_early_termination=True)): every rank raises now. "
                        "Catch the error on every rank to go on without join, or pass "
                        "throw_on_early_termination=False to train the others to the end"
                    )
                self._hook.main_hook()
                is_last_joiner = False
            self._hook.post_hook(is_last_joiner)
        finally:
            self._ddp._join_config = DISABLED


def _count(group: ProcessGroup, device: torch.device, value: float) -> int:
    """Allreduce one float32 ``value`` (torch Join's tensor) and return the sum."""
    t = torch.full((1,), value, dtype=torch.float32, device=device)
    group.allreduce([t]).wait()
    return int(t.item())


class DDPJoinHook(JoinHook):
    """What a rank that ran out of inputs does for each iteration of the others, and once
    all have run out. Usable by torch's ``Join`` too (it calls these two methods)."""

    def __init__(self, ddp: JoiningWrapper, divide_by_initial_world_size: bool) -> None:
        super().__init__()
        self._ddp = ddp
        ddp._divide_by_initial_world_size = bool(divide_by_initial_world_size)

    def main_hook(self) -> None:
        """Shadow one iteration of the ranks still training. See Note [The collectives of a
        joined iteration]."""
        ddp = self._ddp
        synced = _count(ddp._group, ddp.join_device, 0.0) > 0
        if synced and ddp._should_rebuild():
            ddp._rebuild_buckets()
        ddp._sync_buffers(candidate=False)
        ddp.require_forward_param_sync = synced  # as a training rank's forward sets it
        if not synced:
            return
        first = ddp.reducer.iterations + ddp._shadowed == 0
        searched = ddp.find_unused_parameters and not ddp.static_graph
        ddp.reducer._shadow_iteration(used_map=searched or (ddp.static_graph and first))
        ddp._shadowed += 1

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank takes the parameters (and buffers) of the highest rank that ran out
        last, so that all end with the same model."""
        self._ddp._sync_final_model(is_last_joiner)


def notify_join_context(ddp: JoiningWrapper) -> tuple[Work, Tensor] | None:
    """In forward, under join: tell the ranks that ran out that this one still trains.

    Returns the notification's work and tensor (its sum is how many ranks train), or None
    outside join or where another joinable notifies. With throw_on_early_termination, raises
    on every rank still training once some rank has run out.
    """
    config = ddp._join_config
    if not (config.enable and config.is_first_joinable):
        return None
    group, device = ddp._group, ddp.join_device
    ones = torch.ones(1, dtype=torch.float32, device=device)
    work = group.allreduce([ones])
    if config.throw_on_early_termination and _count(group, device, 0.0) > 0:
        raise ReductionError(
            "Detected at least one rank that exhausted inputs. Throwing across all ranks "
            f"(rank {group.rank()}, join(throw_on_early_termination=True)). Catch the error on "
            "every rank to go on without join, or pass throw_on_early_termination=False to "
            "train the remaining ranks to the end"
        )
    return work, ones


def announce_sync(ddp: JoiningWrapper, synced: bool) -> None:
    """In forward, under join: tell the ranks that ran out whether this iteration's backward
    reduces (their ``main_hook`` shadows it only then)."""
    flag = torch.full((1,), float(synced), dtype=torch.float32, device=ddp.join_device)
    ddp._group.allreduce([flag]).wait()


def training_ranks(notified: tuple[Work, Tensor]) -> int:
    """How many ranks still train this iteration (the notification's sum)."""
    work, ones = notified
    work.wait()
    return int(ones.item())
