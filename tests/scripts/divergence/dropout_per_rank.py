"""Clean: dropout seeded per rank (each rank drops different units: only the parameters must
agree), a BatchNorm whose running statistics stay per rank (``broadcast_buffers=False``,
legitimate: the check notes it), and gradient clipping after the reduction."""

import torch
from _common import batch, finish, parse, setup, wrap
from torch import nn


def main() -> None:
    args = parse(__doc__, variants=("clean",))
    rank, _ = setup()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2))
    ddp = wrap(net, args.ddp, broadcast_buffers=False)
    torch.manual_seed(1234 + rank)  # the dropout masks differ per rank
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    for step in range(args.steps):
        ddp(batch(rank, step)).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=0.01)
        optimizer.step()
        optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
