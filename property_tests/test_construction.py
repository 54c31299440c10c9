"""Property: this DDP takes or refuses its construction arguments as torch's DDP does.

A user swapping ``torch.nn.parallel.DistributedDataParallel`` for this one changes no other
line, their CPU script's ``device_ids`` and ``output_device`` included. Over drawn device
arguments (lists, bare values, devices, indices) and a SyncBatchNorm drawn anywhere in the
module (or none), torch's DDP and this one, built on the same rank, either both accept
them, or both refuse them, this one with an exception that is an instance of torch's
(a ``ValueError`` or a ``TypeError``) and names the argument. And a mixed-precision
configuration is taken exactly when each of its dtypes is one torch computes in (or None),
else refused naming its first wrong field and why.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import fakepg
import reducer

_DEVICE_IDS = st.sampled_from(
    [None, [], [0], [1], ["cpu"], [torch.device("cpu")], 0, "cpu", [0, 1], (0,)]
)
_OUTPUT_DEVICES = st.sampled_from([None, 0, 1, "cpu", torch.device("cpu")])


@st.composite
def constructions(draw: st.DrawFn) -> dict[str, Any]:
    """Device arguments, and where a SyncBatchNorm sits in a small CPU module (None: no
    SyncBatchNorm; else its position among the layers and how deep it is nested)."""
    sync = draw(st.none() | st.tuples(st.integers(0, 2), st.integers(0, 2)))
    return {
        "device_ids": draw(_DEVICE_IDS),
        "output_device": draw(_OUTPUT_DEVICES),
        "sync": sync,
    }


def _module(sync: tuple[int, int] | None) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)]
    if sync is not None:
        position, depth = sync
        norm: nn.Module = nn.SyncBatchNorm(4)
        for _ in range(depth):
            norm = nn.Sequential(norm)
        layers.insert(position, norm)
    return nn.Sequential(*layers)


def _outcome(build: Any) -> BaseException | None:
    try:
        build()
    except (ValueError, TypeError) as error:
        return error
    return None


def construction_is_torchs(case: dict[str, Any]) -> None:
    kwargs = {"device_ids": case["device_ids"], "output_device": case["output_device"]}

    def fn(_pg: fakepg.FakeProcessGroup) -> tuple[BaseException | None, BaseException | None]:
        torchs = _outcome(
            lambda: nn.parallel.DistributedDataParallel(_module(case["sync"]), **kwargs)
        )
        ours = _outcome(lambda: reducer.DistributedDataParallel(_module(case["sync"]), **kwargs))
        return torchs, ours

    [(torchs, ours)] = fakepg.run_torch(fn, 1)
    if torchs is None:
        assert ours is None, f"torch's DDP takes {case}; this one refuses it: {ours!r}"
        return
    assert isinstance(ours, reducer.InvalidArgument), f"torch's refuses {case} ({torchs!r})"
    assert isinstance(ours, type(torchs)), f"{case}: torch raises {torchs!r}, this {ours!r}"
    named = "SyncBatchNorm" if "SyncBatchNorm" in str(torchs) else "device"
    assert named in str(ours), f"{case}: {ours}"


@given(constructions())
@settings(max_examples=40, deadline=None)
def test_construction_arguments_are_taken_or_refused_as_torch_does(case: dict[str, Any]) -> None:
    construction_is_torchs(case)


_DTYPES = [
    None,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int32,
    torch.bool,
    torch.complex64,
    "float16",
]
# What each field is cast for, as the refusal of a storage-only dtype says.
_USES = {
    "param_dtype": "forward and backward",
    "reduce_dtype": "the gradients' reduction (a sum over the ranks, then a division)",
    "buffer_dtype": "the buffers' updates",
}


def _refusal(field: str, value: object) -> str | None:
    """The message this DDP gives for ``field=value`` in a mixed-precision configuration,
    None where it takes it."""
    if value is None or value in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        return None
    if not isinstance(value, torch.dtype):
        return (
            "DistributedDataParallel: mixed_precision must be a "
            "torch.nn.parallel.distributed._MixedPrecision (param_dtype, reduce_dtype, "
            f"buffer_dtype: each a torch.dtype or None); {field} is {value!r}"
        )
    if not value.is_floating_point:
        return (
            f"DistributedDataParallel: mixed_precision.{field} is {value}, which is not a real "
            "floating-point dtype; gradients, parameters and buffers are cast to it. Pass "
            f"{field}=torch.float16, torch.bfloat16 or torch.float32 (or None)"
        )
    return (
        f"DistributedDataParallel: mixed_precision.{field} is {value}, a storage-only "
        "floating-point dtype: torch has no addition or division in it (float8 and float4 "
        f"types hold values for scaled kernels), so {_USES[field]} cannot happen in it. Pass "
        f"{field}=torch.bfloat16, torch.float16 or torch.float32 (or None)"
    )


@given(
    dtypes=st.fixed_dictionaries({field: st.sampled_from(_DTYPES) for field in _USES}),
)
@settings(max_examples=40, deadline=None)
def test_mixed_precision_dtypes_are_refused_by_field(dtypes: dict[str, Any]) -> None:
    """Property: a mixed-precision configuration is taken exactly when each of its dtypes is
    None or one torch computes in; else this DDP refuses it at construction, naming the
    first field (in param, reduce, buffer order) and what it cannot be, in these words."""
    from torch.nn.parallel.distributed import _MixedPrecision

    config = _MixedPrecision(**dtypes)
    first = next(
        (text for f in _USES if (text := _refusal(f, dtypes[f])) is not None),
        None,
    )

    def fn(_pg: fakepg.FakeProcessGroup) -> BaseException | None:
        return _outcome(
            lambda: reducer.DistributedDataParallel(_module(None), mixed_precision=config)
        )

    [refused] = fakepg.run_torch(fn, 1)
    if first is None:
        assert refused is None, refused
    else:
        assert isinstance(refused, reducer.InvalidArgument), (dtypes, refused)
        assert str(refused) == first, str(refused)
