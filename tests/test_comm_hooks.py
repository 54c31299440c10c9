"""Comm hooks: GradBucket as a hook sees it, the built-in hooks, and hooks that misbehave,
through the DDP wrapper and through the bare reducer.

Expectations are exact: the fake world sums in rank order, so a hook's result is predicted
bit for bit by doing its arithmetic in that order on plain local gradients (in float16 or
bfloat16 for the compressing hooks).
"""

from __future__ import annotations

import pickle
import re
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import POWERSGD_CONFIGS, rank_input, run_ranks, seeded
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import fakepg
import reducer
from reducer.testing.reference import Scaling, rank_order_average

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


def exact_average(step: int, scaling: Scaling) -> list[Tensor]:
    """The rank-order average of every rank's local gradients at ``step``."""
    per_rank = [local_grads(rank, step) for rank in range(WORLD)]
    averages = [
        rank_order_average([g[i] for g in per_rank], WORLD, scaling=scaling)
        for i in range(len(per_rank[0]))
    ]
    return [a for a in averages if a is not None]


@pytest.mark.parametrize("as_view", [False, True])
def test_allreduce_hook_divides_and_no_hook_multiplies_as_torch(as_view: bool) -> None:
    """As torch's: the hook divides the bucket by W (``g / W``), DDP without a hook multiplies
    by ``1.0 / W``; at W = 3 the two differ in the last bit somewhere."""
    plain = ddp_grads(None, steps=2, gradient_as_bucket_view=as_view)
    hooked = ddp_grads(reducer.allreduce_hook, steps=2, gradient_as_bucket_view=as_view)
    for step in range(2):
        divided, multiplied = exact_average(step, "divide"), exact_average(step, "reciprocal")
        assert any(not torch.equal(a, b) for a, b in zip(divided, multiplied, strict=True))
        for rank in range(WORLD):
            for got, want in zip(hooked[rank][step], divided, strict=True):
                assert torch.equal(got, want)
            for got, want in zip(plain[rank][step], multiplied, strict=True):
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
    for rank in range(WORLD):
        for g, w in zip(got[rank], exact_average(0, "divide"), strict=True):
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


def test_grad_bucket_on_a_sparse_bucket_and_the_hook_scales_as_torch() -> None:
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

    # The sparse gradient is divided by W either way (as torch does); the dense head is
    # divided by the hook and multiplied by 1 / W without it, so it is compared with its
    # exact average each way.
    heads: list[list[Tensor]] = []
    for rank in range(WORLD):
        model = seeded(Embed)
        model(torch.tensor([[rank, 2, rank + 3]])).pow(2).sum().backward()
        heads.append([p.grad for p in model.head.parameters() if p.grad is not None])
    for scaling, results in (("divide", run(reducer.allreduce_hook)), ("reciprocal", run(None))):
        for got in results:
            assert torch.equal(got[0], results[0][0])
            for i, g in enumerate(got[1:]):
                want = rank_order_average([h[i] for h in heads], WORLD, scaling=scaling)
                assert want is not None and torch.equal(g, want), (scaling, i)
    assert torch.equal(run(reducer.allreduce_hook)[0][0], run(None)[0][0])


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
    # Unannotated: an annotated "-> Tensor" is refused at registration already (see below).
    def returns_tensor(state: object, bucket: reducer.GradBucket):  # type: ignore[no-untyped-def]
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


# -------------------------------------------------------------------------------------------
# Registration refuses what torch's register_comm_hook refuses, with torch's error types.


def annotated(bucket: object = None, returns: object = None) -> Callable[..., Any]:
    """An allreduce hook whose annotations are the given objects (not strings)."""

    def hook(state: object, bucket: reducer.GradBucket) -> torch.futures.Future[Tensor]:
        return reducer.allreduce_hook(state, bucket)

    hook.__annotations__ = {
        **({} if bucket is None else {"bucket": bucket}),
        **({} if returns is None else {"return": returns}),
    }
    return hook


def registration_error(hook: object) -> BaseException | None:
    with fakepg.World(1) as world:
        params = list(build().parameters())
        with reducer.Reducer([params], [list(range(len(params)))], world.group(0)) as red:
            try:
                red.register_comm_hook(None, hook)  # type: ignore[arg-type]
            except Exception as exc:
                return exc
    return None


