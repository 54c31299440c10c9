"""torch's FSDP2, HSDP, DDP over a subgroup and ZeRO on the fake world, checked bit for bit.

Why the comparisons are exact (no tolerance):

- Every rank computes its local gradient with the same ops on the same parameters, whatever
  wraps the model (FSDP2 all-gathers exact copies of the parameters), so local gradients are
  the same bits under FSDP2, DDP and a plain model.
- FSDP2 reduce-scatters fp32 gradients with ReduceOp.AVG (no pre/post divide factor for fp32:
  ``_get_gradient_divide_factors``): the fake world adds in rank order, then divides by W:
  ``(((g0 + g1) + g2) + g3) / W``. torch's DDP scales each bucket by 1/W, then sums in rank
  order: ``((g0/W + g1/W) + g2/W) + g3/W``. For W a power of two, multiplying or dividing by W
  is exact and commutes with every rounding of the sum (barring subnormals), so both are the
  same bits: FSDP2 at W = 2 and 4 equals DDP exactly, step after step.
- HSDP on a (replicate=2, shard=2) mesh reduce-scatters over each shard group with AVG, then
  all-reduces over each replicate group with AVG: ``((g0 + g1)/2 + (g2 + g3)/2) / 2``. That is a
  different order from DDP's, so it is compared with a reference that combines the local
  gradients in exactly that order.
- SGD (no momentum, foreach=False) updates each element as ``p.add_(g, alpha=-lr)``, whether
  ``p`` is a whole parameter or an FSDP2 shard.

Each rank seeds its own generator (``torch.manual_seed(1000 + rank)``) for dropout, which the
fake world's per-rank generators make deterministic; the references replay each rank's stream.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

import fakepg
import reducer

VOCAB, WIDTH, HEADS, SEQ, BATCH = 64, 32, 2, 8, 4
STEPS, LR = 3, 0.1

pytestmark = [
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view:UserWarning"),
]


@pytest.fixture(autouse=True)
def _registered() -> None:
    fakepg.register_torch_backend()


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP, with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, HEADS, c // HEADS).transpose(1, 2)
            for z in self.qkv(self.ln1(x)).split(c, dim=2)
        )
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build() -> TinyGPT:
    """The same model on every rank (and in the references)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TinyGPT()


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def train(model: nn.Module, params: list[torch.Tensor], rank: int) -> None:
    """STEPS steps of SGD on this rank's batches; each rank's dropout stream is its own."""
    torch.manual_seed(1000 + rank)
    opt = torch.optim.SGD(params, lr=LR, foreach=False)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        loss_of(model, rank, step).backward()
        opt.step()


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter's full value (gathered, for an FSDP2 shard)."""
    gather = getattr(p, "full_tensor", None)
    return (gather() if gather is not None else p).detach().clone()


def fsdp_rank(
    mesh_shape: tuple[int, ...],
) -> Callable[[fakepg.FakeProcessGroup], list[torch.Tensor]]:
    def fn(pg: fakepg.FakeProcessGroup) -> list[torch.Tensor]:
        names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
        model = build()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        train(model, list(model.parameters()), pg.rank())
        return [full(p) for p in model.parameters()]

    return fn


def ddp_rank(pg: fakepg.FakeProcessGroup) -> list[torch.Tensor]:
    model = build()
    ddp = nn.parallel.DistributedDataParallel(model)
    train(ddp, list(model.parameters()), pg.rank())
    return [full(p) for p in model.parameters()]


def reference(
    world_size: int, combine: Callable[[list[torch.Tensor]], torch.Tensor]
) -> list[torch.Tensor]:
    """Training without any process group: per step, each rank's local gradient (its batch,
    its dropout stream), combined across ranks by ``combine``; then the SGD update."""
    model = build()
    states = []
    for rank in range(world_size):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1000 + rank)
            states.append(torch.get_rng_state())
    params = list(model.parameters())
    for step in range(STEPS):
        local = []
        for rank in range(world_size):
            model.zero_grad(set_to_none=True)
            with torch.random.fork_rng(devices=[]):
                torch.set_rng_state(states[rank])
                loss_of(model, rank, step).backward()
                states[rank] = torch.get_rng_state()
            local.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
        with torch.no_grad():
            for i, p in enumerate(params):
                p.add_(combine([g[i] for g in local]), alpha=-LR)
    return [p.detach().clone() for p in params]


