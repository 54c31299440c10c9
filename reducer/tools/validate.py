"""Run the validation suite: the reducer on a real or fake backend, checked exactly.

    python -m reducer validate --backend gloo --nproc 2      # 2 processes, localhost rendezvous
    python -m reducer validate --backend fakepg --nproc 3    # 3 threads on the fake world
    python -m reducer validate --backend nccl --nproc 8      # one GPU per rank
    python -m reducer validate --backend gloo --device cuda  # CUDA tensors over gloo
    torchrun --nnodes 2 --nproc-per-node 8 ... -m reducer validate --backend nccl

Without RANK and WORLD_SIZE in the environment it starts --nproc ranks itself: processes for
gloo and NCCL, each given MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE (and OMP_NUM_THREADS=1 unless set) as torchrun sets them; threads
for fakepg. Under torchrun it joins the existing rendezvous instead, so the same suite runs
across machines. Rank 0 prints a table of the checks; the exit code is 1 if any check failed
on any rank. With --backend nccl and fewer GPUs than ranks on the machine it prints why and
exits 0 without starting anything (under torchrun, every rank of the machine skips alike).

--device says where the models and gradients live: cpu (the default for gloo and fakepg) or
cuda (NCCL's only choice). With gloo or fakepg on cuda, ranks may share a GPU: a gloo process
with local rank i uses GPU i mod the GPUs visible (two processes on a one-GPU machine share
it), and fakepg's threads all use the first GPU. Without a GPU, --device cuda prints why and
exits 0, as NCCL does.

The checks build small models whose weights and inputs are integers times powers of two, and
scale each rank's loss by the world size W, so every gradient g is W times a dyadic number
with few significant bits (see Note [Dyadic data]). Then g / W and every sum of such terms are
exact in float32, whatever order a backend adds in, and the reducer's gradients must equal
the expectation computed in float64, bit for bit (torch.equal). Exact data make both
roundings of the scaling give the same bits (``g / W`` and ``g * (1.0 / W)``: see Note
[Gradient scaling] in reducer.bucket_views); each expectation still scales as the reducer
under check does, the bare Reducer by dividing, the comparison with torch's DDP by torch's
reciprocal.
"""

# Note [Dyadic data]
# A float32 holds 24 significant bits. The models are tiny (widths 8, weights in {-1, -0.5, 0,
# 0.5, 1}, inputs in {-1, -0.5, 0, 0.5, 1}, output coefficients the same), so every value in
# forward and backward is a multiple of a small power of two well below 2^24 times that unit:
# no operation rounds. Multiplying the loss by W makes each gradient W * h with h dyadic, so
# the reducer's g / W is h exactly, and sums of h over ranks are exact in any order. Each
# check also verifies that its float64 expectation is representable in float32, so a model
# change that breaks exactness shows as a failure of the data, not of the reducer.

from __future__ import annotations

import argparse
import functools
import os
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn

from reducer.buckets import ddp_bucket_assignment
from reducer.process_group import ProcessGroup
from reducer.reducer import Reducer
from reducer.torch_backend import TorchProcessGroup

__all__ = ["add_arguments", "main", "run"]

