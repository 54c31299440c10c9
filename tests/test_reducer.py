"""The reducer on the fake world: exact averages, unused parameters, accumulation, errors."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import pytest
import torch
from helpers import (
    expected_average,
    local_grads,
    mlp,
    names_of,
    rank_input,
    reducer_for,
    run_ranks,
    seeded,
)
from torch import nn

import fakepg
import reducer
from reducer.buckets import FUSED_DIVISION_MIN_NUMEL
from reducer.testing.reference import rank_order_average, sparse_average


def mlp_loss(model: nn.Module, rank: int) -> torch.Tensor:
    return model(rank_input(rank, (4, 6))).pow(2).sum()


def assert_grads_equal(model: nn.Module, expected: list[torch.Tensor | None]) -> None:
    for (name, p), want in zip(model.named_parameters(), expected, strict=True):
        if want is None:
            assert p.grad is None, f"{name} should have no gradient"
        else:
            assert p.grad is not None, f"{name} got no gradient"
            assert torch.equal(p.grad, want), f"{name} differs from the rank-order reference"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("as_view", [False, True])
def test_dense_gradients_are_the_bitwise_rank_order_average(world_size: int, as_view: bool) -> None:
    expected = expected_average(mlp, mlp_loss, world_size)

    def fn(pg: fakepg.FakeProcessGroup) -> nn.Module:
        model = mlp()
        with reducer_for(model, pg, gradient_as_bucket_view=as_view) as red:
            assert len(red.bucket_indices) > 1
            red.prepare_for_backward([])
            mlp_loss(model, pg.rank()).backward()
        return model

    for model in run_ranks(fn, world_size):
        assert_grads_equal(model, expected)


def wide_mlp() -> nn.Sequential:
    """Small parameters around one large enough to be scaled at its own hook (see Note
    [Division fused into the copy] in reducer.buckets)."""
    side = 1 << 8  # a side x side weight: FUSED_DIVISION_MIN_NUMEL elements
    assert side * side >= FUSED_DIVISION_MIN_NUMEL
    return mlp(widths=(6, side, side, 3))


@pytest.mark.parametrize("as_view", [False, True])
@pytest.mark.parametrize("scaling", ["divide", "reciprocal"])
@pytest.mark.parametrize("set_to_none", [False, True])
def test_a_large_gradient_scaled_at_its_hook_is_the_bitwise_average(
    as_view: bool, scaling: str, set_to_none: bool
) -> None:
    """Every parameter in one bucket, the large one among small ones, two iterations (a fresh
    gradient copied in, then, unless set to None, one accumulated into its bucket view in
    place), at W = 3 where the two roundings differ."""
    world_size = 3
    # With bucket views kept between iterations, "reciprocal" divides what autograd
    # accumulated in place, as torch does (see Note [Gradient scaling]).
    second = "divide" if as_view and not set_to_none else scaling
    expected = [
        [rank_order_average(per_rank, world_size, scaling=s) for per_rank in grads]  # type: ignore[arg-type]
        for s, grads in zip(
            (scaling, second), (wide_local(world_size, 0), wide_local(world_size, 1)), strict=True
        )
    ]

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[torch.Tensor]]:
        model = wide_mlp()
        params = list(model.parameters())
        seen = []
        with reducer.Reducer(
            [params],
            [list(range(len(params)))],
            pg,
            gradient_as_bucket_view=as_view,
            gradient_scaling=scaling,  # type: ignore[arg-type]
        ) as red:
            for step in range(2):
                model.zero_grad(set_to_none=set_to_none)
                red.prepare_for_backward([])
                wide_loss(model, pg.rank(), step).backward()
                seen.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
        return seen

    _assert_every_rank_saw(run_ranks(fn, world_size), expected)


@pytest.mark.parametrize("fresh", [(), (1,), (0, 3), (0, 1, 2, 3, 4, 5)])
def test_bucket_views_in_one_bucket_scale_each_gradient_as_torch_does(
    fresh: tuple[int, ...],
) -> None:
    """ "reciprocal" bucket views, every parameter in one bucket, at W = 3: in the second
    iteration the gradients of ``fresh`` were set to None (autograd creates new ones, copied
    into their views while multiplied by 1 / W), the others were zeroed in place (autograd
    accumulates into the views, which are divided). See Note [Bucket views scaled by runs]."""
    world_size = 3
    firsts = wide_local(world_size, 0, build=mlp)
    seconds = wide_local(world_size, 1, build=mlp)
    expected = [
        [rank_order_average(g, world_size, scaling="reciprocal") for g in firsts],
        [
            rank_order_average(g, world_size, scaling="reciprocal" if i in fresh else "divide")
            for i, g in enumerate(seconds)
        ],
    ]

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[torch.Tensor]]:
        model = mlp()
        params = list(model.parameters())
        seen = []
        with reducer.Reducer(
            [params],
            [list(range(len(params)))],
            pg,
            gradient_as_bucket_view=True,
            gradient_scaling="reciprocal",
        ) as red:
            for step in range(2):
                model.zero_grad(set_to_none=False)
                for i in fresh:
                    params[i].grad = None
                red.prepare_for_backward([])
                wide_loss(model, pg.rank(), step).backward()
                seen.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
        return seen

    _assert_every_rank_saw(run_ranks(fn, world_size), expected)


def _assert_every_rank_saw(
    runs: list[list[list[torch.Tensor]]], expected: list[list[torch.Tensor | None]]
) -> None:
    """Each rank's gradients of each step are bit for bit the expected ones."""
    for seen in runs:
        for step, want_step in enumerate(expected):
            for i, (got, want) in enumerate(zip(seen[step], want_step, strict=True)):
                assert want is not None
                assert torch.equal(got, want), f"parameter {i}, step {step}"


