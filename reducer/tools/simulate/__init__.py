"""Simulate data-parallel training of N ranks on threads, verify every step, show the time.

    python -m reducer simulate                                   # mlp, 4 ranks, 20 steps
    python -m reducer simulate --model transformer-block --world-size 8 --network 10gbe \\
        --trace out.json                                         # open in ui.perfetto.dev
    python -m reducer simulate --find-unused --unused-pattern rank-skew --no-sync-every 2
    python -m reducer simulate --model transformer-block --width 512 \\
        --sweep-bucket-cap 0.25,1,4,25 --network 10gbe --world-size 64
    python -m reducer simulate --model transformer-block --device cuda   # every rank on a GPU
    python -m reducer simulate --predict --model resnet50 --world-size 1024 \\
        --network nccl-dgx1-v100 --sweep-bucket-cap 0,1,5,25      # a real cluster, predicted

Each rank is a thread of one process on the in-memory fake world (fakepg), training its own
copy of a built-in model through reducer.DistributedDataParallel on its own batches. After
every step the reduced gradients of every rank are checked against the exact reference: the
sum over ranks, in rank order, of each rank's local gradient / W, computed by plain autograd
on an independent copy of each rank's model (bit for bit; sparse within a reordering bound).
The first mismatch stops the run with a report naming the step, rank and parameter.

--network adds simulated link time to each collective (an alpha-beta model: latency,
bandwidth, ring or tree algorithm), so communication overlapping backward can be seen on one
machine; --trace writes a Chrome/Perfetto timeline with one track per rank. --sweep-bucket-cap
measures one rank's backward, then predicts the step time per bucket cap at --world-size
ranks on --network, without running them, and names the best cap.

--device cuda puts every rank's model, reference copy and batches on one GPU (the rank threads
share it). The check stays bit for bit: cuDNN is held to deterministic algorithms and
attention to its math kernel for the run, so that the reference copy computes the very bits
the rank did. Times are then those of the host issuing GPU work, which is why the sweep, which
predicts from them, runs on the CPU only.

--predict (see reducer.tools.simulate.cluster) runs no ranks: one rank of a real model by
shape (resnet50, bert-base, bert-large, gpt2 ... gpt2-xl) goes through the real DDP on a
virtual clock, compute estimated for --gpu or measured (--device cuda, --profile FILE), the
collectives costed by --network (NCCL and gloo cluster presets), the other ranks identical.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor

# The simulation runs on the fake world; `import reducer` never imports this module.
import fakepg
from reducer.buckets import sparse_gradient_flags
from reducer.comm_hook import CommHook
from reducer.ddp import DistributedDataParallel
from reducer.hooks import allreduce_hook, bf16_compress_hook, fp16_compress_hook
from reducer.tools import catalog
from reducer.tools.trace import Pass, RankStep, Span, write_chrome_trace
from reducer.tools.whatif import BackwardProfile, best, sweep

from . import models, predict_cmd, report, shapes, verify
from .records import DEFAULT_WORLD_SIZE, Config, SimulationResult

__all__ = ["SimulationResult", "add_arguments", "main", "measure_profile", "run", "simulate"]

COMM_HOOKS: dict[str, tuple[CommHook | None, torch.dtype | None]] = {
    "none": (None, None),
    "allreduce": (allreduce_hook, None),
    "fp16": (fp16_compress_hook, torch.float16),
    "bf16": (bf16_compress_hook, torch.bfloat16),
}
_LEARNING_RATE = 0.01


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--world-size",
        type=int,
        default=None,
        help=f"ranks, one thread each (default {DEFAULT_WORLD_SIZE}; with a cluster file that "
        "names its nodes, every GPU in it)",
    )
    add(
        "--model",
        choices=[*models.MODELS, *shapes.SHAPE_MODELS],
        default="mlp",
        help="built-in model (default mlp); the real models by shape ("
        + ", ".join(shapes.SHAPE_MODELS)
        + ") are for --predict",
    )
    add("--width", type=int, default=None, help="model width (default: the model's own, small)")
    add("--batch-size", type=int, default=32, help="samples per rank per micro-batch (32)")
    add("--steps", type=int, default=20, help="optimizer steps, each verified (default 20)")
    add(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="bucket cap in MiB (default: torch's, 25 MiB with a first bucket of 1 MiB; "
        "a cap given is every bucket's, the first too, as torch does)",
    )
    add(
        "--find-unused",
        action="store_true",
        help="find_unused_parameters=True: search the graph for unused parameters",
    )
    add(
        "--unused-pattern",
        choices=models.UNUSED_PATTERNS,
        default="none",
        help="which optional branches each rank skips: none; random (per rank and step); "
        "rank-skew (branch k only on ranks with (rank + step) %% (k + 2) == 0). Without "
        "--find-unused a skipped branch leaves the reduction unfinished; the run stops and "
        "names the parameters",
    )
    add(
        "--no-sync-every",
        type=int,
        default=1,
        metavar="K",
        help="accumulate gradients over K micro-batches per step: K-1 backward passes under "
        "no_sync(), then one synced backward (default 1: every backward syncs)",
    )
    add(
        "--comm-hook",
        choices=list(COMM_HOOKS),
        default="none",
        help="reduce buckets through a comm hook: allreduce, or fp16 / bf16 compression (the "
        "check then sums in that dtype); default none",
    )
    add(
        "--network",
        default="none",
        metavar="NETWORK",
        help="simulated network: none (default: memory speed); a link preset ("
        + ", ".join(fakepg.NETWORK_PRESETS)
        + "); a cluster preset, NCCL or gloo on real machines (see below); a cluster file "
        "(FILE.toml or FILE.json: nodes, GPUs per node, NVLink and NIC bandwidth and latency, "
        "NICs per node; docs/howto/cli.md); or a spec, "
        "'latency=25us,bandwidth=10gbit,algorithm=ring' or 'fixed=5ms'",
    )
    add("--trace", default=None, metavar="FILE", help="write a Chrome/Perfetto trace (JSON)")
    add("--seed", type=int, default=0, help="seed for weights, batches and patterns (0)")
    add(
        "--device",
        default="cpu",
        help="where every rank's model and batches live: cpu (default), cuda or cuda:N (all "
        "ranks share that GPU)",
    )
    add(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds any collective may wait before the run fails (default 60)",
    )
    add(
        "--sweep-bucket-cap",
        default=None,
        metavar="MB,MB,...",
        help="what-if: measure one rank, then predict the step time per bucket cap at "
        "--world-size ranks on --network, and print the best cap (runs no W replicas); "
        "'default' is torch's default cap (25 MiB after a first bucket of 1 MiB)",
    )
    add(
        "--measure-world-size",
        type=int,
        default=1,
        help="ranks of the measuring run of --sweep-bucket-cap (default 1: no contention)",
    )
    add("--no-progress", action="store_true", help="no progress bar")
    predict_cmd.add_arguments(parser)
    parser.epilog = catalog.simulate_epilog()
    # For tests: corrupt one reduced gradient (STEP:RANK:PARAM, PARAM an index or a name)
    # after the synced backward, so that the check must stop the run and name it.
    add("--corrupt-grad", default=None, help=argparse.SUPPRESS)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m reducer simulate``, called in this process: the subcommand on its own."""
    parser = argparse.ArgumentParser(
        prog="python -m reducer simulate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Simulate (or sweep, or predict) as ``args`` say; 0 if every step verified, 1 if not,
    2 on bad args."""
    if predict_cmd.wants_prediction(args):
        return predict_cmd.run(args)
    if args.json is not None:
        print(
            "simulate: --json writes a prediction's assumptions and results: add --predict "
            f"with a model by shape ({', '.join(shapes.SHAPE_MODELS)})",
            file=sys.stderr,
        )
        return 2
    try:
        config = Config.from_args(args)
    except ValueError as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 2
    console = report.console()
    with warnings.catch_warnings(), _intra_op_threads(1), _deterministic_kernels(config.device):
        # torch warns once per process that sparse invariant checks are off; noise here.
        warnings.filterwarnings("ignore", message="Sparse invariant checks")
        if config.sweep_caps:
            return _run_sweep(config, console, progress=not args.no_progress)
        with report.progress_bar(console, not args.no_progress) as advance:
            result = _simulate(config, progress=advance)
        wrote = True
        if config.trace is not None and result.steps:
            try:
                count = write_chrome_trace(
                    config.trace, result.steps, result.param_names, metadata=config.describe()
                )
                result.notes.append(f"trace: {count} events written to {config.trace}")
            except OSError as exc:
                wrote = False
                result.notes.append(f"trace: could not write {config.trace}: {exc}")
    report.print_summary(console, config, result)
    return 0 if result.ok and wrote else 1


# -------------------------------------------------------------------------------------------
# One rank: its DDP model, its reference copy, its optimizer.


class _Rank:
    """Rank ``pg.rank()``'s replica; built on that rank's thread (DDP's constructor issues
    collectives)."""

    def __init__(self, pg: fakepg.FakeProcessGroup, config: Config) -> None:
        self.rank = pg.rank()
        self.config = config
        self.module = models.build_model(config.model, config.width, config.seed).to(config.device)
        self.ddp = DistributedDataParallel(
            self.module,
            pg,
            bucket_cap_mb=config.bucket_cap_mb,
            find_unused_parameters=config.find_unused,
        )
        hook, _wire = COMM_HOOKS[config.comm_hook]
        if hook is not None:
            self.ddp.register_comm_hook(None, hook)
        # The reference: a separate copy trained by plain autograd on the same batches.
        self.reference = models.build_model(config.model, config.width, config.seed).to(
            config.device
        )
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        by_name = dict(self.reference.named_parameters())
        self.ref_params = [by_name[n] for n in self.names]
        self.optimizer = torch.optim.SGD(self.params, lr=_LEARNING_RATE)

    def _inputs(self, step: int, micro: int) -> tuple[tuple[bool, ...], Tensor, Tensor]:
        c = self.config
        active = models.branch_pattern(
            c.unused_pattern,
            len(self.module.branches),
            seed=c.seed,
            rank=self.rank,
            step=step,
            micro=micro,
        )
        generator = models.batch_generator(c.seed, self.rank, step, micro)
        x, y = self.module.make_batch(generator, c.batch_size)
        return active, x.to(c.device), y.to(c.device)

    def train_step(self, step: int) -> RankStep:
        """zero_grad, the micro-batches (all but the last under no_sync), optimizer step."""
        self.optimizer.zero_grad(set_to_none=True)
        self._sync_reference()
        passes = []
        count = self.config.micro_batches
        iterations_before = self.ddp.reducer.iterations
        for micro in range(count):
            active, x, y = self._inputs(step, micro)
            synced = micro == count - 1
            with nullcontext() if synced else self.ddp.no_sync():
                t0 = time.perf_counter_ns()
                loss = self.module.loss(self.ddp(x, active=active), y)
                t1 = time.perf_counter_ns()
                torch.autograd.backward(loss)
                t2 = time.perf_counter_ns()
            passes.append(Pass(Span(t0, t1), Span(t1, t2), synced))
        finished = self.ddp.reducer.iterations == iterations_before + 1
        corrupt = self.config.corrupt
        if corrupt is not None and corrupt[:2] == (step, self.rank):
            self._corrupt(corrupt[2])
        t3 = time.perf_counter_ns()
        if finished:
            self.optimizer.step()
        t4 = time.perf_counter_ns()
        return RankStep(
            rank=self.rank,
            step=step,
            passes=tuple(passes),
            optimizer=Span(t3, t4) if finished else None,
            iteration=self.ddp.reducer.last_iteration if finished else None,
            bucket_indices=tuple(tuple(b) for b in self.ddp.reducer.bucket_indices),
            unused=tuple(sorted({i for _, i in self.ddp.reducer.unused_parameters})),
        )

    def reference_grads(self, step: int) -> list[Tensor | None]:
        """The local gradients of this step by plain autograd on the reference copy (its
        weights were synced before the step, so they are the ones the step used)."""
        for p in self.ref_params:
            p.grad = None
        for micro in range(self.config.micro_batches):
            active, x, y = self._inputs(step, micro)
            torch.autograd.backward(self.reference.loss(self.reference(x, active=active), y))
        return [p.grad for p in self.ref_params]

    def _sync_reference(self) -> None:
        with torch.no_grad():
            for mine, theirs in zip(self.ref_params, self.params, strict=True):
                mine.copy_(theirs)
            for buffer, source in zip(self.reference.buffers(), self.module.buffers(), strict=True):
                buffer.copy_(source)

    def _corrupt(self, which: str) -> None:
        index = int(which) if which.isdigit() else self.names.index(which)
        grad = self.params[index].grad
        if grad is None or grad.is_sparse:
            raise ValueError(f"--corrupt-grad: parameter {which!r} has no dense gradient")
        with torch.no_grad():
            flat = grad.view(-1)
            # The smallest change there is: the next float after the first element.
            inf = torch.tensor(float("inf"), dtype=flat.dtype, device=flat.device)
            flat[0] = torch.nextafter(flat[0], inf)


# -------------------------------------------------------------------------------------------
# The loop.


def _simulate(
    config: Config,
    *,
    progress: Callable[[int, int, str], None] | None = None,
) -> SimulationResult:
    """Run ``config.steps`` verified steps on ``config.world_size`` threads of a fake world."""
    w = config.world_size
    with fakepg.World(w, timeout=config.timeout, network=config.network) as world:
        ranks: list[_Rank] = world.run(lambda pg: _Rank(pg, config))
        first = ranks[0]
        result = SimulationResult(
            world_size=w,
            param_names=list(first.names),
            params=[p.detach().to("meta") for p in first.params],
            sparse=sparse_gradient_flags(first.module, first.params),
        )
        if config.device.type != "cpu":
            result.notes.append(
                f"device: {_device_name(config.device)}, shared by the {w} rank threads; "
                "cuDNN deterministic and math attention for the run (bit-for-bit check)"
            )
        _, wire = COMM_HOOKS[config.comm_hook]
        for step in range(config.steps):
            start = time.perf_counter_ns()
            try:
                records = world.run(functools.partial(_train_step, ranks, step))
            except Exception as exc:
                result.failure = _unfinished(step, ranks, config, exc)
                return result
            result.step_wall_ns.append(time.perf_counter_ns() - start)
            result.steps.extend(records)
            if any(r.iteration is None for r in records):
                result.failure = _unfinished(step, ranks, config, None)
                return result
            # Untimed: each rank's reference gradients, on the rank threads (no collective).
            local = world.run(functools.partial(_reference_grads, ranks, step))
            _count_unused(result, step, local)
            result.sparse_nbytes.append(
                [_sparse_bytes(g) if result.sparse[i] else 0 for i, g in enumerate(local[0])]
            )
            mismatch = _verify(step, ranks, local, result.sparse, wire)
            if mismatch is not None:
                result.mismatch = mismatch
                return result
            result.verified_steps += 1
            if progress is not None:
                progress(step + 1, config.steps, _progress_text(records))
        result.bucket_nbytes = list(first.ddp.reducer.bucket_nbytes)
        return result


def _train_step(ranks: Sequence[_Rank], step: int, pg: fakepg.FakeProcessGroup) -> RankStep:
    return ranks[pg.rank()].train_step(step)


def _reference_grads(
    ranks: Sequence[_Rank], step: int, pg: fakepg.FakeProcessGroup
) -> list[Tensor | None]:
    return ranks[pg.rank()].reference_grads(step)


def _verify(
    step: int,
    ranks: Sequence[_Rank],
    local: Sequence[Sequence[Tensor | None]],
    sparse: Sequence[bool],
    wire: torch.dtype | None,
) -> verify.Mismatch | None:
    names = ranks[0].names
    for index, name in enumerate(names):
        # .grad is what the step reduced; the optimizer changed only the weights.
        reduced = [r.params[index].grad for r in ranks]
        per_rank = [grads[index] for grads in local]
        if sparse[index]:
            found = verify.check_sparse(step, index, name, reduced, per_rank, wire)
        else:
            # Without a hook DDP multiplies by 1 / W, as torch's; the built-in hooks divide.
            expected = verify.reference_average(
                per_rank,
                wire,
                scaling="reciprocal" if ranks[0].config.comm_hook == "none" else "divide",
            )
            found = verify.check_dense(step, index, name, reduced, expected)
        if found is not None:
            return found
    return verify.check_same_parameters(step, names, [r.params for r in ranks])


def _count_unused(
    result: SimulationResult, step: int, local: Sequence[Sequence[Tensor | None]]
) -> None:
    for index, name in enumerate(result.param_names):
        missing = sum(1 for grads in local if grads[index] is None)
        result.unused_local += missing
        if missing:
            result.unused_names.add(name)
        if missing == len(local):
            result.unused_everywhere += 1


def _sparse_bytes(grad: Tensor | None) -> int:
    if grad is None:
        return 0
    return grad._nnz() * grad.sparse_dim() * 8 + grad._values().numel() * grad.element_size()


def _unfinished(
    step: int, ranks: Sequence[_Rank], config: Config, error: BaseException | None
) -> str:
    """Why ``step`` failed: a rank whose reduction could not finish because some parameters
    got no gradient there (its reference copy says which), else the error itself."""
    for r in ranks if not config.find_unused else ():
        if r.ddp.reducer.iterations > step:
            continue  # this rank's reduction finished
        grads = r.reference_grads(step)
        missing = [i for i, g in enumerate(grads) if g is None]
        if not missing:
            continue
        listing = ", ".join(f"{i} ({r.names[i]!r})" for i in missing[:10])
        text = (
            f"step {step}: the gradient reduction did not finish on rank {r.rank}: parameters "
            f"without a gradient on that rank: {listing}. Their buckets never became ready, "
            "so the ranks launched different buckets; pass --find-unused so that the reducer "
            "searches for unused parameters."
        )
        if error is not None:
            text += f" The world reported: {_describe_failure(error)}"
        return text
    if error is None:
        return f"step {step}: the gradient reduction did not finish on every rank"
    return f"step {step}: {_describe_failure(error)}"


def _describe_failure(exc: BaseException) -> str:
    notes = getattr(exc, "__notes__", None) or []
    text = f"{type(exc).__name__}: {exc}"
    return text + "".join(f" ({note})" for note in notes)


def _progress_text(records: Sequence[RankStep]) -> str:
    its = [r.iteration for r in records if r.iteration is not None]
    if not its:
        return ""
    comm = sum(it.comm_ns for it in its) / len(its) / 1e6
    overlap = sum(it.overlap_ns for it in its) / len(its) / 1e6
    return f"comm {comm:.2f} ms, overlap {overlap:.2f} ms"


def _device_name(device: torch.device) -> str:
    if device.type != "cuda":
        return str(device)
    index = torch.cuda.current_device() if device.index is None else device.index
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"


@contextmanager
def _deterministic_kernels(device: torch.device) -> Iterator[None]:
    """On CUDA, kernels that give the same bits on every run, for the run's duration.

    The check compares each rank's reduced gradient with one its reference copy computes
    again; a kernel that sums in a run-dependent order (cuDNN's atomic-add algorithms, the
    fused attention kernels' backward) would make them differ with no reducer at fault. Both
    switches are process-wide torch settings, restored afterwards. A no-op on the CPU.
    """
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    deterministic = torch.backends.cudnn.deterministic
    benchmark = torch.backends.cudnn.benchmark
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.cudnn.deterministic = deterministic
        torch.backends.cudnn.benchmark = benchmark


@contextmanager
def _intra_op_threads(count: int) -> Iterator[None]:
    """Each rank thread computes single-threaded, as a real rank would on its own cores:
    W ranks times N intra-op threads would only fight over this machine's cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


# -------------------------------------------------------------------------------------------
# What-if.


def simulate(args: argparse.Namespace) -> SimulationResult:
    """Run the simulation ``args`` (from :func:`add_arguments`) describe, without printing;
    raises ValueError for invalid arguments. ``--trace`` and ``--sweep-bucket-cap`` are
    ignored: see :func:`run`."""
    config = Config.from_args(args)
    with _intra_op_threads(1), _deterministic_kernels(config.device):
        return _simulate(config)


def measure_profile(args: argparse.Namespace) -> tuple[SimulationResult, BackwardProfile | None]:
    """The measuring run of ``--sweep-bucket-cap`` for ``args`` (from :func:`add_arguments`):
    ``--measure-world-size`` ranks, no simulated network, every step verified. The profile is
    None if the run failed (the result says why)."""
    config = Config.from_args(args)
    with _intra_op_threads(1), _deterministic_kernels(config.device):
        return _measure(config, None)


def _measure(
    config: Config, progress: Callable[[int, int, str], None] | None
) -> tuple[SimulationResult, BackwardProfile | None]:
    measure = Config(**{**_asdict(config), "world_size": config.measure_world_size,
                         "network": None, "network_spec": "none", "trace": None})  # fmt: skip
    result = _simulate(measure, progress=progress)
    return result, _profile(result, measure) if result.ok else None


def _run_sweep(config: Config, console: Any, *, progress: bool) -> int:
    """Measure a small run, then predict the step per bucket cap; prints the best."""
    with report.progress_bar(console, progress) as advance:
        result, profile = _measure(config, advance)
    measured = Config(**{**_asdict(config), "world_size": config.measure_world_size})
    if profile is None:
        report.print_summary(console, measured, result)
        return 1
    predictions = sweep(profile, config.sweep_caps, config.world_size, config.network)
    report.print_sweep(console, config, measured, result, profile, predictions, best(predictions))
    return 0


def _profile(result: SimulationResult, config: Config) -> BackwardProfile:
    """Rank 0's measured steps, skipping the first two (warm-up, bucket rebuild)."""
    steps = result.rank_steps(0)
    kept = [s for s in (steps[2:] if len(steps) > 2 else steps) if s.iteration is not None]
    sparse_nbytes = [
        sum(per_step[i] for per_step in result.sparse_nbytes) / max(1, len(result.sparse_nbytes))
        for i in range(len(result.params))
    ]
    return BackwardProfile.from_iterations(
        [s.iteration for s in kept if s.iteration is not None],
        params=result.params,
        forward_ns=[_before_backward_ns(s) for s in kept],
        optimizer_ns=[s.optimizer.end_ns - s.optimizer.start_ns for s in kept if s.optimizer],
        sparse=result.sparse,
        sparse_nbytes=sparse_nbytes,
        find_unused=config.find_unused,
    )


def _before_backward_ns(record: RankStep) -> int:
    """From the step's first forward to prepare_for_backward of the synced one (the origin of
    the reducer's ready times): no_sync passes and the synced forward."""
    assert record.iteration is not None
    return record.iteration.start_ns - record.passes[0].forward.start_ns


def _asdict(config: Config) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__dataclass_fields__}