BAD_HOOKS = {
    "not callable": ("not a hook", TypeError, "Communication hook must be callable"),
    "bucket: int": (
        annotated(bucket=int),
        ValueError,
        "Communication hook: bucket annotation should be dist.GradBucket",
    ),
    "-> int": (
        annotated(returns=int),
        ValueError,
        "Communication hook: return annotation should be torch.futures.Future[torch.Tensor]",
    ),
    "bucket: 'int' (a string)": (
        annotated(bucket="int"),
        ValueError,
        "bucket annotation should be dist.GradBucket",
    ),
    "-> Future[int]": (
        annotated(returns=torch.futures.Future[int]),
        ValueError,
        "return annotation should be torch.futures.Future[torch.Tensor]",
    ),
}


@pytest.mark.parametrize("case", list(BAD_HOOKS))
def test_registration_refuses_what_torch_refuses(case: str) -> None:
    hook, kind, words = BAD_HOOKS[case]
    error = registration_error(hook)
    assert isinstance(error, kind) and isinstance(error, reducer.InvalidArgument), error
    assert words in str(error)
    if kind is TypeError:
        assert isinstance(error, ValueError)  # what this method raised before: still caught
    else:
        assert "annotate" in str(error) and "'annotated.<locals>.hook'" in str(error)


@pytest.mark.parametrize(
    "hook",
    [
        annotated(),
        annotated(bucket=reducer.GradBucket, returns=torch.futures.Future[Tensor]),
        annotated(bucket=dist.GradBucket, returns=torch.futures.Future[torch.Tensor]),
        annotated(bucket="reducer.GradBucket", returns="torch.futures.Future[torch.Tensor]"),
        annotated(bucket="dist.GradBucket", returns="Future[Tensor]"),
        default_hooks.allreduce_hook,  # written for torch: annotated with dist.GradBucket
        reducer.fp16_compress_wrapper(reducer.allreduce_hook),
        reducer.powerSGD_hook,
        reducer.batched_powerSGD_hook,
        reducer.post_localSGD_hook,
    ],
    ids=lambda h: getattr(h, "__qualname__", repr(h)),
)
def test_registration_accepts_grad_bucket_and_future_annotations(hook: object) -> None:
    assert registration_error(hook) is None


def test_the_wrapper_refuses_at_registration_too() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> None:
        ddp = DDP(build(), pg)
        with pytest.raises(TypeError, match="Communication hook must be callable"):
            ddp.register_comm_hook(None, 42)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"bucket annotation should be dist\.GradBucket"):
            ddp.register_comm_hook(None, annotated(bucket=int))
        ddp.register_comm_hook(None, reducer.allreduce_hook)  # nothing was registered before
        loss_of(ddp, pg.rank()).backward()

    run_ranks(fn, 2)


def test_torch_refuses_the_same_hooks_with_the_same_error_types() -> None:
    """torch's own check, on the same hooks (through torch's DDP on a one-rank fake world)."""
    fakepg.register_torch_backend()
    hook_before = sys.excepthook  # init_process_group chains sys.excepthook

    def fn(_pg: fakepg.FakeProcessGroup) -> dict[str, tuple[type, str] | None]:
        seen: dict[str, tuple[type, str] | None] = {}
        cases = {name: hook for name, (hook, _, _) in BAD_HOOKS.items()}
        cases["torch's allreduce_hook"] = default_hooks.allreduce_hook
        for name, hook in cases.items():
            ddp = nn.parallel.DistributedDataParallel(build())
            try:
                ddp.register_comm_hook(None, hook)
                seen[name] = None
            except Exception as exc:
                seen[name] = (type(exc), str(exc))
        return seen

    try:
        (torch_errors,) = fakepg.run_torch(fn, 1, timeout=20.0)
    finally:
        sys.excepthook = hook_before
    assert torch_errors.pop("torch's allreduce_hook") is None
    assert registration_error(default_hooks.allreduce_hook) is None
    for name, torch_error in torch_errors.items():
        assert torch_error is not None, name
        torch_kind, torch_message = torch_error
        ours = registration_error(BAD_HOOKS[name][0])
        assert isinstance(ours, torch_kind), (name, torch_kind, ours)
        assert torch_message in str(ours), (name, torch_message)