def assert_same_bits(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    names = [n for n, _ in build().named_parameters()]
    for name, a, b in zip(names, got, want, strict=True):
        assert torch.equal(a, b), f"{what}: {name} differs by {(a - b).abs().max().item():.3g}"


@pytest.mark.parametrize("world_size", [2, 4])
def test_fsdp2_trains_to_the_same_bits_as_ddp(world_size: int) -> None:
    fsdp = fakepg.run_torch(fsdp_rank((world_size,)), world_size, timeout=60)
    ddp = fakepg.run_torch(ddp_rank, world_size, timeout=60)
    for rank in range(world_size):
        assert_same_bits(fsdp[rank], fsdp[0], f"FSDP2 rank {rank} vs rank 0")
        assert_same_bits(fsdp[rank], ddp[rank], f"FSDP2 vs DDP, rank {rank}")
    # And both are the rank-order average of the local gradients (DDP's order).
    want = reference(world_size, lambda gs: _sum_in_order([g * (1 / world_size) for g in gs]))
    assert_same_bits(ddp[0], want, "DDP vs the reference")


def test_hsdp_on_a_two_dimensional_mesh_combines_shard_groups_then_replicas() -> None:
    hsdp = fakepg.run_torch(fsdp_rank((2, 2)), 4, timeout=60)

    def hsdp_order(gs: list[torch.Tensor]) -> torch.Tensor:
        # Shard groups [0, 1] and [2, 3] reduce-scatter with AVG, then replicate groups
        # [0, 2] and [1, 3] all-reduce with AVG.
        return ((gs[0] + gs[1]) / 2 + (gs[2] + gs[3]) / 2) / 2

    want = reference(4, hsdp_order)
    for rank in range(4):
        assert_same_bits(hsdp[rank], want, f"HSDP rank {rank}")


def _sum_in_order(gs: list[torch.Tensor]) -> torch.Tensor:
    total = gs[0]
    for g in gs[1:]:
        total = total + g
    return total


def test_ddp_over_subgroups_trains_each_group_on_its_own() -> None:
    """Ranks {0, 1} and {2, 3} each train with torch's DDP over their own subgroup (and rank
    pairs interleave their groups' collectives with the world's). Each pair ends where a
    two-rank world fed the same batches ends."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[torch.Tensor]:
        low, high = dist.new_group([0, 1]), dist.new_group([2, 3])
        mine = low if pg.rank() < 2 else high
        model = build()
        ddp = nn.parallel.DistributedDataParallel(model, process_group=mine)
        train(ddp, list(model.parameters()), pg.rank())
        dist.barrier()  # a world collective after the subgroups' ones
        return [full(p) for p in model.parameters()]

    four = fakepg.run_torch(fn, 4, timeout=60)

    def pair(offset: int) -> Callable[[fakepg.FakeProcessGroup], list[torch.Tensor]]:
        def two(pg: fakepg.FakeProcessGroup) -> list[torch.Tensor]:
            model = build()
            ddp = nn.parallel.DistributedDataParallel(model)
            train(ddp, list(model.parameters()), pg.rank() + offset)
            return [full(p) for p in model.parameters()]

        return two

    for offset in (0, 2):
        two = fakepg.run_torch(pair(offset), 2, timeout=60)
        for rank in range(2):
            assert_same_bits(four[offset + rank], two[rank], f"rank {offset + rank}")
    assert not all(torch.equal(a, b) for a, b in zip(four[0], four[2], strict=True))


def test_this_projects_ddp_runs_on_a_fake_subgroup() -> None:
    """A FakeProcessGroup from new_group is a reducer.ProcessGroup: the reducer's DDP over
    ranks {1, 2} of three gives the rank-order average of those two ranks."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[torch.Tensor] | None:
        sub = pg.new_group([1, 2])
        if sub is None:
            return None
        model = build()
        ddp = reducer.DistributedDataParallel(model, sub)
        train(ddp, list(model.parameters()), pg.rank())
        return [full(p) for p in model.parameters()]

    results = fakepg.run(fn, 3, timeout=60)
    assert results[0] is None
    assert results[1] is not None and results[2] is not None
    assert_same_bits(results[1], results[2], "rank 1 vs rank 2")

    def two(pg: fakepg.FakeProcessGroup) -> list[torch.Tensor]:
        model = build()
        ddp = reducer.DistributedDataParallel(model, pg)
        train(ddp, list(model.parameters()), pg.rank() + 1)
        return [full(p) for p in model.parameters()]

    assert_same_bits(results[1], fakepg.run(two, 2, timeout=60)[0], "subgroup vs two ranks")


def test_zero_redundancy_optimizer_matches_plain_sgd() -> None:
    """ZeRO: each rank steps its partition of the parameters, then broadcasts it; with DDP's
    gradients the parameters end as plain SGD's, bit for bit."""

    def zero(pg: fakepg.FakeProcessGroup) -> list[torch.Tensor]:
        model = build()
        ddp = nn.parallel.DistributedDataParallel(model)
        torch.manual_seed(1000 + pg.rank())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            opt = ZeroRedundancyOptimizer(
                model.parameters(), optimizer_class=torch.optim.SGD, lr=LR, foreach=False
            )
        for step in range(STEPS):
            opt.zero_grad(set_to_none=True)
            loss_of(ddp, pg.rank(), step).backward()
            opt.step()
        return [full(p) for p in model.parameters()]

    zeros = fakepg.run_torch(zero, 3, timeout=60)
    ddp = fakepg.run_torch(ddp_rank, 3, timeout=60)
    for rank in range(3):
        assert_same_bits(zeros[rank], ddp[rank], f"ZeRO vs DDP, rank {rank}")
