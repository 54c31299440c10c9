"""What each rank must hold after each step: a data-parallel algorithm as a reference.

The checks (:mod:`reducer.testing.checks`) replay every rank's step with plain autograd on
the calling thread: each rank's local gradient of each micro-batch, from the same model
state as the rank under test. A :class:`Reference` turns those into what each rank's
optimizer must see (:meth:`Reference.gradients`), steps a plain optimizer of its own on each
rank's plain model, and says what each rank's parameters must be after the step
(:meth:`Reference.parameters`: model averaging). Each expectation is a set of acceptable
tensors by name ("reciprocal", "divide", "sum_then_divide": the roundings of an exact
average; "local": the rank's own gradient), so that one check accepts every correct
rounding and reports which one it saw.

Built in:

- :func:`ddp_average`: every synced micro-batch reduces what each rank accumulated since the
  last sync, averaged over every rank (DDP, FSDP2's full gradients, a hand-written wrapper;
  with a sharded optimizer such as torch's ``ZeroRedundancyOptimizer``, see
  :func:`zero_redundancy`);
- :func:`periodic_averaging`: local SGD (torch's ``PeriodicModelAverager``,
  ``PostLocalSGDOptimizer``, ``post_localSGD_hook``): gradients averaged over every rank
  during warm-up, then within each rank's subgroup (alone by default); parameters averaged
  within groups every ``period`` steps after warm-up;
- :func:`hierarchical_averaging`: torch's ``HierarchicalModelAverager``: groups of several
  sizes, each with its own period;
- :func:`fsdp2_shards`: FSDP2 (``fully_shard``): DDP's average, of which each rank holds only
  its shard (:func:`fsdp2_shard`: dim-0 chunks), compared shard by shard on every rank.

Write your own by subclassing :class:`Reference`: per rank and parameter, return what that
rank must hold.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from reducer._averages import ROUNDINGS, Rounding, average

from . import _arguments

__all__ = [
    "Candidates",
    "Reference",
    "StepGradients",
    "ddp_average",
    "fsdp2_shard",
    "fsdp2_shards",
    "hierarchical_averaging",
    "periodic_averaging",
    "zero_redundancy",
]

Grads = list[Tensor | None]
# Acceptable values of one tensor, by name: any of them passes (None: no gradient).
Candidates = dict[str, Tensor | None]
# An optimizer for the plain models: called with one rank's parameters, in model order.
OptimizerFactory = Callable[[list[torch.nn.Parameter]], Any]
# One parameter's contributions in rank order (None: no gradient there) -> the average.
Average = Callable[[Sequence[Tensor | None], int], Tensor | None]


@dataclass(frozen=True, slots=True)
class StepGradients:
    """One step, as plain autograd saw it on every rank.

    ``micro[rank][m]``: rank's gradients of micro-batch ``m`` alone (per parameter, None
    where it got none); ``syncs[m]``: "sync" where the wrapper reduces at that micro-batch's
    backward, else how it was told not to ("no_sync", "require_backward_grad_sync");
    ``before[rank]``: the gradients before the step's first backward (None after
    ``zero_grad(set_to_none=True)``, zeros otherwise); ``trains[rank]``: False for a rank
    that has run out of inputs (join: it contributes zeros); ``ignored``: indices of
    parameters the wrapper leaves alone (each rank keeps its own gradient); ``views``: the
    wrapper keeps each ``.grad`` a view of its bucket (DDP's ``gradient_as_bucket_view``).
    A "by_hand" micro-batch's gradients were added into ``.grad`` by the training step
    itself, with no backward through the wrapper's hooks."""

    step: int
    world_size: int
    names: tuple[str, ...]
    micro: tuple[tuple[Grads, ...], ...]
    syncs: tuple[str, ...]
    before: tuple[Grads, ...]
    trains: tuple[bool, ...]
    ignored: frozenset[int]
    views: bool = False

    def accumulated(self, rank: int, upto: int | None = None) -> Grads:
        """Rank's gradients with micro-batches ``0 .. upto - 1`` added, as autograd adds."""
        acc = list(self.before[rank])
        for grads in self.micro[rank][:upto]:
            acc = _add(acc, grads)
        return acc


def _add(acc: Grads, grads: Grads) -> Grads:
    return [
        a if g is None else (g.clone() if a is None else a + g)
        for a, g in zip(acc, grads, strict=True)
    ]


class Reference:
    """A data-parallel algorithm: what every rank must hold after every step.

    ``optimizer``: the plain optimizer each rank's plain model steps with (None: the one the
    check was given, or its SGD). Subclasses override :meth:`gradients` (what each rank's
    optimizer must see) and :meth:`parameters` (what each rank holds after its step)."""

    optimizer: OptimizerFactory | None = None
    # Does each rank hold a shard of each tensor (see :meth:`local`), not the whole?
    sharded: bool = False

    def local(self, rank: int, world_size: int, tensor: Tensor) -> Tensor:
        """What ``rank`` holds of a whole gradient or parameter ``tensor`` (its shard, for a
        sharded algorithm): what the check compares with what the rank holds. Default: all
        of it."""
        return tensor

    def gradients(self, s: StepGradients) -> list[list[Candidates]]:
        """Per rank and parameter, the gradients its optimizer may see. Default: each
        rank's own accumulated gradient (no reduction)."""
        return [[{"local": g} for g in s.accumulated(r)] for r in range(s.world_size)]

    def parameters(
        self, step: int, params: Sequence[Sequence[Tensor]], trains: Sequence[bool]
    ) -> list[list[Candidates]] | None:
        """Per rank and parameter, what it must hold after its optimizer step, given what the
        plain optimizers left (``params``). None: just that."""
        return None


def _pinned(scaling: Rounding | None) -> tuple[Rounding, ...]:
    if scaling is None:
        return ROUNDINGS
    if scaling not in ROUNDINGS:
        raise ValueError(f"scaling={scaling!r}; expected None (any) or one of {ROUNDINGS}")
    return (scaling,)


class _GroupAverage(Reference):
    """Every synced micro-batch averages what each rank accumulated since the last one over
    the rank's group (``groups_at(step)``: lists of ranks; a rank in none keeps its own)."""

    def __init__(
        self,
        *,
        scaling: Rounding | None = None,
        average: Average | None = None,
        optimizer: OptimizerFactory | None = None,
    ) -> None:
        self.roundings: tuple[str, ...] = ("average",) if average is not None else _pinned(scaling)
        self.average = average
        self.optimizer = optimizer

    def groups_at(self, step: int, world_size: int) -> list[list[int]]:
        return [list(range(world_size))]

    def _avg(self, name: str, column: Sequence[Tensor | None], n: int) -> Tensor | None:
        if self.average is not None:
            return self.average(column, n)
        return average(column, n, name)  # type: ignore[arg-type]

    def gradients(self, s: StepGradients) -> list[list[Candidates]]:
        world = s.world_size
        groups = self.groups_at(s.step, world)
        out: list[list[Candidates]] = [[{} for _ in s.names] for _ in range(world)]
        for i in range(len(s.names)):
            if i in s.ignored:  # each rank keeps its own
                for r in range(world):
                    out[r][i]["local"] = s.accumulated(r)[i]
                continue
            # One chain of values per way of rounding each sync (a wrapper may round its
            # syncs differently: torch's DDP multiplies a gradient into its bucket, then
            # divides the bucket view autograd accumulated into): name -> value per rank.
            chains: dict[str, list[Tensor | None]] = {"": [s.before[r][i] for r in range(world)]}
            syncs = s.syncs.count("sync")
            hooked: Tensor | None = None  # a gradient some backward gave since the last sync
            for m, mode in enumerate(s.syncs):
                for values in chains.values():
                    for r in range(world):
                        if m < len(s.micro[r]):
                            g = s.micro[r][m][i]
                            v = values[r]
                            values[r] = v if g is None else (g.clone() if v is None else v + g)
                            if g is not None and mode != "by_hand":
                                hooked = g
                if mode != "sync":
                    continue
                if self._reduces(hooked is not None, s.views, chains):
                    chains = self._synced(chains, groups, syncs, hooked)
                hooked = None
            for name, values in chains.items():
                for r in range(world):
                    out[r][i][name or "local"] = values[r]
        return out

    def _reduces(
        self, hooked: bool, views: bool, chains: Mapping[str, Sequence[Tensor | None]]
    ) -> bool:
        """Does a sync reduce the parameter? Where some rank's backward gave it a gradient
        since the last sync (``hooked``). Otherwise DDP leaves .grad as it is (what a rank
        added by hand stays its own), except that a .grad that is its bucket view
        (``views``) is reduced in place, as torch's DDP does."""
        return hooked or (views and _held(chains))

    def _synced(
        self,
        chains: dict[str, list[Tensor | None]],
        groups: list[list[int]],
        syncs: int,
        like: Tensor | None,
    ) -> dict[str, list[Tensor | None]]:
        """Each chain averaged within each group, in each rounding (only the same rounding as
        before where a step syncs more than 3 times: 3^k chains otherwise). A group none of
        whose ranks holds a gradient reduces zeros (shaped as ``like``) where some rank of
        the world used the parameter; where none did, it keeps none, and only the ranks
        holding a .grad (their bucket views) take the reduced value."""
        out: dict[str, list[Tensor | None]] = {}
        for name, values in chains.items():
            for rounding in self.roundings:
                if syncs > 3 and name and not name.endswith(rounding):
                    continue
                new = list(values)
                for group in groups:
                    column = [values[r] for r in group]
                    if all(g is None for g in column):
                        if like is None:
                            continue  # unused on every rank: .grad is left as it was
                        column = [torch.zeros_like(like) for _ in group]
                    avg = self._avg(rounding, column, len(group))
                    for r in group:
                        if like is None and values[r] is None:
                            continue  # reduced only as the bucket view a rank's .grad is
                        new[r] = None if avg is None else avg.clone()
                out[f"{name} then {rounding}" if name else rounding] = new
        return out


def _held(chains: Mapping[str, Sequence[Tensor | None]]) -> bool:
    """Does some rank hold a gradient (in the first chain: every chain has the same Nones)?"""
    return any(v is not None for v in next(iter(chains.values())))


def ddp_average(
    *,
    scaling: Rounding | None = None,
    average: Average | None = None,
    optimizer: OptimizerFactory | None = None,
) -> Reference:
    """DDP's reference: at each synced micro-batch, what every rank accumulated since the
    last sync is averaged over every rank in rank order (a rank without a gradient, or one
    that has run out under ``join()``, contributes zeros; a parameter no rank used keeps its
    ``.grad``). ``scaling`` pins one rounding ("reciprocal": torch's DDP; "divide": its
    ``allreduce_hook``, bucket views; "sum_then_divide": FSDP2, a hook dividing the sum);
    None (the default) accepts any of them. ``average(column, world_size)``: your own
    instead. ``optimizer``: see :class:`Reference`."""
    _arguments.plain_optimizer_factory(optimizer, "ddp_average", "optimizer", optional=True)
    return _GroupAverage(scaling=scaling, average=average, optimizer=optimizer)


def fsdp2_shard(tensor: Tensor, rank: int, world_size: int) -> Tensor:
    """``rank``'s shard of ``tensor`` as FSDP2's ``fully_shard`` lays it out over
    ``world_size`` ranks (``Shard(0)``): ``torch.chunk`` along dim 0, so every shard has
    ceil(n / W) rows but the last ones (FSDP2 pads those to that size in its all-gather and
    reduce-scatter buffers; the local tensor is the unpadded rows), and a rank past the last
    chunk holds no rows (a 0-row tensor). A 0-dim tensor is not sharded."""
    if tensor.dim() == 0:
        return tensor
    chunks = torch.chunk(tensor, world_size, dim=0)
    if rank < len(chunks):
        return chunks[rank]
    return tensor.new_empty((0, *tensor.shape[1:]))


class _Sharded(_GroupAverage):
    """DDP's average, each rank holding its FSDP2 shard of every gradient and parameter."""

    sharded = True

    def local(self, rank: int, world_size: int, tensor: Tensor) -> Tensor:
        return fsdp2_shard(tensor, rank, world_size)


def fsdp2_shards(
    *,
    scaling: Rounding | None = None,
    average: Average | None = None,
    optimizer: OptimizerFactory | None = None,
) -> Reference:
    """FSDP2's reference (``fully_shard`` over every rank on a one-dimensional mesh): the
    gradients are DDP's average (:func:`ddp_average`; FSDP2's float32 reduce-scatter with
    ``ReduceOp.AVG`` gives "sum_then_divide" on the fake world), and each rank holds only its
    shard of each gradient and parameter (:func:`fsdp2_shard`): the check compares each
    rank's local shard (``DTensor.to_local()``) with its shard of the reference, so a shard
    that lands on the wrong rank, or rows shifted between shards, fail on the rank and rows
    where they land, with no gather that could hide them. ``optimizer``: the plain optimizer
    stepped on the whole parameters (an element-wise one gives the same bits on shards)."""
    _arguments.plain_optimizer_factory(optimizer, "fsdp2_shards", "optimizer", optional=True)
    return _Sharded(scaling=scaling, average=average, optimizer=optimizer)


def zero_redundancy(optimizer: OptimizerFactory, *, scaling: Rounding | None = None) -> Reference:
    """torch's ``ZeroRedundancyOptimizer`` (ZeRO-1/2: optimizer state sharded, parameters
    replicated) over DDP: the gradients are DDP's average, and after the step every rank
    holds what ``optimizer`` (the plain optimizer the sharded one wraps, e.g.
    ``lambda ps: torch.optim.Adam(ps, lr=0.01)``) gives on every parameter; torch's
    ``ZeroRedundancyOptimizer`` factory itself goes to the check's ``optimizer=``."""
    _arguments.plain_optimizer_factory(optimizer, "zero_redundancy", "optimizer", optional=False)
    return _GroupAverage(scaling=scaling, optimizer=optimizer)


def _consecutive(size: int, world_size: int) -> list[list[int]]:
    """torch's ``dist.new_subgroups(group_size=size)``: consecutive ranks."""
    if size < 1 or world_size % size:
        raise ValueError(
            f"a group size of {size} does not divide the world size {world_size}: torch's "
            "new_subgroups needs it to"
        )
    return [list(range(k, k + size)) for k in range(0, world_size, size)]


class _ModelAveraging(_GroupAverage):
    """Gradients averaged over every rank during warm-up (``step < warmup_steps``), then
    within ``gradient_groups`` (alone where None); parameters averaged within the groups
    :meth:`parameter_groups_at` names, as torch's ``average_parameters`` does (the
    parameters concatenated in their promoted dtype, divided, summed in rank order, cast
    back)."""

    def __init__(
        self,
        *,
        warmup_steps: int,
        gradient_group_size: int,
        scaling: Rounding | None,
        optimizer: OptimizerFactory | None,
    ) -> None:
        super().__init__(scaling=scaling, optimizer=optimizer)
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be 0 or more, got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.gradient_group_size = gradient_group_size

    def groups_at(self, step: int, world_size: int) -> list[list[int]]:
        if step < self.warmup_steps:
            return [list(range(world_size))]
        return _consecutive(self.gradient_group_size, world_size)

    def parameter_groups_at(self, step: int, world_size: int) -> list[list[int]] | None:
        raise NotImplementedError

    def parameters(
        self, step: int, params: Sequence[Sequence[Tensor]], trains: Sequence[bool]
    ) -> list[list[Candidates]] | None:
        groups = self.parameter_groups_at(step, len(params))
        if groups is None:
            return None
        out: list[list[Candidates]] = [[{"kept": p} for p in ps] for ps in params]
        for group in groups:
            flat = [torch.cat([p.detach().reshape(-1) for p in params[r]]) for r in group]
            for r in group:
                out[r] = [{} for _ in params[r]]
            for name in self.roundings:
                avg = self._avg(name, flat, len(group))
                assert avg is not None
                for r in group:
                    offset = 0
                    for i, p in enumerate(params[r]):
                        out[r][i][name] = avg[offset : offset + p.numel()].view_as(p).to(p.dtype)
                        offset += p.numel()
        return out


class _Periodic(_ModelAveraging):
    def __init__(self, period: int, groups_size: int | None, **kw: Any) -> None:
        super().__init__(**kw)
        if period < 1:
            raise ValueError(f"period must be 1 or more, got {period}")
        self.period = period
        self.group_size = groups_size

    def parameter_groups_at(self, step: int, world_size: int) -> list[list[int]] | None:
        # torch's PeriodicModelAverager.average_parameters, its step counting optimizer steps.
        if step >= self.warmup_steps and (step - self.warmup_steps) % self.period == 0:
            return _consecutive(self.group_size or world_size, world_size)
        return None


def periodic_averaging(
    period: int,
    *,
    warmup_steps: int = 0,
    group_size: int | None = None,
    gradient_group_size: int = 1,
    scaling: Rounding | None = None,
    optimizer: OptimizerFactory | None = None,
) -> Reference:
    """Local SGD as torch runs it: gradients averaged over every rank for the first
    ``warmup_steps`` steps (``post_localSGD_hook``'s ``start_localSGD_iter``), then within
    groups of ``gradient_group_size`` consecutive ranks (its ``subgroup``; 1: each rank's own
    gradient); after the optimizer step of step k >= ``warmup_steps`` with
    ``(k - warmup_steps) % period == 0``, parameters averaged within groups of
    ``group_size`` consecutive ranks (None: every rank), as ``PeriodicModelAverager`` does."""
    _arguments.count(period, "periodic_averaging: period", minimum=1)
    _arguments.count(warmup_steps, "periodic_averaging: warmup_steps", minimum=0)
    _arguments.count(gradient_group_size, "periodic_averaging: gradient_group_size", minimum=1)
    if group_size is not None:
        _arguments.count(group_size, "periodic_averaging: group_size", minimum=1)
    _arguments.plain_optimizer_factory(optimizer, "periodic_averaging", "optimizer", optional=True)
    return _Periodic(
        period,
        group_size,
        warmup_steps=warmup_steps,
        gradient_group_size=gradient_group_size,
        scaling=scaling,
        optimizer=optimizer,
    )


class _Hierarchical(_ModelAveraging):
    def __init__(self, period_group_sizes: Mapping[int, int], **kw: Any) -> None:
        super().__init__(**kw)
        if not period_group_sizes or any(p < 1 for p in period_group_sizes):
            raise ValueError(
                f"period_group_sizes must map periods (1 or more) to group sizes, got "
                f"{dict(period_group_sizes)}"
            )
        self.periods = dict(sorted(period_group_sizes.items()))

    def parameter_groups_at(self, step: int, world_size: int) -> list[list[int]] | None:
        # torch's HierarchicalModelAverager: the largest period dividing the step (not the
        # steps since warm-up) picks the group.
        if step < self.warmup_steps:
            return None
        for period in reversed(self.periods):
            if step % period == 0:
                return _consecutive(self.periods[period], world_size)
        return None


def hierarchical_averaging(
    period_group_sizes: Mapping[int, int],
    *,
    warmup_steps: int = 0,
    gradient_group_size: int = 1,
    scaling: Rounding | None = None,
    optimizer: OptimizerFactory | None = None,
) -> Reference:
    """torch's ``HierarchicalModelAverager(period_group_size_dict, warmup_steps)``: after the
    optimizer step of step k >= ``warmup_steps``, parameters averaged within groups of
    consecutive ranks of the size the largest period dividing k maps to. Gradients: see
    :func:`periodic_averaging`."""
    period_group_sizes = _arguments.period_group_sizes(
        period_group_sizes, "hierarchical_averaging: period_group_sizes"
    )
    _arguments.count(warmup_steps, "hierarchical_averaging: warmup_steps", minimum=0)
    _arguments.count(gradient_group_size, "hierarchical_averaging: gradient_group_size", minimum=1)
    _arguments.plain_optimizer_factory(
        optimizer, "hierarchical_averaging", "optimizer", optional=True
    )
    return _Hierarchical(
        period_group_sizes,
        warmup_steps=warmup_steps,
        gradient_group_size=gradient_group_size,
        scaling=scaling,
        optimizer=optimizer,
    )
