"""Cluster files: a cluster described in TOML or JSON, read into the network model that
:mod:`fakepg.clusternet` costs collectives with, and written back (``--network FILE``).

A file names the machines (GPUs per node, NICs per node, and optionally how many nodes the
cluster has), the links (NVLink inside a node, one NIC between nodes: bandwidth, and
optionally latency), and the collective library (NCCL or gloo) with its settings::

    name = "my-h100-cluster"
    nodes = 4                  # optional: the world must fit; the default world size
    gpus_per_node = 8
    nics_per_node = 8

    [intra_node]               # NVLink / NVSwitch: each GPU's bus bandwidth, one direction
    bandwidth = "450 GB/s"
    latency = "3.4 us"         # optional: one step of NCCL's Simple ring (default: NCCL's)

    [inter_node]               # one NIC
    bandwidth = "400 Gbit/s"
    latency = "14 us"          # optional, as above

    [library]
    name = "nccl"              # or "gloo"
    algorithm = "auto"         # nccl: auto, ring or tree (NCCL_ALGO)
    launch = "0 us"            # nccl: the host's cost to launch one collective
    compute_slowdown = 0.06    # nccl: see Note [Communication slowing compute]

For gloo, ``[library]`` takes ``tcp_bandwidth`` (one TCP connection), ``step_latency``,
``call`` (the fixed cost of one call) and ``copy_bandwidth`` (device-host copies of GPU
tensors; 0 for CPU tensors) instead; the links' latencies are NCCL's and not read.

Quantities are strings with a unit or plain numbers in base units (bytes per second,
seconds). Rates: ``B/s``, ``kB/s``, ``MB/s``, ``GB/s``, ``TB/s`` (bytes) and ``bit/s``,
``kbit/s``, ``Mbit/s``, ``Gbit/s``, ``Tbit/s`` (bits; ``Gb/s`` and ``Gbps`` too: a lower-case
``b`` is a bit), decimal prefixes; times: ``s``, ``ms``, ``us`` (or ``µs``), ``ns``. A key the
format does not have is an error, never ignored. :func:`cluster_to_dict` writes every field
in a unit that reads back to the same float, so a file written and read again gives the
same model (tested as a property).
"""

from __future__ import annotations

import importlib
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .clusternet import GlooModel, NcclModel, Topology

__all__ = ["cluster_from_dict", "cluster_to_dict", "dumps_cluster", "load_cluster"]

ClusterModel = NcclModel | GlooModel

# unit -> (multiplier, divisor) to bytes per second / seconds: dividing rounds once.
_RATES: dict[str, tuple[float, float]] = {
    "B": (1.0, 1.0), "kB": (1e3, 1.0), "KB": (1e3, 1.0), "MB": (1e6, 1.0), "GB": (1e9, 1.0),
    "TB": (1e12, 1.0),
    "b": (1.0, 8.0), "bit": (1.0, 8.0), "kb": (1e3, 8.0), "kbit": (1e3, 8.0),
    "Kb": (1e3, 8.0), "Kbit": (1e3, 8.0), "Mb": (1e6, 8.0), "Mbit": (1e6, 8.0),
    "Gb": (1e9, 8.0), "Gbit": (1e9, 8.0), "Tb": (1e12, 8.0), "Tbit": (1e12, 8.0),
}  # fmt: skip
_TIMES: dict[str, tuple[float, float]] = {
    "s": (1.0, 1.0), "ms": (1.0, 1e3), "us": (1.0, 1e6), "µs": (1.0, 1e6), "ns": (1.0, 1e9),
}  # fmt: skip
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-zµ]*)\s*$")
# The units written, in the order tried (the first that reads back exactly wins).
_WRITE_RATES = ("GB", "MB", "kB", "B")
_WRITE_NIC_RATES = ("Gbit", "Mbit", *_WRITE_RATES)  # NICs are sold in bits per second
_WRITE_TIMES = ("us", "ms", "ns", "s")

_TOP = ("name", "nodes", "gpus_per_node", "nics_per_node", "intra_node", "inter_node", "library")
_LINK = ("bandwidth", "latency")
_NCCL = ("name", "algorithm", "launch", "compute_slowdown")
_GLOO = ("name", "tcp_bandwidth", "step_latency", "call", "copy_bandwidth")