# -------------------------------------------------------------------------------------------
# A hook's future must hold a tensor.


def test_a_hook_future_holding_none_names_the_hook_and_bucket() -> None:
    def forgets_to_return(state: object, bucket: reducer.GradBucket) -> torch.Future[Tensor]:
        pg = state
        assert isinstance(pg, fakepg.FakeProcessGroup)
        buffer = bucket.buffer().div_(pg.size())

        def done(future: torch.Future[list[Tensor]]) -> None:
            future.value()  # no return: the future's value is None

        return pg.allreduce([buffer]).get_future().then(done)  # type: ignore[arg-type]

    def fn(pg: fakepg.FakeProcessGroup) -> str:
        ddp = DDP(build(), pg, bucket_cap_mb=TINY_MB)
        ddp.register_comm_hook(pg, forgets_to_return)
        with pytest.raises(reducer.ReductionError) as info:
            loss_of(ddp, pg.rank()).backward()
        return str(info.value)

    for message in run_ranks(fn, 2):
        assert "'forgets_to_return' returned a future for bucket 0 that completed" in message
        assert "with None, not a tensor" in message
        assert "then(lambda fut: fut.value()[0])" in message


# -------------------------------------------------------------------------------------------
# fp16_compress_wrapper / bf16_compress_wrapper: any hook, on a low-precision copy.


WRAPPERS = [
    (reducer.fp16_compress_wrapper, reducer.fp16_compress_hook, torch.float16),
    (reducer.bf16_compress_wrapper, reducer.bf16_compress_hook, torch.bfloat16),
]


@pytest.mark.parametrize(("wrapper", "hook", "dtype"), WRAPPERS)
def test_a_compress_wrapper_around_allreduce_is_the_compress_hook(
    wrapper: Callable[[reducer.CommHook], reducer.CommHook],
    hook: reducer.CommHook,
    dtype: torch.dtype,
) -> None:
    """Cast to ``dtype``, divide by W, sum in rank order in ``dtype``, cast back: bit for bit,
    and the same bits as the compress hook."""
    wrapped = wrapper(reducer.allreduce_hook)
    assert wrapped.__name__ == f"{wrapper.__name__}_hook"  # type: ignore[attr-defined]
    got = ddp_grads(wrapped, steps=2)
    plain = ddp_grads(hook, steps=2)
    for step in range(2):
        per_rank = [local_grads(r, step) for r in range(WORLD)]
        for i in range(len(per_rank[0])):
            want = in_rank_order([per_rank[r][i].to(dtype).div_(WORLD) for r in range(WORLD)])
            for rank in range(WORLD):
                assert got[rank][step][i].dtype == torch.float32
                assert torch.equal(got[rank][step][i], want.float()), (step, i, rank)
                assert torch.equal(got[rank][step][i], plain[rank][step][i])


@pytest.mark.parametrize(("wrapper", "dtype"), [(w, d) for w, _, d in WRAPPERS])
def test_the_wrapped_hook_sees_the_low_precision_buffer(
    wrapper: Callable[[reducer.CommHook], reducer.CommHook], dtype: torch.dtype
) -> None:
    """The wrapped hook sees ``dtype`` in buffer() and gradients(); what it returns (here the
    buffer times the rank, not divided) is cast back into the bucket."""
    seen: dict[int, list[tuple[torch.dtype, list[torch.dtype], bool]]] = {}

    def times_rank(state: object, bucket: reducer.GradBucket) -> torch.Future[Tensor]:
        pg = state
        assert isinstance(pg, fakepg.FakeProcessGroup)
        buffer = bucket.buffer()
        views = all(
            g.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
            for g in bucket.gradients()
        )
        seen.setdefault(pg.rank(), []).append(
            (buffer.dtype, [g.dtype for g in bucket.gradients()], views)
        )
        return reducer.comm_hook.completed(buffer.mul_(pg.rank() + 1))

    def fn(pg: fakepg.FakeProcessGroup) -> list[Tensor]:
        model = build()
        ddp = DDP(model, pg, bucket_cap_mb=TINY_MB)
        ddp.register_comm_hook(pg, wrapper(times_rank))
        loss_of(ddp, pg.rank()).backward()
        return [p.grad for p in model.parameters() if p.grad is not None]

    results = run_ranks(fn, 2)
    for rank, grads in enumerate(results):
        assert all(b == dtype and set(gs) == {dtype} and v for b, gs, v in seen[rank])
        for got, local in zip(grads, local_grads(rank), strict=True):
            assert torch.equal(got, local.to(dtype).mul_(rank + 1).float())


