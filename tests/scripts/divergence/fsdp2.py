"""Clean: FSDP2 (``fully_shard``). Its parameters are shards, different on every rank by
design: the check compares only replicated parameters and says how many it left out.
``--ddp`` is ignored."""

import torch
import torch.distributed as dist
from _common import batch, parse, setup
from torch import nn
from torch.distributed.fsdp import fully_shard


def main() -> None:
    args = parse(__doc__, variants=("clean",))
    rank, _ = setup()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    for layer in (net[0], net[2]):
        fully_shard(layer)
    fully_shard(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(args.steps):
        net(batch(rank, step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
