"""The exact reference a reduced gradient is compared with, computed from plain autograd.

See DESIGN.md, "Semantics that the properties check": on the fake world the reduced gradient
of a dense parameter is ``sum over ranks r, replicas d of (g[r][d] / W)``, summed left to right
in that order, each term scaled with one rounding. A contribution that is ``None`` (the
parameter got no gradient there) counts as zeros.

``scaling`` says which rounding the reducer under test scales with (see Note [Gradient
scaling] in reducer.bucket_views): ``"divide"``, ``g / W``, the bare ``reducer.Reducer``'s
default; ``"reciprocal"``, ``g * (1.0 / W)`` with ``1.0 / W`` a Python float, torch's DDP and
``reducer.DistributedDataParallel``. They differ in the last bit where W is not a power of two.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

Scaling = Literal["divide", "reciprocal"]


def scaled(g: Tensor, world_size: int, scaling: Scaling = "divide") -> Tensor:
    """One term: ``g / W`` or ``g * (1.0 / W)``, in ``g``'s dtype."""
    if scaling == "reciprocal":
        return g * (1.0 / world_size)
    if scaling == "divide":
        return g / world_size
    raise ValueError(f"scaling must be 'divide' or 'reciprocal', got {scaling!r}")


def rank_order_average(
    contributions: Sequence[Tensor | None], world_size: int, *, scaling: Scaling = "divide"
) -> Tensor | None:
    """``((g0 / W) + (g1 / W)) + ...`` in the given order, each term scaled as ``scaling``
    says; None if every term is None."""
    if all(g is None for g in contributions):
        return None
    like = next(g for g in contributions if g is not None)
    acc: Tensor | None = None
    for g in contributions:
        term = torch.zeros_like(like) if g is None else scaled(g, world_size, scaling)
        acc = term if acc is None else acc + term
    return acc


def sparse_average(contributions: Sequence[Tensor | None], world_size: int) -> Tensor:
    """The dense value of the coalesced sum of sparse ``g / W`` (order not fixed: compare
    with a tolerance). Sparse gradients are divided in either scaling mode, as torch does."""
    dense = [g.to_dense() for g in contributions if g is not None]
    if not dense:
        raise ValueError("sparse_average needs at least one gradient")
    total = torch.zeros_like(dense[0])
    for g in dense:
        total += g / world_size
    return total
