"""What fakepg's torch backend does so that every supported torch runs it alike.

The CUDA device guard's no-GPU stand-in outlives the rank threads (see Note [The CUDA device
guard on rank threads] in fakepg.torch_backend). On a CUDA build of torch without a GPU (torch
2.11 from the package index, on a CPU machine), FSDP2 worlds started one after another from a
thread that ends crashed the process with a segfault; on a CPU build or with a GPU the
subprocess test passes either way, and the unit tests below check the mechanism on every build.

``dist.batch_isend_irecv`` runs a fakepg group's ops one at a time: torch 2.14 asks any
ProcessGroup for a backend object, which a Python backend does not have, and raised.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import fakepg
from fakepg import torch_backend

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import os
import threading
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import fakepg

def fn(pg):
    mesh = init_device_mesh("cpu", (2,))
    model = torch.nn.Linear(4, 2)
    torch.nn.init.ones_(model.weight)
    fully_shard(model, mesh=mesh)
    model(torch.ones(3, 4) * (pg.rank() + 1)).sum().backward()
    return model.weight.grad.full_tensor().tolist()

results = []
for _ in range(3):  # each world from a thread that ends before the next world starts
    t = threading.Thread(target=lambda: results.append(fakepg.run_torch(fn, 2, timeout=60.0)))
    t.start()
    t.join(120)
print(results, flush=True)
# What is checked ends here. Interpreter shutdown is not: on torch 2.12's CUDA build without a
# GPU it once aborted ("terminate called without an active exception") after printing.
os._exit(0)
"""


def test_fsdp2_worlds_from_threads_that_end_do_not_crash() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Each rank's gradient: the rows of 3 * (rank + 1) ones summed, averaged over 2 ranks.
    grad = [[4.5] * 4] * 2
    assert done.stdout.strip() == repr([[grad, grad]] * 3)


@pytest.fixture
def ensure_calls(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """torch's call replaced by one that records the thread it runs on; no GPU; no keeper."""
    calls: list[threading.Thread] = []
    monkeypatch.setattr(
        torch._C,
        "_ensureCUDADeviceGuardSet",
        lambda: calls.append(threading.current_thread()),
        raising=False,
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch_backend, "_guard_keeper", None)
    return calls


def test_the_stand_in_is_installed_on_the_main_thread(
    ensure_calls: list[threading.Thread],
) -> None:
    fakepg.register_torch_backend()
    assert ensure_calls == [threading.main_thread()]
    assert torch_backend._guard_keeper is None


def test_from_another_thread_a_kept_thread_installs_it_once(
    ensure_calls: list[threading.Thread],
) -> None:
    for _ in range(2):
        caller = threading.Thread(target=fakepg.register_torch_backend)
        caller.start()
        caller.join(60)
        assert not caller.is_alive()
    keeper = torch_backend._guard_keeper
    assert keeper is not None and ensure_calls == [keeper]
    assert keeper.is_alive() and keeper.daemon and keeper.name == "torch-cuda-device-guard"


def test_with_a_gpu_nothing_is_done(
    ensure_calls: list[threading.Thread], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    fakepg.register_torch_backend()
    assert ensure_calls == []


def test_batch_isend_irecv_on_fakepg_one_op_at_a_time_and_torchs_checks_kept() -> None:
    world_size = 3

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[list[float], int, list[str]]:
        r = pg.rank()
        got = torch.zeros(2)
        works = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, torch.full((2,), float(r)), (r + 1) % world_size),
                dist.P2POp(dist.irecv, got, (r - 1) % world_size),
            ]
        )
        for work in works:
            work.wait()
        refused = []
        for bad in ([], ["not an op"]):  # torch's own function answers these
            with pytest.raises((IndexError, ValueError)) as info:
                dist.batch_isend_irecv(bad)  # type: ignore[arg-type]
            refused.append(type(info.value).__name__)
        return got.tolist(), len(works), refused

    for r, (got, works, refused) in enumerate(fakepg.run_torch(fn, world_size, timeout=20.0)):
        assert got == [float((r - 1) % world_size)] * 2 and works == 2
        assert refused == ["IndexError", "ValueError"]
    assert dist.batch_isend_irecv is torch_backend._batch_isend_irecv
