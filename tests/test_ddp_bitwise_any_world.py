"""Differential at world sizes that are not powers of two: bit for bit with torch's DDP.

At W = 3, 5 and 6, ``g / W`` and ``g * (1.0 / W)`` differ in the last bit, so these runs tell
the two roundings apart. reducer.DistributedDataParallel and
torch.nn.parallel.DistributedDataParallel run in the same rank threads of one fake world (the
"fakepg" torch backend), on copies of one model fed the same data, each with its own SGD
optimizer; every gradient and every parameter after every step must be bit-identical, on
every path torch scales on, each rounded as torch rounds it (see Note [Gradient scaling] in
reducer.bucket_views):

- multiplied by ``1.0 / W``: the default copy into the bucket, a fresh gradient copied into
  its bucket view (gradient_as_bucket_view after ``zero_grad(set_to_none=True)``, or created
  under no_sync), ``backward(create_graph=True)``, and the join divisor (the ranks still
  training, with ``divide_by_initial_world_size=False``);
- divided by W: a gradient accumulated into its bucket view in place (``.grad`` kept between
  iterations), a sparse gradient, and every built-in comm hook (allreduce, fp16 and bf16
  compression and their wrappers, PowerSGD, post-local SGD; torch's Python hooks and its
  C++ ALLREDUCE and FP16_COMPRESS hooks all divide; the latter's future cannot run on the
  fake world's torch backend, so only ALLREDUCE is compared).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import assert_gradients_bit_identical, mlp, rank_input, reducer_for, seeded
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as torch_post_local
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd

import fakepg
import reducer
from reducer.testing.reference import rank_order_average

WORLD_SIZES = [3, 5, 6]
STEPS = 3


pytestmark = pytest.mark.usefixtures("fakepg_torch_backend")


class Net(nn.Module):
    """A trunk, a head used on some ranks and steps (with ``unused``), and with ``sparse`` an
    embedding with sparse gradients in front."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, 6, sparse=True) if sparse else None
        self.trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8))
        self.heads = nn.ModuleList([nn.Linear(8, 3), nn.Linear(8, 3)])

    def forward(self, x: Tensor, use_head1: bool) -> Tensor:
        if self.embedding is not None:
            x = x + self.embedding((x.abs() * 3).long().clamp(max=9)).sum(1)
        h = torch.tanh(self.trunk(x))
        out: Tensor = self.heads[0](h)
        if use_head1:
            out = out + self.heads[1](h)
        return out


class Powers(nn.Module):
    """For ``backward(create_graph=True)``, as torch's own DDP test of it: one parameter
    raised to a power, times a rank- and step-dependent constant, so that its gradient has a
    graph (torch's DDP fails there with a second parameter in the model: "a leaf Variable
    that requires grad is being used in an in-place operation")."""

    def __init__(self) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.linspace(-1.3, 1.7, 7))

    def forward(self, rank: int, step: int) -> Tensor:
        out: Tensor = (self.p.pow(3) * (1.3 + rank + 0.7 * step)).sum()
        return out


Trace = list[tuple[list[Tensor | None], list[Tensor]]]  # per step: gradients, parameters


