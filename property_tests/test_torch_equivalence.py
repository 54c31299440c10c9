"""Property 5: bucket assignment equals torch's on the parameters of random models."""

from __future__ import annotations

import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import reducer

from .model import ModelSpec, build_model, sparse_flags
from .strategies import model_specs


@given(
    model_specs(max_branches=6, max_params=16),
    st.lists(st.integers(0, 4096), min_size=1, max_size=4),
    st.booleans(),
)
def test_bucket_assignment_equals_torchs(spec: ModelSpec, limits: list[int], reverse: bool) -> None:
    model = build_model(spec)
    params = list(model.parameters())
    sparse = sparse_flags(model)
    if reverse:  # the order DDP buckets in: last layers first
        params, sparse = params[::-1], sparse[::-1]
    ours = reducer.compute_bucket_assignment_by_size(params, limits, sparse)
    theirs, _ = dist._compute_bucket_assignment_by_size(params, limits, sparse)
    assert ours == [list(b) for b in theirs]
