"""Differential: torch's DDP features that tools use, against torch's DDP, bit for bit.

Both wrappers run in the same rank threads of one fake world (fakepg's torch backend is the
default group), on copies of the same model, fed the same data: pickling and reloading the
wrapper, native mixed precision, ``device_mesh=``, ``skip_all_reduce_unused_params=`` and
buffer comm hooks. At W = 2 torch's multiplication by 1/W and a division by W are the same
operation, so every gradient, parameter and buffer must be bit-identical.
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import rank_input, run_ranks, seeded
from torch import Tensor, nn
from torch.nn.parallel.distributed import _BufferCommHookLocation, _MixedPrecision

import fakepg
import reducer

W = 2
STEPS = 3


pytestmark = pytest.mark.usefixtures("fakepg_torch_backend")


class Net(nn.Module):
    """Two layers, a frozen parameter, a buffer that forward updates, and with ``dead`` a
    layer that is never used."""

    def __init__(self, dead: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)
        self.dead = nn.Linear(8, 300, bias=False) if dead else None
        self.frozen = nn.Parameter(torch.linspace(-1, 1, 3), requires_grad=False)
        self.register_buffer("count", torch.zeros(3))

    def forward(self, x: Tensor) -> Tensor:
        self.count += x[:, :3].sum(0).detach().to(self.count.dtype)
        out: Tensor = self.b(torch.tanh(self.a(x))) + self.frozen
        return out


def build(dead: bool = False) -> Net:
    return seeded(lambda: Net(dead), seed=3)


Step = Callable[[nn.Module, int, int], Tensor]


def _train(ddp: nn.Module, model: nn.Module, rank: int, steps: int = STEPS) -> list[list[Tensor]]:
    """Per step: every gradient (or an empty tensor for None), parameter and buffer."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trace: list[list[Tensor]] = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        ddp(rank_input(rank, (4, 6), step)).pow(2).sum().backward()
        grads = [torch.empty(0) if p.grad is None else p.grad.clone() for p in model.parameters()]
        optimizer.step()
        state = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
        trace.append(grads + state)
    return trace


def _both(make: Callable[[type, nn.Module], nn.Module], dead: bool = False) -> list[Any]:
    """Per rank: (ours, torch's) traces of wrappers that ``make(cls, model)`` builds."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[Any, Any]:
        ours_model, theirs_model = build(dead), build(dead)
        ours = make(reducer.DistributedDataParallel, ours_model)
        theirs = make(nn.parallel.DistributedDataParallel, theirs_model)
        return _train(ours, ours_model, pg.rank()), _train(theirs, theirs_model, pg.rank())

    return fakepg.run_torch(fn, W, timeout=60.0)


def _assert_identical(results: list[Any]) -> None:
    for rank, (ours, theirs) in enumerate(results):
        for step, (mine, torchs) in enumerate(zip(ours, theirs, strict=True)):
            for i, (a, b) in enumerate(zip(mine, torchs, strict=True)):
                assert a.dtype == b.dtype, f"rank {rank}, step {step}, tensor {i}: dtype"
                assert torch.equal(a, b), f"rank {rank}, step {step}, tensor {i}: not identical"


# -------------------------------------------------------------------------------------------
# Pickling.


def test_pickled_and_reloaded_wrapper_trains_as_torchs_does() -> None:
    """torch.save(ddp) mid-training and torch.load: the reloaded wrapper (on the default
    group, with a new reducer) goes on training bit for bit as torch's reloaded one."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[list[Tensor]]]:
        traces = []
        for cls in (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel):
            ddp = cls(build())
            first = _train(ddp, ddp.module, pg.rank(), steps=2)
            buffer = io.BytesIO()
            torch.save(ddp, buffer)
            buffer.seek(0)
            loaded = torch.load(buffer, weights_only=False)
            assert type(loaded) is cls and loaded.process_group is dist.group.WORLD
            assert loaded.module is not ddp.module
            traces.append(first + _train(loaded, loaded.module, pg.rank()))
        return traces

    _assert_identical(fakepg.run_torch(fn, W, timeout=60.0))


