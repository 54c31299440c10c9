"""Bucket assignment (equal to torch's) and the bucket layout."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

import reducer
from reducer.buckets import (
    FUSED_DIVISION_MIN_NUMEL,
    _is_non_overlapping_and_dense,
    build_buckets,
    shadow_bucket,
    validate_bucket_indices,
)

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32]


@st.composite
def bucketing_inputs(draw: st.DrawFn) -> tuple[list[torch.Tensor], list[int], list[bool]]:
    count = draw(st.integers(1, 24))
    tensors = [
        torch.empty(draw(st.integers(0, 3000)), dtype=draw(st.sampled_from(DTYPES)))
        for _ in range(count)
    ]
    limits = draw(st.lists(st.integers(0, 12000), min_size=1, max_size=4))
    sparse = draw(st.lists(st.booleans(), min_size=count, max_size=count))
    return tensors, limits, sparse


@given(bucketing_inputs(), st.booleans())
def test_assignment_equals_torchs(
    inputs: tuple[list[torch.Tensor], list[int], list[bool]], pass_sparse: bool
) -> None:
    tensors, limits, sparse = inputs
    if pass_sparse:
        ours = reducer.compute_bucket_assignment_by_size(tensors, limits, sparse)
        theirs = dist._compute_bucket_assignment_by_size(tensors, limits, sparse)[0]
    else:
        ours = reducer.compute_bucket_assignment_by_size(tensors, limits)
        theirs = dist._compute_bucket_assignment_by_size(tensors, limits)[0]
    assert ours == [list(b) for b in theirs]


@given(bucketing_inputs(), st.integers(1, 12000), st.integers(1, 12000))
def test_ddp_assignment_is_torchs_ddp_rule(
    inputs: tuple[list[torch.Tensor], list[int], list[bool]], first: int, cap: int
) -> None:
    """torch's DDP: bucket in parameter order with [first, cap] bytes, then reverse the list."""
    tensors, _, sparse = inputs
    mib = float(1 << 20)
    ours = reducer.ddp_bucket_assignment(
        tensors, bucket_cap_mb=cap / mib, first_bucket_mb=first / mib, expect_sparse_gradient=sparse
    )
    theirs = dist._compute_bucket_assignment_by_size(tensors, [first, cap], sparse)[0]
    assert ours == [list(b) for b in reversed(theirs)]


# Every key torch's hash map may hold here, so that keys share its hash buckets.
ALL_KEYS = [
    (dtype, device)
    for dtype in (*DTYPES, torch.int64, torch.int8, torch.uint8, torch.bool, torch.complex64)
    for device in ("cpu", "meta")
]


@given(st.data())
def test_assignment_in_ready_order_equals_torchs_rebuild(data: st.DataObject) -> None:
    """With ``tensor_indices`` (torch's rebuild): the same buckets in the same order, the
    open ones last in torch's hash-map order (see Note [Rebuilt buckets are not sorted])."""
    keys = data.draw(st.lists(st.sampled_from(ALL_KEYS), min_size=1, max_size=14, unique=True))
    count = data.draw(st.integers(1, 24))
    tensors = [
        torch.empty(data.draw(st.integers(0, 600)), dtype=dtype, device=device)
        for dtype, device in (data.draw(st.sampled_from(keys)) for _ in range(count))
    ]
    limits = data.draw(st.lists(st.integers(0, 3000), min_size=1, max_size=3))
    sparse = data.draw(st.lists(st.booleans(), min_size=count, max_size=count))
    order = data.draw(st.permutations(range(count)))
    ours = reducer.compute_bucket_assignment_by_size(tensors, limits, sparse, order)
    theirs = dist._compute_bucket_assignment_by_size(tensors, limits, sparse, order)[0]
    assert ours == [list(b) for b in theirs]


def test_tensor_indices_must_order_every_tensor() -> None:
    with pytest.raises(reducer.InvalidArgument, match="tensor_indices must order the 2"):
        reducer.compute_bucket_assignment_by_size([torch.empty(2)] * 2, [10], None, [1, 1])


def test_limits_advance_per_key_and_the_last_repeats() -> None:
    f32 = [torch.empty(10) for _ in range(6)]  # 40 bytes each
    # First bucket closes at >= 40 bytes, later ones at >= 80.
    assert reducer.compute_bucket_assignment_by_size(f32, [40, 80]) == [[0], [1, 2], [3, 4], [5]]


