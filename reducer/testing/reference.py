"""The exact reference a reduced gradient is compared with, computed from plain autograd.

See DESIGN.md, "Semantics that the properties check": on the fake world the reduced gradient
of a dense parameter is ``sum over ranks r, replicas d of (g[r][d] / W)``, summed left to right
in that order, each term divided with one rounding. A contribution that is ``None`` (the
parameter got no gradient there) counts as zeros.

How each term is scaled is the ``scaling`` of the reducer under test: "divide" (``g / W``,
the bare ``reducer.Reducer``'s default) or "reciprocal" (``g * (1.0 / W)`` with ``1.0 / W`` a
Python float, as torch's C++ reducer scales; a DDP wrapper, this project's or torch's). The two
differ in the last bit where W is not a power of two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

Scaling = Literal["divide", "reciprocal"]
SCALINGS: tuple[Scaling, ...] = ("divide", "reciprocal")


def rank_order_average(
    contributions: Sequence[Tensor | None], world_size: int, *, scaling: Scaling = "divide"
) -> Tensor | None:
    """``((g0 / W) + (g1 / W)) + ...`` in the given order; None if every term is None.

    With ``scaling="reciprocal"`` each term is ``g * (1.0 / W)`` instead, in the gradient's
    dtype (torch's rounding)."""
    if scaling not in SCALINGS:
        raise ValueError(f"rank_order_average: scaling={scaling!r}; expected one of {SCALINGS}")
    if all(g is None for g in contributions):
        return None
    like = next(g for g in contributions if g is not None)
    factor = 1.0 / world_size
    acc: Tensor | None = None
    for g in contributions:
        if g is None:
            term = torch.zeros_like(like)
        else:
            term = g / world_size if scaling == "divide" else g * factor
        acc = term if acc is None else acc + term
    return acc


def sum_then_divide(contributions: Sequence[Tensor | None], world_size: int) -> Tensor | None:
    """``(((g0 + g1) + g2) + ...) / W``: the sum in the given order, then one division, as a
    reduction with ``ReduceOp.AVG`` gives on the fake world (FSDP2's fp32 reduce-scatter)."""
    if all(g is None for g in contributions):
        return None
    like = next(g for g in contributions if g is not None)
    acc: Tensor | None = None
    for g in contributions:
        term = torch.zeros_like(like) if g is None else g
        acc = term if acc is None else acc + term
    assert acc is not None
    return acc / world_size


def sparse_average(contributions: Sequence[Tensor | None], world_size: int) -> Tensor:
    """The dense value of the coalesced sum of sparse ``g / W`` (order not fixed: compare
    with a tolerance)."""
    dense = [g.to_dense() for g in contributions if g is not None]
    if not dense:
        raise ValueError("sparse_average needs at least one gradient")
    total = torch.zeros_like(dense[0])
    for g in dense:
        total += g / world_size
    return total
