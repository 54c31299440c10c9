"""reducer.DistributedDataParallel on the fake world: one test (or a few) per promise it makes.

Gradients are compared bit for bit (``torch.equal``) with the rank-order reference of
DESIGN.md, computed from plain local autograd: the fake world sums in rank order, so nothing
here needs a tolerance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist
from helpers import rank_input, run_ranks, seeded
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import fakepg
import reducer
from reducer.ddp._setup import bucket_limits
from reducer.testing.reference import rank_order_average

DDP = reducer.DistributedDataParallel
TINY_MB = 1e-5  # about 10 bytes: every parameter in a bucket of its own


def grads_of(model: nn.Module) -> list[Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def reference(
    build: Callable[[], nn.Module],
    backward: Callable[[nn.Module, int], None],
    world_size: int,
) -> list[Tensor | None]:
    """Per parameter, the rank-order average of what ``backward(model, rank)`` leaves in
    ``.grad`` of a fresh local model (None where no rank got a gradient), each term
    ``g * (1.0 / W)``: DDP scales as torch's does."""
    per_rank = []
    for rank in range(world_size):
        model = build()
        backward(model, rank)
        per_rank.append(grads_of(model))
    return [
        rank_order_average([g[i] for g in per_rank], world_size, scaling="reciprocal")
        for i in range(len(per_rank[0]))
    ]


def assert_bitwise(got: Sequence[Tensor | None], want: Sequence[Tensor | None], what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None:
            assert g is None, f"{what}: parameter {i} should have no gradient"
        else:
            assert g is not None, f"{what}: parameter {i} got no gradient"
            assert torch.equal(g, w), f"{what}: parameter {i} differs from the reference"


# -------------------------------------------------------------------------------------------
# Models.


class Tower(nn.Module):
    """trunk -> two heads; ``use`` picks the heads whose outputs are returned."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(6, 5)
        self.heads = nn.ModuleList([nn.Linear(5, 3), nn.Linear(5, 2)])

    def forward(self, x: Tensor, use: Sequence[int] = (0, 1)) -> list[Tensor]:
        h = torch.tanh(self.trunk(x))
        return [self.heads[i](h) for i in use]


def tower() -> Tower:
    return seeded(Tower, seed=1)


def tower_loss(outputs: Sequence[Tensor]) -> Tensor:
    return sum((o.pow(2).sum() for o in outputs), torch.zeros(()))


def x_of(rank: int, step: int = 0) -> Tensor:
    return rank_input(rank, (4, 6), step)


# -------------------------------------------------------------------------------------------
# Construction: same parameters everywhere, rank 0's values, torch's buckets.


def construction_errors(build: Callable[[int], nn.Module], world_size: int = 3) -> list[str]:
    """Build ``build(rank)`` on each rank, wrap it, and return each rank's error message."""

    def fn(pg: fakepg.FakeProcessGroup) -> str:
        with pytest.raises(reducer.InvalidArgument) as info:
            DDP(build(pg.rank()), pg)
        return str(info.value)

    return run_ranks(fn, world_size)


def test_a_shape_mismatch_names_the_first_parameter_and_the_ranks() -> None:
    def build(rank: int) -> nn.Module:
        # Rank 2 differs in the second layer (and, later, the third): the second is reported.
        width = 4 if rank == 2 else 3
        return nn.Sequential(nn.Linear(2, 2), nn.Linear(2, width), nn.Linear(width, 1))

    messages = construction_errors(build)
    assert len(set(messages)) == 1, "every rank must raise the same error"
    message = messages[0]
    assert "parameter 2 ('1.weight')" in message
    assert "rank 0 has float32 (3, 2)" in message and "rank 2 has float32 (4, 2)" in message
    assert "rank 1 has" not in message  # rank 1 agrees with rank 0
    assert "same model" in message


def test_a_dtype_mismatch_is_reported() -> None:
    def build(rank: int) -> nn.Module:
        return nn.Linear(2, 2, dtype=torch.float64 if rank == 1 else torch.float32)

    message = construction_errors(build, 2)[0]
    assert "parameter 0 ('weight')" in message
    assert "float32 (2, 2)" in message and "rank 1 has float64 (2, 2)" in message


def test_a_parameter_count_mismatch_lists_every_rank() -> None:
    def build(rank: int) -> nn.Module:
        return nn.Sequential(*[nn.Linear(2, 2) for _ in range(1 + (rank == 1))])

    message = construction_errors(build)[0]
    assert "rank 0: 2, rank 1: 4, rank 2: 2" in message


def test_parameters_and_buffers_come_from_rank_0() -> None:
    def build(seed: int) -> nn.Module:
        model = seeded(lambda: nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)), seed=seed)
        bn = model[1]
        assert isinstance(bn, nn.BatchNorm1d)
        with torch.no_grad():
            bn.running_mean.fill_(float(seed))
        bn.num_batches_tracked.fill_(10 + seed)  # an int64 buffer
        return model

    rank0 = build(0)

    def fn(pg: fakepg.FakeProcessGroup) -> dict[str, Tensor]:
        model = build(pg.rank())  # a different initialization on every rank
        DDP(model, pg)
        return {k: v.clone() for k, v in model.state_dict().items()}

    for state in run_ranks(fn, 3):
        assert state.keys() == rank0.state_dict().keys()
        for key, value in rank0.state_dict().items():
            assert torch.equal(state[key], value), key


def test_initial_buckets_are_torchs_by_cap_only_where_unused_parameters_are_searched() -> None:
    """torch 2.13: searching for unused parameters, the first bucket holds 1 MiB where
    bucket_cap_mb is left at its default and the cap where it is given, the others the cap,
    and the list is reversed; otherwise one bucket holds every parameter."""
    model = seeded(lambda: nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)]))
    params = list(model.parameters())  # weights 256 KiB, biases 1 KiB

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[list[int]]]:
        return [
            DDP(model, pg, **options).reducer.bucket_indices  # type: ignore[arg-type]
            for options in (
                {"find_unused_parameters": True},
                {"find_unused_parameters": True, "bucket_cap_mb": 2},
                {"bucket_cap_mb": 2},
                {"find_unused_parameters": True, "static_graph": True},
            )
        ]

    default, given, not_searching, static = run_ranks(fn, 1)[0]
    # In parameter order the first bucket closes once it holds 1 MiB: four weights and three
    # biases; the last bias starts the next one. Reversed: reduced first is the last bias.
    assert default == [[7], [0, 1, 2, 3, 4, 5, 6]]
    theirs = dist._compute_bucket_assignment_by_size(params, [1 << 20, 25 << 20])[0]
    assert default == [list(b) for b in reversed(theirs)]
    assert given == not_searching == static == [list(range(8))]  # 2 MiB holds the model


