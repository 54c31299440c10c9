"""CUDA on rank threads, for ``python -m reducer launch``: each rank's GPU, or the CPU for all.

A torchrun script picks its GPU from LOCAL_RANK (``torch.cuda.set_device(local_rank)``,
``model.cuda(local_rank)``, ``DistributedDataParallel(model, device_ids=[local_rank])``).
On rank threads:

- with as many GPUs as ranks or more, that works as it is (the current CUDA device is per
  thread, as it is per process under torchrun);
- with fewer, the ranks share the GPUs round-robin (rank r on GPU r mod n, said once at
  start): :class:`DeviceMap` maps each CUDA device index a rank names to its GPU;
- with ``--cuda-as-cpu``, every CUDA device is the CPU (said once at start): ``torch.cuda``
  answers for the CPU (available, one device per rank, ``set_device`` remembered per rank),
  ``.cuda()``, ``.to("cuda")`` and ``device="cuda"`` keep tensors on the CPU, autocast and
  GradScaler for "cuda" run on the CPU, and the data-parallel wrappers drop ``device_ids``
  (a CPU module takes none), so that an unmodified CUDA script runs on a laptop. What a real
  node would refuse is refused: a device index at or beyond the count ("invalid device
  ordinal"); what the CPU cannot stand for (CUDA graphs, the caching allocator's memory, ...:
  ``_NOT_ON_THE_CPU``) is refused by name.

# Guarantees: install() and the restore it returns run on the launching thread, before the
# rank threads start and after they ended; a DeviceMap is entered on each rank thread (torch
# function modes are per thread); the per-rank current device is thread-local.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__: list[str] = []

Mapper = Callable[[torch.device], torch.device]


def as_cpu(device: torch.device) -> torch.device:
    """--cuda-as-cpu: every CUDA device is the CPU."""
    return torch.device("cpu") if device.type == "cuda" else device


def invalid_ordinal(index: int, count: int, what: str) -> torch.AcceleratorError:
    """What CUDA says of a device index at or beyond the device count, and why here."""
    return torch.AcceleratorError(
        f"CUDA error: invalid device ordinal ({what}: cuda:{index} under --cuda-as-cpu, where "
        f"torch.cuda.device_count() is {count}, one device per rank, as on a node with "
        f"{count} GPU(s); a rank's device is cuda:LOCAL_RANK)"
    )


def cpu_for(count: int) -> Mapper:
    """--cuda-as-cpu with ``count`` ranks: CUDA devices 0 to count - 1 (and the current one)
    are the CPU; an index beyond is refused, as CUDA refuses it (invalid device ordinal)."""

    def mapped(device: torch.device) -> torch.device:
        if device.type != "cuda":
            return device
        if device.index is not None and device.index >= count:
            raise invalid_ordinal(device.index, count, "a tensor on it")
        return torch.device("cpu")

    return mapped


def round_robin(count: int) -> Mapper:
    """Ranks sharing ``count`` GPUs: CUDA device i is GPU i mod ``count``."""

    def mapped(device: torch.device) -> torch.device:
        if device.type != "cuda" or device.index is None or device.index < count:
            return device
        return torch.device("cuda", device.index % count)

    return mapped


def _device_of(value: Any, *, index_is_cuda: bool) -> torch.device | None:
    """``value`` as a device where it names one: a torch.device, "cuda:1", or (where an int
    means a CUDA device index) an int."""
    if isinstance(value, torch.device):
        return value
    if isinstance(value, str) and value.split(":")[0] in ("cuda", "cpu", "meta", "mps", "xpu"):
        return torch.device(value)
    if index_is_cuda and isinstance(value, int) and not isinstance(value, bool):
        return torch.device("cuda", value)
    return None


def _remap(value: Any, mapper: Mapper, *, index_is_cuda: bool) -> Any:
    device = _device_of(value, index_is_cuda=index_is_cuda)
    if device is None or device.type != "cuda":
        return value
    mapped = mapper(device)
    return value if mapped == device else mapped


class DeviceMap(TorchFunctionMode):
    """Every torch call on this thread with a CUDA device in its ``device`` argument (factory
    functions, ``Tensor.to``, ``Tensor.new_*``) gets ``mapper(device)`` instead."""

    def __init__(self, mapper: Mapper) -> None:
        super().__init__()
        self.mapper = mapper

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if "device" in kwargs:
            kwargs["device"] = _remap(kwargs["device"], self.mapper, index_is_cuda=True)
        if func is Tensor.to and len(args) > 1:  # x.to(device, ...): an int is a CUDA index
            args = (args[0], _remap(args[1], self.mapper, index_is_cuda=True), *args[2:])
        return func(*args, **kwargs)


# -------------------------------------------------------------------------------------------
# --cuda-as-cpu: torch.cuda answered for the CPU.


class _Event:
    """torch.cuda.Event on the CPU: a wall-clock time."""

    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self.when: float | None = None

    def record(self, stream: Any = None) -> None:
        self.when = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: _Event) -> float:
        if self.when is None or end.when is None:
            raise RuntimeError("torch.cuda.Event.elapsed_time: both events must be recorded")
        return (end.when - self.when) * 1000.0


class _Stream:
    """torch.cuda.Stream on the CPU: everything runs in order already."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = torch.device("cpu")

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        event = event if event is not None else _Event()
        event.record()
        return event  # type: ignore[no-any-return]

    def query(self) -> bool:
        return True

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


