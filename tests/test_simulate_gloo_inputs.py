"""benchmarks/predicted_vs_gloo.py's measured inputs: the link as measured per size, the core's
roofline. (The gloo run itself is the benchmark; these are its pieces, without gloo.)"""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import fakepg

ROOT = Path(__file__).resolve().parent.parent


def _benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (benchmarks/ is not a package), leaving neither
    benchmarks/ on sys.path nor its helpers (``_common``) in sys.modules: a script launched in
    this process would import them in place of its own modules of the same name."""
    where = str(ROOT / "benchmarks")
    before, path = set(sys.modules), list(sys.path)
    sys.path.insert(0, where)
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = path  # the script puts benchmarks/ there too
        for added in set(sys.modules) - before - {name}:
            if (getattr(sys.modules[added], "__file__", None) or "").startswith(where):
                del sys.modules[added]


predicted_vs_gloo = _benchmark("predicted_vs_gloo")

POINTS = [(4096, 100e-6), (65536, 200e-6), (1 << 20, 1e-3), (16 << 20, 8e-3)]
LINE = fakepg.AlphaBeta(50e-6, 4e9)


def test_the_measured_link_returns_what_was_measured_and_interpolates_between() -> None:
    link = predicted_vs_gloo.MeasuredLink(list(reversed(POINTS)), LINE)
    for nbytes, seconds in POINTS:
        assert link.collective_time_s("allreduce", nbytes, 2) == pytest.approx(seconds)
    # Below the smallest size: the smallest's time (a call costs at least that).
    assert link.collective_time_s("allreduce", 4, 2) == 100e-6
    # Log-log between neighbours: the geometric mean at the geometric middle size.
    middle = link.collective_time_s("allreduce", 16384, 2)  # sqrt(4096 * 65536)
    assert middle == pytest.approx(math.sqrt(100e-6 * 200e-6), rel=1e-12)
    # Beyond the largest: the last segment's slope, linear in size.
    slope = (8e-3 - 1e-3) / ((16 << 20) - (1 << 20))
    assert link.collective_time_s("allreduce", 32 << 20, 2) == pytest.approx(
        8e-3 + (16 << 20) * slope, rel=1e-12
    )
    # Other kinds, and other world sizes, go to the fitted line.
    assert link.collective_time_s("broadcast", 1000, 2) == LINE.collective_time_s(
        "broadcast", 1000, 2
    )
    assert link.collective_time_s("allreduce", 1000, 4) == LINE.collective_time_s(
        "allreduce", 1000, 4
    )
    # Monotone in size across the whole range.
    sizes = [1 << k for k in range(2, 27)]
    times = [link.collective_time_s("allreduce", n, 2) for n in sizes]
    assert times == sorted(times)


def test_the_core_is_measured_as_a_roofline_the_prediction_takes() -> None:
    core = predicted_vs_gloo.measure_core(repeats=3)
    assert core.memory_Bps > 1e8 and core.kernel_s > 0 and core.fp32_flops > 1e8
    assert (core.compute_efficiency, core.memory_efficiency) == (1.0, 1.0)
    # A 1 MiB copy: its bytes (read and written) at the measured bandwidth, plus the fixed cost.
    seconds = core.op_seconds(0.0, 2 * (1 << 20), dtype=torch.float32, conv=False)
    assert seconds == pytest.approx(2 * (1 << 20) / core.memory_Bps + core.kernel_s)