def run_both(
    world_size: int,
    *,
    unused: bool = False,
    as_view: bool = False,
    zero: str = "none",
    sparse: bool = False,
    create_graph: bool = False,
    no_sync: bool = False,
    hooks: Callable[[fakepg.FakeProcessGroup], tuple[Any, Any, Any, Any]] | None = None,
    cap_mb: float = 1e-4,
) -> list[tuple[Trace, Trace]]:
    """Per rank, both wrappers' traces over ``STEPS`` steps. ``zero``: "none" (set_to_none),
    "zero" (zeroed in place) or "keep" (.grad kept: accumulated into). ``no_sync``: a local
    backward before each synced one. ``hooks(pg)`` gives (our state, our hook, torch's state,
    torch's hook); torch's hook may be a ``dist.BuiltinCommHookType``."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[Trace, Trace]:
        torch.get_num_threads()  # this thread's intra-op thread count, before any kernel
        build = Powers if create_graph else lambda: Net(sparse)
        models: list[nn.Module] = [seeded(build, seed=5) for _ in range(2)]
        options = {
            "bucket_cap_mb": cap_mb,
            "find_unused_parameters": unused,
            "gradient_as_bucket_view": as_view,
        }
        ours = reducer.DistributedDataParallel(models[0], pg, **options)  # type: ignore[arg-type]
        theirs = nn.parallel.DistributedDataParallel(models[1], **options)  # type: ignore[arg-type]
        if hooks is not None:
            our_state, our_hook, their_state, their_hook = hooks(pg)
            ours.register_comm_hook(our_state, our_hook)
            if isinstance(their_hook, dist.BuiltinCommHookType):
                theirs._register_builtin_comm_hook(their_hook)
            else:
                theirs.register_comm_hook(their_state, their_hook)
        traces: tuple[Trace, Trace] = ([], [])
        for ddp, model, trace in zip((ours, theirs), models, traces, strict=True):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for step in range(STEPS):
                if zero != "keep":
                    opt.zero_grad(set_to_none=zero == "none")
                use = not unused or (pg.rank() + step) % 3 == 0
                if no_sync:
                    with ddp.no_sync():  # type: ignore[operator]
                        ddp(rank_input(pg.rank(), (4, 6), 100 + step), use).pow(2).sum().backward()
                if create_graph:
                    ddp(pg.rank(), step).backward(create_graph=True)
                else:
                    ddp(rank_input(pg.rank(), (4, 6), step), use).pow(2).sum().backward()
                grads = [
                    None if p.grad is None else p.grad.detach().clone() for p in model.parameters()
                ]
                opt.step()
                trace.append((grads, [p.detach().clone() for p in model.parameters()]))
        return traces

    return fakepg.run_torch(fn, world_size, timeout=60.0)


def assert_bitwise(results: list[tuple[Trace, Trace]]) -> None:
    names = [n for n, _ in Net(sparse=True).named_parameters()]
    count = len(results[0][0][0][0])
    names = names if len(names) == count else names[1:] if count == len(names) - 1 else ["p"]
    for rank, (ours, theirs) in enumerate(results):
        for step, ((grads, params), (their_grads, their_params)) in enumerate(
            zip(ours, theirs, strict=True)
        ):
            assert_gradients_bit_identical(names, grads, their_grads, f"rank {rank}, step {step}")
            for name, a, b in zip(names, params, their_params, strict=True):
                assert torch.equal(a, b), f"{name} after step {step}, rank {rank}"


PATHS: dict[str, dict[str, Any]] = {
    "default": {},
    "unused parameters": {"unused": True},
    "bucket view, set to None": {"as_view": True},
    "bucket view, zeroed in place": {"as_view": True, "zero": "zero"},
    "bucket view, accumulated": {"as_view": True, "zero": "keep"},
    "bucket view, no_sync": {"as_view": True, "no_sync": True},
    "bucket view, no_sync, zeroed in place": {"as_view": True, "no_sync": True, "zero": "zero"},
    "create_graph": {"create_graph": True, "zero": "keep"},
    "create_graph, bucket view": {"create_graph": True, "as_view": True, "zero": "keep"},
    "sparse": {"sparse": True},
}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("path", list(PATHS))
def test_bitwise_with_torchs_ddp(world_size: int, path: str) -> None:
    assert_bitwise(run_both(world_size, **PATHS[path]))


def _same(ours: Any, theirs: Any) -> Callable[[fakepg.FakeProcessGroup], tuple[Any, ...]]:
    return lambda pg: (None, ours, None, theirs)


def _powersgd(pg: fakepg.FakeProcessGroup) -> tuple[Any, ...]:
    config = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2}
    return (
        reducer.PowerSGDState(None, **config),
        reducer.powerSGD_hook,
        torch_powersgd.PowerSGDState(None, **config),
        torch_powersgd.powerSGD_hook,
    )


def _post_local_sgd(pg: fakepg.FakeProcessGroup) -> tuple[Any, ...]:
    # The subgroup: the whole world, given explicitly (the fake world makes no subgroups).
    return (
        reducer.PostLocalSGDState(None, dist.group.WORLD, start_localSGD_iter=2),
        reducer.post_localSGD_hook,
        torch_post_local.PostLocalSGDState(None, dist.group.WORLD, start_localSGD_iter=2),
        torch_post_local.post_localSGD_hook,
    )


def _passthrough(hook: Any) -> Any:
    """``hook`` under another name: torch's DDP refuses its bf16 hooks by name unless CUDA and
    NCCL are there, though the hook itself runs anywhere. Unannotated: torch checks the
    annotations, which this module's ``from __future__ import annotations`` makes strings."""

    def torch_hook(state, bucket):  # type: ignore[no-untyped-def]  # torch reads annotations
        return hook(state, bucket)

    return torch_hook


