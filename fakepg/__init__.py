"""fakepg: an in-memory world of N ranks on threads that implements ``reducer.ProcessGroup``.

Collectives are truly asynchronous (data moves on the world's worker threads once the last rank
joined), deterministic (dense SUM adds in ascending rank order, every rank gets the same bits),
and fail loudly: timeouts name the ranks that never joined, ranks that disagree on a collective
see both sides, and a failure on one rank wakes every other.

    import fakepg, torch
    def step(pg):
        t = torch.full((4,), float(pg.rank()))
        pg.allreduce([t]).wait()
        return t
    fakepg.run(step, world_size=4)   # four tensors of 0+1+2+3
"""

from __future__ import annotations

from .clusterfile import cluster_from_dict, cluster_to_dict, dumps_cluster, load_cluster
from .clusternet import CLUSTER_DESCRIPTIONS, CLUSTER_PRESETS, GlooModel, NcclModel, Topology
from .faults import (
    CollectiveMismatch,
    CollectiveTimeout,
    FakePGError,
    RankExited,
    TensorChanged,
    WorldAborted,
)
from .group import FakeProcessGroup
from .netmodel import NETWORK_PRESETS, AlphaBeta, FixedLatency, NetworkModel, parse_network
from .schedule import Schedule, ScheduleDeadlock, ScheduleEvent
from .torch_backend import init_torch_group, register_torch_backend, run_torch
from .work import Work
from .world import World, run

__all__ = [
    "CLUSTER_DESCRIPTIONS",
    "CLUSTER_PRESETS",
    "NETWORK_PRESETS",
    "AlphaBeta",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "FakePGError",
    "FakeProcessGroup",
    "FixedLatency",
    "GlooModel",
    "NcclModel",
    "NetworkModel",
    "RankExited",
    "Schedule",
    "ScheduleDeadlock",
    "ScheduleEvent",
    "TensorChanged",
    "Topology",
    "Work",
    "World",
    "WorldAborted",
    "cluster_from_dict",
    "cluster_to_dict",
    "dumps_cluster",
    "init_torch_group",
    "load_cluster",
    "parse_network",
    "register_torch_backend",
    "run",
    "run_torch",
]
