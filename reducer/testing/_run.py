"""Playing a :class:`~reducer.testing.scenario.TrainingScenario` on the fake world: one
thread per rank builds the model and the wrapper, runs the training step (the user's or the
default one) for every step, and records what the optimizer saw and what the rank holds
after each step.

# Guarantees: each rank thread writes only its own :class:`RankTrace`; ``errors`` is shared
# and guarded by its lock; the collective observer runs on the issuing rank's thread and
# records into that rank's trace only.
"""

from __future__ import annotations

import contextlib
import heapq
import io
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

import fakepg
import reducer

from . import _arguments
from .scenario import Batch, TrainingScenario

__all__: list[str] = []

Grads = list[Tensor | None]
# make_wrapper(module, pg, **scenario.options) -> the module to call forward on.
WrapperFactory = Callable[..., nn.Module]
# train_step(model, optimizer, batch, step): one training step of one rank.
TrainStep = Callable[[nn.Module, Any, Batch, int], object]
# An optimizer, built on each rank from the module's parameters (model order).
OptimizerFactory = Callable[[list[nn.Parameter]], Any]
# Kinds of collectives that write a reduction into their tensors.
_REDUCTIONS = frozenset({"allreduce", "reduce", "reduce_scatter", "allreduce_coalesced"})


def full(t: Tensor | None) -> Tensor | None:
    """A copy of ``t``, gathered in full if it is a DTensor (a collective: every rank calls
    it in the same order)."""
    if t is None:
        return None
    gather = getattr(t, "full_tensor", None)
    whole = gather() if gather is not None else t
    return whole.detach().clone(memory_format=torch.preserve_format)


def local(t: Tensor | None) -> Tensor | None:
    """A copy of what this rank holds of ``t``: its local shard if it is a DTensor (no
    collective), else all of it."""
    if t is None:
        return None
    to_local = getattr(t, "to_local", None)
    mine = to_local() if to_local is not None else t
    return mine.detach().clone(memory_format=torch.preserve_format)


class SGD:
    """``p.add_(p.grad, alpha=-lr)`` one parameter at a time: torch.optim.SGD's update without
    momentum (foreach=False), the same bits on a whole tensor and on a shard of it; lr = 0
    changes nothing (a lossy hook's error does not carry into later steps)."""

    def __init__(self, params: Sequence[Tensor], lr: float) -> None:
        self.params = list(params)
        self.lr = lr

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                # As torch.optim.Optimizer.zero_grad: a bucket view cannot be detached in place.
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    def step(self) -> None:
        if not self.lr:
            return
        with torch.no_grad():
            for p in self.params:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-self.lr)


@contextlib.contextmanager
def synced(model: nn.Module, mode: str, where: str) -> Iterator[None]:
    """Run a micro-batch with sync ``mode`` (see ``scenario.SYNC_MODES``) on ``model``."""
    if mode == "sync":
        yield
        return
    if mode == "no_sync":
        no_sync = getattr(model, "no_sync", None)
        if no_sync is None:
            raise ValueError(
                f"{where}: the scenario runs this micro-batch under no_sync(), which "
                f"{type(model).__qualname__} does not have; draw micro-batches without it"
            )
        with no_sync():
            yield
        return
    if not hasattr(model, "require_backward_grad_sync"):
        raise ValueError(
            f"{where}: the scenario sets require_backward_grad_sync=False for this micro-batch, "
            f"which {type(model).__qualname__} does not read; draw micro-batches without it"
        )
    setattr(model, "require_backward_grad_sync", False)  # noqa: B010 (an nn.Module attribute)
    try:
        yield
    finally:
        setattr(model, "require_backward_grad_sync", True)  # noqa: B010