BACKENDS = ("fakepg", "gloo", "nccl")
DEVICES = ("cpu", "cuda")
PASS, FAIL, SKIP = "pass", "FAIL", "skip"
# Bucket cap for the multi-bucket checks: 100 bytes, so that the tiny models get several.
_SMALL_BUCKET_MB = 100 / (1 << 20)
_STEPS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", choices=BACKENDS, default="gloo", help="the process group (default: gloo)"
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default=None,
        help="where models and gradients live: cpu (default for gloo and fakepg) or cuda "
        "(NCCL's default and only choice; with gloo or fakepg, ranks may share a GPU)",
    )
    parser.add_argument(
        "--nproc",
        type=int,
        default=2,
        help="ranks to start (default 2); ignored under torchrun, which sets WORLD_SIZE",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        help="seconds for the whole run; every collective wait is bounded by it (default 120)",
    )
    # For the tests of this command: corrupt one check's observed gradients on rank 0, so that
    # the suite must report that check as failed and exit non-zero.
    parser.add_argument("--break-check", default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Validate on ``args.backend``; 0 if every check passed (or NCCL lacks GPUs), else 1."""
    if args.timeout <= 0:
        print(f"validate: --timeout must be > 0 seconds, got {args.timeout}", file=sys.stderr)
        return 2
    if args.backend == "nccl" and args.device == "cpu":
        print(
            "validate: --backend nccl reduces CUDA tensors only; drop --device cpu (NCCL uses "
            "--device cuda), or validate CPU tensors with --backend gloo",
            file=sys.stderr,
        )
        return 2
    if args.break_check is not None and args.break_check not in _CHECK_NAMES:
        print(
            f"validate: --break-check {args.break_check!r} names no check; choose one of "
            f"{', '.join(_CHECK_NAMES)}",
            file=sys.stderr,
        )
        return 2
    with warnings.catch_warnings():
        # torch warns once per process that sparse invariant checks are off; noise here.
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        return _dispatch(args)


def _dispatch(args: argparse.Namespace) -> int:
    backend: str = args.backend
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "fakepg":
            print(
                "validate: --backend fakepg runs every rank as a thread of one process; run it "
                "without torchrun (RANK and WORLD_SIZE are set in this environment)",
                file=sys.stderr,
            )
            return 2
        return _join(args)
    if args.nproc < 1:
        print(f"validate: --nproc must be >= 1, got {args.nproc}", file=sys.stderr)
        return 2
    if backend == "nccl":
        skip = _nccl_skip_reason(args.nproc)
        if skip is not None:
            print(f"validate: skipped: {skip}")
            return 0
    elif args.device == "cuda":
        skip = _cuda_skip_reason()
        if skip is not None:
            print(f"validate: skipped: {skip}")
            return 0
    if backend == "fakepg":
        return _run_fakepg(args)
    return _spawn(args)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m reducer.tools.validate``: the subcommand on its own (what spawned ranks run)."""
    parser = argparse.ArgumentParser(prog="python -m reducer validate", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


# -------------------------------------------------------------------------------------------
# Starting the ranks.


def _nccl_skip_reason(nproc: int, option: str = "--nproc") -> str | None:
    """Why NCCL cannot run ``nproc`` ranks on this machine (one GPU each), or None."""
    gpus = torch.cuda.device_count()
    if gpus < nproc:
        return (
            f"--backend nccl needs one GPU per rank: {nproc} ranks on this machine but "
            f"{gpus} GPU(s) visible; pass {option} {gpus} or fewer, or run on a machine with "
            "more GPUs"
            if gpus
            else f"--backend nccl needs one GPU per rank: {nproc} ranks on this machine but "
            "no GPU visible here"
        )
    if not dist.is_nccl_available():
        return "--backend nccl: this torch build has no NCCL"
    return None


def _cuda_skip_reason() -> str | None:
    """Why --device cuda cannot run here, or None."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"--device cuda: this torch build ({torch.__version__}) has no CUDA"
    return "--device cuda: no GPU visible here (torch.cuda.is_available() is False)"


def _rank_device(backend: str, device: str | None, local_rank: int) -> torch.device:
    """The device of the rank with ``local_rank`` on this machine: its own GPU for NCCL, GPU
    ``local_rank`` mod the GPUs visible for --device cuda (ranks may share one), else the CPU.
    (fakepg passes local rank 0 for every thread: one device for the whole world.)"""
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    if device == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


@contextmanager
def _exact_float32(device: torch.device) -> Iterator[None]:
    """IEEE float32 matmuls and convolutions on CUDA while the checks run: TF32 would round
    the products of the dyadic data (see Note [Dyadic data]). A no-op on the CPU."""
    if device.type != "cuda":
        yield
        return
    precision = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.allow_tf32 = cudnn_tf32


def _free_port() -> int:
    """A TCP port free right now on 127.0.0.1, for rank 0's rendezvous store (as torchrun's
    --standalone picks one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(args: argparse.Namespace) -> int:
    """Start --nproc processes with torchrun's environment; each joins (see ``_join``).

    Every child is waited for with a deadline: once one fails, the others get a short grace
    to fail too (their collectives see the dead peer), then they are terminated, as they are
    when the whole run passes --timeout.
    """
    nproc = int(args.nproc)
    port = _free_port()
    command = _rank_command(args)
    procs: list[subprocess.Popen[bytes]] = []
    for rank in range(nproc):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(nproc),
        )
        if nproc > 1:
            # As torchrun does: ranks that each use every core would fight over them.
            env.setdefault("OMP_NUM_THREADS", "1")
        procs.append(subprocess.Popen(command, env=env))
    deadline = time.monotonic() + args.timeout
    grace_s = 10.0
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + grace_s)
            time.sleep(0.05)
    finally:
        stuck = [rank for rank, p in enumerate(procs) if p.poll() is None]
        _stop(procs)
    codes = [p.returncode for p in procs]
    if stuck:
        print(
            f"validate: rank(s) {', '.join(map(str, stuck))} did not finish within "
            f"{args.timeout:g} s (or {grace_s:g} s after another rank failed) and were "
            "stopped; see their output above, or raise --timeout",
            file=sys.stderr,
        )
        return 1
    if any(codes):
        detail = ", ".join(f"rank {r}: exit code {c}" for r, c in enumerate(codes) if c)
        print(f"validate: {detail}", file=sys.stderr)
        return 1
    return 0


