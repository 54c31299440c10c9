"""The test class that benchmarks/torch_ddp_suite.py runs, imported by every spawned rank.

torch's ``DistributedTest._DistTestBase`` runs each test in ``WORLD_SIZE`` processes started
with multiprocessing's spawn: each rank imports the module that defines the test class, so
what this module does at import happens in every rank. The runner sets, before importing it:

- ``BACKEND``, ``WORLD_SIZE``, ``TEMP_DIR`` (and ``INIT_METHOD``), as upstream's
  test/distributed/test_distributed_spawn.py expects them;
- ``DDP_SUITE_IMPL``: ``torch`` (torch's DistributedDataParallel) or ``ours``
  (``reducer.DistributedDataParallel`` patched in for ``torch.nn.parallel``'s);
- ``DDP_SUITE_CPU``: ``1`` to run tests written for one CUDA device per rank on the CPU:
  the CUDA-count skips pass, CUDA devices named in arguments become ``cpu``, and the
  wrapper drops ``device_ids`` and ``output_device`` (a CPU module takes neither).

The class is upstream's ``TestDistBackendWithSpawn``, unchanged.
"""

from __future__ import annotations

import functools
import os
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.parallel
import torch.nn.parallel.distributed
from torch import nn
from torch.testing._internal import common_distributed
from torch.testing._internal.distributed import distributed_test
from torch.testing._internal.distributed.distributed_test import (
    DistributedTest,
    TestDistBackend,
)

IMPL = os.environ.get("DDP_SUITE_IMPL", "torch")
CPU_MAPPED = os.environ.get("DDP_SUITE_CPU", "0") == "1"
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", "2"))

_TORCH_DDP = torch.nn.parallel.DistributedDataParallel


def _cpu(device: Any) -> Any:
    """``device`` with a CUDA device (an index, 'cuda:i', torch.device) replaced by 'cpu'."""
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


def _map_cuda_to_cpu() -> None:
    """Patch this process so that tests written for one CUDA device per rank run on the CPU."""
    # The skip decorators of common_distributed read torch.cuda through the module's global
    # `torch` and TEST_CUDA: give them a view in which each rank has its device, leaving the
    # real torch.cuda (which torch's DDP consults) alone.
    cuda_view = types.SimpleNamespace(
        is_available=lambda: True,
        device_count=lambda: WORLD_SIZE,
    )

    class _TorchView(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return cuda_view if name == "cuda" else getattr(torch, name)

    common_distributed.torch = _TorchView("torch")  # type: ignore[attr-defined]
    common_distributed.TEST_CUDA = True  # type: ignore[attr-defined]

    torch.cuda.set_device = lambda device: None  # type: ignore[assignment]
    torch.cuda.current_device = lambda: 0  # type: ignore[assignment]
    torch.cuda.synchronize = lambda device=None: None  # type: ignore[assignment]

    def tensor_cuda(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self

    torch.Tensor.cuda = tensor_cuda  # type: ignore[method-assign,assignment]
    tensor_to = torch.Tensor.to

    @functools.wraps(tensor_to)
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        args = tuple(_cpu(a) for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return tensor_to(self, *args, **kwargs)

    torch.Tensor.to = to  # type: ignore[method-assign,assignment]
    nn.Module.cuda = lambda self, device=None: self  # type: ignore[method-assign,assignment]
    module_to = nn.Module.to

    @functools.wraps(module_to)
    def module_to_cpu(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        args = tuple(_cpu(a) for a in args)
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        return module_to(self, *args, **kwargs)

    nn.Module.to = module_to_cpu  # type: ignore[method-assign,assignment]

    for name in (
        "arange", "empty", "full", "ones", "rand", "randint", "randn", "randperm",
        "tensor", "zeros", "ones_like", "zeros_like", "rand_like", "randn_like",
        "empty_like", "full_like", "as_tensor", "sparse_coo_tensor",
    ):  # fmt: skip
        factory = getattr(torch, name)

        def mapped(*args: Any, _factory: Any = factory, **kwargs: Any) -> Any:
            if "device" in kwargs:
                kwargs["device"] = _cpu(kwargs["device"])
            return _factory(*args, **kwargs)

        setattr(torch, name, mapped)


def _drop_devices(ddp_class: type) -> type:
    """A subclass of ``ddp_class`` that drops device_ids and output_device (CPU modules)."""

    class DistributedDataParallel(ddp_class):  # type: ignore[misc,valid-type]
        def __init__(self, module: nn.Module, *args: Any, **kwargs: Any) -> None:
            if args and isinstance(args[0], list | tuple | int | torch.device):
                args = (None, *args[1:])  # device_ids, positional
            if len(args) > 1:
                args = (args[0], None, *args[2:])  # output_device, positional
            kwargs.pop("device_ids", None)
            kwargs.pop("output_device", None)
            super().__init__(module, *args, **kwargs)

    DistributedDataParallel.__module__ = __name__
    DistributedDataParallel.__qualname__ = f"_MAPPED_{ddp_class.__module__.replace('.', '_')}"
    globals()[DistributedDataParallel.__qualname__] = DistributedDataParallel
    return DistributedDataParallel


def _install(ddp_class: type) -> None:
    """Make ``ddp_class`` what the suite (and torch's own helpers) call DistributedDataParallel."""
    torch.nn.parallel.DistributedDataParallel = ddp_class  # type: ignore[misc]
    torch.nn.parallel.distributed.DistributedDataParallel = ddp_class  # type: ignore[misc]
    distributed_test.DistributedDataParallel = ddp_class  # type: ignore[attr-defined]


def _setup() -> None:
    ddp_class: type = _TORCH_DDP
    if IMPL == "ours":
        import reducer

        ddp_class = reducer.DistributedDataParallel
    elif IMPL != "torch":
        raise ValueError(f"DDP_SUITE_IMPL must be 'torch' or 'ours', got {IMPL!r}")
    if CPU_MAPPED:
        _map_cuda_to_cpu()
        ddp_class = _drop_devices(ddp_class)
    if ddp_class is not _TORCH_DDP:
        _install(ddp_class)


_setup()


class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc]
    """Upstream's test/distributed/test_distributed_spawn.py class."""

    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()


__all__ = ["TestDistBackendWithSpawn", "dist"]