def accumulate_by_hand(model: nn.Module, loss: Callable[[Any], Tensor], args: Any) -> None:
    """One micro-batch accumulated by hand, past the wrapper: the forward of its inner module
    (``model.module``, else ``model``), the gradients from ``torch.autograd.grad`` (which
    runs no gradient-accumulation hook, so the wrapper sees nothing), each added into its
    parameter's ``.grad`` (a new one laid out as the parameter, as autograd lays it out)."""
    inner = getattr(model, "module", None)
    module = inner if isinstance(inner, nn.Module) else model
    params = [p for p in module.parameters() if p.requires_grad]
    # None for a parameter this micro-batch leaves out (allow_unused).
    grads: Sequence[Tensor | None] = torch.autograd.grad(
        loss(module(*args)), params, allow_unused=True
    )
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            if g is None:
                continue
            if p.grad is None:
                p.grad = torch.empty_like(p).copy_(g)
            else:
                p.grad.add_(g)


def default_train_step(
    after_backward: Callable[[nn.Module], object] | None, set_to_none: bool
) -> TrainStep:
    """``zero_grad``; per micro-batch forward, loss, backward in its sync mode (or
    :func:`accumulate_by_hand`), then ``after_backward(model)`` after each synced one;
    ``optimizer.step()``."""

    def train_step(model: nn.Module, optimizer: Any, batch: Batch, step: int) -> None:
        optimizer.zero_grad(set_to_none=set_to_none)
        for m, (args, mode) in enumerate(zip(batch.micro_batches, batch.syncs, strict=True)):
            if mode == "by_hand":
                accumulate_by_hand(model, batch.loss, args)
                continue
            with synced(model, mode, f"step {step}, micro-batch {m}"):
                batch.loss(model(*args)).backward()  # type: ignore[no-untyped-call]
            if mode == "sync" and after_backward is not None:
                after_backward(model)
        optimizer.step()

    return train_step


@dataclass(slots=True)
class RankTrace:
    """What one rank did, per step it trained."""

    rank: int
    names: list[str]
    grads: list[Grads] = field(default_factory=list)  # what optimizer.step saw
    params: list[list[Tensor]] = field(default_factory=list)  # after the step
    buffers: list[dict[str, Tensor]] = field(default_factory=list)  # after the step, by name
    # The storages reductions wrote into, and the parameters' storages, per step.
    reduced: list[set[int]] = field(default_factory=list)
    param_storages: list[list[int]] = field(default_factory=list)
    # Per step, the parameter indices of each bucket a comm hook was handed (check_comm_hook).
    buckets: list[list[list[int]]] = field(default_factory=list)
    final: list[Tensor] = field(default_factory=list)  # after join's final sync
    rng: list[Tensor] = field(default_factory=list)  # with rank_seeds: the generator at the end
    step: int = 0  # the step running now
    stepped: int = 0  # optimizer.step calls in it


