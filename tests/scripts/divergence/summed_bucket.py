"""Two heads, each rank picking one by its rank, with ``find_unused_parameters=True`` and one
bucket per layer. Buggy: ``skip_all_reduce_unused_params=True`` skips the buckets of unused
parameters, which differ per rank, so the ranks' collectives pair different buckets of the
same size, and each rank's head gets the sum of its own head's and the other rank's head's
gradients. Fixed: every bucket reduced (the default)."""

import torch
from _common import batch, finish, parse, setup, wrap
from torch import nn


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Linear(4, 8)
        self.left, self.right = nn.Linear(8, 2, bias=False), nn.Linear(8, 2, bias=False)

    def forward(self, x: torch.Tensor, left: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.left(h) if left else self.right(h)


def main() -> None:
    args = parse(__doc__)
    rank, _ = setup()
    net = TwoHeads()
    ddp = wrap(
        net,
        args.ddp,
        find_unused_parameters=True,
        bucket_cap_mb=1e-5,
        skip_all_reduce_unused_params=args.variant == "buggy",
    )
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(args.steps):
        ddp(batch(rank, step), left=rank == 0).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