HOOKS: dict[str, Callable[[fakepg.FakeProcessGroup], tuple[Any, ...]]] = {
    "allreduce": _same(reducer.allreduce_hook, default_hooks.allreduce_hook),
    "fp16": _same(reducer.fp16_compress_hook, default_hooks.fp16_compress_hook),
    "bf16": _same(reducer.bf16_compress_hook, _passthrough(default_hooks.bf16_compress_hook)),
    "fp16 wrapper": _same(
        reducer.fp16_compress_wrapper(reducer.allreduce_hook),
        default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
    ),
    "bf16 wrapper": _same(
        reducer.bf16_compress_wrapper(reducer.allreduce_hook),
        _passthrough(default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook)),
    ),
    "torch's C++ ALLREDUCE": _same(reducer.allreduce_hook, dist.BuiltinCommHookType.ALLREDUCE),
    "PowerSGD": _powersgd,
    "post-local SGD": _post_local_sgd,
}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("hook", list(HOOKS))
def test_builtin_hooks_bitwise_with_torchs(world_size: int, hook: str) -> None:
    # torch's PowerSGD issues its collectives from future callbacks, which can overtake the
    # next bucket's on one rank and not on another: one bucket, as torch's tests have it.
    cap_mb = 25.0 if hook == "PowerSGD" else 1e-4
    assert_bitwise(run_both(world_size, hooks=HOOKS[hook], cap_mb=cap_mb))


# Rank r trains BATCHES[W][r] steps: the number still training, torch's divisor with
# divide_by_initial_world_size=False, takes values that are not powers of two.
BATCHES = {3: [1, 3, 2], 5: [2, 4, 1, 4, 3], 6: [3, 1, 4, 2, 4, 2]}


def run_join_both(batches: list[int], divide_by_initial: bool) -> list[tuple[Trace, Trace]]:
    """Rank r trains ``batches[r]`` steps inside ``join``; per rank, both wrappers' traces
    (one entry per step trained, then the final parameters with no gradients)."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[Trace, Trace]:
        torch.get_num_threads()
        models = [seeded(lambda: Net(sparse=False), seed=5) for _ in range(2)]
        wrappers: tuple[Any, Any] = (
            reducer.DistributedDataParallel(models[0], bucket_cap_mb=1e-4),
            nn.parallel.DistributedDataParallel(models[1], bucket_cap_mb=1e-4),
        )
        traces: tuple[Trace, Trace] = ([], [])
        for ddp, model, trace in zip(wrappers, models, traces, strict=True):
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with ddp.join(divide_by_initial_world_size=divide_by_initial):
                for step in range(batches[pg.rank()]):
                    opt.zero_grad(set_to_none=True)
                    ddp(rank_input(pg.rank(), (4, 6), step), True).pow(2).sum().backward()
                    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
                    opt.step()
                    trace.append((grads, [p.detach().clone() for p in model.parameters()]))
            trace.append(([None] * len(grads), [p.detach().clone() for p in model.parameters()]))
        return traces

    return fakepg.run_torch(fn, len(batches), timeout=60.0)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("divide_by_initial", [True, False], ids=["by-world-size", "by-training"])
def test_join_with_uneven_inputs_bitwise_with_torchs(
    world_size: int, divide_by_initial: bool
) -> None:
    batches = BATCHES[world_size]
    results = run_join_both(batches, divide_by_initial)
    for rank, (ours, theirs) in enumerate(results):
        assert len(ours) == len(theirs) == batches[rank] + 1
    assert_bitwise(results)


# -------------------------------------------------------------------------------------------
# The bare Reducer's option.


@pytest.mark.parametrize("as_view", [False, True])
@pytest.mark.parametrize("scaling", ["divide", "reciprocal"])
def test_reducer_scales_as_its_gradient_scaling_says(scaling: str, as_view: bool) -> None:
    """At W = 3 each mode gives its own reference's bits (and the two references differ)."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[Tensor]:
        model = mlp()
        with reducer_for(
            model, pg, gradient_scaling=scaling, gradient_as_bucket_view=as_view
        ) as red:
            assert red.gradient_scaling == scaling
            red.prepare_for_backward([])
            model(rank_input(pg.rank(), (4, 6))).pow(2).sum().backward()
        return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    results = fakepg.run(fn, 3, timeout=20.0)
    per_rank = []
    for rank in range(3):
        model = mlp()
        model(rank_input(rank, (4, 6))).pow(2).sum().backward()
        per_rank.append([p.grad for p in model.parameters()])
    differ = False
    for i in range(len(per_rank[0])):
        column = [g[i] for g in per_rank]
        want = rank_order_average(column, 3, scaling=scaling)  # type: ignore[arg-type]
        other = rank_order_average(
            column, 3, scaling="divide" if scaling != "divide" else "reciprocal"
        )
        assert want is not None and other is not None
        differ = differ or not torch.equal(want, other)
        for rank, grads in enumerate(results):
            assert torch.equal(grads[i], want), f"parameter {i}, rank {rank}"
    assert differ, "the two roundings agree on this data: the test would not tell them apart"


def test_an_unknown_gradient_scaling_is_refused() -> None:
    with fakepg.World(1) as world, pytest.raises(reducer.InvalidArgument, match="gradient_scaling"):
        reducer.Reducer(
            [[nn.Parameter(torch.ones(2))]], [[0]], world.group(0), gradient_scaling="mul"
        )  # type: ignore[arg-type]
