"""Gradient accumulation with the condition off by one: ``no_sync()`` suppresses the sync on
the optimizer step's micro-batch (it syncs the first one instead). Fixed: sync the last."""

import contextlib

import torch
from _common import batch, finish, model, parse, setup, wrap

ACCUMULATE = 3


def main() -> None:
    args = parse(__doc__)
    rank, _ = setup()
    net = model()
    ddp = wrap(net, args.ddp)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(args.steps):
        for micro in range(ACCUMULATE):
            if args.variant == "buggy":
                accumulating = micro % ACCUMULATE != 0
            else:
                accumulating = (micro + 1) % ACCUMULATE != 0
            with ddp.no_sync() if accumulating else contextlib.nullcontext():
                (ddp(batch(rank, step, micro)).square().mean() / ACCUMULATE).backward()
        optimizer.step()
        optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