def wide_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    return model(rank_input(rank, (4, 6), step)).pow(2).sum()


def wide_local(
    world_size: int, step: int, build: Callable[[], nn.Module] = wide_mlp
) -> list[list[torch.Tensor | None]]:
    """Per parameter, every rank's local gradient of ``wide_loss`` at ``step``."""
    per_rank = [
        local_grads(build, lambda m, r=rank: wide_loss(m, r, step), rank)
        for rank in range(world_size)
    ]
    return [[g[i] for g in per_rank] for i in range(len(per_rank[0]))]


@pytest.mark.parametrize("replicas", [2, 3])
def test_multi_replica_mode_sums_rank_then_replica(replicas: int) -> None:
    world_size = 3

    def loss(model: nn.Module, contribution: int) -> torch.Tensor:
        return mlp_loss(model, contribution)

    per_contribution = [local_grads(mlp, loss, c) for c in range(world_size * replicas)]
    expected = [
        rank_order_average([g[i] for g in per_contribution], world_size)
        for i in range(len(per_contribution[0]))
    ]

    def fn(pg: fakepg.FakeProcessGroup) -> list[nn.Module]:
        models = [mlp() for _ in range(replicas)]
        params = [list(m.parameters()) for m in models]
        buckets = reducer.ddp_bucket_assignment(params[0], bucket_cap_mb=1e-4)
        with reducer.Reducer(params, buckets, pg) as red:
            red.prepare_for_backward([])
            total = sum(loss(m, pg.rank() * replicas + d) for d, m in enumerate(models))
            assert isinstance(total, torch.Tensor)
            total.backward()
        return models

    for models in run_ranks(fn, world_size):
        for model in models:
            assert_grads_equal(model, expected)


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 3, sparse=True)
        self.head = nn.Linear(3, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids)).sum()


def Embed() -> _Embed:
    return seeded(_Embed)


def embed_loss(model: nn.Module, rank: int) -> torch.Tensor:
    ids = torch.tensor([rank % 10, 3, 3, (rank * 7) % 10])  # overlapping rows across ranks
    return model(ids)


def test_sparse_gradients_are_the_coalesced_average() -> None:
    world_size = 4
    per_rank = [local_grads(Embed, embed_loss, r) for r in range(world_size)]

    def fn(pg: fakepg.FakeProcessGroup) -> nn.Module:
        model = Embed()
        params = list(model.parameters())
        sparse = [[True, False, False]]
        buckets = reducer.compute_bucket_assignment_by_size(params, [1 << 20], sparse[0])
        with reducer.Reducer([params], buckets, pg, sparse) as red:
            red.prepare_for_backward([])
            embed_loss(model, pg.rank()).backward()
        return model

    models = run_ranks(fn, world_size)
    want = sparse_average([g[0] for g in per_rank], world_size)
    for model in models:
        grad = model.emb.weight.grad
        assert grad is not None and grad.is_sparse
        torch.testing.assert_close(grad.to_dense(), want, rtol=1e-6, atol=0)
        assert torch.equal(grad.to_dense(), models[0].emb.weight.grad.to_dense())  # type: ignore[union-attr]
        dense_want = rank_order_average([g[1] for g in per_rank], world_size)
        assert torch.equal(model.head.weight.grad, dense_want)  # type: ignore[arg-type]


