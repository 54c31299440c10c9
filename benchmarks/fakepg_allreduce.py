"""Collective times of the fake world against torch's threaded process group, and the floor.

For each collective, world size W and size S (float32), every rank issues the collective on
one tensor of S bytes: allreduce (in place), reduce_scatter (input S, output S / W:
``reduce_scatter_tensor``) and all_to_all (input and output S: ``all_to_all_single``). The
time is from a common start (a thread barrier) until the slowest rank's wait returns, median
over repeats. In the same run it measures torch's threaded group
(``torch.testing._internal.distributed.multi_threaded_pg``, backend "threaded") on the same
inputs, and the memory-bandwidth floor: one ``copy_`` that reads and writes as many bytes as
the collective must (allreduce and all_to_all: W x S read and written; reduce_scatter: W x S
read, S written).

    python benchmarks/fakepg_allreduce.py                 # W = 2, 8, 32; 4 KB, 4 MB, 64 MB
    python benchmarks/fakepg_allreduce.py --world-sizes 8 --sizes 64MB
    python benchmarks/fakepg_allreduce.py --collectives reduce_scatter,all_to_all
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import human_bytes, machine, median_ms, table

import fakepg


def parse_size(text: str) -> int:
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "B": 1}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def time_ranks(world_size: int, setup: Callable[[int], Callable[[], None]], repeats: int) -> float:
    """Median seconds for all ranks to finish one call, started together, over ``repeats``."""
    start = threading.Barrier(world_size + 1)
    done = threading.Barrier(world_size + 1)
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            step = setup(rank)
            step()  # warm up
            for _ in range(repeats):
                start.wait()
                step()
                done.wait()
        except BaseException as exc:
            errors.append(exc)
            start.abort()
            done.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    samples = []
    try:
        for _ in range(repeats):
            start.wait()
            t0 = time.perf_counter()
            done.wait()
            samples.append(time.perf_counter() - t0)
    except threading.BrokenBarrierError:
        pass
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return median_ms(samples) / 1e3


# Per collective: (bytes each rank's output holds, relative to S; a fakepg call; a torch call).
COLLECTIVES = ("allreduce", "reduce_scatter", "all_to_all")


def _buffers(collective: str, world_size: int, numel: int) -> list[tuple[torch.Tensor, ...]]:
    """Per rank: (input,) for allreduce, (output, input) otherwise.

    Zeros: repeated in-place sums stay finite (rand would overflow to inf after a few rounds at
    W=32); adding zeros costs the same as adding any other floats.
    """
    if collective == "allreduce":
        return [(torch.zeros(numel),) for _ in range(world_size)]
    out_numel = numel // world_size if collective == "reduce_scatter" else numel
    return [(torch.zeros(out_numel), torch.zeros(numel)) for _ in range(world_size)]


def bench_fakepg(collective: str, world_size: int, numel: int, repeats: int) -> float:
    world = fakepg.World(world_size)
    buffers = _buffers(collective, world_size, numel)

    def setup(rank: int) -> Callable[[], None]:
        pg = world.group(rank)
        mine = buffers[rank]
        if collective == "allreduce":
            return lambda: pg.allreduce([mine[0]]).wait()
        if collective == "reduce_scatter":
            return lambda: pg.reduce_scatter_tensor(mine[0], mine[1]).wait()
        return lambda: pg.all_to_all_single(mine[0], mine[1]).wait()

    try:
        return time_ranks(world_size, setup, repeats)
    finally:
        world.close()


def bench_threaded(collective: str, world_size: int, numel: int, repeats: int) -> float:
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    mtpg._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store = dist.HashStore()
    buffers = _buffers(collective, world_size, numel)

    def setup(rank: int) -> Callable[[], None]:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        mine = buffers[rank]
        if collective == "allreduce":
            return lambda: dist.all_reduce(mine[0])
        if collective == "reduce_scatter":
            return lambda: dist.reduce_scatter_tensor(mine[0], mine[1])
        return lambda: dist.all_to_all_single(mine[0], mine[1])

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # reduce_scatter_tensor's new name
            return time_ranks(world_size, setup, repeats)
    finally:
        mtpg.ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        mtpg._uninstall_threaded_pg()


def moved_bytes(collective: str, world_size: int, nbytes: int) -> int:
    """Bytes the collective must read and write, over all ranks."""
    if collective == "reduce_scatter":
        return world_size * nbytes + nbytes  # every input read once, W outputs of S / W
    return 2 * world_size * nbytes  # every input read once, every output written once


def bench_floor(nbytes: int, repeats: int) -> float:
    """One copy_ that reads and writes ``nbytes`` in all (``nbytes / 2`` each way)."""
    src = torch.rand(nbytes // 8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(max(repeats, 5)):
        t0 = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - t0)
    return median_ms(samples) / 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2,8,32", help="comma-separated (default 2,8,32)")
    parser.add_argument("--sizes", default="4KB,4MB,64MB", help="per-rank bytes, float32")
    parser.add_argument(
        "--collectives", default=",".join(COLLECTIVES), help=f"any of {', '.join(COLLECTIVES)}"
    )
    parser.add_argument("--repeats", type=int, default=0, help="samples per cell (0: by size)")
    parser.add_argument("--skip-threaded", action="store_true", help="no torch threaded anchor")
    args = parser.parse_args(argv)
    collectives = args.collectives.split(",")
    unknown = set(collectives) - set(COLLECTIVES)
    if unknown:
        parser.error(f"unknown collectives {sorted(unknown)}; choose from {COLLECTIVES}")

    print(f"# fakepg collectives, float32, SUM\n# machine: {machine()}\n")
    headers = [
        "collective", "W", "size", "fakepg ms", "threaded ms", "speedup", "floor ms", "x floor",
        "GB/s",
    ]  # fmt: skip
    rows = []
    for collective in collectives:
        for world_size in [int(w) for w in args.world_sizes.split(",")]:
            for nbytes in [parse_size(s) for s in args.sizes.split(",")]:
                numel = nbytes // 4 // world_size * world_size  # W equal chunks
                nbytes = numel * 4
                repeats = args.repeats or (
                    5 if nbytes >= 32 << 20 else 11 if nbytes >= 1 << 20 else 51
                )
                ours = bench_fakepg(collective, world_size, numel, repeats)
                theirs = (
                    float("nan")
                    if args.skip_threaded
                    else bench_threaded(collective, world_size, numel, max(3, repeats // 2))
                )
                moved = moved_bytes(collective, world_size, nbytes)
                floor = bench_floor(moved, repeats)
                rows.append(
                    [
                        collective,
                        world_size,
                        human_bytes(nbytes),
                        ours * 1e3,
                        theirs * 1e3,
                        theirs / ours,
                        floor * 1e3,
                        ours / floor,
                        moved / ours / 1e9,
                    ]
                )
                print(table(headers, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(headers, rows))
    print("\nspeedup = threaded / fakepg; x floor = fakepg / one copy_ moving the bytes the")
    print("collective must read and write; GB/s = those bytes per second.")


if __name__ == "__main__":
    main()