def _storage(t: Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # a DTensor or a fake tensor: no storage here
        return 0


def _record_steps(
    optimizer: Any,
    trace: RankTrace,
    params: Callable[[], Sequence[Tensor]],
    take: Callable[[Tensor | None], Tensor | None],
) -> None:
    """Wrap ``optimizer.step`` (on the instance) so that each call records the gradients it
    sees (as ``take`` copies them) and counts itself."""
    original = optimizer.step

    def step(*args: Any, **kwargs: Any) -> Any:
        trace.stepped += 1
        if trace.stepped == 1:
            trace.grads.append([take(p.grad) for p in params()])
        return original(*args, **kwargs)

    optimizer.step = step


def play(
    make_wrapper: WrapperFactory,
    s: TrainingScenario,
    *,
    setup: Callable[[nn.Module, reducer.ProcessGroup, RankTrace], None] | None,
    train_step: TrainStep | None,
    optimizer: OptimizerFactory | None,
    after_backward: Callable[[nn.Module], object] | None,
    timeout: float,
    schedule: fakepg.Schedule | None = None,
    shards: bool = False,
) -> list[RankTrace]:
    """Every rank's trace, in rank order; [] where every rank refused as ``s.refusal`` says.
    With ``shards``, what each rank holds of a sharded (DTensor) gradient or parameter is
    recorded (its local shard), not the gathered whole."""
    take = local if shards else full
    errors: dict[int, BaseException] = {}
    lock = threading.Lock()  # guards errors: each rank thread records its own failure
    step_fn = train_step or default_train_step(after_backward, s.set_to_none)

    def rank_fn(pg: fakepg.FakeProcessGroup) -> RankTrace:
        rank = pg.rank()
        model = s.make_model()
        trace = RankTrace(rank, [name for name, _ in model.named_parameters()])
        stop_observing = _observe(pg, trace)
        _registering.trace, _registering.timeout = trace, timeout
        try:
            if s.ignored:
                _ignore(model, s.ignored)
            wrapper = _arguments.built_wrapper(make_wrapper(model, pg, **s.options), make_wrapper)
            if shards:
                _arguments.sharded_wrapper(wrapper, model)
            if setup is not None:
                setup(wrapper, pg, trace)
            params = list(model.parameters())
            opt = optimizer(params) if optimizer is not None else SGD(params, s.lr)
            _arguments.built_optimizer(opt, "check_data_parallel: the optimizer= factory")
            held = [params]  # the parameters now (a reload replaces them)
            _record_steps(opt, trace, lambda: held[0], take)
            if s.rank_seeds is not None:
                torch.manual_seed(s.rank_seeds[rank])  # this rank thread's own generator
            joined = wrapper.join() if s.uneven else contextlib.nullcontext()  # type: ignore[operator]
            with joined:
                for step in range(s.steps):
                    if not s.trains(step, rank):
                        break
                    trace.step, trace.stepped = step, 0
                    trace.reduced.append(set())
                    trace.param_storages.append([_storage(p) for p in params])
                    step_fn(wrapper, opt, s.batch(step, rank), step)
                    if trace.stepped != 1:
                        raise RuntimeError(
                            f"rank {rank}, step {step}: the training step called "
                            f"optimizer.step() {trace.stepped} times; the check compares what "
                            "the optimizer sees and what each rank holds after it, so a "
                            "training step must call it exactly once"
                        )
                    trace.params.append([take(p) for p in params])  # type: ignore[misc]
                    trace.buffers.append(buffers_of(model))
                    if step == s.reload_after:
                        wrapper = _reloaded(wrapper)
                        model = wrapper.module  # type: ignore[assignment]
                        params = held[0] = list(model.parameters())
                        opt = SGD(params, s.lr)
                        _record_steps(opt, trace, lambda: held[0], take)
            trace.final.extend(take(p) for p in params)  # type: ignore[misc]
            if s.rank_seeds is not None:
                trace.rng.append(torch.get_rng_state())  # this rank thread's generator
        except Exception as exc:
            if not isinstance(exc, fakepg.FakePGError):
                with lock:
                    errors[rank] = exc
            raise
        finally:
            stop_observing()
            _registering.trace = None
        return trace

    try:
        with hooks_with_deadline():
            return fakepg.run_torch(rank_fn, s.world_size, timeout=timeout, schedule=schedule)
    except Exception as exc:
        if s.refusal is None:
            raise
        _assert_refused(errors, exc, s.refusal)
        return []


def _observe(pg: fakepg.FakeProcessGroup, trace: RankTrace) -> Callable[[], None]:
    """Record into ``trace`` the storages this rank's reductions write, by step."""
    observe = getattr(pg.world, "observe", None)
    if observe is None:
        return lambda: None
    me = pg.rank()

    def seen(rank: int, kind: str, members: object, tensors: list[Tensor], nbytes: int) -> None:
        if rank == me and kind in _REDUCTIONS and trace.reduced:
            trace.reduced[-1].update(_storage(t) for t in tensors)

    remove: Callable[[], None] = observe(seen)
    return remove


def _reloaded(wrapper: nn.Module) -> nn.Module:
    """``wrapper`` pickled with ``torch.save`` into memory and loaded back, as torch's own
    DDP tests do (a new wrapper, module and parameters; the same default group)."""
    buffer = io.BytesIO()
    torch.save(wrapper, buffer)
    buffer.seek(0)
    loaded: nn.Module = torch.load(buffer, weights_only=False)
    return loaded


def _ignore(model: nn.Module, names: frozenset[str]) -> None:
    """Tell any DDP wrapper to leave ``names`` alone, as torch's static method does (it marks
    the module and the tensors; this project's DDP reads the same marks)."""
    ddp = nn.parallel.DistributedDataParallel
    ddp._set_params_and_buffers_to_ignore_for_model(model, sorted(names))  # type: ignore[no-untyped-call]


def _assert_refused(
    errors: Mapping[int, BaseException], first: BaseException, pattern: str
) -> None:
    """Every rank that failed by itself raised an error matching ``pattern``."""
    if not errors:
        raise AssertionError(
            f"expected every rank to refuse with an error matching {pattern!r}; the world "
            f"failed with {type(first).__name__}: {first}"
        ) from first
    for rank, error in sorted(errors.items()):
        if not re.search(pattern, str(error)):
            raise AssertionError(
                f"rank {rank}: expected an error matching {pattern!r}, got "
                f"{type(error).__name__}: {error}"
            ) from error


def buffers_of(model: nn.Module) -> dict[str, Tensor]:
    """Copies of ``model``'s buffers by name, as they are now (a reassigned one included)."""
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def load_buffers(model: nn.Module, buffers: Mapping[str, Tensor]) -> None:
    for name, value in buffers.items():
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, value.clone())


