"""What each rank did since its last optimizer step: which data-parallel wrappers ran their
forward and whether it armed a reduction, which collectives it issued, and each parameter's
local gradient as autograd accumulated it, before any reduction.

The observation points are all public: a global module forward pre-hook (every forward, so
the wrappers' and the first of each model's, where the gradient hooks get installed), a tensor
hook per parameter (it sees the gradient before it is accumulated, so before any reducer hook
ran: ``.grad`` plus it is the local accumulated gradient, bit for bit, as autograd adds it),
and the fake world's collective observer. ``no_sync`` is the one thing no hook shows (it only
flips ``require_backward_grad_sync``), so :func:`patched_no_sync` wraps the method of each
wrapper class for the duration of a check.

# Guarantees: a RankRecord is written by its rank's thread (forward, autograd and optimizer
# hooks run there: the fake world runs backward on the calling thread) and by the fake world's
# observer, which appends from whichever thread issues a collective (a comm hook's callback
# may run on a completion thread; list.append is atomic). It is read by the rendezvous' judge
# while its rank waits at the step.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__: list[str] = []

# Collectives that reduce (count towards "reductions per step").
REDUCTIONS = frozenset({"allreduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"})


def wrapper_types() -> tuple[type[nn.Module], ...]:
    """The data-parallel wrappers whose forward arms a reduction of every parameter."""
    import reducer

    return (nn.parallel.DistributedDataParallel, reducer.DistributedDataParallel)


@dataclass(slots=True)
class Forward:
    """One forward of a wrapper: did it arm a reduction, and if not, why not."""

    wrapper: nn.Module
    clock: int
    synced: bool
    why_not: str | None  # "no_sync", "require_backward_grad_sync" or "no_grad"
    backward: int = 0  # how many backwards of this rank had ended before it ran
    no_sync_after: bool = False  # a no_sync() block was entered after it, before any forward


@dataclass(slots=True)
class Issued:
    """One collective a rank issued."""

    clock: int
    kind: str
    members: tuple[int, ...]
    nbytes: int
    storages: frozenset[int]  # data pointers of the storages its tensors live in


@dataclass  # not slots: the gradient hooks hold it weakly
class RankRecord:
    """What one rank did since its last optimizer step (see the module's docstring)."""

    rank: int
    clock: int = 0  # orders forwards, accumulations and collectives of this rank
    forwards: list[Forward] = field(default_factory=list)
    collectives: list[Issued] = field(default_factory=list)
    # id(param) -> (the local accumulated gradient, the clock when autograd accumulated it).
    # The gradient only where the rank's last wrapper forward armed a reduction: that is the
    # one a reducer reduces; under no_sync it would be overwritten unread (the clock is kept).
    local: dict[int, tuple[Tensor | None, int]] = field(default_factory=dict)
    accumulated: dict[int, Tensor] = field(default_factory=dict)  # id(param) -> param
    # id(param) -> (id(.grad), its version) when the last backward ended, the reducers'
    # finalize included: a gradient changed since (clipping, unscaling) is not a reducer's.
    settled: dict[int, tuple[int, int]] = field(default_factory=dict)
    end_queued: bool = False  # a callback waits for the end of the current backward
    unscaled: bool = False  # a GradScaler unscaled gradients since the last step
    # Since the check began (not reset at steps):
    seen: dict[int, nn.Module] = field(default_factory=dict)  # every module run, first-seen order
    wrappers: dict[int, nn.Module] = field(default_factory=dict)  # every wrapper run on this rank
    backwards: int = 0  # backwards that accumulated a gradient and ended
    stepping: int | None = None  # id of the optimizer whose step is under way (see _check)
    # (step, caller line) of a step whose closure has not yet run (see _check's Note
    # [Steps that take a closure]).
    pending_before: tuple[int, str] | None = None
    _ignored: dict[int, frozenset[int]] = field(default_factory=dict)  # id(wrapper) -> ignored
    hooked: set[int] = field(default_factory=set)  # id(param) with a gradient hook
    handles: list[Any] = field(default_factory=list)
    no_sync_depth: dict[int, int] = field(default_factory=dict)  # id(wrapper) -> open blocks
    steps: int = 0  # optimizer steps begun
    active: bool = True
    # Per step, for the summary: (reductions, bytes) issued between two steps.
    reductions: list[tuple[int, int]] = field(default_factory=list)

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def reset(self) -> None:
        """After an optimizer step: what follows belongs to the next one."""
        count = sum(1 for c in self.collectives if c.kind in REDUCTIONS)
        nbytes = sum(c.nbytes for c in self.collectives if c.kind in REDUCTIONS)
        self.reductions.append((count, nbytes))
        self.forwards.clear()
        self.collectives.clear()
        self.local.clear()
        self.accumulated.clear()
        self.settled.clear()
        self.unscaled = False
        self.pending_before = None

    # ---------------------------------------------------------------------------------------

    def on_forward(self, module: nn.Module, wrappers: tuple[type[nn.Module], ...]) -> None:
        if id(module) not in self.seen:
            self.seen[id(module)] = module
            for param in module.parameters():
                if id(param) not in self.hooked and _plain(param) and param.requires_grad:
                    self.hooked.add(id(param))
                    hook = functools.partial(_on_gradient, weakref.ref(self), weakref.ref(param))
                    # torch leaves register_hook unannotated.
                    self.handles.append(param.register_hook(hook))  # type: ignore[no-untyped-call]
        if isinstance(module, wrappers):
            self.wrappers.setdefault(id(module), module)
            grad = torch.is_grad_enabled()
            synced = grad and bool(getattr(module, "require_backward_grad_sync", True))
            why = None
            if not grad:
                why = "no_grad"
            elif not synced:
                why = (
                    "no_sync"
                    if self.no_sync_depth.get(id(module))
                    else "require_backward_grad_sync"
                )
            self.forwards.append(Forward(module, self.tick(), synced, why, self.backwards))

    def on_collective(
        self, kind: str, members: tuple[int, ...], tensors: list[Tensor], nbytes: int
    ) -> None:
        if not self.active:
            return
        storages = frozenset(_storage(t) for t in tensors)
        self.collectives.append(Issued(self.tick(), kind, members, nbytes, storages))

    def backward_ended(self) -> None:
        self.end_queued = False
        self.backwards += 1
        for key, param in self.accumulated.items():
            grad = param.grad
            self.settled[key] = (0, -1) if grad is None else (id(grad), grad._version)

    def ignored_by(self, wrapper: nn.Module) -> frozenset[int]:
        """The ids of the parameters and buffers ``wrapper`` was told to leave alone
        (``_set_params_and_buffers_to_ignore_for_model``: neither broadcast nor reduced, so
        they may differ per rank by design). Both wrappers keep their names in
        ``parameters_to_ignore``."""
        found = self._ignored.get(id(wrapper))
        if found is None:
            names = set(getattr(wrapper, "parameters_to_ignore", ()) or ())
            module = getattr(wrapper, "module", wrapper)
            tensors = [
                *module.named_parameters(remove_duplicate=False),
                *module.named_buffers(remove_duplicate=False),
            ]
            found = frozenset(id(t) for name, t in tensors if name in names)
            self._ignored[id(wrapper)] = found
        return found

    def compared(self, stepped: list[Tensor]) -> tuple[list[Tensor], frozenset[int]]:
        """What the check compares at a step of an optimizer over ``stepped``: those, then
        every parameter of every wrapper run on this rank (frozen ones too: nothing reduces
        or steps them, so only the check sees one changed on some ranks), less what a wrapper
        ignores; and the ids of everything ignored."""
        ignored: frozenset[int] = frozenset()
        extra: list[Tensor] = []
        for wrapper in self.wrappers.values():
            ignored |= self.ignored_by(wrapper)
            extra.extend(wrapper.parameters())
        out: list[Tensor] = []
        taken: set[int] = set()
        for param in (*stepped, *extra):
            key = id(param)
            if key not in taken and key not in ignored:
                taken.add(key)
                out.append(param)
        return out, ignored

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.hooked.clear()
        self.active = False


def _on_gradient(
    record_ref: weakref.ref[RankRecord], param_ref: weakref.ref[Tensor], grad: Tensor
) -> None:
    """Before autograd accumulates ``grad`` into the parameter: the local accumulated gradient
    is ``.grad + grad`` (what AccumulateGrad computes), or a copy of ``grad``. A copy, because
    autograd may adopt ``grad`` itself as ``.grad`` and a reducer then overwrites it."""
    record, param = record_ref(), param_ref()
    if record is None or param is None or not record.active:
        return
    forwards = record.forwards
    local = None
    if not forwards or forwards[-1].synced:
        # Backward runs with gradients off (unless create_graph): no context to enter then.
        with torch.no_grad() if torch.is_grad_enabled() else contextlib.nullcontext():
            previous = param.grad
            if previous is None or previous.layout != grad.layout or previous.shape != grad.shape:
                local = grad.detach().clone()
            else:
                local = previous + grad
    record.local[id(param)] = (local, record.tick())
    record.accumulated[id(param)] = param
    if not record.end_queued:
        record.end_queued = True
        _at_end_of_backward(functools.partial(_backward_ended, record_ref))


def _backward_ended(record_ref: weakref.ref[RankRecord]) -> None:
    record = record_ref()
    if record is not None:
        record.backward_ended()


def _at_end_of_backward(fn: Callable[[], None]) -> None:
    """Call ``fn`` when the current backward ends, after every callback queued for its end so
    far (a reducer's finalize, queued when its first gradient hook ran): from a callback
    queued now, which queues ``fn`` (the engine runs callbacks queued while it runs them).
    The engine's queue_callback is private torch API, and the one way to run at the end of a
    backward; it is used here only."""
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(lambda: engine.queue_callback(fn))


def _plain(t: Tensor) -> bool:
    """A tensor whose data is all on this rank (not a DTensor shard)."""
    return type(t) in (Tensor, nn.Parameter)


def _storage(t: Tensor) -> int:
    try:
        return int(t.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return 0


def storage(t: Tensor | None) -> int:
    return 0 if t is None else _storage(t)


@contextmanager
def patched_unscale(record: Callable[[], RankRecord | None]) -> Iterator[None]:
    """While the check runs, ``GradScaler.unscale_`` tells the calling rank's record: it
    divides the gradients in place without bumping their versions, so no other trace shows
    that they are not the reducer's any more. The original is put back at the end."""
    cls = torch.amp.GradScaler
    original = cls.unscale_

    @functools.wraps(original)
    def unscale_(self: Any, optimizer: Any) -> None:
        rec = record()
        if rec is not None:
            rec.unscaled = True
        original(self, optimizer)

    cls.unscale_ = unscale_  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.unscale_ = original  # type: ignore[method-assign]


@contextmanager
def patched_no_sync(
    wrappers: tuple[type[nn.Module], ...], record: Callable[[], RankRecord | None]
) -> Iterator[None]:
    """While the check runs, each wrapper class's ``no_sync`` also tells the calling rank's
    record that a block is open (a forward in it is "under no_sync", not merely "with
    require_backward_grad_sync=False"), and marks a synced forward just before it (a block
    around the backward only, which does nothing). Monkeypatching a public method: no hook
    shows ``no_sync``; the originals are put back at the end."""
    originals = {cls: cls.__dict__.get("no_sync") for cls in wrappers}

    def make(original: Any) -> Any:
        @contextmanager
        def no_sync(self: nn.Module) -> Iterator[None]:
            rec = record()
            if rec is None:
                with original(self):
                    yield
                return
            if rec.forwards and rec.forwards[-1].wrapper is self and rec.forwards[-1].synced:
                rec.forwards[-1].no_sync_after = True
            rec.no_sync_depth[id(self)] = rec.no_sync_depth.get(id(self), 0) + 1
            try:
                with original(self):
                    yield
            finally:
                rec.no_sync_depth[id(self)] -= 1

        functools.update_wrapper(no_sync, original)
        return no_sync

    for cls, original in originals.items():
        if original is not None:
            setattr(cls, "no_sync", make(original))  # noqa: B010
    try:
        yield
    finally:
        for cls, original in originals.items():
            if original is not None:
                setattr(cls, "no_sync", original)  # noqa: B010