@contextlib.contextmanager
def _stream_context(stream: Any = None) -> Iterator[None]:
    yield


def _cuda_index(device: Any) -> int | None:
    """The CUDA device index ``device`` names (an int, "cuda:1", a torch.device), if any."""
    found = _device_of(device, index_is_cuda=True)
    return found.index if found is not None and found.type == "cuda" else None


def _check_ordinal(device: Any, count: int, what: str) -> int | None:
    index = _cuda_index(device)
    if index is not None and index >= count:
        raise invalid_ordinal(index, count, what)
    return index


class _DeviceContext:
    """torch.cuda.device(i): on the CPU, nothing to switch (an index beyond the devices is
    refused, as CUDA refuses it)."""

    count = 1  # set by _cuda_as_cpu

    def __init__(self, device: Any) -> None:
        _check_ordinal(device, self.count, "torch.cuda.device")
        self.device = device

    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass


def _cuda_as_cpu(nproc: int) -> dict[str, Any]:
    """The torch.cuda functions answered for the CPU; the current device is per rank."""
    local = threading.local()

    def current_device() -> int:
        return int(getattr(local, "device", 0))

    def set_device(device: Any) -> None:
        index = _check_ordinal(device, nproc, "torch.cuda.set_device")
        if index is not None and index < 0:
            return  # torch ignores a negative device
        local.device = index if index is not None else 0

    def properties(device: Any = None) -> SimpleNamespace:
        index = _cuda_index(device)
        if index is not None and not 0 <= index < nproc:
            raise AssertionError("Invalid device id")  # torch.cuda's own words
        return SimpleNamespace(
            name="CPU (--cuda-as-cpu)",
            major=8,
            minor=0,
            total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            multi_processor_count=os.cpu_count() or 1,
            is_integrated=False,
            is_multi_gpu_board=False,
        )

    def none(*args: Any, **kwargs: Any) -> None:
        return None

    def zero(*args: Any, **kwargs: Any) -> int:
        return 0

    class DeviceContext(_DeviceContext):
        count = nproc

    def rng_state(device: Any = "cuda") -> Tensor:
        return torch.get_rng_state()  # every CUDA generator is the CPU's (the rank's)

    def memory_info(device: Any = None) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return page * os.sysconf("SC_AVPHYS_PAGES"), page * os.sysconf("SC_PHYS_PAGES")

    refused = {name: _refusal(name, why) for name, why in _NOT_ON_THE_CPU.items()}
    return {
        **refused,
        "is_available": lambda: True,
        "is_initialized": lambda: True,
        "init": none,
        "device_count": lambda: nproc,
        "current_device": current_device,
        "set_device": set_device,
        "device": DeviceContext,
        "get_device_name": lambda device=None: "CPU (--cuda-as-cpu)",
        "get_device_capability": lambda device=None: (8, 0),
        "get_device_properties": properties,
        "is_bf16_supported": lambda *args, **kwargs: True,
        "synchronize": none,
        "empty_cache": none,
        "ipc_collect": none,
        "manual_seed": none,  # torch.manual_seed seeds the CPU, which is every "CUDA" device
        "manual_seed_all": none,
        # fork_rng and checkpoints save and restore the CPU's state through torch's CPU calls.
        "get_rng_state": rng_state,
        "get_rng_state_all": lambda: [torch.get_rng_state() for _ in range(nproc)],
        "set_rng_state": none,
        "set_rng_state_all": none,
        "mem_get_info": memory_info,
        "memory_stats": lambda device=None: {},
        "memory_summary": lambda *args, **kwargs: "(--cuda-as-cpu: no CUDA memory)",
        "seed": none,
        "seed_all": none,
        "memory_allocated": zero,
        "max_memory_allocated": zero,
        "memory_reserved": zero,
        "max_memory_reserved": zero,
        "reset_peak_memory_stats": none,
        "reset_max_memory_allocated": none,
        "set_per_process_memory_fraction": none,
        "Event": _Event,
        "Stream": _Stream,
        "current_stream": lambda device=None: _Stream(),
        "default_stream": lambda device=None: _Stream(),
        "stream": _stream_context,
    }


