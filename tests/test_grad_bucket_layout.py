"""GradBucket.gradients() follows each parameter's strides, before set_buffer and after.

A channels_last conv weight's gradient is laid out channels_last in its bucket. A hook that
reads gradients through ``GradBucket.gradients()`` (PowerSGD, which sees each as a matrix)
must see the same logical gradient as for a contiguous twin of the model, unwrapped or run
by the fp16 wrapper on a float16 copy of the buffer (``set_buffer``). Then the channels_last
model and its twin end with the same gradients, bit for bit (PowerSGD's arithmetic only
depends on the matrices' values, and its error feedback is elementwise). The weights and
inputs are small multiples of 1/2 and the model is linear, so that the two layouts'
convolution kernels, which add in different orders, compute the same local gradients exactly.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks, seeded
from torch import Tensor, nn

import fakepg
import reducer


def dyadic(shape: tuple[int, ...], seed: int) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, shape, generator=generator).float() * 0.5


class Conv(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4, 2)
        with torch.no_grad():
            for i, p in enumerate(self.parameters()):
                p.copy_(dyadic(tuple(p.shape), i))

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.conv(x).mean((2, 3)))
        return out


def run(channels_last: bool, wrap: bool, steps: int = 4) -> list[list[list[Tensor]]]:
    """Per rank and step, the conv model's gradients (contiguous copies) after PowerSGD."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[Tensor]]:
        model = seeded(Conv, seed=3)
        if channels_last:
            model.conv.to(memory_format=torch.channels_last)
        ddp = reducer.DistributedDataParallel(model, pg)
        state = reducer.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
        hook = reducer.powerSGD_hook
        ddp.register_comm_hook(state, reducer.fp16_compress_wrapper(hook) if wrap else hook)
        out = []
        for step in range(steps):
            model.zero_grad(set_to_none=True)
            x = dyadic((2, 3, 6, 6), 100 * step + pg.rank())
            if channels_last:
                x = x.to(memory_format=torch.channels_last)
            ddp(x).pow(2).sum().backward()
            out.append([p.grad.contiguous() for p in model.parameters() if p.grad is not None])
        # The case under test: the conv weight's gradient was compressed after warm-up.
        assert state.total_numel_after_compression < state.total_numel_before_compression
        return out

    return run_ranks(fn, 2)


@pytest.mark.parametrize("wrap", [False, True], ids=["powerSGD", "fp16-wrapped powerSGD"])
def test_channels_last_weight_gets_the_contiguous_twins_gradient(wrap: bool) -> None:
    weight = seeded(Conv, seed=3).conv.weight
    assert weight.to(memory_format=torch.channels_last).stride() != weight.stride()
    twin, channels_last = run(False, wrap), run(True, wrap)
    for rank in range(2):
        for step in range(4):  # two of warm-up (an allreduce), two compressed
            for i, (a, b) in enumerate(
                zip(channels_last[rank][step], twin[rank][step], strict=True)
            ):
                assert torch.equal(a, b), f"rank {rank}, step {step}, parameter {i}"


def test_gradients_view_the_buffer_with_the_parameters_strides_after_set_buffer() -> None:
    """Before and after set_buffer, each gradient is a view of the buffer with the
    parameter's strides, holding the same values."""
    seen: list[tuple[list[tuple[int, ...]], list[tuple[int, ...]], bool]] = []

    def hook(state: object, bucket: reducer.GradBucket) -> torch.futures.Future[Tensor]:
        before = bucket.gradients()
        half = bucket.buffer().to(torch.float16)
        bucket.set_buffer(half)
        after = bucket.gradients()
        same = all(
            torch.equal(a.to(torch.float16), b) and b.data_ptr() >= half.data_ptr()
            for a, b in zip(before, after, strict=True)
        )
        seen.append(([g.stride() for g in before], [g.stride() for g in after], same))
        return reducer.allreduce_hook(state, bucket)

    def fn(pg: fakepg.FakeProcessGroup) -> None:
        model = seeded(Conv, seed=3).to(memory_format=torch.channels_last)
        ddp = reducer.DistributedDataParallel(model, pg)
        ddp.register_comm_hook(None, hook)
        ddp(dyadic((2, 3, 6, 6), pg.rank()).to(memory_format=torch.channels_last)).sum().backward()

    run_ranks(fn, 1)
    strides = [p.stride() for p in reversed(list(seeded(Conv, seed=3).parameters()))]
    channels_last = seeded(Conv, seed=3).conv.weight.to(memory_format=torch.channels_last).stride()
    ((before, after, same),) = seen
    assert before == after and same
    assert channels_last in after and channels_last not in strides