class _Branches(nn.Module):
    """Two branches; ``use`` says which run, so parameters go unused per rank and per step."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 2)
        self.b = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, use: set[str]) -> torch.Tensor:
        out = torch.zeros(x.shape[0], 2)
        if "a" in use:
            out = out + self.a(x)
        if "b" in use:
            out = out + self.b(x)
        return out


def Branches() -> _Branches:
    return seeded(_Branches)


def test_unused_on_every_rank_keeps_grad_exactly_and_none_stays_none() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> _Branches:
        model = Branches()
        model.b.weight.grad = torch.full_like(model.b.weight, 0.3)  # must survive bit for bit
        with reducer_for(model, pg) as red:
            out = model(rank_input(pg.rank(), (3, 4)), {"a"})
            red.prepare_for_backward([out])
            assert {i for _, i in red.unused_parameters} == {2, 3}
            out.sum().backward()
        return model

    for model in run_ranks(fn, 3):
        assert torch.equal(model.b.weight.grad, torch.full((2, 4), 0.3))  # type: ignore[arg-type]
        assert model.b.bias.grad is None
        assert model.a.weight.grad is not None


@pytest.mark.parametrize("as_view", [False, True])
def test_unused_on_some_ranks_contributes_zeros_there(as_view: bool) -> None:
    world_size = 4
    uses = [{"a", "b"}, {"a"}, {"b"}, {"a"}]

    def loss(model: nn.Module, rank: int) -> torch.Tensor:
        return model(rank_input(rank, (3, 4)), uses[rank]).sum()

    expected = expected_average(Branches, loss, world_size)

    def fn(pg: fakepg.FakeProcessGroup) -> _Branches:
        model = Branches()
        with reducer_for(model, pg, gradient_as_bucket_view=as_view) as red:
            out = model(rank_input(pg.rank(), (3, 4)), uses[pg.rank()])
            red.prepare_for_backward([out])
            out.sum().backward()
        return model

    for model in run_ranks(fn, world_size):
        assert_grads_equal(model, expected)


def test_stale_grads_of_locally_unused_parameters_do_not_leak_into_the_average() -> None:
    """A .grad left over from before (no zero_grad) is not this step's gradient: zeros."""

    def fn(pg: fakepg.FakeProcessGroup) -> _Branches:
        model = Branches()
        model.b.weight.grad = torch.full_like(model.b.weight, 100.0)
        model.b.bias.grad = torch.full_like(model.b.bias, 100.0)
        with reducer_for(model, pg) as red:
            use = {"a", "b"} if pg.rank() == 0 else {"a"}
            out = model(torch.ones(1, 4), use)
            red.prepare_for_backward([out])
            out.sum().backward()
        return model

    models = run_ranks(fn, 2)
    # Rank 0's b.bias gradient is 100 (leftover) + 1 (this step); rank 1 contributes zeros.
    assert torch.equal(models[1].b.bias.grad, torch.full((2,), 101.0 / 2))  # type: ignore[arg-type]


@pytest.mark.parametrize("as_view", [False, True])
@pytest.mark.parametrize("local_steps", [1, 3])
def test_accumulation_reduces_the_accumulated_sum(as_view: bool, local_steps: int) -> None:
    world_size = 3

    def accumulated(model: nn.Module, rank: int) -> torch.Tensor:
        return sum(  # type: ignore[return-value]
            model(rank_input(rank, (4, 6), step)).pow(2).sum() for step in range(local_steps + 1)
        )

    expected = expected_average(mlp, accumulated, world_size)

    def fn(pg: fakepg.FakeProcessGroup) -> nn.Module:
        model = mlp()
        with reducer_for(model, pg, gradient_as_bucket_view=as_view) as red:
            for step in range(local_steps):  # no prepare_for_backward: accumulate locally
                model(rank_input(pg.rank(), (4, 6), step)).pow(2).sum().backward()
            red.prepare_for_backward([])
            model(rank_input(pg.rank(), (4, 6), local_steps)).pow(2).sum().backward()
        return model

    for model in run_ranks(fn, world_size):
        for p, want in zip(model.parameters(), expected, strict=True):
            # The local sum is accumulated in another order than one backward of the summed
            # loss, so compare with a tolerance here; the exact check is the property suite's.
            torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-6)


