"""The reducer on a GPU: the fake world's rank threads sharing one device, torch's DDP against
this one with CUDA tensors, the property harness on a device, and NCCL at one rank.

Every check is parametrized by device: the ``cpu`` case runs everywhere (the same code, so the
test itself is exercised in CI), the ``cuda`` case skips without a CUDA GPU, saying so.
``bash benchmarks/gpu_check.sh`` runs the ``cuda`` cases (``pytest tests/test_gpu.py -k cuda``).

What the device changes, and what each test pins:

- autograd runs CUDA backward on one engine thread per device, shared by every thread of the
  process; rank threads on one GPU would share it, and a rank waiting in its end-of-backward
  callback would block its peers' backward (see Note [Each rank runs its own backward] in
  fakepg.world). The first two tests would time out (or see the hooks on another thread).
- NCCL reduces CUDA tensors only: the reducer's used map of find_unused_parameters is
  allreduced on the parameters' device.
- Bitwise comparisons need the same kernels on both sides: every model, reference and input
  lives on the device under test, and W is a power of two where torch's DDP multiplies by
  1 / W while this reducer divides by W (the same bits then).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import rank_input, seeded
from torch import Tensor, nn

import fakepg
import reducer
from reducer.testing import harness
from reducer.testing.model import BranchSpec, ModelSpec
from reducer.testing.reference import rank_order_average
from reducer.tools import simulate

NO_CUDA = "needs a CUDA GPU (torch.cuda.is_available() is False)"
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA))
DEVICES = ["cpu", CUDA]
STEPS = 3


pytestmark = pytest.mark.usefixtures("fakepg_torch_backend")


class Heads(nn.Module):
    """A trunk and two heads (head 1 skipped on some ranks and steps), and with ``dead`` a
    layer no rank uses."""

    def __init__(self, dead: bool) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8))
        self.heads = nn.ModuleList([nn.Linear(8, 3), nn.Linear(8, 3)])
        self.dead = nn.Linear(8, 3) if dead else None

    def forward(self, x: Tensor, use_head1: bool = True) -> Tensor:
        h = torch.tanh(self.trunk(x))
        out: Tensor = self.heads[0](h)
        if use_head1:
            out = out + self.heads[1](h)
        return out


def build(device: str, dead: bool = True) -> Heads:
    return seeded(lambda: Heads(dead), seed=7).to(device)


def uses_head1(rank: int, step: int, skew: bool) -> bool:
    return not skew or (rank + step) % 2 == 0


# -------------------------------------------------------------------------------------------
# The fake world on one device.


@pytest.mark.parametrize("device", DEVICES)
def test_rank_threads_run_their_own_backward(device: str) -> None:
    """Hooks run on the rank's own thread (autograd's multithreading off there, and only
    there), so a rank waiting in a callback cannot hold up another rank's backward."""

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[int, set[int], bool]:
        model = build(device)
        seen: set[int] = set()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda _p: seen.add(threading.get_ident()))
        model(rank_input(pg.rank(), (4, 6)).to(device)).sum().backward()
        return threading.get_ident(), seen, torch._C._is_multithreading_enabled()

    for me, hook_threads, multithreading in fakepg.run(fn, 2, timeout=20.0):
        assert hook_threads == {me}
        assert multithreading is False
    assert torch._C._is_multithreading_enabled()  # the calling thread keeps its setting


class RecordingGroup:
    """A rank's FakeProcessGroup that records the dtype and device of every allreduce."""

    def __init__(self, pg: fakepg.FakeProcessGroup) -> None:
        self.pg = pg
        self.allreduces: list[tuple[torch.dtype, torch.device]] = []

    def rank(self) -> int:
        return self.pg.rank()

    def size(self) -> int:
        return self.pg.size()

    def allreduce(self, tensors: list[Tensor], op: reducer.ReduceOp = reducer.ReduceOp.SUM) -> Any:
        self.allreduces += [(t.dtype, t.device) for t in tensors]
        return self.pg.allreduce(tensors, op)

    def allgather(self, output_lists: list[list[Tensor]], inputs: list[Tensor]) -> Any:
        return self.pg.allgather(output_lists, inputs)

    def broadcast(self, tensors: list[Tensor], root: int) -> Any:
        return self.pg.broadcast(tensors, root)

    def barrier(self) -> Any:
        return self.pg.barrier()