@pytest.mark.parametrize("cap", [None, 0, 0.001, 1, 5, 25, [0.001, 2.0, 0.5]])
@pytest.mark.parametrize(
    ("find_unused", "static_graph"), [(False, False), (True, False), (False, True), (True, True)]
)
def test_bucket_limits_are_torchs(
    cap: float | list[float] | None, find_unused: bool, static_graph: bool
) -> None:
    """The byte limits of the initial and the rebuilt buckets are those torch's
    ``_BucketCapacityConfig`` gives (an empty rebuild list: its reducer's [first, cap])."""
    config_type = getattr(nn.parallel.distributed, "_BucketCapacityConfig", None)
    if config_type is None:
        pytest.skip("this torch has no _BucketCapacityConfig")
    listed = cap if isinstance(cap, list) else None
    single = None if isinstance(cap, list) else cap
    config = config_type.create(single, listed, False)
    initial, rebuild = config.compute_bucket_size_limits(static_graph, find_unused)
    if not rebuild:
        rebuild = [config.first_bucket_bytes_cap, config.bucket_bytes_cap]
    _, our_initial, our_rebuild = bucket_limits(
        single, listed, static_graph=static_graph, find_unused_parameters=find_unused
    )
    assert (our_initial, our_rebuild) == (initial, rebuild)


def test_invalid_arguments() -> None:
    with fakepg.World(1) as world:
        pg = world.group(0)
        with pytest.raises(reducer.InvalidArgument, match=r"wraps an nn\.Module"):
            DDP(torch.ones(2), pg)  # type: ignore[arg-type]
        with pytest.raises(reducer.InvalidArgument, match="bucket_cap_mb must be"):
            DDP(nn.Linear(2, 2), pg, bucket_cap_mb=-1)
        # 0, as torch takes it: one parameter per bucket (from the start where unused
        # parameters are searched for; otherwise one bucket until the rebuild).
        searching = DDP(nn.Linear(2, 2), pg, bucket_cap_mb=0, find_unused_parameters=True)
        assert searching.reducer.bucket_indices == [[1], [0]]
        assert DDP(nn.Linear(2, 2), pg, bucket_cap_mb=0).reducer.bucket_indices == [[0, 1]]
        with pytest.raises(reducer.InvalidArgument, match=r"implement reducer\.ProcessGroup"):
            DDP(nn.Linear(2, 2), object())  # type: ignore[arg-type]
        frozen = nn.Linear(2, 2).requires_grad_(False)
        with pytest.raises(reducer.InvalidArgument, match="no parameter that requires grad"):
            DDP(frozen, pg)


# -------------------------------------------------------------------------------------------
# Forward: averaging, outputs in any structure, outputs the loss does not use, buffers.


@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_gradients_are_the_rank_order_average_over_iterations(
    world_size: int, no_leaked_threads: None
) -> None:
    steps = 3

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[Tensor | None]]:
        model = tower()
        ddp = DDP(model, pg, bucket_cap_mb=TINY_MB)
        out = []
        for step in range(steps):
            ddp.zero_grad(set_to_none=True)
            tower_loss(ddp(x_of(pg.rank(), step))).backward()
            out.append(grads_of(model))
        return out

    per_rank = run_ranks(fn, world_size)
    for step in range(steps):
        want = reference(
            tower, lambda m, r, s=step: tower_loss(m(x_of(r, s))).backward(), world_size
        )
        for rank in range(world_size):
            assert_bitwise(per_rank[rank][step], want, f"step {step}, rank {rank}")


@dataclasses.dataclass
class Out:
    score: Tensor
    label: str = "x"


class Pair(NamedTuple):
    first: Tensor
    second: Tensor


class Nested(nn.Module):
    """Returns each head's output somewhere deep in a structure."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleList([nn.Linear(6, 2) for _ in range(4)])

    def forward(self, x: Tensor) -> dict[str, Any]:
        a, b, c, d = (head(x) for head in self.heads)
        return {"list": [a, (b,)], "dc": Out(score=c), "pair": Pair(d, d), "none": None}


def test_forward_finds_outputs_in_nested_tuples_lists_dicts_dataclasses() -> None:
    """With find_unused_parameters, a head whose output the search missed would count as
    unused and then get a gradient: an error. Every head's gradient must be exact."""

    def loss(out: dict[str, Any]) -> Tensor:
        a, (b,) = out["list"]
        c, (d, d2) = out["dc"].score, out["pair"]
        assert d is d2
        return (a * 1 + b * 2 + c * 3 + d * 4).pow(2).sum()

    def build() -> Nested:
        return seeded(Nested)

    def fn(pg: fakepg.FakeProcessGroup) -> list[Tensor | None]:
        model = build()
        ddp = DDP(model, pg, find_unused_parameters=True, bucket_cap_mb=TINY_MB)
        out = ddp(x_of(pg.rank()))
        assert isinstance(out["dc"], Out) and out["dc"].label == "x"
        assert isinstance(out["pair"], Pair) and out["none"] is None
        loss(out).backward()
        assert ddp.reducer.unused_parameters == []
        return grads_of(model)

    want = reference(build, lambda m, r: loss(m(x_of(r))).backward(), 3)
    for rank, got in enumerate(run_ranks(fn, 3)):
        assert_bitwise(got, want, f"rank {rank}")


@pytest.mark.parametrize("static_graph", [False, True])
def test_outputs_not_used_in_the_loss_make_their_parameters_unused(static_graph: bool) -> None:
    """Head 1's output is returned but left out of the loss: on every rank in step 0 (its
    parameters are unused everywhere: .grad stays exactly as it was), and on odd ranks only
    in step 1 (zeros there: the average over the even ranks' gradients and zeros)."""
    world_size = 3
    preset = torch.full((2, 5), 0.25)

    def loss(outputs: list[Tensor], rank: int, step: int) -> Tensor:
        use_head1 = step == 1 and rank % 2 == 0
        return tower_loss(outputs if use_head1 else outputs[:1])

    def fn(pg: fakepg.FakeProcessGroup) -> dict[str, Any]:
        model = tower()
        kept = preset.clone()
        model.heads[1].weight.grad = kept
        ddp = DDP(
            model,
            pg,
            find_unused_parameters=not static_graph,
            static_graph=static_graph,
            bucket_cap_mb=TINY_MB,
        )
        loss(ddp(x_of(pg.rank())), pg.rank(), 0).backward()
        record: dict[str, Any] = {
            "weight_kept": model.heads[1].weight.grad is kept,
            "weight": model.heads[1].weight.grad.clone(),
            "bias": model.heads[1].bias.grad,
            "unused0": ddp.logging_data().unused_parameters,
        }
        if not static_graph:  # the next step changes the graph
            ddp.zero_grad(set_to_none=True)
            loss(ddp(x_of(pg.rank(), 1)), pg.rank(), 1).backward()
            record["unused1"] = ddp.logging_data().unused_parameters
            record["step1"] = grads_of(model)
        return record

    step1 = reference(tower, lambda m, r: loss(m(x_of(r, 1)), r, 1).backward(), world_size)
    for rank, record in enumerate(run_ranks(fn, world_size)):
        assert record["weight_kept"], "an unused parameter's .grad was replaced"
        assert torch.equal(record["weight"], preset)
        assert record["bias"] is None, "head 1's bias had no .grad and must keep none"
        assert record["unused0"] == 2  # heads.1.weight and heads.1.bias
        if not static_graph:
            assert record["unused1"] == (0 if rank % 2 == 0 else 2)
            assert_bitwise(record["step1"], step1, f"step 1, rank {rank}")


