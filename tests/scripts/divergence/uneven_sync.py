"""Only some ranks reduce: rank 0 syncs on every micro-step, the others on the last only (a
rank-dependent accumulation setting). The ranks' reductions no longer pair up. Fixed: every
rank syncs on the last micro-step only."""

import torch
from _common import batch, finish, model, parse, setup, wrap

ACCUMULATE = 2


def main() -> None:
    args = parse(__doc__)
    rank, _ = setup()
    net = model()
    ddp = wrap(net, args.ddp)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    sync_every_micro_step = args.variant == "buggy" and rank == 0
    for step in range(args.steps):
        for micro in range(ACCUMULATE):
            last = micro == ACCUMULATE - 1
            ddp.require_backward_grad_sync = last or sync_every_micro_step
            (ddp(batch(rank, step, micro)).square().mean() / ACCUMULATE).backward()
        optimizer.step()
        optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
