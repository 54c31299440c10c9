"""The testing library's arguments, checked where they enter: misuse refused before any rank
starts, with an error that names the argument, what was given, what is expected and the fix.

A slip in a check's arguments otherwise surfaces far from its cause: an optimizer instance
where a factory is expected fails on a rank thread as "'SGD' object is not callable", a
model factory that builds different weights on each call as a gradient mismatch that blames
the wrapper. So each entry point (the checks, the references, the strategies) calls one of
these first, on the calling thread. What only a rank can build (the wrapper, the rank's
optimizer) is checked the moment the rank built it, before its first step.

Errors are :class:`reducer.errors.InvalidArgumentType` (a ``TypeError`` and a
``ValueError``) for an argument of the wrong kind, :class:`reducer.errors.InvalidArgument`
(a ``ValueError``) for a wrong value.
"""

from __future__ import annotations

import functools
import math
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from reducer.errors import InvalidArgument, InvalidArgumentType

__all__: list[str] = []

_OPTIMIZER_EXAMPLE = "lambda params: torch.optim.SGD(params, lr=0.1)"


def describe(value: object) -> str:
    """What ``value`` is, in a few words: "None", "an SGD instance", "a list [2, 4]", "a
    Tensor of shape (3, 4)"."""
    if value is None:
        return "None"
    if isinstance(value, Tensor):
        return f"a Tensor of shape {tuple(value.shape)} ({value.dtype})"
    if isinstance(value, type):
        return f"the class {value.__qualname__}"
    if isinstance(value, list | tuple | dict | set | frozenset | int | float | str | bool):
        text = repr(value)
        if len(text) > 60:
            text = text[:57] + "..."
        return f"{_article(type(value).__name__)} {type(value).__name__} {text}"
    if callable(value) and hasattr(value, "__qualname__"):
        return f"the function {value.__qualname__}"
    return f"{_article(type(value).__name__)} {type(value).__qualname__} instance"


def _article(word: str) -> str:
    """ "an" before a vowel sound: "an int", "an SGD" (an initialism, read letter by letter)."""
    initialism = word[:2].isupper()
    return "an" if word[:1].lower() in ("aefhilmnorsx" if initialism else "aeiou") else "a"


# -------------------------------------------------------------------------------------------
# Factories: callables the check calls once per rank (each rank needs its own object).


def factory(
    value: object, owner: str, name: str, *, makes: str, example: str, optional: bool = True
) -> None:
    """``owner``'s argument ``name`` must be a factory (a callable that builds ``makes``),
    not the object it would build: one object cannot serve every rank."""
    if value is None and optional:
        return
    built = isinstance(value, torch.optim.Optimizer | nn.Module)
    if callable(value) and not built:
        return
    raise InvalidArgumentType(
        f"{owner}: {name}= is {describe(value)}; expected a factory that builds {makes}, "
        f"called once per rank (every rank has a model of its own, so each needs its own): "
        f"pass {name}={example}"
    )


def optimizer_factory(value: object, owner: str, name: str, *, optional: bool = True) -> None:
    """An optimizer factory (``params -> optimizer``), not an optimizer."""
    example = _OPTIMIZER_EXAMPLE
    if isinstance(value, torch.optim.Optimizer):
        cls = type(value)
        qualified = cls.__qualname__
        if cls.__module__.startswith("torch.optim"):
            qualified = f"torch.optim.{qualified}"
        example = f"lambda params: {qualified}(params, ...) (with its options)"
    makes = "an optimizer from a rank's parameters"
    factory(value, owner, name, makes=makes, example=example, optional=optional)


def built_optimizer(result: object, argument: str) -> None:
    """What an optimizer factory returned must be an optimizer (``step`` and ``zero_grad``)."""
    if callable(getattr(result, "step", None)) and callable(getattr(result, "zero_grad", None)):
        return
    missing = "returned None" if result is None else f"returned {describe(result)}"
    hint = (
        ": a factory written as a def needs its return statement"
        if result is None
        else ", which has no step() and zero_grad()"
    )
    raise InvalidArgument(
        f"{argument} {missing}{hint}; expected the optimizer it built from the parameters "
        f"it was given, e.g. {_OPTIMIZER_EXAMPLE}"
    )


def _is_zero_redundancy(value: object) -> bool:
    """``value`` is torch's ``ZeroRedundancyOptimizer`` class or a partial of it."""
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    while isinstance(value, functools.partial):
        value = value.func
    return value is ZeroRedundancyOptimizer


