"""``reducer.testing.checks``: the checks fail where a wrapper or a hook is wrong, and say where."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

import reducer
from reducer.testing import (
    TrainingScenario,
    check_comm_hook,
    check_data_parallel,
    reducer_ddp,
    torch_ddp,
)


def _mlp() -> nn.Module:
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return model


def _inputs(world_size: int, steps: int, *, same: bool = False) -> Any:
    return tuple(
        tuple(
            (
                torch.randn(
                    3, 4, generator=torch.Generator().manual_seed(r + (0 if same else 10 * s))
                ),
            )
            for r in range(world_size)
        )
        for s in range(steps)
    )


class SummingParallel(nn.Module):
    """A broken user wrapper: allreduces each gradient without scaling it (the sum)."""

    def __init__(self, module: nn.Module, pg: reducer.ProcessGroup) -> None:
        super().__init__()
        self.module = module
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                lambda q: pg.allreduce([q.grad]).wait()
            )

    def forward(self, *args: Any) -> Any:
        return self.module(*args)


def test_a_wrong_average_is_reported_by_rank_step_and_parameter() -> None:
    with pytest.raises(
        AssertionError, match=r"rank 0, step 0, parameter 0 \('0.weight'\), gradient"
    ):
        check_data_parallel(SummingParallel, TrainingScenario(_mlp, _inputs(2, 2)))


def test_torch_ddp_at_three_ranks_is_the_reciprocal_average_not_the_divided_one() -> None:
    scenario = TrainingScenario(_mlp, _inputs(3, 2))
    check_data_parallel(torch_ddp(), scenario, scaling="reciprocal")
    with pytest.raises(AssertionError, match="not bitwise equal"):
        check_data_parallel(torch_ddp(), scenario, scaling="divide")


def test_an_expected_refusal_that_does_not_come_fails() -> None:
    scenario = TrainingScenario(_mlp, _inputs(2, 1), refusal="never raised")
    with pytest.raises(AssertionError, match="every step ran through"):
        check_data_parallel(reducer_ddp(), scenario, scaling="divide")


def _conv() -> nn.Module:
    generator = torch.Generator().manual_seed(0)
    conv = nn.Conv2d(3, 4, kernel_size=2, bias=False)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=generator))
    return conv.to(memory_format=torch.channels_last)


def _images(world_size: int) -> Any:
    return (
        tuple(
            (
                torch.randn(2, 3, 4, 4, generator=torch.Generator().manual_seed(r)).to(
                    memory_format=torch.channels_last
                ),
            )
            for r in range(world_size)
        ),
    )


class ContiguousParallel(SummingParallel):
    """A broken user wrapper: averages exactly, but hands back contiguous gradients."""

    def __init__(self, module: nn.Module, pg: reducer.ProcessGroup) -> None:
        nn.Module.__init__(self)
        self.module = module

        def reduce(q: Tensor) -> None:
            assert q.grad is not None
            grad = q.grad.contiguous().mul_(1.0 / pg.size())
            pg.allreduce([grad]).wait()
            q.grad = grad

        for p in module.parameters():
            p.register_post_accumulate_grad_hook(reduce)  # type: ignore[no-untyped-call]


def test_gradient_strides_must_be_kept() -> None:
    scenario = TrainingScenario(_conv, _images(2))
    check_data_parallel(torch_ddp(gradient_as_bucket_view=True), scenario)
    with pytest.raises(AssertionError, match="strides"):
        check_data_parallel(ContiguousParallel, scenario)


STEP = 0.5  # the grid the rounding hook sends gradients on


def _rounding_hook(feedback: bool) -> Any:
    """A lossy hook: each rank sends its share of the average rounded to a grid of ``STEP``;
    with ``feedback`` it keeps what it dropped and adds it next time (error feedback)."""

    def hook(state: dict[int, Tensor], bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        # What was held back is kept per parameter: DDP rebuilds its buckets after the first
        # step, in another order.
        pairs = list(zip(bucket.parameters(), bucket.gradients(), strict=True))
        held = [state.get(id(p), torch.zeros_like(g)).reshape(-1) for p, g in pairs]
        share = bucket.buffer() / dist.get_world_size() + torch.cat(held)
        sent = torch.round(share / STEP) * STEP
        if feedback:
            kept, offset = share - sent, 0
            for p, g in pairs:
                state[id(p)] = kept[offset : offset + g.numel()].view_as(g)
                offset += g.numel()
        future = dist.all_reduce(sent, async_op=True).get_future()  # type: ignore[union-attr]
        return future.then(lambda f: f.value()[0])

    hook.__annotations__ = {
        "state": object,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[Tensor],
    }
    return hook


def test_error_feedback_keeps_the_running_sum_within_the_bound() -> None:
    # The same batches every step: what a hook without feedback drops, it drops every time.
    world_size, steps = 2, 8
    scenario = TrainingScenario(_mlp, _inputs(world_size, steps, same=True))
    # Each step is off by at most one grid step per rank; with feedback the running sum is
    # off by what the ranks hold back now, at most half a grid step each.
    bound = world_size * STEP
    report = check_comm_hook(
        _rounding_hook(True),
        scenario,
        state=lambda pg: {},
        atol=bound,
        cumulative_atol=bound / 2 + 1e-5,
    )
    assert not report.exact and report.roundings == ()  # within bounds, not exact
    with pytest.raises(AssertionError, match="running sum"):
        check_comm_hook(
            _rounding_hook(False),
            scenario,
            state=lambda pg: {},
            atol=bound,
            cumulative_atol=bound / 2 + 1e-5,
        )


def test_a_reloaded_wrapper_trains_on_from_the_loaded_copy() -> None:
    # Torch's DDP too: pickled after step 0, both train on from their loaded copies. A
    # wrapper whose reload loses the group or the module fails here (it trains the old one).
    scenario = TrainingScenario(_mlp, _inputs(2, 3), reload_after=0)
    check_data_parallel(reducer_ddp(), scenario, scaling="reciprocal")
    check_data_parallel(torch_ddp(), scenario, scaling="reciprocal")


@pytest.mark.parametrize("after", [-1, 2])
def test_a_reload_must_come_before_the_last_step(after: int) -> None:
    with pytest.raises(ValueError, match=r"reload_after must name a step before the last"):
        TrainingScenario(_mlp, _inputs(2, 3), reload_after=after)


def test_a_reload_with_uneven_inputs_is_refused() -> None:
    inputs = ((("a",), ("b",)), (("c",), None), (("d",), None))
    with pytest.raises(ValueError, match=r"without uneven inputs"):
        TrainingScenario(_mlp, inputs, reload_after=0)


def test_a_comm_hook_check_refuses_a_reload() -> None:
    def hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        raise AssertionError("never run")

    scenario = TrainingScenario(_mlp, _inputs(2, 2), reload_after=0)
    with pytest.raises(ValueError, match="a reloaded wrapper has no comm hook"):
        check_comm_hook(hook, scenario)


# -- one default for both checks, and a diagnosis of every mismatch ---------------------------


def _divide_the_sum(state: object, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """A correct hook that sums, then divides in its callback (sum then divide)."""
    world = dist.get_world_size()  # the callback runs on another thread
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda f: f.value()[0].div_(world))  # type: ignore[union-attr]


_divide_the_sum.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,
    "return": torch.futures.Future[Tensor],
}


def test_no_one_ulp_false_alarm_at_three_ranks_with_the_defaults() -> None:
    scenario = TrainingScenario(_mlp, _inputs(3, 2))
    report = check_comm_hook(_divide_the_sum, scenario)
    assert report.roundings == ("sum_then_divide",)
    with pytest.raises(AssertionError, match=r"scaling='sum_then_divide' accepts it"):
        check_comm_hook(_divide_the_sum, scenario, scaling="reciprocal")
    with pytest.raises(AssertionError, match=r"scaling='reciprocal' accepts it"):
        check_data_parallel(torch_ddp(), scenario, scaling="divide")


def test_the_sum_is_diagnosed_as_w_times_the_average() -> None:
    with pytest.raises(AssertionError, match="W times the average"):
        check_data_parallel(SummingParallel, TrainingScenario(_mlp, _inputs(2, 1)))


class SubgroupParallel(SummingParallel):
    """A broken user wrapper: averages over ranks 0 and 1 only (a subgroup made for the whole
    world)."""

    def __init__(self, module: nn.Module, pg: reducer.ProcessGroup) -> None:
        nn.Module.__init__(self)
        self.module = module
        sub = pg.new_group([0, 1])  # type: ignore[attr-defined]

        def reduce(q: Tensor) -> None:
            if sub is not None:
                sub.allreduce([q.grad.div_(2)]).wait()

        for p in module.parameters():
            p.register_post_accumulate_grad_hook(reduce)  # type: ignore[no-untyped-call]


def test_an_average_of_some_ranks_is_diagnosed() -> None:
    with pytest.raises(AssertionError, match=r"average of ranks \[0, 1\] only"):
        check_data_parallel(SubgroupParallel, TrainingScenario(_mlp, _inputs(3, 1)))


class ParameterAveraging(SummingParallel):
    """A broken user wrapper (a classic): averages the parameters' values after backward,
    not their gradients."""

    def __init__(self, module: nn.Module, pg: reducer.ProcessGroup) -> None:
        nn.Module.__init__(self)
        self.module, self.pg = module, pg

    def finish_gradient_synchronization(self) -> None:
        for p in self.module.parameters():
            self.pg.allreduce([p.data.div_(self.pg.size())]).wait()


def test_parameters_averaged_instead_of_gradients_is_diagnosed() -> None:
    with pytest.raises(
        AssertionError,
        match=r"(?s)rank 0's local gradient: nothing was reduced.*parameter values were averaged",
    ):
        check_data_parallel(
            ParameterAveraging,
            TrainingScenario(_mlp, _inputs(2, 1)),
            after_backward=ParameterAveraging.finish_gradient_synchronization,
        )


def _twins() -> nn.Module:
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Tanh(), nn.Linear(3, 3, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return model


class SwappedParallel(nn.Module):
    """A broken user wrapper: reduces every gradient, then writes each of the two layers'
    averages onto the other (a bucket's gradients on the wrong parameters)."""

    def __init__(self, module: nn.Module, pg: reducer.ProcessGroup) -> None:
        super().__init__()
        self.module, self.pg = module, pg

    def forward(self, *args: Any) -> Any:
        return self.module(*args)

    def finish_gradient_synchronization(self) -> None:
        first, second = self.module.parameters()
        for p in (first, second):
            self.pg.allreduce([p.grad.mul_(1.0 / self.pg.size())]).wait()
        first.grad, second.grad = second.grad, first.grad


def test_gradients_on_the_wrong_parameter_are_diagnosed() -> None:
    inputs = tuple(
        tuple(
            (torch.randn(2, 3, generator=torch.Generator().manual_seed(r + 10 * s)),)
            for r in range(2)
        )
        for s in range(1)
    )
    with pytest.raises(
        AssertionError, match=r"it is the gradient parameter 1 \('2.weight'\) should have"
    ):
        check_data_parallel(
            SwappedParallel,
            TrainingScenario(_twins, inputs),
            after_backward=SwappedParallel.finish_gradient_synchronization,
        )


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_check_builds_the_model_once_per_rank_and_copy_plus_the_determinism_check(
    world_size: int,
) -> None:
    """The two builds that show the factory deterministic serve as plain copies of the
    reference: two, then one per rank, then the reference's others (W + 2 in all where W >= 2,
    not 2W + 2: a cost of every example)."""
    built = []

    def make() -> nn.Module:
        built.append(1)
        return _mlp()

    scenario = TrainingScenario(make, _inputs(world_size, 1))
    check_data_parallel(torch_ddp(), scenario)
    assert len(built) == 2 + world_size + max(0, world_size - 2)
    built.clear()
    check_comm_hook(default_hooks.allreduce_hook, scenario)
    assert len(built) == 2 + world_size + max(0, world_size - 2)
    built.clear()
    # An optimizer= is built on the first copy: that one is not reused.
    check_data_parallel(torch_ddp(), scenario, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert len(built) == 2 * world_size + 1


def test_a_comm_hook_check_starts_no_timer_thread_per_hook_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every hook call's deadline waits on one shared thread, not a threading.Timer each."""

    def no_timer(*args: object, **kwargs: object) -> None:
        raise AssertionError("a threading.Timer was started for a hook call")

    def relayed(state: object, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
        # A future of its own (the watched kind), completed from the collective's.
        out: torch.futures.Future[Tensor] = torch.futures.Future()
        _divide_the_sum(state, bucket).add_done_callback(lambda f: out.set_result(f.value()))
        return out

    relayed.__annotations__ = _divide_the_sum.__annotations__
    monkeypatch.setattr("threading.Timer", no_timer)
    check_comm_hook(relayed, TrainingScenario(_mlp, _inputs(2, 3)))