def test_a_compress_wrapper_refuses_what_is_not_a_hook() -> None:
    with pytest.raises(TypeError, match="fp16_compress_wrapper wraps a comm hook"):
        reducer.fp16_compress_wrapper("allreduce")  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------
# PowerSGD.


class Layers(nn.Module):
    """Matrices PowerSGD compresses (8 x 16, two 8 x 8) and vectors it does not (biases)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        out: Tensor = self.d(torch.tanh(self.c(h)))
        return out


def layers() -> Layers:
    return seeded(Layers, seed=11)


def layers_loss(model: nn.Module, rank: int, step: int) -> Tensor:
    out: Tensor = model(rank_input(rank, (5, 16), step))
    return out.pow(2).sum()


def powersgd_grads(
    world_size: int,
    steps: int,
    hook: reducer.CommHook | None,
    state_of: Callable[[], object] = lambda: None,
    **ddp_kwargs: Any,
) -> list[list[list[Tensor]]]:
    """Per rank and step, the gradients of ``layers()`` under DDP with ``hook`` (each rank its
    own state from ``state_of``)."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[Tensor]]:
        model = layers()
        ddp = DDP(model, pg, **ddp_kwargs)
        if hook is not None:
            ddp.register_comm_hook(state_of(), hook)
        out = []
        for step in range(steps):
            ddp.zero_grad(set_to_none=True)
            layers_loss(ddp, pg.rank(), step).backward()
            out.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        return out

    return run_ranks(fn, world_size)


@pytest.mark.parametrize("hook", [reducer.powerSGD_hook, reducer.batched_powerSGD_hook])
def test_powersgd_during_warm_up_is_allreduce_bit_for_bit(hook: reducer.CommHook) -> None:
    def state() -> reducer.PowerSGDState:
        return reducer.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=3)

    plain = powersgd_grads(WORLD, 4, reducer.allreduce_hook)  # divides, as torch's warm-up
    got = powersgd_grads(WORLD, 4, hook, state)
    for rank in range(WORLD):
        for step in range(3):
            for g, w in zip(got[rank][step], plain[rank][step], strict=True):
                assert torch.equal(g, w), (rank, step)
        # The fourth step compresses: the weights differ from the exact average.
        assert not torch.equal(got[rank][3][0], plain[rank][3][0])


def test_powersgd_reduces_vectors_exactly_and_matrices_alike_on_every_rank() -> None:
    """After warm-up, without error feedback: the biases (not compressed) are (sum in rank
    order) / W, bit for bit, as torch's hook computes them; the compressed weights differ from
    the exact average but every rank gets the same bits; the state counts what it
    compressed."""
    states: dict[int, reducer.PowerSGDState] = {}

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[Tensor]]:
        model = layers()
        ddp = DDP(model, pg)
        state = states[pg.rank()] = reducer.PowerSGDState(
            None, matrix_approximation_rank=2, start_powerSGD_iter=2, use_error_feedback=False
        )
        ddp.register_comm_hook(state, reducer.powerSGD_hook)
        out = []
        for step in range(4):
            ddp.zero_grad(set_to_none=True)
            layers_loss(ddp, pg.rank(), step).backward()
            out.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        return out

    results = run_ranks(fn, WORLD)
    names = [n for n, _ in layers().named_parameters()]
    for step in (2, 3):
        local = []
        for rank in range(WORLD):
            model = layers()
            layers_loss(model, rank, step).backward()
            local.append([p.grad for p in model.parameters()])
        for i, name in enumerate(names):
            for rank in range(1, WORLD):
                assert torch.equal(results[rank][step][i], results[0][step][i]), (step, name)
            exact = in_rank_order([local[r][i] for r in range(WORLD)]) / WORLD  # type: ignore[misc]
            if name != "a.weight":
                # Vectors, 8 x 8 and 4 x 8 at rank 2 ((n + m) * 2 * 2 >= n m): not compressed.
                assert torch.equal(results[0][step][i], exact), (step, name)
            else:
                assert not torch.equal(results[0][step][i], exact), (step, name)
    for state in states.values():
        assert state.iter == 4
        # Two compressed iterations, each: a.weight's 8 * 16 numbers as (8 + 16) * 2.
        rate, before, after = state.compression_stats()
        params = sum(p.numel() for p in layers().parameters())
        assert before == 2 * params
        assert after == 2 * (params - 128 + 48)
        assert rate == before / after