def test_a_gradient_accumulated_locally_counts_even_if_unused_in_the_synced_step() -> None:
    """Nothing a rank computed is lost: b was used only in a local step on rank 0."""

    def fn(pg: fakepg.FakeProcessGroup) -> _Branches:
        model = Branches()
        with reducer_for(model, pg) as red:
            if pg.rank() == 0:
                model(torch.ones(1, 4), {"a", "b"}).sum().backward()  # local: b.bias += 1
            out = model(torch.ones(1, 4), {"a"})
            red.prepare_for_backward([out])
            out.sum().backward()
        return model

    models = run_ranks(fn, 2)
    for model in models:
        assert torch.equal(model.b.bias.grad, torch.full((2,), 0.5))  # type: ignore[arg-type]


@pytest.mark.slow
def test_overlap_first_bucket_launches_before_the_last_gradient_is_ready() -> None:
    """On a slow network, bucket 0's allreduce is in flight while backward goes on."""
    launched: list[fakepg.Work] = []

    class Recording:
        def __init__(self, pg: fakepg.FakeProcessGroup) -> None:
            self.pg = pg

        def rank(self) -> int:
            return self.pg.rank()

        def size(self) -> int:
            return self.pg.size()

        def allreduce(
            self, tensors: list[torch.Tensor], op: reducer.ReduceOp = reducer.ReduceOp.SUM
        ) -> fakepg.Work:
            work = self.pg.allreduce(tensors, op)
            launched.append(work)
            return work

    # The latency is far above this backward's time (a few ms, ~0.3 s on a loaded machine),
    # so bucket 0 is certainly still in flight when the last gradient becomes ready.
    world = fakepg.World(1, network=fakepg.FixedLatency(1.0))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)])
    params = list(model.parameters())
    buckets = reducer.ddp_bucket_assignment(params, bucket_cap_mb=0.25, first_bucket_mb=0.25)
    with world, reducer.Reducer([params], buckets, Recording(world.group(0))) as red:  # type: ignore[arg-type]
        red.prepare_for_backward([])
        start = time.perf_counter()
        model(torch.randn(8, 256)).sum().backward()
        assert time.perf_counter() - start >= 1.0  # finalize waited for the network
    assert len(buckets) >= 3
    last_ready = max(red.backward_stats[0])
    first_launch = red.bucket_launch_stats[0]
    assert first_launch < last_ready
    # Reconstruct the clock base from the first work: its issue time minus its offset.
    base = launched[0].launched_ns - first_launch
    assert launched[0].completed_ns is not None
    assert launched[0].completed_ns - base > last_ready  # still in flight at the last hook
    assert red.bucket_launch_stats == sorted(red.bucket_launch_stats)  # in index order


def test_backward_stats_follow_the_order_gradients_become_ready() -> None:
    model = mlp()
    with fakepg.World(1) as world, reducer_for(model, world.group(0)) as red:
        red.prepare_for_backward([])
        mlp_loss(model, 0).backward()
        stats = red.backward_stats[0]
    assert all(s > 0 for s in stats)
    # The last layer's parameters are ready before the first layer's.
    assert stats[-1] < stats[0]


# -------------------------------------------------------------------------------------------
# Errors.


def test_a_new_iteration_before_the_reduction_finished_names_the_missing_parameters() -> None:
    model = Branches()
    with fakepg.World(1) as world:
        red = reducer_for(model, world.group(0))
        red.prepare_for_backward([])  # every hook expected, but b is not used
        model(torch.ones(1, 4), {"a"}).sum().backward()
        with pytest.raises(reducer.ReductionError) as info:
            red.prepare_for_backward([])
        text = str(info.value)
        assert "on rank 0, these parameters never got a gradient" in text
        assert "parameter 2 ('b.weight'), parameter 3 ('b.bias')" in text
        assert "find_unused_parameters" in text
        assert isinstance(info.value, RuntimeError)
        # The reducer refuses further use; close it and a new one on the same model works.
        with pytest.raises(reducer.ReductionError, match="close"):
            red.prepare_for_backward([])
        red.close()
        model.zero_grad(set_to_none=True)
        with reducer_for(model, world.group(0)) as fresh:
            out = model(torch.ones(1, 4), {"a"})
            fresh.prepare_for_backward([out])
            out.sum().backward()
        assert model.a.weight.grad is not None and model.b.weight.grad is None


def test_a_rank_missing_gradients_fails_the_run_with_its_own_parameters() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> None:
        model = Branches()
        red = reducer_for(model, pg)
        for _ in range(2):
            red.prepare_for_backward([])
            use = {"a"} if pg.rank() == 1 else {"a", "b"}
            model(torch.ones(1, 4), use).sum().backward()

    start = time.monotonic()
    with pytest.raises(reducer.ReductionError, match=r"on rank 1.*'b.weight'") as info:
        run_ranks(fn, 2)
    assert "raised on rank 1" in info.value.__notes__[0]
    assert time.monotonic() - start < 15  # the abort woke rank 0, no timeout needed


