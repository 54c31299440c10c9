"""The testing library against torch's own test machinery: the same test written three ways.

One test, one step of torch's DDP on a small MLP (width, batch and data drawn by Hypothesis;
the reduced gradients and the parameters after an SGD step compared with the mean of the
ranks' local gradients), run

- ``fakepg``: with this library (``check_data_parallel``, ``check_comm_hook``) on the fake
  world;
- ``threaded``: on torch's threaded process group
  (``torch.testing._internal.distributed.multi_threaded_pg``), the ranks on threads started
  for each example as ``MultiThreadedTestCase`` starts them for each test;
- ``gloo spawn``: one process per rank on gloo, spawned for each example as torch's
  ``MultiProcessTestCase`` spawns them for each test;
- ``gloo pool``: one process per rank on gloo, spawned once and handed every example;
- ``fakepg-cuda`` (on a GPU machine, not by default): the library's check with the model and
  inputs on the GPU, against ``fakepg`` on the CPU in the same run.

The anchors check what the library checks: each rank's reduced gradients and parameters
against the mean of the local ones (computed on the calling thread from plain models), with
``torch.testing.assert_close``'s default tolerance (their reductions' order is not pinned).

Rows: (a) ``check_data_parallel`` on torch's DDP at W = 2, 3, 4: examples per second (median of
``--rounds`` rounds, the ways taking turns in each);
(b) a comm hook check (torch's ``allreduce_hook``) at W = 2: examples per second; (c) a
seeded bug, a comm hook that forgets to divide by the world size once a bucket holds more
than 96 elements, found and shrunk at W = 2: seconds to the first failing example and to
the end of shrinking (median over ``--seeds`` seeds), and the shrunk width.

``--suite``: torch's own DDP test suite, CPU-mapped (``benchmarks/torch_ddp_suite.py --mode
cpu --impl torch``), on gloo processes, whole run (slow: minutes).

    PYTHONPATH=$PWD python benchmarks/harness_vs_torch.py [--examples 20] [--rounds 5] [--seeds 3]
        [--ways fakepg,threaded,gloo-pool,gloo-spawn] [--spawn-examples 3] [--parts]
        [--skip-rates] [--skip-bug] [--suite]
    PYTHONPATH=$PWD python benchmarks/harness_vs_torch.py --ways fakepg,fakepg-cuda  # a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import socket
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from torch import Tensor, nn

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _path in (str(HERE), str(ROOT)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from _common import machine, table  # noqa: E402

IN, OUT, BATCH = 4, 3, 2
MAX_WIDTH = 32
# The seeded bug: the hook divides only buckets of at most this many elements.
BUG_ELEMENTS = 96


@dataclass(frozen=True)
class Example:
    """What Hypothesis draws: the MLP's hidden width, its seed and the data's."""

    world_size: int
    width: int
    seed: int
    data: int


def examples(world_size: int) -> st.SearchStrategy[Example]:
    return st.builds(
        Example,
        st.just(world_size),
        st.integers(1, MAX_WIDTH),
        st.integers(0, 2**16),
        st.integers(0, 2**16),
    )


def make_model(example: Example) -> nn.Module:
    """The MLP, its parameters from ``example.seed`` (the same on every call, any thread);
    built without the layers' own initialization, which every way would pay for alike."""
    g = torch.Generator().manual_seed(example.seed)
    return nn.Sequential(_linear(IN, example.width, g), nn.Tanh(), _linear(example.width, OUT, g))


def _linear(fan_in: int, fan_out: int, g: torch.Generator) -> nn.Linear:
    layer = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = fan_in, fan_out
    layer.weight = nn.Parameter(torch.randn(fan_out, fan_in, generator=g))
    layer.bias = nn.Parameter(torch.randn(fan_out, generator=g))
    return layer


def inputs(example: Example) -> list[Tensor]:
    g = torch.Generator().manual_seed(example.data)
    return [torch.randn(BATCH, IN, generator=g) for _ in range(example.world_size)]


def loss(output: Tensor) -> Tensor:
    return output.double().pow(2).sum()


LR = 0.1


# -------------------------------------------------------------------------------------------
# The hooks: torch's allreduce hook, and the seeded bug.


