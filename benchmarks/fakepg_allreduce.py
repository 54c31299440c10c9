"""Collective times of the fake world against torch's threaded process group, and the floor.

For each collective, world size W and size S (float32), every rank issues the collective on
one tensor of S bytes: allreduce (in place), reduce_scatter (input S, output S / W:
``reduce_scatter_tensor``), all_to_all (input and output S: ``all_to_all_single``),
all_gather (input S / W, output S: ``all_gather_into_tensor``) and broadcast (S, in place,
from rank 0). In
the same run it measures torch's threaded group
(``torch.testing._internal.distributed.multi_threaded_pg``, backend "threaded") on the same
inputs, and the memory-bandwidth floor: one ``copy_`` that reads and writes as many bytes as
the collective must (allreduce, all_to_all and all_gather: W x S read and written;
reduce_scatter: W x S read, S written; broadcast: (W - 1) x S read and written, one copy per
receiving rank). For reduce_scatter, which reads W times what it writes, a second anchor
is one ``torch.sum`` over dim 0 of a (W, S) tensor, the same reads and writes as one torch op
(``x sum floor``).

The time is what a user's ranks wait: from the first rank's call to the last rank's return,
each rank reading the clock on its own thread, every rank's input refilled with random values
before each call (as a training step writes its gradients). Each cell is measured in
alternating blocks (the floor, the fake world, the threaded group, again), so that load that
comes and goes hits all alike. ``--explain`` adds the fake world timed the old way (the main
thread's clock between two barriers it shares with the ranks; inputs left zero) and each half
of that change alone.

    python benchmarks/fakepg_allreduce.py                 # W = 2, 8, 32; 4 KB, 4 MB, 64 MB
    python benchmarks/fakepg_allreduce.py --world-sizes 8 --sizes 64MB
    python benchmarks/fakepg_allreduce.py --collectives reduce_scatter,all_to_all
    python benchmarks/fakepg_allreduce.py --world-sizes 8 --sizes 64MB --explain --blocks 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import human_bytes, machine, median_ms, table

import fakepg


def parse_size(text: str) -> int:
    units = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "B": 1}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


# A rank's part of one timed call: (refill its inputs, issue the collective and wait for it).
Rank = tuple[Callable[[], None], Callable[[], None]]


def time_ranks(
    world_size: int, setup: Callable[[int], Rank], repeats: int, *, timing: str = "ranks"
) -> list[float]:
    """Seconds per call over ``repeats`` calls, each rank refilling its inputs first.

    ``timing="ranks"`` (what a user's ranks wait): from the first rank's call to the last
    rank's return, each rank reading the clock on its own thread around its own call.
    ``timing="main"`` (the old figure): from a barrier that the main thread and the ranks
    leave together to the barrier they meet at after the call, on the main thread's clock.
    """
    parties = world_size + (1 if timing == "main" else 0)
    start = threading.Barrier(parties)
    done = threading.Barrier(parties)
    calls = [[0.0] * world_size for _ in range(repeats)]
    returns = [[0.0] * world_size for _ in range(repeats)]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            refill, call = setup(rank)
            refill()
            call()  # warm up
            for i in range(repeats):
                refill()
                start.wait()
                calls[i][rank] = time.perf_counter()
                call()
                returns[i][rank] = time.perf_counter()
                done.wait()
        except BaseException as exc:
            errors.append(exc)
            start.abort()
            done.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    samples = []
    if timing == "main":
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
    if timing == "main":
        return samples
    return [max(r) - min(c) for c, r in zip(calls, returns, strict=True)]


# Per collective: (bytes each rank's output holds, relative to S; a fakepg call; a torch call).
COLLECTIVES = ("allreduce", "reduce_scatter", "all_to_all", "all_gather", "broadcast")


def _buffers(collective: str, world_size: int, numel: int) -> list[tuple[torch.Tensor, ...]]:
    """Per rank: (input,) for allreduce and broadcast (in place), (output, input) otherwise."""
    if collective in ("allreduce", "broadcast"):
        return [(torch.zeros(numel),) for _ in range(world_size)]
    if collective == "all_gather":
        return [(torch.zeros(numel), torch.zeros(numel // world_size)) for _ in range(world_size)]
    out_numel = numel // world_size if collective == "reduce_scatter" else numel
    return [(torch.zeros(out_numel), torch.zeros(numel)) for _ in range(world_size)]


def _refill(tensor: torch.Tensor, source: torch.Tensor | None) -> Callable[[], None]:
    """Write the rank's input before each call, as a training step writes its gradients:
    ``source``'s values (random; its first elements for a smaller input), or nothing with
    ``--inputs zeros`` (the old figure: zeros left in place, whose in-place sums stay zero)."""
    if source is None:
        return lambda: None
    values = source[: tensor.numel()]
    return lambda: tensor.copy_(values)


def bench_fakepg(
    collective: str,
    world_size: int,
    numel: int,
    repeats: int,
    *,
    timing: str,
    source: Tensor | None,
) -> list[float]:
    world = fakepg.World(world_size)
    buffers = _buffers(collective, world_size, numel)

    def setup(rank: int) -> Rank:
        pg = world.group(rank)
        mine = buffers[rank]
        refill = _refill(mine[-1], source)
        if collective == "allreduce":
            return refill, lambda: pg.allreduce([mine[0]]).wait()
        if collective == "reduce_scatter":
            return refill, lambda: pg.reduce_scatter_tensor(mine[0], mine[1]).wait()
        if collective == "all_gather":
            return refill, lambda: pg.allgather_into_tensor(mine[0], mine[1]).wait()
        if collective == "broadcast":
            return refill, lambda: pg.broadcast([mine[0]], 0).wait()
        return refill, lambda: pg.all_to_all_single(mine[0], mine[1]).wait()

    try:
        return time_ranks(world_size, setup, repeats, timing=timing)
    finally:
        world.close()


def bench_threaded(
    collective: str,
    world_size: int,
    numel: int,
    repeats: int,
    *,
    timing: str,
    source: Tensor | None,
) -> list[float]:
    import torch.distributed as dist
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    mtpg._install_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    store = dist.HashStore()
    buffers = _buffers(collective, world_size, numel)

    def setup(rank: int) -> Rank:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        mine = buffers[rank]
        refill = _refill(mine[-1], source)
        if collective == "allreduce":
            return refill, lambda: dist.all_reduce(mine[0])
        if collective == "reduce_scatter":
            return refill, lambda: dist.reduce_scatter_tensor(mine[0], mine[1])
        if collective == "all_gather":
            return refill, lambda: dist.all_gather_into_tensor(mine[0], mine[1])
        if collective == "broadcast":
            return refill, lambda: dist.broadcast(mine[0], 0)
        return refill, lambda: dist.all_to_all_single(mine[0], mine[1])

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # reduce_scatter_tensor's new name
            return time_ranks(world_size, setup, repeats, timing=timing)
    finally:
        mtpg.ProcessLocalGroup.reset()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        mtpg._uninstall_threaded_pg()


def moved_bytes(collective: str, world_size: int, nbytes: int) -> int:
    """Bytes the collective must read and write, over all ranks."""
    if collective == "reduce_scatter":
        return world_size * nbytes + nbytes  # every input read once, W outputs of S / W
    if collective == "broadcast":
        return 2 * (world_size - 1) * nbytes  # the root's tensor copied into W - 1 others
    return 2 * world_size * nbytes  # every input read once, every output written once


def bench_floor(nbytes: int, repeats: int) -> list[float]:
    """One copy_ that reads and writes ``nbytes`` in all (``nbytes / 2`` each way)."""
    src = torch.rand(nbytes // 8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(max(repeats, 5)):
        t0 = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - t0)
    return samples


# The fake world timed the other ways, with --explain: (column, timing, zero inputs).
OTHER_WAYS = (
    ("ranks, zeros", "ranks", True),
    ("main, refilled", "main", False),
    ("main, zeros (old)", "main", True),
)


def bench_sum_floor(world_size: int, numel: int, repeats: int) -> list[float]:
    """One ``torch.sum`` over dim 0 of a (W, S) tensor: what reduce_scatter must read and write
    (W x S read, S written), as one torch op; a copy_ of the same total bytes reads less."""
    src = torch.rand(world_size, numel)
    out = torch.empty(numel)
    torch.sum(src, dim=0, out=out)
    samples = []
    for _ in range(max(repeats, 5)):
        t0 = time.perf_counter()
        torch.sum(src, dim=0, out=out)
        samples.append(time.perf_counter() - t0)
    return samples


def measure_cell(
    collective: str, world_size: int, numel: int, repeats: int, args: argparse.Namespace
) -> dict[str, float]:
    """Median ms of each measurement of one cell, and each x floor, over ``args.blocks``
    alternating blocks (floor, fakepg, threaded, the other ways, then again), so that load
    that comes and goes on the machine hits all alike. ``x floor`` is the median over
    blocks of the block's fakepg median over its floor median."""
    moved = moved_bytes(collective, world_size, numel * 4)
    source = torch.rand(numel)
    samples: dict[str, list[float]] = {"floor": [], "fakepg": [], "threaded": [], "sum": []}
    ratios: dict[str, list[float]] = {"fakepg": [], "sum": []}
    for label, _, _ in OTHER_WAYS:
        samples[label], ratios[label] = [], []
    for _ in range(args.blocks):
        floor = statistics.median(bench_floor(moved, repeats))
        samples["floor"].append(floor)
        ours = bench_fakepg(collective, world_size, numel, repeats, timing="ranks", source=source)
        samples["fakepg"] += ours
        ratios["fakepg"].append(statistics.median(ours) / floor)
        if collective == "reduce_scatter":
            reduction = statistics.median(bench_sum_floor(world_size, numel, repeats))
            samples["sum"].append(reduction)
            ratios["sum"].append(statistics.median(ours) / reduction)
        if not args.skip_threaded:
            samples["threaded"] += bench_threaded(
                collective, world_size, numel, max(3, repeats // 2), timing="ranks", source=source
            )
        if args.explain:
            for label, timing, zeros in OTHER_WAYS:
                other = bench_fakepg(
                    collective,
                    world_size,
                    numel,
                    repeats,
                    timing=timing,
                    source=None if zeros else source,
                )
                samples[label] += other
                ratios[label].append(statistics.median(other) / floor)
    result = {k: median_ms(v) if v else float("nan") for k, v in samples.items()}
    for label, values in ratios.items():
        result[f"{label} x floor"] = statistics.median(values) if values else float("nan")
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", default="2,8,32", help="comma-separated (default 2,8,32)")
    parser.add_argument("--sizes", default="4KB,4MB,64MB", help="per-rank bytes, float32")
    parser.add_argument(
        "--collectives", default=",".join(COLLECTIVES), help=f"any of {', '.join(COLLECTIVES)}"
    )
    parser.add_argument("--repeats", type=int, default=0, help="samples per block (0: by size)")
    parser.add_argument("--blocks", type=int, default=3, help="alternating blocks per cell")
    parser.add_argument("--skip-threaded", action="store_true", help="no torch threaded anchor")
    parser.add_argument(
        "--explain",
        action="store_true",
        help="also time the fake world the old way (main-thread barrier, zero inputs) and "
        "each half of it, in the same blocks",
    )
    args = parser.parse_args(argv)
    collectives = args.collectives.split(",")
    unknown = set(collectives) - set(COLLECTIVES)
    if unknown:
        parser.error(f"unknown collectives {sorted(unknown)}; choose from {COLLECTIVES}")

    print(f"# fakepg collectives, float32, SUM\n# machine: {machine()}\n")
    headers = [
        "collective", "W", "size", "fakepg ms", "threaded ms", "speedup", "floor ms", "x floor",
        "GB/s", "x sum floor",
    ]  # fmt: skip
    if args.explain:
        for label, _, _ in OTHER_WAYS:
            headers += [f"{label} ms", "x floor"]
    rows = []
    for collective in collectives:
        for world_size in [int(w) for w in args.world_sizes.split(",")]:
            for nbytes in [parse_size(s) for s in args.sizes.split(",")]:
                numel = nbytes // 4 // world_size * world_size  # W equal chunks
                nbytes = numel * 4
                repeats = args.repeats or (
                    5 if nbytes >= 32 << 20 else 11 if nbytes >= 1 << 20 else 51
                )
                cell = measure_cell(collective, world_size, numel, repeats, args)
                moved = moved_bytes(collective, world_size, nbytes)
                ours, theirs = cell["fakepg"], cell["threaded"]
                row: list[object] = [
                    collective,
                    world_size,
                    human_bytes(nbytes),
                    ours,
                    theirs,
                    theirs / ours,
                    cell["floor"],
                    cell["fakepg x floor"],
                    moved / ours / 1e6,
                    cell["sum x floor"] if collective == "reduce_scatter" else "",
                ]
                if args.explain:
                    for label, _, _ in OTHER_WAYS:
                        row += [cell[label], cell[f"{label} x floor"]]
                rows.append(row)
                print(table(headers, rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(table(headers, rows))
    print("\nTimed as the ranks wait: from the first rank's call to the last rank's return, each")
    print("rank's input refilled (random values) before each call. speedup = threaded / fakepg;")
    print("x floor = fakepg / one copy_ moving the bytes the collective must read and write")
    print(f"(median over {args.blocks} alternating blocks of the per-block ratio); GB/s = those")
    print("bytes per second; x sum floor (reduce_scatter) = fakepg / one torch.sum reading W x S")
    print("and writing S, as reduce_scatter does (a copy_ of as many bytes reads fewer).")
    print("--explain: 'main' = the old clock, a barrier with the main thread;")
    print("'zeros' = inputs left zero, not refilled.")


if __name__ == "__main__":
    main()
