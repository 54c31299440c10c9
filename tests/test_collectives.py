"""The argument checks that fakepg and reducer.TorchProcessGroup share, under each one's rules.

The checks run before any rank is involved, so they are tested here without a world or a
torch.distributed group; tests/test_fakepg_collectives.py and tests/test_torch_backend.py
check that each process group raises them from its calls.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch

from fakepg import collectives as fake
from reducer import InvalidArgument, ReduceOp, torch_backend
from reducer import collectives as args

FAKE = fake.RULES
TORCH = torch_backend._RULES

Check = Callable[[args.CollectiveRules], object]


def _meta(*shape: int) -> torch.Tensor:
    """A tensor on another device than the CPU, with no storage: enough for spec checks."""
    return torch.empty(shape, device="meta")


def _csr() -> torch.Tensor:
    with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
        warnings.simplefilter("ignore", UserWarning)
        return torch.eye(2).to_sparse_csr()


# What each side rejects, with the words its message must contain. Both sides agree on these.
REJECTED_BY_BOTH: dict[str, tuple[Check, str]] = {
    "a tensor, not a list": (
        lambda r: args.check_allreduce(torch.zeros(2), ReduceOp.SUM, r),
        r"allreduce takes a list of tensors, got Tensor; wrap a single tensor as \[tensor\]",
    ),
    "an empty list": (
        lambda r: args.check_tensor_list([], "broadcast", r),
        "broadcast got an empty list of tensors; pass at least one tensor",
    ),
    "a non-tensor element": (
        lambda r: args.check_tensor_list([torch.zeros(1), 3], "broadcast", r),
        "broadcast: element 1 is a int, not a tensor",
    ),
    "an op that is not a ReduceOp": (
        lambda r: args.check_allreduce([torch.zeros(2)], "sum", r),
        "allreduce: op must be a reducer.ReduceOp, got 'sum'",
    ),
    "replicas of different shapes": (
        lambda r: args.check_allreduce([torch.zeros(2), torch.zeros(3)], ReduceOp.SUM, r),
        r"allreduce: tensor 1 is float32\[3\] but tensor 0 is float32\[2\] \(they differ in "
        r"shape\); all tensors of one allreduce \(one per replica\) must match in dtype, shape",
    ),
    "a non-contiguous allreduce tensor": (
        lambda r: args.check_allreduce([torch.zeros(4, 4).t()], ReduceOp.SUM, r),
        r"allreduce: tensor 0 \(float32\[4, 4\]\) is not contiguous, and .* need contiguous "
        r"tensors: pass .contiguous\(\) and copy the result back",
    ),
    "an unsupported layout": (
        lambda r: args.check_allreduce([_csr()], ReduceOp.SUM, r),
        r"allreduce: layout torch.sparse_csr is not supported \(dense or COO\)",
    ),
    "MAX of sparse tensors": (
        lambda r: args.check_allreduce([torch.eye(2).to_sparse()], ReduceOp.MAX, r),
        "allreduce: sparse tensors support SUM and AVG only, not MAX",
    ),
    "AVG of integers": (
        lambda r: args.check_allreduce([torch.zeros(2, dtype=torch.int64)], ReduceOp.AVG, r),
        "allreduce: AVG needs a floating dtype, got torch.int64; use SUM and divide",
    ),
    "one output list for two inputs": (
        lambda r: args.check_allgather(
            [[torch.zeros(1), torch.zeros(1)]], [torch.zeros(1), torch.zeros(1)], 2, r
        ),
        r"allgather: got 2 input tensor\(s\) and output lists of type list of length 1; pass "
        r"one list of size\(\) = 2 outputs per input",
    ),
    "a tensor for the output lists": (
        lambda r: args.check_allgather(torch.zeros(2), [torch.zeros(1)], 2, r),
        "output lists of type Tensor;",
    ),
    "too few outputs": (
        lambda r: args.check_allgather([[torch.zeros(2)]], [torch.zeros(2)], 2, r),
        r"allgather: output list 0 has 1 tensor\(s\); it needs one per rank \(2\)",
    ),
    "an output of another dtype": (
        lambda r: args.check_allgather(
            [[torch.zeros(2), torch.zeros(2, dtype=torch.float64)]], [torch.zeros(2)], 2, r
        ),
        r"allgather: output 0\[1\] is float64\[2\] but input 0 is float32\[2\] \(they differ in "
        r"dtype\); outputs must match their input in dtype, shape",
    ),
    "an output on another device": (
        lambda r: args.check_allgather([[torch.zeros(2), _meta(2)]], [torch.zeros(2)], 2, r),
        r"output 0\[1\] is float32\[2\] on meta but input 0 is float32\[2\] \(they differ in "
        r"device\)",
    ),
    "a reduce root outside the group": (
        lambda r: args.check_reduce([torch.zeros(2)], 3, ReduceOp.SUM, 2, r),
        r"reduce: root must be a rank in \[0, 2\), got 3",
    ),
    "a sparse reduce": (
        lambda r: args.check_reduce([torch.eye(2).to_sparse()], 0, ReduceOp.SUM, 2, r),
        r"reduce: layout torch.sparse_coo is not supported \(dense tensors only\)",
    ),
    "too few reduce_scatter inputs": (
        lambda r: args.check_reduce_scatter(torch.zeros(2), [torch.zeros(2)], ReduceOp.SUM, 2, r),
        r"reduce_scatter: got 1 input tensor\(s\); pass one per rank \(2\)",
    ),
    "a reduce_scatter_tensor input of the wrong size": (
        lambda r: args.check_reduce_scatter_tensor(
            torch.zeros(2), torch.zeros(3), ReduceOp.SUM, 2, r
        ),
        r"reduce_scatter_tensor: the input has 3 elements but needs size\(\) x the output's = "
        r"2 x 2 = 4",
    ),
    "an allgather_into_tensor output of another dtype": (
        lambda r: args.check_allgather_into_tensor(
            torch.zeros(4, dtype=torch.float64), torch.zeros(2), 2, r
        ),
        r"allgather_into_tensor: the output is float64\[4\] but the input is float32\[2\] "
        r"\(they differ in dtype\)",
    ),
    "one all_to_all output for two ranks": (
        lambda r: args.check_all_to_all([torch.zeros(1)], [torch.zeros(1)] * 2, 2, r),
        r"all_to_all: got 1 outputs; pass one per rank \(2\)",
    ),
    "split sizes that do not add up": (
        lambda r: args.check_all_to_all_single(torch.zeros(4), torch.zeros(4), [1, 1], None, 2, r),
        r"all_to_all_single: output_split_sizes \[1, 1\] add up to 2, but dim 0 has 4 rows",
    ),
    "split sizes of the wrong length": (
        lambda r: args.check_all_to_all_single(torch.zeros(4), torch.zeros(4), None, [4], 2, r),
        r"input_split_sizes must be a list of size\(\) = 2 ints >= 0, got \[4\]",
    ),
    "a gather list on a rank that is not the root": (
        lambda r: args.check_gather(torch.zeros(1), [torch.zeros(1)] * 2, 0, 1, 2, r),
        r"gather: gather_list is given on rank 1, but only the root \(rank 0\) passes one",
    ),
    "a scatter root without its list": (
        lambda r: args.check_scatter(torch.zeros(1), None, 1, 1, 2, r),
        r"scatter: the root \(rank 1\) must pass scatter_list, one tensor per rank \(2\)",
    ),
    "a send to this rank itself": (
        lambda r: args.check_peer(0, 0, 2, "send", "dst", r),
        "send: dst=0 is this rank itself",
    ),
    "a negative timeout": (
        lambda r: args.check_timeout(-1.0, "Work.wait", r),
        r"Work.wait: timeout must be a finite number of seconds > 0, got -1.0; pass None",
    ),
    "an infinite timeout": (
        lambda r: args.check_timeout(float("inf"), "monitored_barrier", r),
        "monitored_barrier: timeout must be a finite number of seconds > 0, got inf",
    ),
}


@pytest.mark.parametrize("case", sorted(REJECTED_BY_BOTH))
def test_both_sides_reject_with_the_same_words_and_their_own_error_class(case: str) -> None:
    check, words = REJECTED_BY_BOTH[case]
    with pytest.raises(ValueError, match=words) as fake_error:
        check(FAKE)
    assert type(fake_error.value) is ValueError  # fakepg raises plain ValueErrors
    with pytest.raises(InvalidArgument, match=words):
        check(TORCH)


def test_messages_name_what_needs_contiguous_tensors() -> None:
    t = torch.zeros(4, 4).t()
    with pytest.raises(ValueError, match="and fakepg's kernels need contiguous tensors"):
        args.check_allreduce([t], ReduceOp.SUM, FAKE)
    with pytest.raises(InvalidArgument, match="and torch backends need contiguous tensors"):
        args.check_allreduce([t], ReduceOp.SUM, TORCH)


def test_torch_backends_need_contiguous_tensors_in_every_collective_fakepg_only_in_allreduce() -> (
    None
):
    t = torch.zeros(4, 4).t()
    assert args.check_tensor_list([t], "broadcast", FAKE) == [t]
    outputs, inputs = args.check_allgather([[t, t]], [t], 2, FAKE)
    assert outputs == [[t, t]] and inputs == [t]
    with pytest.raises(InvalidArgument, match=r"broadcast: tensor 0 \(float32\[4, 4\]\) is not"):
        args.check_tensor_list([t], "broadcast", TORCH)
    with pytest.raises(InvalidArgument, match=r"allgather inputs: tensor 0 .* is not contiguous"):
        args.check_allgather([[t, t]], [t], 2, TORCH)
    with pytest.raises(InvalidArgument, match=r"allgather output list 0: tensor 1 .* is not"):
        args.check_allgather([[torch.zeros(4, 4), t]], [torch.zeros(4, 4)], 2, TORCH)


def test_torch_replicas_may_be_on_several_devices_fake_ones_may_not() -> None:
    replicas = [torch.zeros(2), _meta(2)]
    assert args.check_allreduce(replicas, ReduceOp.SUM, TORCH) == replicas
    with pytest.raises(
        ValueError,
        match=r"tensor 1 is float32\[2\] on meta but tensor 0 is float32\[2\] \(they differ in "
        r"device\); .* must match in dtype, shape, layout and device",
    ):
        args.check_allreduce(replicas, ReduceOp.SUM, FAKE)


def test_a_valid_call_returns_its_tensors_as_lists() -> None:
    a, b = torch.zeros(3), torch.ones(3)
    for rules in (FAKE, TORCH):
        assert args.check_allreduce((a, b), ReduceOp.AVG, rules) == [a, b]
        sparse = torch.eye(2).to_sparse()
        assert args.check_allreduce([sparse], ReduceOp.SUM, rules) == [sparse]
        outputs, inputs = args.check_allgather(((a, b),), (a,), 2, rules)
        assert outputs == [[a, b]] and inputs == [a]


def test_tensor_spec_prints_and_compares_what_must_agree() -> None:
    dense = args.TensorSpec.of(torch.zeros(2, 3, dtype=torch.float16))
    sparse = args.TensorSpec.of(torch.eye(3).to_sparse())
    assert str(dense) == "float16[2, 3]"
    assert str(sparse) == "float32[3, 3] sparse_coo"
    assert str(args.TensorSpec.of(_meta(1))) == "float32[1] on meta"
    assert dense.differences(sparse) == ["dtype", "shape", "layout"]
    assert dense.differences(sparse, ("layout", "device")) == ["layout"]
    assert dense.differences(dense) == []


def test_a_timeout_that_is_not_a_number_is_a_type_error_under_both_rules() -> None:
    for rules in (FAKE, TORCH):
        with pytest.raises(TypeError, match="timeout must be a number of seconds or None, got"):
            args.check_timeout("5", "Work.wait", rules)
        with pytest.raises(TypeError, match="got bool"):
            args.check_timeout(True, "Work.wait", rules)
        assert args.check_timeout(None, "Work.wait", rules) is None
        assert args.check_timeout(2, "Work.wait", rules) == 2.0


def test_reductions_need_contiguous_tensors_under_both_rules_data_movement_only_under_torchs() -> (
    None
):
    t = torch.zeros(4, 4).t()
    for rules in (FAKE, TORCH):
        with pytest.raises(ValueError, match="is not contiguous"):
            args.check_reduce_scatter(torch.zeros(4, 4), [t, t], ReduceOp.SUM, 2, rules)
        with pytest.raises(ValueError, match="is not contiguous"):
            args.check_reduce_scatter_tensor(torch.zeros(8), t, ReduceOp.SUM, 2, rules)
    # fakepg copies into and out of strided tensors where nothing is reduced.
    _out, inp = args.check_allgather_into_tensor(torch.zeros(32), t, 2, FAKE)
    assert inp is t
    with pytest.raises(InvalidArgument, match="is not contiguous"):
        args.check_allgather_into_tensor(torch.zeros(32), t, 2, TORCH)
    assert args.check_gather(t, [t, t], 0, 0, 2, FAKE)[1] == [t, t]
    with pytest.raises(InvalidArgument, match="is not contiguous"):
        args.check_gather(t, [t, t], 0, 0, 2, TORCH)


def test_split_sizes_default_to_equal_parts_and_accept_tensors() -> None:
    _out, _inp, out_splits, in_splits = args.check_all_to_all_single(
        torch.zeros(6, 2), torch.zeros(4, 2), [1, 2, 3], torch.tensor([0, 4, 0]), 3, FAKE
    )
    assert (out_splits, in_splits) == ([1, 2, 3], [0, 4, 0])
    assert args.check_all_to_all_single(torch.zeros(6), torch.zeros(6), None, [], 3, FAKE)[2:] == (
        [2, 2, 2],
        [2, 2, 2],
    )


def test_tensor_spec_prints_sizes_that_may_differ_between_ranks_as_a_star() -> None:
    spec = args.TensorSpec(torch.float32, (-1, 4), torch.strided, torch.device("cpu"))
    assert str(spec) == "float32[*, 4]"
