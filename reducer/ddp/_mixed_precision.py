"""DDP's native mixed precision (``mixed_precision=``), as torch's ``_MixedPrecision``.

The configuration names three dtypes, each optional: ``param_dtype`` (parameters and inputs
during forward and backward, so the computation), ``reduce_dtype`` (the allreduce; default:
``param_dtype``) and ``buffer_dtype`` (buffers, cast once at construction). Outside forward
and backward the parameters are full precision (checkpoints, the optimizer).

How, step for step as torch's DDP does it, so that the bits agree:

- construction: every parameter not ignored gets a :class:`Twin`: a ``param_dtype`` tensor
  with no storage yet (torch's ``_mp_param``) and its full-precision data (``_fp_param``);
  buffers are cast;
- each forward: each parameter's low twin gets storage and a copy of the full-precision
  values (a cast), an accumulated ``.grad`` is cast down too, and ``param.data`` becomes
  the low twin; floating-point inputs are cast to ``param_dtype``;
- backward: gradients arrive in ``param_dtype``. The reducer copies them into its buckets
  (full precision: a widening copy, exact) and calls :func:`allreduce_and_upcast`, a comm
  hook, which casts the bucket to ``reduce_dtype``, sums it over the ranks, divides by the
  world size in ``reduce_dtype`` (torch's hook divides after the sum), and puts each of the
  bucket's parameters back on its full-precision data, with its ``.grad`` widened; the
  reducer then writes the reduced values into those ``.grad``. Parameters that do not
  require a gradient go back to full precision when backward ends.

The bucket stays in full precision here where torch's is in ``param_dtype``: the widening
copy is exact and the cast to ``reduce_dtype`` rounds the same values, so the reduced bits
are torch's. Gradients are not bucket views under mixed precision (``.grad`` changes dtype
every iteration); the values are the same either way.

The twins live in the wrapper (a :data:`Twins` table), not in the parameters' ``__dict__``
as torch keeps them: ``torch.save`` pickles a parameter's ``__dict__``, and a low twin saved
with its storage freed cannot be loaded ("Trying to resize storage that is not resizable").
So ``torch.save(model)`` and ``torch.save(ddp)`` save full-precision parameters only, and
load anywhere; a reloaded wrapper makes its twins anew. torch's attributes are still read
as torch's tests and tools read them (``param._mp_param``, ``param._fp_param``): see Note
[Twins read as parameter attributes].

# Note [Twins read as parameter attributes]
# Each parameter with a twin becomes an instance of a subclass of nn.Parameter made for its
# wrapper, whose properties ``_mp_param`` and ``_fp_param`` read the wrapper's table (an
# ignored parameter has neither, as in torch). Nothing is added to the parameter's
# ``__dict__``, and nn.Parameter pickles as a plain Parameter (its ``__reduce_ex__`` rebuilds
# ``Parameter(data)``), so a checkpoint holds full-precision parameters and no twin; a copy
# (``copy.deepcopy``) has no entry in the table and so no attribute. The subclass changes
# nothing else: nn.Parameter's operations return plain tensors either way.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from reducer.comm_hook import GradBucket
from reducer.errors import InvalidArgument
from reducer.graph import at_backward_end
from reducer.process_group import ProcessGroup, ReduceOp

__all__: list[str] = []


class MixedPrecisionConfig(Protocol):
    """What the wrapper reads of torch's ``_MixedPrecision`` (or any object like it)."""

    param_dtype: torch.dtype | None
    reduce_dtype: torch.dtype | None
    buffer_dtype: torch.dtype | None


