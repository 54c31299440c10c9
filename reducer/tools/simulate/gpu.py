"""A GPU's time for each operation, estimated from its FLOPs and bytes (a roofline).

:class:`GpuSpec` holds a GPU's published peaks; :class:`OpClock` is a dispatch mode that sees
every operation a model runs (on the meta device: shapes, no data) and advances a virtual
clock by the estimated time of its kernel:

    time = max(FLOPs / (peak FLOP/s x compute efficiency), bytes / (memory bandwidth x
           memory efficiency)) + a fixed cost per kernel

FLOPs come from torch's own counting rules (``torch.utils.flop_counter``: matmuls and
convolutions, forward and backward); bytes are those of every tensor the operation reads and
writes. Views and allocations cost nothing. This is an estimate, labelled as one wherever it
is shown: it ignores caches, kernel fusion and the library's algorithm choice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

__all__: list[str] = []

_T = 1e12


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU's peaks (datasheet) and the fractions of them kernels reach (assumed).

    ``fp32_flops``: FP32 FLOP/s without tensor cores; ``conv_fp32_flops``: what cuDNN runs
    FP32 convolutions at (TF32 tensor cores by default from Ampere on); ``half_flops``: FP16 /
    BF16 tensor-core FLOP/s (dense); ``memory_Bps``: HBM bandwidth."""

    name: str
    fp32_flops: float
    conv_fp32_flops: float
    half_flops: float
    memory_Bps: float
    compute_efficiency: float = 0.7
    memory_efficiency: float = 0.8
    kernel_s: float = 4e-6
    source: str = ""

    def __post_init__(self) -> None:
        for field_name in ("fp32_flops", "conv_fp32_flops", "half_flops", "memory_Bps"):
            if not getattr(self, field_name) > 0:
                raise ValueError(f"GpuSpec {self.name}: {field_name} must be > 0")
        for field_name in ("compute_efficiency", "memory_efficiency"):
            if not 0 < getattr(self, field_name) <= 1:
                raise ValueError(f"GpuSpec {self.name}: {field_name} must be in (0, 1]")

    def op_seconds(self, flops: float, nbytes: float, *, dtype: torch.dtype, conv: bool) -> float:
        """One kernel's estimated time."""
        if dtype in (torch.float16, torch.bfloat16):
            peak = self.half_flops
        else:
            peak = self.conv_fp32_flops if conv else self.fp32_flops
        compute = flops / (peak * self.compute_efficiency)
        memory = nbytes / (self.memory_Bps * self.memory_efficiency)
        return max(compute, memory) + self.kernel_s


# Efficiencies: 0.7 of the FLOP peak for cuDNN/cuBLAS kernels and 0.8 of the memory
# bandwidth for element-wise kernels are assumptions (typical of large kernels), not
# measurements; kernel_s 4 us: the usual floor of a small kernel's duration on these GPUs.
GPUS: dict[str, GpuSpec] = {
    "v100": GpuSpec(
        "V100-SXM2", 15.7 * _T, 15.7 * _T, 125 * _T, 900e9,
        source="NVIDIA Tesla V100 datasheet: 15.7 TFLOPS FP32, 125 TFLOPS tensor, 900 GB/s",
    ),
    "a100": GpuSpec(
        "A100-SXM4-80GB", 19.5 * _T, 156 * _T, 312 * _T, 2039e9,
        source="NVIDIA A100 datasheet: 19.5 FP32, 156 TF32, 312 BF16 TFLOPS, 2039 GB/s",
    ),
    "h100": GpuSpec(
        "H100-SXM5", 67 * _T, 494.5 * _T, 989 * _T, 3.35e12,
        source="NVIDIA H100 datasheet (dense): 67 FP32, 494.5 TF32, 989 BF16 TFLOPS, 3.35 TB/s",
    ),
    "h200": GpuSpec(
        "H200-SXM", 67 * _T, 494.5 * _T, 989 * _T, 4.8e12,
        source="NVIDIA H200 datasheet (dense): H100's compute, 4.8 TB/s HBM3e",
    ),
}  # fmt: skip


def gpu_spec(name: str) -> GpuSpec:
    """The GPU ``name`` (v100, a100, h100, h200)."""
    key = name.strip().lower()
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; choose one of {', '.join(GPUS)}")
    return GPUS[key]


# Operations that launch no kernel: metadata and allocation.
_FREE = {
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach",
    "lift_fresh", "_local_scalar_dense", "set_", "resize_", "sym_size", "sym_stride",
    "is_same_size", "_has_compatible_shallow_copy_type",
}  # fmt: skip
_CONV = {"convolution", "convolution_backward", "_convolution", "cudnn_convolution"}


class OpClock(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Advances ``now_s`` by each operation's estimated time while ``charging`` is true.

    ``now_s`` is the GPU stream's clock: collectives read it as their launch time and waiting
    for one moves it to the collective's completion (see reducer.tools.simulate.cluster).
    """

    def __init__(self, gpu: GpuSpec | None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.gpu = gpu
        self.now_s = 0.0
        self.charging = gpu is not None
        self.kernels = 0

    def advance_to(self, seconds: float) -> None:
        self.now_s = max(self.now_s, seconds)

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.charging and self.gpu is not None:
            self.now_s += self._seconds(func, args, kwargs, out)
        return out

    def _seconds(self, func: Any, args: Any, kwargs: Any, out: Any) -> float:
        assert self.gpu is not None
        packet = func.overloadpacket
        name = packet.__name__
        if func.is_view or name in _FREE:
            return 0.0
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        if not tensors:
            return 0.0
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        flops = 0.0
        counter: Callable[..., int] | None = flop_registry.get(packet)
        if counter is not None:
            flops = float(counter(*args, **kwargs, out_val=out))
        dtype = tensors[0].dtype
        self.kernels += 1
        return self.gpu.op_seconds(flops, nbytes, dtype=dtype, conv=name in _CONV)