def local_grads(device: str, rank: int, step: int) -> list[Tensor | None]:
    model = build(device)
    model(rank_input(rank, (4, 6), step).to(device), uses_head1(rank, step, True)).sum().backward()
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("device", DEVICES)
def test_four_ranks_on_one_device_average_exactly(device: str) -> None:
    """W = 4 rank threads, find_unused_parameters with a head used on even ranks only and a
    layer used nowhere: every gradient is the rank-order average bit for bit, the unused
    layer keeps .grad None, and the used map is reduced on the parameters' device."""
    world = 4

    def fn(pg: fakepg.FakeProcessGroup) -> tuple[list[Tensor | None], list[Any]]:
        model = build(device)
        group = RecordingGroup(pg)
        params = list(model.parameters())
        buckets = reducer.ddp_bucket_assignment(params, bucket_cap_mb=1e-4, first_bucket_mb=1e-4)
        with reducer.Reducer([params], buckets, group) as red:  # type: ignore[arg-type]
            x = rank_input(pg.rank(), (4, 6), 0).to(device)
            out = model(x, uses_head1(pg.rank(), 0, True))
            red.prepare_for_backward([out])
            out.sum().backward()
        return [None if p.grad is None else p.grad.clone() for p in params], group.allreduces

    results = fakepg.run(fn, world, timeout=20.0)
    per_rank = [local_grads(device, r, 0) for r in range(world)]
    names = [n for n, _ in build("cpu").named_parameters()]
    for i, name in enumerate(names):
        want = rank_order_average([g[i] for g in per_rank], world)
        for rank, (grads, _) in enumerate(results):
            got = grads[i]
            if want is None:
                assert got is None, f"{name}, rank {rank}: unused everywhere, .grad must stay"
                continue
            assert got is not None and got.device.type == device, f"{name}, rank {rank}"
            assert torch.equal(got, want), f"{name}, rank {rank}: not the rank-order average"
    for _, allreduces in results:
        used_maps = [d for dtype, d in allreduces if dtype == torch.int32]
        assert len(used_maps) == 1 and used_maps[0].type == device
        assert all(d.type == device for _, d in allreduces)


@pytest.mark.parametrize("device", [CUDA])
def test_a_collective_waits_for_the_stream_that_wrote_its_input(device: str) -> None:
    """NCCL's stream order (Note [Stream order of a collective] in fakepg.streams): each
    rank writes its input on a stream of its own behind a kernel that sleeps (the host runs
    ahead of it), issues an allreduce and waits for it there, and copies the result on that
    stream. Without the order, the world's kernel reads the input before it is written, or
    the copy runs before the reduction; either way a rank would not see 1 + 2 + 3."""

    def fn(pg: fakepg.FakeProcessGroup) -> Tensor:
        x = torch.zeros(1 << 20, device=device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())  # the zeros before anything on it
        with torch.cuda.stream(stream):
            torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU cycles before the write
            x.fill_(float(pg.rank() + 1))
            pg.allreduce([x]).wait()
            result = x.clone()
        stream.synchronize()
        return result

    for rank, result in enumerate(fakepg.run(fn, 3, timeout=30.0)):
        assert torch.equal(result, torch.full_like(result, 6.0)), f"rank {rank}"


# -------------------------------------------------------------------------------------------
# Against torch's DDP.


Trace = list[tuple[list[Tensor | None], list[Tensor]]]  # per step: grads, then parameters


def train_both(
    device: str, rank: int, ours_group: reducer.ProcessGroup, options: dict[str, bool]
) -> tuple[Trace, Trace]:
    """Both wrappers on copies of one model, STEPS SGD steps on the same data; with
    ``no_sync``, a local micro-step before each synced one."""
    find_unused = options.get("find_unused", False)
    as_view = options.get("as_view", False)
    ours_model, theirs_model = build(device, find_unused), build(device, find_unused)
    ours = reducer.DistributedDataParallel(
        ours_model,
        ours_group,
        bucket_cap_mb=1e-4,
        find_unused_parameters=find_unused,
        gradient_as_bucket_view=as_view,
    )
    theirs = nn.parallel.DistributedDataParallel(
        theirs_model,
        device_ids=[torch.device(device)] if device == "cuda" else None,
        bucket_cap_mb=1e-4,
        find_unused_parameters=find_unused,
        gradient_as_bucket_view=as_view,
    )
    traces: tuple[Trace, Trace] = ([], [])
    pairs = ((ours, ours_model), (theirs, theirs_model))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for _, m in pairs]
    for step in range(STEPS):
        x = rank_input(rank, (4, 6), step).to(device)
        use = uses_head1(rank, step, find_unused)
        for (ddp, model), opt, trace in zip(pairs, optimizers, traces, strict=True):
            opt.zero_grad(set_to_none=True)
            if options.get("no_sync", False):
                local = rank_input(rank + 100, (4, 6), step).to(device)
                with ddp.no_sync():
                    ddp(local, use).pow(2).sum().backward()
            ddp(x, use).pow(2).sum().backward()
            grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
            opt.step()
            trace.append((grads, [p.detach().clone() for p in model.parameters()]))
    return traces


def assert_bit_identical(ours: Trace, theirs: Trace, where: str) -> None:
    for step, ((g_ours, p_ours), (g_theirs, p_theirs)) in enumerate(zip(ours, theirs, strict=True)):
        for i, (a, b) in enumerate(zip(g_ours, g_theirs, strict=True)):
            at = f"{where}, step {step}, grad {i}"
            assert (a is None) == (b is None), f"{at}: one side has no gradient"
            assert a is None or b is None or torch.equal(a, b), f"{at}: not bit-identical"
        for i, (a, b) in enumerate(zip(p_ours, p_theirs, strict=True)):
            assert torch.equal(a, b), f"{where}, step {step}, param {i}: not bit-identical"


