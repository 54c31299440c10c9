"""Callbacks run in their rank: a future's callback and a comm hook's then() see the rank's
torch.distributed state and random generator, as on a gloo process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fakepg
from reducer.testing import TrainingScenario, check_comm_hook


def test_a_futures_callback_sees_its_ranks_group_and_generator() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> tuple[int, int, int, bool, float]:
        torch.manual_seed(pg.rank())
        expected = torch.rand(1).item()
        torch.manual_seed(pg.rank())
        seen: list[tuple[int, int, int, bool, float]] = []

        def callback(_f: object) -> None:
            t = torch.ones(1)
            dist.all_reduce(t)  # a collective of the rank's default group, from its callback
            seen.append(
                (
                    dist.get_rank(),
                    dist.get_world_size(),
                    int(t.item()),
                    dist.group.WORLD is not None,
                    torch.rand(1).item(),
                )
            )

        work = dist.all_reduce(torch.ones(1), async_op=True)
        assert work is not None
        work.get_future().then(callback).wait()
        assert seen[0][4] == expected  # the rank's own stream
        return seen[0]

    out = fakepg.run_torch(fn, 3)
    assert [o[:4] for o in out] == [(r, 3, 3, True) for r in range(3)]


def world_size_in_then_hook(state, bucket):  # type: ignore[no-untyped-def]
    fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(dist.get_world_size()))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))


@pytest.mark.parametrize("schedule", [None, fakepg.Schedule(), fakepg.Schedule(adversarial=True)])
def test_a_comm_hooks_then_callback_sees_its_ranks_world_size(
    schedule: fakepg.Schedule | None,
) -> None:
    g = torch.Generator().manual_seed(1)
    inputs = tuple(tuple((torch.randn(2, 4, generator=g),) for _ in range(2)) for _ in range(2))
    check_comm_hook(world_size_in_then_hook, TrainingScenario(_model, inputs), schedule=schedule)


def test_a_state_lent_to_the_thread_that_installed_the_proxy_is_the_one_it_sees() -> None:
    # A thread kept between worlds may be the one that installed the per-thread proxy of
    # torch.distributed's state (its own state is then the process's original) and later run
    # a rank's callbacks: the lent state must win there too.
    from fakepg.torch_backend import _PerThreadWorlds

    original, lent = object(), object()
    proxy = _PerThreadWorlds(original)  # installed by this thread: it is the owner
    assert proxy._current() is original
    with proxy.lent(lent):
        assert proxy._current() is lent
    assert proxy._current() is original


def test_a_later_thread_with_the_installers_ident_gets_a_state_of_its_own() -> None:
    # Thread idents are reused once a thread has ended (glibc recycles the stacks): a later
    # thread with the installer's ident must get its own state, not the process's original.
    import threading

    from fakepg.torch_backend import _PerThreadWorlds

    original = object()
    made: dict[str, Any] = {}

    def install() -> None:
        made["proxy"] = _PerThreadWorlds(original)
        made["ident"] = threading.get_ident()

    installer = threading.Thread(target=install)
    installer.start()
    installer.join()
    proxy = made["proxy"]
    seen: list[tuple[int, Any]] = []

    def look() -> None:
        seen.append((threading.get_ident(), proxy._current()))

    for _ in range(20):  # until the ident comes back, most often at once
        later = threading.Thread(target=look)
        later.start()
        later.join()
        if seen[-1][0] == made["ident"]:
            break
    assert all(state is not original for _, state in seen)


def test_a_proxy_installed_on_a_thread_kept_between_worlds_leaves_the_original_to_main() -> None:
    # The first init_torch_group of a process may run on a rank's thread, a cached one that
    # later runs other worlds' jobs: it must not keep the original state (a job's groups left
    # there would be seen by every later job on that thread).
    import threading

    from fakepg import _threads
    from fakepg.torch_backend import _PerThreadWorlds

    original = object()
    made: dict[str, Any] = {}

    def install() -> None:
        proxy = made["proxy"] = _PerThreadWorlds(original)
        made["state"] = proxy._current()

    job = _threads.Job(target=install, name="installs the proxy")
    job.start()
    job.join(timeout=30)
    proxy = made["proxy"]
    assert proxy._owner is threading.main_thread()
    assert made["state"] is not original
    assert proxy._current() is original  # this test runs on the main thread


_LEFT_BEHIND = """
import torch.distributed as dist
import fakepg

def job(world, destroy):
    def rank_main(pg):
        fakepg.init_torch_group(world, pg.rank())
        seen = (dist.get_rank(), dist.get_world_size())
        if destroy:
            dist.destroy_process_group()
        return seen
    return rank_main

# The process's first registration, on a rank's thread; the ranks leave their groups behind.
with fakepg.World(2) as world:
    assert world.run(job(world, False)) == [(0, 2), (1, 2)]
for _ in range(6):  # later worlds run on the same cached threads
    with fakepg.World(2) as world:
        assert world.run(job(world, True)) == [(0, 2), (1, 2)]
print("ok")
"""


def test_groups_a_job_left_on_the_installing_thread_are_gone_for_the_next_job() -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _LEFT_BEHIND], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
