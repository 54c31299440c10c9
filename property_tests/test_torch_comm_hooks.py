"""Property 7: torch's own comm hooks on torch's DDP, checked with ``check_comm_hook``.

On the fake world each hook's result is predictable from the ranks' local gradients (the
fake world sums in rank order, in the tensor's dtype):

- ``allreduce_hook`` divides the bucket in place, then sums: the rank-order average with
  ``g / W`` (not torch's reducer's own ``g * (1/W)``), bit for bit;
- ``fp16_compress_hook`` / ``bf16_compress_hook``: each gradient cast to the half type and
  divided there, summed in the half type, cast back: bit for bit, at every gradient magnitude
  drawn (zeros, denormals, float16 sums past 65504: inf exactly where the prediction has it;
  the hook from before torch's overflow fix, summing first, fails here) (torch refuses to register
  ``bf16_compress_hook`` by its name without CUDA and NCCL, so it is registered under
  another name; what it computes does not depend on the device);
- ``powerSGD_hook`` with a rank at least the smaller side of every matrix: the average within
  the float32 rounding of the orthogonalization (``atol = rtol = 1e-4``; the rounding bound
  itself is derived and checked in ``test_comm_hook_bounds.py``).

Error feedback across steps (``check_comm_hook(cumulative_atol=...)``) is checked on a hook
whose residual is exactly bounded, in ``tests/test_testing_checks.py``.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, quantization_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from reducer.testing import TrainingScenario, check_comm_hook, generated_training_scenarios
from reducer.testing.harness import note_size
from reducer.testing.hooks import AVERAGES
from reducer.testing.model import BranchSpec, ModelSpec, build_model, loss_of
from reducer.testing.strategies import gradient_scales, model_specs

SCENARIOS = _SCENARIOS = generated_training_scenarios(
    model=model_specs(max_branches=3, max_params=6, allow_sparse=False),
    options={"find_unused_parameters": True},
    lr=0.0,
)
# The same, each rank's loss scaled per step by a drawn power of two: gradients of any
# magnitude, zeros, denormals, and float16 sums past 65504 (see gradient_scales).
MAGNITUDES = generated_training_scenarios(
    model=model_specs(max_branches=3, max_params=6, allow_sparse=False),
    options={"find_unused_parameters": True},
    lr=0.0,
    loss_scales=gradient_scales(),
)


def bf16_hook(state: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    """torch's ``bf16_compress_hook`` under a name torch's DDP does not refuse on the CPU."""
    return default_hooks.bf16_compress_hook(state, bucket)


# torch's DDP inspects a hook's annotations, which this module's ``annotations`` import turns
# into strings: give it the objects.
bf16_hook.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[torch.Tensor],
}


def _note(s: TrainingScenario) -> None:
    note_size(len(list(s.make_model().parameters())), s.world_size)


def check_allreduce_hook(s: TrainingScenario) -> None:
    # torch's hook as default_hooks holds it now (a mutant may replace it).
    check_comm_hook(default_hooks.allreduce_hook, s, scaling="divide")


def check_fp16_hook(s: TrainingScenario) -> None:
    check_comm_hook(default_hooks.fp16_compress_hook, s, average=AVERAGES["fp16"])


@given(_SCENARIOS)
def test_allreduce_hook_is_the_divided_average(s: TrainingScenario) -> None:
    _note(s)
    check_allreduce_hook(s)


@given(MAGNITUDES)
def test_fp16_compression_is_exactly_predictable(s: TrainingScenario) -> None:
    _note(s)
    check_fp16_hook(s)


@given(MAGNITUDES)
def test_bf16_compression_is_exactly_predictable(s: TrainingScenario) -> None:
    _note(s)
    check_comm_hook(bf16_hook, s, average=AVERAGES["bf16"])


def _powersgd_state(pg: object) -> powersgd.PowerSGDState:
    # Rank 6 covers every matrix drawn below (3 to 6 features a side), so the hook
    # orthogonalizes with Householder QR (rank 3 or more; rank 2 or less takes Gram-Schmidt,
    # whose float32 loss of orthogonality depends on conditioning); compression from the
    # third step on (error feedback needs two plain iterations first).
    return powersgd.PowerSGDState(
        None, matrix_approximation_rank=6, start_powerSGD_iter=2, min_compression_rate=0.0
    )


_SIDE = st.integers(3, 6)
# One or two projections (a Linear without bias: one matrix of 3 to 6 a side).
_PROJECTIONS = st.builds(
    lambda sides, seed: ModelSpec(
        tuple(BranchSpec("proj", width=w, out=o) for w, o in sides), seed=seed
    ),
    st.lists(st.tuples(_SIDE, _SIDE), min_size=1, max_size=2),
    st.integers(0, 2**16),
)


@settings(max_examples=max(5, settings().max_examples // 2))
@given(generated_training_scenarios(model=_PROJECTIONS, lr=0.0, min_steps=3, max_steps=4))
def test_full_rank_powersgd_is_the_average_within_rounding(s: TrainingScenario) -> None:
    _note(s)
    check_comm_hook(powersgd.powerSGD_hook, s, state=_powersgd_state, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "hook",
    [
        quantization_hooks.quantization_pertensor_hook,
        quantization_hooks.quantization_perchannel_hook,
    ],
)
def test_torch_quantization_hooks_fail_at_their_first_bucket(hook: Any) -> None:
    # Each reads the gathered scales and zero points as ``fut.wait()[0][rank][0]``, which needs
    # the future's value nested one level deeper than the fake world's all_gather future gives
    # it (a flat list of the gathered tensors): an IndexError in its first callback, on every
    # rank, before anything is quantized.
    scenario = TrainingScenario(
        functools.partial(build_model, ModelSpec((BranchSpec("mlp"),), seed=0)),
        ((([torch.ones(2, 3)], frozenset({0})), ([torch.zeros(2, 3)], frozenset({0}))),),
        loss=loss_of,
    )
    with pytest.raises(RuntimeError, match="IndexError"):
        check_comm_hook(hook, scenario, range_rtol=2 / 255, timeout=10.0)
