"""What each rank fed its data-parallel wrapper, and how: the evidence the same-training
verdict is judged from (see :mod:`._findings`).

Recorded on each rank's thread, from public observation points only: a global module forward
pre-hook (the wrappers' forwards: a fingerprint of their inputs, the batch size, torch's
generator state, the wrapped modules' BatchNorm and Dropout), optimizer step hooks (which
forward belongs to which step), ``Tensor.backward`` (the loss each micro-step backpropagates),
torch's loss functions in ``torch.nn.functional`` (their reduction and how many elements they
reduce), and ``DataLoader`` iteration (the dataset indices of every batch, its epoch, the
sampler, whether fetching a batch drew random numbers).

# Guarantees: one recorder installed at a time per process (the patches are process-wide).
# A RankEvidence is written only by its rank's thread (``rank_of`` says which rank a thread
# is; other threads are not recorded) and read by the verdict after every rank has ended.
"""

from __future__ import annotations

import functools
import hashlib
import math
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__: list[str] = []

_ACTIVE = threading.Lock()  # held while a recorder is installed

# torch.nn.functional losses: name -> how to count the elements a "mean" divides by.
_LOSSES = (
    "cross_entropy",
    "nll_loss",
    "mse_loss",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "binary_cross_entropy",
    "binary_cross_entropy_with_logits",
)


@dataclass(slots=True)
class ForwardEv:
    """One training forward of a data-parallel wrapper."""

    step: int  # optimizer steps this rank had taken before it
    micro: int  # training forwards of this rank since its last step, before it
    fingerprint: str | None  # hash of every tensor in the arguments (None: no tensor found)
    rows: int | None  # the first tensor argument's length (the local batch), if any
    rng: str  # hash of torch's generator state (this rank's) at the forward
    dropout: tuple[str, ...]  # active Dropout modules (p > 0, training)
    batchnorm: tuple[str, ...]  # BatchNorm modules in training mode that are not synced


@dataclass(slots=True)
class LossEv:
    """One call of a torch loss function whose result needs a gradient."""

    name: str
    reduction: str  # "mean", "sum", "none" or "weighted" (a mean by the weights' sum)
    count: int  # the elements a "mean" divides by
    value: float


@dataclass(slots=True)
class BackwardEv:
    """One ``loss.backward()`` of a scalar loss."""

    step: int
    micro: int  # backwards of this rank since its last step, before it
    value: float
    losses: list[LossEv]  # the loss functions called since the previous backward


@dataclass(slots=True)
class LoaderEv:
    """A DataLoader as a rank iterated it (once per epoch)."""

    order: int  # the how-many-th loader this rank iterated (matches loaders across ranks)
    sampler: str  # the sampler's class name
    num_replicas: int | None  # a DistributedSampler's
    rank: int | None
    shuffle: bool | None
    drop_last: bool | None
    dataset_len: int | None
    sampler_id: int = 0  # id() of the sampler: its set_epoch calls are in RankEvidence
    # epoch number -> the dataset indices of each batch fetched, in order
    epochs: list[list[tuple[int, ...] | None]] = field(default_factory=list)
    sampler_epochs: list[int | None] = field(default_factory=list)  # sampler.epoch per epoch
    trained: bool = False  # a training forward followed one of its batches


@dataclass(slots=True)
class FetchEv:
    """One batch fetched from a DataLoader."""

    loader: int  # LoaderEv.order
    epoch: int
    batch: int
    rng_before: str
    drew: bool  # fetching it moved torch's generator (random augmentation, sampling)


@dataclass
class RankEvidence:
    """What one rank did (see the module's docstring)."""

    rank: int
    steps: int = 0
    micro: int = 0
    backwards_in_step: int = 0
    stepping: int | None = None  # id of the optimizer whose step is under way
    forwards: list[ForwardEv] = field(default_factory=list)
    backwards: list[BackwardEv] = field(default_factory=list)
    pending: list[LossEv] = field(default_factory=list)
    amp: float = 1.0  # a GradScaler's factor on the loss about to be backpropagated
    loaders: dict[int, LoaderEv] = field(default_factory=dict)  # id(loader) -> evidence
    iterators: dict[int, tuple[Any, LoaderEv, int]] = field(default_factory=dict)
    fetches: list[FetchEv] = field(default_factory=list)
    last_fetch: FetchEv | None = None
    samplers: dict[int, list[int]] = field(default_factory=dict)  # id -> set_epoch values