def test_a_powersgd_state_shared_by_two_ranks_is_refused() -> None:
    shared = reducer.PowerSGDState(None, start_powerSGD_iter=2)

    def fn(pg: fakepg.FakeProcessGroup) -> str:
        ddp = DDP(build(), pg)
        ddp.register_comm_hook(shared, reducer.powerSGD_hook)
        for step in range(2):  # the second hook call on each rank sees the other's at the latest
            try:
                loss_of(ddp, pg.rank(), step).backward()
            except reducer.ReductionError as exc:  # one rank is refused, its peer fails too
                return str(exc)
        return ""

    messages = run_ranks(fn, 2)
    refused = [m for m in messages if "Give every rank its own PowerSGDState" in m]
    assert len(refused) >= 1 and all(m for m in messages)
    assert re.search(r"is used by rank [01] and by rank [01]", refused[0])


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"start_powerSGD_iter": 1}, "Expect `start_powerSGD_iter` > 1"),
        ({"matrix_approximation_rank": 0}, "matrix_approximation_rank must be an int >= 1"),
        ({"min_compression_rate": -1}, "min_compression_rate must be a finite number >= 0"),
        ({"orthogonalization_epsilon": float("nan")}, "orthogonalization_epsilon must be"),
        ({"start_powerSGD_iter": 2.5}, "start_powerSGD_iter must be an int >= 0"),
    ],
)
def test_powersgd_state_refuses_bad_hyperparameters(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        reducer.PowerSGDState(None, **kwargs)


def test_powersgd_state_pickles_without_its_group() -> None:
    state = reducer.PowerSGDState(object(), start_powerSGD_iter=2, random_seed=3)
    state.error_dict[0] = torch.arange(3.0)
    state.iter = 5
    restored = pickle.loads(pickle.dumps(state))
    assert restored.process_group is None and restored.iter == 5
    assert torch.equal(restored.error_dict[0], torch.arange(3.0))
    assert restored.rng.randint(1_000_000_000) == state.rng.randint(1_000_000_000)


def torch_powersgd_state(**kwargs: Any) -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    return torch_powersgd.PowerSGDState(None, **kwargs)


@pytest.mark.parametrize("config", list(POWERSGD_CONFIGS))
@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "fp16 wrapper"])
def test_powersgd_matches_torchs_hook_in_torchs_ddp(config: str, wrap: bool) -> None:
    """Differential, bit for bit: this DDP with this powerSGD_hook against torch's DDP with
    torch's, on a one-rank fake world, each config plain and in the fp16 wrapper (on two
    and three ranks: tests/test_powersgd_vs_torch.py). Five steps: two of warm-up, then
    compression with its state."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    kwargs = {"start_powerSGD_iter": 2, **POWERSGD_CONFIGS[config]}
    fakepg.register_torch_backend()
    hook_before = sys.excepthook

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
        ours, theirs = layers(), layers()
        ddp = DDP(ours, pg)
        torch_ddp = nn.parallel.DistributedDataParallel(theirs)
        our_hook: reducer.CommHook = reducer.powerSGD_hook
        their_hook = torch_powersgd.powerSGD_hook
        if wrap:
            our_hook = reducer.fp16_compress_wrapper(our_hook)
            their_hook = default_hooks.fp16_compress_wrapper(their_hook)
        ddp.register_comm_hook(reducer.PowerSGDState(None, **kwargs), our_hook)
        torch_ddp.register_comm_hook(torch_powersgd_state(**kwargs), their_hook)
        traces: tuple[list[list[Tensor]], list[list[Tensor]]] = ([], [])
        for step in range(5):
            for model, wrapper, trace in ((ours, ddp, traces[0]), (theirs, torch_ddp, traces[1])):
                model.zero_grad(set_to_none=True)
                layers_loss(wrapper, pg.rank(), step).backward()
                trace.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        assert ddp.reducer.bucket_indices == [list(range(7, -1, -1))]  # one bucket, as torch's
        return traces

    try:
        ((ours, theirs),) = fakepg.run_torch(fn, 1, timeout=30.0)
    finally:
        sys.excepthook = hook_before
    plain = [layers() for _ in range(5)]
    for step in range(5):
        layers_loss(plain[step], 0, step).backward()
        for i, (got, want) in enumerate(zip(ours[step], theirs[step], strict=True)):
            assert torch.equal(got, want), (step, i)
        if step >= 2 and not wrap:  # compressed: not the plain gradient any more
            assert not torch.equal(ours[step][0], plain[step].a.weight.grad)


# -------------------------------------------------------------------------------------------
# Post-local SGD.


def post_local_grads(
    start: int, *, subgroups: bool, post_local_allreduce: bool = True, steps: int = 3
) -> list[list[list[Tensor]]]:
    """Per rank and step on 4 ranks; with ``subgroups``, ranks {0, 1} and {2, 3} average
    together after ``start`` (each pair a fake world of its own)."""
    pairs = [fakepg.World(2, timeout=20.0), fakepg.World(2, timeout=20.0)]

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[Tensor]]:
        model = build()
        ddp = DDP(model, pg, bucket_cap_mb=TINY_MB)
        rank = pg.rank()
        subgroup = pairs[rank // 2].group(rank % 2) if subgroups else None
        state = reducer.PostLocalSGDState(None, subgroup, start, post_local_allreduce)
        ddp.register_comm_hook(state, reducer.post_localSGD_hook)
        out = []
        for step in range(steps):
            ddp.zero_grad(set_to_none=True)
            loss_of(ddp, rank, step).backward()
            out.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        return out

    try:
        return run_ranks(fn, 4)
    finally:
        for world in pairs:
            world.close()


def test_post_local_sgd_averages_globally_then_within_the_subgroup() -> None:
    got = post_local_grads(2, subgroups=True)
    for step in range(3):
        local = [local_grads(r, step) for r in range(4)]
        for rank in range(4):
            members = range(4) if step < 2 else range(2 * (rank // 2), 2 * (rank // 2) + 2)
            for i, grad in enumerate(got[rank][step]):
                terms = [local[r][i] / len(members) for r in members]
                assert torch.equal(grad, in_rank_order(terms)), (step, rank, i)


def test_post_local_sgd_without_gradient_allreduce_keeps_local_gradients() -> None:
    got = post_local_grads(1, subgroups=True, post_local_allreduce=False)
    for rank in range(4):
        for i, grad in enumerate(got[rank][1]):
            assert torch.equal(grad, local_grads(rank, 1)[i])


def test_post_local_sgd_without_a_subgroup_warns_and_stays_global() -> None:
    with pytest.warns(UserWarning, match="subgroup=None.*the global group is used throughout"):
        reducer.PostLocalSGDState(None, None, 1)
    with pytest.warns(UserWarning, match="subgroup=None"):
        got = post_local_grads(1, subgroups=False, steps=2)
    for step in range(2):
        local = [local_grads(r, step) for r in range(4)]
        for rank in range(4):
            for i, grad in enumerate(got[rank][step]):
                assert torch.equal(grad, in_rank_order([local[r][i] / 4 for r in range(4)]))


def torch_and_ours(
    world_size: int,
    steps: int,
    ours: Callable[[], tuple[object, Any]],
    theirs: Callable[[], tuple[object, Any]],
) -> list[tuple[list[list[Tensor]], list[list[Tensor]]]]:
    """Per rank: this DDP with ``ours()`` = (state, hook) and torch's DDP with ``theirs()``,
    on copies of ``layers()``, the same data, one fake world registered with torch."""
    fakepg.register_torch_backend()
    hook_before = sys.excepthook

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
        mine, torch_model = layers(), layers()
        ddp = DDP(mine, pg)
        torch_ddp = nn.parallel.DistributedDataParallel(torch_model)
        ddp.register_comm_hook(*ours())
        torch_ddp.register_comm_hook(*theirs())
        traces: tuple[list[list[Tensor]], list[list[Tensor]]] = ([], [])
        for step in range(steps):
            for model, wrapper, trace in (
                (mine, ddp, traces[0]),
                (torch_model, torch_ddp, traces[1]),
            ):
                model.zero_grad(set_to_none=True)
                layers_loss(wrapper, pg.rank(), step).backward()
                trace.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        return traces

    try:
        return fakepg.run_torch(fn, world_size, timeout=30.0)
    finally:
        sys.excepthook = hook_before


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        (
            lambda: (None, reducer.fp16_compress_wrapper(reducer.allreduce_hook)),
            lambda: (None, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)),
        ),
        (
            lambda: (reducer.PowerSGDState(None, start_powerSGD_iter=10), reducer.powerSGD_hook),
            lambda: (torch_powersgd_state(start_powerSGD_iter=10), torch_powersgd_hook()),
        ),
    ],
    # (torch refuses its bf16 hooks without CUDA and NCCL; the bf16 wrapper's exact
    # reference is above.)
    ids=["fp16_compress_wrapper", "powerSGD warm-up"],
)
def test_elementwise_hooks_match_torchs_on_three_ranks(
    ours: Callable[[], tuple[object, Any]], theirs: Callable[[], tuple[object, Any]]
) -> None:
    """Differential, bit for bit, on three ranks: the compression wrapper (cast, divide, sum
    in rank order, cast back) and PowerSGD's warm-up (divide, allreduce) reduce element by
    element, so the bucket layouts (torch's first iteration has one bucket) do not matter."""
    for rank, (mine, torch_trace) in enumerate(torch_and_ours(3, 3, ours, theirs)):
        for step in range(3):
            for i, (got, want) in enumerate(zip(mine[step], torch_trace[step], strict=True)):
                assert torch.equal(got, want), (rank, step, i)


def torch_powersgd_hook() -> Any:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

    return torch_powersgd.powerSGD_hook


class SparseAndDense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 8, sparse=True)
        self.head = nn.Linear(8, 16)

    def forward(self, idx: Tensor) -> Tensor:
        out: Tensor = self.head(self.emb(idx))
        return out