def test_a_parameter_used_outside_forward_is_marked_ready_twice() -> None:
    model = Branches()
    with fakepg.World(1) as world, reducer_for(model, world.group(0)) as red:
        out = model(torch.ones(1, 4), {"a"})
        red.prepare_for_backward([out])
        loss = out.sum() + model.b.weight.sum()  # b used outside forward
        with pytest.raises(reducer.ReductionError) as info:
            loss.backward()
    text = str(info.value)
    assert "parameter 2 ('b.weight') was marked ready twice" in text
    assert "used outside the forward pass" in text


def test_reentrant_checkpointing_with_unused_search_is_reported() -> None:
    from torch.utils.checkpoint import checkpoint

    model = mlp()
    with fakepg.World(1) as world, reducer_for(model, world.group(0)) as red:
        x = rank_input(0, (4, 6)).requires_grad_()
        out = checkpoint(model, x, use_reentrant=True, preserve_rng_state=False)
        red.prepare_for_backward([out])
        with pytest.raises(reducer.ReductionError, match="reentrant"):
            out.sum().backward()


def test_initialize_buckets_during_backward_is_refused() -> None:
    model = mlp()
    with fakepg.World(1) as world, reducer_for(model, world.group(0)) as red:
        red.prepare_for_backward([])
        with pytest.raises(reducer.ReductionError, match="between iterations"):
            red.initialize_buckets([list(range(6))])


def test_initialize_buckets_between_iterations_changes_the_assignment() -> None:
    expected = expected_average(mlp, mlp_loss, 2)

    def fn(pg: fakepg.FakeProcessGroup) -> nn.Module:
        model = mlp()
        with reducer_for(model, pg) as red:
            red.initialize_buckets([[5, 4, 3, 2, 1, 0]])
            assert red.bucket_indices == [[5, 4, 3, 2, 1, 0]]
            red.prepare_for_backward([])
            mlp_loss(model, pg.rank()).backward()
        return model

    for model in run_ranks(fn, 2):
        assert_grads_equal(model, expected)


def test_a_sparse_gradient_in_a_dense_bucket_names_the_flag_to_set() -> None:
    model = Embed()
    with fakepg.World(1) as world, reducer_for(model, world.group(0)) as red:
        red.prepare_for_backward([])
        with pytest.raises(reducer.ReductionError, match=r"'emb.weight'\) got a sparse gradient"):
            embed_loss(model, 0).backward()


def test_a_replaced_bucket_view_gradient_is_reported() -> None:
    model = mlp()
    with fakepg.World(1) as world:
        red = reducer_for(model, world.group(0), gradient_as_bucket_view=True)
        red.prepare_for_backward([])
        mlp_loss(model, 0).backward()
        assert model[0].weight.grad is not None
        model[0].weight.grad = torch.zeros_like(model[0].weight)
        with pytest.raises(reducer.ReductionError, match=r"'0.weight'\): its .grad was replaced"):
            red.prepare_for_backward([])
        red.close()


def test_bucket_views_survive_set_to_none() -> None:
    expected = expected_average(mlp, mlp_loss, 2)

    def fn(pg: fakepg.FakeProcessGroup) -> nn.Module:
        model = mlp()
        with reducer_for(model, pg, gradient_as_bucket_view=True) as red:
            for _ in range(2):
                model.zero_grad(set_to_none=True)
                red.prepare_for_backward([])
                mlp_loss(model, pg.rank()).backward()
            storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}  # type: ignore[union-attr]
            assert len(storages) == len(red.bucket_indices)  # every grad lives in a bucket
        return model

    for model in run_ranks(fn, 2):
        assert_grads_equal(model, expected)


def nonleaf() -> torch.Tensor:
    return torch.zeros(2, requires_grad=True) * 2


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (
            lambda p: ([[p[0], torch.zeros(2)]], [[0, 1]]),
            "parameter 1 of replica 0 does not require grad",
        ),
        (lambda p: ([[p[0], nonleaf()]], [[0, 1]]), "parameter 1 of replica 0 is not a leaf"),
        (lambda p: ([[p[0], p[0]]], [[0, 1]]), "is the same tensor as parameter 0"),
        (lambda p: ([], [[0]]), "non-empty list of parameter lists"),
        (lambda p: ([[p[0]], [p[1], p[2]]], [[0]]), "replica 1 has 2 parameters"),
        (lambda p: ([[p[0]], [p[1]]], [[0]]), "replicas must match in shape and dtype"),
        (lambda p: ([[p[0]]], [[0], [0]]), "is in bucket 0 and bucket 1"),
        (lambda p: ([[p[0]]], [[]]), "bucket 0 is empty"),
    ],
)
def test_invalid_construction_raises_value_error(make: object, match: str) -> None:
    params = [
        nn.Parameter(torch.zeros(2)),
        nn.Parameter(torch.zeros(3)),
        nn.Parameter(torch.zeros(2)),
    ]
    replicas, buckets = make(params)  # type: ignore[operator]
    with fakepg.World(1) as world, pytest.raises(reducer.InvalidArgument, match=match) as info:
        reducer.Reducer(replicas, buckets, world.group(0))
    assert isinstance(info.value, ValueError)