class _Reader:
    """Reads the fields of one file, naming the file and the field in every error."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, message: str) -> ValueError:
        return ValueError(f"{self.source}: {where}: {message}")

    def table(self, data: object, where: str, keys: tuple[str, ...]) -> Mapping[str, Any]:
        if not isinstance(data, Mapping):
            raise self.fail(where, f"expected a table of {', '.join(keys)}, got {data!r}")
        unknown = sorted(set(data) - set(keys))
        if unknown:
            raise self.fail(
                where, f"unknown key(s) {', '.join(map(repr, unknown))}; the keys are "
                f"{', '.join(keys)}"
            )  # fmt: skip
        return data

    def count(self, data: Mapping[str, Any], key: str, *, required: bool = True) -> int | None:
        value = data.get(key)
        if value is None and not required:
            return None
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise self.fail(key, f"expected an integer of 1 or more, got {value!r}")
        return value

    def quantity(
        self,
        data: Mapping[str, Any],
        key: str,
        where: str,
        units: dict[str, tuple[float, float]],
        *,
        required: bool,
        zero: bool = False,
    ) -> float | None:
        value = data.get(key)
        place = f"{where}.{key}" if where else key
        if value is None:
            if required:
                raise self.fail(place, "missing")
            return None
        number = _read_quantity(value, units)
        if number is None or not math.isfinite(number) or number < 0 or (number == 0 and not zero):
            kind = "a rate" if units is _RATES else "a time"
            raise self.fail(
                place,
                f"cannot read {value!r} as {kind} {'>= 0' if zero else '> 0'}: write a number "
                f"with one of the units {', '.join(units)} (per second for a rate), or a plain "
                f"number in {'bytes per second' if units is _RATES else 'seconds'}",
            )
        return number


def _read_quantity(value: object, units: dict[str, tuple[float, float]]) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, str):
        return None
    text = value.strip()
    if units is _RATES:
        for suffix in ("/s", "ps"):
            if text.endswith(suffix) and text[: -len(suffix)].rstrip()[-1:].isalpha():
                text = text[: -len(suffix)]
                break
    match = _QUANTITY.match(text)
    if match is None:
        return None
    unit = match.group(2)
    if not unit:
        return float(match.group(1))
    if unit not in units:
        return None
    multiplier, divisor = units[unit]
    return float(match.group(1)) * multiplier / divisor


def cluster_from_dict(data: Mapping[str, Any], *, source: str = "cluster") -> ClusterModel:
    """The network model a cluster file's contents (parsed TOML or JSON) describe; a
    ValueError naming ``source`` and the field for anything it cannot read."""
    r = _Reader(source)
    top = r.table(data, "the file", _TOP)
    for key in ("gpus_per_node", "nics_per_node", "intra_node", "inter_node"):
        if key not in top:
            raise r.fail(key, "missing (see the format in fakepg.clusterfile)")
    name = top.get("name", "")
    if not isinstance(name, str):
        raise r.fail("name", f"expected a string, got {name!r}")
    intra = r.table(top["intra_node"], "intra_node", _LINK)
    inter = r.table(top["inter_node"], "inter_node", _LINK)
    library = r.table(top.get("library", {"name": "nccl"}), "library", (*_NCCL, *_GLOO))
    kind = library.get("name", "nccl")
    if kind not in ("nccl", "gloo"):
        raise r.fail("library.name", f"expected 'nccl' or 'gloo', got {kind!r}")
    r.table(library, "library", _NCCL if kind == "nccl" else _GLOO)
    gpus, nics = r.count(top, "gpus_per_node"), r.count(top, "nics_per_node")
    assert gpus is not None and nics is not None  # required
    try:
        topology = Topology(
            gpus,
            _required(r.quantity(intra, "bandwidth", "intra_node", _RATES, required=True)),
            nics,
            _required(r.quantity(inter, "bandwidth", "inter_node", _RATES, required=True)),
            name,
            r.count(top, "nodes", required=False),
            r.quantity(intra, "latency", "intra_node", _TIMES, required=False),
            r.quantity(inter, "latency", "inter_node", _TIMES, required=False),
        )
        if kind == "nccl":
            slowdown = library.get("compute_slowdown", 0.0)
            if isinstance(slowdown, bool) or not isinstance(slowdown, int | float):
                raise r.fail("library.compute_slowdown", f"expected a number, got {slowdown!r}")
            return NcclModel(
                topology,
                library.get("algorithm", "auto"),
                r.quantity(library, "launch", "library", _TIMES, required=False, zero=True) or 0.0,
                name,
                float(slowdown),
            )
        return GlooModel(
            topology,
            _required(r.quantity(library, "step_latency", "library", _TIMES, required=True,
                                 zero=True)),
            _required(r.quantity(library, "tcp_bandwidth", "library", _RATES, required=True)),
            _required(r.quantity(library, "call", "library", _TIMES, required=True, zero=True)),
            r.quantity(library, "copy_bandwidth", "library", _RATES, required=False, zero=True)
            or 0.0,
            name,
        )  # fmt: skip
    except ValueError as exc:
        if str(exc).startswith(f"{source}:"):
            raise
        raise ValueError(f"{source}: {exc}") from None


def _required(value: float | None) -> float:
    assert value is not None  # the reader raised where a required field was missing
    return value


def cluster_to_dict(model: ClusterModel) -> dict[str, Any]:
    """The file's contents for ``model`` (an :class:`NcclModel` or a :class:`GlooModel`):
    each quantity as a string in a unit that reads back to the same float."""
    t = model.topology
    data: dict[str, Any] = {"name": model.name or t.name}
    if t.node_count is not None:
        data["nodes"] = t.node_count
    data["gpus_per_node"] = t.gpus_per_node
    data["nics_per_node"] = t.nics_per_node
    data["intra_node"] = {"bandwidth": _write(t.intra_Bps, _RATES, _WRITE_RATES, "/s")}
    data["inter_node"] = {"bandwidth": _write(t.nic_Bps, _RATES, _WRITE_NIC_RATES, "/s")}
    if t.intra_latency_s is not None:
        data["intra_node"]["latency"] = _write(t.intra_latency_s, _TIMES, _WRITE_TIMES, "")
    if t.nic_latency_s is not None:
        data["inter_node"]["latency"] = _write(t.nic_latency_s, _TIMES, _WRITE_TIMES, "")
    if isinstance(model, NcclModel):
        data["library"] = {
            "name": "nccl",
            "algorithm": model.algorithm,
            "launch": _write(model.launch_s, _TIMES, _WRITE_TIMES, ""),
            "compute_slowdown": model.compute_slowdown,
        }
    else:
        data["library"] = {
            "name": "gloo",
            "tcp_bandwidth": _write(model.tcp_Bps, _RATES, _WRITE_RATES, "/s"),
            "step_latency": _write(model.latency_s, _TIMES, _WRITE_TIMES, ""),
            "call": _write(model.call_s, _TIMES, _WRITE_TIMES, ""),
            "copy_bandwidth": _write(model.copy_Bps, _RATES, _WRITE_RATES, "/s"),
        }
    return data


def _write(
    value: float, units: dict[str, tuple[float, float]], order: tuple[str, ...], per: str
) -> str | float:
    """``value`` in the first unit of ``order`` that reads back to the very same float, else
    the plain number (base units)."""
    for unit in order:
        multiplier, divisor = units[unit]
        number = value * divisor / multiplier
        text = repr(number)
        if "e" in text or "inf" in text or "nan" in text:
            continue
        if float(text) * multiplier / divisor == value:
            return f"{text.removesuffix('.0')} {unit}{per}"
    return float(value)


def dumps_cluster(model: ClusterModel, fmt: str = "toml") -> str:
    """``model`` as the text of a cluster file, ``fmt`` "toml" or "json"."""
    data = cluster_to_dict(model)
    if fmt == "json":
        return json.dumps(data, indent=2) + "\n"
    if fmt != "toml":
        raise ValueError(f"dumps_cluster: fmt must be 'toml' or 'json', got {fmt!r}")
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(f"\n[{key}]")
            lines.extend(f"{k} = {_toml_value(v)}" for k, v in value.items())
    return "\n".join(lines) + "\n"


def _toml_value(value: object) -> str:
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, float):
        return repr(value)
    return str(value)


def load_cluster(path: str | Path) -> ClusterModel:
    """The network model of the cluster file at ``path`` (``.toml`` or ``.json``)."""
    file = Path(path)
    if file.suffix not in (".toml", ".json"):
        raise ValueError(f"{path}: a cluster file ends in .toml or .json")
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read the cluster file: {exc.strerror}") from None
    if file.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from None
    else:
        data = _parse_toml(text, str(path))
    return cluster_from_dict(data, source=str(path))


def _parse_toml(text: str, source: str) -> Any:
    toml: Any = None
    for name in ("tomllib", "tomli"):  # the standard library's from Python 3.11, else tomli
        try:
            toml = importlib.import_module(name)
            break
        except ImportError:
            continue
    if toml is None:
        raise ValueError(
            f"{source}: reading TOML needs Python 3.11 (tomllib) or the tomli package; "
            "install tomli, or write the cluster file as JSON"
        )
    try:
        return toml.loads(text)
    except toml.TOMLDecodeError as exc:
        raise ValueError(f"{source}: not valid TOML: {exc}") from None
