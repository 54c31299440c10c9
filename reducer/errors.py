"""The reducer's errors: one base, each subclass also the builtin a caller would catch.

Invalid arguments at construction are ``ValueError`` subclasses (an argument of the wrong
kind, such as a hook that is not callable, is also a ``TypeError``, as torch raises); misuse
during training (detected by the call that sees it) are ``RuntimeError`` subclasses. Every
message says what happened, which parameter (index and, where known, name), replica, bucket or
rank, the likely cause and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BucketAssignmentError",
    "InvalidArgument",
    "InvalidArgumentType",
    "InvalidModel",
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


class InvalidModel(InvalidArgument, RuntimeError):
    """The module given to ``DistributedDataParallel`` cannot be reduced as it is.

    No parameter requires grad, a parameter is not initialized, or the ranks hold different
    parameters (count, dtype, shape or strides). torch's DDP raises ``RuntimeError`` for
    these, so this is one too; and an :class:`InvalidArgument`, as every construction error
    here is.
    """


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


@dataclass(frozen=True, slots=True)
class Wording:
    """How errors raised during training name the caller's API.

    The reducer's state machine is the same whoever drives it, but its user is not: a
    Reducer's user calls ``prepare_for_backward`` and builds Reducers, a
    ``DistributedDataParallel`` user calls forward and passes constructor flags, and never
    heard of ``prepare_for_backward``. Each message takes its remedies from here.
    """

    owner: str  # what the user built: closed, failed, rebuilt
    starts_iteration: str  # the call that starts an iteration
    search_for_unused: str  # how to make unused parameters found, and what else to check
    found_unused_because: str  # why the search called a parameter unused
    no_search: str  # how to turn the search off
    no_static_graph: str  # how to turn static_graph off
    recover: str  # what to do once the ranks are out of step
    # expect_sparse_gradients came from the model's nn.Embedding / nn.EmbeddingBag(sparse=...)
    # modules, not from the user: layout errors point at the module instead of the flag.
    sparse_flags_from_modules: bool = False


REDUCER_WORDING = Wording(
    owner="Reducer",
    starts_iteration="prepare_for_backward",
    search_for_unused=(
        "Pass the forward outputs to prepare_for_backward so unused parameters are found "
        "(find_unused_parameters=True), or make every output take part in the loss. If you "
        "already pass the outputs, the loss depends on a tensor that is not among them."
    ),
    found_unused_because=(
        "its accumulator is not in the graph of the outputs given to prepare_for_backward"
    ),
    no_search="do not search for unused parameters (find_unused_parameters=False)",
    no_static_graph="Build the reducer with static_graph=False.",
    recover="close() this Reducer and build a new one (the model can be reused)",
)

DDP_WORDING = Wording(
    owner="DistributedDataParallel",
    starts_iteration="forward",
    search_for_unused=(
        "Construct DistributedDataParallel with find_unused_parameters=True so that unused "
        "parameters are found, and return from forward every output the loss uses. If "
        "find_unused_parameters=True already, the loss depends on a tensor that forward did "
        "not return."
    ),
    found_unused_because="the outputs forward returned do not depend on it",
    no_search="construct DistributedDataParallel with find_unused_parameters=False",
    no_static_graph="Construct DistributedDataParallel with static_graph=False.",
    recover=(
        "call close() on this DistributedDataParallel and wrap the model in a new one (the "
        "model can be reused)"
    ),
    sparse_flags_from_modules=True,
)
