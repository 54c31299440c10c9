"""Gradients agree, parameters do not: the learning-rate scheduler steps on rank 0 only
(inside an ``if rank == 0:`` block meant for logging). Fixed: every rank steps it."""

import torch
from _common import batch, finish, model, parse, setup, wrap


def main() -> None:
    args = parse(__doc__)
    rank, _ = setup()
    net = model()
    ddp = wrap(net, args.ddp)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    for step in range(args.steps + 1):
        ddp(batch(rank, step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0 or args.variant == "fixed":
            scheduler.step()
            if rank == 0:
                print(f"step {step}: lr {scheduler.get_last_lr()[0]}")
    finish(net)


if __name__ == "__main__":
    main()
