"""The exact averages a data-parallel reduction may give, and what a wrong one looks like.

One place for the arithmetic that both ``python -m reducer launch``'s replica check
(:mod:`reducer.tools.check`) and the testing library's checks (:mod:`reducer.testing`)
judge a reduced gradient by.

# Note [The roundings of an exact average]
# The fake world adds in rank order, so an average is exact up to where its division rounds,
# and reducers round in one of three places: torch's DDP multiplies each gradient by 1/W as it
# copies it into the bucket (sum of g_r * (1/W): "reciprocal"), but divides in place when the
# gradient is already a view of its bucket, as torch's ``allreduce_hook`` does (sum of g_r / W:
# "divide"); a reducer may also divide the sum (sum / W: "sum_then_divide", FSDP2's AVG
# reduce-scatter, a hook that divides in its callback). For a power-of-two W the three are the
# same bits; for others they may differ in the last place, and each is a correct average.
# Anything else is not; :func:`explain` says what it looks like instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Literal

import torch
from torch import Tensor

__all__ = ["ROUNDINGS", "Rounding", "average", "averages", "explain", "bits_equal", "max_diff"]

Rounding = Literal["reciprocal", "divide", "sum_then_divide"]
ROUNDINGS: tuple[Rounding, ...] = ("reciprocal", "divide", "sum_then_divide")
# How each rounding reads in a report.
FORMULAS: dict[str, str] = {
    "reciprocal": "sum of g_r * (1/W)",
    "divide": "sum of g_r / W",
    "sum_then_divide": "(sum of g_r) / W",
}
# A subset-of-ranks search looks at every subset up to this world size (2^W subsets).
_MAX_SUBSET_WORLD = 8


def _terms(column: Sequence[Tensor | None]) -> list[Tensor] | None:
    """The contributions with None (no gradient there) as zeros; None if all are None."""
    like = next((g for g in column if g is not None), None)
    if like is None:
        return None
    return [torch.zeros_like(like) if g is None else g for g in column]


def rank_order_sum(tensors: Sequence[Tensor]) -> Tensor:
    """``((x0 + x1) + x2) + ...``: the fake world's reduction order (a new tensor)."""
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total


def average(column: Sequence[Tensor | None], world_size: int, rounding: Rounding) -> Tensor | None:
    """The rank-order average of ``column`` (None counts as zeros) with ``rounding``; None if
    every contribution is None. See Note [The roundings of an exact average]."""
    terms = _terms(column)
    if terms is None:
        return None
    if rounding == "reciprocal":
        factor = 1.0 / world_size
        return rank_order_sum([g * factor for g in terms])
    if rounding == "divide":
        return rank_order_sum([g / world_size for g in terms])
    if rounding == "sum_then_divide":
        return rank_order_sum(terms) / world_size
    raise ValueError(f"rounding={rounding!r}; expected one of {ROUNDINGS}")


def averages(
    column: Sequence[Tensor | None],
    world_size: int,
    roundings: Sequence[Rounding] = ROUNDINGS,
) -> dict[str, Tensor | None]:
    """Every rounding's average of ``column``, by rounding name, in the given order."""
    return {r: average(column, world_size, r) for r in roundings}


def host(t: Tensor) -> Tensor:
    """``t`` on the CPU: ranks' tensors may live on different GPUs, and the checks compare
    them, and compute their averages (elementwise: the same bits anywhere), in one place."""
    return t if t.device.type == "cpu" else t.detach().cpu()


def bits(t: Tensor) -> Tensor:
    t = t.to_dense() if t.is_sparse else t
    return host(t).detach().contiguous().reshape(-1).view(torch.uint8)


