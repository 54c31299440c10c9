"""Simulated network time: how long after its data moved a collective counts as complete.

The fake world moves data at memory speed. A network model adds, per collective, the time a
real interconnect would need, so that overlap of communication with backward can be seen and
measured on one machine. Once every rank has joined, the world reserves the simulated link for
that long (see Note [One link per world] in fakepg.world) and waits, off every rank's thread,
until the reservation ends; then the data lands in the ranks' tensors and the collective
completes.

Two models: :class:`FixedLatency` (every collective takes the same time) and
:class:`AlphaBeta`, the latency-bandwidth model of collective algorithms (see Note
[Alpha-beta cost formulas]). :func:`parse_network` turns a preset name (``"10gbe"``,
``"100gbe-tree"``, see :data:`NETWORK_PRESETS`) or a spec such as
``"latency=25us,bandwidth=10gbit,algorithm=ring"`` into a model.

# Note [Alpha-beta cost formulas]
# A message of n bytes over one link costs alpha + n / B (alpha: per-message latency in
# seconds, B: bandwidth in bytes per second). S is the size of one rank's input, W the world
# size, L = ceil(log2(W)). With W = 1 nothing crosses a link and every collective costs 0.
#
#   collective          ring                                  tree
#   allreduce           2(W-1) alpha + 2(W-1)/W * S/B          2L alpha + 2 S/B
#   allgather           (W-1) (alpha + S/B)                    L alpha + (W-1) S/B
#   broadcast           (W-1) alpha + S/B                      L alpha + S/B
#   barrier             2(W-1) alpha                           2L alpha
#   sparse_allreduce    as allgather (each rank's indices and values are gathered)
#   reduce              as broadcast (the same messages, the other way)
#   reduce_scatter      (W-1) alpha + (W-1)/W * S/B            L alpha + (W-1)/W * S/B
#   all_to_all          (W-1) (alpha + S/(W B))                the same (pairwise exchange)
#   gather, scatter     as allgather (S: one rank's part; the root's link carries W-1 parts)
#   send                alpha + S/B                            the same (one message)
#
# For reduce_scatter and all_to_all, S is one rank's whole input (W parts of S/W). Ring
# allreduce is reduce-scatter then allgather, each W-1 steps of S/W bytes (bandwidth
# optimal, latency linear in W). Tree allreduce is NCCL's pipelined double binary tree: the
# message is cut into chunks that stream up two complementary trees (each carries half) and
# back down, so the latency is logarithmic and every link carries the bytes once each way:
# 2 S/B, the bandwidth NCCL's tuning model gives it (algorithm bandwidth = bus bandwidth / 2,
# src/graph/tuning.cc). Tree broadcast is the same pipeline one way. Tree allgather is
# recursive doubling. Ring broadcast is the pipelined chain in its limit (each
# hop adds a latency, the bytes cross once). A barrier is an allreduce of nothing. Sparse
# allreduce on real backends (gloo) gathers every rank's sparse tensor, so it costs an
# allgather of the rank's sparse bytes.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Literal, Protocol, runtime_checkable

__all__ = ["NETWORK_PRESETS", "AlphaBeta", "FixedLatency", "NetworkModel", "parse_network"]

Algorithm = Literal["ring", "tree"]
_KINDS = (
    "allreduce", "sparse_allreduce", "allgather", "broadcast", "barrier", "reduce",
    "reduce_scatter", "all_to_all", "gather", "scatter", "send",
)  # fmt: skip


# Kinds that cost what another kind costs. See Note [Alpha-beta cost formulas].
_SAME_AS = {
    "sparse_allreduce": "allgather",
    "reduce": "broadcast",
    "gather": "allgather",
    "scatter": "allgather",
}


@runtime_checkable
class NetworkModel(Protocol):
    """Seconds a collective takes on the simulated network."""

    def collective_time_s(self, kind: str, nbytes: int, world_size: int) -> float:
        """``kind`` is "allreduce", "sparse_allreduce", "allgather", "broadcast", "barrier",
        "reduce", "reduce_scatter", "all_to_all", "gather", "scatter" or "send" (one message;
        ``world_size`` 2); ``nbytes`` is the size of one rank's input (all its tensors; for
        scatter, one rank's part)."""
        ...