def check_config(config: object) -> MixedPrecisionConfig:
    """``config`` if it names floating-point dtypes where it names any; else a clear error
    that names the field (an integer ``reduce_dtype`` would otherwise fail only in the first
    backward, inside a comm hook the user never registered)."""
    for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        value = getattr(config, field, None)
        if not hasattr(config, field) or not (value is None or isinstance(value, torch.dtype)):
            raise InvalidArgument(
                "DistributedDataParallel: mixed_precision must be a "
                "torch.nn.parallel.distributed._MixedPrecision (param_dtype, reduce_dtype, "
                f"buffer_dtype: each a torch.dtype or None); {field} is "
                f"{'missing' if not hasattr(config, field) else repr(value)}"
            )
        if value is not None and not value.is_floating_point:
            raise InvalidArgument(
                f"DistributedDataParallel: mixed_precision.{field} is {value}, which is not a "
                "real floating-point dtype; gradients, parameters and buffers are cast to it. "
                f"Pass {field}=torch.float16, torch.bfloat16 or torch.float32 (or None)"
            )
        if value is not None and value not in _ARITHMETIC_DTYPES:
            raise InvalidArgument(
                f"DistributedDataParallel: mixed_precision.{field} is {value}, a storage-only "
                "floating-point dtype: torch has no addition or division in it (float8 and "
                f"float4 types hold values for scaled kernels), so {_USE[field]} cannot "
                f"happen in it. Pass {field}=torch.bfloat16, torch.float16 or torch.float32 "
                "(or None)"
            )
    return config  # type: ignore[return-value]


# The floating-point dtypes torch computes in (sums, divides, matmuls): the others (float8,
# float4) are storage formats that only scaled kernels read.
_ARITHMETIC_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_USE = {
    "param_dtype": "forward and backward",
    "reduce_dtype": "the gradients' reduction (a sum over the ranks, then a division)",
    "buffer_dtype": "the buffers' updates",
}


@dataclass(slots=True)
class Twin:
    """A parameter's two data tensors: ``low`` in ``param_dtype`` (storage only during
    forward and backward) and ``full``, its full-precision data."""

    low: Tensor
    full: Tensor


# Per parameter (by id: the wrapper holds the module, so the parameters outlive the table).
Twins = dict[int, Twin]


def _ignored(tensor: Tensor) -> bool:
    return bool(getattr(tensor, "_ddp_ignored", False))


def _twin_attributes(twins: Twins, base: type[nn.Parameter]) -> type[nn.Parameter]:
    """The subclass of ``base`` whose ``_mp_param`` and ``_fp_param`` read ``twins``. See
    Note [Twins read as parameter attributes]."""

    def twin_of(param: Tensor, name: str) -> Twin:
        twin = twins.get(id(param))
        if twin is None:  # a copy of a parameter, not the parameter itself
            raise AttributeError(f"this parameter has no {name}: it is not a wrapper's")
        return twin

    def low(param: Tensor) -> Tensor:
        """The low-precision twin (torch's name)."""
        return twin_of(param, "_mp_param").low

    def full(param: Tensor) -> Tensor:
        """The full-precision data (torch's name)."""
        return twin_of(param, "_fp_param").full

    def parameter_repr(param: Tensor) -> str:  # nn.Parameter's, not the subclass's name
        shown = param.detach().requires_grad_(param.requires_grad)
        return f"Parameter containing:\n{shown!r}"

    # A class statement: its name, module and docstrings are the statement's (type() took
    # them as values of its namespace, which mutation testing changes to no effect).
    class MixedPrecisionParameter(base):  # type: ignore[valid-type,misc]
        """A parameter of a mixed-precision wrapper, with torch's twin attributes."""

        _twin_base = base  # a second wrapper over the same module subclasses it again
        _mp_param = property(low)
        _fp_param = property(full)
        if base is nn.Parameter:  # a user's own Parameter subclass keeps its repr
            __repr__ = parameter_repr

    return MixedPrecisionParameter