# torch.cuda calls the CPU cannot stand for under --cuda-as-cpu: refused by name, and why.
_NOT_ON_THE_CPU = {
    "CUDAGraph": "a CUDA graph replays recorded GPU kernels",
    "graph": "a CUDA graph replays recorded GPU kernels",
    "make_graphed_callables": "a CUDA graph replays recorded GPU kernels",
    "graph_pool_handle": "a CUDA graph's memory pool is GPU memory",
    "MemPool": "a CUDA memory pool is GPU memory",
    "use_mem_pool": "a CUDA memory pool is GPU memory",
    "caching_allocator_alloc": "the caching allocator hands out GPU memory",
    "caching_allocator_delete": "the caching allocator hands out GPU memory",
    "memory_snapshot": "a snapshot of the caching allocator describes GPU memory",
    "can_device_access_peer": "peer access is between GPUs",
    "set_sync_debug_mode": "synchronization debugging watches GPU streams",
}


def _refusal(name: str, why: str) -> Any:
    def refused(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"torch.cuda.{name} under --cuda-as-cpu: the CPU cannot stand for it ({why}). "
            "Run this part on a GPU (python -m reducer launch without --cuda-as-cpu, or "
            "torchrun), or skip it where torch.cuda.get_device_name() says "
            "'CPU (--cuda-as-cpu)'"
        )

    refused.__name__ = refused.__qualname__ = name
    return refused


def _patch(owner: Any, name: str, value: Any, undo: list[Callable[[], None]]) -> None:
    """``owner.name = value`` until the launch ends (a class attribute inherited, not its
    own, is deleted again rather than copied onto the class)."""
    missing = object()
    original = vars(owner).get(name, missing)
    setattr(owner, name, value)

    def put_back() -> None:
        if original is missing:
            with contextlib.suppress(AttributeError):
                delattr(owner, name)
        else:
            setattr(owner, name, original)

    undo.append(put_back)