@pytest.mark.parametrize("hook", [reducer.powerSGD_hook, reducer.batched_powerSGD_hook])
def test_powersgd_reduces_a_sparse_gradient_as_it_is(hook: reducer.CommHook) -> None:
    """nn.Embedding(sparse=True) has nothing to approximate: after warm-up its gradient is
    what no hook gives, bit for bit, while the dense bucket is compressed."""

    def run(with_hook: bool) -> list[list[Tensor]]:
        def fn(pg: fakepg.FakeProcessGroup) -> list[Tensor]:
            model = seeded(SparseAndDense)
            ddp = DDP(model, pg)
            if with_hook:
                state = reducer.PowerSGDState(None, start_powerSGD_iter=2)
                ddp.register_comm_hook(state, hook)
            for step in range(3):
                ddp.zero_grad(set_to_none=True)
                idx = torch.tensor([[pg.rank(), 2, (pg.rank() + step) % 7]])
                ddp(idx).pow(2).sum().backward()
            grad = model.emb.weight.grad
            assert grad is not None and grad.is_sparse
            return [grad.coalesce().to_dense(), model.head.weight.grad]  # type: ignore[list-item]

        return run_ranks(fn, WORLD)

    for (emb, head), (plain_emb, plain_head) in zip(run(True), run(False), strict=True):
        assert torch.equal(emb, plain_emb)
        assert not torch.equal(head, plain_head)  # compressed