_ZERO_FIX = (
    "Give zero_redundancy the plain optimizer that ZeroRedundancyOptimizer wraps (its "
    "optimizer_class, with its options), which the reference steps on whole models: "
    "reference=zero_redundancy(lambda params: torch.optim.Adam(params, lr=0.01)); the "
    "ZeroRedundancyOptimizer factory goes to the check's optimizer= (optimizer=lambda params: "
    "ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=0.01))"
)


def plain_optimizer_factory(value: object, owner: str, name: str, optional: bool) -> None:
    """A factory of a plain optimizer, for a reference: not torch's ZeroRedundancyOptimizer
    (it needs a process group; the reference's models have none)."""
    optimizer_factory(value, owner, name, optional=optional)
    if _is_zero_redundancy(value):
        raise InvalidArgument(
            f"{owner}: {name}= is torch's ZeroRedundancyOptimizer, which needs a process group, "
            f"while the reference steps plain models outside any. {_ZERO_FIX}"
        )


def reference_optimizer(
    make: Callable[[list[nn.Parameter]], Any], params: list[nn.Parameter], argument: str
) -> None:
    """Build the reference's optimizer once on ``params`` (a plain model's, on the calling
    thread, as the reference will): a factory that needs a process group, or returns no
    optimizer, is refused here, naming the argument, instead of after every rank has run."""
    try:
        built = make(params)
    except Exception as exc:
        if _needs_process_group(exc):
            zero = _raised_in(exc, "zero_redundancy_optimizer")
            what = (
                "builds torch's ZeroRedundancyOptimizer, which" if zero else "builds an object that"
            )
            raise InvalidArgument(
                f"{argument} {what} needs a process group ({type(exc).__name__}: {exc}); the "
                f"reference builds its optimizers on the calling thread, for plain models "
                f"outside any process group. {_ZERO_FIX}"
            ) from exc
        raise InvalidArgument(
            f"{argument} failed on a plain model's parameters, as the reference builds it "
            f"(on the calling thread, outside any process group): {type(exc).__name__}: {exc}"
        ) from exc
    built_optimizer(built, argument)


