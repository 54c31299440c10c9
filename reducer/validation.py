"""Validation of the reducer's constructor and call arguments (InvalidArgument, a ValueError).

Each check names the replica and parameter (index, and name where given) and says what to pass
instead, so that a misconfigured reducer fails at construction, not in the middle of backward.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

from .errors import InvalidArgument, describe_param

__all__: list[str] = []


def check_replicas(replicas: object) -> list[list[Tensor]]:
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
            what = f"parameter {i} of replica {r}"
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
                    f"{what} is the same tensor as parameter {i0} of replica {r0}; list each "
                    "parameter once (shared parameters appear once in module.parameters())"
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
                    f"parameter {i} of replica {r} is {p.dtype} {tuple(p.shape)} but replica 0 "
                    f"has {q.dtype} {tuple(q.shape)}; replicas must match in shape and dtype"
                )
    return checked


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