class RankStreams:
    """Each rank's random stream, replayed on the calling thread: torch's default generator
    holds rank r's state while rank r's step runs (and its own state again afterwards)."""

    def __init__(self, seeds: Sequence[int] | None) -> None:
        self._states: list[Tensor] | None = None
        if seeds is not None:
            with torch.random.fork_rng(devices=[]):
                self._states = []
                for seed in seeds:
                    torch.manual_seed(seed)
                    self._states.append(torch.get_rng_state())

    def states(self) -> list[Tensor]:
        return [] if self._states is None else list(self._states)

    @contextlib.contextmanager
    def of(self, rank: int) -> Iterator[None]:
        if self._states is None:
            yield
            return
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._states[rank])
            yield
            self._states[rank] = torch.get_rng_state()


def _watched(
    hook: Callable[[Any, Any], torch.futures.Future[Tensor]],
    trace: RankTrace,
    module: nn.Module,
    timeout: float,
) -> Callable[[Any, Any], torch.futures.Future[Tensor]]:
    """``hook``, recording which parameters each bucket holds, its future failing after
    ``timeout`` seconds if the hook's own never completes (torch's DDP waits on it without a
    deadline)."""
    index = {id(p): i for i, p in enumerate(_module_of(module).parameters())}

    def watched(state: Any, bucket: Any) -> torch.futures.Future[Tensor]:
        step = trace.step
        while len(trace.buckets) <= step:
            trace.buckets.append([])
        members = [index.get(id(p), -1) for p in bucket.parameters()]
        trace.buckets[step].append(members)
        returned: object = hook(state, bucket)
        if not isinstance(returned, torch.futures.Future):
            # Not a future (a tensor, None): handed on as it is, so that the wrapper refuses it
            # with its own message, which names the hook and what it must return.
            return returned  # type: ignore[return-value]
        inner: torch.futures.Future[Tensor] = returned
        outer: torch.futures.Future[Tensor] = torch.futures.Future()
        lock = threading.Lock()  # one completion of outer: the relay or the timer

        def relay(f: torch.futures.Future[Tensor]) -> None:
            with lock:
                if outer.done():
                    return
                try:
                    value = f.value()
                except Exception as exc:  # the hook's own failure, passed on as it is
                    outer.set_exception(exc)  # type: ignore[arg-type]
                    return
                outer.set_result(value)

        def expire() -> None:
            error = TimeoutError(
                f"rank {trace.rank}, step {step}: the comm hook's future for bucket "
                f"{bucket.index()} (parameters {members}) did not complete within {timeout} s "
                "(a future the hook never completes, or a collective some rank never issued)"
            )
            with lock:
                if not outer.done():
                    outer.set_exception(error)  # type: ignore[arg-type]

        key = _DEADLINES.add(timeout, expire)
        outer.add_done_callback(lambda _: _DEADLINES.cancel(key))
        inner.add_done_callback(relay)
        return outer

    watched._watched = True  # type: ignore[attr-defined]
    watched.__annotations__ = dict(getattr(hook, "__annotations__", {}))
    watched.__name__ = getattr(hook, "__name__", "hook")
    watched.__qualname__ = getattr(hook, "__qualname__", "hook")
    return watched


