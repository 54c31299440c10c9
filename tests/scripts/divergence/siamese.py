"""Clean: a siamese step, two forwards of the wrapper (one per input of a pair) and one
backward of the loss that joins them: one reduction per step, not two."""

import torch
from _common import batch, finish, model, parse, setup, wrap


def main() -> None:
    args = parse(__doc__, variants=("clean",))
    rank, _ = setup()
    net = model()
    ddp = wrap(net, args.ddp)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(args.steps):
        left, right = ddp(batch(rank, step, 0)), ddp(batch(rank, step, 1))
        (left - right).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
