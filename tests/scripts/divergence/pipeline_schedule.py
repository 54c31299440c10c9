"""A pipeline schedule sets ``require_backward_grad_sync`` for the data-parallel replicas of
a stage; its "last micro-batch" test is off by one, so these replicas never sync. Fixed: the
last micro-batch syncs."""

import torch
from _common import batch, finish, model, parse, setup, wrap

MICRO_BATCHES = 4


def schedule(micro_batches: int, buggy: bool) -> list[tuple[int, bool]]:
    """(micro-batch, is it the last) in the order the stage runs them."""
    last = micro_batches if buggy else micro_batches - 1
    return [(mb, mb == last) for mb in range(micro_batches)]


def main() -> None:
    args = parse(__doc__)
    rank, _ = setup()
    net = model()
    stage = wrap(net, args.ddp)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(args.steps):
        for mb, is_last in schedule(MICRO_BATCHES, args.variant == "buggy"):
            stage.require_backward_grad_sync = is_last
            stage(batch(rank, step, mb)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