def _rank_command(args: argparse.Namespace) -> list[str]:
    """What each started rank runs: this command with the same options, minus --nproc."""
    command = [sys.executable, "-m", "reducer.tools.validate", "--backend", args.backend]
    if args.device is not None:
        command += ["--device", args.device]
    command += ["--timeout", str(args.timeout)]
    if args.break_check is not None:
        command += ["--break-check", args.break_check]
    return command


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Terminate the children still running (only ours, by handle), then kill stragglers."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(5.0)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5.0)


def _join(args: argparse.Namespace) -> int:
    """Join the rendezvous in the environment (torchrun's, or ``_spawn``'s) and run the suite."""
    backend: str = args.backend
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    # Every rank of this machine sees the same GPUs, so they all skip together (a rank that
    # skipped alone would leave the others waiting in the rendezvous).
    skip = None
    if backend == "nccl":
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        skip = _nccl_skip_reason(max(local_size, local_rank + 1), "--nproc-per-node")
    elif args.device == "cuda":
        skip = _cuda_skip_reason()
    if skip is not None:
        print(f"validate: skipped on rank {rank}: {skip}")
        return 0
    device = _rank_device(backend, args.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with _exact_float32(device):
        return _join_and_check(args, rank, world_size, device)


def _join_and_check(
    args: argparse.Namespace, rank: int, world_size: int, device: torch.device
) -> int:
    backend: str = args.backend
    dist.init_process_group(
        backend,
        timeout=timedelta(seconds=args.timeout),
        device_id=device if backend == "nccl" else None,
    )
    try:
        pg = TorchProcessGroup(dist.group.WORLD, timeout=args.timeout)  # type: ignore[arg-type]
        ctx = _Context(rank, world_size, backend, device, pg, args.break_check)
        mine = _run_checks(ctx)
        gathered: list[object] = [None] * world_size
        dist.all_gather_object(gathered, mine)
    finally:
        dist.destroy_process_group()
    per_rank = [list(r) for r in gathered if isinstance(r, list)]
    where = (
        f"{world_size} ranks as processes, rendezvous "
        f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    )
    return _report(backend, where, device, per_rank, print_table=rank == 0)


def _run_fakepg(args: argparse.Namespace) -> int:
    """The suite on threads: the reducer on each rank's FakeProcessGroup, torch's DDP on the
    "fakepg" torch backend over the same world."""
    import fakepg  # only here: the reducer itself never depends on the fake world

    nproc = int(args.nproc)

    # Every rank thread on one device (the fake world's collectives take one device), the
    # first GPU or the CPU.
    device = _rank_device("fakepg", args.device, 0)

    def rank_main(pg: fakepg.FakeProcessGroup) -> list[tuple[str, str, str]]:
        ctx = _Context(pg.rank(), nproc, "fakepg", device, pg, args.break_check)
        return _run_checks(ctx)

    with _exact_float32(device):
        per_rank = fakepg.run_torch(rank_main, nproc, timeout=args.timeout)
    return _report("fakepg", f"{nproc} ranks as threads", device, per_rank, True)


# -------------------------------------------------------------------------------------------
# Reporting.


def _report(
    backend: str,
    where: str,
    device: torch.device,
    per_rank: list[list[tuple[str, str, str]]],
    print_table: bool,
) -> int:
    """Merge the ranks' results (a check passes only if it passed everywhere) and print."""
    rows = []
    failed = 0
    for i, (name, status, detail) in enumerate(per_rank[0]):
        failing = [(r, res[i]) for r, res in enumerate(per_rank) if res[i][1] == FAIL]
        if failing:
            _, (_, status, detail) = failing[0]
            ranks = ", ".join(str(rank) for rank, _ in failing)
            detail = f"rank(s) {ranks}: {detail}" if len(per_rank) > 1 else detail
            failed += 1
        rows.append((name, status, detail))
    if print_table:
        passed = sum(1 for _, s, _ in rows if s == PASS)
        skipped = sum(1 for _, s, _ in rows if s == SKIP)
        print(
            f"reducer validate: backend {backend}, {where}, device {device.type}, torch "
            f"{torch.__version__}"
        )
        print(_table(("check", "result", "detail"), rows))
        print(f"{len(rows)} checks: {passed} passed, {failed} failed, {skipped} skipped")
        sys.stdout.flush()
    return 1 if failed else 0


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table, left-aligned, that pastes into Markdown as is."""
    cells = [list(headers)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------
# The checks. Each runs on every rank and returns (passed, detail) for that rank.


@dataclass(slots=True)
class _Context:
    rank: int
    world_size: int
    backend: str
    device: torch.device
    pg: ProcessGroup  # what the reducer runs on
    break_check: str | None
    current: str = field(default="")

    def observed(self, grads: list[Tensor | None]) -> list[Tensor | None]:
        """The gradients a check compares, on the CPU; corrupted for --break-check."""
        out = [None if g is None else g.detach().to("cpu", copy=True) for g in grads]
        if self.current == self.break_check and self.rank == 0:
            for i, g in enumerate(out):
                if g is not None:
                    out[i] = g.to_dense() if g.is_sparse else g
                    out[i].view(-1)[0] += 1.0  # type: ignore[union-attr]
                    break
        return out


def _run_checks(ctx: _Context) -> list[tuple[str, str, str]]:
    results = []
    for name, check in _CHECKS:
        ctx.current = name
        try:
            outcome = check(ctx)
        except Exception as exc:
            outcome = (FAIL, f"raised {type(exc).__name__}: {_one_line(str(exc))}")
        results.append((name, outcome[0], outcome[1]))
    return results


def _one_line(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Models and data: see Note [Dyadic data].


def _dyadic(shape: Sequence[int], seed: int) -> Tensor:
    """Integers in [-2, 2] times 0.5, the same on every rank for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, tuple(shape), generator=gen).to(torch.float32) * 0.5


