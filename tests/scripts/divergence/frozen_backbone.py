"""A frozen backbone (``requires_grad=False``) and a trained head. Buggy: the pretrained
weights are loaded on rank 0 only, after the wrapper broadcast rank 0's parameters at its
construction; nothing reduces or steps a frozen parameter, so rank 1 trains its head on a
random backbone, and the head's gradients agree anyway (they are averaged). Fixed: every rank
loads them (or load before wrapping)."""

import torch
from _common import batch, finish, parse, setup, wrap
from torch import nn


def pretrained() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"weight": torch.randn(8, 4, generator=g), "bias": torch.randn(8, generator=g)}


def main() -> None:
    args = parse(__doc__)
    rank, _ = setup()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    net[0].requires_grad_(False)
    ddp = wrap(net, args.ddp)
    if rank == 0 or args.variant == "fixed":
        net[0].load_state_dict(pretrained())
    optimizer = torch.optim.SGD(net[2].parameters(), lr=0.1)
    for step in range(args.steps):
        ddp(batch(rank, step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
