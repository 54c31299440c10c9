"""Property 5: bucket assignment equals torch's ``_compute_bucket_assignment_by_size``.

On arbitrary tensor lists (four dtypes, two devices, sparse flags or none, any limits) and on
the parameters of random models, in forward order and in the reverse order DDP buckets in.
Both get the core properties' example count (four times the profile's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor

import reducer
from reducer.testing.harness import note_size
from reducer.testing.model import ModelSpec, build_model, sparse_flags
from reducer.testing.strategies import bucketing_inputs, model_specs, size_limits

Assign = Callable[[Sequence[Tensor], Sequence[int], Sequence[bool] | None], list[list[int]]]


def check_bucket_assignment(
    tensors: Sequence[Tensor],
    limits: Sequence[int],
    sparse: Sequence[bool] | None,
    assign: Assign | None = None,
) -> None:
    """``assign`` (``reducer.compute_bucket_assignment_by_size`` as it is now, by default)
    gives torch's buckets."""
    note_size(len(tensors), None)
    ours = (assign or reducer.compute_bucket_assignment_by_size)(tensors, limits, sparse)
    # torch takes [] for "no sparse flags"; ours takes None too.
    theirs, _ = dist._compute_bucket_assignment_by_size(  # type: ignore[attr-defined]
        list(tensors), list(limits), list(sparse or [])
    )
    assert ours == [list(b) for b in theirs], (
        f"bucket assignment differs from torch's for limits {limits}, sparse {sparse}, tensors "
        f"{[(t.numel(), str(t.dtype), str(t.device)) for t in tensors]}: ours {ours}, "
        f"torch's {theirs}"
    )


# As many examples as the core properties (ci: 100): a bug may need two keys whose buckets
# fill up side by side, with two limits, to show.
@settings(max_examples=4 * settings().max_examples)
@given(bucketing_inputs())
def test_bucket_assignment_of_any_tensors_equals_torchs(
    case: tuple[list[Tensor], list[int], list[bool] | None],
) -> None:
    check_bucket_assignment(*case)


@settings(max_examples=4 * settings().max_examples)
@given(model_specs(max_branches=6, max_params=16, allow_wide=True), st.booleans(), st.data())
def test_bucket_assignment_of_model_parameters_equals_torchs(
    spec: ModelSpec, reverse: bool, data: st.DataObject
) -> None:
    model = build_model(spec)
    params = list(model.parameters())
    sparse = sparse_flags(model)
    if reverse:  # the order DDP buckets in: last layers first
        params, sparse = params[::-1], sparse[::-1]
    limits = data.draw(size_limits([p.numel() * p.element_size() for p in params]))
    check_bucket_assignment(params, limits, sparse)
