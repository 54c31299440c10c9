"""The records of a simulation: its configuration (from the command line) and its result.

Both the run (``reducer.tools.simulate``) and its rendering (``report``) read them; they live
here, below both, so that neither imports the other's module to name them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

import fakepg
from reducer.tools.trace import RankStep
from reducer.tools.whatif import parse_caps

from . import models, verify

__all__ = ["DEFAULT_WORLD_SIZE", "Config", "SimulationResult", "world_size_of"]

DEFAULT_WORLD_SIZE = 4


def world_size_of(args: argparse.Namespace, network: object) -> int:
    """``--world-size`` as given; else every GPU of a cluster file that names its nodes;
    else :data:`DEFAULT_WORLD_SIZE`."""
    if args.world_size is not None:
        return int(args.world_size)
    capacity = getattr(getattr(network, "topology", None), "capacity", None)
    return DEFAULT_WORLD_SIZE if capacity is None else int(capacity)


@dataclass(frozen=True, slots=True)
class Config:
    """A run's settings, checked: :meth:`from_args` raises ValueError naming the flag."""

    world_size: int
    model: str
    width: int | None
    batch_size: int
    steps: int
    bucket_cap_mb: float | None  # None: torch's default (25 MiB, its first bucket 1 MiB)
    find_unused: bool
    unused_pattern: str
    micro_batches: int
    comm_hook: str
    network_spec: str
    network: fakepg.NetworkModel | None
    trace: str | None
    seed: int
    device: torch.device
    timeout: float
    sweep_caps: tuple[float | None, ...]  # None: torch's default cap
    measure_world_size: int
    corrupt: tuple[int, int, str] | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Config:
        network = fakepg.parse_network(args.network)
        world_size = world_size_of(args, network)
        positive = {
            "--world-size": world_size,
            "--steps": args.steps,
            "--batch-size": args.batch_size,
            "--no-sync-every": args.no_sync_every,
            "--measure-world-size": args.measure_world_size,
        }
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if args.width is not None and args.width < 4:
            raise ValueError(f"--width must be >= 4, got {args.width}")
        if args.bucket_cap_mb is not None and not args.bucket_cap_mb >= 0:
            raise ValueError(
                f"--bucket-cap-mb must be >= 0 (0: one parameter per bucket), got "
                f"{args.bucket_cap_mb}"
            )
        if not args.timeout > 0:
            raise ValueError(f"--timeout must be > 0 seconds, got {args.timeout}")
        topology = getattr(network, "topology", None)
        if topology is not None:  # a cluster: the world must fill whole nodes, and fit
            topology.nodes(world_size)
        caps: tuple[float | None, ...] = ()
        if args.sweep_bucket_cap is not None:
            caps = tuple(parse_caps(args.sweep_bucket_cap))
        device = _parse_device(args.device)
        if caps and device.type != "cpu":
            raise ValueError(
                f"--sweep-bucket-cap predicts from the times the host measures, which on "
                f"{device.type} are when work was issued, not done; run the sweep with "
                "--device cpu, or sweep a model by shape with --predict (it times the GPU "
                "with events)"
            )
        _check_available(device, args.device)
        corrupt = None
        if args.corrupt_grad is not None:
            corrupt = _corrupt_target(args, world_size)
        return cls(
            world_size=world_size,
            model=args.model,
            width=args.width,
            batch_size=args.batch_size,
            steps=args.steps,
            bucket_cap_mb=args.bucket_cap_mb,
            find_unused=args.find_unused,
            unused_pattern=args.unused_pattern,
            micro_batches=args.no_sync_every,
            comm_hook=args.comm_hook,
            network_spec=args.network,
            network=network,
            trace=args.trace,
            seed=args.seed,
            device=device,
            timeout=args.timeout,
            sweep_caps=caps,
            measure_world_size=args.measure_world_size,
            corrupt=corrupt,
        )

    def network_name(self) -> str:
        return "none (memory speed)" if self.network is None else str(self.network)

    def describe(self) -> dict[str, Any]:
        """The run's settings, as the trace's metadata."""
        return {
            "model": self.model,
            "world_size": self.world_size,
            "steps": self.steps,
            "bucket_cap_mb": self.bucket_cap_mb,
            "find_unused_parameters": self.find_unused,
            "unused_pattern": self.unused_pattern,
            "micro_batches": self.micro_batches,
            "comm_hook": self.comm_hook,
            "network": self.network_name(),
            "seed": self.seed,
            "device": str(self.device),
        }


@dataclass
class SimulationResult:
    """What a simulation produced: per rank and step records, and the verdict."""

    world_size: int
    param_names: list[str]
    params: list[Tensor]  # rank 0's parameters on the meta device: shapes and dtypes
    sparse: list[bool]
    steps: list[RankStep] = field(default_factory=list)
    step_wall_ns: list[int] = field(default_factory=list)
    bucket_nbytes: list[int] = field(default_factory=list)
    verified_steps: int = 0
    mismatch: verify.Mismatch | None = None
    failure: str | None = None
    # (step, rank, parameter) with no local gradient; (step, parameter) unused everywhere.
    unused_local: int = 0
    unused_everywhere: int = 0
    unused_names: set[str] = field(default_factory=set)
    # Rank 0's local sparse gradient bytes per step, per parameter (0 for dense).
    sparse_nbytes: list[list[int]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.mismatch is None and self.failure is None

    def rank_steps(self, rank: int) -> list[RankStep]:
        return [s for s in self.steps if s.rank == rank]


def _corrupt_target(args: argparse.Namespace, world_size: int) -> tuple[int, int, str]:
    """--corrupt-grad STEP:RANK:PARAM, checked against the world and the model's names."""
    parts = args.corrupt_grad.split(":", 2)
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
        raise ValueError("--corrupt-grad takes STEP:RANK:PARAM (PARAM an index or a name)")
    step, rank, which = int(parts[0]), int(parts[1]), parts[2]
    model = models.build_model(args.model, args.width, args.seed)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    known = (which.isdigit() and int(which) < len(names)) or which in names
    if rank >= world_size or not known:
        raise ValueError(f"--corrupt-grad: no rank {rank} or parameter {which!r} in this run")
    return step, rank, which


def _parse_device(text: str) -> torch.device:
    """--device: the CPU or a CUDA device."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device takes cpu, cuda or cuda:N, got {text!r}")
    return device


def _check_available(device: torch.device, text: str) -> None:
    """A CUDA --device must exist here."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        build = "has no CUDA" if torch.version.cuda is None else "sees no GPU"
        raise ValueError(
            f"--device {text}: this torch ({torch.__version__}) {build}; run on the CPU "
            "(--device cpu) or on a machine with a GPU"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device {text}: only {count} GPU(s) visible (cuda:0 ...)")
