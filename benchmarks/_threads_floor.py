"""The nanoGPT-style script's training on N plain threads of one process: no process group, no
DDP, no launch. The floor of any launcher that runs ranks as threads of one CPython process:
what the GIL alone costs the ranks' Python (benchmarks/launch_vs_torchrun.py runs it).

Each thread does what one rank of ``nanogpt_train.py --grad-accum 8`` does (its own model,
``8 / N`` micro-batches per step, AdamW) and prints the script's ``timing`` lines, so the
benchmark reads both alike. One intra-op thread, as torchrun gives each of several workers.

``--ddp``: the same threads run torch's DistributedDataParallel on the fake world (fakepg's
torch backend, per-rank generators), with the script's gradient accumulation, and still no
launch: the floor of the launch's own cost (what it adds to ranks on threads: per-rank
environment, output, imports, ``__main__``, the switch interval).

    python benchmarks/_threads_floor.py --nproc 2 --steps 30
    python benchmarks/_threads_floor.py --nproc 2 --steps 30 --ddp
"""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "scripts"))

from nanogpt_train import GPT, clocks, get_batch


def rank_main(
    rank: int, nproc: int, steps: int, barrier: threading.Barrier, *, ddp: bool = False
) -> None:
    # The process's intra-op thread count on this thread too, before its first op (as each
    # rank thread of fakepg's world does: see Note [Each rank computes with the process's
    # thread count] in fakepg.world); without it a new thread's oneDNN kernels use OpenMP's
    # default, one thread per core, and the ranks oversubscribe the cores.
    torch.get_num_threads()
    torch.manual_seed(1337 + rank)
    model: Any = GPT()
    if ddp:
        model = torch.nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    grad_accum = 8 // nproc
    x, y = get_batch(4)
    barrier.wait(timeout=60)  # every rank built: the steps start together, as after a broadcast
    for step in range(steps):
        for micro_step in range(grad_accum):
            if ddp:
                model.require_backward_grad_sync = micro_step == grad_accum - 1
            loss = model(x, y) / grad_accum
            x, y = get_batch(4)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sys.stdout.write(f"timing {rank} {step} {clocks()}\n")  # one write: whole lines
        sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--ddp", action="store_true", help="torch's DDP on the fake world")
    args = parser.parse_args()
    if 8 % args.nproc:
        raise SystemExit(f"--nproc {args.nproc}: must divide the 8 micro-batches of a step")
    torch.set_num_threads(1)
    barrier = threading.Barrier(args.nproc)
    if args.ddp:
        import fakepg

        fakepg.run_torch(
            lambda pg: rank_main(pg.rank(), args.nproc, args.steps, barrier, ddp=True),
            args.nproc,
        )
        return
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