def _init_dyadic(model: nn.Module, seed: int) -> nn.Module:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(_dyadic(p.shape, seed * 100 + i))
    return model


def _mlp(seed: int = 1) -> nn.Module:
    """Three Linear(8) layers with ReLU: six parameters."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    return _init_dyadic(model, seed)


class _Branchy(nn.Module):
    """A trunk and head every rank uses, a ``local`` layer only even ranks use, and a ``dead``
    layer no rank uses: unused parameters of both kinds."""

    def __init__(self, seed: int = 2) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.local = nn.Linear(8, 4)
        self.dead = nn.Linear(8, 4)
        _init_dyadic(self, seed)

    def forward(self, x: Tensor, rank: int) -> Tensor:
        h = torch.relu(self.trunk(x))
        out: Tensor = self.head(h)
        if rank % 2 == 0:
            out = out + self.local(h)
        return out


class _Sparse(nn.Module):
    """An Embedding with sparse gradients and a dense Linear on top."""

    def __init__(self, seed: int = 3) -> None:
        super().__init__()
        self.embedding = nn.Embedding(16, 8, sparse=True)
        self.proj = nn.Linear(8, 4)
        _init_dyadic(self, seed)

    def forward(self, indices: Tensor) -> Tensor:
        out: Tensor = self.proj(self.embedding(indices))
        return out


def _input(rank: int, step: int, check_seed: int) -> Tensor:
    return _dyadic((4, 8), 10_000 * check_seed + 100 * step + rank)


def _indices(rank: int, step: int) -> Tensor:
    """Overlapping lookups with a repeat, different on every rank."""
    return torch.tensor([rank % 16, (rank + 3 + step) % 16, 5, 5])


_COEFF = _dyadic((4,), 7)


def _loss(out: Tensor, world_size: int) -> Tensor:
    """W times a dyadic weighted sum: see Note [Dyadic data]."""
    return (out * _COEFF.to(out.device)).sum() * world_size


def _backward(out: Tensor, world_size: int) -> None:
    torch.autograd.backward(_loss(out, world_size))


def _dense_input(check_seed: int, step: int, model: nn.Module, rank: int) -> Tensor:
    """Rank's output in float64 on the CPU, for the expectations (bind the first two)."""
    out: Tensor = model(_input(rank, step, check_seed).double())
    return out