def test_other_construction_errors() -> None:
    p = nn.Parameter(torch.zeros(2))
    with fakepg.World(1) as world:
        pg = world.group(0)
        with pytest.raises(reducer.InvalidArgument, match="param_names must be 1 strings"):
            reducer.Reducer([[p]], [[0]], pg, param_names=["a", "b"])
        with pytest.raises(reducer.InvalidArgument, match="one list per replica"):
            reducer.Reducer([[p]], [[0]], pg, [[True], [True]])
        with pytest.raises(reducer.InvalidArgument, match=r"implement reducer\.ProcessGroup"):
            reducer.Reducer([[p]], [[0]], object())  # type: ignore[arg-type]
        red = reducer.Reducer([[p]], [[0]], pg)
        with pytest.raises(reducer.InvalidArgument, match="output 0 is a str"):
            red.prepare_for_backward(["loss"])  # type: ignore[list-item]
        red.close()


def test_close_removes_every_hook() -> None:
    model = mlp()
    calls: list[tuple[int, int]] = []
    with fakepg.World(1) as world:
        red = reducer_for(model, world.group(0))
        red._autograd_hook = lambda r, i: calls.append((r, i))  # type: ignore[method-assign]
        mlp_loss(model, 0).backward()
        assert len(calls) == 6  # the hooks were live
        red.close()
        red.close()  # idempotent
        calls.clear()
        mlp_loss(model, 0).backward()
        assert calls == []
        with pytest.raises(reducer.ReductionError, match="closed"):
            red.prepare_for_backward([])


def test_a_dropped_reducer_leaves_no_hooks() -> None:
    model = mlp()
    with fakepg.World(1) as world:
        reducer_for(model, world.group(0))  # never stored, never closed
        gc.collect()
        assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())


def test_repr_and_introspection() -> None:
    model = mlp()
    with fakepg.World(1) as world, reducer_for(model, world.group(0)) as red:
        assert "6 parameters" in repr(red)
        assert sorted(i for b in red.bucket_indices for i in b) == list(range(6))
        assert sum(red.bucket_nbytes) == 4 * sum(p.numel() for p in model.parameters())
        assert names_of(model)[0] == "0.weight"


def test_a_backward_that_raises_after_every_gradient_is_reported_as_unfinished() -> None:
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom in backward")

    model = mlp()
    with fakepg.World(1) as world, reducer_for(model, world.group(0)) as red:
        red.prepare_for_backward([])
        # Boom's backward runs last (its input is a leaf), after every parameter's hook.
        x = rank_input(0, (4, 6)).requires_grad_()
        with pytest.raises(ValueError, match="boom in backward"):
            model(Boom.apply(x)).sum().backward()
        assert all(stat > 0 for stat in red.backward_stats[0])  # every parameter was ready
        with pytest.raises(reducer.ReductionError) as info:
            red.prepare_for_backward([])
    text = str(info.value)
    assert "every parameter got its gradient" in text
    assert "did not reach its end" in text and "close()" in text


# -------------------------------------------------------------------------------------------
# Nested and higher-order backward.


def _penalized_loss(model: nn.Module, rank: int) -> torch.Tensor:
    """A loss plus a gradient penalty: backward goes through the graph of the gradients."""
    loss = mlp_loss(model, rank)
    grads = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    return loss + sum(g.pow(2).sum() for g in grads)


@pytest.mark.parametrize("as_view", [False, True])
def test_a_gradient_penalty_is_reduced_exactly(as_view: bool) -> None:
    world_size = 3
    want = expected_average(mlp, _penalized_loss, world_size)

    def fn(pg: fakepg.FakeProcessGroup) -> list[torch.Tensor | None]:
        model = mlp()
        with reducer_for(model, pg, gradient_as_bucket_view=as_view) as red:
            red.prepare_for_backward([])
            _penalized_loss(model, pg.rank()).backward()
        return [p.grad for p in model.parameters()]

    for rank, grads in enumerate(run_ranks(fn, world_size)):
        for i, (got, exp) in enumerate(zip(grads, want, strict=True)):
            assert got is not None and exp is not None
            assert torch.equal(got, exp), f"rank {rank}, parameter {i}"