def _on_device_type(
    cls: type, argument: str, mapper: Mapper, undo: list[Callable[[], None]], *, default: bool
) -> None:
    """``cls(device_type="cuda")`` (autocast, GradScaler) made for ``mapper``'s device;
    ``default``: the argument defaults to "cuda" (GradScaler's)."""
    original = cls.__init__  # type: ignore[misc]

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if argument in kwargs:
            kwargs[argument] = _device_type(kwargs[argument], mapper)
        elif args:
            args = (_device_type(args[0], mapper), *args[1:])
        elif default:
            kwargs[argument] = _device_type("cuda", mapper)
        original(self, *args, **kwargs)

    _patch(cls, "__init__", __init__, undo)


def _device_type(value: Any, mapper: Mapper) -> Any:
    if isinstance(value, str) and value == "cuda":
        return mapper(torch.device("cuda")).type
    return value


def _without_device_ids(cls: type, mapper: Mapper, undo: list[Callable[[], None]]) -> None:
    """A data-parallel wrapper built with ``device_ids=[local_rank]``: mapped to the rank's
    device; dropped (as a CPU module takes none) when that is the CPU."""
    original = cls.__init__  # type: ignore[misc]

    @functools.wraps(original)
    def __init__(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        ids = kwargs.get("device_ids", args[0] if args else None)
        if isinstance(ids, list | tuple) and ids:
            mapped = [mapper(d) for d in (_device_of(i, index_is_cuda=True) for i in ids) if d]
            if mapped and all(d.type == "cpu" for d in mapped):
                new_ids, output = None, None
            else:
                new_ids = [d.index if d.index is not None else 0 for d in mapped] or ids
                output = kwargs.get("output_device")
            if "device_ids" in kwargs:
                kwargs["device_ids"] = new_ids
            else:
                args = (new_ids, *args[1:])
            if output is None and "output_device" in kwargs:
                kwargs["output_device"] = None
        original(self, module, *args, **kwargs)

    _patch(cls, "__init__", __init__, undo)


def install(mapper: Mapper, *, cuda_as_cpu: bool, nproc: int) -> Callable[[], None]:
    """Map CUDA devices with ``mapper`` process-wide where torch allows it (``Tensor.cuda``,
    ``torch.cuda.set_device``, autocast, GradScaler, the wrappers' ``device_ids``), and answer
    ``torch.cuda`` for the CPU with ``cuda_as_cpu``, until the returned function is called.
    Each rank thread also enters ``DeviceMap(mapper)`` for the rest."""
    import reducer

    undo: list[Callable[[], None]] = []
    if cuda_as_cpu:
        for name, value in _cuda_as_cpu(nproc).items():
            _patch(torch.cuda, name, value, undo)

        def cuda(self: Tensor, device: Any = None, non_blocking: bool = False, **_: Any) -> Tensor:
            _check_ordinal(device, nproc, "Tensor.cuda")
            return self

        def pin_memory(self: Tensor, device: Any = None) -> Tensor:
            return self

        _patch(Tensor, "cuda", cuda, undo)
        _patch(Tensor, "pin_memory", pin_memory, undo)
    else:
        real_set_device = torch.cuda.set_device
        real_cuda = Tensor.cuda

        def set_device(device: Any) -> None:
            real_set_device(_remap(device, mapper, index_is_cuda=True))

        def cuda_mapped(self: Tensor, device: Any = None, *args: Any, **kwargs: Any) -> Tensor:
            if device is not None:
                device = _remap(device, mapper, index_is_cuda=True)
            return real_cuda(self, device, *args, **kwargs)

        _patch(torch.cuda, "set_device", set_device, undo)
        _patch(Tensor, "cuda", cuda_mapped, undo)
    _on_device_type(torch.amp.autocast, "device_type", mapper, undo, default=False)
    _on_device_type(torch.amp.GradScaler, "device", mapper, undo, default=True)
    for wrapper in (torch.nn.parallel.DistributedDataParallel, reducer.DistributedDataParallel):
        _without_device_ids(wrapper, mapper, undo)

    def restore() -> None:
        while undo:
            undo.pop()()

    return restore
