"""Clean: ``ZeroRedundancyOptimizer`` over two blocks of equal shapes. Each rank steps its own
shard (rank 0 the first block, rank 1 the second), then the owners broadcast the updated
parameters: the ranks hold the same model after every step, though each rank's inner
optimizer holds a different shard of the same shapes."""

import torch
from _common import batch, finish, parse, setup, wrap
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer


def main() -> None:
    args = parse(__doc__, variants=("clean",))
    rank, _ = setup()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    ddp = wrap(net, args.ddp)
    optimizer = ZeroRedundancyOptimizer(net.parameters(), torch.optim.SGD, lr=0.1)
    for step in range(args.steps):
        ddp(batch(rank, step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