def _sparse_input(step: int, model: nn.Module, rank: int) -> Tensor:
    out: Tensor = model(_indices(rank, step))
    return out


def _branchy_input(model: nn.Module, rank: int) -> Tensor:
    out: Tensor = model(_input(rank, 0, 2).double(), rank)
    return out


def _grads(model: nn.Module) -> list[Tensor | None]:
    return [p.grad for p in model.parameters()]


def _expected(
    build: Callable[[], nn.Module],
    forward: Callable[[nn.Module, int], Tensor],
    world_size: int,
    backwards_per_rank: int = 1,
    *,
    scaling: Literal["divide", "reciprocal"] = "divide",
) -> list[Tensor | None]:
    """Per parameter, sum over ranks of the local gradient scaled by W, in float64 on the CPU:
    ``g / W`` ("divide", the bare Reducer's default) or ``g * (1.0 / W)`` ("reciprocal").

    ``forward(model, rank)`` gives rank's output; ``backwards_per_rank`` backward passes are
    accumulated per rank (gradient accumulation). None where no rank got a gradient.
    """
    total: list[Tensor | None] = []
    for rank in range(world_size):
        model = build().double()
        for _ in range(backwards_per_rank):
            _backward(forward(model, rank), world_size)
        for i, p in enumerate(model.parameters()):
            dense = None if p.grad is None else p.grad.to_dense()
            if dense is None:
                g = None
            elif scaling == "reciprocal":
                g = dense * (1.0 / world_size)
            else:
                g = dense / world_size
            if i == len(total):
                total.append(g)
            elif g is not None:
                prev = total[i]
                total[i] = g if prev is None else prev + g
    return total


def _compare(
    got: list[Tensor | None], want: list[Tensor | None], *, rtol: float = 0.0
) -> tuple[bool, str]:
    """Exact (rtol=0: torch.equal) or relative comparison of gradients, with the worst error."""
    worst = 0.0
    bad: list[int] = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if w is None or g is None:
            if (w is None) != (g is None):
                bad.append(i)
            continue
        if not torch.equal(w.float().double(), w):
            return False, f"parameter {i}: the expectation is not exact in float32 (data bug)"
        g64 = (g.to_dense() if g.is_sparse else g).double()
        err = float((g64 - w).abs().max()) if g64.numel() else 0.0
        worst = max(worst, err)
        limit = rtol * float(w.abs().max()) if w.numel() else 0.0
        if g64.shape != w.shape or (rtol == 0 and not torch.equal(g64, w)) or err > limit:
            bad.append(i)
    if bad:
        return (
            False,
            f"{len(bad)} of {len(want)} gradients differ (first: parameter {bad[0]}), "
            f"max abs error {worst:g}",
        )
    kind = "bit-exact" if rtol == 0 else f"within rtol {rtol:g}"
    return True, f"{kind}, max abs error {worst:g}"


