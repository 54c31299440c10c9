"""A training script whose ranks start child processes, as torchrun runs it (and the launch).

Each ``--case`` is one way a rank starts children: DataLoader workers in each start method
(with persistent workers, pinned memory, a ``worker_init_fn`` that reads the rank from the
environment, a prefetch factor), a preprocessing ``multiprocessing.Pool`` or
``ProcessPoolExecutor``, and children that end with ``os._exit`` or ``sys.exit``. Every case
trains a small DDP model on what the children made, and each rank saves what it saw (the
batches, what the children read from their environment, their exit codes) and the parameters to
``--out``/<case>-rank<r>.pt: a launch and torchrun on gloo give the same files, bit for bit.

    torchrun --nproc-per-node 2 child_processes.py --case all --out /tmp/ref
    python -m reducer launch --nproc 2 child_processes.py --case dl-fork --out /tmp/launch

``--case collective``: a forked child tries an all_reduce and reports what it got (not part of
``all``: under torchrun such a child hangs or breaks the group's connections).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import random
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, get_worker_info

CASES = (
    "dl-fork",
    "dl-fork-persistent",
    "dl-spawn",
    "dl-forkserver",
    "pool-fork",
    "pool-spawn",
    "executor-forkserver",
    "executor-fork",
    "exits",
)


def environment() -> tuple[int, int, int]:
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Random samples drawn in the worker (from the generator DataLoader seeds there), shifted
    by what the worker's ``worker_init_fn`` read from its environment."""

    def __init__(self) -> None:
        self.shift = 0.0

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(8) + self.shift + index
        y = torch.tensor([random.random(), float(os.environ["RANK"])])
        return x, y


def init_worker(worker_id: int) -> None:
    rank, local_rank, world_size = environment()
    info = get_worker_info()
    assert info is not None and info.id == worker_id
    info.dataset.shift = 100.0 * rank + 10.0 * local_rank + world_size + worker_id  # type: ignore[attr-defined]


def preprocess(seed: int) -> tuple[list[float], int, int, int, bool]:
    """A pool's work: samples from a generator of the task's own, and the child's environment."""
    generator = torch.Generator().manual_seed(seed)
    rank, local_rank, world_size = environment()
    values = (torch.randn(8, generator=generator) + rank).tolist()
    return values, rank, local_rank, world_size, os.getpid() != int(os.environ["PARENT_PID"])


def end_with_os_exit() -> None:
    sys.stdout.flush()
    os._exit(3)


def end_with_sys_exit() -> None:
    sys.exit(4)


def try_a_collective(connection: Any) -> None:
    try:
        dist.all_reduce(torch.ones(1))
    except Exception as exc:  # what the child got is the result
        connection.send(f"{type(exc).__name__}: {exc}")
    else:
        connection.send("no error")
    connection.close()


def loader(context: str, *, persistent: bool = False) -> DataLoader[Any]:
    return DataLoader(
        Samples(),
        batch_size=4,
        shuffle=True,
        num_workers=2,
        multiprocessing_context=context,
        worker_init_fn=init_worker,
        persistent_workers=persistent,
        pin_memory=True,
        prefetch_factor=3,
    )


def batches(case: str, rank: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The inputs of the training steps for ``case``, and what else the children reported."""
    seen: dict[str, Any] = {}
    if case.startswith("dl-"):
        context = case.split("-")[1]
        data = loader(context, persistent=case.endswith("persistent"))
        inputs = []
        for _ in range(2 if case.endswith("persistent") else 1):  # epochs
            for x, y in data:
                inputs.append(x)
                seen.setdefault("y", []).append(y)
        return inputs, seen
    if case.startswith(("pool-", "executor-")):
        kind, context = case.split("-")
        ctx = multiprocessing.get_context(context)
        seeds = [1000 * rank + i for i in range(4)]
        if kind == "pool":
            with ctx.Pool(2) as pool:
                results = pool.map(preprocess, seeds)
        else:
            with concurrent.futures.ProcessPoolExecutor(2, mp_context=ctx) as executor:
                results = list(executor.map(preprocess, seeds))
        seen["children"] = [r[1:] for r in results]
        return [torch.tensor([r[0] for r in results])], seen
    if case == "exits":
        codes = []
        for context, target in (
            ("fork", end_with_os_exit),
            ("fork", end_with_sys_exit),
            ("spawn", end_with_os_exit),
            ("forkserver", end_with_sys_exit),
        ):
            process = multiprocessing.get_context(context).Process(target=target)
            process.start()
            process.join()
            codes.append(process.exitcode)
        pid = os.fork()
        if pid == 0:
            os._exit(5)
        _, status = os.waitpid(pid, 0)
        codes.append(os.waitstatus_to_exitcode(status))
        seen["codes"] = codes
        return [torch.full((4, 8), float(sum(codes)))], seen
    if case == "collective":
        parent, child = multiprocessing.get_context("fork").Pipe()
        process = multiprocessing.get_context("fork").Process(
            target=try_a_collective, args=(child,)
        )
        process.start()
        seen["child"] = parent.recv()
        process.join()
        seen["exitcode"] = process.exitcode
        print(f"child: {seen['child']}")
        print(f"child exit code: {seen['exitcode']}")
        return [torch.ones(4, 8)], seen
    raise ValueError(f"--case {case}: one of {', '.join(CASES)}, all or collective")


def train(case: str, out: Path) -> None:
    rank, _, world_size = environment()
    torch.manual_seed(1234 + rank)
    random.seed(rank)
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    inputs, seen = batches(case, rank)
    for x in inputs:
        optimizer.zero_grad()
        model(x.reshape(-1, 8)).square().mean().backward()
        optimizer.step()
    params = [p.detach().clone() for p in model.parameters()]
    torch.save({"inputs": inputs, "seen": seen, "params": params}, out / f"{case}-rank{rank}.pt")
    print(f"{case}: done on rank {rank} of {world_size}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", default="all")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    os.environ["PARENT_PID"] = str(os.getpid())
    dist.init_process_group("gloo")
    args.out.mkdir(parents=True, exist_ok=True)
    for case in CASES if args.case == "all" else args.case.split(","):
        train(case, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
