"""Comm hooks: GradBucket as a hook sees it, the built-in hooks, and hooks that misbehave,
through the DDP wrapper and through the bare reducer.

Expectations are exact: the fake world sums in rank order, so a hook's result is predicted
bit for bit by doing its arithmetic in that order on plain local gradients (in float16 or
bfloat16 for the compressing hooks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import rank_input, run_ranks, seeded
from torch import Tensor, nn

import fakepg
import reducer

DDP = reducer.DistributedDataParallel
TINY_MB = 1e-5  # every parameter in a bucket of its own
WORLD = 3


def build() -> nn.Module:
    return seeded(lambda: nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)), seed=4)


def loss_of(model: nn.Module, rank: int, step: int = 0) -> Tensor:
    out: Tensor = model(rank_input(rank, (3, 5), step))
    return out.pow(2).sum()


def local_grads(rank: int, step: int = 0) -> list[Tensor]:
    model = build()
    loss_of(model, rank, step).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def ddp_grads(
    hook: reducer.CommHook | None,
    state: object = None,
    *,
    steps: int = 1,
    cap_mb: float = TINY_MB,
    **kwargs: Any,
) -> list[list[list[Tensor]]]:
    """Per rank and step, the gradients DDP (with ``hook``) leaves on a WORLD-rank world."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[Tensor]]:
        model = build()
        ddp = DDP(model, pg, bucket_cap_mb=cap_mb, **kwargs)
        if hook is not None:
            ddp.register_comm_hook(state, hook)
        out = []
        for step in range(steps):
            ddp.zero_grad(set_to_none=True)
            loss_of(ddp, pg.rank(), step).backward()
            out.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        return out

    return run_ranks(fn, WORLD)


def in_rank_order(terms: list[Tensor]) -> Tensor:
    acc = terms[0]
    for t in terms[1:]:
        acc = acc + t
    return acc


# -------------------------------------------------------------------------------------------
# The built-in hooks.


@pytest.mark.parametrize("as_view", [False, True])
def test_allreduce_hook_gives_the_same_bits_as_no_hook(as_view: bool) -> None:
    plain = ddp_grads(None, steps=2, gradient_as_bucket_view=as_view)
    hooked = ddp_grads(reducer.allreduce_hook, steps=2, gradient_as_bucket_view=as_view)
    for rank in range(WORLD):
        for step in range(2):
            for got, want in zip(hooked[rank][step], plain[rank][step], strict=True):
                assert torch.equal(got, want)


def test_allreduce_hook_takes_a_process_group_as_state() -> None:
    """state is the group to reduce over; here a group of a second world of the same size."""
    with fakepg.World(WORLD, timeout=20.0) as other:

        def fn(pg: fakepg.FakeProcessGroup) -> list[Tensor]:
            model = build()
            ddp = DDP(model, pg)
            ddp.register_comm_hook(other.group(pg.rank()), reducer.allreduce_hook)
            loss_of(ddp, pg.rank()).backward()
            return [p.grad for p in model.parameters() if p.grad is not None]

        got = run_ranks(fn, WORLD)
    plain = ddp_grads(None)
    for rank in range(WORLD):
        for g, w in zip(got[rank], plain[rank][0], strict=True):
            assert torch.equal(g, w)


@pytest.mark.parametrize(
    ("hook", "dtype"),
    [(reducer.fp16_compress_hook, torch.float16), (reducer.bf16_compress_hook, torch.bfloat16)],
)
def test_compress_hooks_reduce_in_the_low_precision_dtype(
    hook: reducer.CommHook, dtype: torch.dtype
) -> None:
    """Each rank's gradient cast down and divided by W, summed in rank order in ``dtype``,
    cast back to float32: the same bits, and not the float32 average (the test can tell)."""
    got = ddp_grads(hook)
    per_rank = [local_grads(r) for r in range(WORLD)]
    for i in range(len(per_rank[0])):
        want = in_rank_order([per_rank[r][i].to(dtype).div_(WORLD) for r in range(WORLD)])
        exact = in_rank_order([per_rank[r][i] / WORLD for r in range(WORLD)])
        assert not torch.equal(want.float(), exact), "the data should show the compression"
        for rank in range(WORLD):
            assert got[rank][0][i].dtype == torch.float32
            assert torch.equal(got[rank][0][i], want.float()), f"parameter {i}, rank {rank}"


# -------------------------------------------------------------------------------------------
# GradBucket, and a hook's contract: the buffer is not divided, the hook divides.