def buggy_hook(state: object, bucket: Any) -> torch.futures.Future[Tensor]:
    """torch's allreduce hook with the divide missing on buckets of more than BUG_ELEMENTS."""
    buffer = bucket.buffer()
    group = state if state is not None else dist.group.WORLD
    size = dist.get_world_size(group)  # type: ignore[arg-type]
    if buffer.numel() <= BUG_ELEMENTS:
        buffer.div_(size)
    fut: Any = dist.all_reduce(buffer, group=group, async_op=True).get_future()
    done: torch.futures.Future[Tensor] = fut.then(lambda f: f.value()[0])
    return done


# torch's DDP checks a hook's annotations as objects; this module's are strings.
buggy_hook.__annotations__ = {
    "state": object,
    "bucket": dist.GradBucket,  # type: ignore[attr-defined]
    "return": torch.futures.Future[torch.Tensor],
}


def good_hook() -> Callable[..., Any]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    return allreduce_hook


HOOKS: dict[str, Callable[[], Callable[..., Any] | None]] = {
    "none": lambda: None,
    "allreduce": good_hook,
    "bug": lambda: buggy_hook,
}


# -------------------------------------------------------------------------------------------
# One rank's step and the anchors' check, shared by the threaded group and gloo.


def rank_step(example: Example, rank: int, hook: str) -> tuple[list[Tensor], list[Tensor]]:
    """On a rank with the default group up: DDP, one step; the reduced gradients, and the
    parameters after SGD."""
    model = make_model(example)
    ddp = nn.parallel.DistributedDataParallel(model)
    fn = HOOKS[hook]()
    if fn is not None:
        ddp.register_comm_hook(None, fn)
    loss(ddp(inputs(example)[rank])).backward()  # type: ignore[no-untyped-call]
    grads = [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(p.grad, alpha=-LR)  # type: ignore[arg-type]
    return grads, [p.detach().clone() for p in model.parameters()]


def expect(example: Example, results: Sequence[tuple[list[Tensor], list[Tensor]]]) -> None:
    """The anchors' check: every rank's gradients and parameters against the mean of the
    ranks' local gradients, from plain models on this thread."""
    xs = inputs(example)
    local = []
    for rank in range(example.world_size):
        plain = make_model(example)
        loss(plain(xs[rank])).backward()  # type: ignore[no-untyped-call]
        local.append([p.grad for p in plain.parameters()])
    mean = [torch.stack(column).mean(0) for column in zip(*local, strict=True)]
    start = [p.detach() for p in make_model(example).parameters()]
    after = [p - LR * g for p, g in zip(start, mean, strict=True)]
    for rank, (grads, params) in enumerate(results):
        for i, (got, want) in enumerate(zip(grads, mean, strict=True)):
            torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank} grad {i}: {m}")  # noqa: B023
        for i, (got, want) in enumerate(zip(params, after, strict=True)):
            torch.testing.assert_close(got, want, msg=lambda m: f"rank {rank} param {i}: {m}")  # noqa: B023


# -------------------------------------------------------------------------------------------
# The ways.


def fakepg_way(hook: str, device: str = "cpu") -> Callable[[Example], None]:
    """This library: the check on the fake world (the model and inputs on ``device``)."""
    from reducer.testing import TrainingScenario, check_comm_hook, check_data_parallel, torch_ddp

    def check(example: Example) -> None:
        scenario = TrainingScenario(
            make_model=lambda: make_model(example).to(device),
            inputs=(tuple((x.to(device),) for x in inputs(example)),),
            loss=loss,
            lr=LR,
        )
        fn = HOOKS[hook]()
        if fn is None:
            check_data_parallel(torch_ddp(), scenario)
        else:
            check_comm_hook(fn, scenario)

    return check


