"""The simulation's exact check (reducer.tools.simulate.verify) and its models' patterns, alone."""

from __future__ import annotations

import pytest
import torch

from reducer import sparse_gradient_flags
from reducer.tools.simulate import models, verify


def test_the_reference_adds_in_rank_order() -> None:
    # float32: (1e8/3 + 1/3) - 1e8/3 loses the small term; another order would keep it.
    grads = [torch.tensor([1e8]), torch.tensor([1.0]), torch.tensor([-1e8])]
    expected = (grads[0] / 3 + grads[1] / 3) + grads[2] / 3
    got = verify.reference_average(grads, None)
    assert got is not None and torch.equal(got, expected)
    assert not torch.equal(got, (grads[0] / 3 + grads[2] / 3) + grads[1] / 3)


def test_a_missing_gradient_counts_as_zeros_and_all_missing_as_none() -> None:
    got = verify.reference_average([None, torch.tensor([2.0, 4.0])], None)
    assert got is not None and torch.equal(got, torch.tensor([1.0, 2.0]))
    assert verify.reference_average([None, None], None) is None


def test_a_wire_dtype_divides_and_sums_in_it() -> None:
    grads = [torch.tensor([1.0 + 2**-12]), torch.tensor([1.0])]
    got = verify.reference_average(grads, torch.float16)
    # 1 + 2^-12 rounds to 1 in float16 before the division: the average is exactly 1.
    assert got is not None and got.dtype == torch.float32 and torch.equal(got, torch.ones(1))


def test_check_dense_reports_one_ulp_with_rank_and_parameter() -> None:
    expected = torch.tensor([1.0, 2.0, 3.0])
    off = expected.clone()
    off[1] = torch.nextafter(off[1], torch.tensor(9.0))
    found = verify.check_dense(4, 7, "fc.weight", [expected.clone(), off], expected)
    assert found is not None
    assert (found.step, found.rank, found.index, found.name) == (4, 1, 7, "fc.weight")
    assert found.max_abs_diff == 2.0**-22
    assert found.message().startswith(
        "step 4, rank 1, parameter 7 ('fc.weight'): max |reduced - reference| = 2.38419e-07 "
        "(1 of 3 elements differ)"
    )
    assert verify.check_dense(4, 7, "fc.weight", [expected.clone()] * 2, expected) is None


def test_check_dense_wants_none_exactly_where_no_rank_had_a_gradient() -> None:
    found = verify.check_dense(0, 1, "b", [None, torch.zeros(2)], None)
    assert found is not None and found.rank == 1 and "unused on every rank" in found.what
    found = verify.check_dense(0, 1, "b", [None], torch.zeros(2))
    assert found is not None and "has no gradient" in found.what


def sparse(indices: list[int], values: list[float], size: int = 6) -> torch.Tensor:
    return torch.sparse_coo_tensor([indices], torch.tensor(values), (size,))


def test_check_sparse_accepts_reordering_and_catches_a_real_error() -> None:
    local = [sparse([0, 2, 2], [1.0, 0.5, 0.25]), None, sparse([2, 5], [3.0, -1.0])]
    exact = sparse([0, 2, 5], [1 / 3, (0.5 + 0.25 + 3.0) / 3, -1 / 3]).coalesce()
    assert verify.check_sparse(3, 0, "emb", [exact, exact, exact], local, None) is None
    wrong = sparse([0, 2, 5], [1 / 3, 0.75 / 3, -1 / 3]).coalesce()  # lost rank 2's 3.0
    found = verify.check_sparse(3, 0, "emb", [exact, wrong, exact], local, None)
    assert found is not None and found.rank == 1 and found.max_abs_diff == pytest.approx(1.0)
    dense = verify.check_sparse(3, 0, "emb", [exact.to_dense()] * 3, local, None)
    assert dense is not None and "expected a sparse reduced gradient" in dense.what


def test_check_same_parameters_names_the_diverged_rank() -> None:
    same = [torch.ones(2), torch.zeros(3)]
    other = [torch.ones(2), torch.tensor([0.0, 0.5, 0.0])]
    found = verify.check_same_parameters(9, ["a", "b"], [same, same, other])
    assert found is not None and (found.rank, found.index, found.max_abs_diff) == (2, 1, 0.5)
    assert verify.check_same_parameters(9, ["a", "b"], [same, same]) is None


def test_branch_patterns() -> None:
    assert models.branch_pattern("none", 2, seed=0, rank=3, step=5, micro=0) == (True, True)
    # rank-skew: branch k runs where (rank + step) % (k + 2) == 0
    skew = [
        models.branch_pattern("rank-skew", 2, seed=0, rank=r, step=1, micro=0) for r in (0, 1, 2)
    ]
    assert skew == [(False, False), (True, False), (False, True)]
    draws = {models.branch_pattern("random", 2, seed=1, rank=r, step=s, micro=0)
             for r in range(4) for s in range(8)}  # fmt: skip
    assert len(draws) == 4  # every combination shows up
    again = models.branch_pattern("random", 2, seed=1, rank=2, step=3, micro=1)
    assert again == models.branch_pattern("random", 2, seed=1, rank=2, step=3, micro=1)
    with pytest.raises(ValueError, match="unknown unused pattern 'sometimes'"):
        models.branch_pattern("sometimes", 1, seed=0, rank=0, step=0, micro=0)


def test_models_build_the_same_weights_every_time() -> None:
    for name in models.MODELS:
        a, b = models.build_model(name, None, 3), models.build_model(name, None, 3)
        for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
            assert na == nb and torch.equal(pa, pb), (name, na)
    emb = models.build_model("embedding", None, 0)
    params = list(emb.parameters())
    assert sparse_gradient_flags(emb, params) == [True, True, False, False, False, False]