def fingerprint(value: Any) -> str:
    """A hash of every tensor in ``value`` (nested tuples, lists, dicts), with shapes and
    dtypes: equal fingerprints mean equal inputs."""
    digest = hashlib.blake2b(digest_size=12)
    for tensor in _tensors(value):
        t = tensor.detach()
        digest.update(f"{tuple(t.shape)}{t.dtype}".encode())
        if not t.numel():
            continue
        if t.device.type == "cpu" and t.is_contiguous() and t.dtype in _NUMPY_DTYPES:
            digest.update(t.numpy().data)  # the fast path: the tensor's memory, no copy
        else:
            flat = t.to("cpu").contiguous().reshape(-1)
            digest.update(flat.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


_NUMPY_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.uint8}
)


def _tensors(value: Any) -> Iterator[Tensor]:
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, Mapping):  # dicts, and HF's BatchEncoding (a UserDict)
        for key in sorted(value, key=str):
            yield from _tensors(value[key])


def _safe_fingerprint(value: Any) -> str | None:
    """The fingerprint, or None where ``value`` holds no tensor or one that cannot be read
    (sparse, meta): the evidence never stops a run."""
    try:
        if next(_tensors(value), None) is None:
            return None
        return fingerprint(value)
    except Exception:  # see the docstring
        return None


def _rng() -> str:
    return hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=12).hexdigest()


def _wrapper_types() -> tuple[type[nn.Module], ...]:
    import reducer

    return (nn.parallel.DistributedDataParallel, reducer.DistributedDataParallel)


def _candidates(wrapper: nn.Module) -> list[tuple[str, nn.Module]]:
    """The wrapped model's Dropout modules and unsynced BatchNorms, named."""
    inner = getattr(wrapper, "module", wrapper)
    kinds = (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)
    return [
        (f"'{name}' ({type(module).__name__})" if name else type(module).__name__, module)
        for name, module in inner.named_modules()
        if isinstance(module, kinds) and not isinstance(module, nn.SyncBatchNorm)
    ]


