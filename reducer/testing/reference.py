"""The exact reference a reduced gradient is compared with, computed from plain autograd.

See DESIGN.md, "Semantics that the properties check": on the fake world the reduced gradient
of a dense parameter is ``sum over ranks r, replicas d of (g[r][d] / W)``, summed left to right
in that order, each term divided with one rounding. A contribution that is ``None`` (the
parameter got no gradient there) counts as zeros.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def rank_order_average(contributions: Sequence[Tensor | None], world_size: int) -> Tensor | None:
    """``((g0 / W) + (g1 / W)) + ...`` in the given order; None if every term is None."""
    if all(g is None for g in contributions):
        return None
    like = next(g for g in contributions if g is not None)
    acc: Tensor | None = None
    for g in contributions:
        term = torch.zeros_like(like) if g is None else g / world_size
        acc = term if acc is None else acc + term
    return acc


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