def test_a_wrapper_over_a_group_not_the_default_refuses_pickling_as_torch() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> str:
        ddp = reducer.DistributedDataParallel(build(), pg)
        with pytest.raises(RuntimeError, match="only supported when using DDP with the default"):
            torch.save(ddp, io.BytesIO())
        return "refused"

    assert run_ranks(fn, W) == ["refused"] * W


# -------------------------------------------------------------------------------------------
# Native mixed precision.


@pytest.mark.parametrize(
    "config",
    [
        _MixedPrecision(torch.float16, torch.float16, torch.float16),
        _MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16),
        _MixedPrecision(torch.float16, torch.bfloat16, None),
    ],
    ids=["fp16", "bf16-reduce-fp32", "fp16-reduce-bf16"],
)
@pytest.mark.parametrize("as_view", [False, True], ids=["copy", "bucket-view"])
def test_mixed_precision_reduces_as_torchs_mixed_precision(
    config: _MixedPrecision, as_view: bool
) -> None:
    """Forward and backward in param_dtype, the sum in reduce_dtype divided there by W,
    full-precision parameters and gradients after backward, buffers in buffer_dtype.

    torch's DDP mixed precision needs accelerator streams and events, so on the CPU its
    result is not a reference; the reference is its algorithm written out (torch's
    ``_root_copy_hook`` and ``_reducer_allreduce_and_upcast_hook``): each rank's model cast
    to param_dtype, its gradients cast to reduce_dtype, summed over the ranks, divided by W,
    widened to float32."""
    reduce_dtype = config.reduce_dtype or config.param_dtype

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[list[Tensor], list[Tensor], list[Tensor]]:
        model, local = build(), build()
        ddp = reducer.DistributedDataParallel(
            model, bucket_cap_mb=1e-4, mixed_precision=config, gradient_as_bucket_view=as_view
        )
        if config.buffer_dtype is not None:
            assert model.count.dtype == config.buffer_dtype
        low = local.to(config.param_dtype)
        grads, expected_local, params = [], [], []
        for step in range(STEPS):
            x = rank_input(pg.rank(), (4, 6), step)
            model.zero_grad(set_to_none=True)
            low.zero_grad(set_to_none=True)
            ddp(x).pow(2).sum().backward()
            low(x.to(config.param_dtype)).pow(2).sum().backward()
            assert {p.dtype for p in model.parameters()} == {torch.float32}
            grads += [p.grad.clone() for p in model.parameters() if p.grad is not None]
            expected_local += [p.grad.clone() for p in low.parameters() if p.grad is not None]
            params += [p.detach().clone() for p in model.parameters()]
        return grads, expected_local, params

    results = fakepg.run_torch(fn, W, timeout=60.0)
    for rank, (grads, _, params) in enumerate(results):
        for i, grad in enumerate(grads):
            summed = results[0][1][i].to(reduce_dtype) + results[1][1][i].to(reduce_dtype)
            expected = summed.div_(W).to(torch.float32)
            assert grad.dtype == torch.float32
            assert torch.equal(grad, expected), f"rank {rank}, gradient {i}"
        # No optimizer steps: the full-precision parameters are untouched by the casts.
        initial = [p.detach() for p in build().parameters()]
        for i, param in enumerate(params):
            assert torch.equal(param, initial[i % len(initial)]), f"rank {rank}, param {i}"


_MIXED_CONFIGS = [
    _MixedPrecision(torch.float16, torch.float16, torch.float16),
    _MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16),
    _MixedPrecision(torch.float16, torch.bfloat16, None),
]