def test_backward_with_create_graph_averages_and_keeps_the_gradient_differentiable() -> None:
    """Hooks run in grad mode under create_graph=True; the reducer must record nothing (its
    in-place division of a leaf's gradient used to raise) and leave .grad requiring grad."""
    world_size, steps = 2, 3

    def fn(pg: fakepg.FakeProcessGroup) -> list[tuple[float, bool]]:
        p = nn.Parameter(torch.tensor(float(pg.rank() + 1)))
        out = []
        with reducer.Reducer([[p]], [[0]], pg) as red:
            for _ in range(steps):
                red.prepare_for_backward([])
                p.pow(2).backward(create_graph=True)
                assert p.grad is not None
                out.append((p.grad.item(), p.grad.requires_grad))
        return out

    # d/dp p**2 = 2p: 2 and 4 on the ranks, averaged 3, accumulated once per step
    # (the averaged .grad plus the next step's local 2p, averaged again).
    per_rank = run_ranks(fn, world_size)
    assert per_rank[0] == per_rank[1]
    assert [v for v, _ in per_rank[0]] == [3.0, 6.0, 9.0]
    assert all(requires_grad for _, requires_grad in per_rank[0])


class _TwiceCheckpointed(nn.Module):
    """One layer applied twice, each time in a reentrant checkpoint of its own: its hook
    fires once per checkpoint, and after the first, every bucket is complete."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        inner = checkpoint(self.lin, x, use_reentrant=True, preserve_rng_state=False)
        out = checkpoint(self.lin, inner, use_reentrant=True, preserve_rng_state=False)
        assert isinstance(out, torch.Tensor)
        return out


def test_a_layer_in_two_reentrant_checkpoints_is_an_error_not_a_wrong_gradient() -> None:
    """The inner backward of the second checkpoint used to finalize the iteration; the first
    checkpoint's gradient then went to local accumulation, silently, and the ranks diverged."""

    def fn(pg: fakepg.FakeProcessGroup) -> str:
        model = seeded(_TwiceCheckpointed)
        with reducer_for(model, pg, cap_mb=25.0) as red:
            red.prepare_for_backward([])
            x = rank_input(pg.rank(), (2, 3)).requires_grad_()
            with pytest.raises(reducer.ReductionError) as info:
                model(x).sum().backward()
        return str(info.value)

    for message in run_ranks(fn, 2):
        assert "Expected to mark a variable ready only once" in message
        assert "'lin.weight'" in message or "'lin.bias'" in message
        assert "use_reentrant=False" in message and "static_graph=True" in message


@pytest.mark.parametrize("static_graph", [False, True])
def test_reentrant_checkpointing_of_the_whole_model_finalizes_at_the_outer_end(
    static_graph: bool,
) -> None:
    """Every gradient arrives inside the checkpoint's own backward; the reduction finishes
    once, when the outer backward ends (without the DDP wrapper's help for static_graph)."""
    from torch.utils.checkpoint import checkpoint

    world_size, steps = 3, 2

    def loss_of(model: nn.Module, rank: int, step: int = 0) -> torch.Tensor:
        x = rank_input(rank, (4, 6), step).requires_grad_()
        # No RNG state kept: the checkpoint's backward would set torch's global generator,
        # shared by the rank threads, while another rank draws its initial weights.
        out = checkpoint(model, x, use_reentrant=True, preserve_rng_state=False)
        assert isinstance(out, torch.Tensor)
        return out.pow(2).sum()

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[torch.Tensor | None]]:
        model = mlp()
        per_step = []
        with reducer_for(model, pg, static_graph=static_graph) as red:
            for step in range(steps):
                model.zero_grad(set_to_none=True)
                red.prepare_for_backward([])
                loss_of(model, pg.rank(), step).backward()
                per_step.append([p.grad for p in model.parameters()])
            assert red.iterations == steps
        return per_step

    results = run_ranks(fn, world_size)
    for step in range(steps):
        want = expected_average(mlp, lambda m, r, s=step: loss_of(m, r, s), world_size)
        for rank in range(world_size):
            for i, (got, exp) in enumerate(zip(results[rank][step], want, strict=True)):
                assert got is not None and exp is not None
                assert torch.equal(got, exp), f"step {step}, rank {rank}, parameter {i}"


