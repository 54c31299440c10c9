"""Activation checkpointing under DDP, the patterns of two open torch reports (#109191,
#121594), run as written with the wrapper's defaults:

- ``twice-reentrant``: one layer inside two reentrant checkpoints (it runs twice per
  forward), static_graph off;
- ``unused-reentrant``: reentrant checkpointing of a multi-task model with
  ``find_unused_parameters=True``, each rank training a different task head;
- ``unused-not-found``: the same model and tasks with reentrant checkpointing and
  ``find_unused_parameters=False`` (what a trainer picks when checkpointing is on);
- ``*-static``: the same with ``static_graph=True``, the workaround torch's error suggests;
- ``accumulate-nonreentrant``: non-reentrant checkpointing of each layer, with the
  micro-batches' forwards run first (the synced one first, the others under ``no_sync``) and
  their backwards after;
- ``accumulate-plain``: the same without checkpointing;
- ``fixed``: non-reentrant checkpointing, each micro-batch's forward then backward.
"""

import torch
from _common import batch, finish, parse, setup, wrap
from torch import nn
from torch.utils.checkpoint import checkpoint

VARIANTS = (
    "twice-reentrant",
    "twice-reentrant-static",
    "unused-reentrant",
    "unused-reentrant-static",
    "unused-not-found",
    "accumulate-nonreentrant",
    "accumulate-plain",
    "fixed",
)


class Net(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.variant = variant
        self.inp, self.shared = nn.Linear(4, 8), nn.Linear(8, 8)
        tasks = 2 if variant.startswith("unused-") else 1
        self.heads = nn.ModuleList([nn.Linear(8, 2) for _ in range(tasks)])

    def forward(self, x: torch.Tensor, task: int = 0) -> torch.Tensor:
        reentrant = "-reentrant" in self.variant or self.variant == "unused-not-found"
        h = torch.tanh(self.inp(x))
        if self.variant == "accumulate-plain":  # the same without checkpointing
            return self.heads[task](torch.tanh(self.shared(h)))
        h = checkpoint(self.shared, h, use_reentrant=reentrant)
        if self.variant.startswith("twice-"):
            h = checkpoint(self.shared, torch.tanh(h), use_reentrant=True)
        return checkpoint(self.heads[task], torch.tanh(h), use_reentrant=reentrant)


def main() -> None:
    args = parse(__doc__, variants=VARIANTS)
    rank, _ = setup()
    net = Net(args.variant)
    static = args.variant.endswith("-static")
    unused = args.variant == "unused-reentrant"
    ddp = wrap(net, args.ddp, find_unused_parameters=unused, static_graph=static)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(args.steps):
        if args.variant.startswith("accumulate-"):
            outputs = [ddp(batch(rank, step, 0))]
            with ddp.no_sync():
                outputs += [ddp(batch(rank, step, micro)) for micro in (1, 2)]
                for out in outputs[1:]:
                    out.square().mean().backward()
            outputs[0].square().mean().backward()
        else:
            task = rank % 2 if args.variant.startswith("unused-") else 0
            ddp(batch(rank, step), task=task).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    finish(net)


if __name__ == "__main__":
    main()