def test_a_head_used_only_in_no_sync_passes_after_a_step_that_left_it_out_is_reduced() -> None:
    """Step 0 leaves head 1 out of the loss. Step 1 uses it in a no_sync pass only, then
    leaves it out of the synced pass: what every rank accumulated for it in the no_sync pass
    must be averaged (nothing a rank computed is lost), not left local. (With static_graph
    the graph may not change so: not tested.)"""
    world_size = 2

    def fn(pg: fakepg.FakeProcessGroup) -> list[Tensor | None]:
        model = tower()
        ddp = DDP(model, pg, find_unused_parameters=True, bucket_cap_mb=TINY_MB)
        tower_loss(ddp(x_of(pg.rank()))[:1]).backward()
        ddp.zero_grad(set_to_none=True)
        with ddp.no_sync():
            tower_loss(ddp(x_of(pg.rank(), 1))).backward()
        tower_loss(ddp(x_of(pg.rank(), 2))[:1]).backward()  # synced, head 1 left out
        return grads_of(model)

    def local(model: nn.Module, rank: int) -> None:
        tower_loss(model(x_of(rank, 1))).backward()
        tower_loss(model(x_of(rank, 2))[:1]).backward()

    want = reference(tower, local, world_size)
    assert want[-1] is not None  # head 1 got gradients in the no_sync pass
    for rank, got in enumerate(run_ranks(fn, world_size)):
        assert_bitwise(got, want, f"rank {rank}")


class Counter(nn.Module):
    """A buffer that forward reads (recording what it saw) and then changes per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.register_buffer("count", torch.zeros(3))
        self.seen: list[Tensor] = []

    def forward(self, x: Tensor, rank: int) -> Tensor:
        self.seen.append(self.count.clone())
        self.count += rank + 1
        return self.lin(x) * self.count.sum()


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_buffers_are_broadcast_from_rank_0_before_each_forward(broadcast_buffers: bool) -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> list[Tensor]:
        model = seeded(Counter)
        ddp = DDP(model, pg, broadcast_buffers=broadcast_buffers)
        for _ in range(3):
            ddp(torch.ones(1, 2), pg.rank()).sum().backward()
        return model.seen

    seen = run_ranks(fn, 3)
    for rank in range(3):
        for step in range(3):
            # Rank 0 adds 1 per forward: with broadcasting, every rank starts each forward
            # from rank 0's count; without, from its own.
            per_forward = 1 if broadcast_buffers else rank + 1
            want = torch.full((3,), float(step * per_forward))
            assert torch.equal(seen[rank][step], want), (rank, step)


class Reassigning(nn.Module):
    """Buffers that forward replaces with new tensors (not in place), one shared by two
    submodules, one ignored, one set to None."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.inner = nn.Module()
        self.register_buffer("count", torch.zeros(3))
        self.register_buffer("local", torch.zeros(1))
        self.register_buffer("gone", torch.zeros(1))
        self.inner.register_buffer("count", self.count)  # the same tensor under two names
        self.seen: list[Tensor] = []

    def forward(self, x: Tensor, rank: int) -> Tensor:
        self.seen.append(torch.cat([self.count, self.local]))
        self.count = self.count + (rank + 1)  # a new tensor under the same name
        self.local = self.local + (rank + 1)
        self.gone = None
        return self.lin(x) * self.count.sum()


def test_buffers_that_forward_reassigns_are_still_broadcast() -> None:
    """The buffers are found once (as torch does), but read by name at each forward, so a
    module that assigns a new tensor to a buffer still starts every forward from rank 0's;
    an ignored buffer stays each rank's own; a buffer set to None is skipped."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[Tensor]:
        model = seeded(Reassigning)
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["local"])
        ddp = DDP(model, pg)
        for _ in range(3):
            ddp(torch.ones(1, 2), pg.rank()).sum().backward()
        return model.seen

    seen = run_ranks(fn, 3)
    for rank in range(3):
        for step in range(3):
            # count: rank 0's, which adds 1 per forward; local: the rank's own, rank + 1.
            want = torch.tensor([float(step)] * 3 + [float(step * (rank + 1))])
            assert torch.equal(seen[rank][step], want), (rank, step, seen[rank][step])


# -------------------------------------------------------------------------------------------
# Gradient accumulation: no_sync and the attribute nanoGPT toggles.


@pytest.mark.parametrize("how", ["no_sync", "attribute"])
@pytest.mark.parametrize("as_view", [False, True])
def test_accumulation_reduces_the_accumulated_sum(how: str, as_view: bool) -> None:
    world_size, micro_steps = 3, 3

    def backward_all(model: nn.Module, rank: int) -> None:
        for micro in range(micro_steps):
            tower_loss(model(x_of(rank, micro))).backward()

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[list[Tensor | None], list[Tensor | None]]:
        model = tower()
        ddp = DDP(model, pg, bucket_cap_mb=TINY_MB, gradient_as_bucket_view=as_view)
        local = []
        for micro in range(micro_steps):
            last = micro == micro_steps - 1
            if how == "no_sync" and not last:
                with ddp.no_sync():
                    tower_loss(ddp(x_of(pg.rank(), micro))).backward()
                assert ddp.require_backward_grad_sync
            else:
                ddp.require_backward_grad_sync = last  # nanoGPT's train.py does this
                tower_loss(ddp(x_of(pg.rank(), micro))).backward()
            if micro == 0:
                local = grads_of(model)  # nothing reduced yet: this rank's own gradients
        return local, grads_of(model)

    want = reference(tower, backward_all, world_size)
    for rank, (local, synced) in enumerate(run_ranks(fn, world_size)):
        mine = tower()
        tower_loss(mine(x_of(rank, 0))).backward()
        assert_bitwise(local, grads_of(mine), f"rank {rank} before the synced step")
        assert_bitwise(synced, want, f"rank {rank} after the synced step")


# -------------------------------------------------------------------------------------------
# gradient_as_bucket_view.


def test_bucket_view_grads_are_views_into_the_buckets() -> None:
    """Every .grad is its slice of the one bucket's flat storage, the same storage every
    iteration once the buckets were rebuilt (after the first): nothing is copied in or out."""

    def fn(pg: fakepg.FakeProcessGroup) -> None:
        model = tower()
        ddp = DDP(model, pg, gradient_as_bucket_view=True, bucket_cap_mb=1)
        sizes = [p.numel() for p in model.parameters()]
        storages = []
        for step in range(4):
            ddp.zero_grad(set_to_none=step == 2)  # in place, except once
            tower_loss(ddp(x_of(pg.rank(), step))).backward()
            grads = [p.grad for p in model.parameters()]
            assert all(g is not None for g in grads)
            storages.append({g.untyped_storage().data_ptr() for g in grads if g is not None})
            (bucket,) = ddp.reducer.bucket_indices
            offsets = {i: sum(sizes[j] for j in bucket[: bucket.index(i)]) for i in bucket}
            for i, g in enumerate(grads):
                assert g is not None and g.storage_offset() == offsets[i]
        assert all(len(s) == 1 for s in storages), "one flat storage per bucket"
        assert storages[1] == storages[2] == storages[3], "gradients moved out of the bucket"

    run_ranks(fn, 2)


# -------------------------------------------------------------------------------------------
# Rebuilding buckets in the order gradients became ready.


class TwoTowers(nn.Module):
    """Two independent layers; which one forward computes first decides which one's
    gradients backward produces first (autograd runs the later node first)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x: Tensor, a_first: bool) -> Tensor:
        if a_first:
            ya, yb = self.a(x), self.b(x)
        else:
            yb, ya = self.b(x), self.a(x)
        return (ya * yb).sum()