def _needs_process_group(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "process group" in text or "init_process_group" in text


def _raised_in(exc: BaseException, module_part: str) -> bool:
    return any(module_part in frame.filename for frame in traceback.extract_tb(exc.__traceback__))


def hook_state_factory(state: object) -> None:
    """``check_comm_hook(state=)``: a factory of each rank's state, not the state itself."""
    if state is None or (callable(state) and not isinstance(state, nn.Module)):
        return
    raise InvalidArgumentType(
        f"check_comm_hook: state= is {describe(state)}; expected a factory called on each "
        "rank with that rank's process group, returning the hook's state for that rank (a "
        "state holds one rank's data, such as PowerSGD's error feedback, so the ranks cannot "
        f"share one): pass state=lambda pg: {type(state).__qualname__}(...), building the "
        "state inside the factory"
    )


# -------------------------------------------------------------------------------------------
# Wrapper factories.


def built_wrapper(result: object, make_wrapper: object) -> nn.Module:
    """What ``make_wrapper`` returned on a rank: the module to train."""
    if isinstance(result, nn.Module):
        return result
    name = getattr(make_wrapper, "__qualname__", type(make_wrapper).__qualname__)
    hint = (
        ": a factory that wraps the module in place (as fully_shard does) must still return "
        "it, ending with `return module`"
        if result is None
        else ""
    )
    raise InvalidArgument(
        f"make_wrapper ({name}) returned {describe(result)}{hint}; expected the nn.Module each "
        "rank trains and calls forward on: the wrapper around the module it was given, or "
        "that module itself where it was wrapped in place"
    )


def sharded_wrapper(wrapper: nn.Module, module: nn.Module) -> None:
    """With a sharded reference (``fsdp2_shards()``), the wrapper must have sharded the
    module's parameters (DTensors, each rank holding its shard)."""
    if any(hasattr(p, "to_local") for p in module.parameters()):
        return
    raise InvalidArgument(
        f"reference=fsdp2_shards() compares each rank's shard of every parameter, but the "
        f"wrapper ({type(wrapper).__qualname__}) left the module's parameters whole (none is "
        "a DTensor): it does not shard. For a wrapper that replicates the parameters (DDP, "
        "your own), use the default reference (ddp_average()); to check FSDP2, use "
        "make_wrapper=fsdp2()"
    )


def mixed_precision_option(options: Mapping[str, Any], argument: str) -> None:
    """A ``mixed_precision=`` option whose dtypes DDP can compute and reduce in."""
    config = options.get("mixed_precision")
    if config is None:
        return
    from reducer.ddp._mixed_precision import check_config

    try:
        check_config(config)
    except InvalidArgument as exc:
        text = str(exc).removeprefix("DistributedDataParallel: ")
        raise InvalidArgument(f"{argument}: {text}") from None


# -------------------------------------------------------------------------------------------
# The scenario's model and inputs.


def deterministic_model(
    make_model: Callable[[], nn.Module], argument: str, *, spare: list[nn.Module] | None = None
) -> nn.Module:
    """Build the model twice (the calling thread's random stream left as it was): both must
    have the same parameters and buffers, bit for bit, since every rank and the reference
    build their own copy. Returns the first; the second is appended to ``spare`` (a copy the
    reference may use as one rank's plain model instead of building one more)."""
    if not callable(make_model):
        raise InvalidArgumentType(
            f"{argument} is {describe(make_model)}; expected a function that builds the "
            "model (called once per rank and once per reference copy), e.g. "
            "make_model=lambda: torch.manual_seed(0) and MyModel()"
        )
    with torch.random.fork_rng(devices=[]):
        first, second = make_model(), make_model()
    if not isinstance(first, nn.Module):
        raise InvalidArgument(
            f"{argument} returned {describe(first)}; expected an nn.Module (the model of one rank)"
        )
    one = [*first.named_parameters(), *first.named_buffers()]
    two = [*second.named_parameters(), *second.named_buffers()]
    if [n for n, _ in one] != [n for n, _ in two]:
        raise InvalidArgument(
            f"{argument} is not deterministic: two calls built models with different "
            f"parameters or buffers ({[n for n, _ in one]} and {[n for n, _ in two]}); every "
            "call must build the same model"
        )
    for index, ((name, a), (_, b)) in enumerate(zip(one, two, strict=True)):
        if a.shape == b.shape and a.dtype == b.dtype and _same_bits(a, b):
            continue
        kind = "parameter" if index < len(list(first.parameters())) else "buffer"
        raise InvalidArgument(
            f"{argument} is not deterministic: two calls built different values of {kind} "
            f"{index} ({name!r}). Every rank builds its own model and the reference replays "
            "each rank on a copy of its own, so every call must build the same weights (a "
            "gradient mismatch would follow, with no fault in the wrapper). Seed inside the "
            "factory: make_model=lambda: (torch.manual_seed(0), MyModel())[1], or copy fixed "
            "weights in (a torch.Generator seeded in the factory)"
        )
    if spare is not None:
        spare.append(second)
    return first


def _same_bits(a: Tensor, b: Tensor) -> bool:
    a, b = a.detach(), b.detach()
    if a.is_sparse or b.is_sparse:
        a, b = a.to_dense(), b.to_dense()
    if bool(torch.equal(a, b)):
        return True
    if not a.is_floating_point():
        return False
    # NaNs alike (an uninitialised buffer): compare the bits.
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return bool(torch.equal(a.contiguous().view(width), b.contiguous().view(width)))


def forward_arguments(args: object, where: str) -> None:
    """One forward's arguments: a tuple (or list) called as ``model(*args)``."""
    if isinstance(args, tuple | list):
        return
    example = "(x,)" if isinstance(args, Tensor) else "(x, mask)"
    raise InvalidArgumentType(
        f"{where} is {describe(args)}; expected the tuple of the forward's positional "
        f"arguments (the model is called as model(*args)): write {example} for a forward of "
        f"{'one tensor' if isinstance(args, Tensor) else 'its arguments'}"
    )


def scenario_inputs(inputs: object, *, micro_batches: bool) -> None:
    """``TrainingScenario.inputs[step][rank]``: a tuple of forward arguments (with
    ``micro_batches``, a tuple of them per micro-batch), or None. A tensor where a tuple is
    expected would be unpacked along its first dimension by ``model(*args)``."""
    if isinstance(inputs, Tensor) or not isinstance(inputs, tuple | list):
        raise InvalidArgumentType(
            f"TrainingScenario: inputs is {describe(inputs)}; expected one entry per step, "
            "each one entry per rank, each the tuple of that rank's forward arguments: "
            "inputs=(((x0,), (x1,)),) is one step of two ranks, rank r calling model(x_r)"
        )
    for k, step in enumerate(inputs):
        if isinstance(step, Tensor) or not isinstance(step, tuple | list):
            raise InvalidArgumentType(
                f"TrainingScenario: inputs[{k}] is {describe(step)}; expected one entry per "
                "rank (a tuple), each the tuple of that rank's forward arguments"
            )
        for rank, args in enumerate(step):
            if args is None:
                continue
            forward_arguments(args, f"TrainingScenario: inputs[{k}][{rank}]")
            for m, micro in enumerate(args if micro_batches else ()):
                forward_arguments(micro, f"TrainingScenario: inputs[{k}][{rank}][{m}]")


# -------------------------------------------------------------------------------------------
# Strategies' arguments and what they draw.


def strategy(value: object, owner: str, name: str, example: str) -> None:
    """``owner``'s argument ``name`` must be a Hypothesis strategy (or None)."""
    from hypothesis.strategies import SearchStrategy

    if value is None or isinstance(value, SearchStrategy):
        return
    raise InvalidArgumentType(
        f"{owner}: {name}= is {describe(value)}; expected a Hypothesis strategy that draws "
        f"it: {name}={example}"
    )


def drawn_count(value: object, argument: str, *, what: str, example: str) -> int:
    """A count a strategy drew (ranks, steps): an integer, 1 or more."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise InvalidArgument(
        f"{argument} drew {value!r}; expected {what}, an integer of 1 or more: draw from {example}"
    )


def count(value: object, argument: str, *, minimum: int) -> None:
    """An integer argument of at least ``minimum``."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= minimum:
        return
    raise InvalidArgument(f"{argument} is {value!r}; expected an integer of {minimum} or more")


def finite_scale(value: object, argument: str) -> float:
    """A loss scale: a finite real number (inf or NaN makes every gradient inf or NaN: no
    wrapper is at fault for what follows)."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise InvalidArgument(
        f"{argument} is {value!r}; expected a finite number: an infinite or NaN loss scale "
        "makes every gradient of that rank inf or NaN, and the check then fails for no fault "
        "of the wrapper. Scale by powers of two (exact), e.g. 2.0**-130 for denormals or "
        "2.0**14 for float16 sums that overflow"
    )


def scales(values: Sequence[object], argument: str) -> tuple[float, ...]:
    """Loss scales to draw from: at least one, each finite."""
    if isinstance(values, str | bytes) or not isinstance(values, Sequence) or not values:
        raise InvalidArgumentType(
            f"{argument} is {describe(values)}; expected a non-empty sequence of finite "
            "numbers, e.g. (1.0, 0.0, 2.0**-130, 2.0**14)"
        )
    return tuple(finite_scale(v, f"{argument}[{i}]") for i, v in enumerate(values))


def period_group_sizes(value: object, argument: str) -> dict[int, int]:
    """torch's ``period_group_size_dict``: periods (1 or more) mapped to group sizes."""
    example = "{2: 2, 4: 4} (within pairs every 2 steps, within groups of 4 every 4 steps)"
    if not isinstance(value, Mapping):
        raise InvalidArgumentType(
            f"{argument} is {describe(value)}; expected a mapping from each period to the "
            f"size of the groups averaged at that period, as torch's "
            f"HierarchicalModelAverager(period_group_size_dict): e.g. {example}"
        )
    if not value:
        raise InvalidArgument(f"{argument} is empty; expected at least one period, e.g. {example}")
    for period, size in value.items():
        for what, number in (("period", period), ("group size", size)):
            if not (isinstance(number, int) and not isinstance(number, bool) and number >= 1):
                raise InvalidArgument(
                    f"{argument} maps {period!r} to {size!r}: each {what} must be an integer "
                    f"of 1 or more; e.g. {example}"
                )
    return dict(value)


# -------------------------------------------------------------------------------------------
# The checks' entry: everything that can be known before a rank starts.


def hook(hook: object, state: object) -> None:
    """``check_comm_hook``'s hook (a callable ``hook(state, bucket) -> Future``) and state."""
    if not callable(hook) or isinstance(hook, nn.Module):
        raise InvalidArgumentType(
            f"check_comm_hook: hook is {describe(hook)}; expected a comm hook, a function "
            "hook(state, bucket) returning a torch.futures.Future of the reduced bucket, as "
            "register_comm_hook takes (e.g. torch's default_hooks.allreduce_hook)"
        )
    hook_state_factory(state)
