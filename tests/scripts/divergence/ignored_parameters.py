"""Clean: a parameter the wrapper is told to leave alone
(``_set_params_and_buffers_to_ignore_for_model``): it is neither broadcast nor reduced, so it
starts and stays different per rank by design (a per-rank embedding, say), and the script
steps it with the others. The check leaves it alone too."""

import torch
from _common import batch, parse, setup, wrap
from torch import nn


class Scale(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((2,), 1.0 + rank))  # differs per rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class WithOwnScale(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 2)
        # In a submodule: torch's DDP does not find an ignored name of the root module's own
        # parameters when it builds its reducer (it looks for ".scale").
        self.own = Scale(rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.own(self.body(x))


def main() -> None:
    args = parse(__doc__, variants=("clean",))
    rank, _ = setup()
    net = WithOwnScale(rank)
    kind = torch.nn.parallel.DistributedDataParallel
    kind._set_params_and_buffers_to_ignore_for_model(net, ["own.scale"])
    ddp = wrap(net, args.ddp)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(args.steps):
        ddp(batch(rank, step)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"param sum {sum(float(p.detach().double().sum()) for p in net.body.parameters()):.17g}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
