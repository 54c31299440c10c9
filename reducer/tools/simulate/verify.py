"""The exact check ``python -m reducer simulate`` makes after every step.

The reference is DESIGN.md's rank-order average: for each dense parameter, the sum over ranks
r in ascending order of ``local_grad[r]`` scaled by ``W``, added left to right, where
``local_grad[r]`` is
what plain autograd computed on an independent copy of rank r's model (zeros where the
parameter got no gradient on that rank; no gradient at all where it got none on any rank).
Each term is scaled as the reduction scales it (see Note [Gradient scaling] in
reducer.bucket_views): ``g * (1.0 / W)`` without a comm hook (the simulation runs
reducer.DistributedDataParallel, which rounds as torch's DDP does), ``g / W`` through a comm
hook (the built-in hooks divide, as torch's do). On the fake world the reducer's result must
equal it bit for bit (``torch.equal``). A comm hook that reduces in another dtype (fp16, bf16)
is checked against the same sum taken in that dtype, the division too, then cast back, again
bit for bit. Sparse gradients are
coalesced in an order no one fixes, so they are compared within a bound on reordering (see
:func:`_sparse_bound`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__: list[str] = []


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The first difference found: where, and by how much."""

    step: int
    rank: int
    index: int
    name: str
    what: str  # what differs, in words
    max_abs_diff: float

    def message(self) -> str:
        return (
            f"step {self.step}, rank {self.rank}, parameter {self.index} ({self.name!r}): "
            f"{self.what}"
        )


def reference_average(
    local_grads: Sequence[Tensor | None],
    wire_dtype: torch.dtype | None,
    *,
    scaling: Literal["divide", "reciprocal"] = "divide",
) -> Tensor | None:
    """Sum over ranks, ascending, of ``local_grad`` scaled by W (dense), or None if no rank
    has one. ``scaling``: each term is ``g / W`` ("divide") or ``g * (1.0 / W)``
    ("reciprocal", torch's DDP rounding).

    With ``wire_dtype`` (a compressing comm hook) each term is cast to it before the scaling
    and the sum is taken in it, as the hook does; the result has the gradient's dtype.
    """
    present = [g for g in local_grads if g is not None]
    if not present:
        return None
    world = len(local_grads)
    like = present[0]
    dtype = wire_dtype or like.dtype
    total: Tensor | None = None
    for grad in local_grads:
        term = torch.zeros_like(like, dtype=dtype) if grad is None else grad.to(dtype)
        term = term * (1.0 / world) if scaling == "reciprocal" else term / world
        total = term if total is None else total + term  # left to right: ((t0 + t1) + t2) ...
    assert total is not None
    return total.to(like.dtype)


def check_dense(
    step: int,
    index: int,
    name: str,
    reduced: Sequence[Tensor | None],
    expected: Tensor | None,
) -> Mismatch | None:
    """Every rank's reduced gradient must be ``expected``, bit for bit (or absent with it)."""
    for rank, got in enumerate(reduced):
        if expected is None:
            if got is not None:
                return Mismatch(
                    step,
                    rank,
                    index,
                    name,
                    "has a gradient, but no rank computed one (unused on every rank): its "
                    ".grad must stay as it was (None)",
                    float("inf"),
                )
            continue
        if got is None:
            return Mismatch(
                step,
                rank,
                index,
                name,
                "has no gradient, but some rank computed one: the reduced average is missing",
                float("inf"),
            )
        if got.layout != torch.strided or got.shape != expected.shape:
            return Mismatch(
                step,
                rank,
                index,
                name,
                f"reduced gradient is {_describe(got)}, expected {_describe(expected)}",
                float("inf"),
            )
        if not torch.equal(got, expected):
            differ = got != expected
            diff = (got.double() - expected.double()).abs()[differ]
            worst = float(diff.max()) if diff.numel() else float("nan")
            return Mismatch(
                step,
                rank,
                index,
                name,
                f"max |reduced - reference| = {worst:.6g} ({int(differ.sum())} of "
                f"{got.numel()} elements differ); the reference is the sum over ranks, in rank "
                "order, of each rank's local gradient scaled by the world size",
                worst,
            )
    return None


def check_sparse(
    step: int,
    index: int,
    name: str,
    reduced: Sequence[Tensor | None],
    local_grads: Sequence[Tensor | None],
    wire_dtype: torch.dtype | None,
) -> Mismatch | None:
    """Sparse: the reduced gradient, densified, within the reordering bound of the sum."""
    present = [g for g in local_grads if g is not None]
    world = len(local_grads)
    if not present:
        return check_dense(step, index, name, reduced, None)
    dtype = wire_dtype or present[0].dtype
    expected, bound = _sparse_reference(present, world, dtype)
    for rank, got in enumerate(reduced):
        if got is None or not got.is_sparse:
            what = "no gradient" if got is None else f"a {_describe(got)} gradient"
            return Mismatch(
                step,
                rank,
                index,
                name,
                f"expected a sparse reduced gradient, got {what}",
                float("inf"),
            )
        diff = (got.to_dense().double() - expected).abs()
        over = diff > bound
        if bool(over.any()):
            worst = float(diff.max())
            return Mismatch(
                step,
                rank,
                index,
                name,
                f"max |reduced - reference| = {worst:.6g} ({int(over.sum())} elements beyond "
                "the reordering bound); the reference is the sum over ranks of each rank's "
                "local sparse gradient / world size",
                worst,
            )
    return None


def check_same_parameters(
    step: int, names: Sequence[str], per_rank: Sequence[Sequence[Tensor]]
) -> Mismatch | None:
    """After the optimizer step every rank must hold rank 0's parameters, bit for bit."""
    for rank in range(1, len(per_rank)):
        for index, (mine, first) in enumerate(zip(per_rank[rank], per_rank[0], strict=True)):
            if not torch.equal(mine, first):
                worst = float((mine.double() - first.double()).abs().max())
                return Mismatch(
                    step,
                    rank,
                    index,
                    names[index],
                    f"parameter differs from rank 0's after the optimizer step (max difference "
                    f"{worst:.6g}): the replicas diverged",
                    worst,
                )
    return None


def _sparse_reference(
    grads: Sequence[Tensor], world: int, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """The exact sum (in float64) of every entry / W, and how far a sum in ``dtype`` may be.

    Each entry is divided by W in ``dtype``, as the reducer (or hook) does before the
    reduction. The reduction coalesces the entries of all ranks, duplicates included, in an
    order no one fixes. Recursive summation of n terms in any order errs by at most
    (n - 1) u sum |t_i| (u = eps / 2), and the result is rounded once more, so the bound per
    element is (n + 1) eps sum |t_i|, with n the entries that land on that element.
    """
    sums: list[Tensor] = []  # the terms, their absolute values, the entry counts
    for grad in grads:
        # An embedding's gradient is uncoalesced (one entry per lookup): the entries themselves
        # are needed, and only the private accessors give them without coalescing.
        indices, values = grad._indices(), grad._values()
        terms = (values.to(dtype) / world).double()
        for k, v in enumerate((terms, terms.abs(), torch.ones_like(terms))):
            dense = torch.sparse_coo_tensor(indices, v, grad.shape).to_dense()
            if len(sums) < 3:
                sums.append(dense)
            else:
                sums[k] = sums[k] + dense
    expected, magnitude, count = sums
    return expected, (count + 1) * torch.finfo(dtype).eps * magnitude


def _describe(t: Tensor) -> str:
    layout = "sparse" if t.is_sparse else "dense"
    return f"{layout} {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
