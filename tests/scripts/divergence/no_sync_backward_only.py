"""``no_sync()`` wraps only the backward, not the forward: it does nothing, and every
micro-step reduces (waste, not divergence). Fixed: the forward runs inside the block too."""

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
            last = micro == ACCUMULATE - 1
            block = contextlib.nullcontext() if last else ddp.no_sync()
            if args.variant == "buggy":
                loss = ddp(batch(rank, step, micro)).square().mean() / ACCUMULATE
                with block:
                    loss.backward()
            else:
                with block:
                    loss = ddp(batch(rank, step, micro)).square().mean() / ACCUMULATE
                    loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