def _check_exact_average(ctx: _Context, *, as_view: bool) -> tuple[str, str]:
    model = _mlp().to(ctx.device)
    params: list[Tensor] = list(model.parameters())
    buckets = ddp_bucket_assignment(
        params, bucket_cap_mb=_SMALL_BUCKET_MB, first_bucket_mb=_SMALL_BUCKET_MB
    )
    details = []
    with Reducer([params], buckets, ctx.pg, gradient_as_bucket_view=as_view) as red:
        for step in range(_STEPS):
            model.zero_grad(set_to_none=True)
            red.prepare_for_backward([])
            _backward(model(_input(ctx.rank, step, 1).to(ctx.device)), ctx.world_size)
            want = _expected(_mlp, functools.partial(_dense_input, 1, step), ctx.world_size)
            ok, detail = _compare(ctx.observed(_grads(model)), want)
            if not ok:
                return FAIL, f"step {step}: {detail}"
            details.append(detail)
    return PASS, f"{len(params)} params, {len(buckets)} buckets, {_STEPS} steps: {details[-1]}"


def _check_unused(ctx: _Context) -> tuple[str, str]:
    model = _Branchy().to(ctx.device)
    params: list[Tensor] = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    dead_w, dead_b = names.index("dead.weight"), names.index("dead.bias")
    kept = _dyadic(params[dead_w].shape, 99).to(ctx.device)
    params[dead_w].grad = kept  # globally unused: must stay this very tensor, untouched
    buckets = ddp_bucket_assignment(
        params, bucket_cap_mb=_SMALL_BUCKET_MB, first_bucket_mb=_SMALL_BUCKET_MB
    )
    with Reducer([params], buckets, ctx.pg, param_names=names) as red:
        out = model(_input(ctx.rank, 0, 2).to(ctx.device), ctx.rank)
        red.prepare_for_backward([out])
        _backward(out, ctx.world_size)
    want = _expected(_Branchy, _branchy_input, ctx.world_size)
    got = ctx.observed(_grads(model))
    want[dead_w] = kept.double().cpu()
    if params[dead_w].grad is not kept:
        return FAIL, "dead.weight (unused on every rank): its .grad was replaced"
    if params[dead_b].grad is not None:
        return FAIL, "dead.bias (unused on every rank): .grad was None and is now set"
    ok, detail = _compare(got, want)
    if not ok:
        return FAIL, detail
    local = "used on even ranks only" if ctx.world_size > 1 else "used on the only rank"
    return PASS, f"dead.* kept as they were, local.* {local}: {detail}"


def _check_sparse(ctx: _Context) -> tuple[str, str]:
    if ctx.backend == "nccl":
        return SKIP, "NCCL has no sparse allreduce"
    model = _Sparse().to(ctx.device)
    params: list[Tensor] = list(model.parameters())
    sparse = [[True, False, False]]
    buckets = ddp_bucket_assignment(params, expect_sparse_gradient=sparse[0])
    with Reducer([params], buckets, ctx.pg, sparse) as red:
        for step in range(_STEPS):
            model.zero_grad(set_to_none=True)
            red.prepare_for_backward([])
            _backward(model(_indices(ctx.rank, step).to(ctx.device)), ctx.world_size)
            grad = params[0].grad
            if grad is None or not grad.is_sparse:
                return FAIL, f"step {step}: embedding.weight.grad is not a sparse tensor"
            want = _expected(_Sparse, functools.partial(_sparse_input, step), ctx.world_size)
            got = ctx.observed(_grads(model))
            ok, detail = _compare(got[:1], want[:1], rtol=1e-6)
            dense_ok, dense_detail = _compare(got[1:], want[1:])
            if not (ok and dense_ok):
                return FAIL, f"step {step}: sparse {detail}; dense {dense_detail}"
    return PASS, f"sparse embedding {detail}; dense {dense_detail}; {_STEPS} steps"