@contextlib.contextmanager
def threaded_group() -> Iterator[None]:
    """torch's threaded process group installed, as MultiThreadedTestCase installs it."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    hook = sys.excepthook  # each init_process_group wraps it: put back the one from before
    c10d: Any = torch._C._distributed_c10d
    mtpg._install_threaded_pg()  # type: ignore[no-untyped-call]
    c10d._set_thread_isolation_mode(True)
    try:
        yield
    finally:
        mtpg._uninstall_threaded_pg()  # type: ignore[no-untyped-call]
        sys.excepthook = hook
        # The fake world's backend, registered earlier in this process, keeps isolation on.
        fake = type(dist.distributed_c10d._world).__name__ == "_PerThreadWorlds"
        c10d._set_thread_isolation_mode(fake)


def threaded_way(hook: str) -> Callable[[Example], None]:
    """torch's threaded process group: threads started for each example."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    def check(example: Example) -> None:
        w = example.world_size
        store = dist.HashStore()  # type: ignore[attr-defined]
        results: list[Any] = [None] * w
        errors: list[BaseException] = []

        def rank_main(rank: int) -> None:
            try:
                dist.init_process_group("threaded", rank=rank, world_size=w, store=store)
                try:
                    with torch.autograd.set_multithreading_enabled(False):
                        results[rank] = rank_step(example, rank, hook)
                finally:
                    dist.destroy_process_group()
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(w)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60.0)
        mtpg.ProcessLocalGroup.reset()  # type: ignore[no-untyped-call]
        if errors:
            raise errors[0]
        expect(example, results)

    return check


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gloo_rank(rank: int, world_size: int, port: int, conn: Any, once: Any) -> None:
    """A gloo rank: run each example received on ``conn`` (or ``once``), send the result."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        while True:
            job = once if once is not None else conn.recv()
            if job is None:
                break
            example, hook = job
            try:
                grads, params = rank_step(example, rank, hook)
                # As arrays, by value: a tensor is sent as a shared-memory handle, which the
                # receiver cannot open once this process has exited.
                conn.send(("ok", ([g.numpy() for g in grads], [p.numpy() for p in params])))
            except Exception as exc:
                conn.send(("error", repr(exc)))
            if once is not None:
                break
    finally:
        dist.destroy_process_group()


class GlooPool:
    """``world_size`` gloo ranks in processes, spawned once, handed one example at a time."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.conns = []
        self.procs = []
        for rank in range(world_size):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_gloo_rank, args=(rank, world_size, port, theirs, None))
            p.start()
            self.conns.append(mine)
            self.procs.append(p)

    def run(self, example: Example, hook: str) -> list[Any]:
        for c in self.conns:
            c.send((example, hook))
        return [_result(c.recv()) for c in self.conns]

    def close(self) -> None:
        for c in self.conns:
            c.send(None)
        for p in self.procs:
            p.join(30)


def _result(reply: tuple[str, Any]) -> Any:
    if reply[0] != "ok":
        raise RuntimeError(f"a gloo rank failed: {reply[1]}")
    grads, params = reply[1]
    return [torch.from_numpy(g) for g in grads], [torch.from_numpy(p) for p in params]