def setup(config: MixedPrecisionConfig, module: nn.Module) -> Twins:
    """Give each parameter its low-precision twin and cast the buffers (construction)."""
    twins: Twins = {}
    classes: dict[type[nn.Parameter], type[nn.Parameter]] = {}
    for param in module.parameters():
        if _ignored(param):
            continue
        low = torch.zeros_like(param, dtype=config.param_dtype, requires_grad=param.requires_grad)
        low.untyped_storage().resize_(0)  # storage comes at each forward
        twins[id(param)] = Twin(low, param.data)
        if isinstance(param, nn.Parameter):
            # A user's own Parameter subclass stays its base.
            base = getattr(type(param), "_twin_base", type(param))
            if base not in classes:
                classes[base] = _twin_attributes(twins, base)
            param.__class__ = classes[base]
    if config.buffer_dtype is not None:
        for buffer in module.buffers():
            if not _ignored(buffer):
                buffer.data = buffer.to(dtype=config.buffer_dtype)
    return twins


def to_low_precision(config: MixedPrecisionConfig, module: nn.Module, twins: Twins) -> None:
    """Before forward: every parameter computes in ``param_dtype`` (torch's root copy)."""
    with torch.no_grad():
        for param in module.parameters():
            twin = twins.get(id(param))
            if twin is None:  # ignored
                continue
            low, full = twin.low, twin.full
            storage = low.untyped_storage()
            if storage.size() == 0:
                storage.resize_(low.numel() * low.element_size())
            low.copy_(full)  # a cast
            if param.grad is not None and config.param_dtype is not None:
                param.grad.data = param.grad.to(config.param_dtype)
            param.data = low


def cast_inputs(dtype: torch.dtype | None, inputs: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """Floating-point tensors among the inputs, cast to ``dtype`` (torch's
    ``_cast_forward_inputs``: nested containers too)."""
    if dtype is None:
        return inputs, kwargs
    from torch.distributed.utils import _cast_forward_inputs  # torch's own, not copied

    return _cast_forward_inputs(dtype, *inputs, **kwargs)


def to_full_precision(twins: Twins, params: Iterable[Tensor]) -> None:
    """Back on full-precision data, the gradient widened (after the bucket's reduction)."""
    for param in params:
        twin = twins.get(id(param))
        if twin is None:
            continue
        param.data = twin.full
        twin.low.untyped_storage().resize_(0)
        if param.grad is not None:
            param.grad.data = param.grad.to(twin.full.dtype)


class _Owner(Protocol):
    @property
    def mixed_precision(self) -> MixedPrecisionConfig | None: ...

    @property
    def module(self) -> nn.Module: ...

    _mp_twins: Twins


class UpcastState:
    """The state of :func:`allreduce_and_upcast`: the wrapper (weakly) and its group."""

    def __init__(self, owner: _Owner, group: ProcessGroup) -> None:
        self.owner = weakref.ref(owner)
        self.group = group
        self.end_queued = False


def allreduce_and_upcast(state: UpcastState, bucket: GradBucket) -> torch.futures.Future[Tensor]:
    """The comm hook mixed precision runs: reduce in ``reduce_dtype``, average, upcast.

    See the module docstring. The division follows the sum, in ``reduce_dtype``, as in
    torch's ``_reducer_allreduce_and_upcast_hook``.
    """
    owner = state.owner()
    assert owner is not None  # the hook runs during the wrapper's backward
    config = owner.mixed_precision
    assert config is not None  # the hook is registered only with a configuration
    buffer = bucket.buffer()
    reduce_dtype = config.reduce_dtype or config.param_dtype or buffer.dtype
    low = buffer.to(reduce_dtype)
    # Waited for here: the parameters go back to full precision only once it is done.
    state.group.allreduce([low], ReduceOp.SUM).wait()
    low.div_(state.group.size())
    to_full_precision(owner._mp_twins, bucket.parameters())
    if not state.end_queued:
        state.end_queued = True
        at_backward_end(lambda: _restore_frozen(state))
    result = buffer.copy_(low) if low is not buffer else buffer
    done: torch.futures.Future[Tensor] = torch.futures.Future()
    done.set_result(result)
    return done


def _restore_frozen(state: UpcastState) -> None:
    """Parameters without a gradient hook (frozen) go back to full precision at the end."""
    state.end_queued = False
    owner = state.owner()
    if owner is None:
        return
    to_full_precision(
        owner._mp_twins, (p for p in owner.module.parameters() if not p.requires_grad)
    )
