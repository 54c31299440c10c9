"""Gradients into and out of buckets: the write-back after the reduction, and bucket views.

Without gradient_as_bucket_view, the reducer copies each gradient into its bucket's flat
contents, and after the reduction copies the averages back into ``.grad``
(:func:`write_dense`, :func:`write_sparse`, batched with :func:`copy_all`). With it,
:class:`BucketViews` keeps each dense ``.grad`` a view of its bucket.

# Note [Gradients as bucket views]
# With gradient_as_bucket_view, each dense .grad is a view of its bucket: autograd accumulates
# straight into the bucket, the division and the allreduce happen in place, and nothing is
# copied in or out. A fresh gradient (after zero_grad(set_to_none=True)) is copied in once
# and .grad is pointed back at the view. .grad stays that one view object from iteration to
# iteration (until the buckets are rebuilt), as in torch, so an optimizer or user code that
# holds on to it keeps seeing the gradient. A locally unused parameter (found unused, or
# reached only by outputs the loss did not use) must contribute zeros, yet keep its .grad
# exactly if it is unused on every rank: its values are set aside (``BucketViews.kept``), the
# view is zeroed for the reduction, and finalize copies them back if no rank used it. The view
# follows the parameter's strides: see Note [Bucket views follow the parameter's strides] in
# reducer.buckets.

# Note [Gradient scaling]
# Each rank scales its bucket contents by the divisor d (the world size, or under join the
# ranks still training) before the SUM, so that the sum is the average. Two roundings exist:
# "divide", ``g / d`` (DESIGN's contract for the bare Reducer), and "reciprocal",
# ``g * (1.0 / d)`` with ``1.0 / d`` a Python float (a double), which is what torch's reducer
# computes (``at::mul_out(bucket_view, grad, wrapped_scalar_tensor(1.0 / div_factor))``; the
# kernel rounds the scalar to the tensor's compute type, float32 for float32, float16 and
# bfloat16, and multiplies). For d a power of two both are exact and agree; otherwise they
# can differ in the last bit. Even in "reciprocal" mode torch divides on two paths, and so
# does this reducer there: a dense gradient that already lives in its bucket view
# (gradient_as_bucket_view, accumulated in place: ``bucket_view.div_(div_factor)``; this
# reducer divides such small views by runs, see Note [Bucket views scaled by runs] in
# reducer.reducer) and a sparse gradient (``div_``). Which of the two a bucket view's
# gradient is follows torch's .grad: torch leaves a gradient that autograd created afresh
# while accumulating locally (no_sync after set_to_none) where it is, and multiplies it into
# the view at the synced hook;
# this reducer moves it into the view at once (``BucketViews.move_into``), and remembers it
# (``BucketViews.fresh``) so that the synced hook multiplies it there, as torch does.
# Comm hooks get undivided buckets and scale as they choose
# (torch's built-in ones divide). ``create_graph`` changes nothing: torch multiplies into a
# temporary there and copies it in, the same bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, cast

import torch
from torch import Tensor

from .buckets import Bucket, BucketReplica
from .errors import InvalidArgument, hook_result_shape_error, view_replaced_error

__all__: list[str] = []

GradientScaling = Literal["divide", "reciprocal"]
GRADIENT_SCALINGS: tuple[GradientScaling, ...] = ("divide", "reciprocal")


def check_gradient_scaling(value: object) -> GradientScaling:
    """``value`` if it names a rounding of Note [Gradient scaling], else a clear error."""
    for mode in GRADIENT_SCALINGS:
        if value == mode and isinstance(value, str):
            return mode
    raise InvalidArgument(
        f"gradient_scaling must be 'divide' (g / W, the Reducer's default) or 'reciprocal' "
        f"(g * (1.0 / W), torch's DDP rounding), got {value!r}"
    )


def scale_(tensor: Tensor, divisor: int, mode: GradientScaling) -> None:
    """Scale ``tensor`` in place by ``divisor`` with the rounding ``mode``. See Note
    [Gradient scaling]."""
    if mode == "reciprocal":
        tensor.mul_(1.0 / divisor)
    else:
        tensor.div_(divisor)


def scale_into(grad: Tensor, out: Tensor, divisor: int, mode: GradientScaling) -> None:
    """``out = grad`` scaled by ``divisor`` with the rounding ``mode``, in one pass (the
    same bits as a copy and :func:`scale_`). See Note [Gradient scaling]."""
    if mode == "reciprocal":
        torch.mul(grad, 1.0 / divisor, out=out)
    else:
        torch.div(grad, divisor, out=out)


# -------------------------------------------------------------------------------------------
# Copies.

# torch's multi-tensor copy (what its optimizers use); not public API, hence the fallback.
_FOREACH_COPY: Callable[[list[Tensor], list[Tensor]], None] | None = getattr(
    torch, "_foreach_copy_", None
)


def copy_all(destinations: list[Tensor], sources: list[Tensor]) -> None:
    """``d.copy_(s)`` for every pair, as one call.

    A bucket of many small parameters costs one op dispatch per ``copy_``, which dominates
    the write-back; torch's multi-tensor ``_foreach_copy_`` does them all in one dispatch,
    with the same bits.
    """
    if _FOREACH_COPY is not None and len(destinations) > 1:
        _FOREACH_COPY(destinations, sources)
        return
    for destination, source in zip(destinations, sources, strict=True):
        destination.copy_(source)


_MaybeTensors = list[Tensor] | list[Tensor | None]


def try_copy_all(destinations: _MaybeTensors, sources: _MaybeTensors) -> bool:
    """:func:`copy_all` where every entry is a dense tensor; False (nothing to rely on
    copied) where some entry is None or sparse, which the caller handles one by one."""
    try:
        copy_all(cast(list[Tensor], destinations), cast(list[Tensor], sources))
    except (TypeError, RuntimeError, AttributeError):
        return False
    return True


# -------------------------------------------------------------------------------------------
# Writing results into .grad.


def write_dense(bucket: Bucket, globally_used: list[int] | None) -> None:
    """Copy a reduced dense bucket's averages into each parameter's ``.grad``; where
    ``globally_used`` says no rank used a parameter, its ``.grad`` stays as it was."""
    if globally_used is None:
        # Every parameter's .grad gets its average. Those that have a .grad take it in one
        # multi-tensor copy; a None among them (a first backward, set_to_none) makes the
        # copy raise, and the loop below allocates what is missing.
        done = True
        for replica in bucket.replicas:
            present = [param.grad for param in replica.variables]
            done = try_copy_all(present, replica.views) and done
        if done:
            return
    grads: list[Tensor] = []
    views: list[Tensor] = []
    for replica in bucket.replicas:
        for index, param, view in zip(
            bucket.variable_indices, replica.variables, replica.views, strict=True
        ):
            if globally_used is not None and not globally_used[index]:
                continue  # unused on every rank: .grad stays as it was
            if param.grad is None:
                param.grad = torch.empty_like(param, memory_format=torch.preserve_format)
            grads.append(param.grad)
            views.append(view)
    copy_all(grads, views)


def write_sparse(bucket: Bucket, results: list[Tensor], globally_used: list[int] | None) -> None:
    """A reduced sparse bucket's result becomes ``.grad`` (unless no rank used it)."""
    index = bucket.variable_indices[0]
    if globally_used is not None and not globally_used[index]:
        return
    for replica, result in zip(bucket.replicas, results, strict=True):
        replica.variables[0].grad = result


