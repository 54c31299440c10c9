"""A Lightning module trained with ``strategy="ddp"`` (Lightning puts a DistributedSampler in
the DataLoader and calls its set_epoch). Correct as it is; ``--summed`` returns a summed loss
and ``--no-distributed-sampler`` keeps the DataLoader's own shuffling sampler (the mistakes)."""

import argparse
import os

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Module(L.LightningModule):
    def __init__(self, reduction: str) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        self.reduction = reduction

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y, reduction=self.reduction)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--summed", action="store_true")
    parser.add_argument("--no-distributed-sampler", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(48, 8, generator=g), torch.arange(48) % 4)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("WORLD_SIZE", 1)),
        strategy="ddp",
        max_epochs=2,
        use_distributed_sampler=not args.no_distributed_sampler,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Module("sum" if args.summed else "mean")
    trainer.fit(module, DataLoader(data, batch_size=4, shuffle=True))


if __name__ == "__main__":
    main()
