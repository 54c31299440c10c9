"""Network models of real clusters: GPUs in nodes, NVLink inside, NICs between, NCCL or gloo.

:class:`Topology` describes the machines: GPUs per node, the bus bandwidth each GPU reaches
over NVLink/NVSwitch inside a node, and the NICs of a node with their bandwidth.
:class:`NcclModel` costs a collective as NCCL's own tuning model does (see Note [NCCL's cost
model]): a fixed base latency per call, a per-step latency by hop type, three protocols (LL
for small messages, LL128, Simple for large ones) with their bandwidth efficiencies, ring and
pipelined double binary tree, and the fastest (algorithm, protocol) pair chosen per call as
NCCL does. :class:`GlooModel` costs gloo's ring over TCP, with the device-host copies it does
for GPU tensors. :data:`CLUSTER_PRESETS` names real machines; every number says its source.

# Note [NCCL's cost model]
# NCCL picks an algorithm and protocol per call from a table of predicted times, computed in
# src/graph/tuning.cc (ncclTopoTuneModel; constants below from NCCL 2.19-2.21):
#
#   time = latency + bytes / algorithm bandwidth
#   latency (ring) = baseLat + (nsteps - nInter) * intraLat + nInter * interLat,
#       nsteps = 2(n-1) for allreduce, n-1 for allgather/reduce-scatter, n otherwise;
#       nInter = 2(nNodes-1) for allreduce, nNodes-1 otherwise (0 on one node)
#   latency (tree allreduce) = baseLat + 2 ((n/nNodes - 1) intraLat + log2(nNodes) interLat)
#   bus bandwidth: NVLink inside one node, min(NVLink, the node's NICs) across nodes;
#       ring LL x 0.5, ring LL128 x 0.92; tree allreduce x 0.92, then LL x 1/3.8,
#       LL128 x 7/9 (one node) or 120/128
#   algorithm bandwidth = bus bandwidth x n / nsteps (ring), x 0.5 (tree allreduce)
#
# So ring allreduce moves 2(n-1)/n * bytes at the bus bandwidth (nccl-tests'
# doc/PERFORMANCE.md: busbw = algbw * 2(n-1)/n), and the pipelined tree moves 2 * bytes at it,
# with a latency logarithmic in the nodes. Small messages go LL (half the bandwidth, a
# fraction of the latency). Not modelled: NVLS/CollNet (switch reductions), per-channel caps,
# the chunk-size effects inside one protocol.

# Note [Communication slowing compute]
# An NCCL collective is a CUDA kernel of one block per channel (NCCL's environment-variable
# docs describe NCCL_MIN/MAX_NCHANNELS as the number of channels, i.e. CUDA blocks, it uses),
# and each block holds one SM for the whole call, spinning while it waits on its peers.
# While one runs beside backward, backward's kernels have the other SMs: compute advances at
# 1 - f of its rate, f = channels / SMs. Over B seconds of collectives in flight during
# backward, backward does f x B less work and ends f x B later; the last bucket launches that
# much later too, so the exposed tail after backward shrinks by up to f x B (what was queued
# has had longer to drain), never below the last bucket's own time (first order: the other
# collectives are not moved). The presets' f: 8 channels (an assumption: NCCL's usual count
# on these machines, not measured here) of the V100's 80 SMs (NVIDIA V100 whitepaper) = 0.1,
# of the H100 SXM's 132 SMs (H100 whitepaper) = 0.06. Memory-bandwidth contention is not
# modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

__all__ = ["CLUSTER_DESCRIPTIONS", "CLUSTER_PRESETS", "GlooModel", "NcclModel", "Topology"]

NcclAlgorithm = Literal["ring", "tree", "auto"]
_PROTOCOLS = ("LL", "LL128", "Simple")
_KINDS = (
    "allreduce", "sparse_allreduce", "allgather", "broadcast", "barrier", "reduce",
    "reduce_scatter", "all_to_all", "gather", "scatter", "send",
)  # fmt: skip

# NCCL src/graph/tuning.cc: base latency (us) per call, by algorithm and protocol.
_BASE_LAT_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4)}
# The same file: latency (us) per step, by hop type (NVLink, network), algorithm and protocol.
_HW_LAT_US = {
    ("nvlink", "tree"): (0.6, 1.25, 4.0),
    ("nvlink", "ring"): (0.6, 1.9, 3.4),
    ("net", "tree"): (5.0, 8.5, 14.0),
    ("net", "ring"): (2.7, 4.0, 14.0),
}


def _positive(owner: str, name: str, value: float) -> None:
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{owner}: {name} must be a finite number > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class Topology:
    """GPUs in nodes: ``gpus_per_node`` GPUs share NVLink/NVSwitch, each reaching
    ``intra_Bps`` bus bandwidth (bytes/s, one direction); each node has ``nics_per_node``
    NICs of ``nic_Bps`` bytes/s each. A world larger than one node must be a multiple of
    ``gpus_per_node``. ``node_count``: the cluster's nodes (None: as many as a world needs);
    a world must fit in them. ``intra_latency_s`` / ``nic_latency_s``: the time of one step
    of NCCL's Simple ring over NVLink / the network (None: NCCL's own figures, Note [NCCL's
    cost model]); NCCL's other protocols and its tree keep their ratios to it."""

    gpus_per_node: int
    intra_Bps: float
    nics_per_node: int
    nic_Bps: float
    name: str = ""
    node_count: int | None = None
    intra_latency_s: float | None = None
    nic_latency_s: float | None = None

    def __post_init__(self) -> None:
        for field_name in ("gpus_per_node", "nics_per_node"):
            value = getattr(self, field_name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"Topology: {field_name} must be an integer >= 1, got {value!r}")
        _positive("Topology", "intra_Bps (NVLink bandwidth)", self.intra_Bps)
        _positive("Topology", "nic_Bps (NIC bandwidth)", self.nic_Bps)
        count = self.node_count
        if count is not None and not (isinstance(count, int) and count >= 1):
            raise ValueError(f"Topology: node_count must be an integer >= 1 or None, got {count!r}")
        for field_name in ("intra_latency_s", "nic_latency_s"):
            value = getattr(self, field_name)
            if value is not None:
                _positive("Topology", field_name, value)

    @property
    def capacity(self) -> int | None:
        """GPUs in the cluster (None: unbounded)."""
        return None if self.node_count is None else self.node_count * self.gpus_per_node

    def latency_scale(self, hop: str) -> float:
        """What this topology's latency of ``hop`` ("nvlink" or "net") multiplies NCCL's
        per-step latencies of that hop by (1: NCCL's own)."""
        given = self.intra_latency_s if hop == "nvlink" else self.nic_latency_s
        return 1.0 if given is None else given / (_HW_LAT_US[(hop, "ring")][2] * 1e-6)

    def describe(self) -> str:
        """One line: nodes, GPUs and links."""
        nodes = f"{self.node_count} nodes of " if self.node_count is not None else ""
        latency = [
            f"{what} {value * 1e6:g} us/step"
            for what, value in (("NVLink", self.intra_latency_s), ("network", self.nic_latency_s))
            if value is not None
        ]
        return (
            f"{nodes}{self.gpus_per_node} GPUs/node at {self.intra_Bps / 1e9:g} GB/s, "
            f"{self.nics_per_node} x {self.nic_Bps * 8 / 1e9:g} Gb/s NICs"
            + "".join(f", {text}" for text in latency)
        )

    def nodes(self, world_size: int) -> int:
        """Nodes a world of ``world_size`` ranks fills; ValueError if it does not divide, or
        does not fit in ``node_count`` nodes."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        capacity = self.capacity
        if capacity is not None and world_size > capacity:
            raise ValueError(
                f"Topology {self.name or ''}: world_size {world_size} does not fit in its "
                f"{self.node_count} nodes of {self.gpus_per_node} GPUs ({capacity}); use at "
                f"most {capacity} ranks, or a topology with more nodes"
            )
        if world_size <= self.gpus_per_node:
            return 1
        if world_size % self.gpus_per_node:
            raise ValueError(
                f"Topology {self.name or ''}: world_size {world_size} is not a multiple of "
                f"gpus_per_node {self.gpus_per_node}; use whole nodes (a multiple of "
                f"{self.gpus_per_node}) or a topology with another gpus_per_node"
            )
        return world_size // self.gpus_per_node

    def bus_Bps(self, world_size: int) -> float:
        """Bus bandwidth per GPU: NVLink on one node; across nodes the node's NICs, shared by
        its GPUs' rings (one ring per NIC, NCCL's channels), capped by NVLink."""
        if self.nodes(world_size) == 1:
            return self.intra_Bps
        return min(self.intra_Bps, self.nics_per_node * self.nic_Bps)


@dataclass(frozen=True, slots=True)
class NcclModel:
    """NCCL on a :class:`Topology`: see Note [NCCL's cost model]. ``algorithm`` "auto" takes
    the fastest of ring and tree per call, as NCCL does; "ring" or "tree" forces one (as
    NCCL_ALGO does). ``launch_s`` is the host's cost to launch one collective kernel, paid
    before NCCL's base latency. ``compute_slowdown`` is the fraction of the GPU's compute
    an NCCL kernel in flight takes from the kernels beside it (see Note [Communication
    slowing compute]); 0 leaves compute alone."""

    topology: Topology
    algorithm: NcclAlgorithm = "auto"
    launch_s: float = 0.0
    name: str = ""
    compute_slowdown: float = 0.0

    def __post_init__(self) -> None:
        if self.algorithm not in ("ring", "tree", "auto"):
            raise ValueError(
                f"NcclModel: algorithm must be 'ring', 'tree' or 'auto', got {self.algorithm!r}"
            )
        if not (self.launch_s >= 0 and math.isfinite(self.launch_s)):
            raise ValueError(f"NcclModel: launch_s must be >= 0, got {self.launch_s!r}")
        if not 0 <= self.compute_slowdown < 1:
            raise ValueError(
                f"NcclModel: compute_slowdown must be in [0, 1) (the fraction of the GPU's "
                f"compute a collective in flight takes), got {self.compute_slowdown!r}"
            )

    def choice(self, kind: str, nbytes: int, world_size: int) -> tuple[str, str, float]:
        """(algorithm, protocol, seconds) NCCL's tuner would pick for this call."""
        _check_call("NcclModel", kind, nbytes, world_size)
        n = world_size
        if n == 1:
            return ("ring", "Simple", 0.0)
        nodes = self.topology.nodes(n)
        if kind == "barrier":  # an allreduce of one element, as NCCL-based barriers do
            kind, nbytes = "allreduce", 4
        if kind in ("sparse_allreduce", "gather", "scatter"):
            kind = "allgather"  # gathers every rank's part (see fakepg.netmodel)
        if kind == "send":
            t = self.topology
            bus = t.intra_Bps if nodes == 1 else min(t.nic_Bps, t.intra_Bps)
            hop = "nvlink" if nodes == 1 else "net"
            step = 1e-6 * _HW_LAT_US[(hop, "ring")][2] * t.latency_scale(hop)
            return ("p2p", "Simple", self.launch_s + step + nbytes / bus)
        algorithms = ("ring", "tree") if self.algorithm == "auto" else (self.algorithm,)
        if kind != "allreduce":
            algorithms = ("ring",)  # NCCL's tree serves allreduce only
        best: tuple[str, str, float] | None = None
        for algorithm in algorithms:
            for p, protocol in enumerate(_PROTOCOLS):
                seconds = self._time(kind, nbytes, n, nodes, algorithm, p)
                if best is None or seconds < best[2]:
                    best = (algorithm, protocol, seconds)
        assert best is not None
        return best[0], best[1], best[2] + self.launch_s

    def time_s(
        self, kind: str, nbytes: int, world_size: int, algorithm: str, protocol: str
    ) -> float:
        """Seconds of one call with ``algorithm`` ("ring" or "tree") and ``protocol`` ("LL",
        "LL128", "Simple") forced, as NCCL_ALGO and NCCL_PROTO force them (no launch cost):
        to read what a protocol costs beside the one the tuner picks."""
        _check_call("NcclModel", kind, nbytes, world_size)
        if algorithm not in ("ring", "tree") or protocol not in _PROTOCOLS:
            raise ValueError(
                f"NcclModel.time_s: algorithm must be 'ring' or 'tree' and protocol one of "
                f"{', '.join(_PROTOCOLS)}, got {algorithm!r}, {protocol!r}"
            )
        if algorithm == "tree" and kind != "allreduce":
            raise ValueError(f"NcclModel.time_s: NCCL's tree serves allreduce only, not {kind!r}")
        if world_size == 1:
            return 0.0
        nodes = self.topology.nodes(world_size)
        return self._time(kind, nbytes, world_size, nodes, algorithm, _PROTOCOLS.index(protocol))

    def _time(self, kind: str, nbytes: int, n: int, nodes: int, algorithm: str, p: int) -> float:
        bus = self.topology.bus_Bps(n)
        intra = _HW_LAT_US[("nvlink", algorithm)][p] * self.topology.latency_scale("nvlink")
        inter = _HW_LAT_US[("net", algorithm)][p] * self.topology.latency_scale("net")
        latency = _BASE_LAT_US[algorithm][p]
        if algorithm == "ring":
            bus *= (0.5, 0.92, 1.0)[p]
            if kind == "allreduce":
                steps, inter_steps = 2 * (n - 1), 2 * (nodes - 1)
            elif kind in ("allgather", "reduce_scatter", "all_to_all"):
                steps, inter_steps = n - 1, nodes - 1
            else:  # broadcast, reduce: a pipelined chain
                steps, inter_steps = n, nodes - 1
            latency += (steps - inter_steps) * intra + inter_steps * inter
            if kind == "allreduce":
                moved = nbytes * steps / n  # 2(n-1)/n bytes over the bus
            elif kind in ("allgather", "all_to_all"):
                moved = nbytes * (n - 1)  # every other rank's part arrives
            elif kind == "reduce_scatter":
                moved = nbytes * (n - 1) / n
            else:
                moved = nbytes
        else:  # tree allreduce
            bus = bus * 0.92
            bus *= (1 / 3.8, 7 / 9 if nodes == 1 else 120 / 128, 1.0)[p]
            latency += 2 * ((n // nodes - 1) * intra + math.log2(nodes) * inter)
            moved = 2 * nbytes  # algorithm bandwidth = bus bandwidth / 2
        return latency * 1e-6 + moved / bus

    def collective_time_s(self, kind: str, nbytes: int, world_size: int) -> float:
        return self.choice(kind, nbytes, world_size)[2]

    def __str__(self) -> str:
        t = self.topology
        label = f"{self.name}: " if self.name else ""
        return (
            f"{label}NCCL {self.algorithm}, {t.describe()}"
            + (f", compute slowed {self.compute_slowdown:.3g} in flight" if
               self.compute_slowdown else "")
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class GlooModel:
    """gloo's ring allreduce over TCP on a :class:`Topology`.

    gloo does not use NVLink: every hop is a TCP connection (loopback inside a node), each
    step costs ``latency_s`` and moves its chunk at ``tcp_Bps`` (one connection's throughput,
    at most one NIC's bandwidth across nodes). ``call_s`` is the fixed cost of one call (the
    process group's queue and the algorithm's setup); ``copy_Bps`` is the device-host copy
    bandwidth for GPU tensors (gloo reduces on the host: a copy each way), 0 for CPU tensors.
    """

    topology: Topology
    latency_s: float
    tcp_Bps: float
    call_s: float
    copy_Bps: float = 0.0
    name: str = ""

    def __post_init__(self) -> None:
        _positive("GlooModel", "tcp_Bps (TCP bandwidth)", self.tcp_Bps)
        for field_name in ("latency_s", "call_s", "copy_Bps"):
            value = getattr(self, field_name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"GlooModel: {field_name} must be >= 0, got {value!r}")

    def collective_time_s(self, kind: str, nbytes: int, world_size: int) -> float:
        _check_call("GlooModel", kind, nbytes, world_size)
        n = world_size
        if n == 1:
            return 0.0
        nodes = self.topology.nodes(n)
        bw = self.tcp_Bps if nodes == 1 else min(self.tcp_Bps, self.topology.nic_Bps)
        copies = 2 * nbytes / self.copy_Bps if self.copy_Bps else 0.0
        if kind == "allreduce":
            steps, moved = 2 * (n - 1), 2 * (n - 1) / n * nbytes
        elif kind == "barrier":
            steps, moved = 2 * (n - 1), 0.0
        elif kind == "send":
            steps, moved = 1, float(nbytes)
        elif kind in ("broadcast", "reduce"):
            steps, moved = n - 1, float(nbytes)
        elif kind == "reduce_scatter":
            steps, moved = n - 1, (n - 1) / n * nbytes
        else:  # allgather and the kinds that gather
            steps, moved = n - 1, float((n - 1) * nbytes)
        return self.call_s + steps * self.latency_s + moved / bw + copies

    def __str__(self) -> str:
        t = self.topology
        label = f"{self.name}: " if self.name else ""
        return (
            f"{label}gloo ring over TCP at {self.tcp_Bps / 1e9:g} GB/s, "
            f"{self.latency_s * 1e6:g} us/step, {self.call_s * 1e6:g} us/call, {t.describe()}"
        )


def _check_call(owner: str, kind: str, nbytes: int, world_size: int) -> None:
    if kind not in _KINDS:
        raise ValueError(
            f"{owner}: unknown collective kind {kind!r}; expected one of {', '.join(_KINDS)}"
        )
    if nbytes < 0 or world_size < 1:
        raise ValueError(
            f"{owner}: nbytes must be >= 0 and world_size >= 1, got {nbytes}, {world_size}"
        )


_GB = 1e9
_GBIT = 1e9 / 8

# DGX-1 (V100): 8 GPUs in a hybrid cube-mesh of NVLink2 links, 25 GB/s per link and direction
# (NVIDIA Tesla V100 datasheet: 300 GB/s NVLink, six links); NCCL's rings use the links of two
# rings per GPU direction pair: 2 x 25 x 2 = 100 GB/s of bus bandwidth is what its tuner
# assumes for six links shared by 8 GPUs (an assumption: we know no published busbw figure).
# Its NICs: 4 x 100 Gb/s InfiniBand EDR (torch's benchmarks/distributed/ddp/README.md: "8 DGX
# machines with V100 GPUs ... 4x 100Gb InfiniBand per machine").
DGX1_V100 = Topology(8, 100 * _GB, 4, 100 * _GBIT, "dgx1-v100")
# The same GPUs with one 100 Gb/s NIC per node.
V100_1NIC = Topology(8, 100 * _GB, 1, 100 * _GBIT, "8xv100-1x100g")
# DGX A100: 8 A100 through NVSwitch, NVLink3 600 GB/s bidirectional per GPU, so 300 GB/s per
# direction (NVIDIA A100 Tensor Core GPU datasheet); 8 x single-port ConnectX-6 200 Gb/s HDR
# InfiniBand for the compute fabric, one per GPU (NVIDIA DGX A100 User Guide, "Network
# Ports"; DGX A100 datasheet).
DGX_A100 = Topology(8, 300 * _GB, 8, 200 * _GBIT, "dgx-a100")
# DGX H100 / H200: NVLink4 through NVSwitch, 900 GB/s bidirectional per GPU, so 450 GB/s per
# direction (NVIDIA H100 and H200 Tensor Core GPU datasheets); eight single-port ConnectX-7 of
# 400 Gb/s InfiniBand per node for the compute fabric, one per GPU (NVIDIA DGX H100 User
# Guide, "Network Modules"; NVIDIA DGX BasePOD reference architecture, "Core Components":
# "eight single-port NVIDIA ConnectX-7 VPI ... up to 400 Gb/s", for DGX H100 and DGX H200).
DGX_H100 = Topology(8, 450 * _GB, 8, 400 * _GBIT, "dgx-h100")
DGX_H200 = Topology(8, 450 * _GB, 8, 400 * _GBIT, "dgx-h200")
# H100 nodes (HGX H100 8-GPU: the same NVLink4 as DGX H100) with eight NICs of 200 Gb/s, one
# per GPU: a configuration, not a named product (ConnectX-7 runs at 200 Gb/s as well as 400:
# NVIDIA ConnectX-7 datasheet), for clusters whose fabric is HDR / 200 GbE.
H100_8X200G = Topology(8, 450 * _GB, 8, 200 * _GBIT, "8xh100-8x200g")

# See Note [Communication slowing compute]: 8 NCCL channels (assumed) of the GPU's SMs: the
# V100 has 80 (V100 whitepaper), the A100 108 (A100 whitepaper), the H100 SXM5 and the H200
# 132 (H100 whitepaper; the H200 is the same GH100 die).
V100_NCCL_SLOWDOWN = 8 / 80
A100_NCCL_SLOWDOWN = 8 / 108
H100_NCCL_SLOWDOWN = 8 / 132

CLUSTER_PRESETS: dict[str, NcclModel | GlooModel] = {
    "nccl-dgx1-v100": NcclModel(DGX1_V100, "auto", 0.0, "nccl-dgx1-v100", V100_NCCL_SLOWDOWN),
    # The DDP paper's cluster as its section 5 describes it (Li et al., VLDB 2020; not
    # re-checked against the paper's text here): 4 servers of 8 V100 on NVLink, each with one
    # Mellanox ConnectX-4 100 Gb/s NIC.
    "nccl-v100-1nic": NcclModel(V100_1NIC, "auto", 0.0, "nccl-v100-1nic", V100_NCCL_SLOWDOWN),
    "nccl-dgx-a100": NcclModel(DGX_A100, "auto", 0.0, "nccl-dgx-a100", A100_NCCL_SLOWDOWN),
    "nccl-dgx-h100": NcclModel(DGX_H100, "auto", 0.0, "nccl-dgx-h100", H100_NCCL_SLOWDOWN),
    "nccl-dgx-h200": NcclModel(DGX_H200, "auto", 0.0, "nccl-dgx-h200", H100_NCCL_SLOWDOWN),
    "nccl-h100-8x200g": NcclModel(H100_8X200G, "auto", 0.0, "nccl-h100-8x200g", H100_NCCL_SLOWDOWN),
    # gloo between DGX-1 nodes: TCP over the 100 Gb/s NICs. One TCP connection moves about
    # 2.5 GB/s (20 Gb/s) and a step costs about 25 us, typical of kernel TCP on 100 GbE (an
    # assumption, not a measurement of that cluster); call_s 100 us: gloo's per-call setup
    # (an assumption); copies over PCIe 3 x16 at 12 GB/s of its 15.75 GB/s (PCI-SIG spec).
    "gloo-dgx1-v100": GlooModel(DGX1_V100, 25e-6, 2.5 * _GB, 100e-6, 12 * _GB, "gloo-dgx1-v100"),
}
"""Named clusters: NCCL on DGX-1 V100 (4 x 100 Gb/s IB), on 8 x V100 with one 100 Gb/s NIC,
on DGX A100 (8 x 200 Gb/s IB), on DGX H100 and DGX H200 (8 x 400 Gb/s IB), on H100 nodes with
8 x 200 Gb/s NICs; gloo over TCP on DGX-1 V100."""

CLUSTER_DESCRIPTIONS: dict[str, str] = {
    "nccl-dgx1-v100": "NCCL, DGX-1: 8 x V100 (NVLink2), 4 x 100 Gb/s InfiniBand per node",
    "nccl-v100-1nic": "NCCL, 8 x V100 (NVLink2) per node, one 100 Gb/s NIC (the DDP paper's)",
    "nccl-dgx-a100": "NCCL, DGX A100: 8 x A100 (NVLink3), 8 x 200 Gb/s InfiniBand per node",
    "nccl-dgx-h100": "NCCL, DGX H100: 8 x H100 (NVLink4), 8 x 400 Gb/s InfiniBand per node",
    "nccl-dgx-h200": "NCCL, DGX H200: 8 x H200 (NVLink4), 8 x 400 Gb/s InfiniBand per node",
    "nccl-h100-8x200g": "NCCL, 8 x H100 (NVLink4) per node, 8 x 200 Gb/s NICs per node",
    "gloo-dgx1-v100": "gloo over TCP between DGX-1 V100 nodes (100 Gb/s NICs)",
}
"""One line per cluster preset, for listings (``--help``)."""
