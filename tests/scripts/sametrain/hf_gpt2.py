"""An HF transformers model (a tiny GPT-2, built from its config: no download) trained with
DDP: ``model(input_ids=x, labels=x).loss``. Correct as it is; ``--one-seed`` seeds every rank
alike after building the model (the same dropout masks on every rank: the mistake)."""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--one-seed", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
    model = GPT2LMHeadModel(config)
    torch.manual_seed(100 if args.one_seed else 100 + rank)
    ddp = DistributedDataParallel(model)
    data = TensorDataset(torch.randint(0, 64, (32, 8), generator=torch.Generator().manual_seed(0)))
    sampler = DistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for (x,) in loader:
            ddp(input_ids=x, labels=x).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
