"""A nanoGPT-style training script, as torchrun runs it (python -m reducer launch runs it too).

The shape of nanoGPT's train.py: DDP is on when RANK is set; init_process_group(backend);
the seed is offset by rank (so is the model's init: DDP broadcasts rank 0's); batches drawn
with torch.randint from the global generator; gradient accumulation by setting
``require_backward_grad_sync`` on the last micro-step only; AdamW. At the end every rank prints
a checksum of its parameters and rank 0 saves them (``--out``).

    torchrun --nproc-per-node 2 nanogpt_train.py --backend gloo
    python -m reducer launch --nproc 2 nanogpt_train.py --backend nccl --ddp reducer
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import threading
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

VOCAB, WIDTH, HEADS, BLOCK = 48, 32, 2, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.fc, self.out = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (
            z.view(b, t, HEADS, c // HEADS).transpose(1, 2)
            for z in self.qkv(self.ln1(x)).split(c, dim=2)
        )
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // HEADS)
        att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, WIDTH), nn.Embedding(BLOCK, WIDTH)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.ln_f, self.lm_head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


DATA = torch.arange(4096) * 7 % VOCAB  # a fixed token stream


def get_batch(batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    ix = torch.randint(len(DATA) - BLOCK, (batch_size,))
    x = torch.stack([DATA[i : i + BLOCK] for i in ix])
    y = torch.stack([DATA[i + 1 : i + 1 + BLOCK] for i in ix])
    return x, y


def checksum(model: nn.Module) -> str:
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    return digest.hexdigest()[:16]


def clocks() -> str:
    """This thread's wall clock, CPU time and time spent runnable but waiting for a CPU (the
    second field of Linux's schedstat; 0 elsewhere), in seconds: benchmarks/
    launch_vs_torchrun.py reads them per step."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as stats:
            runqueue = int(stats.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        runqueue = 0.0
    return f"{time.perf_counter():.6f} {time.thread_time():.6f} {runqueue:.6f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--ddp", choices=["torch", "reducer"], default="torch")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", default=None)
    parser.add_argument("--timing", action="store_true", help="print each step's clocks")
    args = parser.parse_args()

    ddp = int(os.environ.get("RANK", -1)) != -1
    grad_accum = args.grad_accum
    if ddp:
        dist.init_process_group(backend=args.backend)
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        assert grad_accum % world_size == 0
        grad_accum //= world_size
    else:
        rank, world_size = 0, 1
    master = rank == 0
    torch.manual_seed(1337 + rank)

    model = GPT()
    raw = model
    if ddp and args.ddp == "torch":
        model = nn.parallel.DistributedDataParallel(model)
    elif ddp:
        import reducer

        pg = reducer.TorchProcessGroup(dist.group.WORLD)  # type: ignore[arg-type]
        model = reducer.DistributedDataParallel(model, pg)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-3, foreach=False)

    x, y = get_batch(args.batch_size)
    for step in range(args.steps):
        for micro_step in range(grad_accum):
            if ddp:
                model.require_backward_grad_sync = micro_step == grad_accum - 1
            loss = model(x, y) / grad_accum
            x, y = get_batch(args.batch_size)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.timing:
            print(f"timing {rank} {step} {clocks()}")
        if master:
            print(f"step {step}: loss {loss.item() * grad_accum:.4f}")
    print(f"params {checksum(raw)}")
    if master and args.out:
        torch.save([p.detach() for p in raw.parameters()], args.out)
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
