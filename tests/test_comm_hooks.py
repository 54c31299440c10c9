"""reducer.comm_hooks through the reducer on the fake world: each built-in hook, exactly."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fakepg
import reducer
from reducer import ReductionError

WORLD = 3


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

    with pytest.raises(ReductionError, match="returned a Tensor for bucket 0, not a"):
        grads_with_hook(bad)