def test_buckets_are_rebuilt_once_in_rank_0s_ready_order() -> None:
    """Rank 0 computes a then b (b's gradients are ready first), the other ranks b then a.
    After the first iteration every rank rebuilds from rank 0's order, recorded by hooks."""
    world_size = 3

    def fn(pg: fakepg.FakeProcessGroup) -> dict[str, Any]:
        model = seeded(TwoTowers)
        hooked: list[int] = []
        for i, p in enumerate(model.parameters()):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: hooked.append(i))
        ddp = DDP(model, pg, bucket_cap_mb=TINY_MB)
        initial = ddp.reducer.bucket_indices
        a_first = pg.rank() == 0
        x = x_of(pg.rank())[:, :3]
        ddp(x, a_first).backward()
        ready = ddp.reducer.ready_order
        record = {"initial": initial, "hooked": list(hooked), "ready": ready}
        for step in range(3):
            ddp.zero_grad()
            ddp(x, not a_first if step else a_first).backward()  # the order changes later
            record[f"buckets{step}"] = ddp.reducer.bucket_indices
        record["rebuilt"] = ddp.logging_data().buckets_rebuilt
        return record

    records = run_ranks(fn, world_size)
    zero = records[0]
    # torch 2.13 without find_unused_parameters: every parameter in one bucket, whatever the
    # cap, until the rebuild.
    assert zero["initial"] == [[0, 1, 2, 3]]
    assert zero["ready"] == zero["hooked"]
    assert zero["ready"][:2] == [2, 3] or zero["ready"][:2] == [3, 2]  # b's first
    assert records[1]["ready"][:2] in ([0, 1], [1, 0]), "rank 1 should see a's first"
    for record in records:
        assert record["rebuilt"]
        # Every rank, every later iteration: rank 0's order, one parameter per bucket.
        for step in range(3):
            assert record[f"buckets{step}"] == [[i] for i in zero["ready"]]


def test_ranks_built_with_different_caps_take_rank_0s_rebuilt_buckets() -> None:
    """Rank 0 with bucket_cap_mb=0.0001 (a bucket per parameter), the others with 25 (one
    bucket): as torch 2.13, one bucket in the first iteration, then rank 0's rebuilt bucket
    indices on every rank, and every iteration's gradients the rank-order average."""
    world_size, steps = 3, 3

    def fn(pg: fakepg.FakeProcessGroup) -> dict[str, Any]:
        model = tower()
        ddp = DDP(model, pg, bucket_cap_mb=0.0001 if pg.rank() == 0 else 25)
        record: dict[str, Any] = {"buckets": [], "grads": []}
        for step in range(steps):
            ddp.zero_grad(set_to_none=True)
            tower_loss(ddp(x_of(pg.rank(), step))).backward()
            record["buckets"].append(ddp.reducer.bucket_indices)  # rebuilt in step 1's forward
            record["grads"].append(grads_of(model))
        return record

    records = run_ranks(fn, world_size)
    count = len(list(tower().parameters()))
    rebuilt = records[0]["buckets"][1]
    assert len(rebuilt) > 1, "rank 0's cap (about 100 bytes) splits the parameters"
    for rank, record in enumerate(records):
        assert record["buckets"][0] == [list(range(count))], f"rank {rank}: one bucket first"
        assert record["buckets"][1:] == [rebuilt] * (steps - 1), f"rank {rank}: rank 0's"
        for step in range(steps):
            want = reference(
                tower, lambda m, r, s=step: tower_loss(m(x_of(r, s))).backward(), world_size
            )
            assert_bitwise(record["grads"][step], want, f"step {step}, rank {rank}")


@pytest.mark.parametrize(
    ("find_unused", "static_graph", "rebuilt_at"),
    [(False, False, 1), (True, False, None), (True, True, 2), (False, True, 2)],
)
def test_when_buckets_are_rebuilt(
    find_unused: bool, static_graph: bool, rebuilt_at: int | None
) -> None:
    """Like torch: never while searching for unused parameters (the order may change every
    iteration); at the second forward otherwise; with static_graph at the third, from the
    order recorded in the second iteration (the first records none)."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[list[bool], list[list[int]]]:
        model = seeded(TwoTowers)
        ddp = DDP(
            model,
            pg,
            bucket_cap_mb=TINY_MB,
            find_unused_parameters=find_unused,
            static_graph=static_graph,
        )
        rebuilt = []
        for _ in range(3):
            ddp(x_of(pg.rank())[:, :3], True).backward()
            rebuilt.append(ddp.logging_data().buckets_rebuilt)
        return rebuilt, ddp.reducer.bucket_indices

    got_rebuilt, buckets = run_ranks(fn, 2)[0]
    assert got_rebuilt == [rebuilt_at is not None and i >= rebuilt_at for i in range(3)]
    # a then b in forward: b's gradients first, so the rebuilt buckets start with b's.
    assert (buckets[0][0] in (2, 3)) if rebuilt_at else buckets == [[3], [2], [1], [0]]


# -------------------------------------------------------------------------------------------
# static_graph.


class Checkpointed(nn.Module):
    """``a`` runs twice, each time inside reentrant checkpointing, and so does everything
    after it: in backward, ``a``'s hooks fire twice, and the first hook call of all comes
    from an inner (reentrant) backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 2)
        self.unused = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = checkpoint(self.a, x, use_reentrant=True, preserve_rng_state=False)
        h = checkpoint(self.a, torch.tanh(h), use_reentrant=True, preserve_rng_state=False)
        out = checkpoint(self._tail, h, use_reentrant=True, preserve_rng_state=False)
        assert isinstance(out, Tensor)
        return out

    def _tail(self, h: Tensor) -> Tensor:
        return self.c(self.b(torch.tanh(h)))


