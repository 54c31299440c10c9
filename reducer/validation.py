"""Validation of the reducer's constructor and call arguments (InvalidArgument, a ValueError).

Each check names the replica and parameter (index, and name where given) and says what to pass
instead, so that a misconfigured reducer fails at construction, not in the middle of backward.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import math
import numbers
import re
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .errors import InvalidArgument, InvalidArgumentType, describe_param

__all__: list[str] = []

# The longest wait Python's threading primitives accept (seconds); longer ones overflow.
_LONGEST_WAIT_S = threading.TIMEOUT_MAX


def check_timeout(timeout: object, where: str) -> float:
    """A timeout in seconds: a finite number > 0, or a ``datetime.timedelta`` (torch's type).

    Every wait in the project has a deadline, so infinity is refused rather than mapped to "no
    timeout"; torch refuses it too (``timedelta(seconds=inf)`` overflows).
    """
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise InvalidArgumentType(
            f"{where}: timeout must be a number of seconds (or a datetime.timedelta), got "
            f"{timeout!r} ({type(timeout).__name__}); pass e.g. timeout=300.0"
        )
    seconds = float(timeout)
    if math.isnan(seconds) or seconds <= 0:
        raise InvalidArgument(
            f"{where}: timeout must be > 0 seconds, got {timeout!r}; it bounds how long a wait "
            "may block, so pass a positive number of seconds, e.g. timeout=300.0"
        )
    if seconds > _LONGEST_WAIT_S:
        raise InvalidArgument(
            f"{where}: timeout must be a finite number of seconds (at most "
            f"{_LONGEST_WAIT_S:.0f}), got {timeout!r}; every wait needs a deadline so that a "
            "failed peer cannot hang this rank forever. Pass a large finite value instead, "
            "e.g. timeout=86400.0 to wait up to a day"
        )
    return seconds


def check_replicas(replicas: object, names: Sequence[str] | None = None) -> list[list[Tensor]]:
    """The replicas as lists; ``names`` (unchecked yet, may be None) name parameters in errors."""
    if isinstance(replicas, Tensor) or not isinstance(replicas, Sequence) or not replicas:
        raise InvalidArgument(
            "replicas must be a non-empty list of parameter lists, one per model replica "
            "(usually [list(model.parameters())])"
        )
    checked: list[list[Tensor]] = []
    seen: dict[int, tuple[int, int]] = {}
    for r, replica in enumerate(replicas):
        if isinstance(replica, Tensor) or not isinstance(replica, Sequence) or not replica:
            raise InvalidArgument(
                f"replica {r} must be a non-empty list of parameters, got {type(replica).__name__}"
            )
        params = list(replica)
        for i, p in enumerate(params):
            what = f"{describe_param(i, names)} of replica {r}"
            if not isinstance(p, Tensor):
                raise InvalidArgument(f"{what} is a {type(p).__name__}, not a tensor")
            if not p.requires_grad:
                raise InvalidArgument(
                    f"{what} does not require grad; pass only parameters that are trained "
                    "(filter with p.requires_grad)"
                )
            if not p.is_leaf:
                raise InvalidArgument(
                    f"{what} is not a leaf tensor (it has a grad_fn); pass the module's "
                    "parameters themselves, not tensors computed from them"
                )
            if id(p) in seen:
                r0, i0 = seen[id(p)]
                raise InvalidArgument(
                    f"{what} is the same tensor as {describe_param(i0, names)} of replica {r0}; "
                    "list each parameter once (shared parameters appear once in "
                    "module.parameters())"
                )
            seen[id(p)] = (r, i)
        checked.append(params)
    first = checked[0]
    for r, params in enumerate(checked[1:], start=1):
        if len(params) != len(first):
            raise InvalidArgument(
                f"replica {r} has {len(params)} parameters but replica 0 has {len(first)}; "
                "model replicas must have the same parameters"
            )
        for i, (p, q) in enumerate(zip(params, first, strict=True)):
            if p.shape != q.shape or p.dtype != q.dtype:
                raise InvalidArgument(
                    f"{describe_param(i, names)} of replica {r} is {p.dtype} {tuple(p.shape)} but "
                    f"replica 0 has {q.dtype} {tuple(q.shape)}; replicas must match in shape and "
                    "dtype"
                )
    return checked


def names_hint(names: object, replicas: object) -> Sequence[str] | None:
    """``param_names`` if it can name the parameters of ``replicas`` before either is checked
    (one string per parameter of the first replica); else None."""
    if isinstance(names, str) or not isinstance(names, Sequence):
        return None
    if not isinstance(replicas, Sequence) or not replicas:
        return None
    first = replicas[0]
    if isinstance(first, Tensor) or not isinstance(first, Sequence) or len(first) != len(names):
        return None
    return names if all(isinstance(n, str) for n in names) else None


def check_names(names: Sequence[str] | None, count: int) -> list[str] | None:
    if names is None:
        return None
    names = list(names)
    if len(names) != count or not all(isinstance(n, str) for n in names):
        raise InvalidArgument(
            f"param_names must be {count} strings, one per parameter, got {len(names)} entries"
        )
    return names


def check_sparse(
    expect: object, replicas: list[list[Tensor]], names: list[str] | None
) -> list[bool]:
    count = len(replicas[0])
    if expect is None:
        return [False] * count
    if not isinstance(expect, Sequence) or len(expect) != len(replicas):
        raise InvalidArgument(
            f"expect_sparse_gradients must have one list per replica ({len(replicas)})"
        )
    rows = []
    for r, row in enumerate(expect):
        if not isinstance(row, Sequence) or len(row) != count:
            raise InvalidArgument(
                f"expect_sparse_gradients[{r}] must have one bool per parameter ({count})"
            )
        rows.append([bool(x) for x in row])
    for r, row in enumerate(rows[1:], start=1):
        for i, (mine, first) in enumerate(zip(row, rows[0], strict=True)):
            if mine != first:
                raise InvalidArgument(
                    f"expect_sparse_gradients disagree for {describe_param(i, names)}: "
                    f"replica {r} says {mine}, replica 0 says {first}; replicas must agree"
                )
    return rows[0]


def check_process_group(process_group: object) -> int:
    size = getattr(process_group, "size", None)
    if not callable(size) or not callable(getattr(process_group, "allreduce", None)):
        raise InvalidArgument(
            f"process_group must implement reducer.ProcessGroup (size, allreduce, ...), got "
            f"{type(process_group).__name__}"
        )
    world_size = size()
    if not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgument(f"process_group.size() must be an int >= 1, got {world_size!r}")
    return world_size


def check_outputs(outputs: object) -> list[Tensor]:
    if isinstance(outputs, Tensor):
        return [outputs]
    if not isinstance(outputs, Sequence):
        raise InvalidArgument(
            f"prepare_for_backward takes a list of output tensors, got {type(outputs).__name__}"
        )
    checked = list(outputs)
    for i, t in enumerate(checked):
        if not isinstance(t, Tensor):
            raise InvalidArgument(
                f"prepare_for_backward: output {i} is a {type(t).__name__}, not a tensor; pass "
                "the tensors found in the forward's return value"
            )
    return checked


# What torch's DistributedDataParallel._check_comm_hook accepts as annotations, as source text
# (annotations that are strings, e.g. under ``from __future__ import annotations``, and cannot
# be evaluated are compared by their text).
_BUCKET_TEXT = re.compile(r"^([A-Za-z_][\w]*\.)*GradBucket$")
_FUTURE_TEXT = re.compile(r"^([A-Za-z_]\w*\.)*Future\[([A-Za-z_]\w*\.)*Tensor\]$")


def check_comm_hook(hook: object, grad_bucket_types: tuple[type, ...]) -> None:
    """Refuse what torch's ``register_comm_hook`` refuses, with torch's error types.

    A hook that is not callable is a TypeError; a ``bucket`` parameter annotated with anything
    but a GradBucket (ours, or ``torch.distributed.GradBucket`` for a hook written for torch),
    or a return annotated with anything but ``torch.futures.Future[torch.Tensor]``, is a
    ValueError. Unannotated hooks pass, as in torch. Messages begin with torch's own.
    """
    if not callable(hook):
        raise InvalidArgumentType(
            f"Communication hook must be callable. register_comm_hook got {hook!r} (a "
            f"{type(hook).__name__}); pass a function hook(state, bucket) -> "
            "torch.futures.Future[torch.Tensor], e.g. reducer.allreduce_hook"
        )
    name = getattr(hook, "__qualname__", None) or getattr(hook, "__name__", None) or repr(hook)
    try:
        signature = inspect.signature(hook)
    except (TypeError, ValueError):
        return  # a callable without a signature (a builtin): nothing to check
    # Annotations that cannot be evaluated here (names imported for type checking only) are
    # compared by their text.
    with contextlib.suppress(Exception):
        signature = inspect.signature(hook, eval_str=True)
    bucket = _bucket_parameter(signature)
    if bucket is not None and not _is_grad_bucket(bucket.annotation, grad_bucket_types):
        raise InvalidArgument(
            f"Communication hook: bucket annotation should be dist.GradBucket. The hook "
            f"{name!r} annotates its parameter {bucket.name!r} as {_show(bucket.annotation)}; "
            "annotate it as reducer.GradBucket (or torch.distributed.GradBucket), or not at all"
        )
    returned = signature.return_annotation
    if returned is not inspect.Signature.empty and not _is_future_of_tensor(returned):
        raise InvalidArgument(
            f"Communication hook: return annotation should be torch.futures.Future[torch.Tensor]. "
            f"The hook {name!r} is annotated to return {_show(returned)}; return the future of "
            "the reduced bucket buffer and annotate it as torch.futures.Future[torch.Tensor]"
        )


def _bucket_parameter(signature: inspect.Signature) -> inspect.Parameter | None:
    """The parameter named ``bucket`` (what torch checks), else the second positional one."""
    parameters = list(signature.parameters.values())
    for parameter in parameters:
        if parameter.name == "bucket":
            return parameter
    positional = [
        p
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    return positional[1] if len(positional) > 1 else None


def _is_grad_bucket(annotation: Any, grad_bucket_types: tuple[type, ...]) -> bool:
    if annotation is inspect.Parameter.empty:
        return True
    if isinstance(annotation, str):
        return bool(_BUCKET_TEXT.match(annotation.replace(" ", "")))
    return any(annotation is t for t in grad_bucket_types)


def _is_future_of_tensor(annotation: Any) -> bool:
    if isinstance(annotation, str):
        return bool(_FUTURE_TEXT.match(annotation.replace(" ", "")))
    return bool(annotation == torch.futures.Future[Tensor])


def _show(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__qualname__
    return repr(annotation)
