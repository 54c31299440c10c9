"""``reducer.tools.launch.run_function``: a function, not a script, on a launch's rank threads.

What torch's DDP suite on the fake world (benchmarks/_torch_suite_fake.py) relies on: each
rank sees its own environment and joins the world through ``init_process_group`` of any
backend, and ``sys.exit``, ``os._exit`` and exceptions end one rank each, with the exit code
torchrun would report for it; the process is as it was afterwards.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
import torch.distributed as dist

import fakepg
from reducer.tools.launch import run_function


def test_each_rank_joins_the_world_with_its_own_environment() -> None:
    seen: dict[int, tuple[str, str, int, float]] = {}
    lock = threading.Lock()

    def rank_main(rank: int) -> None:
        dist.init_process_group("gloo")  # any backend joins the fake world
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)
        with lock:
            seen[rank] = (
                os.environ["RANK"],
                os.environ["WORLD_SIZE"],
                dist.get_rank(),
                total.item(),
            )
        dist.destroy_process_group()

    before = dict(os.environ)
    with fakepg.World(2, timeout=20.0) as world:
        assert run_function(rank_main, world) == [0, 0]
    assert seen == {0: ("0", "2", 0, 3.0), 1: ("1", "2", 1, 3.0)}
    assert dict(os.environ) == before  # the ranks' variables were theirs only
    assert not dist.is_initialized()


def test_environ_gives_the_variables_each_rank_sees() -> None:
    seen: dict[int, tuple[str | None, str | None]] = {}

    def rank_main(rank: int) -> None:
        seen[rank] = (os.environ.get("RANK"), os.environ.get("MINE"))

    def variables(rank: int, world_size: int) -> dict[str, str]:
        return {"MINE": f"{rank} of {world_size}"}

    with fakepg.World(2, timeout=20.0) as world:
        assert run_function(rank_main, world, environ=variables) == [0, 0]
    # No torchrun variables unless environ gives them (RANK is not in this process's).
    assert "RANK" not in os.environ
    assert seen == {0: (None, "0 of 2"), 1: (None, "1 of 2")}


@pytest.mark.parametrize(
    ("end", "codes"),
    [
        (lambda: sys.exit(5), [0, 5]),
        (lambda: sys.exit(0), [0, 0]),
        (lambda: os._exit(3), [0, 3]),
        (lambda: 1 / 0, [0, 1]),
    ],
    ids=["sys.exit(5)", "sys.exit(0)", "os._exit(3)", "an exception"],
)
def test_how_rank_1_ends_is_its_exit_code(end: object, codes: list[int]) -> None:
    def rank_main(rank: int) -> None:
        if rank == 1:
            end()  # type: ignore[operator]

    with fakepg.World(2, timeout=20.0) as world:
        assert run_function(rank_main, world, name="ends.py") == codes


def test_a_failed_rank_wakes_the_rank_that_waits_for_it() -> None:
    def rank_main(rank: int) -> None:
        dist.init_process_group("gloo")
        if rank == 1:
            sys.exit(10)  # as torch's test scaffolding exits a failed test
        dist.all_reduce(torch.ones(1))  # never matched: rank 1 is gone

    with fakepg.World(2, timeout=60.0) as world:
        codes = run_function(rank_main, world)
    # Rank 0 fails at once (its collective can never complete), not after the 60 s timeout.
    assert codes == [1, 10]


def test_refuses_what_is_not_callable() -> None:
    with fakepg.World(2, timeout=20.0) as world, pytest.raises(ValueError, match="callable"):
        run_function("not a function", world)  # type: ignore[arg-type]
