"""Differential, on real-model shapes: reducer.DistributedDataParallel against torch's DDP.

A GPT-2-shaped model (tied embedding and head, LayerNorm, causal attention, GELU MLP) and a
Switch-Transformer-shaped MoE (top-1 routing over experts, some idle on some ranks, one never
routed to, ``find_unused_parameters=True``), each from a small config in tests/helpers.py,
train two AdamW steps under both wrappers on the fake world, in the same rank threads, on
copies of one model fed the same tokens. Gradients after each backward and parameters after
each step must be bit-identical at every world size: both scale each gradient by
multiplying with ``1.0 / W`` (see Note [Gradient scaling] in reducer.bucket_views), and the
fake world sums in rank order for both. AdamW divides by the square root of the second moment,
so a last-bit difference in a gradient would show in the parameters too.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers import assert_gradients_bit_identical, tiny_gpt2, tiny_switch_moe, token_batch
from torch import Tensor, nn

import fakepg
import reducer

STEPS = 2


pytestmark = pytest.mark.usefixtures("fakepg_torch_backend")


Record = list[tuple[list[Tensor | None], list[Tensor]]]  # per step: gradients, parameters


def train_both(
    build: Callable[[], nn.Module], vocab: int, world_size: int, *, find_unused: bool
) -> list[tuple[Record, Record]]:
    """Per rank, each wrapper's record of ``STEPS`` AdamW steps."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[Record, Record]:
        torch.get_num_threads()  # this thread's intra-op thread count, before any kernel
        records: tuple[Record, Record] = ([], [])
        wrappers = (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel)
        for wrapper, record in zip(wrappers, records, strict=True):
            model = build()
            ddp = wrapper(model, bucket_cap_mb=0.01, find_unused_parameters=find_unused)  # type: ignore[operator]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(STEPS):
                opt.zero_grad(set_to_none=True)
                tokens, targets = token_batch(pg.rank(), step, vocab)
                logits = ddp(tokens)
                nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
                grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
                opt.step()
                record.append((grads, [p.detach().clone() for p in model.parameters()]))
        return records

    return fakepg.run_torch(fn, world_size, timeout=60.0)


def worst_difference(results: list[tuple[Record, Record]]) -> tuple[int, int, float, float]:
    """(gradients compared, gradients that differ, worst gradient difference, worst parameter
    difference), over every rank and step."""
    compared = differ = 0
    worst_grad = worst_param = 0.0
    for ours, theirs in results:
        for (grads, params), (their_grads, their_params) in zip(ours, theirs, strict=True):
            for a, b in zip(grads, their_grads, strict=True):
                assert (a is None) == (b is None), "one wrapper left a gradient None"
                if a is None or b is None:
                    continue
                compared += 1
                if not torch.equal(a, b):
                    differ += 1
                    worst_grad = max(worst_grad, float((a.double() - b.double()).abs().max()))
            for a, b in zip(params, their_params, strict=True):
                worst_param = max(worst_param, float((a.double() - b.double()).abs().max()))
    return compared, differ, worst_grad, worst_param


def assert_bitwise(results: list[tuple[Record, Record]], names: list[str]) -> None:
    for rank, (ours, theirs) in enumerate(results):
        for step, ((grads, params), (their_grads, their_params)) in enumerate(
            zip(ours, theirs, strict=True)
        ):
            assert_gradients_bit_identical(names, grads, their_grads, f"rank {rank}, step {step}")
            for name, a, b in zip(names, params, their_params, strict=True):
                assert torch.equal(a, b), f"{name} after AdamW step {step}, rank {rank}"


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_gpt2_shaped_model_is_bitwise_torchs(world_size: int) -> None:
    model = tiny_gpt2()
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == 28  # the tied head is the embedding's parameter, seen once
    results = train_both(tiny_gpt2, model.wte.num_embeddings, world_size, find_unused=False)
    assert_bitwise(results, names)
    compared, _, _, _ = worst_difference(results)
    assert compared == 28 * STEPS * world_size


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_switch_moe_shaped_model_is_bitwise_torchs(world_size: int) -> None:
    model = tiny_switch_moe()
    names = [n for n, _ in model.named_parameters()]
    results = train_both(tiny_switch_moe, model.embed.num_embeddings, world_size, find_unused=True)
    assert_bitwise(results, names)
    # The case under test: the never-routed expert stays None everywhere, and some expert is
    # idle on some rank (it contributes zeros there) yet used on another.
    idle = [i for i, n in enumerate(names) if n.startswith("experts.0.5.")]
    assert idle and all(ours[0][0][i] is None for ours, _ in results for i in idle)
    used = [locally_used(rank, model.embed.num_embeddings) for rank in range(world_size)]
    assert set.union(*used) - set.intersection(*used), "no expert idle on one rank only"


def locally_used(rank: int, vocab: int) -> set[int]:
    """The parameters plain autograd gives a gradient on ``rank`` at step 0."""
    model = tiny_switch_moe()
    tokens, targets = token_batch(rank, 0, vocab)
    nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten()).backward()
    return {i for i, p in enumerate(model.parameters()) if p.grad is not None}
