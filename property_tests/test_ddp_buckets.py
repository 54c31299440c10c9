"""This project's DDP hands comm hooks torch 2.13's buckets, in every iteration.

Both wrappers run on the same rank threads of one fake world, on copies of one drawn model,
fed the same data, each with a comm hook that records, per iteration, every GradBucket it
is called with: its index and its parameters (as indices into the model's parameters), in
the order the hook is called. The records must be equal: the initial buckets (one per dtype
where unused parameters are not searched for, or the graph is static; by the caps where
they are), the iteration after which they are rebuilt (the first; a static graph's second)
and the rebuilt ones (in the order gradients became ready on rank 0, unsorted).

Drawn: 1 to 3 ranks; a chain of 1 to 3 linear layers (with or without bias, float32 or
float64) of widths around the caps, an embedding with sparse gradients in front or not, a
head that only some ranks and steps use (where unused parameters are searched for) or none
(a static graph); ``bucket_cap_mb`` (left at its default, 0, or a few to a few hundred
bytes, or 1, 5, 25 MiB) or ``bucket_cap_mb_list``; ``find_unused_parameters``;
``static_graph`` (at construction, or ``_set_static_graph()`` after it).

# Note [A static graph's first bucket indices]
# In a static graph's first iteration torch's reducer defers every bucket to the end of
# backward and launches them all with its bucket cursor at 0: its hooks see index 0 for
# every bucket. This wrapper gives each bucket its own index there. That iteration's
# buckets are compared by their parameters, in order; every other iteration by index too.
"""

from __future__ import annotations

import io
import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import event, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import fakepg
import reducer
from reducer.testing.harness import note_size

_BUILD = threading.Lock()  # torch's default generator is shared by the rank threads
_MIB = 1 << 20
STEPS = 3  # a static graph rebuilds after its second iteration: the third shows it


@dataclass(frozen=True)
class Layer:
    width: int  # output features
    bias: bool
    double: bool


@dataclass(frozen=True)
class BucketScenario:
    """One run of both wrappers."""

    world_size: int
    layers: tuple[Layer, ...]
    embedding: bool  # a sparse-gradient embedding in front
    head: bool  # a head some ranks and steps leave unused
    caps: tuple[str, Any] | None  # ("bucket_cap_mb", MiB) or ("bucket_cap_mb_list", [MiB])
    find_unused: bool
    static: str | None  # None, "constructor" or "set"

    @property
    def parameter_count(self) -> int:
        return len(self.layers) + sum(x.bias for x in self.layers) + self.embedding + self.head

    @property
    def options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "find_unused_parameters": self.find_unused,
            "static_graph": self.static == "constructor",
        }
        if self.caps is not None:
            options[self.caps[0]] = self.caps[1]
        return options


_CAPS = st.sampled_from([0.0, 16 / _MIB, 64 / _MIB, 200 / _MIB, 1.0, 5.0, 25.0])
_CAP_LISTS = st.lists(st.sampled_from([16 / _MIB, 64 / _MIB, 200 / _MIB]), min_size=1, max_size=3)


@st.composite
def bucket_scenarios(
    draw: st.DrawFn,
    *,
    find_unused: bool | None = None,
    static: tuple[str | None, ...] = (None, "constructor", "set"),
) -> BucketScenario:
    """Scenarios as the module docstring says; ``find_unused`` and ``static`` narrow them."""
    layers = draw(
        st.lists(
            st.builds(Layer, st.integers(1, 8), st.booleans(), st.booleans()),
            min_size=1,
            max_size=3,
        )
    )
    caps = draw(
        st.one_of(
            st.none(),
            st.tuples(st.just("bucket_cap_mb"), _CAPS),
            st.tuples(st.just("bucket_cap_mb_list"), _CAP_LISTS),
        )
    )
    static_graph = draw(st.sampled_from(static))
    searching = draw(st.booleans()) if find_unused is None else find_unused
    return BucketScenario(
        world_size=draw(st.integers(1, 3)),
        layers=tuple(layers),
        embedding=draw(st.booleans()),
        head=(searching or static_graph is not None) and draw(st.booleans()),
        caps=caps,
        find_unused=searching,
        static=static_graph,
    )


class _Net(nn.Module):
    def __init__(self, s: BucketScenario) -> None:
        super().__init__()
        self.embedding = nn.Embedding(6, 3, sparse=True) if s.embedding else None
        widths = [3, *(x.width for x in s.layers)]
        self.layers = nn.ModuleList(
            nn.Linear(a, x.width, bias=x.bias, dtype=torch.float64 if x.double else None)
            for a, x in zip(widths, s.layers, strict=False)
        )
        self.head = nn.Linear(widths[-1], 2, bias=False) if s.head else None

    def forward(self, x: Tensor, ids: Tensor, use_head: bool) -> Tensor:
        h = x if self.embedding is None else x + self.embedding(ids).sum(1)
        for layer in self.layers:
            h = torch.tanh(layer(h.to(layer.weight.dtype))).float()
        out = h.square().sum()
        if self.head is not None and use_head:
            out = out + self.head(h).sum()
        return out