def checkpointed() -> Checkpointed:
    return seeded(Checkpointed, seed=2)


def ckpt_input(rank: int, step: int) -> Tensor:
    return x_of(rank, step)[:, :4].requires_grad_()  # reentrant checkpointing needs one


def test_static_graph_supports_reentrant_checkpointing() -> None:
    world_size, steps = 3, 3

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[Tensor | None]]:
        model = checkpointed()
        ddp = DDP(model, pg, static_graph=True, bucket_cap_mb=TINY_MB)
        out = []
        for step in range(steps):
            ddp.zero_grad(set_to_none=True)
            ddp(ckpt_input(pg.rank(), step)).pow(2).sum().backward()
            out.append(grads_of(model))
        assert ddp.logging_data().buckets_rebuilt
        return out

    per_rank = run_ranks(fn, world_size)
    for step in range(steps):
        want = reference(
            checkpointed,
            lambda m, r, s=step: m(ckpt_input(r, s)).pow(2).sum().backward(),
            world_size,
        )
        assert want[-1] is None and want[-2] is None  # `unused` never gets a gradient
        for rank in range(world_size):
            assert_bitwise(per_rank[rank][step], want, f"step {step}, rank {rank}")


class CheckpointedWithAux(nn.Module):
    """A body under reentrant checkpointing, and an auxiliary head beside it, returned in a
    dict. The search for parameters reached only by outputs the loss leaves out cannot see
    into the checkpoint (its forward ran without grad)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.aux = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"main": checkpoint(self.body, x, use_reentrant=True), "aux": self.aux(x)}


def test_static_graph_reduces_a_checkpointed_body_when_a_head_is_left_out_of_the_loss() -> None:
    """The body's gradients arrive inside the checkpoint's own backward: they are real
    gradients, not the hook calls without a gradient that the left-out head's get."""
    world_size, steps = 3, 2

    def build() -> CheckpointedWithAux:
        return seeded(CheckpointedWithAux, seed=4)

    def loss(out: dict[str, Tensor]) -> Tensor:
        return out["main"].pow(2).sum()

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[Tensor | None]]:
        model = build()
        ddp = DDP(model, pg, static_graph=True, bucket_cap_mb=TINY_MB)
        out = []
        for step in range(steps):
            ddp.zero_grad(set_to_none=True)
            loss(ddp(ckpt_input(pg.rank(), step))).backward()
            out.append(grads_of(model))
        return out

    per_rank = run_ranks(fn, world_size)
    for step in range(steps):
        want = reference(
            build, lambda m, r, s=step: loss(m(ckpt_input(r, s))).backward(), world_size
        )
        assert want[0] is not None and want[2] is None  # body used, aux left out everywhere
        for rank in range(world_size):
            assert_bitwise(per_rank[rank][step], want, f"step {step}, rank {rank}")


def test_without_static_graph_reentrant_checkpointing_is_the_marked_twice_error() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> str:
        ddp = DDP(checkpointed(), pg)
        with pytest.raises(RuntimeError, match="marked ready twice") as info:
            ddp(ckpt_input(pg.rank(), 0)).sum().backward()
        return str(info.value)

    for message in run_ranks(fn, 2):
        assert "'a.weight'" in message or "'a.bias'" in message
        assert "use_reentrant=False" in message


def test_static_graph_refuses_a_graph_that_changed() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> str:
        model = seeded(lambda: nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)))
        ddp = DDP(model, pg, static_graph=True)
        x = torch.ones(2, 3, requires_grad=True)
        ddp(x).sum().backward()
        out = ddp(x)
        # The first layer again, inside reentrant checkpointing: its hook fires twice now.
        extra = checkpoint(model[0], x, use_reentrant=True, preserve_rng_state=False)
        assert isinstance(extra, Tensor)
        with pytest.raises(RuntimeError, match="static_graph") as info:
            (out.sum() + extra.sum()).backward()
        return str(info.value)

    for message in run_ranks(fn, 2):
        assert "'0.weight'" in message or "'0.bias'" in message
        assert "recorded in the first one" in message and "static_graph=False" in message


# -------------------------------------------------------------------------------------------
# The two classic errors, naming parameters by module path.


def test_unused_parameters_without_the_search_name_their_module_path() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> str:
        ddp = DDP(tower(), pg)
        tower_loss(ddp(x_of(pg.rank()), use=(0,))).backward()  # heads.1 unused
        with pytest.raises(RuntimeError, match="before the previous one finished") as info:
            ddp(x_of(pg.rank()))
        return str(info.value)

    for message in run_ranks(fn, 2):
        assert "'heads.1.weight'" in message and "'heads.1.bias'" in message
        assert "'heads.0.weight'" not in message
        assert "find_unused_parameters=True" in message


def test_a_parameter_used_outside_forward_names_its_module_path() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> str:
        model = tower()
        ddp = DDP(model, pg, find_unused_parameters=True)
        out = ddp(x_of(pg.rank()), use=(0,))
        # heads.1 is unused in forward, then used in the loss: the search could not see it.
        head = model.heads[1]
        assert isinstance(head, nn.Linear)
        with pytest.raises(RuntimeError, match="marked ready twice") as info:
            (tower_loss(out) + head.weight.sum()).backward()
        return str(info.value)

    for message in run_ranks(fn, 2):
        assert "'heads.1.weight'" in message and "found unused" in message


# -------------------------------------------------------------------------------------------
# Logging data.


