"""Run a torchrun-style training script on N rank threads of one fake world: debug it on a
laptop, with every rank's stack when it hangs.

    python -m reducer launch --nproc-per-node 2 tests/scripts/nanogpt_train.py --backend nccl
    python -m reducer launch --nproc 2 --timeout 5 tests/scripts/deadlock.py
    python -m reducer launch --standalone --nnodes 1 --nproc 4 -m tests.scripts.nanogpt_train

The script runs unmodified as ``__main__`` on each of N threads, with sys.argv as given. Each
thread sees its own RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT
(as torchrun sets them), and ``torch.distributed.init_process_group`` with any backend
("nccl", "gloo", "cpu:gloo,cuda:nccl") and any init method joins the fake world: collectives
run in memory, deterministically (every reduction adds in rank order). Each output line is
prefixed with its rank (``[rank0]: ...``); the exit code is torchrun's (1 if any rank failed).

When a collective times out, ranks disagree on one (a desync), or a rank fails or returns while
others wait, the launch says which ranks are missing from which collective and prints every
rank's Python stack as it was at that moment. So does Ctrl-C, which then stops every rank and
prints the summary.

At every optimizer step the replica check (reducer.tools.check) compares every rank's
parameters and gradients bit for bit and, at the first divergence, stops the ranks, says why
and exits with code 3 (``--no-check`` turns it off; ``--check-keep-going`` reports and goes on).
After the run, the same-training verdict (reducer.testing.sametrain) says whether the ranks trained
what one process would on the global batch (``--no-same-training`` turns it off).

torchrun's --standalone and --nnodes 1 are accepted (a launch is one node); --nproc-per-node
takes a number, auto, cpu or gpu, as torchrun's (default 1). LOCAL_RANK picks a rank's GPU as
under torchrun (ranks share fewer GPUs round-robin), and ``--cuda-as-cpu`` runs a CUDA script
on the CPU (see .devices). What a process does once (os._exit, sys.stdout assignment, stdin,
signal handlers, its ``__main__``) is made per rank (see .process), and a rank's child
processes (DataLoader workers, pools, subprocesses) are as a torchrun worker's: its
environment, their own exit, no collectives (see .children).
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import inspect
import os
import runpy
import signal
import sys
import sysconfig
import threading
import traceback
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FrameType, ModuleType
from typing import Any

from reducer.testing.sametrain import _launch as sametrain

from . import children, devices, imports, process, singletons
from .threads import RankOutput, ThreadEnviron, rank_environment

__all__ = ["add_arguments", "run", "run_function"]

# Note [What a launch changes in the process]
# Ranks are threads, so what a script takes to be its process's own is made per thread, for
# the duration of the launch, and put back afterwards: os.environ (ThreadEnviron: each rank a
# copy with its torchrun variables; child processes and C getenv see the real one),
# sys.stdout and sys.stderr (RankOutput: lines prefixed by rank), and
# torch.distributed.init_process_group (joins the fake world on the calling rank's thread).
# sys.argv and sys.path[0] are the script's, as for `python script.py`, and the same on every
# rank. The script's leading imports run once before the ranks start (see Note [Imports before
# the ranks start] in .imports), every other import is serialised (Note [One import at a
# time] in .imports), process-wide calls are made per rank (.process: os._exit, sys.stdout
# assignment, stdin, signal.signal, a __main__ module per rank), known one-per-process
# state is refused on rank threads (.singletons), and a child process of a rank gets none of
# this: a forked child has it all undone before fork() returns there, and is a process of
# that rank's, with its environment (.children). What stays shared: torch's intra-op threads
# (set to one per rank unless OMP_NUM_THREADS is set, as torchrun does), the working
# directory, sys.modules (a module the script imports is imported once, and its globals are
# shared), and Python's and NumPy's global random generators (torch's generator is per rank:
# see fakepg.rng). While the ranks run, the interpreter's switch interval (how long a thread
# running Python keeps the GIL from one that waits for it) is --switch-interval, 0.5 ms by
# default, a tenth of Python's own: ranks then take turns more evenly, and the ones a
# collective waits for arrive sooner (at 4 ranks on 2 cores the nanoGPT-style script's step
# took 18.4 ms against 20.8 ms with Python's 5 ms in alternating runs, though not in every
# protocol; see BENCHMARKS.md).

# Frames above the script (left out of stacks), and frames of the plumbing every torch call
# or import of a rank passes through (left out too).
_LAUNCHER_FILES = (
    os.path.join("", "threading.py"),
    os.path.join("", "runpy.py"),
    os.path.join("fakepg", "world.py"),
    os.path.join("reducer", "tools", "launch", "__init__.py"),
)
_PLUMBING_FILES = (
    os.path.join("fakepg", "rng.py"),
    os.path.join("torch", "overrides.py"),
    os.path.join("reducer", "tools", "launch", "singletons.py"),  # every import statement
)
_RULE = "=" * 60
# The interpreter's switch interval while the ranks run: see Note [What a launch changes in
# the process].
_SWITCH_INTERVAL_S = 0.0005
_THIN = "-" * 60
# After the first failure, a rank computing outside any collective gets this long to reach one
# (where the abort wakes it) before it is stopped, and as long again to stop; a rank still
# running after that is blocked in a C call or a lock of its own, and is abandoned.
_STOP_GRACE_S = 1.0
_INTERRUPTED = 130  # the exit code of a launch stopped by Ctrl-C, as a shell reports SIGINT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nproc",
        "--nproc-per-node",
        "--nproc_per_node",
        dest="nproc",
        default="1",
        help="number of ranks (threads): a number, or as torchrun's: auto (one per GPU, else "
        "one per CPU core), cpu, gpu (default 1)",
    )
    parser.add_argument(
        "--nnodes",
        default="1",
        help="torchrun's; a launch is one node: only 1 (or 1:1)",
    )
    parser.add_argument(
        "--standalone",
        action="store_true",
        help="torchrun's; accepted (the rendezvous is the in-memory world)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds a rank waits in a collective before the launch reports a hang (default 60)",
    )
    parser.add_argument(
        "--network",
        default=None,
        help="simulated network for collectives: a preset (10gbe, 100gbe-tree, ...) or "
        "latency=25us,bandwidth=10gbit (default: memory speed)",
    )
    parser.add_argument(
        "--local-ranks-filter",
        "--local_ranks_filter",
        dest="ranks_filter",
        default=None,
        help="show the output of these ranks only (comma-separated), as torchrun's",
    )
    parser.add_argument(
        "--full-stacks",
        action="store_true",
        help="show every frame of stacks and tracebacks (by default frames in torch, fakepg and "
        "the standard library are folded into one line per run)",
    )
    parser.add_argument(
        "--shared-rng",
        action="store_true",
        help="let ranks share torch's default generator (by default each rank has its own)",
    )
    parser.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="check at every optimizer step that the ranks' parameters and gradients are "
        "bit-identical and say why not; exit code 3 when they diverged (default: on)",
    )
    parser.add_argument(
        "--check-keep-going",
        action="store_true",
        help="report every divergence and go on, instead of stopping at the first",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=_SWITCH_INTERVAL_S,
        metavar="SECONDS",
        help="how long a rank thread running Python may keep the GIL from one waiting for it "
        f"(sys.setswitchinterval while the ranks run; default {_SWITCH_INTERVAL_S:g}, a tenth "
        "of Python's: ranks take turns more evenly)",
    )
    parser.add_argument(
        "--cuda-as-cpu",
        action="store_true",
        help="run a CUDA script on the CPU: torch.cuda answers for the CPU (one device per "
        "rank), .cuda() and device='cuda' keep tensors on the CPU, autocast and GradScaler "
        "for 'cuda' run on the CPU, and device_ids are dropped",
    )
    parser.add_argument(
        "-m",
        "--module",
        action="store_true",
        help="run the target as a module (python -m), as torchrun's -m",
    )
    parser.add_argument("script", help="the training script (or module, with -m)")
    sametrain.add_arguments(parser)  # --same-training, --deliberate
    rest = parser.add_argument(
        "script_args", nargs=argparse.REMAINDER, help="the script's arguments"
    )
    rest.required = False  # argparse counts a REMAINDER as required in its usage error


def _nproc_count(value: object) -> int:
    """--nproc-per-node as torchrun reads it: a number, auto, cpu or gpu."""
    import torch

    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    elif isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        count = int(value)
    elif value in ("auto", "cpu"):
        accelerator = getattr(torch, "accelerator", None)  # torch >= 2.6
        if value == "auto" and accelerator is not None and accelerator.is_available():
            count = accelerator.device_count()
        elif value == "auto" and accelerator is None and torch.cuda.is_available():
            count = torch.cuda.device_count()
        else:
            count = _cpu_count()
    elif value == "gpu":
        if not torch.cuda.is_available():
            raise ValueError(
                "--nproc-per-node gpu: no GPU visible here (torch.cuda.is_available() is "
                "False); pass a number of ranks"
            )
        count = torch.cuda.device_count()
    else:
        raise ValueError(
            f"--nproc-per-node takes a number of ranks, auto, cpu or gpu (as torchrun's), "
            f"got {value!r}"
        )
    if count < 1:
        raise ValueError(f"--nproc must be >= 1, got {count}")
    return count


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _check_flags(args: argparse.Namespace) -> None:
    """Flags that contradict each other are refused, not silently resolved."""
    if not getattr(args, "check", True) and getattr(args, "check_keep_going", False):
        raise ValueError(
            "--no-check and --check-keep-going contradict each other: --check-keep-going "
            "runs the replica check and reports every divergence; --no-check turns the check "
            "off. Pass one of them"
        )
    interval = getattr(args, "switch_interval", _SWITCH_INTERVAL_S)
    if not (isinstance(interval, float) and 0.0 < interval <= 1.0):
        raise ValueError(
            f"--switch-interval {interval}: give the seconds a rank thread may keep the GIL, "
            f"more than 0 and at most 1 (default {_SWITCH_INTERVAL_S:g})"
        )


def _check_nnodes(text: str) -> None:
    if text.strip() not in ("1", "1:1"):
        raise ValueError(
            f"--nnodes {text}: a launch runs the ranks of one node, as threads of this "
            "process; only --nnodes 1 (or 1:1). For several nodes, use torchrun"
        )


def run(args: argparse.Namespace) -> int:
    """Launch ``args.script`` on ``args.nproc`` rank threads; torchrun's exit code."""
    import fakepg  # the CLI tools may; the reducer itself never imports the fake world

    try:
        nproc = _nproc_count(args.nproc)
        _check_nnodes(str(args.nnodes))
        _check_flags(args)
        network = None if args.network is None else fakepg.parse_network(args.network)
        ranks = _parse_filter(args.ranks_filter, nproc)
        target = _Target.load(args.script, module=args.module)
        world = fakepg.World(nproc, timeout=args.timeout, network=network)
        same = sametrain.for_launch(args, nproc)  # the verdict printed at the end, or None
    except SyntaxError as exc:
        # As `python script.py` would: the error line, then where (exit code 1, as python's).
        where = "".join(traceback.format_exception_only(exc)).rstrip("\n")
        print(f"{_PROG}: error: {args.script} does not compile:\n{where}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, OSError) as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return 2
    note = gil_note()
    if note is not None:
        print(note, file=sys.stderr, flush=True)
    check = _replica_check(args, world, nproc)
    launch = _Launch(target, list(args.script_args), world, ranks, full_stacks=args.full_stacks)
    launch.check = check
    launch.devices = _device_plan(nproc, cuda_as_cpu=bool(getattr(args, "cuda_as_cpu", False)))
    launch.switch_interval = float(getattr(args, "switch_interval", _SWITCH_INTERVAL_S))
    recording = sametrain.recording(same, launch.rank_of_thread)  # reports at its exit
    with world, check or contextlib.nullcontext(), launch.installed(), recording:
        if not launch.preimport():
            return _INTERRUPTED
        try:
            launch.run_ranks(per_rank_rng=not args.shared_rng)
        except KeyboardInterrupt:  # a second Ctrl-C: quit without waiting for the ranks
            print(f"[launch] interrupted again: {_PROG} quits now", file=launch.real_stderr)
            return _INTERRUPTED
    if check is None:
        return launch.report(sys.stderr)
    # When the check stopped the ranks, its report is the launch's.
    code = 0 if check.stopped else launch.report(sys.stderr)
    check.print_summary()
    return int(check.exit_code(code))


def run_function(
    fn: Callable[[int], object],
    world: Any,
    *,
    name: str = "<function>",
    environ: Callable[[int, int], dict[str, str]] = rank_environment,
) -> list[int | None]:
    """Call ``fn(rank)`` on every rank thread of ``world`` as a launch runs a script there.

    For code written for a process per rank that is reached through a function rather than
    a script (a test harness running each test's ranks as threads): everything a launch makes
    per rank is so for ``fn`` (see Note [What a launch changes in the process]): os.environ
    with the rank's torchrun variables, rank-prefixed output, ``init_process_group`` with any
    backend joining ``world``, ``sys.exit`` and ``os._exit`` ending the rank only. No replica
    check, no device mapping, torch's generator per rank. ``name`` stands for the script
    (``sys.argv[0]``). ``environ(rank, world_size)``: the variables rank ``rank`` sees on top
    of the process's environment; by default torchrun's (RANK, WORLD_SIZE, MASTER_ADDR, ...).
    Code that expects no launcher's variables (a process spawned by multiprocessing, whose
    variables C code reads too) passes ``lambda rank, size: {}``. Call it from a thread that
    is no rank's; ``world`` is left open.

    Returns each rank's exit code as torchrun reports a worker's: 0; the code of ``sys.exit``
    or ``os._exit``; 1 for an exception; None for a rank that never ended (still running after
    the world's abort and its grace: see ``World.run``). A failing rank aborts the world, as
    in a launch: the ranks that wait for it in a collective wake with an error.
    """
    if not callable(fn):
        raise ValueError(f"run_function: fn must be callable, got {fn!r}")
    target = _FunctionTarget(name, fn)
    launch = _Launch(target, [], world, None)
    launch.rank_environment = environ
    target.rank_of_thread = launch.rank_of_thread
    with launch.installed():
        launch.run_ranks(per_rank_rng=True)
    return [outcome.code for outcome in launch.outcomes]


class _FunctionTarget:
    """A function in place of the script: ``fn(rank)`` on each rank (see run_function)."""

    path: Path | None = None
    path0: str | None = None

    def __init__(self, name: str, fn: Callable[[int], object]) -> None:
        self.name = name
        self.fn = fn
        self.rank_of_thread: Callable[[], int | None] = lambda: None

    @property
    def argv0(self) -> str:
        return self.name

    def preimport(self) -> None:
        """Nothing to import ahead: the caller has imported what ``fn`` needs."""

    def execute(self, main: ModuleType) -> None:
        rank = self.rank_of_thread()
        if rank is None:
            raise RuntimeError("run_function: the function ran on a thread that is no rank's")
        self.fn(rank)


def gil_note(*, gil_enabled: bool | None = None) -> str | None:
    """What the launch says at start on a free-threaded Python (the GIL off: ``gil_enabled``,
    by default ``sys._is_gil_enabled()``), where it runs everything it runs with the GIL; None
    with the GIL on (every Python before 3.13, and free-threaded builds that re-enabled it)."""
    if gil_enabled is None:
        is_enabled = getattr(sys, "_is_gil_enabled", None)
        gil_enabled = True if is_enabled is None else bool(is_enabled())
    if gil_enabled:
        return None
    return (
        "[launch] free-threaded Python (the GIL is off): rank threads run Python in parallel, "
        "as torchrun's processes do; --switch-interval has no effect"
    )


@dataclass(frozen=True, slots=True)
class _DevicePlan:
    """How CUDA devices map on the rank threads (see .devices), and what is said at start."""

    mapper: devices.Mapper
    cuda_as_cpu: bool
    said: str


def _device_plan(nproc: int, *, cuda_as_cpu: bool) -> _DevicePlan | None:
    """--cuda-as-cpu; or, with fewer GPUs than ranks, GPUs shared round-robin; else None
    (each rank's set_device(local_rank) works as it is)."""
    import torch

    if cuda_as_cpu:
        said = (
            f"[launch] --cuda-as-cpu: every CUDA device is the CPU here: torch.cuda answers for "
            f"it (available, {nproc} device(s), one per rank), .cuda() and device='cuda' keep "
            "tensors on the CPU, autocast and GradScaler for 'cuda' run on the CPU, and "
            "device_ids are dropped"
        )
        return _DevicePlan(devices.cpu_for(nproc), True, said)
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if nproc <= count:
        return None
    said = (
        f"[launch] {nproc} ranks share {count} GPU(s) round-robin: rank r (LOCAL_RANK r) uses "
        f"cuda:{{r % {count}}} wherever it names cuda:r"
    )
    return _DevicePlan(devices.round_robin(count), False, said)


def _replica_check(args: argparse.Namespace, world: Any, nproc: int) -> Any:
    """The replica check of the launch (see reducer.tools.check), or None with --no-check."""
    if not getattr(args, "check", False):
        return None
    from reducer.tools.check import ReplicaCheck

    stop = not getattr(args, "check_keep_going", False)
    return ReplicaCheck(nproc, world=world, stop=stop, out=sys.stderr)


_PROG = "python -m reducer launch"


def _parse_filter(text: str | None, nproc: int) -> set[int] | None:
    if text is None:
        return None
    try:
        ranks = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        raise ValueError(f"--local-ranks-filter takes ranks such as 0,2; got {text!r}") from None
    outside = sorted(r for r in ranks if not 0 <= r < nproc)
    if outside:
        raise ValueError(f"--local-ranks-filter: ranks {outside} are not in [0, {nproc})")
    return ranks


@dataclass(frozen=True, slots=True)
class _Target:
    """The script (compiled once, run as ``__main__`` on every rank) or module, and its
    syntax tree (None where its source is not found), for the imports before the ranks."""

    name: str
    path: Path | None  # the file that runs as __main__ (a directory's or zip's __main__.py)
    code: CodeType | None
    tree: ast.Module | None = None
    is_package: bool = False  # -m of a package: its __main__ runs
    path0: str | None = None  # sys.path[0], as python sets it for the target

    @classmethod
    def load(cls, name: str, *, module: bool) -> _Target:
        if module:
            tree, is_package = _module_tree(name)
            return cls(name, None, None, tree, is_package)
        path = Path(name)
        if path.is_dir() or (path.is_file() and zipfile.is_zipfile(path)):
            return cls._load_main(name, path)
        if not path.is_file():
            raise ValueError(f"no such script: {name}")
        # Named as given, as `python path` names it in tracebacks.
        tree = ast.parse(path.read_bytes(), str(path))
        path0 = str(path.resolve().parent)
        return cls(name, path, compile(tree, str(path), "exec"), tree, path0=path0)

    @classmethod
    def _load_main(cls, name: str, path: Path) -> _Target:
        """A directory or zip file with a ``__main__.py``, run as ``python path`` runs it:
        that file as ``__main__``, with the directory or zip first on sys.path."""
        main = path / "__main__.py"
        if path.is_dir():
            if not main.is_file():
                raise ValueError(f"{name} is a directory without a __main__.py: nothing to run")
            source = main.read_bytes()
        else:
            with zipfile.ZipFile(path) as archive:
                try:
                    source = archive.read("__main__.py")
                except KeyError:
                    raise ValueError(
                        f"{name} is a zip file without a __main__.py: nothing to run"
                    ) from None
        tree = ast.parse(source, str(main))
        code = compile(tree, str(main), "exec")
        return cls(name, main, code, tree, path0=str(path.resolve()))

    def preimport(self) -> None:
        """See Note [Imports before the ranks start] in .imports."""
        if self.tree is None:
            return
        package = None
        if self.path is None:  # a module: its relative imports resolve in its package
            package = self.name if self.is_package else self.name.rpartition(".")[0]
        imports.preimport(self.tree, self.argv0, package)

    def execute(self, main: ModuleType) -> None:
        """Run the target as ``__main__`` in ``main``, this rank's module (see
        process.MainModules)."""
        if self.code is None:
            spec, code = _module_code(self.name)
            if spec is None or code is None:
                # runpy raises what python -m would (no such module, no code). alter_sys=False:
                # runpy must not swap sys.modules["__main__"] or sys.argv[0] under the other
                # ranks' feet.
                runpy.run_module(self.name, run_name="__main__", alter_sys=False)
                return
            main.__dict__.update(
                {
                    "__file__": spec.origin if spec.has_location else None,
                    "__builtins__": builtins,
                    "__package__": spec.parent,
                    "__spec__": spec,
                    "__loader__": spec.loader,
                    "__cached__": spec.cached,
                    "__doc__": None,
                }
            )
            exec(code, main.__dict__)  # what runpy.run_module does, in this rank's module
            return
        main.__dict__.update(
            {
                "__file__": str(self.path),
                "__builtins__": builtins,
                "__package__": None,
                "__spec__": None,
                "__loader__": None,
                "__cached__": None,
                "__doc__": None,
            }
        )
        exec(self.code, main.__dict__)  # what runpy.run_path does, in this rank's module

    @property
    def argv0(self) -> str:
        return self.name if self.path is None else str(self.path)


def _module_code(name: str) -> tuple[Any, CodeType | None]:
    """The spec and code of what ``python -m name`` runs (a package's ``__main__``), or
    (None, None) where they are not found (then runpy says why, as python -m would)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{name}.__main__")
        get_code = getattr(getattr(spec, "loader", None), "get_code", None)
        code = get_code(spec.name) if spec is not None and get_code is not None else None
    except (ImportError, ValueError, SyntaxError, OSError):
        return None, None
    return (spec, code) if isinstance(code, CodeType) else (None, None)


def _module_tree(name: str) -> tuple[ast.Module | None, bool]:
    """The syntax tree of what ``python -m name`` runs (None if its source is not a file
    here), and whether ``name`` is a package. Finding it imports its parent packages, as
    running it would; an error is left to the ranks, which report it as python -m would."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(name)
        is_package = spec is not None and spec.submodule_search_locations is not None
        if is_package:
            spec = importlib.util.find_spec(f"{name}.__main__")
    except (ImportError, ValueError):
        return None, False
    if spec is None or not spec.has_location or not str(spec.origin).endswith(".py"):
        return None, is_package
    try:
        return ast.parse(Path(str(spec.origin)).read_bytes(), str(spec.origin)), is_package
    except (OSError, SyntaxError, ValueError):
        return None, is_package


@dataclass(slots=True)
class _Outcome:
    code: int | None = None  # None: still running or never started; 0: success
    error: BaseException | None = None


class _Launch:
    """One launch: the rank threads' function, the process-wide state it swaps, the report.

    # Guarantees: rank_main runs on the world's rank threads; _lock guards the outcomes, the
    # first failure and the stacks taken then. preimport(), run_ranks() and report() run on
    # the launching thread, report() after every rank has ended or been abandoned.
    """

    def __init__(
        self,
        target: _Target | _FunctionTarget,
        argv: list[str],
        world: Any,
        ranks: set[int] | None,
        *,
        full_stacks: bool = False,
    ) -> None:
        self.target = target
        self.full_stacks = full_stacks
        self.argv = argv
        self.world = world
        self.nproc: int = world.world_size
        self._lock = threading.Lock()
        self.outcomes = [_Outcome() for _ in range(self.nproc)]
        self.idents: dict[int, int] = {}  # rank -> thread ident
        self.first: int | None = None  # the rank that failed first
        self.stacks: dict[int, str] = {}  # where the other ranks were at the first failure
        self._ranks_filter = ranks
        # The stand-ins installed while the launch runs (see installed()), and the real stderr.
        self.environ: ThreadEnviron | None = None
        self.stdout: RankOutput | None = None
        self.stderr: RankOutput | None = None
        self.real_stderr: Any = sys.stderr
        self._thread_rank = threading.local()  # .rank: the rank of a rank thread
        self.check: Any = None  # the replica check, told which thread is which rank
        self.running = False  # the rank threads run (set by run_ranks)
        self.interrupted = False  # Ctrl-C stopped the ranks
        self._interrupt: threading.Thread | None = None  # aborts the world after a Ctrl-C
        self.main: process.MainModules | None = None  # sys.modules["__main__"] (installed())
        self.devices: _DevicePlan | None = None  # CUDA on the rank threads (see .devices)
        self.switch_interval = _SWITCH_INTERVAL_S  # sys.setswitchinterval while ranks run
        # The variables each rank sees on top of the process's (run_function may change it).
        self.rank_environment: Callable[[int, int], dict[str, str]] = rank_environment

    # ---------------------------------------------------------------------------------------
    # See Note [What a launch changes in the process].

    @contextmanager
    def installed(self) -> Iterator[None]:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        real_environ, real_out, real_err = os.environ, sys.stdout, sys.stderr
        argv, path = sys.argv, list(sys.path)
        torch_init = c10d.init_process_group
        lock = threading.Lock()
        self.environ = ThreadEnviron(real_environ)
        self.stdout = RankOutput(real_out, lock, self._ranks_filter)
        self.stderr = RankOutput(real_err, lock, self._ranks_filter)
        self.real_stderr = real_err
        init = self._init_process_group(torch_init)
        handler = None
        os.environ = self.environ  # type: ignore[assignment]  # noqa: B003 (a stand-in)
        sys.stdout, sys.stderr = self.stdout, self.stderr
        sys.argv = [self.target.argv0, *self.argv]
        if self.target.path0 is not None:
            sys.path.insert(0, self.target.path0)
        dist.init_process_group = c10d.init_process_group = init
        restore_singletons = singletons.install(self.rank_of_thread, self.nproc)
        self.main, restore_process = process.install(
            self.rank_of_thread, self.stdout, self.stderr, self.environ
        )
        restore_imports = imports.serialise(timeout=min(30.0, self.world.timeout / 2))
        restore_devices: Any = lambda: None  # noqa: E731
        if self.devices is not None:
            print(self.devices.said, file=real_err, flush=True)
            restore_devices = devices.install(
                self.devices.mapper, cuda_as_cpu=self.devices.cuda_as_cpu, nproc=self.nproc
            )
        if threading.current_thread() is threading.main_thread():
            handler = signal.signal(signal.SIGINT, self._on_interrupt)
        restore_children = children.install(self.environ.bound)
        interval = sys.getswitchinterval()

        def in_child() -> None:
            # Runs last in a forked child (see .children): the forking rank's environment and
            # output become the process's, and its collectives are refused.
            assert self.environ is not None and self.stdout is not None
            assert self.stderr is not None
            rank = self.rank_of_thread()
            children.become_environment(real_environ, self.environ.copy())
            os.environ = real_environ  # noqa: B003 (the real one back)
            self._thread_rank.rank = None
            self.running = False
            if self.check is not None:
                self.check.unbind()
            child_lock = threading.Lock()
            self.stdout.after_fork(child_lock)
            self.stderr.after_fork(child_lock)
            self.world._issue = _refuse_in_child(rank)
            dist.init_process_group = c10d.init_process_group = torch_init
            if handler is not None:
                signal.signal(signal.SIGINT, handler)
            sys.setswitchinterval(interval)

        remove_child_hook = children.in_forked_child(in_child)
        try:
            yield
        finally:
            remove_child_hook()
            restore_children()
            if handler is not None:
                signal.signal(signal.SIGINT, handler)
            if self._interrupt is not None:
                self._interrupt.join()
            restore_devices()
            restore_imports()
            restore_process()
            restore_singletons()
            dist.init_process_group = c10d.init_process_group = torch_init
            sys.argv, sys.path[:] = argv, path
            sys.stdout, sys.stderr = real_out, real_err
            os.environ = real_environ  # noqa: B003 (the real one back)

    def rank_of_thread(self) -> int | None:
        """The rank whose thread calls this, or None on any other thread."""
        rank: int | None = getattr(self._thread_rank, "rank", None)
        return rank

    def _init_process_group(self, torch_init: Any) -> Any:
        """``init_process_group`` for the launch: any backend, on the fake world."""
        import fakepg

        signature = inspect.signature(torch_init)
        launch = self

        def init_process_group(*args: Any, **kwargs: Any) -> None:
            rank = launch.rank_of_thread()
            if rank is None:  # not a rank thread: torch's own
                torch_init(*args, **kwargs)
                return
            given = signature.bind(*args, **kwargs).arguments
            for name, mine in (("rank", rank), ("world_size", launch.nproc)):
                value = given.get(name, -1)
                if value not in (-1, None, mine):
                    raise ValueError(
                        f"init_process_group({name}={value}) on rank {rank} of a launch of "
                        f"{launch.nproc}: this thread is {name} {mine} (RANK and WORLD_SIZE say "
                        f"so); pass {name}=int(os.environ[...]) or leave it out"
                    )
            fakepg.init_torch_group(launch.world, rank)

        init_process_group.__doc__ = torch_init.__doc__
        return init_process_group

    def preimport(self) -> bool:
        """The script's leading imports, once, on this thread, before the ranks start, with
        rank 0's environment and output (see Note [Imports before the ranks start] in
        .imports). False if Ctrl-C stopped it."""
        assert self.environ is not None and self.stdout is not None and self.stderr is not None
        self.environ.bind(self.rank_environment(0, self.nproc))
        self.stdout.bind(0)
        self.stderr.bind(0)
        try:
            self.target.preimport()
        except KeyboardInterrupt:
            print(
                "[launch] interrupted while importing the script's modules", file=self.real_stderr
            )
            return False
        finally:
            self.stdout.finish()
            self.stderr.finish()
            self.environ.unbind()
        return True

    def run_ranks(self, *, per_rank_rng: bool) -> None:
        """Run the script on every rank; a failure is recorded per rank (see report). A
        second Ctrl-C raises KeyboardInterrupt without waiting for the ranks."""
        self.running = True
        interval = sys.getswitchinterval()
        sys.setswitchinterval(self.switch_interval)  # see Note [What a launch changes ...]
        try:
            self.world.run(self.rank_main, per_rank_rng=per_rank_rng, stop_grace=_STOP_GRACE_S)
        except BaseException as exc:  # recorded per rank by rank_main; reported below
            if isinstance(exc, KeyboardInterrupt) and self.interrupted:
                raise  # the second Ctrl-C (a rank's own KeyboardInterrupt is its failure)
        finally:
            self.running = False
            sys.setswitchinterval(interval)

    # ---------------------------------------------------------------------------------------
    # The rank threads.

    def rank_main(self, pg: Any) -> None:
        import torch
        import torch.distributed as dist

        rank = pg.rank()
        assert self.environ is not None and self.stdout is not None and self.stderr is not None
        self.idents[rank] = threading.get_ident()
        self._thread_rank.rank = rank
        if self.check is not None:
            self.check.bind(rank)
        self.environ.bind(self.rank_environment(rank, self.nproc))
        self.stdout.bind(rank)
        self.stderr.bind(rank)
        if "OMP_NUM_THREADS" not in self.environ.real:
            torch.set_num_threads(1)  # torchrun's default for several workers per node
        assert self.main is not None
        module = ModuleType("__main__")  # this rank's run of the script: see process.py
        self.main.bind(module)
        mapping = (
            contextlib.nullcontext()
            if self.devices is None
            else devices.DeviceMap(self.devices.mapper)
        )
        try:
            with mapping:
                self.target.execute(module)
        except process.RankExit as exc:  # os._exit: this rank ends, as its process would
            self._record(rank, exc.code, None if exc.code == 0 else exc)
            if exc.code != 0:
                raise
        except SystemExit as exc:
            code = _exit_code(exc, self.stderr)
            if code == 0:
                self._record(rank, 0, None)
                return
            self._record(rank, code, exc)
            raise
        except BaseException as exc:
            self._record(rank, 1, exc)
            if self.check is not None and self.check.stopped:
                raise  # a consequence of the check's stop, which reports it
            # What the worker process would print before dying (prefixed by rank).
            frames = self._format(traceback.extract_tb(exc.__traceback__), collapse=True)
            if _is_world_stop(exc):
                print(
                    f"Stopped by the launch at (most recent call last):\n{frames}", file=self.stderr
                )
            else:
                last = "".join(traceback.format_exception_only(exc)).rstrip("\n")
                print(f"Traceback (most recent call last):\n{frames}\n{last}", file=self.stderr)
            raise
        else:
            self._record(rank, 0, None)
        finally:
            try:
                if dist.is_initialized():
                    dist.destroy_process_group()
            finally:
                self.stdout.finish()
                self.stderr.finish()
                self.environ.unbind()
                self.main.bind(None)
                self._thread_rank.rank = None
                if self.check is not None:
                    self.check.unbind()
                    self.check.rank_ended(rank)

    def _record(self, rank: int, code: int, error: BaseException | None) -> None:
        with self._lock:
            self.outcomes[rank] = _Outcome(code, error)
            if code != 0 and self.first is None and not self.interrupted:
                # Before the world's abort wakes anyone: where every other rank is right now.
                self.first = rank
                self.stacks = self._stacks(exclude=rank)

    def _stacks(self, exclude: int | None = None, only: int | None = None) -> dict[int, str]:
        from fakepg.schedule import current_frames  # See Note [Reading every thread's frame]

        frames = current_frames()
        out = {}
        for rank, ident in sorted(self.idents.items()):
            frame = frames.get(ident)
            if rank != exclude and only in (None, rank) and frame is not None:
                out[rank] = self._format(traceback.extract_stack(frame), collapse=True)
        return out

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        if not self.running or self.interrupted:
            raise KeyboardInterrupt  # before the ranks start, or a second Ctrl-C: at once
        self.interrupted = True
        stacks = self._stacks()
        lines = ["[launch] interrupted; where every rank is:"]
        for rank, stack in stacks.items():
            lines += [f"[launch] rank {rank}:", stack]
        lines.append("[launch] stopping every rank (Ctrl-C again to quit at once)")
        print("\n".join(lines), file=self.real_stderr, flush=True)
        # Not on this thread: a signal handler runs between any two bytecodes of the main
        # thread, which may hold the world's lock then. The ranks wake, and run() reports.
        reason = KeyboardInterrupt("the launch was interrupted (Ctrl-C)")
        self._interrupt = threading.Thread(
            target=self.world.abort, args=(reason,), name="launch-interrupt", daemon=True
        )
        self._interrupt.start()

    def _format(
        self,
        frames: traceback.StackSummary | list[traceback.FrameSummary],
        *,
        collapse: bool = False,
    ) -> str:
        """The frames from the script's own on, as a worker process would show them: the
        launcher's frames above the script and the per-rank generator mode's (every torch call
        passes through it) are left out. With ``collapse`` (unless --full-stacks), each run of
        library frames (torch, fakepg, the standard library) becomes one line: the stack reads
        as the script's."""
        frames = list(frames)
        start = next(
            (i for i, f in enumerate(frames) if not f.filename.endswith(_LAUNCHER_FILES)), 0
        )
        kept = [f for f in frames[start:] if not f.filename.endswith(_PLUMBING_FILES)]
        if not collapse or self.full_stacks:
            return "".join(traceback.format_list(kept)).rstrip("\n")
        out: list[str] = []
        hidden: list[traceback.FrameSummary] = []
        for frame in [*kept, None]:
            if frame is not None and _is_library(frame.filename):
                hidden.append(frame)
                continue
            if hidden:
                last = hidden[-1]
                out.append(
                    f"  ... {len(hidden)} frame(s) in libraries (innermost: {last.name} in "
                    f"{Path(last.filename).name}:{last.lineno})\n"
                )
                hidden = []
            if frame is not None:
                out.extend(traceback.format_list([frame]))
        return "".join(out).rstrip("\n")

    # ---------------------------------------------------------------------------------------
    # The report, as torchrun's, plus the stacks.

    def report(self, out: Any) -> int:
        failed = [r for r, o in enumerate(self.outcomes) if o.code not in (0, None)]
        never = [r for r, o in enumerate(self.outcomes) if o.code is None]
        if not failed and not never and not self.interrupted:
            return 0
        lines = []
        first = None if self.interrupted else self.first
        if first is not None:
            error = self.outcomes[first].error
            lines.append(f"[launch] rank {first} failed first: {_one_line(error)}")
            lines.append(f"[launch] where every rank was when rank {first} failed:")
            for rank in range(self.nproc):
                lines += self._where(rank, first)
        elif never:
            lines.append("[launch] where the ranks that did not stop are:")
            for rank in never:
                lines += self._where(rank, None)
        lines += [_RULE, f"{self.target.name} FAILED", _THIN, "Failures:"]
        others = [r for r in failed if r != first] + never
        if not others:
            lines.append("  <NO_OTHER_FAILURES>")
        for i, rank in enumerate(others, start=1):
            lines.append(f"  [{i}]: {self._describe(rank)}")
        lines += [_THIN, "Root Cause (first observed failure):"]
        if self.interrupted:
            root = "interrupted (Ctrl-C, SIGINT): the launch stopped every rank"
        else:
            root = self._describe(first) if first is not None else "none recorded"
        lines += [f"  [0]: {root}", _RULE]
        print("\n".join(lines), file=out, flush=True)
        return _INTERRUPTED if self.interrupted else 1

    # Note [A rank's stack at the first failure]
    # A stack taken from another thread is a snapshot of a moving target: a rank may be
    # returning from a collective that has just completed, and then fail on its next line
    # (the abort reaches it there). Its own traceback says where it really stopped, so a rank
    # that failed after the first shows that; the snapshot is kept for ranks that ended
    # without an error after it, and a rank that never ended shows where it is now.

    def _where(self, rank: int, first: int | None) -> list[str]:
        """Rank ``rank``'s part of "where every rank was". See Note [A rank's stack at the
        first failure]."""
        outcome = self.outcomes[rank]
        if rank == first and outcome.error is not None:
            tb = self._format(traceback.extract_tb(outcome.error.__traceback__), collapse=True)
            return [f"[launch] rank {rank} (failed here):", tb]
        if outcome.code is None:
            now = self._stacks(only=rank).get(rank, "  (no Python frames)")
            return [f"[launch] rank {rank} (did not stop; abandoned here):", now]
        if outcome.error is not None:
            tb = self._format(traceback.extract_tb(outcome.error.__traceback__), collapse=True)
            return [f"[launch] rank {rank} (stopped here after rank {first} failed):", tb]
        if rank in self.stacks:
            return [f"[launch] rank {rank} (then ended without error):", self.stacks[rank]]
        return [f"[launch] rank {rank}: had ended"]

    def _describe(self, rank: int) -> str:
        outcome = self.outcomes[rank]
        if outcome.code is None:
            return (
                f"rank {rank}: did not end: still running {2 * _STOP_GRACE_S:g} s after the "
                "abort (blocked in a C call such as time.sleep, or in a lock of its own), so the "
                "launch abandoned its thread"
            )
        return f"rank {rank}: exitcode {outcome.code}: {_one_line(outcome.error)}"


def _refuse_in_child(rank: int | None) -> Any:
    """The fake world's entry for every collective, in a forked child: refused, saying why."""

    def refuse(channel: Any, rank_: int, fingerprint: Any, *args: Any, **kwargs: Any) -> Any:
        what = f"torch.distributed {fingerprint.kind}"
        raise children.ChildCollectiveError(children.collective_message(rank, what))

    return refuse


def _library_dirs() -> tuple[str, ...]:
    """Where the frames folded in stacks live: the standard library, site-packages (torch),
    fakepg (wherever it is installed) and this launcher."""
    import fakepg

    paths = sysconfig.get_paths()
    here = Path(__file__).resolve().parent
    dirs = {paths["stdlib"], paths["purelib"], paths["platlib"], str(here)}
    dirs.add(str(here.parent / "check"))  # the replica check's hooks run inside optimizer.step
    dirs.add(str(Path(fakepg.__file__).resolve().parent))
    return tuple(os.path.join(d, "") for d in dirs)


_LIBRARY_DIRS = _library_dirs()


def _is_library(filename: str) -> bool:
    return os.path.abspath(filename).startswith(_LIBRARY_DIRS)


def _exit_code(exc: SystemExit, stderr: Any) -> int:
    """Python's exit status for ``sys.exit(code)``: a message is printed and counts as 1."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=stderr)
    return 1


def _is_world_stop(exc: BaseException) -> bool:
    """The fake world's stop, delivered to a rank computing after an abort (a BaseException
    private to fakepg.world, so that a script's ``except Exception`` does not swallow it)."""
    return not isinstance(exc, Exception) and type(exc).__module__ == "fakepg.world"


def _one_line(error: BaseException | None) -> str:
    if error is None:
        return "(no exception)"
    if _is_world_stop(error) or isinstance(error, process.RankExit):
        return str(error)
    if isinstance(error, SystemExit):
        return f"SystemExit({error.code!r})"
    first_line = str(error).strip().split("\n", 1)[0]
    return f"{type(error).__name__}: {first_line}"
