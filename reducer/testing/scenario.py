"""A few steps of data-parallel training as plain data: :class:`TrainingScenario`, and the
:class:`Batch` one rank trains on in one step (its micro-batches, which of them sync, its
loss)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from . import _arguments

__all__ = ["SYNC_MODES", "Batch", "TrainingScenario", "sum_of_squares"]

# How a micro-batch's backward is told (not) to reduce: "sync" reduces; "no_sync" runs its
# forward and backward inside ``wrapper.no_sync()``; "require_backward_grad_sync" sets that
# attribute to False around them (what nanoGPT's train.py does); "by_hand" bypasses the
# wrapper: the forward of its inner module (``wrapper.module``), the gradients from
# ``torch.autograd.grad`` (no backward through the wrapper's hooks), added into each
# ``.grad`` by the step itself (accumulation written by hand).
SYNC_MODES = ("sync", "no_sync", "require_backward_grad_sync", "by_hand")


def sum_of_squares(output: Any) -> Tensor:
    """The default loss: the sum of squares of every tensor in ``output`` (nested lists,
    tuples and dicts searched), in float64."""
    total = torch.zeros((), dtype=torch.float64)
    for t in _tensors(output):
        total = total + t.double().pow(2).sum()
    return total


def _tensors(obj: Any) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, list | tuple):
        return [t for v in obj for t in _tensors(v)]
    return []


@dataclass(frozen=True)
class TrainingScenario:
    """A few steps of data-parallel training, as plain data.

    ``make_model()`` must build the same parameters on every call. ``inputs[step][rank]`` is
    the tuple of positional arguments of that rank's forward in that step; ``loss`` maps the
    forward's output to a scalar. ``options`` are keyword arguments of the wrapper factory
    (``bucket_cap_mb``, ``find_unused_parameters``, ...). ``refusal``: a regular expression
    that the error every rank raises in the first step must match, where the wrapper must
    refuse the scenario. ``lr``: the SGD step after each step (0: gradients only).
    ``ignored``: names of parameters and buffers the wrapper is told to leave alone (torch's
    ``_set_params_and_buffers_to_ignore_for_model``, before wrapping): each rank keeps its
    own gradient of an ignored parameter, and its own ignored buffers. ``rank_seeds``: each
    rank calls ``torch.manual_seed(rank_seeds[rank])`` on its thread before the first step,
    and draws its random numbers (dropout) from that stream, its own (the fake world gives
    every rank thread a generator of its own); the reference replays each rank's stream.
    Uneven inputs: ``inputs[step][rank]`` is None once that rank has run out of batches (from
    some step on); every rank then trains inside the wrapper's ``join()``, and a rank that has
    run out contributes zeros to the others' steps (``divide_by_initial_world_size``: the
    average over every rank); after the last step every rank holds the parameters of the
    highest rank that trained last. ``reload_after``: after that step (not the last; not
    with uneven inputs), every rank pickles its wrapper with ``torch.save`` into memory and
    trains on from the ``torch.load``-ed copy and its module (the wrapper must be over
    torch's default group, as a pickled DDP reloads onto it); the expectation is unchanged.

    Gradient accumulation: with ``micro_batches``, step k runs ``len(micro_batches[k])``
    micro-batches, each with its sync mode (see ``SYNC_MODES``), and ``inputs[k][rank]`` is
    a tuple of one argument tuple per micro-batch. ``loss_scales[k][rank]``: that rank's loss
    is multiplied by it in step k (gradient magnitudes: a power of two scales them exactly).
    ``set_to_none``: how the step's ``optimizer.zero_grad`` clears the gradients.
    """

    make_model: Callable[[], nn.Module]
    inputs: tuple[tuple[tuple[Any, ...] | None, ...], ...]
    loss: Callable[[Any], Tensor] = sum_of_squares
    options: Mapping[str, Any] = field(default_factory=dict)
    refusal: str | None = None
    lr: float = 0.1
    ignored: frozenset[str] = frozenset()
    rank_seeds: tuple[int, ...] | None = None
    reload_after: int | None = None
    micro_batches: tuple[tuple[str, ...], ...] | None = None
    loss_scales: tuple[tuple[float, ...], ...] | None = None
    set_to_none: bool = True

    def __post_init__(self) -> None:
        _arguments.scenario_inputs(self.inputs, micro_batches=self.micro_batches is not None)
        if not self.inputs or not self.inputs[0]:
            raise ValueError("TrainingScenario: inputs must hold at least one step of one rank")
        sizes = {len(step) for step in self.inputs}
        if len(sizes) != 1:
            raise ValueError(
                f"TrainingScenario: every step needs inputs for every rank; got steps of "
                f"{[len(step) for step in self.inputs]} ranks"
            )
        for rank in range(len(self.inputs[0])):
            ran = [self.inputs[k][rank] is not None for k in range(len(self.inputs))]
            if ran != sorted(ran, reverse=True) or not ran[0]:
                raise ValueError(
                    f"TrainingScenario: rank {rank} must train from the first step until its "
                    f"inputs run out (None from then on), got {ran}"
                )
        if self.rank_seeds is not None and len(self.rank_seeds) != len(self.inputs[0]):
            raise ValueError(
                f"TrainingScenario: rank_seeds needs one seed per rank ({len(self.inputs[0])}), "
                f"got {len(self.rank_seeds)}"
            )
        if self.reload_after is not None and (
            not 0 <= self.reload_after < len(self.inputs) - 1 or self.uneven
        ):
            raise ValueError(
                f"TrainingScenario: reload_after must name a step before the last "
                f"(0 .. {len(self.inputs) - 2}), without uneven inputs; got {self.reload_after}"
            )

        self._check_micro_batches()
        if self.loss_scales is not None and (
            len(self.loss_scales) != len(self.inputs)
            or any(len(scales) != self.world_size for scales in self.loss_scales)
        ):
            raise ValueError(
                f"TrainingScenario: loss_scales needs one scale per step ({len(self.inputs)}) "
                f"and rank ({self.world_size}), got {self.loss_scales}"
            )
        for k, per_rank in enumerate(self.loss_scales or ()):
            for rank, scale in enumerate(per_rank):
                _arguments.finite_scale(scale, f"TrainingScenario: loss_scales[{k}][{rank}]")

    def _check_micro_batches(self) -> None:
        if self.micro_batches is None:
            return
        if len(self.micro_batches) != len(self.inputs):
            raise ValueError(
                f"TrainingScenario: micro_batches needs the sync modes of every step "
                f"({len(self.inputs)}), got {len(self.micro_batches)}"
            )
        for k, modes in enumerate(self.micro_batches):
            bad = [m for m in modes if m not in SYNC_MODES]
            if not modes or bad:
                raise ValueError(
                    f"TrainingScenario: step {k}'s micro-batches {modes!r}: each must be one "
                    f"of {SYNC_MODES}, at least one per step"
                )
            for rank, args in enumerate(self.inputs[k]):
                if args is not None and len(args) != len(modes):
                    raise ValueError(
                        f"TrainingScenario: with micro_batches, inputs[{k}][{rank}] holds one "
                        f"argument tuple per micro-batch ({len(modes)}), got {len(args)}"
                    )

    @property
    def world_size(self) -> int:
        return len(self.inputs[0])

    @property
    def uneven(self) -> bool:
        """Does some rank run out of inputs before the others (a run under ``join()``)?"""
        return any(args is None for step in self.inputs for args in step)

    def trains(self, step: int, rank: int) -> bool:
        return self.inputs[step][rank] is not None

    def args(self, step: int, rank: int) -> tuple[Any, ...]:
        """The forward's arguments of ``rank`` in ``step`` (it must train then)."""
        args = self.inputs[step][rank]
        if args is None:
            raise ValueError(f"rank {rank} has no inputs in step {step}: it ran out before")
        return args

    @property
    def steps(self) -> int:
        return len(self.inputs)

    def syncs(self, step: int) -> tuple[str, ...]:
        """The sync mode of each micro-batch of ``step`` (one synced one by default)."""
        return ("sync",) if self.micro_batches is None else self.micro_batches[step]

    def batch(self, step: int, rank: int) -> Batch:
        """What ``rank`` trains on in ``step`` (it must train then)."""
        args = self.args(step, rank)
        micro = (args,) if self.micro_batches is None else tuple(tuple(a) for a in args)
        scale = 1.0 if self.loss_scales is None else self.loss_scales[step][rank]
        return Batch(micro, self.syncs(step), self.loss, scale)


@dataclass(frozen=True)
class Batch:
    """One rank's data for one step, handed to a ``train_step``: ``micro_batches`` (argument
    tuples of the forward), ``syncs`` (each one's sync mode, see ``SYNC_MODES``), and
    :meth:`loss` (the scenario's loss, times this rank's ``scale``). A step must run, for
    each micro-batch, ``batch.loss(model(*args)).backward()`` with its sync mode: the
    reference replays exactly that."""

    micro_batches: tuple[tuple[Any, ...], ...]
    syncs: tuple[str, ...]
    loss_fn: Callable[[Any], Tensor]
    scale: float = 1.0

    def loss(self, output: Any) -> Tensor:
        value = self.loss_fn(output)
        return value if self.scale == 1.0 else value * self.scale

    @property
    def args(self) -> tuple[Any, ...]:
        """The forward's arguments, where the step has one micro-batch."""
        if len(self.micro_batches) != 1:
            raise ValueError(
                f"Batch.args: this step has {len(self.micro_batches)} micro-batches; iterate "
                "over batch.micro_batches (with batch.syncs) instead"
            )
        return self.micro_batches[0]
