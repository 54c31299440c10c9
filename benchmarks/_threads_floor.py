"""The nanoGPT-style script's training on N plain threads of one process: no process group, no
DDP, no launch. The floor of any launcher that runs ranks as threads of one CPython process:
what the GIL alone costs the ranks' Python (benchmarks/launch_vs_torchrun.py runs it).

Each thread does what one rank of ``nanogpt_train.py --grad-accum 8`` does (its own model,
``8 / N`` micro-batches per step, AdamW) and prints the script's ``timing`` lines, so the
benchmark reads both alike. One intra-op thread, as torchrun gives each of several workers.

    python benchmarks/_threads_floor.py --nproc 2 --steps 30
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "scripts"))

from nanogpt_train import GPT, clocks, get_batch


def rank_main(rank: int, nproc: int, steps: int, barrier: threading.Barrier) -> None:
    torch.manual_seed(1337 + rank)
    model = GPT()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    grad_accum = 8 // nproc
    x, y = get_batch(4)
    barrier.wait(timeout=60)  # every rank built: the steps start together, as after a broadcast
    for step in range(steps):
        for _ in range(grad_accum):
            loss = model(x, y) / grad_accum
            x, y = get_batch(4)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"timing {rank} {step} {clocks()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    if 8 % args.nproc:
        raise SystemExit(f"--nproc {args.nproc}: must divide the 8 micro-batches of a step")
    torch.set_num_threads(1)
    barrier = threading.Barrier(args.nproc)
    threads = [
        threading.Thread(target=rank_main, args=(rank, args.nproc, args.steps, barrier))
        for rank in range(args.nproc)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


if __name__ == "__main__":
    main()