@pytest.mark.parametrize("config", _MIXED_CONFIGS, ids=["fp16", "bf16-reduce-fp32", "fp16-bf16"])
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"static_graph": True},
        {"find_unused_parameters": True},
        {"gradient_as_bucket_view": True},
        {"find_unused_parameters": True, "skip_all_reduce_unused_params": True},
    ],
    ids=["plain", "static", "find-unused", "as-view", "skip-unused"],
)
def test_a_mixed_precision_checkpoint_loads_and_trains_on(
    config: _MixedPrecision, options: dict[str, Any]
) -> None:
    """torch.save(ddp) and torch.save(model) after two steps: both load (full-precision
    parameters, no low-precision twin saved with its storage freed: the saved module has no
    ``_mp_param``, the reloaded wrapper's parameters its own new twins), and the reloaded
    wrapper's next step is bit for bit the original's."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[list[list[Tensor]], list[list[Tensor]]]:
        model = build()
        ddp = reducer.DistributedDataParallel(
            model, bucket_cap_mb=1e-4, mixed_precision=config, **options
        )
        _train(ddp, model, pg.rank(), steps=2)
        saved_ddp, saved_model = io.BytesIO(), io.BytesIO()
        torch.save(ddp, saved_ddp)
        torch.save(model, saved_model)
        saved_ddp.seek(0)
        saved_model.seek(0)
        loaded = torch.load(saved_ddp, weights_only=False)
        loaded_model = torch.load(saved_model, weights_only=False)
        for copy in (loaded.module, loaded_model):
            for (name, mine), theirs in zip(
                copy.named_parameters(), model.parameters(), strict=True
            ):
                assert mine.dtype == torch.float32 and torch.equal(mine, theirs), name
                if copy is loaded_model:
                    assert not hasattr(mine, "_mp_param"), name  # no twin saved
                    assert not hasattr(mine, "_fp_param"), name
                else:  # the reloaded wrapper's own twins, made anew
                    assert mine._mp_param.dtype == config.param_dtype, name
                    assert mine._mp_param is not theirs._mp_param, name
                    assert mine._fp_param is mine.data or torch.equal(mine._fp_param, mine)
        # One more step on each, the same data: the same gradients and parameters.
        after_load = _train(loaded, loaded.module, pg.rank(), steps=1)
        kept_on = _train(ddp, model, pg.rank(), steps=1)
        return after_load, kept_on

    _assert_identical(fakepg.run_torch(fn, W, timeout=60.0))


def test_mixed_precision_parameters_carry_torchs_twin_attributes_ignored_ones_none() -> None:
    """As torch's test_ddp_native_mixed_precision_ignored_params reads them: every parameter
    not ignored has ``_mp_param`` (param_dtype) and ``_fp_param`` (float32), an ignored
    parameter or buffer neither; during forward the parameter computes on its ``_mp_param``,
    after backward it is back on its ``_fp_param``; a deep copy of the module has neither."""
    config = _MixedPrecision(torch.float16, torch.float16, torch.float16)

    def fn(pg: fakepg.FakeProcessGroup) -> str:
        model = build()
        model.register_buffer("buffer", torch.ones(5))
        to_ignore = ["frozen", "buffer"]  # torch's test: a.weight; frozen computes here
        DDP = reducer.DistributedDataParallel
        DDP._set_params_and_buffers_to_ignore_for_model(model, to_ignore)
        ddp = DDP(model, pg, mixed_precision=config, gradient_as_bucket_view=True)
        ignored = {f"module.{name}" for name in to_ignore}
        named = [*ddp.named_parameters(), *ddp.named_buffers()]
        seen = 0
        for name, tensor in named:
            if name in ignored:
                seen += 1
                assert not hasattr(tensor, "_mp_param") and not hasattr(tensor, "_fp_param")
            elif isinstance(tensor, nn.Parameter):
                assert tensor._mp_param.dtype == config.param_dtype, name
                assert tensor._fp_param.dtype == torch.float32, name
        assert seen == len(ignored)
        during: list[bool] = []
        model.b.register_forward_pre_hook(
            lambda m, _: during.append(m.weight.data.data_ptr() == m.weight._mp_param.data_ptr())
        )
        ddp(rank_input(pg.rank(), (4, 6), 0)).float().pow(2).sum().backward()
        assert during == [True], "forward computes on the _mp_param"
        assert model.b.weight.data_ptr() == model.b.weight._fp_param.data_ptr()
        assert model.b.weight.dtype == torch.float32
        import copy

        copied = copy.deepcopy(model)
        assert not hasattr(copied.b.weight, "_mp_param")
        return "ok"

    assert run_ranks(fn, W) == ["ok"] * W


@pytest.mark.parametrize("field", ["param_dtype", "reduce_dtype", "buffer_dtype"])
def test_a_mixed_precision_dtype_that_is_not_floating_point_is_refused(field: str) -> None:
    config = _MixedPrecision(**{field: torch.int32})  # type: ignore[arg-type]

    def fn(pg: fakepg.FakeProcessGroup) -> str:
        with pytest.raises(
            ValueError, match=rf"mixed_precision\.{field} is torch\.int32.*floating"
        ):
            reducer.DistributedDataParallel(build(), pg, mixed_precision=config)
        return "refused"

    assert run_ranks(fn, W) == ["refused"] * W


# -------------------------------------------------------------------------------------------
# device_mesh.


def test_a_one_dimensional_device_mesh_is_its_group_as_in_torch() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    def make(cls: type, model: nn.Module) -> nn.Module:
        mesh = init_device_mesh("cpu", (W,))
        ddp: nn.Module = cls(model, device_mesh=mesh, bucket_cap_mb=1e-4)
        assert ddp.process_group is mesh.get_group(0) and ddp.device_mesh is mesh
        return ddp

    _assert_identical(_both(make))


def test_a_device_mesh_and_a_group_are_refused_together_as_by_torch() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    def fn(pg: fakepg.FakeProcessGroup) -> list[str]:
        mesh = init_device_mesh("cpu", (W,))
        messages = []
        for cls in (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel):
            with pytest.raises(RuntimeError) as info:
                cls(build(), process_group=dist.group.WORLD, device_mesh=mesh)
            messages.append(str(info.value))
        return messages

    for ours, theirs in fakepg.run_torch(fn, W, timeout=30.0):
        assert theirs in ours


# -------------------------------------------------------------------------------------------
# skip_all_reduce_unused_params.


def test_skipping_the_buckets_of_unused_parameters_matches_torch() -> None:
    """The unused layer fills a bucket of its own: it is not reduced (one bucket fewer, as
    torch's logging data says), and every gradient is what torch's DDP gives."""
    counts: list[tuple[int, int]] = []

    def make(cls: type, model: nn.Module) -> nn.Module:
        ddp: nn.Module = cls(
            model, bucket_cap_mb=0.001, find_unused_parameters=True,
            skip_all_reduce_unused_params=True,
        )  # fmt: skip
        return ddp

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[Any, Any]:
        traces = []
        reduced = []
        for cls in (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel):
            model = build(dead=True)
            ddp = make(cls, model)
            traces.append(_train(ddp, model, pg.rank()))
            data = ddp._get_ddp_logging_data()
            reduced.append(data["num_buckets_reduced"])
        counts.append((reduced[0], reduced[1]))
        return traces[0], traces[1]

    results = fakepg.run_torch(fn, W, timeout=60.0)
    _assert_identical(results)
    for ours, theirs in counts:
        assert ours == theirs == 1, counts  # of 2 buckets: the dead layer's is skipped


class TwoBranches(nn.Module):
    """Two same-shaped branches; forward runs the one ``which`` names."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)

    def forward(self, x: Tensor, which: str) -> Tensor:
        out: Tensor = getattr(self, which)(x)
        return out


def test_skipping_buckets_unused_on_some_ranks_only_is_an_error_naming_them() -> None:
    """Rank 0 leaves branch b unused, rank 1 branch a: each bucket (one per branch) would be
    skipped on one rank and reduced on the other, and the two reductions, of the same shape,
    would be summed together (torch's DDP does, silently). Every rank raises, naming the
    parameters and the ranks, before any bucket is reduced."""

    def fn(pg: fakepg.FakeProcessGroup) -> str:
        model = seeded(TwoBranches, seed=1)
        ddp = reducer.DistributedDataParallel(
            model, pg, bucket_cap_mb=1e-5, find_unused_parameters=True,
            skip_all_reduce_unused_params=True,
        )  # fmt: skip
        x = rank_input(pg.rank(), (2, 4))
        with pytest.raises(RuntimeError) as info:
            ddp(x, "a" if pg.rank() == 0 else "b")
        return str(info.value)

    messages = run_ranks(fn, W)
    assert messages[0] == messages[1]
    assert "skip_all_reduce_unused_params" in messages[0]
    assert re.search(
        r"parameters 0 'a\.weight'\) is unused on rank\(s\) \[1\] and used on "
        r"rank\(s\) \[0\]",
        messages[0],
    ) or re.search(
        r"'b\.weight'\) is unused on rank\(s\) \[0\] and used on rank\(s\) \[1\]",
        messages[0],
    ), messages[0]


def test_a_bucket_one_rank_accumulated_under_no_sync_is_reduced_by_every_rank() -> None:
    """Rank 0 runs branch b under no_sync, then the synced pass leaves b unused on every
    rank: b's bucket holds rank 0's accumulated gradient, so every rank reduces it (rank 1
    contributing zeros) instead of skipping it: the gradients without skipping, no error."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[Tensor]]:
        traces = []
        for skip in (True, False):
            model = seeded(TwoBranches, seed=1)
            ddp = reducer.DistributedDataParallel(
                model, pg, bucket_cap_mb=1e-5, find_unused_parameters=True,
                skip_all_reduce_unused_params=skip,
            )  # fmt: skip
            with ddp.no_sync():
                branch = "b" if pg.rank() == 0 else "a"
                ddp(rank_input(pg.rank(), (2, 4), 0), branch).pow(2).sum().backward()
            ddp(rank_input(pg.rank(), (2, 4), 1), "a").pow(2).sum().backward()
            traces.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
        return traces

    for rank, (skipped, reduced) in enumerate(run_ranks(fn, W)):
        assert len(skipped) == len(reduced) == 2, rank  # b: rank 0's accumulated, averaged
        for a, b in zip(skipped, reduced, strict=True):
            assert torch.equal(a, b), rank


def test_skipping_the_same_unused_bucket_under_join_matches_no_skipping() -> None:
    """Uneven inputs under join(): the rank that ran out takes the others' skip decisions,
    so its shadow reductions match theirs; the gradients are those without skipping."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[list[Tensor]]:
        traces = []
        for skip in (True, False):
            model = seeded(TwoBranches, seed=1)
            ddp = reducer.DistributedDataParallel(
                model, pg, bucket_cap_mb=1e-5, find_unused_parameters=True,
                skip_all_reduce_unused_params=skip,
            )  # fmt: skip
            trace = []
            with ddp.join():
                for step in range(1 + 2 * pg.rank()):
                    model.zero_grad(set_to_none=True)
                    ddp(rank_input(pg.rank(), (2, 4), step), "a").pow(2).sum().backward()
                    trace += [torch.empty(0) if p.grad is None else p.grad.clone()
                              for p in model.parameters()]  # fmt: skip
            traces.append(trace)
        return traces

    for skipped, reduced in run_ranks(fn, W):
        assert len(skipped) == len(reduced)
        for a, b in zip(skipped, reduced, strict=True):
            assert torch.equal(a, b)


# -------------------------------------------------------------------------------------------
# Buffer comm hooks.


def _allreduce_buffers(futures: bool) -> Callable[[Any, dict[str, Tensor]], Any]:
    def hook(ddp: Any, named: dict[str, Tensor]) -> Any:
        works = [dist.all_reduce(b, group=ddp.process_group, async_op=True) for b in named.values()]
        done = [w.get_future() for w in works]  # type: ignore[union-attr]
        if futures:
            return done
        torch.futures.collect_all(done).wait()
        return None

    return hook


@pytest.mark.parametrize(
    ("location", "futures"),
    [
        (_BufferCommHookLocation.PRE_FORWARD, False),
        (_BufferCommHookLocation.POST_FORWARD, False),
        (_BufferCommHookLocation.POST_FORWARD, True),
    ],
    ids=["pre-forward", "post-forward", "post-forward-futures"],
)
def test_buffer_comm_hook_matches_torch(location: _BufferCommHookLocation, futures: bool) -> None:
    """A hook that allreduces the buffers instead of broadcasting them, before or after the
    module runs; returned futures are awaited by the end of backward. (Futures returned
    before forward race with forward's own update of the buffers, in torch as here: torch's
    test leaves that case out, and so does this one.)"""

    def make(cls: type, model: nn.Module) -> nn.Module:
        ddp: nn.Module = cls(model, bucket_cap_mb=1e-4)
        ddp._register_buffer_comm_hook(ddp, _allreduce_buffers(futures), location)
        return ddp

    results = _both(make)
    _assert_identical(results)
    if location == _BufferCommHookLocation.POST_FORWARD:
        # Summed over the ranks after forward (and awaited by the end of backward): the
        # same on every rank.
        assert all(torch.equal(ours[-1][-1], results[0][0][-1][-1]) for ours, _ in results)


def test_buffer_broadcast_through_a_hook_matches_torch() -> None:
    """torch's own example: a hook that calls ddp._default_broadcast_coalesced."""

    def make(cls: type, model: nn.Module) -> nn.Module:
        ddp: nn.Module = cls(model, bucket_cap_mb=1e-4)
        ddp._register_buffer_comm_hook(
            ddp, lambda d, named: d._default_broadcast_coalesced(list(named.values()))
        )
        return ddp

    _assert_identical(_both(make))


def test_a_buffer_comm_hook_returning_one_future_is_told_a_list_was_expected() -> None:
    def fn(pg: fakepg.FakeProcessGroup) -> str:
        model = build()
        ddp = reducer.DistributedDataParallel(model, bucket_cap_mb=1e-4)

        def hook(d: Any, named: dict[str, Tensor]) -> Any:
            work = dist.all_reduce(named["count"], group=d.process_group, async_op=True)
            return work.get_future()  # type: ignore[union-attr]

        ddp._register_buffer_comm_hook(ddp, hook)
        with pytest.raises(
            TypeError, match=r"list of torch\.futures\.Future.*got Future.*\[future\]"
        ):
            ddp(rank_input(pg.rank(), (4, 6)))
        return "told"

    assert fakepg.run_torch(fn, W, timeout=30.0) == ["told"] * W


# -------------------------------------------------------------------------------------------
# Join: the rank the final model came from.


def test_join_records_the_authoritative_rank_as_torch() -> None:
    """Ranks with 1 and 3 batches: after join every rank took rank 1's model, and says so
    in ``_authoritative_rank`` as torch's DDP does (its suite reads it)."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[tuple[int, list[Tensor]]]:
        out = []
        for cls in (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel):
            model = build()
            ddp = cls(model, bucket_cap_mb=1e-4)
            with ddp.join():
                for step in range(1 + 2 * pg.rank()):
                    ddp(rank_input(pg.rank(), (4, 6), step)).pow(2).sum().backward()
            out.append((ddp._authoritative_rank, [p.detach().clone() for p in model.parameters()]))
        return out

    for (ours_rank, ours), (theirs_rank, theirs) in fakepg.run_torch(fn, W, timeout=60.0):
        assert ours_rank == theirs_rank == W - 1
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


# -------------------------------------------------------------------------------------------
# The calls torch's tools make on a wrapper.


def test_parameter_calls_answer_as_torchs() -> None:
    """_build_params_for_reducer, _build_debug_param_to_name_mapping (and its errors),
    _get_data_parallel_params, bucket_bytes_cap_list and broadcast_bucket_size."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[Any]:
        answers = []
        for cls in (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel):
            model = build()
            cls._set_params_and_buffers_to_ignore_for_model(model, ["a.bias"])
            ddp = cls(model, bucket_cap_mb_list=[1, 2])
            params, sparse = ddp._build_params_for_reducer()
            mapping = ddp._build_debug_param_to_name_mapping(params)
            with pytest.raises(ValueError, match="Expected param to name mapping"):
                ddp._build_debug_param_to_name_mapping([*params, nn.Parameter(torch.ones(1))])
            with pytest.raises(ValueError, match="Param with name"):
                ddp._build_debug_param_to_name_mapping(params[:-1])
            # By name: torch's filters nothing (it looks for the mark on the (name, param)
            # pair); this one leaves the ignored parameter out, as without names.
            named = [n for n, _ in cls._get_data_parallel_params(model, named_params=True)]
            unnamed = [id(p) for p in cls._get_data_parallel_params(model)]
            answers.append(
                (
                    named,
                    [id(p) for p in params],
                    list(sparse),
                    mapping,
                    [id(p) for n, p in model.named_parameters() if n != "a.bias"] == unnamed,
                    ddp.bucket_bytes_cap_list,
                    ddp.broadcast_bucket_size,
                )
            )
        return answers

    for ours, theirs in fakepg.run_torch(fn, W, timeout=30.0):
        assert ours[2:] == theirs[2:]
        assert len(ours[1]) == len(theirs[1]) == 3  # a.weight, b.weight, b.bias
        assert ours[0] == ["frozen", "a.weight", "b.weight", "b.bias"]


def test_a_compiled_wrapper_trains_as_torchs_ddp(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile(ddp) runs the wrapper eagerly (see DistributedDataParallel.forward):
    the same bits as torch's DDP, with static_graph. Each runs in a world of its own: torch
    marks its DDP active in a class attribute that every thread sees, and dynamo, compiling
    in the same threads, takes it for its own. For the same reason dynamo's optimizer for
    torch's DDP (which splits torch's DDP graphs at its buckets) is off, and dynamo starts
    afresh.

    The option is switched off with dynamo's own ``config.patch``: its entries are context
    variables behind the config module's ``__getattr__``/``__delattr__``, and undoing pytest's
    ``monkeypatch`` of one can delete (hide) it, after which every later torch DDP in the
    process raises AttributeError reading it."""
    import torch._dynamo

    # A torch DDP of an earlier test, stopped mid-forward by a failing rank, can leave itself
    # marked active.
    monkeypatch.setattr(nn.parallel.DistributedDataParallel, "_active_ddp_module", None)
    with torch._dynamo.config.patch(optimize_ddp=False):
        torch._dynamo.reset()
        _compiled_and_eager_agree()
    torch._dynamo.reset()  # nothing compiled under the patch outlives it


def _compiled_and_eager_agree() -> None:
    def ours(pg: fakepg.FakeProcessGroup) -> list[list[Tensor]]:
        model = build()
        ddp = torch.compile(reducer.DistributedDataParallel(model, static_graph=True))
        return _train(ddp, model, pg.rank())

    def theirs(pg: fakepg.FakeProcessGroup) -> list[list[Tensor]]:
        model = build()
        ddp = nn.parallel.DistributedDataParallel(model, static_graph=True)
        return _train(ddp, model, pg.rank())

    compiled = fakepg.run_torch(ours, W, timeout=120.0)
    eager = fakepg.run_torch(theirs, W, timeout=120.0)
    _assert_identical(list(zip(compiled, eager, strict=True)))


def test_an_output_sink_without_clones_matches_torch() -> None:
    """_set_ddp_sink_clone(False): outputs pass the sink as views, not copies; the same bits."""

    def make(cls: type, model: nn.Module) -> nn.Module:
        ddp: nn.Module = cls(model, bucket_cap_mb=1e-4, find_unused_parameters=True)
        ddp._set_ddp_sink_clone(False)
        return ddp

    _assert_identical(_both(make, dead=True))


def test_errors_are_in_the_logging_data_as_torchs() -> None:
    """A refused comm hook and a late _set_static_graph: the error, with torch's phrases, is
    in _get_ddp_logging_data()["error"], as torch's tools (verify_ddp_error_logged) read it."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[Any]:
        found = []
        for cls in (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel):
            ddp = cls(build())
            assert "has_error" not in ddp._get_ddp_logging_data()
            with pytest.raises(TypeError, match="must be callable"):
                ddp.register_comm_hook({}, {})
            data = ddp._get_ddp_logging_data()
            found.append((data["has_error"], "must be callable" in data["error"]))
            ddp(rank_input(pg.rank(), (4, 6))).sum().backward()
            with pytest.raises(RuntimeError, match="should be called before training loop"):
                ddp._set_static_graph()
            error = ddp._get_ddp_logging_data()["error"]
            found.append("should be called before training loop starts" in error)
        return found

    for ours_and_theirs in fakepg.run_torch(fn, W, timeout=30.0):
        assert ours_and_theirs == [(1, True), True] * 2


def test_sync_batchnorm_in_a_cpu_module_is_refused_as_by_torch() -> None:
    """torch's DDP refuses SyncBatchNorm in a CPU module at construction (ValueError, its
    phrase); so does this one, naming the layer."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[str]:
        messages = []
        for cls in (reducer.DistributedDataParallel, nn.parallel.DistributedDataParallel):
            model = nn.Sequential(nn.Linear(4, 4), nn.SyncBatchNorm(4))
            with pytest.raises(ValueError, match="SyncBatchNorm layers only work with GPU"):
                cls(model)
            messages.append("done")
        return messages

    assert fakepg.run_torch(fn, W, timeout=30.0) == [["done", "done"]] * W


def test_training_errors_contain_torchs_phrases() -> None:
    """An unused parameter without the search, and a static graph that changed: the errors
    have this wrapper's detail and torch's phrases, which torch's tests and log searches
    look for."""

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(4, 4)
            self.spare = nn.Linear(4, 4)

        def forward(self, x: Tensor, both: bool = False) -> Tensor:
            out: Tensor = self.used(x)
            return self.spare(out) if both else out

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[str, str]:
        x = rank_input(pg.rank(), (2, 4))
        ddp = reducer.DistributedDataParallel(seeded(Two), pg)
        ddp(x).sum().backward()
        with pytest.raises(RuntimeError) as unfinished:
            ddp(x)
        ddp.close()
        static = reducer.DistributedDataParallel(seeded(Two), pg, static_graph=True)
        static(x).sum().backward()
        with pytest.raises(RuntimeError) as changed:
            static(x, both=True).sum().backward()
        return str(unfinished.value), str(changed.value)

    for rank, (unfinished, changed) in enumerate(run_ranks(fn, W)):
        assert "Expected to have finished reduction in the prior iteration" in unfinished
        assert "passing the keyword argument `find_unused_parameters=True`" in unfinished
        assert "`forward` function outputs participate in calculating loss" in unfinished
        assert f"did not receive grad for rank {rank}: spare.weight, spare.bias" in unfinished
        assert "Your training graph has changed in this iteration" in changed