def test_grad_bucket_shows_the_undivided_gradients_and_the_hook_result_is_used() -> None:
    """A hook that sums and divides afterwards: its result, not a pre-divided sum, must land in
    .grad; and the bucket must show each parameter's local gradient as a view of the buffer."""
    seen: dict[int, list[dict[str, Any]]] = {}

    def post_divide(state: object, bucket: reducer.GradBucket) -> torch.Future[Tensor]:
        pg = state
        assert isinstance(pg, fakepg.FakeProcessGroup)
        buffer = bucket.buffer()
        seen.setdefault(pg.rank(), []).append(
            {
                "index": bucket.index(),
                "is_last": bucket.is_last(),
                "params": [id(p) for p in bucket.parameters()],
                "buffer": buffer.clone(),
                "grads": [g.clone() for g in bucket.gradients()],
                "views": all(
                    g.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
                    for g in bucket.gradients()
                ),
            }
        )
        work = pg.allreduce([buffer])
        return work.get_future().then(lambda f: f.value()[0].div_(pg.size()))

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[list[Tensor], list[list[int]], list[int]]:
        model = build()
        ddp = DDP(model, pg, bucket_cap_mb=TINY_MB)
        ddp.register_comm_hook(pg, post_divide)
        loss_of(ddp, pg.rank()).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return grads, ddp.reducer.bucket_indices, [id(p) for p in model.parameters()]

    results = run_ranks(fn, WORLD)
    per_rank = [local_grads(r) for r in range(WORLD)]
    for rank, (grads, buckets, param_ids) in enumerate(results):
        calls = sorted(seen[rank], key=lambda c: c["index"])
        assert [c["index"] for c in seen[rank]] == list(range(len(buckets)))  # in index order
        assert [c["is_last"] for c in calls] == [False] * (len(buckets) - 1) + [True]
        for call, indices in zip(calls, buckets, strict=True):
            assert call["params"] == [param_ids[i] for i in indices]
            assert call["views"]
            mine = [per_rank[rank][i] for i in indices]
            assert torch.equal(call["buffer"], torch.cat([g.reshape(-1) for g in mine]))
            for g, want in zip(call["grads"], mine, strict=True):
                assert torch.equal(g, want)  # undivided, shaped like the parameter
        for i, grad in enumerate(grads):
            want = in_rank_order([per_rank[r][i] for r in range(WORLD)]) / WORLD
            assert torch.equal(grad, want), f"parameter {i}"


def test_set_buffer_replaces_the_contents() -> None:
    def ones_times_rank(state: object, bucket: reducer.GradBucket) -> torch.Future[Tensor]:
        pg = state
        assert isinstance(pg, fakepg.FakeProcessGroup)
        bucket.set_buffer(torch.full_like(bucket.buffer(), float(pg.rank() + 1)))
        return pg.allreduce([bucket.buffer()]).get_future().then(lambda f: f.value()[0])

    def fn(pg: fakepg.FakeProcessGroup) -> list[Tensor]:
        model = build()
        ddp = DDP(model, pg)
        ddp.register_comm_hook(pg, ones_times_rank)
        loss_of(ddp, pg.rank()).backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    for grads in run_ranks(fn, WORLD):
        for g in grads:
            assert torch.equal(g, torch.full_like(g, 6.0))  # 1 + 2 + 3


def test_grad_bucket_on_a_sparse_bucket_and_the_hook_matches_no_hook() -> None:
    class Embed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(7, 3, sparse=True)
            self.head = nn.Linear(3, 1)

        def forward(self, idx: Tensor) -> Tensor:
            out: Tensor = self.head(self.emb(idx))
            return out

    def run(hook: reducer.CommHook | None) -> list[list[Tensor]]:
        def fn(pg: fakepg.FakeProcessGroup) -> list[Tensor]:
            model = seeded(Embed)
            ddp = DDP(model, pg)
            if hook is not None:
                ddp.register_comm_hook(None, hook)
            idx = torch.tensor([[pg.rank(), 2, pg.rank() + 3]])
            ddp(idx).pow(2).sum().backward()
            grad = model.emb.weight.grad
            assert grad is not None and grad.is_sparse
            return [grad.to_dense(), *(p.grad for p in model.head.parameters())]

        return run_ranks(fn, WORLD)

    for hooked, plain in zip(run(reducer.allreduce_hook), run(None), strict=True):
        for got, want in zip(hooked, plain, strict=True):
            assert torch.equal(got, want)


# -------------------------------------------------------------------------------------------
# Misuse and failure: clear errors on every rank, nothing left hanging.


def hook_errors(hook: Callable[..., Any], state: object = None) -> list[str]:
    def fn(pg: fakepg.FakeProcessGroup) -> str:
        ddp = DDP(build(), pg)
        ddp.register_comm_hook(state, hook)
        with pytest.raises(Exception) as info:  # noqa: PT011 (the type is checked below)
            loss_of(ddp, pg.rank()).backward()
        assert isinstance(info.value, RuntimeError)
        return str(info.value)

    return run_ranks(fn, 2)


def test_a_hook_that_returns_no_future_is_reported() -> None:
    def returns_tensor(state: object, bucket: reducer.GradBucket) -> Tensor:
        return bucket.buffer()

    for message in hook_errors(returns_tensor):
        assert "'returns_tensor' returned a Tensor for bucket 0" in message
        assert "torch.futures.Future" in message