def test_logging_data_reports_configuration_buckets_and_timings() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> tuple[reducer.DDPLoggingData, dict[str, Any]]:
        model = tower()
        ddp = DDP(model, pg, bucket_cap_mb=TINY_MB, find_unused_parameters=True)
        before = ddp.logging_data()
        assert before.iterations == 0 and before.forward_ms == 0 and before.grad_ready_order == ()
        ddp.register_comm_hook(None, reducer.allreduce_hook)
        for step in range(3):
            ddp.zero_grad()
            use = (0,) if step == 2 else (0, 1)
            tower_loss(ddp(x_of(pg.rank(), step), use)).backward()
        with ddp.no_sync():  # not an iteration: changes nothing
            tower_loss(ddp(x_of(pg.rank()))).backward()
        return ddp.logging_data(), ddp._get_ddp_logging_data()

    for rank, (data, as_dict) in enumerate(run_ranks(fn, 2)):
        assert dataclasses.is_dataclass(data)
        with pytest.raises(dataclasses.FrozenInstanceError):
            data.iterations = 5  # type: ignore[misc]
        # The record's fields, in torch's format where torch has the key, and torch's keys.
        torch_format = {
            "dtypes": "float",
            "bucket_sizes": ", ".join(map(str, data.bucket_sizes)),
            "broadcast_buffers": 1,
            "find_unused_parameters": 1,
            "gradient_as_bucket_view": 0,
            "static_graph": 0,
        }
        assert {k: as_dict[k] for k in dataclasses.asdict(data)} == {
            **dataclasses.asdict(data),
            **torch_format,
        }
        # torch's "iteration" is the index of the last sampled iteration (all of the first 10).
        assert (as_dict["iteration"], as_dict["has_rebuilt_buckets"]) == (2, 0)
        assert as_dict["num_parameter_tensors"] == 6 and as_dict["output_device"] == -1
        assert as_dict["num_buckets_reduced"] == len(data.bucket_sizes)
        assert (data.rank, data.world_size, data.process_group) == (rank, 2, "FakeProcessGroup")
        assert data.module_name == "Tower" and data.comm_hook == "allreduce_hook"
        assert data.find_unused_parameters and not data.static_graph
        assert data.iterations == 3 and not data.buckets_rebuilt
        assert data.num_parameters == 6 and data.dtypes == ("float32",)
        sizes = [p.numel() * 4 for p in tower().parameters()]
        assert data.total_parameter_size_bytes == sum(sizes)
        assert data.num_buckets == len(data.bucket_sizes) == len(data.bucket_param_indices) == 6
        assert sorted(i for b in data.bucket_param_indices for i in b) == list(range(6))
        for size, indices in zip(data.bucket_sizes, data.bucket_param_indices, strict=True):
            assert size == sum(sizes[i] for i in indices)
        assert sorted(data.grad_ready_order) == list(range(6))
        assert data.unused_parameters == 2  # heads.1 in the last synced iteration
        assert data.forward_ms > 0 and data.backward_compute_ms > 0 and data.comm_ms > 0
        assert 0 <= data.overlap_ms <= data.comm_ms
        assert data.avg_forward_ms > 0 and data.avg_comm_ms > 0
        assert 0 <= data.avg_overlap_ms <= data.avg_comm_ms


# -------------------------------------------------------------------------------------------
# torch's constructor: the process group, devices, arguments honoured or refused by name.