def _use_head(s: BucketScenario, rank: int, step: int) -> bool:
    """Never under a static graph; some ranks and steps where unused parameters are searched
    for."""
    return s.static is None and (rank + step) % 2 == 0


Record = list[list[tuple[int, list[int]]]]  # per iteration: (index, parameters) per hook call


def _record_buckets(ddp: Any, model: nn.Module) -> Record:
    """Register a comm hook on ``ddp`` that records, per iteration, the buckets it sees;
    each iteration starts with ``record.append([])``."""
    index_of = {id(p): i for i, p in enumerate(model.parameters())}
    record: Record = []

    def hook(state: object, bucket: dist.GradBucket) -> Any:
        record[-1].append((bucket.index(), [index_of[id(p)] for p in bucket.parameters()]))
        return default_hooks.allreduce_hook(state, bucket)  # type: ignore[arg-type]

    hook.__annotations__ = {}  # torch's DDP reads them: none to check
    ddp.register_comm_hook(None, hook)
    return record


def _run(s: BucketScenario) -> list[tuple[Record, Record]]:
    """Per rank: what this project's wrapper's hook saw, then what torch's saw."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[Record, Record]:
        rank = pg.rank()
        records = []
        for cls in (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel):
            with _BUILD:
                torch.manual_seed(0)
                model = _Net(s)
            ddp: Any = cls(model, **s.options)
            if s.static == "set":
                ddp._set_static_graph()
            record = _record_buckets(ddp, model)
            for step in range(STEPS):
                record.append([])
                seed = torch.Generator().manual_seed(10 * step + rank)
                x = torch.randn(2, 3, generator=seed)
                ids = torch.randint(0, 6, (2, 2), generator=seed)
                ddp(x, ids, _use_head(s, rank, step)).backward()
            records.append(record)
        return records[0], records[1]

    return fakepg.run_torch(fn, s.world_size, timeout=30.0)


def check_buckets(s: BucketScenario) -> None:
    """The property: every rank's hook sees torch's buckets, iteration by iteration."""
    note_size(s.parameter_count, s.world_size)
    for rank, (ours, theirs) in enumerate(_run(s)):
        for step, (mine, torchs) in enumerate(zip(ours, theirs, strict=True)):
            if s.static is not None and step == 0:  # See Note [A static graph's first ...].
                mine = [(0, params) for _, params in mine]
                torchs = [(0, params) for _, params in torchs]
            assert mine == torchs, (
                f"rank {rank}, iteration {step}: the comm hook saw buckets (index, parameters) "
                f"{mine}, torch's {torchs}"
            )


@pytest.mark.slow
@settings(max_examples=4 * settings().max_examples)
@given(bucket_scenarios())
def test_comm_hooks_see_torchs_buckets_in_every_iteration(s: BucketScenario) -> None:
    event(f"caps: {s.caps and s.caps[0]}, find_unused: {s.find_unused}, static: {s.static}")
    event(f"{len({x.double for x in s.layers})} dtype(s), sparse: {s.embedding}")
    check_buckets(s)


def test_a_reloaded_static_graph_starts_from_torchs_buckets() -> None:
    """A wrapper searching for unused parameters, made static by ``_set_static_graph()``
    after construction (buckets by the cap), pickled and reloaded: torch builds the new
    reducer knowing the static graph (one bucket until the rebuild), and so does this one."""
    s = BucketScenario(
        1, (Layer(4, True, False),), False, False, ("bucket_cap_mb", 0.0), True, "set"
    )

    def fn(pg: fakepg.FakeProcessGroup) -> list[Record]:
        records = []
        for cls in (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel):
            with _BUILD:
                torch.manual_seed(0)
                ddp: Any = cls(_Net(s), **s.options)
            ddp._set_static_graph()
            buffer = io.BytesIO()
            torch.save(ddp, buffer)
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=False)
            record = _record_buckets(loaded, loaded.module)
            for _ in range(STEPS):
                record.append([])
                loaded(torch.randn(2, 3), torch.zeros(2, 2, dtype=torch.long), False).backward()
            records.append([[params for _, params in calls] for calls in record])
        return records

    ((ours, theirs),) = fakepg.run_torch(fn, 1, timeout=30.0)
    assert ours == theirs == [[[0, 1]], [[0, 1]], [[1], [0]]]