def adopt_hook_result(bucket: Bucket, results: list[Tensor]) -> None:
    """A comm hook returns the reduced flat tensor; bring it into the bucket's contents."""
    contents = bucket.replicas[0].contents
    result = results[0]
    if result is contents:
        return
    if result.shape != contents.shape:
        raise hook_result_shape_error(bucket.index, tuple(result.shape), tuple(contents.shape))
    contents.copy_(result)


# -------------------------------------------------------------------------------------------
# Gradients as bucket views.


class BucketViews:
    """Keeps each dense ``.grad`` the view of its bucket. See Note [Gradients as bucket views].

    The reducer calls it under its lock: :meth:`attach` when buckets are (re)built,
    :meth:`check_kept` before each iteration, :meth:`set_aside` or :meth:`settle` at a hook
    whose gradient is not in its view already, :meth:`move_into` while accumulating locally,
    and :meth:`write_back` once a bucket is reduced.
    """

    def __init__(self, names: Sequence[str] | None) -> None:
        self._names = names
        # The .grad values of locally unused parameters, by (replica, parameter), set aside
        # while their views hold zeros for the reduction.
        self.kept: dict[tuple[int, int], Tensor] = {}
        # (replica, parameter) whose view holds a gradient that autograd created afresh while
        # accumulating locally, moved in by move_into: torch would hold it in a tensor of its
        # own until the synced hook. See Note [Gradient scaling].
        self.fresh: set[tuple[int, int]] = set()

    def attach(self, buckets: list[Bucket]) -> None:
        """Move existing dense gradients into their bucket views and make .grad the view."""
        self.kept = {}
        # ``fresh`` stays: torch rebuilds its buckets at the first forward after the first
        # iteration, no_sync or not, before any gradient of it exists, so a gradient moved
        # into a view while accumulating before this rebuild is still torch's own tensor.
        with torch.no_grad():
            for bucket in buckets:
                if bucket.expect_sparse_gradient:
                    continue
                for replica in bucket.replicas:
                    for param, view in zip(replica.variables, replica.views, strict=True):
                        if param.grad is not None and param.grad is not view:
                            view.copy_(param.grad)
                            param.grad = view

    def check_kept(self, buckets: list[Bucket]) -> None:
        """Every .grad is still its view (or None): a .grad replaced by user code would
        silently stop being reduced."""
        for bucket in buckets:
            if bucket.expect_sparse_gradient:
                continue
            for replica in bucket.replicas:
                for index, param, view in zip(
                    bucket.variable_indices, replica.variables, replica.views, strict=True
                ):
                    grad = param.grad
                    if grad is None or grad is view:
                        continue
                    raise view_replaced_error(index, self._names)

    def set_aside(self, key: tuple[int, int], param: Tensor, view: Tensor) -> None:
        """``param`` is unused here: its view holds zeros for the reduction, and the values
        of a .grad that is the view wait aside, in case no rank used it."""
        if param.grad is view:
            # .grad keeps being the view; its values wait aside while it holds zeros.
            self.kept[key] = view.clone()
        view.zero_()

    def settle(
        self,
        param: Tensor,
        view: Tensor,
        grad: Tensor | None,
        copy_in: Callable[[Tensor, Tensor], object] = Tensor.copy_,
    ) -> None:
        """``param`` is used, but its gradient is not in its view (``grad``: what it
        contributes, None for zeros): copy it in (``copy_in(view, grad)``, which may scale
        on the way), and make .grad the view."""
        if grad is None:
            view.zero_()
        else:
            copy_in(view, grad)
            param.grad = view  # a fresh gradient (after set_to_none): the bucket holds it now

    def move_into(self, replica: BucketReplica, intra: int, key: tuple[int, int]) -> None:
        """A gradient autograd created afresh (after set_to_none) while accumulating locally
        moves into its view, so that .grad is the view again (remembered in ``fresh``)."""
        param, view = replica.variables[intra], replica.views[intra]
        if param.grad is not None and param.grad is not view:
            view.copy_(param.grad)
            param.grad = view
            self.fresh.add(key)

    def write_back(self, bucket: Bucket, globally_used: list[int] | None) -> None:
        """The average is in the bucket; make every used .grad that view.

        A parameter unused on every rank gets its values back."""
        for r, replica in enumerate(bucket.replicas):
            for index, param, view in zip(
                bucket.variable_indices, replica.variables, replica.views, strict=True
            ):
                kept = self.kept.pop((r, index), None)
                if globally_used is not None and not globally_used[index]:
                    if kept is not None:
                        view.copy_(kept)  # unused on every rank: .grad as it was
                    continue
                if param.grad is not view:
                    param.grad = view