def test_buckets_never_mix_dtypes_and_sparse_parameters_stand_alone() -> None:
    tensors = [torch.empty(4), torch.empty(4, dtype=torch.float64), torch.empty(4), torch.empty(4)]
    got = reducer.compute_bucket_assignment_by_size(tensors, [1 << 20], [False, False, True, False])
    assert got == [[0, 3], [1], [2]]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (([], [10]), "non-empty list of tensors"),
        (([torch.empty(2)], []), "bucket_size_limits must be a non-empty list"),
        (([torch.empty(2)], [-1]), "byte counts >= 0"),
        (([torch.empty(2)], [10], [True, False]), "2 entries for 1 tensors"),
        (([torch.empty(2).to_sparse()], [10]), "tensor 0 is sparse"),
    ],
)
def test_assignment_rejects_bad_input(args: tuple[object, ...], match: str) -> None:
    with pytest.raises(reducer.InvalidArgument, match=match):
        reducer.compute_bucket_assignment_by_size(*args)  # type: ignore[arg-type]


NAMES = ["a.weight", "a.bias", "b.weight"]


@pytest.mark.parametrize(
    ("indices", "match"),
    [
        ([[0, 1], []], "bucket 1 is empty"),
        ([[0, 1, 5], [2]], "parameter index 5, out of range: the model has 3 parameters"),
        ([[0, 1, 1], [2]], r"parameter 1 \('a.bias'\) is twice in bucket 0"),
        ([[0, 1], [1, 2]], r"parameter 1 \('a.bias'\) is in bucket 0 and bucket 1"),
        ([[0, 1]], r"parameter 2 \('b.weight'\) is in no bucket"),
        ([[0, "1"], [2]], "holds '1', not a parameter index"),
        ([[0, True], [2]], "holds True"),
        ("01", "must be a list of lists"),
        (["01", [2]], "bucket 0 is empty or not a list"),
    ],
)
def test_bucket_indices_are_validated(indices: object, match: str) -> None:
    with pytest.raises(reducer.BucketAssignmentError, match=match):
        validate_bucket_indices(indices, 3, NAMES)


def test_a_bucket_holds_one_dtype_and_device() -> None:
    """A RuntimeError, as torch's reducer raises, and a BucketAssignmentError."""
    params = [torch.zeros(2), torch.zeros(2, dtype=torch.float64)]
    with pytest.raises(reducer.MixedBucketError, match=r"bucket 0 mixes dtypes") as info:
        build_buckets([params], [[0, 1]], [False, False], ["x", "y"])
    assert isinstance(info.value, RuntimeError)
    assert isinstance(info.value, reducer.BucketAssignmentError)
    assert isinstance(info.value, reducer.ReducerError)


def test_a_sparse_parameter_needs_its_own_bucket() -> None:
    params = [torch.zeros(2), torch.zeros(3, 2)]
    with pytest.raises(reducer.BucketAssignmentError, match=r"parameter 1 \('e'\), which expects"):
        build_buckets([params], [[0, 1]], [False, True], ["w", "e"])


def test_layout_views_alias_the_contents() -> None:
    big = FUSED_DIVISION_MIN_NUMEL
    params = [torch.zeros(3, 4), torch.zeros(big), torch.zeros(5), torch.zeros(7)]
    buckets, locators = build_buckets([params], [[2, 1, 0], [3]], [False] * 4, None)
    first = buckets[0].replicas[0]
    assert first.offsets == [0, 5, 5 + big]
    assert first.lengths == [5, big, 12]
    assert [tuple(v.shape) for v in first.views] == [(5,), (big,), (3, 4)]
    for view, offset in zip(first.views, first.offsets, strict=True):
        assert view.data_ptr() == first.contents.data_ptr() + 4 * offset
    assert first.fused == [False, True, False]
    # The runs divided at completion cover exactly the parameters not divided while copied.
    assert [(r.data_ptr() - first.contents.data_ptr()) // 4 for r in first.scale_runs] == [
        0,
        5 + big,
    ]
    assert [r.numel() for r in first.scale_runs] == [5, 12]
    assert locators[0] == reducer.buckets.Locator(0, 2)
    assert locators[3] == reducer.buckets.Locator(1, 0)
    assert buckets[0].nbytes == 4 * (17 + big)


