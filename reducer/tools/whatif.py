"""What-if: predict a training step's time at any world size and bucket cap, without running it.

A :class:`BackwardProfile` is measured once, on a small run (one rank on the fake world): when
each parameter's gradient became ready during backward, how long forward, the optimizer and
the end of finalize took, and the bytes of each gradient. :func:`predict_step` replays that
backward against a network model (anything with ``collective_time_s(kind, nbytes,
world_size)``, such as :class:`fakepg.AlphaBeta`) for a bucket cap and a world size, following
the reducer's rules (see Note [Replaying a backward]); :func:`sweep` does so per cap and
:func:`best` picks the fastest.

# Note [Replaying a backward]
# 1. Buckets as DistributedDataParallel builds them for the cap: after its first iteration it
#    rebuilds them in the order gradients became ready (first bucket min(1 MiB, cap), then the
#    cap); with find_unused_parameters it keeps the reverse-parameter-order buckets.
# 2. A bucket is ready when its last gradient is; it launches when it is ready and every
#    earlier bucket has launched (Note [Buckets launch in index order] in reducer.reducer).
# 3. The link carries one collective at a time, in launch order (Note [One link per world] in
#    fakepg.world): a bucket's allreduce begins when it has launched and the link is free and
#    takes the model's time for its bytes; with find_unused_parameters the used map (one int32
#    per parameter) follows the last bucket.
# 4. Step = optimizer + forward + max(last gradient ready, last collective done) + the part of
#    finalize after the last completion (copying averages into .grad).
# Compute is taken as measured: each rank is assumed to compute as fast as the measured one
# (its own cores, no contention), and the links to be free of other traffic.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from reducer.buckets import compute_bucket_assignment_by_size
from reducer.ddp._setup import bucket_limits
from reducer.stats import IterationStats

__all__ = [
    "BackwardProfile",
    "CostModel",
    "Prediction",
    "best",
    "cap_label",
    "cap_order",
    "parse_caps",
    "predict_step",
    "sweep",
]


def _limits(bucket_cap_mb: float | None, find_unused: bool = False) -> tuple[list[int], list[int]]:
    """The byte limits of DDP's buckets for ``bucket_cap_mb`` (``None``: left unset), before
    and after its rebuild, from the wrapper's own rule (torch 2.13's: the default cap is
    25 MiB after a first bucket of 1 MiB; a cap given is every bucket's, the first one's
    too)."""
    _, initial, rebuilt = bucket_limits(
        bucket_cap_mb, None, static_graph=False, find_unused_parameters=find_unused
    )
    return initial, rebuilt


def parse_caps(text: str, flag: str = "--sweep-bucket-cap") -> list[float | None]:
    """Bucket caps in MiB, separated by commas; ``default`` is torch's default (25 MiB after
    a first bucket of 1 MiB). Raises ValueError naming ``flag``."""
    caps: list[float | None] = []
    for token in (t.strip() for t in text.split(",")):
        if not token:
            continue
        try:
            cap = None if token == "default" else float(token)
        except ValueError:
            cap = -1.0
        if cap is not None and not cap >= 0:
            caps = []
            break
        caps.append(cap)
    if not caps:
        raise ValueError(
            f"{flag} takes bucket caps in MiB, >= 0, or 'default' (torch's: 25 MiB after a "
            f"first bucket of 1 MiB), separated by commas (e.g. default,0.25,1,4,25), got "
            f"{text!r}"
        )
    return caps


def cap_order(bucket_cap_mb: float | None) -> tuple[int, int]:
    """Sorts caps by the largest bucket they allow, then the first bucket's limit: the
    smaller first among equal steps (less memory per bucket)."""
    first, cap = _limits(bucket_cap_mb)[1]
    return cap, first


def cap_label(bucket_cap_mb: float | None) -> str:
    """A cap as tables print it: ``default`` where it was left unset."""
    return "default" if bucket_cap_mb is None else f"{bucket_cap_mb:g}"


class CostModel(Protocol):
    """What the prediction needs from a network model (``fakepg.NetworkModel`` fits)."""

    def collective_time_s(self, kind: str, nbytes: int, world_size: int) -> float: ...


@dataclass(frozen=True, slots=True)
class BackwardProfile:
    """One rank's measured step, per parameter in DDP order, times in ns.

    ``ready_ns[i]``: from prepare_for_backward (the end of forward) until parameter i's
    gradient was ready. ``nbytes[i]``: its gradient's bytes (for a sparse gradient, the
    measured bytes of its indices and values). ``tail_ns``: finalize after the last
    completion. ``dtypes`` key the buckets as the reducer does.
    """

    ready_ns: tuple[int, ...]
    nbytes: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    sparse: tuple[bool, ...]
    forward_ns: int
    optimizer_ns: int
    tail_ns: int
    find_unused: bool = False

    @classmethod
    def from_iterations(
        cls,
        iterations: Sequence[IterationStats],
        *,
        params: Sequence[torch.Tensor],
        forward_ns: Sequence[int],
        optimizer_ns: Sequence[int],
        sparse: Sequence[bool],
        sparse_nbytes: Sequence[float] | None = None,
        find_unused: bool = False,
    ) -> BackwardProfile:
        """Medians over measured iterations (pass those after warm-up) of one rank."""
        if not iterations:
            raise ValueError("BackwardProfile.from_iterations needs at least one iteration")
        count = len(params)
        ready = tuple(int(statistics.median(it.ready_ns[0][i] for it in iterations))
                      for i in range(count))  # fmt: skip
        tails = [
            max(0, it.finalize_end_ns - max(max(it.done_ns, default=0), it.finalize_start_ns))
            for it in iterations
        ]
        nbytes = []
        for i, p in enumerate(params):
            if sparse[i] and sparse_nbytes is not None:
                nbytes.append(int(sparse_nbytes[i]))
            else:
                nbytes.append(p.numel() * p.element_size())
        return cls(
            ready_ns=ready,
            nbytes=tuple(nbytes),
            dtypes=tuple(p.dtype for p in params),
            sparse=tuple(bool(s) for s in sparse),
            forward_ns=int(statistics.median(forward_ns)) if forward_ns else 0,
            optimizer_ns=int(statistics.median(optimizer_ns)) if optimizer_ns else 0,
            tail_ns=int(statistics.median(tails)),
            find_unused=find_unused,
        )


@dataclass(frozen=True, slots=True)
class Prediction:
    """The replayed step for one bucket cap; times in ns."""

    bucket_cap_mb: float | None  # None: torch's default (see _limits)
    world_size: int
    bucket_indices: tuple[tuple[int, ...], ...]
    bucket_nbytes: tuple[int, ...]
    launch_ns: tuple[int, ...]  # from the end of forward
    done_ns: tuple[int, ...]
    backward_ns: int  # last gradient ready
    comm_ns: int  # first launch to last completion
    exposed_ns: int  # communication after the last gradient was ready
    step_ns: int


def bucket_assignment(profile: BackwardProfile, bucket_cap_mb: float | None) -> list[list[int]]:
    """The buckets DistributedDataParallel would use for ``bucket_cap_mb`` (``None``: the
    default); Note step 1."""
    shapes = [
        torch.empty(max(1, n // _itemsize(d)), dtype=d, device="meta")
        for n, d in zip(profile.nbytes, profile.dtypes, strict=True)
    ]
    initial, rebuilt = _limits(bucket_cap_mb, profile.find_unused)
    if profile.find_unused:  # never rebuilt: in parameter order, reversed (ddp_bucket_assignment)
        by_size = compute_bucket_assignment_by_size(shapes, initial, list(profile.sparse))
        return list(reversed(by_size))
    order = sorted(range(len(shapes)), key=lambda i: (profile.ready_ns[i], i))
    in_order = compute_bucket_assignment_by_size(
        [shapes[i] for i in order],
        rebuilt,
        [profile.sparse[i] for i in order],
    )
    return [[order[j] for j in bucket] for bucket in in_order]


def predict_step(
    profile: BackwardProfile,
    bucket_cap_mb: float | None,
    world_size: int,
    network: CostModel | None,
) -> Prediction:
    """Replay the profiled backward for ``bucket_cap_mb`` (``None``: torch's default) on
    ``world_size`` ranks."""
    if bucket_cap_mb is not None and not bucket_cap_mb >= 0:
        raise ValueError(
            f"bucket_cap_mb must be >= 0 (0: one parameter per bucket), got {bucket_cap_mb!r}"
        )
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size!r}")
    buckets = bucket_assignment(profile, bucket_cap_mb)

    def cost_ns(kind: str, nbytes: int) -> int:
        if network is None:
            return 0
        return round(network.collective_time_s(kind, nbytes, world_size) * 1e9)

    launches, dones, sizes = [], [], []
    launched = link_free = 0
    for bucket in buckets:
        ready = max(profile.ready_ns[i] for i in bucket)
        launched = max(launched, ready)  # in index order
        nbytes = sum(profile.nbytes[i] for i in bucket)
        kind = "sparse_allreduce" if profile.sparse[bucket[0]] else "allreduce"
        link_free = max(link_free, launched) + cost_ns(kind, nbytes)  # one link, in order
        launches.append(launched)
        dones.append(link_free)
        sizes.append(nbytes)
    comm_end = link_free
    if profile.find_unused:
        comm_end = max(comm_end, launched) + cost_ns("allreduce", 4 * len(profile.nbytes))
    backward = max(profile.ready_ns)
    exposed = max(0, comm_end - backward)
    step = profile.optimizer_ns + profile.forward_ns + max(backward, comm_end) + profile.tail_ns
    return Prediction(
        bucket_cap_mb=bucket_cap_mb,
        world_size=world_size,
        bucket_indices=tuple(tuple(b) for b in buckets),
        bucket_nbytes=tuple(sizes),
        launch_ns=tuple(launches),
        done_ns=tuple(dones),
        backward_ns=backward,
        comm_ns=comm_end - min(launches),
        exposed_ns=exposed,
        step_ns=step,
    )


def sweep(
    profile: BackwardProfile,
    bucket_caps_mb: Sequence[float | None],
    world_size: int,
    network: CostModel | None,
) -> list[Prediction]:
    """One prediction per cap, in the order given."""
    return [predict_step(profile, cap, world_size, network) for cap in bucket_caps_mb]


def best(predictions: Sequence[Prediction]) -> Prediction:
    """The fastest predicted step; among equals, the smallest cap (less memory per bucket)."""
    if not predictions:
        raise ValueError("best: no predictions")
    return min(predictions, key=lambda p: (p.step_ns, cap_order(p.bucket_cap_mb)))


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
