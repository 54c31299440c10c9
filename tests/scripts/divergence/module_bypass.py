"""The forward goes through ``ddp.module``: DDP's hooks are never armed, and each rank steps
on its local gradient. Fixed: call the wrapper."""

import torch
from _common import batch, finish, model, parse, setup, wrap


def main() -> None:
    args = parse(__doc__)
    rank, _ = setup()
    net = model()
    ddp = wrap(net, args.ddp)
    forward = ddp.module if args.variant == "buggy" else ddp
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(args.steps):
        forward(batch(rank, step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