def _check_accumulation(ctx: _Context) -> tuple[str, str]:
    model = _mlp(4).to(ctx.device)
    params: list[Tensor] = list(model.parameters())
    buckets = ddp_bucket_assignment(
        params, bucket_cap_mb=_SMALL_BUCKET_MB, first_bucket_mb=_SMALL_BUCKET_MB
    )
    local_steps = 2
    with Reducer([params], buckets, ctx.pg) as red:
        x = _input(ctx.rank, 0, 3).to(ctx.device)
        for _ in range(local_steps):  # no prepare_for_backward: gradients accumulate locally
            _backward(model(x), ctx.world_size)
        red.prepare_for_backward([])
        _backward(model(x), ctx.world_size)
    want = _expected(
        functools.partial(_mlp, 4),
        functools.partial(_dense_input, 3, 0),
        ctx.world_size,
        backwards_per_rank=local_steps + 1,
    )
    ok, detail = _compare(ctx.observed(_grads(model)), want)
    if not ok:
        return FAIL, detail
    return PASS, f"{local_steps} local backward passes, then a synced one: {detail}"


def _check_vs_torch_ddp(ctx: _Context) -> tuple[str, str]:
    """torch's DDP and the reducer on the same model and data, gradients bit for bit.

    Configurations: default; gradient_as_bucket_view; find_unused_parameters (a layer used on
    even ranks only, one used nowhere); and a no_sync micro-step before each synced one
    (the reducer accumulates while prepare_for_backward was not called)."""
    configs = [
        ("default", False, False, False),
        ("gradient_as_bucket_view", True, False, False),
        ("find_unused_parameters", False, True, False),
        ("no_sync accumulation", False, False, True),
    ]
    for label, as_view, find_unused, accumulate in configs:
        build: Callable[[], nn.Module] = _Branchy if find_unused else _mlp
        ours, theirs = build().to(ctx.device), build().to(ctx.device)
        ddp = nn.parallel.DistributedDataParallel(
            theirs,
            device_ids=[ctx.device] if ctx.device.type == "cuda" else None,
            gradient_as_bucket_view=as_view,
            find_unused_parameters=find_unused,
        )
        params: list[Tensor] = list(ours.parameters())
        red = Reducer(
            [params],
            ddp_bucket_assignment(params),
            ctx.pg,
            gradient_as_bucket_view=as_view,
            gradient_scaling="reciprocal",  # torch's DDP rounding
        )
        extra = (ctx.rank,) if find_unused else ()
        with red:
            for step in range(_STEPS):
                ddp.zero_grad(set_to_none=True)
                ours.zero_grad(set_to_none=True)
                if accumulate:
                    local = _input(ctx.rank, step, 6).to(ctx.device)
                    with ddp.no_sync():
                        _backward(ddp(local), ctx.world_size)
                    _backward(ours(local), ctx.world_size)  # no prepare: stays local
                x = _input(ctx.rank, step, 5).to(ctx.device)
                _backward(ddp(x, *extra), ctx.world_size)
                out = ours(x, *extra)
                red.prepare_for_backward([out] if find_unused else [])
                _backward(out, ctx.world_size)
                want = [None if g is None else g.double().cpu() for g in _grads(theirs)]
                ok, detail = _compare(ctx.observed(_grads(ours)), want)
                if not ok:
                    return FAIL, f"{label}, step {step}: {detail}"
    return PASS, f"{', '.join(c[0] for c in configs)}; {_STEPS} steps each: bit-identical"


_CHECKS: list[tuple[str, Callable[[_Context], tuple[str, str]]]] = [
    ("exact average", lambda ctx: _check_exact_average(ctx, as_view=False)),
    ("exact average, bucket views", lambda ctx: _check_exact_average(ctx, as_view=True)),
    ("unused parameters", _check_unused),
    ("sparse gradients", _check_sparse),
    ("gradient accumulation", _check_accumulation),
    ("same as torch DDP", _check_vs_torch_ddp),
]
_CHECK_NAMES = [name for name, _ in _CHECKS]


if __name__ == "__main__":
    _code = main()
    # A rank process ends here with its result settled. gloo's and the store's C++ threads may
    # still be winding down after destroy_process_group, and interpreter teardown then
    # sometimes aborts the process ("terminate called without an active exception"), turning
    # a pass into a failure. So flush and leave without running the C++ static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_code)
