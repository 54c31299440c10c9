"""Clean: uneven inputs under DDP's ``join()``: rank r trains on 2 + r batches, and the ranks
that run out shadow the others' reductions. Ranks step a different number of times by design
and stay in sync; the check notes it and stops checking from the first step a rank skips."""

import torch
from _common import batch, finish, model, parse, setup, wrap


def main() -> None:
    args = parse(__doc__, variants=("clean",))
    rank, _ = setup()
    net = model()
    ddp = wrap(net, args.ddp)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    with ddp.join():
        for step in range(2 + rank):
            ddp(batch(rank, step)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
