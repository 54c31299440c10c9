"""A small Accelerate training script, unmodified from what ``accelerate launch`` or torchrun
runs: ``Accelerator()``, ``prepare`` (model, optimizer, data loader), ``accelerator.backward``,
``gather`` of each rank's loss, ``save_state``. Every rank prints a checksum of its parameters
and rank 0 saves them (``--out``).

    torchrun --nproc-per-node 2 accelerate_train.py --out params.pt
    python -m reducer launch --nproc 2 accelerate_train.py --out params.pt
"""

from __future__ import annotations

import argparse
import hashlib

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument("--state-dir", default=None)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    loader = DataLoader(data, batch_size=4, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for step, (x, y) in enumerate(loader):
        if step == args.steps:
            break
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses = accelerator.gather(loss.detach().reshape(1))
        if accelerator.is_main_process:
            print(f"step {step}: losses {[round(v, 6) for v in losses.tolist()]}")
    if args.state_dir:
        accelerator.save_state(args.state_dir)
    raw = accelerator.unwrap_model(model)
    digest = hashlib.sha256()
    for p in raw.parameters():
        digest.update(p.detach().numpy().tobytes())
    index = accelerator.process_index
    print(f"rank {index} of {accelerator.num_processes}: params {digest.hexdigest()[:16]}")
    if accelerator.is_main_process and args.out:
        torch.save([p.detach() for p in raw.parameters()], args.out)
    accelerator.end_training()


if __name__ == "__main__":
    main()