# -------------------------------------------------------------------------------------------
# Views that follow each parameter's strides.


def occupied(view: torch.Tensor, contents: torch.Tensor) -> list[int]:
    """The positions in ``contents`` that ``view`` covers, in sorted order."""
    with torch.no_grad():
        contents.copy_(torch.arange(contents.numel(), dtype=contents.dtype))
    return sorted(int(v) for v in view.flatten().tolist())


def test_views_follow_each_dense_parameters_strides() -> None:
    """A channels_last weight and a transposed one get views with their own strides; a
    parameter that is not dense (a strided slice) a row-major view. Each view covers exactly
    its slot of the contents."""
    channels_last = torch.zeros(4, 3, 3, 3).to(memory_format=torch.channels_last)
    transposed = torch.zeros(3, 5).t()
    sliced = torch.zeros(4, 6)[:, ::2]
    plain = torch.zeros(2, 3)
    params = [channels_last, transposed, sliced, plain]
    (bucket,), _ = build_buckets([params], [[0, 1, 2, 3]], [False] * 4, None)
    replica = bucket.replicas[0]
    assert [v.stride() for v in replica.views] == [
        channels_last.stride(),
        transposed.stride(),
        (3, 1),
        plain.stride(),
    ]
    assert channels_last.stride() != (27, 9, 3, 1) and transposed.stride() == (1, 5)
    for view, offset, length in zip(replica.views, replica.offsets, replica.lengths, strict=True):
        assert occupied(view, replica.contents) == list(range(offset, offset + length))


def test_a_replica_laid_out_differently_is_refused() -> None:
    first = [torch.zeros(4, 3, 3, 3)]
    second = [torch.zeros(4, 3, 3, 3).to(memory_format=torch.channels_last)]
    with pytest.raises(reducer.InvalidArgument, match=r"parameter 0 \('w'\) has strides"):
        build_buckets([first, second], [[0]], [False], ["w"])


@given(
    st.lists(st.integers(1, 4), min_size=0, max_size=4),
    st.randoms(use_true_random=False),
    st.integers(1, 2),
)
def test_the_density_check_agrees_with_torchs(
    shape: list[int], rng: random.Random, step: int
) -> None:
    """Permuted dimensions, and slices with a step, against torch's own check, seen through
    public behaviour: ``empty_like`` (``preserve_format``) keeps the strides of a
    non-overlapping and dense tensor, and gives any other tensor dense strides, which differ
    from its own."""
    t = torch.zeros(shape)
    order = list(range(len(shape)))
    rng.shuffle(order)
    t = t.permute(order)
    if t.dim() and step > 1:
        t = t[..., ::step]
    torchs = torch.empty_like(t).stride() == t.stride()
    assert _is_non_overlapping_and_dense(t) == torchs


def test_a_shadow_bucket_has_the_layout_and_zeros() -> None:
    """What a rank that ran out of inputs reduces: the same shapes and views, zeros, and the
    real contents left alone."""
    channels_last = torch.zeros(2, 3, 1, 2).to(memory_format=torch.channels_last)
    params = [channels_last, torch.zeros(3), torch.zeros(4, 2)]
    buckets, _ = build_buckets([params], [[0, 1], [2]], [False, False, True], None)
    dense, sparse = buckets
    dense.replicas[0].contents.fill_(7)
    shadow = shadow_bucket(dense)
    copy = shadow.replicas[0]
    assert (shadow.index, shadow.variable_indices) == (0, [0, 1])
    assert copy.contents.shape == dense.replicas[0].contents.shape
    assert copy.contents.data_ptr() != dense.replicas[0].contents.data_ptr()
    assert not copy.contents.any() and bool((dense.replicas[0].contents == 7).all())
    assert copy.offsets == dense.replicas[0].offsets
    assert [v.stride() for v in copy.views] == [v.stride() for v in dense.replicas[0].views]
    assert all(v.data_ptr() >= copy.contents.data_ptr() for v in copy.views)
    sparse_copy = shadow_bucket(sparse).replicas[0].contents
    assert sparse_copy.is_sparse and sparse_copy.shape == (4, 2) and sparse_copy._nnz() == 0
