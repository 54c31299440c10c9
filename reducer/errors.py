"""The reducer's errors: one base, each subclass also the builtin a caller would catch.

Invalid arguments at construction are ``ValueError`` subclasses (an argument of the wrong
kind, such as a hook that is not callable, is also a ``TypeError``, as torch raises); misuse
during training (detected by the call that sees it) are ``RuntimeError`` subclasses. Every
message says what happened, which parameter (index and, where known, name), replica, bucket or
rank, the likely cause and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "BucketAssignmentError",
    "InvalidArgument",
    "InvalidArgumentType",
    "ReducerError",
    "ReductionError",
]


class ReducerError(Exception):
    """Base of every error the reducer raises on purpose."""


class InvalidArgument(ReducerError, ValueError):
    """An argument to a constructor or setup call is invalid (parameters, replicas, names)."""


class InvalidArgumentType(InvalidArgument, TypeError):
    """An argument of the wrong kind (a hook that is not callable, a timeout that is not a
    number): a ``TypeError``, as torch raises, and an :class:`InvalidArgument` as well."""


class BucketAssignmentError(InvalidArgument):
    """``bucket_indices`` is not a valid partition of the parameters."""


class ReductionError(ReducerError, RuntimeError):
    """Misuse during training: an unfinished reduction, a parameter ready twice, and so on."""


def describe_param(index: int, names: Sequence[str] | None) -> str:
    """``parameter 3 ('fc.weight')``, or ``parameter 3`` where no names were given."""
    if names is not None and 0 <= index < len(names):
        return f"parameter {index} ({names[index]!r})"
    return f"parameter {index}"


def describe_params(indices: Sequence[int], names: Sequence[str] | None, limit: int = 20) -> str:
    """Up to ``limit`` parameters described, then how many more."""
    shown = ", ".join(describe_param(i, names) for i in indices[:limit])
    if len(indices) > limit:
        shown += f" and {len(indices) - limit} more"
    return shown
