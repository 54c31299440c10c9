"""The public API is exactly what each package's ``__init__`` exports, and what DESIGN names."""

from __future__ import annotations

import types

import pytest

import fakepg
import reducer


def _public_names(package: types.ModuleType) -> set[str]:
    """Names a user can reach, less submodules and the ``__future__`` import."""
    return {
        name
        for name in dir(package)
        if not name.startswith("_")
        and name != "annotations"
        and not isinstance(getattr(package, name), types.ModuleType)
    }


@pytest.mark.parametrize("package", [reducer, fakepg], ids=lambda p: p.__name__)
def test_all_is_exactly_the_public_names(package: types.ModuleType) -> None:
    assert set(package.__all__) == _public_names(package)
    assert len(package.__all__) == len(set(package.__all__)), "a name is listed twice"


def test_the_design_contract_is_exported() -> None:
    for name in (
        "ReduceOp",
        "Work",
        "ProcessGroup",
        "compute_bucket_assignment_by_size",
        "Reducer",
        "TorchProcessGroup",
    ):
        assert name in reducer.__all__, name
    assert {op.name for op in reducer.ReduceOp} >= {"SUM", "AVG", "MIN", "MAX"}
    for name in ("World", "run"):
        assert name in fakepg.__all__, name
    for method in ("prepare_for_backward", "initialize_buckets", "backward_stats", "close"):
        assert hasattr(reducer.Reducer, method), method