def _modules_of(
    candidates: list[tuple[str, nn.Module]],
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Of the candidates, the active Dropout modules and the BatchNorms in training mode."""
    dropout, batchnorm = [], []
    for name, module in candidates:
        if not module.training:
            continue
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if module.p > 0:
                dropout.append(name)
        else:
            batchnorm.append(name)
    return tuple(dropout), tuple(batchnorm)


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    for tensor in _tensors((args, kwargs)):
        return int(tensor.shape[0]) if tensor.dim() else None
    return None


def _loss_count(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, int]:
    """The reduction of a loss call, and the elements its mean divides by."""
    reduction = kwargs.get("reduction", "mean")
    if kwargs.get("size_average") is not None or kwargs.get("reduce") is not None:
        return "legacy", 0
    tensors = [a for a in args if isinstance(a, Tensor)]
    source = tensors[0] if tensors else kwargs.get("input")
    target = tensors[1] if len(tensors) > 1 else kwargs.get("target")
    if name in ("cross_entropy", "nll_loss"):
        if kwargs.get("weight") is not None or (len(args) > 2 and args[2] is not None):
            return "weighted", 0
        if isinstance(target, Tensor) and not target.is_floating_point():
            ignore = kwargs.get("ignore_index", -100)
            return str(reduction), int((target != ignore).sum())
        if isinstance(target, Tensor) and isinstance(source, Tensor) and source.dim() > 1:
            return str(reduction), source.numel() // source.shape[1]
        return str(reduction), 1
    if isinstance(source, Tensor) and isinstance(target, Tensor):
        return str(reduction), int(max(source.numel(), target.numel()))
    return str(reduction), source.numel() if isinstance(source, Tensor) else 0


class Recorder:
    """Records :class:`RankEvidence` for ``world_size`` ranks while installed (a context
    manager); ``rank_of()`` says which rank the calling thread is (None: not a rank)."""

    def __init__(self, world_size: int, rank_of: Callable[[], int | None]) -> None:
        self.world_size = world_size
        self.rank_of = rank_of
        self.ranks = [RankEvidence(r) for r in range(world_size)]
        self._undo: list[Callable[[], None]] = []
        # id(wrapper) -> (the wrapper, held so that its id is not reused; its candidates)
        self._candidates: dict[int, tuple[nn.Module, list[tuple[str, nn.Module]]]] = {}

    def _current(self) -> RankEvidence | None:
        rank = self.rank_of()
        return None if rank is None or not 0 <= rank < self.world_size else self.ranks[rank]

    def __enter__(self) -> Recorder:
        if not _ACTIVE.acquire(blocking=False):
            raise RuntimeError("same-training evidence: another recorder runs in this process")
        try:
            self._install()
        except BaseException:
            self._uninstall()
            _ACTIVE.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._uninstall()
        finally:
            _ACTIVE.release()

    def _uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        original = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
        setattr(owner, name, make(original))
        self._undo.append(lambda: setattr(owner, name, original))

    # ---------------------------------------------------------------------------------------

    def _install(self) -> None:
        from torch.optim import optimizer as _optimizer
        from torch.utils.data import DataLoader, DistributedSampler
        from torch.utils.data import dataloader as _dataloader

        # The wrappers' forward methods, not a global module hook: a global hook sends every
        # module's call through torch's slow path.
        for wrapper in _wrapper_types():
            self._patch(wrapper, "forward", self._wrapper_forward)
        self._undo.append(_optimizer.register_optimizer_step_pre_hook(self._before_step).remove)
        self._undo.append(_optimizer.register_optimizer_step_post_hook(self._after_step).remove)
        self._patch(Tensor, "backward", self._backward)
        for name in _LOSSES:
            self._patch(F, name, functools.partial(self._loss, name))
        self._patch(DataLoader, "__iter__", self._loader_iter)
        self._patch(_dataloader._BaseDataLoaderIter, "__next__", self._loader_next)
        self._patch(DistributedSampler, "set_epoch", self._set_epoch)
        self._patch(torch.amp.GradScaler, "scale", self._amp_scale)

    def watch(self, module: nn.Module) -> None:
        """Record ``module``'s forwards as a wrapper's (a training step under test has no
        wrapper), until the recorder exits."""
        hook = module.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        self._undo.append(hook.remove)

    def _wrapper_forward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        def forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
            recorder._on_forward(module, args, kwargs)
            return original(module, *args, **kwargs)

        forward.__doc__ = original.__doc__
        return forward

    def _on_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        record = self._current()
        if record is None or not module.training or not torch.is_grad_enabled():
            return
        known = self._candidates.get(id(module))
        if known is None:  # once per wrapper: a model's modules are set before training
            known = self._candidates[id(module)] = (module, _candidates(module))
        candidates = known[1]
        dropout, batchnorm = _modules_of(candidates)
        record.forwards.append(
            ForwardEv(
                record.steps,
                record.micro,
                _safe_fingerprint((args, kwargs)),
                _rows(args, kwargs),
                _rng(),
                dropout,
                batchnorm,
            )
        )
        record.micro += 1
        if record.last_fetch is not None:
            for loader in record.loaders.values():
                if loader.order == record.last_fetch.loader:
                    loader.trained = True

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        record = self._current()
        if record is not None and record.stepping is None:
            record.stepping = id(optimizer)  # an optimizer inside it is not a step of its own

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        record = self._current()
        if record is not None and record.stepping == id(optimizer):
            self.end_step(record.rank)

    def end_step(self, rank: int) -> None:
        """Rank ``rank`` took an optimizer step: what follows is the next step's."""
        record = self.ranks[rank]
        record.stepping = None
        record.steps += 1
        record.micro = 0
        record.backwards_in_step = 0

    def _backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        def backward(self: Tensor, *args: Any, **kwargs: Any) -> Any:
            record = recorder._current()
            if record is not None and self.dim() == 0 and self.requires_grad:
                try:
                    value = float(self.detach()) / record.amp  # the loss before a GradScaler's
                except Exception:  # the evidence never stops a run
                    value = math.nan
                record.amp = 1.0
                record.backwards.append(
                    BackwardEv(record.steps, record.backwards_in_step, value, record.pending)
                )
                record.backwards_in_step += 1
                record.pending = []
            return original(self, *args, **kwargs)

        backward.__doc__ = original.__doc__
        return backward

    def _loss(self, name: str, original: Callable[..., Tensor]) -> Callable[..., Tensor]:
        recorder = self

        def loss(*args: Any, **kwargs: Any) -> Tensor:
            out = original(*args, **kwargs)
            record = recorder._current()
            if (
                record is not None
                and isinstance(out, Tensor)
                and out.requires_grad
                and out.dim() == 0
            ):
                try:
                    reduction, count = _loss_count(name, args, kwargs)
                    value = float(out.detach())
                except Exception:  # the evidence never stops a run
                    reduction, count, value = "unknown", 0, 0.0
                record.pending.append(LossEv(name, reduction, count, value))
            return out

        loss.__doc__ = original.__doc__
        loss.__wrapped__ = original  # type: ignore[attr-defined]
        return loss

    def _amp_scale(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        def scale(scaler: Any, outputs: Any) -> Any:
            scaled = original(scaler, outputs)
            record = recorder._current()
            if (
                record is not None
                and isinstance(outputs, Tensor)
                and isinstance(scaled, Tensor)
                and outputs.dim() == 0
                and outputs.device.type != "meta"
                and float(outputs.detach()) != 0
            ):
                record.amp = float(scaled.detach()) / float(outputs.detach())
            return scaled

        scale.__doc__ = original.__doc__
        return scale

    def _loader_iter(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        def __iter__(loader: Any) -> Any:
            iterator = original(loader)
            record = recorder._current()
            if record is not None:
                evidence = record.loaders.get(id(loader))
                if evidence is None:
                    evidence = _loader_evidence(loader, len(record.loaders))
                    record.loaders[id(loader)] = evidence
                sampler = getattr(loader, "sampler", None)
                evidence.epochs.append([])
                evidence.sampler_epochs.append(getattr(sampler, "epoch", None))
                # Strong reference: the id of a collected iterator could be reused.
                record.iterators[id(iterator)] = (iterator, evidence, len(evidence.epochs) - 1)
            return iterator

        return __iter__

    def _loader_next(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        def __next__(iterator: Any) -> Any:
            record = recorder._current()
            known = None if record is None else record.iterators.get(id(iterator))
            if record is None or known is None:
                return original(iterator)
            _, loader, epoch = known
            before = _rng()
            indices: list[Any] = []
            next_index = iterator._next_index

            def spy() -> Any:
                index = next_index()
                indices.append(index)
                return index

            iterator._next_index = spy
            try:
                batch = original(iterator)
            finally:
                del iterator._next_index
            got = indices[0] if indices else None
            try:
                batch_indices = _dataset_indices(getattr(iterator, "_dataset", None), got)
            except Exception:  # the evidence never stops a run
                batch_indices = None
            loader.epochs[epoch].append(batch_indices)
            fetch = FetchEv(loader.order, epoch, len(loader.epochs[epoch]) - 1, before, False)
            fetch.drew = _rng() != before
            record.fetches.append(fetch)
            record.last_fetch = fetch
            return batch

        return __next__

    def _set_epoch(self, original: Callable[..., Any]) -> Callable[..., Any]:
        recorder = self

        def set_epoch(sampler: Any, epoch: int) -> None:
            record = recorder._current()
            if record is not None:
                record.samplers.setdefault(id(sampler), []).append(int(epoch))
            original(sampler, epoch)

        return set_epoch


def _dataset_indices(dataset: Any, got: Any) -> tuple[int, ...] | None:
    """The batch's indices in the underlying dataset (through each ``Subset``: a
    hand-rolled split is a Subset per rank)."""
    from torch.utils.data import Subset

    if isinstance(got, int):
        got = [got]
    if not isinstance(got, (list, tuple)) or not all(isinstance(i, int) for i in got):
        return None
    indices = [int(i) for i in got]
    while isinstance(dataset, Subset):
        indices = [int(dataset.indices[i]) for i in indices]
        dataset = dataset.dataset
    return tuple(indices)


def _loader_evidence(loader: Any, order: int) -> LoaderEv:
    from torch.utils.data import DistributedSampler

    sampler: Any = getattr(loader, "sampler", None)
    try:
        dataset_len: int | None = len(loader.dataset)
    except TypeError:
        dataset_len = None
    distributed = isinstance(sampler, DistributedSampler)
    return LoaderEv(
        order,
        type(sampler).__name__,
        sampler.num_replicas if distributed else None,
        sampler.rank if distributed else None,
        sampler.shuffle if distributed else None,
        sampler.drop_last if distributed else None,
        dataset_len,
        id(sampler),
    )
