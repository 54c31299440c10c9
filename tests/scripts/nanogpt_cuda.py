"""The nanoGPT-style training of nanogpt_train.py, written for GPUs as nanoGPT's train.py is:
each rank on ``cuda:LOCAL_RANK`` (``torch.cuda.set_device``, ``model.to(device)``, batches
pinned and moved with ``non_blocking=True``), ``DistributedDataParallel(model,
device_ids=[local_rank])``, and optionally autocast with a GradScaler (``--amp``).

    torchrun --nproc-per-node 2 nanogpt_cuda.py
    python -m reducer launch --nproc 2 nanogpt_cuda.py                # on a GPU machine
    python -m reducer launch --nproc 2 --cuda-as-cpu nanogpt_cuda.py  # on a laptop
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os

import torch
import torch.distributed as dist
from nanogpt_train import GPT, get_batch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="nccl")
    parser.add_argument("--ddp", choices=["torch", "reducer"], default="torch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    dist.init_process_group(backend=args.backend)
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])
    device = f"cuda:{local_rank}"
    torch.cuda.set_device(device)
    assert torch.cuda.is_available() and torch.cuda.current_device() == local_rank
    grad_accum = args.grad_accum // world_size
    torch.manual_seed(1337 + rank)

    raw = GPT().to(device)
    if args.ddp == "torch":
        model: nn.Module = nn.parallel.DistributedDataParallel(raw, device_ids=[local_rank])
    else:
        import reducer

        pg = reducer.TorchProcessGroup(dist.group.WORLD)  # type: ignore[arg-type]
        model = reducer.DistributedDataParallel(raw, pg)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-3, foreach=False)
    amp = torch.amp.autocast(device_type="cuda", dtype=torch.bfloat16)
    scaler = torch.amp.GradScaler("cuda", enabled=args.amp)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        x, y = get_batch(args.batch_size)
        return (
            x.pin_memory().to(device, non_blocking=True),
            y.pin_memory().to(device, non_blocking=True),
        )

    x, y = batch()
    for step in range(args.steps):
        for micro_step in range(grad_accum):
            model.require_backward_grad_sync = micro_step == grad_accum - 1
            with amp if args.amp else contextlib.nullcontext():
                loss = model(x, y) / grad_accum
            x, y = batch()
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if rank == 0:
            print(f"step {step}: loss {loss.item() * grad_accum:.4f}")
    digest = hashlib.sha256()
    for p in raw.parameters():
        digest.update(p.detach().cpu().numpy().tobytes())
    print(f"params {digest.hexdigest()[:16]} on {torch.cuda.get_device_name()}")
    if rank == 0 and args.out:
        torch.save([p.detach().cpu() for p in raw.parameters()], args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
