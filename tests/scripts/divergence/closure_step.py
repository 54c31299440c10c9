"""Gradient accumulation with the last micro-batch in the step's closure, as Lightning runs
every training step (the step is given a closure): the first micro-batch runs under
``no_sync()``, the closure's must sync. Buggy: the closure's micro-batch runs under
``no_sync()`` too, so no rank's gradient is ever averaged. Fixed: the closure syncs."""

import contextlib

import torch
from _common import batch, finish, model, parse, setup, wrap


def main() -> None:
    args = parse(__doc__)
    rank, _ = setup()
    net = model()
    ddp = wrap(net, args.ddp)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(args.steps):
        with ddp.no_sync():
            (ddp(batch(rank, step, 0)).square().mean() / 2).backward()

        def closure(step: int = step) -> torch.Tensor:
            unsynced = args.variant == "buggy"
            with ddp.no_sync() if unsynced else contextlib.nullcontext():
                loss = ddp(batch(rank, step, 1)).square().mean() / 2
                loss.backward()
            return loss

        optimizer.step(closure)
        optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