def test_the_group_is_torchs_default_group_or_the_one_given() -> None:
    """No group: the default group, which on fakepg's torch backend is used through its own
    FakeProcessGroup; a raw torch group likewise; the fake group itself, second or by
    keyword. Each reduces over the rank's FakeProcessGroup; ``process_group`` is, as in
    torch, the group given (the default group when none was)."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[tuple[bool, bool]]:
        world = dist.group.WORLD
        given: list[tuple[tuple[Any, ...], dict[str, Any], object]] = [
            ((), {}, world),
            ((world,), {}, world),
            ((), {"process_group": world}, world),
            ((pg,), {}, pg),
            ((), {"process_group": pg}, pg),
        ]
        wrappers = [(DDP(tower(), *args, **kwargs), shown) for args, kwargs, shown in given]
        return [(ddp._group is pg, ddp.process_group is shown) for ddp, shown in wrappers]

    fakepg.register_torch_backend()
    for same in fakepg.run_torch(fn, 2, timeout=20.0):
        assert same == [(True, True)] * 5


def test_without_a_group_or_a_default_group_the_error_says_what_to_do() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> str:
        with pytest.raises(reducer.InvalidArgument) as info:
            DDP(tower())
        return str(info.value)

    for message in run_ranks(fn, 1):
        assert "no process_group was given" in message
        assert "init_process_group" in message and "process_group=" in message


def test_a_group_given_twice_is_refused() -> None:
    with fakepg.World(1) as world:
        pg = world.group(0)
        with pytest.raises(reducer.InvalidArgument, match="pass it once"):
            DDP(tower(), pg, process_group=pg)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device_ids": [0]}, r"device_ids=\[0\] and output_device=None name a device.*cpu"),
        ({"output_device": 1}, r"output_device=1 name a device.*CPU module"),
        ({"device_ids": [0, 1]}, r"device_ids=\[0, 1\] names several devices"),
        ({"device_ids": 0}, r"device_ids must be a list of one device"),
    ],
)
def test_device_ids_on_a_cpu_module_are_refused_as_by_torch(
    kwargs: dict[str, Any], match: str
) -> None:
    """torch's DDP refuses device_ids and output_device for a CPU module (ValueError), and
    several devices for any module; so does this wrapper, naming the argument. (torch tests
    them for truth: ``output_device=0`` on a CPU module is ignored, as here.)"""
    with fakepg.World(1) as world:
        with pytest.raises(reducer.InvalidArgument, match=match):
            DDP(tower(), process_group=world.group(0), **kwargs)
        assert DDP(tower(), None, process_group=world.group(0)).device_ids is None
        ignored = DDP(tower(), process_group=world.group(0), output_device=0)
        assert ignored.device_ids is None and ignored.output_device is None


def test_inputs_move_to_the_device_as_torchs_ddp_moves_them() -> None:
    """To the module's device (``device_ids[0]``), through nested containers; shown with the
    meta device, which every machine has."""
    from reducer.ddp._setup import move_inputs

    x, y, z = torch.ones(2), torch.zeros(3), torch.ones(1)
    inputs, kwargs = move_inputs((x, [y, {"k": z}], 3), {"w": (z,)}, torch.device("meta"))
    assert inputs[0].device.type == "meta" and inputs[2] == 3
    assert inputs[1][0].device.type == "meta" and inputs[1][1]["k"].device.type == "meta"
    assert kwargs["w"][0].device.type == "meta" and inputs[0].shape == (2,)
    assert move_inputs((), {}, torch.device("meta")) == ((), {})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA device is needed")
def test_a_module_on_one_gpu_takes_device_ids_and_gets_its_inputs_moved() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> tuple[list[int] | None, torch.device]:
        model = tower().cuda(0)
        ddp = DDP(model, pg, device_ids=[0])
        seen: list[torch.device] = []
        model.register_forward_pre_hook(lambda _m, args: seen.append(args[0].device))
        ddp(x_of(pg.rank()))  # a CPU input
        return ddp.device_ids, seen[0]

    for ids, device in run_ranks(fn, 1):
        assert ids == [0] and device == torch.device("cuda", 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"delay_all_reduce_named_params": [], "param_to_hook_all_reduce": None},
        {"param_to_hook_all_reduce": object()},
    ],
    ids=lambda kwargs: next(k for k, v in kwargs.items() if v is not None),
)
def test_arguments_this_wrapper_cannot_honour_are_refused_by_name(kwargs: dict[str, Any]) -> None:
    name = next(k for k, v in kwargs.items() if v is not None)
    with fakepg.World(1) as world, pytest.raises(reducer.InvalidArgument) as info:
        DDP(tower(), world.group(0), **kwargs)
    assert f"{name} is not supported" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"mixed_precision": object()}, reducer.InvalidArgument, "param_dtype is missing"),
        # A group given, and a mesh: torch's RuntimeError and phrase.
        ({"device_mesh": object()}, RuntimeError, "Cannot specify both process_group and"),
    ],
    ids=["mixed_precision", "device_mesh"],
)
def test_bad_mixed_precision_or_device_mesh_is_refused_by_name(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with fakepg.World(1) as world, pytest.raises(error, match=match):
        DDP(tower(), world.group(0), **kwargs)


def test_check_reduction_warns_as_torchs_does() -> None:
    with fakepg.World(1) as world, pytest.warns(FutureWarning, match="check_reduction"):
        DDP(tower(), world.group(0), check_reduction=True)


def test_bucket_cap_mb_list_sets_each_buckets_cap_as_in_torch() -> None:
    model = seeded(lambda: nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)]))
    params = list(model.parameters())
    caps = [0.01, 0.02, 0.04]
    limits = [int(c * (1 << 20)) for c in caps]

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[list[list[int]], list[list[int]], float]:
        ddp = DDP(model, pg, bucket_cap_mb_list=caps)
        initial = ddp.reducer.bucket_indices
        ddp(torch.ones(1, 64)).sum().backward()
        ddp(torch.ones(1, 64)).sum().backward()  # rebuilt first, in the ready order
        return initial, ddp.reducer.bucket_indices, ddp.logging_data().bucket_cap_mb

    initial, rebuilt, cap = run_ranks(fn, 1)[0]
    theirs = dist._compute_bucket_assignment_by_size(params, limits)[0]
    assert initial == [list(b) for b in reversed(theirs)]
    order = [i for b in rebuilt for i in b]
    by_order = dist._compute_bucket_assignment_by_size([params[i] for i in order], limits)[0]
    assert rebuilt == [[order[j] for j in b] for b in by_order]
    assert cap == 0.04
    with fakepg.World(1) as world, pytest.raises(reducer.InvalidArgument, match="pass one"):
        DDP(model, world.group(0), bucket_cap_mb=1, bucket_cap_mb_list=caps)


def test_init_sync_false_runs_no_collective_at_construction() -> None:
    """Each rank keeps its own initial values (nothing verified, nothing broadcast)."""

    def fn(pg: fakepg.FakeProcessGroup) -> Tensor:
        model = seeded(Tower, seed=pg.rank())
        DDP(model, pg, init_sync=False)
        return model.trunk.weight.detach().clone()

    first, second = run_ranks(fn, 2)
    assert torch.equal(first, seeded(Tower, seed=0).trunk.weight)
    assert torch.equal(second, seeded(Tower, seed=1).trunk.weight)


def test_a_lazy_module_is_refused_until_initialized() -> None:
    with fakepg.World(1) as world, pytest.raises(RuntimeError, match="not initialized") as info:
        DDP(nn.LazyLinear(3), world.group(0))
    assert isinstance(info.value, reducer.InvalidModel)
    assert "parameter 0 ('weight')" in str(info.value)


def test_a_requires_grad_mismatch_across_ranks_is_a_runtime_error() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> str:
        model = tower()
        model.trunk.bias.requires_grad_(pg.rank() == 0)
        with pytest.raises(RuntimeError) as info:
            DDP(model, pg)
        assert isinstance(info.value, reducer.InvalidModel)  # and an InvalidArgument
        return str(info.value)

    for message in run_ranks(fn, 2):
        assert "parameter 1 ('trunk.bias') differs between ranks" in message
        assert "rank 1 has float32 (5,) (frozen: requires_grad=False)" in message


# -------------------------------------------------------------------------------------------
# Ignored parameters and buffers.


def test_ignored_names_must_name_parameters_or_buffers() -> None:
    model = tower()
    DDP._set_params_and_buffers_to_ignore_for_model(model, ["trunk.weight", "module.trunk.bias"])
    assert getattr(model.trunk.weight, "_ddp_ignored", False)
    with fakepg.World(1) as world, pytest.raises(reducer.InvalidArgument) as info:
        DDP(model, world.group(0))
    assert "'module.trunk.bias'" in str(info.value) and "'trunk.weight'" not in str(info.value)


def test_an_ignored_parameter_is_neither_reduced_nor_broadcast() -> None:
    """``trunk.weight`` ignored: each rank keeps its own values and its local gradient; the
    others are averaged, bit for bit."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[Tensor, list[Tensor | None], int]:
        model = tower()
        with torch.no_grad():
            model.trunk.weight.add_(pg.rank())
        DDP._set_params_and_buffers_to_ignore_for_model(model, ["trunk.weight"])
        ddp = DDP(model, pg, bucket_cap_mb=TINY_MB)
        tower_loss(ddp(x_of(pg.rank()))).backward()
        reduced = sum(len(b) for b in ddp.reducer.bucket_indices)
        return model.trunk.weight.detach().clone(), grads_of(model), reduced

    def shifted(rank: int) -> nn.Module:
        model = tower()
        with torch.no_grad():
            model.trunk.weight.add_(rank)
        return model

    per_rank = []
    for rank in range(2):
        local = shifted(rank)
        tower_loss(local(x_of(rank))).backward()
        per_rank.append(grads_of(local))
    averaged = [rank_order_average([g[i] for g in per_rank], 2) for i in range(6)]
    for rank, (weight, grads, reduced) in enumerate(run_ranks(fn, 2)):
        assert reduced == 5
        assert torch.equal(weight, shifted(rank).trunk.weight)
        assert_bitwise(grads[:1], per_rank[rank][:1], f"rank {rank}: the ignored weight")
        assert_bitwise(grads[1:], averaged[1:], f"rank {rank}: the reduced parameters")


# -------------------------------------------------------------------------------------------
# _set_static_graph, close, the comm hook's timeout.


def test_set_static_graph_only_before_the_first_iteration() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> str:
        ddp = DDP(tower(), pg)
        ddp._set_static_graph()
        with pytest.warns(UserWarning, match="no need to set it again"):
            ddp._set_static_graph()
        late = DDP(tower(), pg)
        tower_loss(late(x_of(pg.rank()))).backward()
        with pytest.raises(RuntimeError) as info:
            late._set_static_graph()
        assert not late.static_graph
        return str(info.value)

    for message in run_ranks(fn, 2):
        assert "after the first iteration started" in message
        assert "before the first forward" in message and "static_graph=True" in message