class _Deadlines:
    """One thread for every watched hook's deadline (a thread per hook call would cost each
    example of a check more than its collectives): ``add(seconds, expire)`` calls ``expire``
    on that thread once the time is up, unless ``cancel`` came first. ``expire`` must not
    block. Started on first use; it exits when it has nothing left to wait for.

    # Guarantees: add and cancel are safe from any thread; _cond guards every field. A
    # cancelled entry drops its function at once (the heap keeps only its time and key).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int]] = []
        self._live: dict[int, Callable[[], None]] = {}
        self._count = 0
        self._running = False

    def add(self, seconds: float, expire: Callable[[], None]) -> int:
        with self._cond:
            self._count += 1
            key = self._count
            self._live[key] = expire
            heapq.heappush(self._heap, (time.monotonic() + seconds, key))
            if not self._running:
                self._running = True
                threading.Thread(target=self._run, name="hook-deadlines", daemon=True).start()
            elif self._heap[0][1] == key:
                self._cond.notify()  # a new earliest deadline
            return key

    def cancel(self, key: int) -> None:
        with self._cond:
            self._live.pop(key, None)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)  # cancelled
                if not self._heap:
                    self._running = False
                    return
                due, key = self._heap[0]
                now = time.monotonic()
                if due > now:
                    self._cond.wait(due - now)
                    continue
                heapq.heappop(self._heap)
                expire = self._live.pop(key)
            expire()


_DEADLINES = _Deadlines()


def _module_of(wrapper: nn.Module) -> nn.Module:
    inner = getattr(wrapper, "module", None)
    return inner if isinstance(inner, nn.Module) else wrapper


# The rank thread's trace and the check's timeout, for hooks registered on that thread.
_registering = threading.local()


@contextlib.contextmanager
def hooks_with_deadline() -> Iterator[None]:
    """While a check plays, every comm hook registered on a DDP wrapper (torch's or this
    project's) from a rank thread is watched: its buckets recorded, its future failed after
    the check's timeout (torch's reducer waits on it without a deadline). Process-wide: the
    checks run one at a time, as torch's default group is one per process."""
    classes: list[Any] = [nn.parallel.DistributedDataParallel, reducer.DistributedDataParallel]
    originals = [cls.register_comm_hook for cls in classes]

    def patched(original: Callable[..., Any]) -> Callable[..., Any]:
        def register_comm_hook(self: nn.Module, state: object, hook: Any) -> Any:
            trace: RankTrace | None = getattr(_registering, "trace", None)
            if trace is not None and not getattr(hook, "_watched", False):
                hook = _watched(hook, trace, self, _registering.timeout)
            return original(self, state, hook)

        return register_comm_hook

    for cls, original in zip(classes, originals, strict=True):
        cls.register_comm_hook = patched(original)
    try:
        yield
    finally:
        for cls, original in zip(classes, originals, strict=True):
            cls.register_comm_hook = original