# -------------------------------------------------------------------------------------------
# Bad input: each a clear error of the right type that names the argument and the fix.


def test_a_parameter_that_does_not_require_grad_is_named() -> None:
    params = [nn.Parameter(torch.zeros(2)), torch.zeros(3)]
    with fakepg.World(1) as world, pytest.raises(reducer.InvalidArgument) as info:
        reducer.Reducer([params], [[0, 1]], world.group(0), param_names=["w", "frozen.bias"])
    assert "parameter 1 ('frozen.bias') of replica 0 does not require grad" in str(info.value)


@pytest.mark.parametrize(
    ("timeout", "kind", "words"),
    [
        (-1, ValueError, "timeout must be > 0 seconds, got -1"),
        (0, ValueError, "timeout must be > 0 seconds, got 0"),
        (float("nan"), ValueError, "timeout must be > 0 seconds, got nan"),
        (float("inf"), ValueError, "timeout must be a finite number of seconds"),
        ("30", TypeError, "timeout must be a number of seconds"),
        (None, TypeError, "timeout must be a number of seconds"),
    ],
)
def test_a_timeout_that_is_not_a_finite_positive_number_is_refused(
    timeout: object, kind: type, words: str
) -> None:
    p = nn.Parameter(torch.zeros(2))
    with fakepg.World(1) as world, pytest.raises(kind) as info:
        reducer.Reducer([[p]], [[0]], world.group(0), timeout=timeout)  # type: ignore[arg-type]
    assert isinstance(info.value, reducer.InvalidArgument)
    assert str(info.value).startswith(f"Reducer: {words}")


def test_a_timedelta_timeout_is_accepted() -> None:
    import datetime

    model = mlp()
    with fakepg.World(1) as world:
        params = list(model.parameters())
        red = reducer.Reducer(
            [params], [list(range(6))], world.group(0), timeout=datetime.timedelta(minutes=2)
        )
        assert red._timeout == 120.0
        red.close()


class _Tied(nn.Module):
    """nn.Embedding(sparse=True) whose weight is also the output layer's: its gradient is the
    sum of a sparse and a dense one, dense."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 3, sparse=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.emb(ids) @ self.emb.weight.t()).sum()


class _FunctionalSparse(nn.Module):
    """A sparse gradient from F.embedding(sparse=True), not from an nn.Embedding module."""

    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(10, 3))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.table, sparse=True).sum()


IDS = torch.tensor([1, 3, 3])


def test_a_sparse_gradient_in_a_dense_bucket_asks_for_the_flag_set_to_true() -> None:
    model = Embed()
    with fakepg.World(1) as world, reducer_for(model, world.group(0)) as red:
        red.prepare_for_backward([])
        with pytest.raises(reducer.ReductionError) as info:
            embed_loss(model, 0).backward()
    message = str(info.value)
    assert "'emb.weight') got a sparse gradient but its bucket expects a dense one" in message
    assert "expect_sparse_gradients[0][0]=True" in message and "[0][0]=False" not in message


def test_a_dense_gradient_in_a_sparse_bucket_asks_for_the_flag_set_to_false() -> None:
    model = seeded(_Tied)
    with fakepg.World(1) as world:
        params = list(model.parameters())
        with reducer.Reducer(
            [params], [[0]], world.group(0), [[True]], param_names=names_of(model)
        ) as red:
            red.prepare_for_backward([])
            with pytest.raises(reducer.ReductionError) as info:
                model(IDS).backward()
    message = str(info.value)
    assert "'emb.weight') got a dense gradient but its bucket expects a sparse one" in message
    assert "expect_sparse_gradients[0][0]=False" in message and "[0][0]=True" not in message


@pytest.mark.parametrize(
    ("module", "got", "words"),
    [
        (_FunctionalSparse, "sparse", "compute its sparse gradient through such a module"),
        (_Tied, "dense", "also used outside the module's lookup (weight tying, say)"),
    ],
)
def test_through_the_wrapper_a_layout_error_points_at_the_module(
    module: type[nn.Module], got: str, words: str
) -> None:
    """The wrapper has no expect_sparse_gradients argument: it reads nn.Embedding(sparse=...)."""

    def fn(pg: fakepg.FakeProcessGroup) -> str:
        ddp = reducer.DistributedDataParallel(seeded(module), pg)
        with pytest.raises(reducer.ReductionError) as info:
            ddp(IDS).backward()
        return str(info.value)

    for message in run_ranks(fn, 2):
        assert f"got a {got} gradient" in message and words in message
        assert "expect_sparse_gradients" not in message
        assert "nn.Embedding" in message