def test_close_ends_the_wrapper_and_recovery_needs_no_private_attribute() -> None:
    """After an error the ranks are out of step: close() the wrapper and wrap the model
    again; the new wrapper averages as usual. A closed wrapper refuses forward."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[str, str, list[Tensor | None]]:
        model = tower()
        ddp = DDP(model, pg)
        tower_loss(ddp(x_of(pg.rank()), use=(0,))).backward()  # heads.1 unused: unfinished
        with pytest.raises(RuntimeError):
            ddp(x_of(pg.rank()))
        with pytest.raises(RuntimeError) as failed:
            ddp(x_of(pg.rank()))
        ddp.close()
        ddp.close()  # idempotent
        with pytest.raises(RuntimeError) as closed:
            ddp(x_of(pg.rank()))
        model.zero_grad(set_to_none=True)
        fresh = DDP(model, pg)
        tower_loss(fresh(x_of(pg.rank(), 1))).backward()
        return str(failed.value), str(closed.value), grads_of(model)

    want = reference(tower, lambda m, r: tower_loss(m(x_of(r, 1))).backward(), 2)
    for rank, (failed, closed, grads) in enumerate(run_ranks(fn, 2)):
        assert "forward: this DistributedDataParallel failed in an earlier iteration" in failed
        assert "close() on this DistributedDataParallel and wrap the model in a new one" in failed
        assert "forward on a closed DistributedDataParallel" in closed
        assert_bitwise(grads, want, f"rank {rank} after recovery")


def test_the_comm_hook_timeout_is_set_from_the_wrapper() -> None:
    def never(state: object, bucket: reducer.GradBucket) -> torch.futures.Future[Tensor]:
        return torch.futures.Future()  # nothing completes it

    def fn(pg: fakepg.FakeProcessGroup) -> str:
        ddp = DDP(tower(), pg, comm_hook_timeout=0.2)
        ddp.register_comm_hook(None, never)
        with pytest.raises(RuntimeError) as info:
            tower_loss(ddp(x_of(pg.rank()))).backward()
        return str(info.value)

    for message in run_ranks(fn, 2):
        assert "did not complete within 0.2 s" in message


# -------------------------------------------------------------------------------------------
# Errors in the DDP user's words.


def test_errors_speak_of_the_wrappers_arguments_not_the_reducers_calls() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> list[str]:
        messages = []
        model = tower()
        ddp = DDP(model, pg, find_unused_parameters=True)
        out = ddp(x_of(pg.rank()), use=(0,))
        head = model.heads[1]
        assert isinstance(head, nn.Linear)
        with pytest.raises(RuntimeError) as info:
            (tower_loss(out) + head.weight.sum()).backward()
        messages.append(str(info.value))
        ddp.close()
        static = DDP(seeded(lambda: nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))), pg)
        static._set_static_graph()
        x = torch.ones(2, 3, requires_grad=True)
        static(x).sum().backward()
        out = static(x)
        extra = checkpoint(static.module[0], x, use_reentrant=True)
        assert isinstance(extra, Tensor)
        with pytest.raises(RuntimeError) as info:
            (out.sum() + extra.sum()).backward()
        messages.append(str(info.value))
        return messages

    for twice, changed in run_ranks(fn, 2):
        assert "Expected to mark a variable ready only once" in twice
        assert "the outputs forward returned do not depend on it" in twice
        assert "construct DistributedDataParallel with find_unused_parameters=False" in twice
        assert "Construct DistributedDataParallel with static_graph=False" in changed
        for message in (twice, changed):
            assert "prepare_for_backward" not in message and "Build the reducer" not in message


# -------------------------------------------------------------------------------------------
# Bucket views: the parameter's strides, one .grad object for good.


class Sometimes(nn.Module):
    """``side``'s output is returned at every step, and in the loss only when ``use``."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(4, 3)
        self.side = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.main(x), self.side(x)


def sometimes_loss(out: tuple[Tensor, Tensor], use: bool) -> Tensor:
    main, side = out
    return main.pow(2).sum() + (side.pow(2).sum() if use else 0)


@pytest.mark.parametrize("static_graph", [False, True])
def test_bucket_view_grads_stay_the_same_objects_across_iterations(static_graph: bool) -> None:
    """``side`` is reached by the outputs but not by the loss on rank 1 at step 2, and on no
    rank at steps 3 and 4 (with static_graph: never, on any rank). Its .grad must stay the one view
    object, holding the average where some rank used it and its old values where none did."""
    world_size = 2

    def use(rank: int, step: int) -> bool:
        return not static_graph and (step < 2 or (step == 2 and rank == 0))

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[Tensor | None]]:
        model = seeded(Sometimes)
        if static_graph:  # a .grad that must survive every iteration untouched
            model.side.weight.grad = torch.full((2, 4), 0.5)
        ddp = DDP(
            model,
            pg,
            gradient_as_bucket_view=True,
            find_unused_parameters=not static_graph,
            static_graph=static_graph,
        )
        after, objects = [], []
        for step in range(5):
            model.zero_grad(set_to_none=False)  # in place: the views stay
            if static_graph:
                model.side.weight.grad.fill_(0.5)
            sometimes_loss(ddp(x_of(pg.rank(), step)[:, :4]), use(pg.rank(), step)).backward()
            after.append(grads_of(model))
            objects.append([p.grad for p in model.parameters()])
        rebuilt = 2 if static_graph else 1  # the buckets are rebuilt once, at this step
        for step in range(rebuilt + 1, 5):
            for now, first in zip(objects[step], objects[rebuilt], strict=True):
                assert now is first, f"step {step}: a .grad left its bucket view"
        (bucket,) = ddp.reducer.bucket_indices  # one bucket: every .grad is a view of it
        storages = {g.untyped_storage().data_ptr() for g in objects[-1] if g is not None}
        assert len(bucket) == 4 and len(storages) == 1, "a .grad is not a bucket view"
        return after

    per_rank = run_ranks(fn, world_size)
    for step in range(5):

        def backward(model: nn.Module, rank: int, step: int = step) -> None:
            sometimes_loss(model(x_of(rank, step)[:, :4]), use(rank, step)).backward()

        want = reference(lambda: seeded(Sometimes), backward, world_size)
        if static_graph:  # side: never used; its weight keeps the .grad it had, its bias none
            want[2] = torch.full((2, 4), 0.5)
        elif step >= 3:  # side: unused everywhere; as it was, zeroed in place
            want[2], want[3] = torch.zeros(2, 4), torch.zeros(2)
        for rank in range(world_size):
            assert_bitwise(per_rank[rank][step], want, f"step {step}, rank {rank}")
