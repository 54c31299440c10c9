"""``reducer.testing``: any training step (``train_step``, ``optimizer``, ``after_backward``,
micro-batches) and references as algorithms (``reducer.testing.algorithms``), each against
torch's own implementation on the fake world, and the errors for bad input."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_testing_checks import _inputs, _mlp
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.hierarchical_model_averager import (
    HierarchicalModelAverager,
)
from torch.distributed.optim import PostLocalSGDOptimizer, ZeroRedundancyOptimizer

import reducer
import reducer.testing.checks
from reducer.testing import (
    Batch,
    Reference,
    StepGradients,
    TrainingScenario,
    check_comm_hook,
    check_data_parallel,
    ddp_average,
    fsdp2,
    hierarchical_averaging,
    periodic_averaging,
    reducer_ddp,
    torch_ddp,
    zero_redundancy,
)


def _sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def _micro(world_size: int, steps: int, count: int) -> Any:
    return tuple(
        tuple(
            tuple(
                (torch.randn(3, 4, generator=torch.Generator().manual_seed(100 * s + 10 * r + k)),)
                for k in range(count)
            )
            for r in range(world_size)
        )
        for s in range(steps)
    )


@pytest.mark.parametrize(
    "modes", [("no_sync", "sync"), ("require_backward_grad_sync", "sync", "sync")]
)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_micro_batches_accumulate_and_sync_as_drawn(
    modes: tuple[str, ...], set_to_none: bool
) -> None:
    scenario = TrainingScenario(
        _mlp, _micro(3, 2, len(modes)), micro_batches=(modes, modes), set_to_none=set_to_none
    )
    check_data_parallel(torch_ddp(), scenario)
    check_data_parallel(reducer_ddp(), scenario)


class IgnoresSyncToggle(nn.Module):
    """A wrapper that reduces at every backward: what was accumulated is reduced twice."""

    def __init__(self, module: nn.Module, pg: reducer.ProcessGroup) -> None:
        super().__init__()
        self.module = module
        self.require_backward_grad_sync = True
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                lambda q: pg.allreduce([q.grad.mul_(1.0 / pg.size())]).wait()
            )

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


def test_a_wrapper_that_ignores_the_sync_toggle_fails() -> None:
    modes = ("require_backward_grad_sync", "sync")
    scenario = TrainingScenario(_mlp, _micro(2, 1, 2), micro_batches=(modes,))
    check_data_parallel(IgnoresSyncToggle, TrainingScenario(_mlp, _inputs(2, 1)))
    with pytest.raises(AssertionError, match=r"rank 0, step 0, parameter 0"):
        check_data_parallel(IgnoresSyncToggle, scenario)


class HandWritten(nn.Module):
    """A course-style wrapper: buckets nothing, reduces every gradient in
    ``finish_gradient_synchronization()``, which the training step calls after backward."""

    def __init__(self, module: nn.Module, pg: reducer.ProcessGroup) -> None:
        super().__init__()
        self.module, self.pg = module, pg

    def forward(self, *args: Any) -> Any:
        return self.module(*args)

    def finish_gradient_synchronization(self) -> None:
        for p in self.module.parameters():
            if p.grad is not None:
                self.pg.allreduce([p.grad.div_(self.pg.size())]).wait()


def test_a_training_step_of_your_own() -> None:
    def train_step(model: nn.Module, optimizer: Any, batch: Batch, step: int) -> None:
        optimizer.zero_grad()
        batch.loss(model(*batch.args)).backward()
        model.finish_gradient_synchronization()  # type: ignore[operator]
        optimizer.step()

    scenario = TrainingScenario(_mlp, _inputs(3, 2))
    report = check_data_parallel(HandWritten, scenario, train_step=train_step, optimizer=_adam)
    assert report.roundings == ("divide",)  # g / W summed: another rounding, accepted
    after = HandWritten.finish_gradient_synchronization
    check_data_parallel(HandWritten, scenario, after_backward=after, optimizer=_adam)
    with pytest.raises(AssertionError, match="rank 0's local gradient: nothing was reduced"):
        check_data_parallel(HandWritten, scenario, optimizer=_adam)  # nobody calls it


def test_a_training_step_that_never_steps_is_refused() -> None:
    def train_step(model: nn.Module, optimizer: Any, batch: Batch, step: int) -> None:
        batch.loss(model(*batch.args)).backward()

    with pytest.raises(RuntimeError, match=r"rank \d, step 0: .*optimizer.step\(\) 0 times"):
        check_data_parallel(
            torch_ddp(), TrainingScenario(_mlp, _inputs(2, 1)), train_step=train_step
        )


def test_zero_redundancy_optimizer_holds_what_plain_adam_gives() -> None:
    def zero(params: list[nn.Parameter]) -> Any:
        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=0.01)

    scenario = TrainingScenario(_mlp, _inputs(3, 3))
    check_data_parallel(torch_ddp(), scenario, optimizer=zero, reference=zero_redundancy(_adam))
    with pytest.raises(AssertionError, match="after the step"):
        check_data_parallel(torch_ddp(), scenario, optimizer=zero, reference=zero_redundancy(_sgd))


def _post_local_ddp(group_size: int, start: int) -> Any:
    """torch's DDP with ``post_localSGD_hook``: gradients over every rank for ``start``
    steps, then within subgroups of ``group_size`` consecutive ranks."""

    def make(module: nn.Module, pg: reducer.ProcessGroup) -> nn.Module:
        ddp = nn.parallel.DistributedDataParallel(module)
        subgroup, _ = dist.new_subgroups(group_size=group_size)
        state = PostLocalSGDState(None, subgroup=subgroup, start_localSGD_iter=start)
        ddp.register_comm_hook(state, post_localSGD_hook)
        return ddp

    return make


def test_post_local_sgd_with_a_periodic_averager() -> None:
    def optimizer(params: list[nn.Parameter]) -> Any:
        return PostLocalSGDOptimizer(_sgd(params), PeriodicModelAverager(period=2, warmup_steps=1))

    scenario = TrainingScenario(_mlp, _inputs(4, 4))
    want = periodic_averaging(2, warmup_steps=1, gradient_group_size=2, optimizer=_sgd)
    check_data_parallel(_post_local_ddp(2, 1), scenario, optimizer=optimizer, reference=want)
    wrong = periodic_averaging(3, warmup_steps=1, gradient_group_size=2, optimizer=_sgd)
    with pytest.raises(
        AssertionError, match=r"step 3, .*after the step.*average of ranks \[0, 1, 2, 3\]"
    ):
        check_data_parallel(_post_local_ddp(2, 1), scenario, optimizer=optimizer, reference=wrong)


def test_hierarchical_averaging() -> None:
    periods = {2: 2, 4: 4}

    def optimizer(params: list[nn.Parameter]) -> Any:
        return PostLocalSGDOptimizer(_sgd(params), HierarchicalModelAverager(periods, 1))

    scenario = TrainingScenario(_mlp, _inputs(4, 5))
    want = hierarchical_averaging(periods, warmup_steps=1, optimizer=_sgd)
    check_data_parallel(_post_local_ddp(1, 1), scenario, optimizer=optimizer, reference=want)


class WrongShape(Reference):
    def gradients(self, s: StepGradients) -> list[list[dict[str, Tensor | None]]]:
        return [[{"mine": torch.zeros(1)} for _ in s.names] for _ in range(s.world_size)]


def test_a_reference_of_the_wrong_shape_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"WrongShape, rank 0, step 0, parameter 0 \('0.weight'\).*shape \(3, 4\)"
    ):
        check_data_parallel(
            torch_ddp(), TrainingScenario(_mlp, _inputs(2, 1)), reference=WrongShape()
        )


def test_a_hook_future_that_never_completes_fails_within_the_timeout() -> None:
    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        return torch.futures.Future()  # never completed

    hook.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[Tensor],
    }
    with pytest.raises(Exception, match=r"rank \d, step 0: the comm hook's future for bucket 0"):
        check_comm_hook(hook, TrainingScenario(_mlp, _inputs(2, 1)), timeout=2.0)


def test_the_default_average_is_any_rounding_and_scaling_pins_one() -> None:
    scenario = TrainingScenario(_mlp, _inputs(3, 1))
    assert "reciprocal" in check_data_parallel(torch_ddp(), scenario).roundings
    report = check_data_parallel(torch_ddp(), scenario, reference=ddp_average(scaling="reciprocal"))
    assert report.roundings == ("reciprocal",)
    # FSDP2's full gradients: the sum in rank order, then divided (its AVG reduce-scatter).
    report = check_data_parallel(fsdp2(), scenario, check_strides=False)
    assert report.roundings == ("sum_then_divide",)


def _never(state: object, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    return torch.futures.Future()  # never completed


_never.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[Tensor],
}


@pytest.mark.parametrize("wrapper", [nn.parallel.DistributedDataParallel, "ours"])
def test_the_timeout_holds_for_a_hook_registered_by_any_wrapper(wrapper: Any) -> None:
    def make(module: nn.Module, pg: reducer.ProcessGroup) -> nn.Module:
        ddp = reducer.DistributedDataParallel(module, pg) if wrapper == "ours" else wrapper(module)
        ddp.register_comm_hook(None, _never)
        return ddp

    with pytest.raises(Exception, match=r"rank \d, step 0: the comm hook's future for bucket"):
        check_data_parallel(make, TrainingScenario(_mlp, _inputs(2, 1)), timeout=2.0)


def test_torch_distributed_log_records_stay_out_of_the_captured_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)

    def train_step(model: nn.Module, optimizer: Any, batch: Batch, step: int) -> None:
        logging.getLogger("torch.distributed.c10d_logger").debug("c10d noise")
        logging.getLogger("my_training").debug("my record")
        optimizer.zero_grad()
        batch.loss(model(*batch.args)).backward()
        optimizer.step()

    check_data_parallel(torch_ddp(), TrainingScenario(_mlp, _inputs(2, 1)), train_step=train_step)
    messages = [r.getMessage() for r in caplog.records]
    assert "my record" in messages and "c10d noise" not in messages


def test_hypothesis_explanations_leave_the_library_lines_out() -> None:
    from hypothesis.internal import scrutineer

    check_data_parallel(torch_ddp(), TrainingScenario(_mlp, _inputs(1, 1)))
    hidden = re.compile(scrutineer._glob_to_re(scrutineer.UNHELPFUL_LOCATIONS))
    assert hidden.search(reducer.testing.checks.__file__.replace("\\", "/"))
    assert hidden.search(f"{reducer.__file__.rsplit('/', 1)[0]}/_averages.py")
    assert not hidden.search(__file__)  # the user's own lines stay


def test_fsdp2_shard_is_fsdp2s_dim0_chunk() -> None:
    from reducer.testing import fsdp2_shard

    rows = torch.arange(8.0).reshape(4, 2)
    # ceil(4 / 3) = 2 rows each: the last rank holds none (FSDP2 pads it in its buffers).
    assert [fsdp2_shard(rows, r, 3).shape[0] for r in range(3)] == [2, 2, 0]
    assert torch.equal(fsdp2_shard(rows, 1, 3), rows[2:4])
    assert fsdp2_shard(rows, 2, 3).shape == (0, 2)
    assert [fsdp2_shard(torch.ones(7), r, 3).numel() for r in range(3)] == [3, 3, 1]
    scalar = torch.tensor(2.0)
    assert fsdp2_shard(scalar, 1, 2) is scalar


def test_fsdp2_shards_name_the_rank_and_shard_that_differs() -> None:
    # FSDP2 checked against a reference that wants the sum, not the average: rank 0's own
    # shard fails, named as such.
    def x(rank: int, step: int) -> tuple[Tensor]:
        return (torch.randn(3, 2, generator=torch.Generator().manual_seed(10 * step + rank)),)

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2))

    def total(column: Any, world_size: int) -> Tensor:
        return sum(column[1:], column[0])  # type: ignore[no-any-return]

    s = TrainingScenario(model, (tuple(x(r, 0) for r in range(2)),))
    wrong = reducer.testing.fsdp2_shards(average=total)
    with pytest.raises(
        AssertionError,
        match=r"rank 0, step 0, parameter 0 \('0.weight'\), rank 0's shard, gradient: not bitwise",
    ):
        check_data_parallel(fsdp2(), s, reference=wrong, check_strides=False)
