"""Clean: ``find_unused_parameters=True`` with a branch that each rank picks by its own data,
so the unused parameters differ per rank and per step. DDP reduces every gradient anyway (an
unused one counts as zero): the ranks stay in sync."""

import torch
from _common import batch, finish, parse, setup, wrap
from torch import nn


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 8)
        self.left, self.right = nn.Linear(8, 2), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, left: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.left(h) if left else self.right(h)


def main() -> None:
    args = parse(__doc__, variants=("clean",))
    rank, _ = setup()
    net = TwoHeads()
    ddp = wrap(net, args.ddp, find_unused_parameters=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(args.steps + 1):
        ddp(batch(rank, step), left=(rank + step) % 2 == 0).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