@dataclass(frozen=True, slots=True)
class FixedLatency:
    """Every collective takes ``seconds``, whatever its size: the simplest slow link."""

    seconds: float

    def __post_init__(self) -> None:
        if not self.seconds >= 0:
            raise ValueError(f"FixedLatency: seconds must be >= 0, got {self.seconds!r}")

    def collective_time_s(self, kind: str, nbytes: int, world_size: int) -> float:
        return self.seconds

    def __str__(self) -> str:
        return f"fixed {_format_seconds(self.seconds)} per collective"


@dataclass(frozen=True, slots=True)
class AlphaBeta:
    """The alpha-beta model: ``latency_s`` per message, ``bandwidth_Bps`` bytes per second per
    link, collectives by the ``algorithm`` ("ring" or "tree"); see Note [Alpha-beta cost
    formulas]. ``name`` is only for display (the preset it came from)."""

    latency_s: float
    bandwidth_Bps: float
    algorithm: Algorithm = "ring"
    name: str = ""

    def __post_init__(self) -> None:
        if not (self.latency_s >= 0 and math.isfinite(self.latency_s)):
            raise ValueError(
                f"AlphaBeta: latency_s must be a finite number >= 0, got {self.latency_s!r}"
            )
        if not self.bandwidth_Bps > 0:
            raise ValueError(
                f"AlphaBeta: bandwidth_Bps must be > 0 bytes per second, got {self.bandwidth_Bps!r}"
            )
        if self.algorithm not in ("ring", "tree"):
            raise ValueError(
                f"AlphaBeta: algorithm must be 'ring' or 'tree', got {self.algorithm!r}"
            )

    def collective_time_s(self, kind: str, nbytes: int, world_size: int) -> float:
        if kind not in _KINDS:
            raise ValueError(
                f"AlphaBeta: unknown collective kind {kind!r}; expected one of {', '.join(_KINDS)}"
            )
        if nbytes < 0 or world_size < 1:
            raise ValueError(
                f"AlphaBeta: nbytes must be >= 0 and world_size >= 1, got {nbytes}, {world_size}"
            )
        w = world_size
        if w == 1:
            return 0.0
        alpha, size = self.latency_s, nbytes / self.bandwidth_Bps
        kind = _SAME_AS.get(kind, kind)
        if kind == "send":
            return alpha + size
        if kind == "all_to_all":
            return (w - 1) * (alpha + size / w)
        if kind == "reduce_scatter":
            steps = w - 1 if self.algorithm == "ring" else math.ceil(math.log2(w))
            return steps * alpha + (w - 1) / w * size
        if self.algorithm == "ring":
            if kind == "allreduce":
                return 2 * (w - 1) * alpha + 2 * (w - 1) / w * size
            if kind == "allgather":
                return (w - 1) * (alpha + size)
            if kind == "broadcast":
                return (w - 1) * alpha + size
            return 2 * (w - 1) * alpha  # barrier
        levels = math.ceil(math.log2(w))
        if kind == "allreduce":  # pipelined: see Note [Alpha-beta cost formulas]
            return 2 * levels * alpha + 2 * size
        if kind == "allgather":
            return levels * alpha + (w - 1) * size
        if kind == "broadcast":
            return levels * alpha + size
        return 2 * levels * alpha  # barrier

    def __str__(self) -> str:
        label = f"{self.name}: " if self.name else ""
        return (
            f"{label}{self.algorithm}, latency {_format_seconds(self.latency_s)}, "
            f"bandwidth {_format_rate(self.bandwidth_Bps)}"
        )


def _preset(gbit: float, latency_us: float, algorithm: Algorithm, name: str) -> AlphaBeta:
    return AlphaBeta(latency_us / 1e6, gbit * 1e9 / 8, algorithm, name)


def _presets() -> dict[str, AlphaBeta]:
    # (Gbit/s, one-message latency in us): typical figures for a collective library on each
    # link (TCP for Ethernet, RDMA for InfiniBand), not measurements of a particular cluster.
    links = {"10gbe": (10, 25.0), "25gbe": (25, 15.0), "100gbe": (100, 8.0), "ib-hdr": (200, 3.0)}
    presets: dict[str, AlphaBeta] = {}
    for link, (gbit, latency_us) in links.items():
        presets[link] = _preset(gbit, latency_us, "ring", link)
        for algorithm in ("ring", "tree"):
            name = f"{link}-{algorithm}"
            presets[name] = _preset(gbit, latency_us, algorithm, name)
    return presets


