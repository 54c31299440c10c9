"""A hand-written data-parallel loop: all_reduce every gradient, then divide. Buggy: the loop
skips the biases (``if p.dim() > 1``, meant for weight decay). ``--ddp`` is ignored."""

import torch
import torch.distributed as dist
from _common import batch, finish, model, parse, setup


def main() -> None:
    args = parse(__doc__)
    rank, world_size = setup()
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(args.steps):
        net(batch(rank, step)).square().mean().backward()
        for p in net.parameters():
            if args.variant == "buggy" and p.dim() < 2:
                continue
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)
        optimizer.step()
        optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