def bits_equal(a: Tensor, b: Tensor) -> bool:
    """Bit for bit, shapes and dtypes included (NaNs of the same payload are equal)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(torch.equal(bits(a), bits(b)))


def max_diff(a: Tensor, b: Tensor) -> float:
    a = host(a.to_dense() if a.is_sparse else a)
    b = host(b.to_dense() if b.is_sparse else b)
    if a.shape != b.shape:
        return float("nan")
    return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0


def _within_one_ulp(got: Tensor, want: Tensor) -> bool:
    """Every element of ``got`` is ``want`` or its neighbour in ``want``'s dtype."""
    if got.shape != want.shape or got.dtype != want.dtype or not got.is_floating_point():
        return False
    if not bool(torch.isfinite(want).all()) or not bool(torch.isfinite(got).all()):
        return False
    up = torch.nextafter(want, torch.full_like(want, float("inf")))
    down = torch.nextafter(want, torch.full_like(want, float("-inf")))
    return bool(((got == want) | (got == up) | (got == down)).all())


def explain(
    got: Tensor,
    column: Sequence[Tensor | None],
    world_size: int,
    *,
    accepted: Sequence[Rounding] = ROUNDINGS,
) -> str | None:
    """What a reduced gradient ``got`` is, where it is not the average of ``column`` (every
    rank's local gradient, rank order) in any of the ``accepted`` roundings: None where it
    is one; else a sentence naming what it matches (another rounding and the ``scaling=``
    that accepts it; rank r's local gradient: nothing reduced; the sum: not divided; the
    average divided twice; the average of some ranks only; 1 ulp from an average), or how
    far it is from the first accepted rounding's average."""
    terms = _terms(column)
    if terms is None or any(t.shape != got.shape or t.dtype != got.dtype for t in terms):
        return None
    world = world_size
    every = averages(terms, world)
    if any(bits_equal(every[r], got) for r in accepted):  # type: ignore[arg-type]
        return None
    others = [r for r in ROUNDINGS if r not in accepted and bits_equal(every[r], got)]  # type: ignore[arg-type]
    if others:
        return (
            f"it is the exact average with the other rounding {FORMULAS[others[0]]} "
            f"(scaling={others[0]!r} accepts it; the default accepts any of torch's roundings)"
        )
    total = rank_order_sum(terms)
    if bits_equal(total, got):
        return (
            "it is the sum of the local gradients, not their average: W times the average "
            "(a missing division by the world size)"
        )
    for avg in every.values():
        assert avg is not None
        if bits_equal(avg * (1.0 / world), got) or bits_equal(avg / world, got):
            return f"it is the average divided by the world size again (divided by {world} twice)"
    for rank, g in enumerate(terms):
        if bits_equal(g, got):
            return f"it is rank {rank}'s local gradient: nothing was reduced"
    subset = _subset(got, terms, world)
    if subset is not None:
        return subset
    for rounding in accepted:
        avg = every[rounding]
        assert avg is not None
        if _within_one_ulp(got, avg):
            return (
                f"it is within 1 ulp of the average {FORMULAS[rounding]}, but none of torch's "
                "roundings gives it (another summation order, or an intermediate rounding)"
            )
    first = every[accepted[0]]
    assert first is not None
    diff = max_diff(first, got)
    return f"it differs from the average {FORMULAS[accepted[0]]} by up to {diff:.3g}"


def _subset(got: Tensor, terms: Sequence[Tensor], world: int) -> str | None:
    """Is ``got`` the average over some ranks only (divided by their number or by W)?"""
    if world > _MAX_SUBSET_WORLD or world < 3:
        return None
    for size in range(2, world):
        for ranks in itertools.combinations(range(world), size):
            part = [terms[r] for r in ranks]
            for divisor in (size, world):
                for rounding in ROUNDINGS:
                    if bits_equal(average(part, divisor, rounding), got):  # type: ignore[arg-type]
                        over = (
                            f"divided by their number ({size})"
                            if divisor == size
                            else f"divided by the world size ({world})"
                        )
                        return (
                            f"it is the average of ranks {list(ranks)} only, {over}: the "
                            "other ranks' gradients are missing (a subgroup, or ranks that "
                            "did not take part)"
                        )
    return None


def which(got: Tensor, candidates: Mapping[str, Tensor | None]) -> str | None:
    """The name of the first candidate bit-identical to ``got``."""
    for name, want in candidates.items():
        if want is not None and bits_equal(want, got):
            return name
    return None