NETWORK_PRESETS: dict[str, AlphaBeta] = _presets()
"""Named links: ``10gbe``, ``25gbe``, ``100gbe``, ``ib-hdr`` (ring), each also as ``-ring``
and ``-tree``."""

# unit -> (multiplier, divisor): dividing by 1e6 rounds once, multiplying by 1e-6 twice.
_SECONDS = {"s": (1.0, 1.0), "ms": (1.0, 1e3), "us": (1.0, 1e6), "ns": (1.0, 1e9)}
_RATES = {
    "b": (1.0, 1.0), "kb": (1e3, 1.0), "mb": (1e6, 1.0), "gb": (1e9, 1.0),
    "bit": (1.0, 8.0), "kbit": (1e3, 8.0), "mbit": (1e6, 8.0), "gbit": (1e9, 8.0),
}  # fmt: skip
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[-+]?[0-9]+)?)\s*([a-z]*)\s*$")


def parse_network(spec: str) -> NetworkModel | None:
    """A network model from a preset name or a spec; None for ``"none"`` (memory speed).

    Presets: :data:`NETWORK_PRESETS` (one link) and ``fakepg.CLUSTER_PRESETS`` (NCCL or gloo
    on real machines). A path ending in ``.toml`` or ``.json`` is a cluster file
    (:mod:`fakepg.clusterfile`: nodes, GPUs per node, links, NICs, the collective library).

    A spec is ``latency=25us,bandwidth=10gbit[,algorithm=ring|tree]`` (latency in s, ms, us
    or ns; bandwidth per second in b, kb, mb, gb (bytes) or bit, kbit, mbit, gbit, decimal
    prefixes), or ``fixed=5ms`` for :class:`FixedLatency`.
    """
    from .clusternet import CLUSTER_PRESETS  # below this module: it imports nothing of it

    if spec.strip().endswith((".toml", ".json")):
        from .clusterfile import load_cluster

        return load_cluster(spec.strip())
    text = spec.strip().lower()
    if text in ("", "none"):
        return None
    if text in NETWORK_PRESETS:
        return NETWORK_PRESETS[text]
    if text in CLUSTER_PRESETS:
        return CLUSTER_PRESETS[text]
    if "=" not in text:
        raise ValueError(
            f"unknown network {spec!r}: use none, a preset "
            f"({', '.join([*NETWORK_PRESETS, *CLUSTER_PRESETS])}), a spec such as "
            "'latency=25us,bandwidth=10gbit,algorithm=ring' or 'fixed=5ms', or a cluster file "
            "(a path ending in .toml or .json)"
        )
    fields: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in ("latency", "bandwidth", "algorithm", "fixed"):
            raise ValueError(
                f"network spec {spec!r}: {item.strip()!r} is not one of latency=..., "
                "bandwidth=..., algorithm=ring|tree, fixed=..."
            )
        fields[key.strip()] = value.strip()
    if "fixed" in fields:
        if len(fields) > 1:
            raise ValueError(f"network spec {spec!r}: fixed=... takes no other field")
        return FixedLatency(_quantity(fields["fixed"], _SECONDS, "s", spec))
    missing = [k for k in ("latency", "bandwidth") if k not in fields]
    if missing:
        raise ValueError(f"network spec {spec!r} lacks {' and '.join(missing)}=...")
    algorithm = fields.get("algorithm", "ring")
    if algorithm not in ("ring", "tree"):
        raise ValueError(f"network spec {spec!r}: algorithm must be ring or tree")
    return AlphaBeta(
        _quantity(fields["latency"], _SECONDS, "s", spec),
        _quantity(fields["bandwidth"].removesuffix("/s").removesuffix("ps"), _RATES, "b", spec),
        algorithm,  # type: ignore[arg-type]
        spec.strip(),
    )


def _quantity(text: str, units: dict[str, tuple[float, float]], default: str, spec: str) -> float:
    match = _QUANTITY.match(text)
    unit = match.group(2) if match else ""
    if match is None or (unit or default) not in units:
        raise ValueError(
            f"network spec {spec!r}: cannot read {text!r}; write a number with one of the "
            f"units {', '.join(units)}"
        )
    multiplier, divisor = units[unit or default]
    return float(match.group(1)) * multiplier / divisor


def _format_seconds(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:g} {unit}"
    return f"{seconds * 1e9:g} ns"


def _format_rate(bps: float) -> str:
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:g} {unit}"
    return f"{bps:g} B/s"
