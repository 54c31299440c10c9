"""The reducer's errors: one base, each subclass also the builtin a caller would catch.

Invalid arguments at construction are ``ValueError`` subclasses (an argument of the wrong
kind, such as a hook that is not callable, is also a ``TypeError``, as torch raises); misuse
during training (detected by the call that sees it) are ``RuntimeError`` subclasses. Every
message says what happened, which parameter (index and, where known, name), replica, bucket or
rank, the likely cause and the fix. The messages of errors during training are built here
too, from the facts the reducer has and the remedies of the caller's :class:`Wording`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "BucketAssignmentError",
    "InvalidArgument",
    "InvalidArgumentType",
    "InvalidModel",
    "MixedBucketError",
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


class MixedBucketError(BucketAssignmentError, RuntimeError):
    """A bucket would hold parameters of different dtypes or devices. torch's reducer raises
    ``RuntimeError`` for it ("All parameters in a bucket must have the same dtype"), so this
    is one too; and a :class:`BucketAssignmentError`, as every invalid assignment here is."""


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


# -------------------------------------------------------------------------------------------
# What the reducer raises during training. Each builds the message from the facts the
# reducer has at the point of failure; the remedies come from the caller's Wording.


def closed_error(what: str, words: Wording) -> ReductionError:
    """``what`` was called on a closed reducer (or wrapper)."""
    return ReductionError(f"{what} on a closed {words.owner}; build a new {words.owner}")


def failed_error(what: str, words: Wording, failure: BaseException) -> ReductionError:
    """``what`` was called after an earlier iteration failed (``failure``)."""
    return ReductionError(
        f"{what}: this {words.owner} failed in an earlier iteration "
        f"({type(failure).__name__}: {failure}); the ranks are out of "
        f"step: {words.recover}"
    )


def unfinished_error(
    words: Wording,
    rank: int,
    ready: Sequence[Sequence[bool]],
    names: Sequence[str] | None,
    *,
    torch_text: str = "",
) -> ReductionError:
    """A new iteration started before the last one's reduction finished; ``ready`` (per
    replica and parameter) says which parameters got their gradient. ``torch_text``, where
    given, follows (torch's DDP's message: see torch_unfinished_text)."""
    error = _unfinished_error(words, rank, ready, names)
    if torch_text:
        error = ReductionError(f"{error}\n{torch_text}")
    return error


def torch_unfinished_text(
    rank: int, missing: Sequence[int], names: Sequence[str] | None, *, static: bool, searched: bool
) -> str:
    """torch's DDP's message for an unfinished reduction, whose phrases its tests and users'
    log searches look for; with the names this wrapper always has."""
    text = "Expected to have finished reduction in the prior iteration before starting a new one. "
    if static:
        text += (
            "This error indicates that your training graph has changed in this iteration, "
            "e.g., one parameter is used in first iteration, but then got unused in the "
            "second iteration. this is not compatible with static_graph set to True."
        )
    elif searched:
        text += (
            "Since `find_unused_parameters=True` is enabled, this likely means that not all "
            "`forward` outputs participate in computing loss. You can fix this by making sure "
            "all `forward` function outputs participate in calculating loss."
        )
    else:
        text += (
            "This error indicates that your module has parameters that were not used in "
            "producing loss. You can enable unused parameter detection by passing the "
            "keyword argument `find_unused_parameters=True` to "
            "`torch.nn.parallel.DistributedDataParallel`, and by making sure all `forward` "
            "function outputs participate in calculating loss."
        )
    text += (
        f"\nParameter indices which did not receive grad for rank {rank}: "
        f"{' '.join(map(str, missing))}"
    )
    if names is not None:
        text += (
            f"\nParameters which did not receive grad for rank {rank}: "
            f"{', '.join(names[i] for i in missing)}"
            "\nThere is no need to set the environment variable TORCH_DISTRIBUTED_DEBUG to "
            "either INFO or DETAIL to see which parameters did not receive gradient on this "
            "rank: they are named here."
        )
    return text


def _unfinished_error(
    words: Wording, rank: int, ready: Sequence[Sequence[bool]], names: Sequence[str] | None
) -> ReductionError:
    what = (
        f"{words.starts_iteration} started a new iteration before the previous one "
        "finished its reduction (Expected to have finished reduction in the prior "
        "iteration before starting a new one)"
    )
    per_replica = []
    for r, replica_ready in enumerate(ready):
        missing = [i for i, is_ready in enumerate(replica_ready) if not is_ready]
        if missing:
            prefix = f"replica {r}: " if len(ready) > 1 else ""
            per_replica.append(prefix + describe_params(missing, names))
    if not per_replica:
        return ReductionError(
            f"{what}: on rank {rank}, every parameter got its gradient, but the "
            "backward pass did not reach its end (it raised after the last gradient, or "
            "was interrupted), so the end-of-backward step that waits for the buckets and "
            f"writes .grad never ran. The ranks are out of step now: {words.recover}."
        )
    return ReductionError(
        f"{what}: on rank {rank}, these parameters never got a gradient: "
        f"{'; '.join(per_replica)}. They were not used to compute the loss, so their "
        f"buckets never launched. {words.search_for_unused}"
    )


def marked_twice_error(
    words: Wording,
    rank: int,
    names: Sequence[str] | None,
    replica_index: int,
    index: int,
    *,
    replicas: int,
    found_unused: bool,
) -> ReductionError:
    """A parameter got a second gradient in one iteration (or one after it was found
    unused): why that happens, and what to do, differ."""
    what = describe_param(index, names)
    where = f" of replica {replica_index}" if replicas > 1 else ""
    if found_unused:
        cause = (
            f"It was found unused ({words.found_unused_because}) and marked "
            "ready, then got a gradient anyway: it was used outside the forward pass, in "
            "a tensor not among the outputs, or inside reentrant activation checkpointing "
            "(which hides it from the search; use torch.utils.checkpoint with "
            "use_reentrant=False). Use it inside forward and return what depends on it, "
            f"or {words.no_search}."
        )
    else:
        cause = (
            "Its gradient hook fired twice in one backward pass. Either it is used in two "
            "reentrant activation checkpoints (or in one and outside it): each runs a "
            "backward of its own, so the parameter gets two gradients; use "
            "torch.utils.checkpoint(..., use_reentrant=False), or static_graph=True if "
            "the graph is the same every iteration. Or a second backward went through "
            "the same graph (retain_graph=True) before the reduction finished; call "
            "backward once per iteration (sum the losses first)."
        )
    return ReductionError(
        f"Expected to mark a variable ready only once: {what}{where} was marked ready "
        f"twice in one iteration on rank {rank}. {cause}"
    )


def not_static_error(
    words: Wording, rank: int, names: Sequence[str] | None, index: int, recorded: int
) -> ReductionError:
    """Static graph: a parameter got more hook calls than the ``recorded`` first iteration."""
    return ReductionError(
        f"{describe_param(index, names)} got more gradient hook calls in this "
        f"iteration than the {recorded} recorded in the first one, on rank {rank}; "
        "static_graph=True needs the same graph every iteration (the same parameters used "
        f"the same number of times). {words.no_static_graph} (Your training graph has "
        "changed in this iteration, e.g., one parameter is unused in first iteration, but "
        "then got used in the second iteration. this is not compatible with static_graph "
        "set to True.)"
    )


def static_graph_too_late_error(words: Wording, iterations: int) -> ReductionError:
    """``_set_static_graph`` after the first iteration started: nothing left to record."""
    return ReductionError(
        f"_set_static_graph() was called after the first iteration started (this "
        f"{words.owner} has run {iterations} synced iteration(s)); "
        "the first iteration records the graph, so call it right after "
        f"construction, before the first {words.starts_iteration}, or "
        f"build the {words.owner} with static_graph=True (set_static_graph() should be "
        "called before training loop starts and after DistributedDataParallel is "
        "constructed.)"
    )


def layout_error(
    words: Wording,
    rank: int,
    names: Sequence[str] | None,
    replica_index: int,
    index: int,
    *,
    expected: str,
) -> ReductionError:
    """A gradient whose layout (sparse or dense) is not the one its bucket was built for."""
    got = "dense" if expected == "sparse" else "sparse"
    what = (
        f"{describe_param(index, names)} got a {got} gradient but its bucket expects "
        f"a {expected} one, on rank {rank}"
    )
    if words.sparse_flags_from_modules:
        # The wrapper derives the flags from nn.Embedding / nn.EmbeddingBag(sparse=True).
        if got == "sparse":
            fix = (
                "Only the weights of nn.Embedding(sparse=True) and nn.EmbeddingBag("
                "sparse=True) are bucketed for sparse gradients, and this parameter is not "
                "one: compute its sparse gradient through such a module, or make it dense "
                "(sparse=False, e.g. in F.embedding)"
            )
        else:
            fix = (
                "It belongs to an nn.Embedding or nn.EmbeddingBag with sparse=True, but got "
                "a dense gradient: it is also used outside the module's lookup (weight "
                "tying, say). Build that module with sparse=False, or use its weight only "
                "through the lookup"
            )
    else:
        # A sparse gradient needs the flag set (a bucket of its own); a dense one, cleared.
        flag = "True" if got == "sparse" else "False"
        fix = (
            f"Pass expect_sparse_gradients[{replica_index}][{index}]={flag} (and bucket "
            "assignments computed with the same flags: a sparse gradient needs a bucket of "
            "its own). nn.Embedding(sparse=True) and nn.EmbeddingBag(sparse=True) give "
            "sparse gradients"
        )
    return ReductionError(f"{what}. {fix}.")


def view_replaced_error(index: int, names: Sequence[str] | None) -> ReductionError:
    """Bucket views: user code replaced a .grad, which would silently stop being reduced."""
    return ReductionError(
        f"{describe_param(index, names)}: its .grad was replaced by a "
        "tensor that is not its bucket view, but gradient_as_bucket_view=True "
        "reduces the bucket in place. Change .grad in place (zero_(), mul_(), "
        "copy_()) or set it to None (zero_grad(set_to_none=True)) instead."
    )


def comm_hook_raised_error(
    words: Wording, rank: int, hook: str, bucket_index: int, exc: BaseException
) -> ReductionError:
    """The comm hook ``hook`` (its name) raised for a bucket the other ranks wait for."""
    return ReductionError(
        f"the comm hook {hook!r} raised for bucket "
        f"{bucket_index} on rank {rank}: {type(exc).__name__}: {exc}. "
        "The ranks are out of step now; fix the hook, then "
        f"{words.recover}"
    )


def comm_hook_not_future_error(hook: str, bucket_index: int, returned: object) -> ReductionError:
    """The comm hook ``hook`` (its name) returned something other than a future."""
    return ReductionError(
        f"the comm hook {hook!r} returned a "
        f"{type(returned).__name__} for bucket {bucket_index}, not a "
        "torch.futures.Future; return the future of the reduction, e.g. "
        "work.get_future().then(lambda f: f.value()[0])"
    )


def hook_result_shape_error(
    bucket_index: int, result: tuple[int, ...], contents: tuple[int, ...]
) -> ReductionError:
    """The comm hook's future gave a tensor that does not fit the bucket's buffer."""
    return ReductionError(
        f"the comm hook returned a tensor of shape {result} for bucket "
        f"{bucket_index}, whose buffer has shape {contents}; return the "
        "reduced buffer (same shape), e.g. bucket.buffer() after copying into it"
    )


def joined_mid_iteration_error(words: Wording, rank: int) -> ReductionError:
    """A rank ran out of inputs between forward and backward."""
    return ReductionError(
        f"rank {rank} joined (ran out of inputs) in the middle of an "
        f"iteration: {words.starts_iteration} ran, but its backward did not; "
        "leave the join context only after a complete iteration"
    )