CONFIGS = [{}, {"as_view": True}, {"find_unused": True}, {"no_sync": True}]
CONFIG_IDS = ["default", "views", "unused", "no_sync"]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("device", DEVICES)
def test_fake_world_same_bits_as_torch_ddp(device: str, world_size: int) -> None:
    """Both wrappers in the same rank threads on one fake world; this one on the rank's
    FakeProcessGroup, torch's on the "fakepg" torch backend."""

    def fn(pg: fakepg.FakeProcessGroup) -> list[tuple[Trace, Trace]]:
        return [train_both(device, pg.rank(), pg, options) for options in CONFIGS]

    for rank, per_config in enumerate(fakepg.run_torch(fn, world_size, timeout=30.0)):
        for label, (ours, theirs) in zip(CONFIG_IDS, per_config, strict=True):
            assert_bit_identical(ours, theirs, f"{label}, rank {rank}")


@pytest.fixture
def one_rank_group(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """torch.distributed's default group of one rank in this process, on gloo or NCCL."""
    backend, device = request.param
    if backend == "nccl" and not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    if dist.is_initialized():
        pytest.fail("a default process group is already initialized in this process")
    dist.init_process_group(
        backend,
        rank=0,
        world_size=1,
        store=dist.HashStore(),  # type: ignore[attr-defined]
        device_id=torch.device("cuda", 0) if device == "cuda" else None,
    )
    try:
        yield backend, device
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "one_rank_group",
    [
        ("gloo", "cpu"),
        pytest.param(
            ("nccl", "cuda"),
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA),
        ),
    ],
    ids=["gloo-cpu", "nccl-cuda"],
    indirect=True,
)
@pytest.mark.parametrize("options", CONFIGS, ids=CONFIG_IDS)
def test_one_rank_real_backend_same_bits_as_torch_ddp(
    one_rank_group: tuple[str, str], options: dict[str, bool]
) -> None:
    """This wrapper over reducer.TorchProcessGroup and torch's DDP on the same group."""
    backend, device = one_rank_group
    group = reducer.TorchProcessGroup(dist.group.WORLD)  # type: ignore[arg-type]
    assert group.backend == backend
    ours, theirs = train_both(device, 0, group, options)
    assert_bit_identical(ours, theirs, f"{backend} on {device}")


# -------------------------------------------------------------------------------------------
# The property harness and the simulation on a device.

# A linear branch, an optional sparse embedding (parameter 2), an optional conv2d with a head.
_SPEC = ModelSpec(
    (
        BranchSpec("linear"),
        BranchSpec("embedding", sparse=True, optional=True),
        BranchSpec("conv2d", head=True, optional=True),
    ),
    seed=5,
)
_SCENARIO = harness.Scenario(
    _SPEC,
    world_size=4,
    replicas=1,
    buckets=((5, 4), (3,), (2,), (1, 0)),
    # A local step with everything, then a synced one: rank 0 skips the embedding, every rank
    # skips the conv branch (locally used only through the local step on ranks 0 and 1).
    steps=(
        (frozenset({1, 2}), frozenset({1, 2}), frozenset({1}), frozenset({1})),
        (frozenset(), frozenset({1}), frozenset({1}), frozenset({1})),
    ),
    find_unused=True,
    preset_grads=True,
    preset_sparse=True,
)


@pytest.mark.parametrize("device", DEVICES)
def test_the_harness_runs_on_the_device_its_variable_names(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(harness.DEVICE_VARIABLE, device)
    assert harness.harness_device().type == device
    got = harness.run_reducer(_SCENARIO)
    grads = [g for per_rank in got for replica in per_rank for g in replica if g is not None]
    # Every .grad was preset, so every parameter of every rank has one.
    assert len(grads) == 4 * 6 and {g.device.type for g in grads} == {device}
    harness.assert_matches_reference(got, _SCENARIO)


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        ("nonsense", ValueError, "PROPERTY_TESTS_DEVICE='nonsense' is not a torch device"),
        ("meta", ValueError, "PROPERTY_TESTS_DEVICE='meta': the harness runs on cpu or cuda"),
    ],
    ids=["not-a-device", "meta"],
)
def test_a_bad_harness_device_names_the_variable(
    value: str, error: type[Exception], words: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(harness.DEVICE_VARIABLE, value)
    with pytest.raises(error, match=words):
        harness.run_reducer(_SCENARIO)


def test_the_harness_defaults_to_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(harness.DEVICE_VARIABLE, raising=False)
    assert harness.harness_device() == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible here")
def test_the_harness_on_a_gpu_without_one_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(harness.DEVICE_VARIABLE, "cuda")
    with pytest.raises(RuntimeError, match="torch sees no CUDA device here; unset it"):
        harness.harness_device()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_simulate_transformer_block_four_ranks_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--model", "transformer-block", "--device", "cuda", "--world-size", "4"]
    code = simulate.main([*args, "--steps", "3", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "verification: passed: 3 steps x 4 ranks" in out and "bit-exact" in out
    assert "device: cuda:" in out