def gloo_spawn_run(example: Example, hook: str) -> list[Any]:
    """One process per rank spawned for this example alone, as a torch test case spawns."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    conns, procs = [], []
    for rank in range(example.world_size):
        mine, theirs = ctx.Pipe()
        p = ctx.Process(
            target=_gloo_rank, args=(rank, example.world_size, port, theirs, (example, hook))
        )
        p.start()
        conns.append(mine)
        procs.append(p)
    try:
        return [_result(c.recv()) for c in conns]
    finally:
        for p in procs:
            p.join(30)


def gloo_way(hook: str, pool: GlooPool | None) -> Callable[[Example], None]:
    def check(example: Example) -> None:
        results = pool.run(example, hook) if pool else gloo_spawn_run(example, hook)
        expect(example, results)

    return check


# -------------------------------------------------------------------------------------------
# Timing under Hypothesis.


@dataclass
class Run:
    examples: int
    seconds: float
    first_failure: float | None = None
    first_examples: int = 0  # examples run up to the first failure, it included
    shrunk: Example | None = None


def hypothesis_run(
    check: Callable[[Example], None],
    strategy: st.SearchStrategy[Example],
    *,
    max_examples: int,
    seed: int,
    shrink: bool,
) -> Run:
    """Run ``check`` under Hypothesis (no database, seeded); count and time the examples,
    the first failure, and the whole run (shrinking included)."""
    count = 0
    first: list[float] = []
    first_count: list[int] = []
    last_failing: list[Example] = []
    start = time.perf_counter()

    @hypothesis_seed(seed)
    @settings(
        max_examples=max_examples,
        database=None,
        deadline=None,
        phases=[Phase.generate, Phase.shrink] if shrink else [Phase.generate],
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        print_blob=False,
    )
    @given(strategy)
    def prop(example: Example) -> None:
        nonlocal count
        count += 1
        try:
            check(example)
        except Exception:
            if not first:
                first.append(time.perf_counter() - start)
                first_count.append(count)
            last_failing.append(example)
            raise

    failed = False
    try:
        prop()
    except Exception:
        failed = True
    seconds = time.perf_counter() - start
    run = Run(count, seconds)
    if failed:
        run.first_failure = first[0] if first else None
        run.first_examples = first_count[0] if first_count else 0
        run.shrunk = last_failing[-1] if last_failing else None
    return run


WAYS = ("fakepg", "threaded", "gloo-pool", "gloo-spawn", "fakepg-cuda")


def make_check(way: str, hook: str, world_size: int, stack: contextlib.ExitStack) -> Any:
    if way == "fakepg":
        return fakepg_way(hook)
    if way == "fakepg-cuda":
        return fakepg_way(hook, "cuda")
    if way == "threaded":
        stack.enter_context(threaded_group())
        return threaded_way(hook)
    if way == "gloo-pool":
        pool = GlooPool(world_size)
        stack.callback(pool.close)
        return gloo_way(hook, pool)
    return gloo_way(hook, None)


def throughput(way: str, hook: str, world_size: int, n: int, seed: int) -> float:
    """Examples per second of one way alone (its start-up, and one example, untimed)."""
    return rates([way], hook, world_size, {way: n}, 1)[way]


def rates(
    ways: Sequence[str], hook: str, world_size: int, n: dict[str, int], rounds: int
) -> dict[str, float]:
    """Per way, the median over ``rounds`` of its examples per second. Every way is set up
    first (a pool's processes started, one untimed example each: imports, first calls); then
    in each round every way runs ``n[way]`` examples in turn, so that the load of a shared
    machine falls on all alike (gloo-spawn, seconds per example, in the first round only)."""
    samples: dict[str, list[float]] = {w: [] for w in ways}
    with contextlib.ExitStack() as stack:
        checks = {w: make_check(w, hook, world_size, stack) for w in ways}
        for check in checks.values():
            check(Example(world_size, 4, 0, 0))
        for r in range(rounds):
            turn = list(ways[r % len(ways) :]) + list(ways[: r % len(ways)])
            for way in turn:
                if way == "gloo-spawn" and samples[way]:
                    continue
                run = hypothesis_run(
                    checks[way], examples(world_size), max_examples=n[way], seed=r, shrink=False
                )
                samples[way].append(run.examples / run.seconds)
    return {w: statistics.median(v) for w, v in samples.items()}


def bug_hunt(way: str, seeds: Sequence[int], examples_cap: int) -> list[Run]:
    runs = []
    with contextlib.ExitStack() as stack:
        check = make_check(way, "bug", 2, stack)
        check(Example(2, 4, 0, 0))
        for s in seeds:
            runs.append(
                hypothesis_run(check, examples(2), max_examples=examples_cap, seed=s, shrink=True)
            )
    return runs


@contextlib.contextmanager
def torch_work_clock(cpu: list[float]) -> Iterator[None]:
    """While inside: ``cpu[0]`` grows by the CPU time (``time.thread_time``) that threads other
    than the main one spend in torch's DDP constructor, its forward and ``Tensor.backward``:
    the ranks' torch work, the same code on the fake world and on the threaded group (their
    collectives' calls included, as those run inside it)."""
    ddp = nn.parallel.DistributedDataParallel
    originals = (ddp.__init__, ddp.forward, torch.Tensor.backward)
    main = threading.main_thread()
    lock = threading.Lock()

    def clocked(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is main:
                return fn(*args, **kwargs)
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    cpu[0] += time.thread_time() - start

        return call

    ddp.__init__ = clocked(originals[0])  # type: ignore[method-assign]
    ddp.forward = clocked(originals[1])  # type: ignore[method-assign]
    torch.Tensor.backward = clocked(originals[2])  # type: ignore[method-assign]
    try:
        yield
    finally:
        ddp.__init__, ddp.forward, torch.Tensor.backward = originals  # type: ignore[method-assign]


def parts(world_size: int, count: int, rounds: int) -> list[list[object]]:
    """Milliseconds per example of the library's check and of its parts (the argument checks,
    the world and its ranks, the reference and the comparison), beside the threaded way's
    whole check, in turns over ``rounds`` rounds of ``count`` examples (median): where the
    time goes; each as wall time and as the process's CPU time (every thread's), and, for
    both whole checks, the rank threads' CPU time in torch's DDP (constructor, forward,
    backward): the torch work both ways do alike. Private functions of the checks: the
    benchmark measures what they cost."""
    from reducer.testing import TrainingScenario, torch_ddp
    from reducer.testing import checks as library
    from reducer.testing._judge import Bounds, judge
    from reducer.testing._run import play
    from reducer.testing.algorithms import ddp_average

    widths = [3, 7, 12, 20, 31, 5]
    batch = [Example(world_size, widths[i % 6], i, i + 1) for i in range(count)]
    ref = ddp_average()

    def scenario(e: Example) -> TrainingScenario:
        return TrainingScenario(
            make_model=lambda: make_model(e),
            inputs=(tuple((x,) for x in inputs(e)),),
            loss=loss,
            lr=LR,
        )

    def checks_alone(e: Example) -> None:
        library._preflight("check_data_parallel", torch_ddp(), scenario(e), ref)

    def world_alone(e: Example) -> Any:
        return play(
            torch_ddp(), scenario(e), setup=None, train_step=None, optimizer=None,
            after_backward=None, timeout=60.0,
        )  # fmt: skip

    traces = {e: world_alone(e) for e in batch}

    def judged(e: Example) -> None:
        s = scenario(e)
        built = library._preflight("check_data_parallel", torch_ddp(), s, ref)
        judge(s, traces[e], ref, optimizer=None, broadcast_buffers=True, check_strides=True,
              bounds=Bounds(), built=built)  # fmt: skip

    ways: dict[str, Callable[[Example], object]] = {
        "fakepg: check_data_parallel": fakepg_way("none"),
        "  its argument checks (_preflight)": checks_alone,
        "  the world and its ranks (play)": world_alone,
        "  argument checks + reference and comparison (judge)": judged,
        "threaded: the whole check": threaded_way("none"),
    }
    ms: dict[str, list[float]] = {name: [] for name in ways}
    cpu_ms: dict[str, list[float]] = {name: [] for name in ways}
    torch_ms: dict[str, list[float]] = {name: [] for name in ways}
    with threaded_group():
        for fn in ways.values():
            fn(batch[0])
        for _ in range(rounds):
            for name, fn in ways.items():
                in_torch = [0.0]
                with torch_work_clock(in_torch):
                    start, cpu = time.perf_counter(), time.process_time()
                    for e in batch:
                        fn(e)
                    ms[name].append((time.perf_counter() - start) / count * 1e3)
                    cpu_ms[name].append((time.process_time() - cpu) / count * 1e3)
                torch_ms[name].append(in_torch[0] / count * 1e3)
    whole = ("fakepg: check_data_parallel", "threaded: the whole check")
    return [
        [
            name,
            world_size,
            statistics.median(ms[name]),
            statistics.median(cpu_ms[name]),
            statistics.median(torch_ms[name]) if name in whole else "",
        ]
        for name in ways
    ]


def suite(timeout: int) -> list[list[object]]:
    """torch's DDP suite CPU-mapped on gloo processes, whole run, timed."""
    command = [
        sys.executable, str(HERE / "torch_ddp_suite.py"), "--mode", "cpu", "--impl", "torch",
        "--quiet", "--timeout", str(timeout),
    ]  # fmt: skip
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    summary = [ln for ln in done.stdout.splitlines() if ln.startswith("summary")]
    return [["torch's DDP suite, cpu-mapped", "gloo processes", seconds, " ".join(summary)]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=20, help="examples per round and way")
    parser.add_argument("--spawn-examples", type=int, default=3, help="for gloo-spawn")
    parser.add_argument("--world-sizes", default="2,3,4")
    parser.add_argument("--seeds", type=int, default=3, help="bug hunts per way (median)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per rate (median)")
    parser.add_argument(
        "--ways",
        default=",".join(WAYS[:4]),
        help=f"any of {', '.join(WAYS)} (fakepg-cuda: the fake world's check on CUDA tensors)",
    )
    parser.add_argument("--skip-bug", action="store_true")
    parser.add_argument("--skip-rates", action="store_true", help="no examples/s table")
    parser.add_argument(
        "--parts", action="store_true", help="also the check's parts, ms per example"
    )
    parser.add_argument("--suite", action="store_true", help="also torch's DDP suite on gloo")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    ways = [w for w in args.ways.split(",") if w]
    for way in ways:
        if way not in WAYS:
            raise SystemExit(f"--ways: {way!r} is none of {', '.join(WAYS)}")
    print(f"# the testing library against torch's test machinery\n# machine: {machine()}\n")
    rows: list[list[object]] = []
    cases = [(f"(a) check_data_parallel, W={w}", "none", w) for w in _ints(args.world_sizes)]
    cases.append(("(b) check_comm_hook (allreduce_hook), W=2", "allreduce", 2))
    n = {w: args.spawn_examples if w == "gloo-spawn" else args.examples for w in ways}
    # Hypothesis's own first run in a process costs more than later ones: paid here.
    hypothesis_run(lambda e: None, examples(2), max_examples=20, seed=0, shrink=False)
    headers = ["examples/s", *ways, *(f"fakepg / {w}" for w in ways if w != "fakepg")]
    for name, hook, w in [] if args.skip_rates else cases:
        rows.append([name, *_rate_cells(rates(ways, hook, w, n, args.rounds), ways)])
        print(table(headers, rows[-1:]).splitlines()[-1], flush=True)  # as it comes
    if rows:
        print()
        print(table(headers, rows))
    if not args.skip_bug:
        print(
            f"\n# (c) the seeded bug (no divide once a bucket holds > {BUG_ELEMENTS} elements), "
            f"W=2, median of {args.seeds} seeds\n"
        )
        bug_rows: list[list[object]] = []
        seeds = list(range(args.seeds))
        spawn_rate = spawn_seconds = None
        for way in ways:
            if way == "gloo-spawn":
                # Every example spawns its ranks: the hunt's examples (counted on the pool)
                # times the seconds of one spawned example, not run (minutes).
                spawn_rate = throughput(way, "bug", 2, args.spawn_examples, seed=0)
                continue
            runs = bug_hunt(way, seeds, 200)
            found = [r for r in runs if r.first_failure is not None]
            if not found:
                bug_rows.append([way, len(runs), 0, "-", "-", "-", "-"])
                continue
            examples_run = statistics.median(r.examples for r in found)
            first_examples = statistics.median(r.first_examples for r in found)
            if way == "gloo-pool":
                spawn_seconds = (first_examples, examples_run)
            bug_rows.append(
                [
                    way,
                    len(runs),
                    len(found),
                    statistics.median(r.first_failure or 0.0 for r in found),
                    statistics.median(r.seconds for r in found),
                    examples_run,
                    sorted({r.shrunk.width for r in found if r.shrunk}),
                ]
            )
        if spawn_rate and spawn_seconds:
            first, total = spawn_seconds
            bug_rows.append(
                [
                    "gloo-spawn (estimated)",
                    0,
                    "-",
                    first / spawn_rate,
                    total / spawn_rate,
                    total,
                    "as gloo-pool",
                ]
            )
        print(
            table(
                [
                    "way",
                    "runs",
                    "found",
                    "s to first failure",
                    "s to shrunk",
                    "examples run",
                    "shrunk width",
                ],
                bug_rows,
            )
        )
    if args.parts:
        print(
            "\n# where an example's time goes (ms per example, median of the rounds; CPU: the "
            "process's, every thread's)\n"
        )
        rows = [r for w in _ints(args.world_sizes) for r in parts(w, args.examples, args.rounds)]
        headers = ["part", "W", "ms per example", "CPU ms", "ranks' CPU ms in torch's DDP"]
        print(table(headers, rows))
    if args.suite:
        print("\n# torch's own DDP suite\n")
        print(table(["suite", "on", "seconds", "result"], suite(300)))


def _rate_cells(rates: dict[str, float], ways: list[str]) -> list[object]:
    cells: list[object] = [rates[w] for w in ways]
    if "fakepg" in rates:
        cells += [f"{rates['fakepg'] / rates[w]:.2f}x" for w in ways if w != "fakepg"]
    return cells


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


if __name__ == "__main__":
    main()
