"""Cluster files (``fakepg.clusterfile``): any cluster written and read back is the same model,
and every spelling of a rate or a time reads as its value.

- the round trip: a drawn :class:`fakepg.NcclModel` or :class:`fakepg.GlooModel` (any node
  count, GPUs and NICs per node, bandwidths and latencies, library settings), written as TOML
  or JSON and read again, equals the model it came from, field for field, and so costs every
  collective the same;
- spellings: a rate written in any unit of bits or bytes (``400 Gbit/s``, ``400 Gb/s``,
  ``400 Gbps``, ``50 GB/s``, a plain number of bytes per second) and a time in any unit read
  as the value it names: a lower-case ``b`` is a bit, an upper-case ``B`` a byte.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import fakepg
from fakepg.clusterfile import _RATES, _TIMES, _parse_toml

_BANDWIDTHS = st.floats(1e6, 1e13, allow_nan=False, allow_infinity=False)
_LATENCIES = st.none() | st.floats(1e-8, 1e-2, allow_nan=False, allow_infinity=False)
_NAMES = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=12)


@st.composite
def topologies(draw: st.DrawFn) -> fakepg.Topology:
    """Any topology: 1 to 16 GPUs and NICs per node, bandwidths from 1 MB/s to 10 TB/s, an
    optional node count and per-hop latencies."""
    return fakepg.Topology(
        draw(st.integers(1, 16)),
        draw(_BANDWIDTHS),
        draw(st.integers(1, 16)),
        draw(_BANDWIDTHS),
        draw(_NAMES),
        draw(st.none() | st.integers(1, 4096)),
        draw(_LATENCIES),
        draw(_LATENCIES),
    )


@st.composite
def cluster_models(draw: st.DrawFn) -> fakepg.NcclModel | fakepg.GlooModel:
    """NCCL or gloo on a drawn topology, the model named as the topology (a file has one
    name for both)."""
    topology = draw(topologies())
    seconds = st.floats(0, 1e-2, allow_nan=False)
    if draw(st.booleans()):
        return fakepg.NcclModel(
            topology,
            draw(st.sampled_from(["auto", "ring", "tree"])),
            draw(seconds),
            topology.name,
            draw(st.floats(0, 0.5, allow_nan=False)),
        )
    return fakepg.GlooModel(
        topology,
        draw(seconds),
        draw(_BANDWIDTHS),
        draw(seconds),
        draw(st.just(0.0) | _BANDWIDTHS),
        topology.name,
    )


@given(cluster_models(), st.sampled_from(["toml", "json"]))
def test_a_cluster_written_and_read_back_is_the_same_model(
    model: fakepg.NcclModel | fakepg.GlooModel, fmt: str
) -> None:
    text = fakepg.dumps_cluster(model, fmt)
    data: Any = _parse_toml(text, "cluster.toml") if fmt == "toml" else json.loads(text)
    again = fakepg.cluster_from_dict(data, source=f"cluster.{fmt}")
    assert again == model, text
    world = model.topology.gpus_per_node * (model.topology.node_count or 2)
    assert again.collective_time_s("allreduce", 1 << 20, world) == model.collective_time_s(
        "allreduce", 1 << 20, world
    )


_RATE_UNITS = sorted(_RATES)
_TIME_UNITS = sorted(_TIMES)


def rate_spellings() -> st.SearchStrategy[dict[str, Any]]:
    """A NIC's bandwidth spelled any way a file may: a number, a unit of bits or bytes, per
    second as "/s", "ps" or nothing, with or without a space."""
    return st.fixed_dictionaries(
        {
            "number": st.integers(1, 10**6),
            "unit": st.sampled_from(_RATE_UNITS),
            "per": st.sampled_from(["/s", "ps", ""]),
            "space": st.sampled_from(["", " "]),
        }
    )


def check_rate_spelling(case: dict[str, Any]) -> None:
    unit = case["unit"]
    multiplier, divisor = _RATES[unit]
    bits = unit[-1] in ("b", "t")  # b, kb, Gbit, ...: a lower-case b is a bit, B a byte
    assert (divisor == 8.0) == bits, unit  # the table itself
    data = {
        "gpus_per_node": 8,
        "nics_per_node": 1,
        "intra_node": {"bandwidth": 1e9},
        "inter_node": {"bandwidth": f"{case['number']}{case['space']}{unit}{case['per']}"},
    }
    model = fakepg.cluster_from_dict(data)
    assert model.topology.nic_Bps == case["number"] * multiplier / divisor, data


@given(rate_spellings())
def test_every_spelling_of_a_rate_reads_as_its_value(case: dict[str, Any]) -> None:
    check_rate_spelling(case)


@given(st.integers(1, 10**6), st.sampled_from(_TIME_UNITS), st.sampled_from(["", " "]))
def test_every_spelling_of_a_time_reads_as_its_value(number: int, unit: str, space: str) -> None:
    multiplier, divisor = _TIMES[unit]
    data = {
        "gpus_per_node": 8,
        "nics_per_node": 1,
        "intra_node": {"bandwidth": 1e9, "latency": f"{number}{space}{unit}"},
        "inter_node": {"bandwidth": 1e9},
    }
    model = fakepg.cluster_from_dict(data)
    assert model.topology.intra_latency_s == number * multiplier / divisor
    assert {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6, "ns": 1e9}[unit] == divisor


_OUT_OF_RANGE = st.sampled_from([-1.0, -1e-9, float("inf"), float("-inf"), float("nan")])
# Each numeric setting of a model, and the text its refusal starts with.
_MODEL_FIELDS = {
    ("nccl", "launch_s"): "NcclModel: launch_s must be >= 0",
    ("nccl", "compute_slowdown"): "NcclModel: compute_slowdown must be in [0, 1)",
    ("gloo", "latency_s"): "GlooModel: latency_s must be >= 0",
    ("gloo", "call_s"): "GlooModel: call_s must be >= 0",
    ("gloo", "copy_Bps"): "GlooModel: copy_Bps must be >= 0",
}


@given(field=st.sampled_from(sorted(_MODEL_FIELDS)), value=_OUT_OF_RANGE)
def test_a_model_refuses_a_setting_out_of_range_by_name(
    field: tuple[str, str], value: float
) -> None:
    """Property: a negative, infinite or NaN setting of a network model is refused when the
    model is made, with a ValueError that names the model and the setting."""
    library, name = field
    topology = fakepg.Topology(gpus_per_node=8, nics_per_node=1, intra_Bps=1e11, nic_Bps=1e10)
    make: Callable[[], object]
    if library == "nccl":
        make = functools.partial(fakepg.NcclModel, topology, **{name: value})
    else:
        settings = {"latency_s": 1e-5, "tcp_Bps": 1e9, "call_s": 1e-5, name: value}
        make = functools.partial(fakepg.GlooModel, topology, **settings)
    with pytest.raises(ValueError, match="^" + re.escape(_MODEL_FIELDS[field])):
        make()


@given(
    kind=st.sampled_from(["rate", "time"]),
    text=st.sampled_from(["fast", "-3", "-2 us", "inf", "1e400", "nan"]),
)
def test_a_cluster_file_refuses_a_quantity_it_cannot_read(kind: str, text: str) -> None:
    """Property: a bandwidth or a latency that is not a quantity >= 0 (a word, a negative or
    infinite number) is refused with the place in the file, what it could not read, and the
    plain unit a number is read in."""
    data: dict[str, Any] = {
        "gpus_per_node": 8,
        "nics_per_node": 1,
        "intra_node": {"bandwidth": 1e11},
        "inter_node": {"bandwidth": text if kind == "rate" else 1e10},
    }
    if kind == "time":
        data["inter_node"]["latency"] = text
    key = "inter_node.bandwidth" if kind == "rate" else "inter_node.latency"
    unit = "bytes per second" if kind == "rate" else "seconds"
    with pytest.raises(ValueError, match="cannot read") as refused:
        fakepg.cluster_from_dict(data, source="cluster.toml")
    message = str(refused.value)
    assert message.startswith(f"cluster.toml: {key}: cannot read {text!r} as a {kind}"), message
    assert message.endswith(f"or a plain number in {unit}"), message