def test_a_hook_that_raises_is_reported_with_its_bucket_and_rank() -> None:
    def wrong_shape(state: object, bucket: reducer.GradBucket) -> torch.Future[Tensor]:
        bucket.set_buffer(torch.zeros(1))
        raise AssertionError("unreachable")

    messages = hook_errors(wrong_shape)
    for rank, message in enumerate(messages):
        assert f"'wrong_shape' raised for bucket 0 on rank {rank}" in message
        assert "set_buffer: bucket 0 holds torch.float32 (39,), got torch.float32 (1,)" in message


def test_a_failed_hook_future_fails_backward() -> None:
    def fails(state: object, bucket: reducer.GradBucket) -> torch.Future[Tensor]:
        future: torch.futures.Future[Tensor] = torch.futures.Future()
        future.set_exception(ValueError("the hook's collective failed"))  # type: ignore[arg-type]
        return future

    for message in hook_errors(fails):
        assert "future for bucket 0 failed: ValueError: the hook's collective failed" in message


def test_a_hook_future_that_never_completes_times_out() -> None:
    def never(state: object, bucket: reducer.GradBucket) -> torch.Future[Tensor]:
        return torch.futures.Future()

    def fn(pg: fakepg.FakeProcessGroup) -> str:
        model = build()
        params = list(model.parameters())
        red = reducer.Reducer([params], [list(range(len(params)))], pg, timeout=0.2)
        red.register_comm_hook(None, never)
        red.prepare_for_backward([])
        with pytest.raises(RuntimeError, match=r"did not complete within 0\.2 s") as info:
            loss_of(model, pg.rank()).backward()
        red.close()
        return str(info.value)

    for message in run_ranks(fn, 2):
        assert "bucket 0" in message


def test_logging_data_names_the_hook() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> str | None:
        ddp = DDP(build(), pg)
        ddp.register_comm_hook(None, reducer.bf16_compress_hook)
        return ddp.logging_data().comm_hook

    assert run_ranks(fn, 1) == ["bf16_compress_hook"]


def test_a_built_in_hook_refuses_a_state_that_is_not_a_group() -> None:
    for message in hook_errors(reducer.allreduce_hook, state="not a group"):
        assert "takes a process group (or None) as its state, got str" in message


def test_register_once_before_the_first_backward() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> None:
        ddp = DDP(build(), pg)
        with pytest.raises(ValueError, match="must be callable"):
            ddp.register_comm_hook(None, "not a hook")  # type: ignore[arg-type]
        ddp.register_comm_hook(None, reducer.allreduce_hook)
        with pytest.raises(RuntimeError, match="already registered"):
            ddp.register_comm_hook(None, reducer.allreduce_hook)
        later = DDP(build(), pg)
        loss_of(later, pg.rank()).backward()
        with pytest.raises(RuntimeError, match="before the first backward"):
            later.register_comm_hook(None, reducer.allreduce_hook)

    run_ranks(fn, 2)


# -------------------------------------------------------------------------------------------
# Through the bare reducer.


def grads_with_hook(hook: reducer.CommHook) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Rank 1's reduced gradients, and every rank's local gradients by plain autograd."""

    def rank_main(pg: fakepg.FakeProcessGroup) -> tuple[list[torch.Tensor], torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Linear(5, 3)
        params = list(model.parameters())
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(pg.rank()))
        local = torch.autograd.grad(model(x).square().sum(), params)
        with reducer.Reducer([params], [[0], [1]], pg) as red:
            red.register_comm_hook(None, hook)
            red.prepare_for_backward([])
            model(x).square().sum().backward()
        return [p.grad.clone() for p in params], torch.cat([g.reshape(-1) for g in local])  # type: ignore[union-attr]

    results = fakepg.run(rank_main, WORLD, timeout=20.0)
    return results[1][0], [flat for _, flat in results]


@pytest.mark.parametrize(
    ("hook", "wire"),
    [
        (reducer.allreduce_hook, torch.float32),
        (reducer.fp16_compress_hook, torch.float16),
        (reducer.bf16_compress_hook, torch.bfloat16),
    ],
)
def test_builtin_hooks_reduce_exactly_in_their_dtype(
    hook: reducer.CommHook, wire: torch.dtype
) -> None:
    """Their futures come from ``Future.then``, which the reducer must accept."""
    reduced, local = grads_with_hook(hook)
    total = local[0].to(wire) / WORLD
    for flat in local[1:]:
        total = total + flat.to(wire) / WORLD  # rank order, in the hook's dtype
    expected = total.to(torch.float32)
    assert torch.equal(torch.cat([g.reshape(-1) for g in reduced]), expected)


def test_a_hook_that_returns_no_future_is_refused() -> None:
    def bad(state: object, bucket: reducer.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return bucket.buffer()  # type: ignore[return-value]

    with pytest.raises(reducer.ReductionError, match="returned a Tensor for bucket 0, not a"):
        grads_with_hook(bad)
